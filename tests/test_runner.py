"""Fault injection: environments that hang, raise or return garbage, generations that never stop or
are empty, non-finite losses and gradients, and batches with no contrast at all.

Every rollout test builds one real iteration on the tiny Qwen3 (scripted engine, so it is fast and
deterministic) and checks the same three things: the iteration completes and yields trainable
batches, each faulty episode is a failure (reward 0) with the named stop reason, and the counters
show it.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from helpers import quiet_trainer, rollout_data, trace_module

from trace_lightning import allocation as alloc
from trace_lightning.advantages import ESTIMATORS
from trace_lightning.batching import RolloutBatch
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import Completion, EngineStats, SamplingParams, ScriptedEngineBase
from trace_lightning.envs.base import Task, Transition, transition_problem
from trace_lightning.envs.calls import StepTimeout, call_with_timeout
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.iteration import Branch
from trace_lightning.losses import LossSettings, TokenMean, clipped_surrogate
from trace_lightning.module import ModuleSettings, NonFiniteTrainingError, TraceModule
from trace_lightning.runner import (
    TRUNCATION_MARK,
    EpisodeLimits,
    ReActRunner,
)

SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)
MAX_TURNS, MAX_EPISODE_TOKENS = 3, 96
LETTERS = tuple(f"<choose>{c}</choose>" for c in "ABCD")


# --------------------------------------------------------------------------- test doubles


class ScriptedEngine(ScriptedEngineBase):
    """Answers every prompt with the next text of a fixed cycle, tokenised by the real tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, texts: Sequence[str] = LETTERS) -> None:
        self.tokenizer, self.stats, self.i = tokenizer, EngineStats(), 0
        self.ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for _ in prompts:
            ids = self.ids[self.i % len(self.ids)][: params.max_new_tokens]
            self.i += 1
            out.append(Completion(list(ids), [0.0] * len(ids), "stop"))
        return out


class JunkEngine(ScriptedEngine):
    """Never emits a stop: always exactly `max_new_tokens` tokens of "x", the worst a policy can do."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        x, n = self.tokenizer("x", add_special_tokens=False)["input_ids"][0], params.max_new_tokens
        self.caps = [*getattr(self, "caps", []), n]
        return [Completion([x] * n, [0.0] * n, "length") for _ in prompts]


class EmptyEngine(ScriptedEngine):
    """Returns zero tokens for every prompt (an engine may, e.g. when EOS is sampled and stripped)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        return [Completion([], [], "eos") for _ in prompts]


class FaultyEnv(ChainEnv):
    """ChainEnv whose step is passed through `fault` whenever the policy's text matches `when`."""

    def __init__(self, fault: Callable[[Transition], Any], when: Callable[[str], bool] = bool) -> None:
        super().__init__(n_tasks=24, turns=3, seed=0)
        self.fault, self.when, self.faults = fault, when, 0

    def step(self, task: Task, state: tuple[int, int], action_text: str) -> Transition:
        tr = super().step(task, state, action_text)
        if not self.when(action_text):
            return tr
        self.faults += 1
        return self.fault(tr)  # type: ignore[no-any-return]


class LenientEnv(ChainEnv):
    """Never flags a format error itself, so only the runner can count an empty turn as one."""

    def step(self, task: Task, state: tuple[int, int], action_text: str) -> Transition:
        return Transition("<observation>ok</observation>", False, None, None, state)


class ConstantEnv(ChainEnv):
    """Two turns, then done with the same reward for every episode: all-success or all-failure."""

    def __init__(self, reward: float) -> None:
        super().__init__(n_tasks=24, turns=3, seed=0)
        self.reward = reward

    def step(self, task: Task, state: tuple[int, int], action_text: str) -> Transition:
        if state[0] == 0:
            return Transition("<observation>go on</observation>", False, None, None, (1, 0), tool="choose")
        return Transition("", True, self.reward, "answer", (2, 0), tool="choose")


