"""Engine/trainer agreement checks that need no vLLM: the per-iteration log-prob mismatch and the rule
that the DataModule syncs the engine exactly when the policy changed since the engine last saw it."""

import functools
import importlib.util

import lightning as L
import numpy as np
import pytest
import torch
from helpers.chain_fixtures import make_data, make_module

from trace_lightning import allocation as alloc
from trace_lightning.collector import RolloutCollector
from trace_lightning.engines.auto import auto_engine
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.evaluation import EvalSettings
from trace_lightning.metrics import rollout_metrics


class CountingEngine(HFEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.syncs = self.sleeps = 0

    def sync_weights(self):
        self.syncs += 1

    def sleep(self):
        self.sleeps += 1


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_engine_and_trainer_logprobs_agree_at_the_sampling_temperature(tiny_model_dir, temperature):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, temperature=temperature)
    data = make_data(sampling=SamplingParams(max_new_tokens=12, temperature=temperature))
    data.build_iteration(module)
    report = data.report
    assert 0 <= report.logprob_mismatch <= report.logprob_mismatch_max < 1e-4
    metrics = rollout_metrics(report)
    assert metrics["engine/logprob_mismatch"] == report.logprob_mismatch


def test_a_trainer_at_another_temperature_is_refused(tiny_model_dir):
    module = make_module(tiny_model_dir, temperature=1.0)
    data = make_data(sampling=SamplingParams(max_new_tokens=12, temperature=0.5))
    with pytest.raises(ValueError, match="sampling.temperature=0.5"):
        data.build_iteration(module)


def test_logprob_mismatch_exposes_a_trainer_at_another_temperature(tiny_model_dir):
    """The check can fail: a trainer scoring at T=1 what was sampled at T=0.5 is far off."""
    torch.manual_seed(0)
    sampled_at = SamplingParams(max_new_tokens=12, temperature=0.5)
    module, data = make_module(tiny_model_dir, temperature=0.5), make_data(sampling=sampled_at)
    data.collector.start(module)
    module.sampling = SamplingParams(max_new_tokens=12, temperature=1.0)  # e.g. a bug in a custom loop
    data.build_iteration(module)
    assert data.report.logprob_mismatch > 0.05


