"""Engine/trainer agreement checks that need no vLLM: the per-iteration log-prob mismatch and the rule
that the DataModule syncs the engine exactly when the policy changed since the engine last saw it."""

import functools
import importlib.util

import pytest
import torch
from chain_fixtures import make_data, make_module

from trace_lightning.callbacks import rollout_metrics
from trace_lightning.engines.auto import auto_engine
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine


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
    with pytest.raises(ValueError, match="sampling.temperature"):
        SamplingParams(temperature=0.0)


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