# --------------------------------------------------------------------------- helpers


def make_module(model_dir: str, max_skipped_steps: int | None = 8) -> TraceModule:
    # weight_decay=0 as in conf/optimizer/adamw.yaml: with decay, AdamW moves weights even on zero grads
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    return trace_module(model_dir, optimizer, sampling=SAMPLING, settings=ModuleSettings(max_skipped_steps))


def build(
    module: TraceModule,
    env: ChainEnv,
    engine: type[ScriptedEngine] = ScriptedEngine,
    allocator: alloc.TreeAllocator | None = None,
    leaves: int = 8,
    estimator: str = "tree_grpo",  # a name in advantages.ESTIMATORS
    **runner_kw: Any,
) -> tuple[RolloutDataModule, list[RolloutBatch]]:
    """One iteration with these episode limits (the DataSettings fields)."""
    limits = {"max_turns": MAX_TURNS, "max_episode_tokens": MAX_EPISODE_TOKENS, **runner_kw}
    allocator = allocator or alloc.uniform(4)
    estimator_ = ESTIMATORS[estimator]()
    data = rollout_data(env, allocator, engine, SAMPLING, leaves, estimator=estimator_, pool_size=8, **limits)
    return data, data.build_iteration(module)


def leaves_of(data: RolloutDataModule) -> list[Any]:
    return [t.nodes[leaf] for t in data.report.result.trees for leaf in t.leaves()]


def assert_faulted(
    data: RolloutDataModule, batches: list[RolloutBatch], module: TraceModule, reason: str
) -> int:
    """The iteration completed and trains; every `reason` leaf failed and is counted. Returns how many."""
    leaves, counters = leaves_of(data), data.report.counters
    faulted = [n for n in leaves if n.stop_reason == reason]
    assert faulted, f"no episode ended with {reason}: the test is vacuous"
    assert all(n.reward == 0.0 for n in faulted)
    assert counters.stop_reasons[reason] == len(faulted)
    assert sum(counters.stop_reasons.values()) == len(leaves) == data.collector.budget.leaves
    assert batches and all(math.isfinite(module.training_step(b, 0).item()) for b in batches)
    return len(faulted)


