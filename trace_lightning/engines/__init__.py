"""Generation engines behind one protocol: tokens in, tokens and log-probabilities out."""

from trace_lightning.engines.base import Completion, EngineStats, GenerationEngine, SamplingParams

__all__ = ["Completion", "EngineStats", "GenerationEngine", "SamplingParams"]
