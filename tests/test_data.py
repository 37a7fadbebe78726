"""RolloutDataModule through Lightning on the chain task: on-policy iterations, budgets, exact
re-entry of branched prefixes, robustness to malformed actions, and resume state."""

import dataclasses
import functools
import itertools
import re

import lightning as L
import numpy as np
import pytest
import torch
from helpers.chain_fixtures import DATA, fit, make_data, make_module

from trace_lightning import allocation as alloc
from trace_lightning.data import RolloutDataModule
from trace_lightning.engines.base import Completion, EngineStats, ScriptedEngineBase
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.evaluation import EvalSettings
from trace_lightning.module import ModuleSettings


class Recorder(L.Callback):
    """Weights at each epoch end, and whether the first update of each epoch was exactly on-policy."""

    def __init__(self):
        self.end_fingerprints, self.first_ratio_exact, self.generated_with = [], [], []

    def on_train_epoch_start(self, trainer, module):
        self.generated_with.append(trainer.datamodule.report.policy_fingerprint)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:
            with torch.no_grad():
                logp, _ = module._batch_forward(module.policy, batch)  # the forward training_step runs
            keep = batch.loss_mask.bool()
            self.first_ratio_exact.append(bool(torch.equal(logp[keep], batch.old_logprobs[keep])))

    def on_train_epoch_end(self, trainer, module):
        self.end_fingerprints.append(module.weights_fingerprint())


def test_full_iterations_through_lightning_are_on_policy(tiny_model_dir):
    torch.manual_seed(0)
    # every step moves the weights, contrast or not, so that "training changed them" is checkable
    moving = ModuleSettings(hold_on_zero_gradient=False)
    module, data, rec = make_module(tiny_model_dir, settings=moving), make_data(), Recorder()
    fit(module, data, epochs=3, callbacks=[rec])
    # the batch of epoch k was sampled by the weights that epoch k-1 ended with
    assert rec.generated_with[1:] == rec.end_fingerprints[:-1]
    assert rec.generated_with[0] != rec.end_fingerprints[0]  # and training did change them
    assert rec.first_ratio_exact == [True, True, True]
    report = data.report
    assert report.iteration == 2 and data.collector.iteration == 3
    assert sum(len(t.leaves()) for t in report.result.trees) == report.result.ledger.leaves_used == 12