@pytest.fixture
def module(tiny_model_dir: str) -> TraceModule:
    torch.manual_seed(0)
    return make_module(tiny_model_dir)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets abandoned hung steps finish when the test ends, so no thread outlives it for long."""
    event = threading.Event()
    yield event
    event.set()


# --------------------------------------------------------------------------- environment faults


def test_hanging_step_times_out_and_fails_only_its_episode(module: TraceModule, release: threading.Event):
    env = FaultyEnv(lambda tr: (release.wait(), tr)[1], when=lambda text: "B" in text)
    start = time.perf_counter()
    data, batches = build(module, env, step_timeout=0.2)
    n = assert_faulted(data, batches, module, "env_timeout")
    assert data.report.counters.env_timeouts == n == env.faults
    assert time.perf_counter() - start < 0.2 * n + 10  # each hang cost about its timeout
    assert any(leaf.stop_reason != "env_timeout" for leaf in leaves_of(data))  # the others went on


GARBAGE: list[tuple[str, Callable[[Transition], Any]]] = [
    ("none", lambda tr: None),
    ("dict", lambda tr: {"observation": "ok", "done": False}),
    ("nan_reward", lambda tr: replace(tr, done=True, reward=math.nan, stop_reason="answer")),
    ("inf_reward", lambda tr: replace(tr, done=True, reward=math.inf, stop_reason="answer")),
    ("reward_above_1", lambda tr: replace(tr, done=True, reward=1.5, stop_reason="answer")),
    ("negative_reward", lambda tr: replace(tr, done=True, reward=-0.1, stop_reason="answer")),
    ("no_reward_when_done", lambda tr: replace(tr, done=True, reward=None, stop_reason="answer")),
    ("string_reward", lambda tr: replace(tr, done=True, reward="1.0", stop_reason="answer")),
    ("bytes_observation", lambda tr: replace(tr, done=False, observation=b"<observation>")),
    ("none_observation", lambda tr: replace(tr, done=False, observation=None)),
    ("string_done", lambda tr: replace(tr, done="yes")),
    ("string_format_error", lambda tr: replace(tr, format_error="no")),
]


@pytest.mark.parametrize(("kind", "make"), GARBAGE, ids=[k for k, _ in GARBAGE])
def test_transition_problem_names_each_kind_of_garbage(kind: str, make: Callable[[Transition], Any]):
    good = Transition("<observation>right</observation>", False, None, None, (1, 0), tool="choose")
    assert transition_problem(good) is None
    assert transition_problem(replace(good, done=True, reward=np.float32(1.0), stop_reason="x")) is None
    assert transition_problem(make(good)) is not None


def test_garbage_transitions_end_episodes_as_env_invalid(module: TraceModule):
    kinds = itertools.count()
    env = FaultyEnv(lambda tr: GARBAGE[next(kinds) % len(GARBAGE)][1](tr))  # every step, every kind
    data, batches = build(module, env, leaves=12)
    n = assert_faulted(data, batches, module, "env_invalid")
    assert n == 12 == env.faults  # each episode failed on its first turn, one kind of garbage each
    assert len(data.report.counters.invalid_transitions) == n
    assert all(len(leaf.action_ids) > 0 for leaf in leaves_of(data))  # its turn is kept, as context


def test_huge_observation_is_truncated_and_counted(module: TraceModule):
    env = FaultyEnv(lambda tr: tr if tr.done else replace(tr, observation="<observation>" + "y" * 10**6))
    # room for 200 characters (~200 tokens here): this checks the character cut, not the token cut
    data, batches = build(module, env, max_observation_chars=200, max_episode_tokens=1024)
    counters = data.report.counters
    cut = [n for t in data.report.result.trees for n in t.nodes if n.obs_ids]
    assert counters.truncated_observations == len(cut) > 0
    for node in cut:  # the user turn holds the bounded text and the template, nothing more
        text = module.tokenizer.decode(node.obs_ids)
        assert TRUNCATION_MARK in text and text.count("y") == 200 - len("<observation>" + TRUNCATION_MARK)
    assert all(math.isfinite(module.training_step(b, 0).item()) for b in batches)
    assert not {"env_error", "env_invalid", "env_timeout"} & set(counters.stop_reasons)  # not a fault


def test_default_observation_bound_is_4000_chars(module: TraceModule):
    env = ChainEnv(n_tasks=4)
    runner = ReActRunner(ScriptedEngine(None, module.tokenizer), module.tokenizer, env, SAMPLING)
    assert len(runner._bounded("z" * 10**5)) == 4000 and len(runner._bounded("z" * 4000)) == 4000
    assert runner.counters.truncated_observations == 1


def test_failing_reward_function_is_env_error(module: TraceModule):
    def score_crash(tr: Transition) -> Transition:
        if tr.done:
            raise ZeroDivisionError("reward function divided by zero")
        return tr

    env = FaultyEnv(score_crash)
    data, batches = build(module, env)
    n = assert_faulted(data, batches, module, "env_error")
    assert len(data.report.counters.env_errors) == n
    assert all(e.startswith("ZeroDivisionError: reward function") for e in data.report.counters.env_errors)


@pytest.mark.parametrize("error", [MemoryError, RecursionError])
def test_step_out_of_memory_or_recursion_is_env_error(module: TraceModule, error: type[BaseException]):
    """A step that exhausts memory or the stack (a world grown without bound, a deeply nested
    argument) fails its episode, is recorded, and the iteration still trains."""

    def exhausted(tr: Transition) -> Transition:
        raise error("the step's world grew past what the process can hold")

    env = FaultyEnv(exhausted, when=lambda text: "B" in text)
    data, batches = build(module, env)
    n = assert_faulted(data, batches, module, "env_error")
    assert len(data.report.counters.env_errors) == n
    assert all(e.startswith(error.__name__) for e in data.report.counters.env_errors)


def test_episode_limits_are_checked_when_made():
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"data\.step_timeout"):
            EpisodeLimits(step_timeout=bad)
    with pytest.raises(ValueError, match=r"data\.max_observation_chars"):
        EpisodeLimits(max_observation_chars=0)
    with pytest.raises(ValueError, match=r"data\.max_turns"):
        DataSettings(max_turns=0)
    assert EpisodeLimits(step_timeout=None).step_timeout is None


def test_call_with_timeout_returns_raises_or_abandons(release: threading.Event):
    assert call_with_timeout(lambda: 7, 1.0) == 7 and call_with_timeout(lambda: 8, None) == 8
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["missing"], 1.0)
    start = time.perf_counter()
    with pytest.raises(StepTimeout):
        call_with_timeout(release.wait, 0.05)
    assert time.perf_counter() - start < 5


# --------------------------------------------------------------------------- generation faults


class HonestEngine(ScriptedEngine):
    """The scripted replies, with the finish reason a real engine gives: `length` when max_new_tokens
    cut the reply."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for _ in prompts:
            ids = self.ids[self.i % len(self.ids)]
            self.i += 1
            cut = len(ids) > params.max_new_tokens
            ids = ids[: params.max_new_tokens]
            out.append(Completion(list(ids), [0.0] * len(ids), "length" if cut else "stop"))
        return out