def test_engine_is_synced_exactly_when_the_policy_changed(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    data = make_data(engine=functools.partial(CountingEngine, max_batch_size=16))
    data.build_iteration(module)
    engine = data.collector.runner.engine
    assert engine.syncs == 1  # never synced before: a resumed policy may differ from what it loaded
    assert engine.sleeps == 1  # after every generation phase
    data.build_iteration(module)
    assert engine.syncs == 1 and data.report.sync_seconds == 0.0  # same weights: nothing to push
    with torch.no_grad():
        next(p for p in module.policy.parameters() if p.requires_grad).add_(0.01)
    data.build_iteration(module)
    assert engine.syncs == 2 and engine.sleeps == 3


def test_training_logprobs_use_the_sampling_temperature(tiny_model_dir):
    hot, cold = make_module(tiny_model_dir, temperature=1.0), make_module(tiny_model_dir, temperature=0.5)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = hot.policy(input_ids=ids).logits[:, :-1]
        expected = torch.log_softmax(logits / 0.5, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        got, _ = cold._forward(cold.policy, ids, mask)
    torch.testing.assert_close(got[:, 1:], expected)


def test_training_refuses_greedy_decoding(tiny_model_dir):
    """Temperature 0 is greedy decoding, for evaluation only: RL needs sampled rollouts and log-probs at a
    temperature, so the collector and the module refuse it, naming the key."""
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    with pytest.raises(ValueError, match="sampling.temperature=0.0 must be > 0"):
        make_data(sampling=greedy)
    with pytest.raises(ValueError, match="sampling.temperature=0.0 must be > 0"):
        make_module(tiny_model_dir, temperature=0.0)
    with pytest.raises(ValueError, match="sampling.temperature"):
        SamplingParams(temperature=-0.1)


def test_training_refuses_nucleus_truncation(tiny_model_dir):
    """With top_p < 1 the engine samples from a truncated distribution the trainer's log-probs do not
    model: every importance ratio would be wrong, so training refuses it (evaluation may use it)."""
    nucleus = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
    with pytest.raises(ValueError, match="sampling.top_p=0.9: training needs top_p=1"):
        make_data(sampling=nucleus)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_names_the_install_step(tiny_policy):
    from trace_lightning.engines.vllm import VLLMEngine  # the module itself imports without vLLM

    model, tokenizer = tiny_policy
    with pytest.raises(ImportError, match="make install-vllm"):
        VLLMEngine(model, tokenizer)


def test_engine_auto_falls_back_to_transformers_without_vllm(tiny_policy, monkeypatch):
    model, tokenizer = tiny_policy
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    picked = []
    engine = auto_engine(model, tokenizer, vllm=lambda **kw: picked.append("vllm"))
    assert isinstance(engine, HFEngine) and not picked
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert auto_engine(model, tokenizer, vllm=lambda **kw: "vllm engine") == "vllm engine"


# --------------------------------------------------------------------------- held-out evaluation


def test_held_out_tasks_never_enter_a_pool_and_evaluation_leaves_training_untouched(tiny_model_dir):
    """Two identical runs, one evaluated between its iterations: the same trees, the same reports."""
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    evaluated, plain = make_data(held_out=6), make_data(held_out=6)
    held = set(evaluated.collector.held_out)
    assert len(held) == 6 and held == set(plain.collector.held_out)
    settings = EvalSettings(samples=2, seed=5, temperature=0.5)
    for _ in range(2):
        result = evaluated.collector.evaluator.evaluate(module, settings)
        assert result.episodes == 12 and set(result.task_ids) == held and 0.0 <= result.pass_at_1 <= 1.0
        assert result.turns >= 1 and result.temperature == 0.5 and result.seconds > 0
        assert evaluated.collector.runner.sampling.temperature == 1.0  # the training temperature is back
        a, b = evaluated.build_iteration(module), plain.build_iteration(module)
        ta, tb = evaluated.report.result.trees, plain.report.result.trees
        assert [t.task_id for t in ta] == [t.task_id for t in tb] and not held & {t.task_id for t in ta}
        assert [t.token_ids(x) for t in ta for x in t.leaves()] == [
            t.token_ids(x) for t in tb for x in t.leaves()
        ]
        assert evaluated.report.counters == plain.report.counters
        assert len(a) == len(b)
    # the same seed, the same policy: the same evaluation
    again = [evaluated.collector.evaluator.evaluate(module, settings).successes for _ in range(2)]
    assert again[0] == again[1]
    assert make_data().collector.evaluator.evaluate(module, settings) is None  # nothing held out


class ParityChain(ChainEnv):
    """The chain task with one attribute: the task id's parity (`envs.base.HasAttributes`)."""

    def attributes(self, task):
        return (f"parity={task.task_id % 2}", "unused=finer")


def test_held_out_pass_at_1_is_broken_down_by_the_tasks_coarsest_attribute(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    data = make_data(held_out=6, env=ParityChain(n_tasks=24, turns=3, seed=0))
    result = data.collector.evaluator.evaluate(module, EvalSettings(samples=2, seed=5))
    assert result.groups == tuple(f"parity={t % 2}" for t in result.task_ids)
    expected = {}  # pass@1 per parity, from the per-task successes
    for t, c in zip(result.task_ids, result.successes, strict=True):
        expected.setdefault(f"parity={t % 2}", []).append(c / 2)
    assert {g: (p, n) for g, (p, _, n) in result.by_group().items()} == {
        g: (pytest.approx(sum(r) / len(r)), len(r)) for g, r in expected.items()
    }
    plain = make_data(held_out=6).collector.evaluator.evaluate(module, EvalSettings(samples=2, seed=5))
    assert plain.groups == () and plain.by_group() == {}  # an env without attributes


class TemperatureSpy(HFEngine):
    """Records the temperature of every generate call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperatures = []

    def generate(self, prompts, params):
        self.temperatures.append(params.temperature)
        return super().generate(prompts, params)


def test_evaluation_samples_at_its_own_temperature_on_the_chosen_tasks(tiny_model_dir):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    data = make_data(held_out=4, engine=functools.partial(TemperatureSpy, max_batch_size=16))
    collector = data.collector
    greedy = collector.evaluator.evaluate(module, EvalSettings(samples=1, temperature=0.0, tasks="all"))
    engine = collector.runner.engine
    assert set(engine.temperatures) == {0.0} and greedy.temperature == 0.0 and greedy.samples == 1
    assert (
        sorted(greedy.task_ids) == sorted(collector.train_ids + collector.held_out)
        and len(greedy.task_ids) == 24
    )
    engine.temperatures.clear()
    trained = collector.evaluator.evaluate(module, EvalSettings(samples=2, tasks="train", k=2))
    assert set(engine.temperatures) == {1.0} and trained.temperature == 1.0  # null: the training one
    assert list(trained.task_ids) == collector.train_ids and trained.k == 2
    engine.temperatures.clear()
    data.build_iteration(module)
    assert set(engine.temperatures) == {1.0}  # training samples at its own temperature again


def test_held_out_success_draws_the_curve_before_training_and_every_k_iterations(tiny_model_dir):
    from helpers.chain_fixtures import fit

    from trace_lightning.callbacks import HeldOutSuccess

    torch.manual_seed(0)
    curve = HeldOutSuccess(EvalSettings(samples=2, every_n_iterations=2))
    fit(make_module(tiny_model_dir), make_data(held_out=4), epochs=3, callbacks=[curve])
    assert [trained for trained, _ in curve.history] == [0, 2, 3]  # before, every 2, and the last
    assert all(r.episodes == 8 and r.samples == 2 for _, r in curve.history)
    resumed = HeldOutSuccess(EvalSettings(samples=2, every_n_iterations=2))
    resumed.load_state_dict(curve.state_dict())  # the curve survives a resume (plain values only)
    assert resumed.history == curve.history


def test_held_out_count_is_checked_against_the_tasks():
    with pytest.raises(ValueError, match="data.held_out=24"):
        make_data(held_out=24)
    with pytest.raises(ValueError, match="data.pool_size=8 must be in"):
        make_data(held_out=20)  # 4 tasks left for a pool of 8


# --------------------------------------------------------------------------- the predictor's probe


class Trees(L.Callback):
    """Every iteration's leaf token ids and counters, as the epoch starts."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_start(self, trainer, pl_module):
        report = trainer.datamodule.report
        self.seen.append(([t.token_ids(x) for t in report.result.trees for x in t.leaves()], report.counters))


def test_a_probed_run_trains_exactly_like_an_unprobed_one(tiny_model_dir):
    """SuccessProbe plays 2 x half episodes of every candidate between sampling and training; the
    probed and the plain run must sample the same trees, report the same counters and end with the
    same weights."""
    from helpers.chain_fixtures import fit

    from trace_lightning.callbacks import SuccessProbe

    runs = []
    for probed in (True, False):
        torch.manual_seed(0)
        module = make_module(tiny_model_dir)
        data = make_data(cold_start=alloc.BetaPrior(warmup=0))
        probe = SuccessProbe(every_n_epochs=1, half=2, max_per_prompt=4)
        trees = Trees()
        fit(module, data, epochs=2, callbacks=[probe, trees] if probed else [trees])
        runs.append((trees.seen, module.weights_fingerprint(), probe.history))
    (probed_leaves, probed_weights, history), (plain_leaves, plain_weights, _) = runs
    assert probed_leaves == plain_leaves and probed_weights == plain_weights
    assert [it for it, _ in history] == [0, 1]
    for _, m in history:
        assert -1 <= m["probe/spearman"] <= 1 or np.isnan(m["probe/spearman"])
        assert 0 <= m["probe/expected_mixed"] <= m["probe/expected_mixed_random"] * 10
        assert m["probe/base_rate_brier"] <= 0.25


def test_probe_counts_successes_of_fresh_episodes_of_each_task(tiny_model_dir):
    torch.manual_seed(0)
    module, data = make_module(tiny_model_dir), make_data()
    ids = data.collector.train_ids[:5]
    wins = data.collector.evaluator.probe(module, ids, samples=3, seed=9)
    trees = data.collector.evaluator.play(
        module, ids, samples=3, seed=9
    )  # the same seed plays the same episodes
    assert wins.tolist() == [sum(t.nodes[x].reward >= 0.5 for x in t.leaves()) for t in trees]
    assert all(len(t.leaves()) == 3 for t in trees)


def test_a_collector_that_overrides_stage_1s_estimates_steers_stage_1(tiny_model_dir):
    """The hook of benchmarks/learning.py's true_v instrument (TrueVCollector), built by the DataModule:
    Stage 1 runs on what `stage1_estimates` returns, steered."""
    asked = []

    class OracleCollector(RolloutCollector):
        def stage1_estimates(self, module, pool_ids, predicted):
            asked.append(list(pool_ids))
            return np.array([0.5 if t == pool_ids[1] else 0.0 for t in pool_ids]), True  # one uncertain

    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    data = make_data(allocator=alloc.trace(expansion=2, max_per_prompt=4), collector=OracleCollector)
    data.build_iteration(module)
    report = data.report
    assert asked == [report.pool_ids] and report.steered
    assert report.result.root_counts[1] == 4  # the cap on the only uncertain one, the rest by tie-break


def test_grpo_reports_no_steering_whatever_the_gate_says(tiny_model_dir):
    """GRPO's uniform groups read no estimate, so its iterations are never reported as steered, even with
    a gate that is always open; trace's are, under the same gate."""
    from trace_lightning.selection import Selection

    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    for allocator, steered in ((alloc.uniform(2), False), (alloc.trace(expansion=2, max_per_prompt=4), True)):
        data = make_data(allocator=allocator, selection=Selection(explore_groups=1, gate_skill=None))
        data.build_iteration(module)
        assert data.report.steered is steered


def test_the_unbiased_slice_is_rolled_out_on_top_of_stage_1(tiny_model_dir):
    from trace_lightning.selection import Selection

    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    data = make_data(selection=Selection(explore_groups=1), cold_start=alloc.BetaPrior(warmup=1))
    data.build_iteration(module)
    report = data.report
    assert report.result.root_counts.sum() == 4  # 12 leaves at expansion 2: 4 bare rollouts
    (entry,) = data.collector.selection.history  # one slice group, recorded for the gate
    assert entry[0] == 0 and entry[4] == 2.0  # iteration 0, 2 bare rollouts
    assert entry[1] == pytest.approx(0.5) and entry[2] == 0.5  # the prior's mean; no base rate yet


def test_priced_stage_2_reports_its_spend_and_resumes_its_flip_rates(tiny_model_dir):
    """The default trace: with the gate closed an iteration is GRPO's groups and nothing else; open, what
    Stage 2 spent and gave back adds up to the budget, its flips are reported, and the flip table it
    learned travels in the collector's state."""
    from trace_lightning.pricing import Pricing
    from trace_lightning.selection import Selection

    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    allocator = alloc.trace(expansion=2, max_per_prompt=4, group_size=2, pricing=Pricing())
    gated = make_data(allocator=allocator, selection=Selection(explore_groups=1, gate_skill=0.25))
    gated.build_iteration(module)
    report = gated.report
    assert not report.steered  # too few slice outcomes to open the gate: GRPO's groups of 2, no Stage 2
    assert sorted(int(m) for m in report.result.root_counts if m) == [2] * 6
    assert report.result.ledger.leaves == {"bare": 12, "expand": 0}

    data = make_data(allocator=allocator, selection=Selection(explore_groups=1, gate_skill=None))
    for _ in range(2):
        data.build_iteration(module)
        report, ledger = data.report, data.report.result.ledger
        assert report.steered
        assert ledger.leaves["expand"] + int(report.result.root_counts.sum()) == 12
        assert ledger.returned == int(report.result.root_counts.sum()) - 4  # M = 4 bare, the rest given back
        assert sum(report.flips.continuations) == ledger.leaves["expand"] >= 2  # the probe at least
    state = data.collector.state_dict()
    assert state["flips"]["counts"]
    fresh = make_data(allocator=allocator, selection=Selection(explore_groups=1, gate_skill=None))
    fresh.collector.load_state_dict(state)
    assert fresh.collector.flips.counts == data.collector.flips.counts
    assert fresh.collector.flips.roots == data.collector.flips.roots