def test_real_rollout_trees_respect_leaf_and_token_budgets(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    for allocator in (alloc.uniform(4), alloc.trace(2, max_per_prompt=4), alloc.random_expand(2, 2)):
        data = make_data(allocator=allocator, max_tokens=150)
        data.build_iteration(module)
        res = data.report.result
        assert sum(len(t.leaves()) for t in res.trees) == 12
        assert res.ledger.tokens_used <= 150
        assert res.ledger.tokens_used == sum(len(n.action_ids) for t in res.trees for n in t.nodes)


class TestTokenBudget:
    """`budget.unit=tokens`: each iteration's leaves follow what the run's own leaves cost, and no
    iteration generates more than `budget.max_tokens`."""

    def test_the_leaves_follow_the_last_iterations_cost_per_leaf(self, tiny_model_dir):
        torch.manual_seed(0)
        module = make_module(tiny_model_dir)
        allocator = alloc.trace(2, max_per_prompt=4)
        step = allocator.leaf_step()
        assert step == 3  # 1 + N
        data = make_data(allocator, leaves=36, max_tokens=600, unit="tokens")
        seen = []
        for _ in range(3):
            data.build_iteration(module)
            ledger, counters = data.report.result.ledger, data.report.counters
            assert ledger.tokens_used <= 600 and ledger.leaves_used == ledger.budget.leaves
            bound = counters.stop_reasons.get("token_budget", 0) > 0 or counters.budget_bound_turns > 0
            seen.append((ledger.leaves_used, ledger.tokens_used, bound))
        assert seen[0][0] == 18  # nothing measured yet: half of budget.leaves (a multiple of 3)
        assert len({leaves for leaves, _, _ in seen}) > 1  # the leaves moved with the cost
        for (leaves, tokens, cut), (following, _, _) in itertools.pairwise(seen):
            # from the rule's words: after a bound iteration, one step fewer; else the most multiples of
            # the step that fit 90% of the budget at the last cost per leaf, at most 36
            expected = leaves - step if cut else min(36, int(0.9 * 600 * leaves / tokens) // step * step)
            assert following == max(step, expected)

    def test_a_closed_gate_plans_grpos_groups_of_4(self, tiny_model_dir):
        """While the skill gate is closed, trace under `budget.unit=tokens` plans whole groups of 4 every
        iteration, as `allocator=uniform` does (before, its step was 1 + N = 3, so it ran groups of 3
        and 4 where GRPO's are all 4)."""
        from trace_lightning.pricing import Pricing
        from trace_lightning.selection import Selection

        torch.manual_seed(0)
        module = make_module(tiny_model_dir)
        allocator = alloc.trace(2, max_per_prompt=4, group_size=4, pricing=Pricing())
        gate = Selection(explore_groups=1, explore_size=4, gate_skill=0.99)  # a bar the head will not clear
        data = make_data(allocator, leaves=36, max_tokens=500, unit="tokens", selection=gate)
        planned = []
        for _ in range(3):
            data.build_iteration(module)
            report = data.report
            counts = [int(m) for m in report.result.root_counts if m]
            assert not report.steered and set(counts) == {4}
            assert report.result.ledger.leaves == {"bare": 4 * len(counts), "expand": 0}
            planned.append(report.result.ledger.budget.leaves)
        assert planned[0] == 16 and len(set(planned)) > 1  # half of 36 in 4s, then the cost moves it

    def test_at_an_equal_token_budget_the_tree_method_gets_more_leaves_and_the_same_steps(
        self, tiny_model_dir
    ):
        """Continuations start mid-episode, so a trace leaf costs fewer generated tokens than a GRPO
        one: at the same tokens trace spends them on more leaves, with the same optimizer steps."""
        runs = {}
        for allocator, most in ((alloc.trace(2, max_per_prompt=4), 48), (alloc.uniform(4), 32)):
            torch.manual_seed(0)
            module = make_module(tiny_model_dir)
            data = make_data(allocator, leaves=most, max_tokens=500, unit="tokens")
            for _ in range(3):
                data.build_iteration(module)
                assert data.report.result.ledger.tokens_used <= 500
            runs[allocator.name] = (data.report.result.ledger.leaves_used, data.report.optimizer_steps)
        (trace_leaves, trace_steps), (uniform_leaves, uniform_steps) = runs["trace"], runs["uniform"]
        assert trace_leaves > uniform_leaves and trace_steps == uniform_steps == DATA.steps_per_iteration

    def test_a_budget_too_small_for_budget_leaves_is_spent_on_fewer_of_them(self, tiny_model_dir):
        torch.manual_seed(0)
        module = make_module(tiny_model_dir)
        data = make_data(alloc.uniform(4), leaves=24, max_tokens=60, unit="tokens")
        data.build_iteration(module)
        data.build_iteration(module)
        ledger = data.report.result.ledger
        assert ledger.tokens_used <= 60 and ledger.leaves_used < 24 and ledger.leaves_used % 4 == 0

    def test_unit_tokens_needs_max_tokens(self):
        with pytest.raises(alloc.BudgetError, match="budget.max_tokens"):
            alloc.Budget(12, None, "tokens")
        with pytest.raises(alloc.BudgetError, match="budget.unit"):
            alloc.Budget(12, 100, "episodes")

    def test_the_cost_estimate_resumes_with_the_datamodule(self, tiny_model_dir):
        torch.manual_seed(0)
        module = make_module(tiny_model_dir)
        data = make_data(alloc.trace(2, max_per_prompt=4), leaves=36, max_tokens=400, unit="tokens")
        data.build_iteration(module)
        state = data.state_dict()
        fresh = make_data(alloc.trace(2, max_per_prompt=4), leaves=36, max_tokens=400, unit="tokens")
        fresh.load_state_dict(state)
        assert fresh.collector._iteration_budget() == data.collector._iteration_budget()
        assert data.collector._spent is not None and fresh.collector._spent == data.collector._spent


class SpyEngine(HFEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return super().generate(prompts, params)


def test_branching_reenters_exact_prefix_tokens_and_env_state(tiny_model_dir):
    torch.manual_seed(1)
    module = make_module(tiny_model_dir)
    env = ChainEnv(n_tasks=24, turns=3, seed=0)
    seen_states = []
    real_step = env.step
    env.step = lambda task, state, text: (
        seen_states.append((task.task_id, state)),
        real_step(task, state, text),
    )[1]
    data = make_data(engine=functools.partial(SpyEngine, max_batch_size=16))
    data.collector.env = env
    data.build_iteration(module)
    trees = data.report.result.trees
    spy = data.collector.runner.engine
    expand_roots = [
        (t, n) for t in trees for n in t.nodes if n.stage == "expand" and t.nodes[n.parent].stage == "bare"
    ]
    assert expand_roots, "no continuation from a turn prefix was sampled"
    for tree, node in expand_roots:
        prefix = tree.token_ids(node.parent)
        assert prefix in spy.prompts  # the engine was given exactly the prefix's tokens
        assert (tree.task_id, tree.env_states[node.parent]) in seen_states  # and the env its state there
        assert tree.token_ids(node.id)[: len(prefix)] == prefix


class ScriptedEngine(ScriptedEngineBase):
    """Returns adversarial turns (as tokens of the real tokenizer) in a fixed cycle."""

    TEXTS = (
        "",
        "<choose>",
        "</choose>",
        "<choose></choose>",
        "<choose>ZZZ</choose>",
        "\x00\ufffd🙂" * 20,
        "<choose>" + "A" * 5000 + "</choose>",
        "<answer>A</answer>",
        "<choose>B</choose><choose>C</choose>",
    )

    def __init__(self, model, tokenizer):
        self.tokenizer, self.stats, self.i = tokenizer, EngineStats(), 0

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.tokenizer(self.TEXTS[self.i % len(self.TEXTS)], add_special_tokens=False)["input_ids"]
            self.i += 1
            out.append(Completion(ids, [0.0] * len(ids), "stop"))
        return out


def test_malformed_and_adversarial_actions_never_crash_a_rollout(tiny_model_dir):
    module = make_module(tiny_model_dir)
    data = make_data(engine=ScriptedEngine, allocator=alloc.uniform(4))
    batches = data.build_iteration(module)
    counters = data.report.counters
    assert batches and counters.format_errors > 0
    assert sum(counters.stop_reasons.values()) == 12
    assert np.isfinite(sum(module.training_step(b, 0).item() for b in batches))


def test_datamodule_state_dict_replays_the_next_iteration_exactly(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    first = make_data()
    first.build_iteration(module)  # move every generator past its start
    state = first.state_dict()
    first.build_iteration(module)
    expected = [(t.task_id, t.token_ids(leaf)) for t in first.report.result.trees for leaf in t.leaves()]
    resumed = make_data(seed=123)  # a different seed: everything must come from the state
    resumed.load_state_dict(state)
    resumed.build_iteration(module)
    got = [(t.task_id, t.token_ids(leaf)) for t in resumed.report.result.trees for leaf in t.leaves()]
    assert got == expected and resumed.collector.iteration == first.collector.iteration == 2


class StepCounter(L.Callback):
    """Optimizer steps per epoch (the Trainer's global step at each epoch's end)."""

    def __init__(self):
        self.at_epoch_end = []

    def on_train_epoch_end(self, trainer, module):
        self.at_epoch_end.append(trainer.global_step)


def test_uniform_and_trace_make_the_same_optimizer_steps_at_the_same_budget(tiny_model_dir):
    # Packed into micro-batches of 40 tokens, trace's trees (shared prefixes once) and uniform's groups
    # make different numbers of micro-batches; data.steps_per_iteration fixes the optimizer steps.
    settings = dataclasses.replace(DATA, micro_batch_tokens=40, steps_per_iteration=3)
    for name, allocator in {
        "trace": alloc.trace(expansion=2, max_per_prompt=4),
        "uniform": alloc.uniform(group_size=3),
    }.items():
        torch.manual_seed(0)
        module, data, steps = (
            make_module(tiny_model_dir),
            make_data(allocator, settings=settings),
            StepCounter(),
        )
        trainer = fit(module, data, epochs=2, callbacks=[steps])
        report = data.report
        assert report.optimizer_steps == 3 and steps.at_epoch_end == [3, 6], name
        assert trainer.accumulate_grad_batches == report.micro_batches_per_step


def test_split_seed_keeps_the_held_out_tasks_while_the_run_seed_changes():
    held = {s: make_data(held_out=6, seed=s).collector.held_out for s in (0, 1)}
    assert held[0] != held[1]  # the split follows the run's seed by default
    fixed = dataclasses.replace(DATA, split_seed=0)
    assert make_data(held_out=6, seed=1, settings=fixed).collector.held_out == held[0]


# --------------------------------------------------------------------------- the observers' face


def test_of_finds_the_rollout_datamodule_and_nothing_else():
    data = make_data()
    assert RolloutDataModule.of(L.Trainer(logger=False)) is None  # before `fit(datamodule=...)`
    assert RolloutDataModule.of(None) is None

    class Fitted:  # what `fit(datamodule=...)` leaves on a Trainer
        def __init__(self, datamodule):
            self.datamodule = datamodule

    assert RolloutDataModule.of(Fitted(data)) is data
    # a DataModule of another kind, even one with a `report`: observers then do nothing
    other = L.LightningDataModule()
    other.report = data.report
    assert RolloutDataModule.of(Fitted(other)) is None


class CountingProgress:
    """An `EpisodeProgress`: counts sampling episodes and records the bars it opens."""

    def __init__(self):
        self.sampled, self.bars = 0, []

    def episode_done(self):
        self.sampled += 1

    def episode_bar(self, description, total):
        bar = CountingBar(description, total)
        self.bars.append(bar)
        return bar


@dataclasses.dataclass
class CountingBar:
    description: str
    total: int
    n: int = 0
    closed: bool = False
    postfix: list = dataclasses.field(default_factory=list, compare=False)

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, text):
        self.postfix.append(text)

    def close(self):
        self.closed = True


def test_a_registered_progress_counts_sampling_and_evaluation_episodes(tiny_model_dir):
    torch.manual_seed(0)
    module, data, progress = make_module(tiny_model_dir), make_data(held_out=4), CountingProgress()
    data.progress = progress  # what console.IterationProgress does in `setup`
    data.build_iteration(module)
    assert progress.sampled == data.report.result.ledger.leaves_used > 0  # one call per episode
    result = data.evaluate(module, EvalSettings(samples=2), "evaluation after 1 iterations")
    assert result is not None and result.episodes == 8  # 4 held-out tasks x 2 episodes
    assert progress.bars == [CountingBar("evaluation after 1 iterations", 8, n=8, closed=True)]
    # batched episodes end together: the bar also says after each turn how many are still running
    turns = [tuple(int(w) for w in re.findall(r"\d+", text)) for text in progress.bars[0].postfix]
    assert [t for t, _ in turns] == list(range(1, len(turns) + 1)) and 1 < len(turns) <= DATA.max_turns
    running = [r for _, r in turns]
    assert running == sorted(running, reverse=True) and running[0] > 0 and running[-1] == 0
    sampled, data.progress = progress.sampled, None  # no display: the collector gets no hook
    data.build_iteration(module)
    assert data.evaluate(module, EvalSettings(samples=2), "unseen") is not None
    assert progress.sampled == sampled and len(progress.bars) == 1