@pytest.mark.parametrize("spare", [1, -1], ids=["replies_fit", "replies_cut"])
def test_a_turn_counts_as_budget_bound_only_when_a_reply_ran_into_the_lowered_cap(
    module: TraceModule, spare: int
):
    """One turn for 8 episodes under a token budget of 8 * (reply + spare): the share lowers every
    reply's cap below max_new_tokens either way, but only when the replies do not fit (spare -1) did
    the budget cut anything, and only then may the token plan read the iteration as bound."""
    tok = module.tokenizer
    reply = len(tok(LETTERS[0], add_special_tokens=False)["input_ids"])
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == reply for t in LETTERS)
    assert reply + spare < SAMPLING.max_new_tokens  # the premise: the share lowers the cap
    env = ChainEnv(n_tasks=8, turns=3, seed=0)
    limits = EpisodeLimits(max_turns=1, max_episode_tokens=MAX_EPISODE_TOKENS)
    runner = ReActRunner(HonestEngine(None, tok), tok, env, SAMPLING, limits)
    ledger = BudgetLedger(Budget(8, 8 * (reply + spare)))
    ledger.reserve_leaves(8, "bare")
    trees = [runner.new_tree(t) for t in list(runner.tasks)[:4]]
    runner([Branch(t, 0, 2, "bare") for t in trees], ledger, np.random.default_rng(0))
    counters = runner.take_counters()
    assert ledger.tokens_used == 8 * min(reply, reply + spare)
    assert counters.budget_bound_turns == (1 if spare < 0 else 0)


def test_generation_that_never_stops_hits_length_cap(module: TraceModule):
    env = LenientEnv(n_tasks=24, turns=3, seed=0)  # short replies, so episodes take several turns
    data, batches = build(module, env, JunkEngine, max_turns=50)
    n = assert_faulted(data, batches, module, "length_cap")
    assert n == data.collector.budget.leaves  # every episode, whatever the turn count allows
    assert data.report.counters.turns > n  # several turns each, every one a full max_new_tokens of junk
    assert max(data.collector.runner.engine.caps) == SAMPLING.max_new_tokens
    for tree in data.report.result.trees:
        for leaf in tree.leaves():  # each one stopped once it had used its token allowance
            path = [tree.nodes[i] for i in tree.path(leaf)]
            assert sum(len(p.action_ids) + len(p.obs_ids) for p in path) >= MAX_EPISODE_TOKENS


def test_empty_completions_are_format_errors_and_batch_cleanly(module: TraceModule):
    env = LenientEnv(n_tasks=24, turns=3, seed=0)
    data, batches = build(module, env, EmptyEngine, allocator=alloc.trace(2, max_per_prompt=4), leaves=12)
    counters = data.report.counters
    assert counters.format_errors == counters.turns > 0
    n = assert_faulted(data, batches, module, "turn_cap")
    assert n == 12 and all(not node.action_ids for t in data.report.result.trees for node in t.nodes)
    assert all(int(b.loss_mask.sum()) == 0 for b in batches)  # nothing to train, and no NaN from it


# --------------------------------------------------------------------------- non-finite loss and grads


class Probe(L.Callback):
    """Optionally poisons batches; records the skip metrics and whether each step moved the weights."""

    def __init__(self, poison: Callable[[int], bool] = lambda i: False) -> None:
        self.poison, self.skipped, self.skipped_grad, self.moved, self.trained_tokens = poison, [], [], [], []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.before = [p.detach().clone() for p in module.parameters()]
        self.trained_tokens.append(int(batch.loss_mask.sum()))
        if self.poison(batch_idx):
            batch.advantages.fill_(math.nan)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
        metrics = trainer.callback_metrics
        self.skipped.append(float(metrics["train/skipped_nonfinite"]))
        self.skipped_grad.append(float(metrics["train/skipped_nonfinite_grad"]))
        self.moved.append(
            any(not torch.equal(a, b) for a, b in zip(self.before, module.parameters(), strict=True))
        )


def fit(module: TraceModule, data: RolloutDataModule, probe: Probe) -> L.Trainer:
    trainer = quiet_trainer(accumulate_grad_batches=1, callbacks=[probe])
    trainer.fit(module, datamodule=data)
    return trainer


def chain_data(
    leaves: int = 12, env: ChainEnv | None = None, estimator: str = "tree_grpo"
) -> RolloutDataModule:
    env = env or ChainEnv(n_tasks=24, turns=3, seed=0)
    return rollout_data(
        env,
        alloc.uniform(4),
        ScriptedEngine,
        SAMPLING,
        leaves,
        estimator=ESTIMATORS[estimator](),
        pool_size=8,
        max_turns=MAX_TURNS,
        max_episode_tokens=MAX_EPISODE_TOKENS,
        steps_per_iteration=None,  # one optimizer step per micro-batch: these tests check every step
    )


@pytest.mark.filterwarnings("ignore:.*returned `None`")
def test_nan_loss_skips_the_update_and_is_logged(module: TraceModule):
    probe = Probe(poison=lambda i: i == 0)  # the first of three steps has NaN advantages everywhere
    trainer = fit(module, chain_data(), probe)
    assert probe.trained_tokens[0] > 0  # the NaN reached trained tokens, so the loss was NaN
    assert probe.skipped == [1.0, 0.0, 0.0] and probe.skipped_grad == [0.0, 0.0, 0.0]
    assert probe.moved == [False, True, True]  # skipped, then training goes on unharmed
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert trainer.global_step == 3


def test_nan_gradient_skips_the_update_and_is_logged(module: TraceModule):
    weight = module.policy.model.layers[0].mlp.up_proj.weight
    weight.register_hook(lambda grad: torch.full_like(grad, math.nan))  # a backward that overflowed
    probe = Probe()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = fit(module, chain_data(), probe)
    assert probe.skipped == [0.0, 0.0, 0.0] and probe.skipped_grad == [1.0, 1.0, 1.0]
    assert probe.moved == [False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert not trainer.optimizers[0].state  # AdamW saw no grad at all: no moments, no step count


SKIP_MESSAGE = (
    r"optimizer steps in a row .*learning rate.*corrupt checkpoint.*fp16 overflow.*module.max_skipped_steps="
)


def test_consecutive_nonfinite_gradients_stop_training_naming_the_causes(tiny_model_dir: str):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, max_skipped_steps=2)
    weight = module.policy.model.layers[0].mlp.up_proj.weight
    weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
    probe = Probe()
    with pytest.raises(NonFiniteTrainingError, match="^2 " + SKIP_MESSAGE + "2"):
        fit(module, chain_data(), probe)
    assert probe.skipped_grad == [1.0]  # the second skipped step raised before its batch ended


@pytest.mark.filterwarnings("ignore:.*returned `None`")
def test_consecutive_nonfinite_losses_stop_training(tiny_model_dir: str):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, max_skipped_steps=3)
    probe = Probe(poison=lambda i: True)  # every batch: NaN loss, so no step has a gradient
    with pytest.raises(NonFiniteTrainingError, match="^3 " + SKIP_MESSAGE + "3"):
        fit(module, chain_data(), probe)
    assert probe.skipped == [1.0, 1.0]


@pytest.mark.filterwarnings("ignore:.*returned `None`")
def test_skipped_steps_that_are_not_consecutive_do_not_stop_training(tiny_model_dir: str):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, max_skipped_steps=2)
    probe = Probe(poison=lambda i: i in (0, 2))  # skipped, trained, skipped: never 2 in a row
    trainer = fit(module, chain_data(), probe)
    assert probe.skipped == [1.0, 0.0, 1.0] and trainer.global_step == 3


# --------------------------------------------------------------------------- no contrast at all


@pytest.mark.parametrize("reward", [1.0, 0.0], ids=["all_success", "all_failure"])
def test_batches_without_contrast_have_zero_advantages_and_no_nan(module: TraceModule, reward: float):
    for estimator in ESTIMATORS:
        _, batches = build(
            module,
            ConstantEnv(reward),
            allocator=alloc.trace(2, max_per_prompt=4),
            leaves=12,
            estimator=estimator,
        )
        for b in batches:
            tensors = [t for t in vars(b).values() if isinstance(t, torch.Tensor)]  # not the packed rows
            assert all(torch.isfinite(t.float()).all() for t in tensors), estimator
            assert torch.equal(b.advantages, torch.zeros_like(b.advantages)), estimator
            assert_zero_policy_gradient(module, b)
        targets = torch.cat([b.pred_targets for b in batches])
        assert targets.numel() and bool((targets == reward).all()), estimator  # the head's job is clear


def assert_zero_policy_gradient(module: TraceModule, batch: RolloutBatch) -> None:
    assert batch.loss_mask.any()  # there are tokens to train, so a zero gradient is not vacuous
    module.zero_grad(set_to_none=True)
    logp, _ = module._forward(module.policy, batch.input_ids, batch.attention_mask)
    pg = clipped_surrogate(
        logp, batch.old_logprobs, batch.advantages, batch.loss_mask, LossSettings(), TokenMean()
    )
    pg.loss.backward()
    assert pg.loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in module.policy.parameters())
    module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("reward", [1.0, 0.0], ids=["all_success", "all_failure"])
def test_step_without_contrast_leaves_the_policy_unchanged(module: TraceModule, reward: float):
    policy = [p.detach().clone() for p in module.policy.parameters()]
    head = [p.detach().clone() for p in module.head.parameters()]
    probe = Probe()
    trainer = fit(module, chain_data(env=ConstantEnv(reward)), probe)
    assert min(probe.trained_tokens) > 0 and probe.skipped == probe.skipped_grad == [0.0] * 3
    assert float(trainer.callback_metrics["train/policy_loss"]) == 0.0
    assert math.isfinite(float(trainer.callback_metrics["train/predictor_mse"]))
    assert all(torch.equal(a, b) for a, b in zip(policy, module.policy.parameters(), strict=True))
    # the predictor still learns that these prompts always (or never) succeed
    assert any(not torch.equal(a, b) for a, b in zip(head, module.head.parameters(), strict=True))
