"""The `GenerationEngine` protocol every engine implements (`hf.HFEngine`, `vllm.VLLMEngine`).

Tokens in, tokens out: prompts are token id lists (the full prefix H_t of a branch), completions
are the generated token ids with their log-probabilities. Nothing here decodes and re-encodes what
the policy wrote; text is derived from tokens only to parse actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How one turn is sampled: the `sampling` config group, one object shared by the engine and the
    trainer (which scores tokens at the same temperature). `stop` strings end the turn and are kept in
    the output; the runner adds the environment's own. Temperature 0 decodes greedily (the vLLM and
    OpenAI convention): evaluation only (`eval.temperature=0`); training refuses it, since RL needs
    sampled rollouts and log-probs at a temperature (`require_sampling`)."""

    max_new_tokens: int = 48
    temperature: float = 0.8
    top_p: float = 1.0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))  # a config list becomes a (hashable) tuple
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(
                f"sampling.temperature={self.temperature} must be >= 0 (0: greedy, for evaluation only)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")


def require_sampling(params: SamplingParams) -> None:
    """Training samples and scores at a temperature > 0 from the whole distribution: greedy decoding
    is for evaluation only, and with top_p < 1 the sampled tokens come from a truncated distribution
    that the trainer's log-probs (and so the importance ratios) do not model."""
    if params.temperature <= 0:
        raise ValueError(
            f"sampling.temperature={params.temperature} must be > 0: RL needs sampled rollouts (a greedy "
            "evaluation is eval.temperature=0)"
        )
    if params.top_p < 1:
        raise ValueError(
            f"sampling.top_p={params.top_p}: training needs top_p=1, since the trainer scores tokens under "
            "the full distribution and nucleus truncation would make every importance ratio wrong; lower "
            "sampling.temperature instead"
        )


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]  # generated tokens, including a matched stop string and the EOS token if emitted
    logprobs: list[float]  # log pi(token | prefix) at the sampling temperature, one per token
    finish_reason: FinishReason  # "stop": a stop string matched; "eos": EOS emitted; "length": max_new_tokens


@dataclass
class EngineStats:
    """Counters an engine accumulates; callers take them once per iteration (`take_stats`)."""

    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run through the model
    reused_prefill_tokens: int = 0  # prompt tokens served from a shared-prefix cache instead
    calls: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class GenerationEngine(Protocol):
    stats: EngineStats

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order. Identical prompts (several continuations from the same
        tree node) should share their prefill."""
        ...

    def sync_weights(self) -> None:
        """Make the engine sample from the policy's current weights. The DataModule calls it before a
        generation phase whenever the policy changed since the last sync."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory for training after a generation phase; the next `sync_weights` or
        `generate` wakes the engine. A no-op for engines that hold no such memory."""
        ...

    def close(self) -> None:
        """Release everything the engine holds (a vLLM engine its memory and process group)."""
        ...

    def take_stats(self) -> EngineStats:
        """The counters since the last call, which start again from zero."""
        ...


class ScriptedEngineBase:
    """The weight-free half of `GenerationEngine` for engines that hold no weights of their own (a
    script, a teacher, a test double): syncing, sleeping and closing do nothing; subclasses write
    `generate` and count into `stats`."""

    stats: EngineStats

    def sync_weights(self) -> None:
        """Nothing to sync."""

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to release."""

    def take_stats(self) -> EngineStats:
        stats, self.stats = getattr(self, "stats", EngineStats()), EngineStats()
        return stats


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS plus any the model's generation config lists (chat models often have two)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = model.generation_config.eos_token_id
    ids.update([configured] if isinstance(configured, int) else configured or [])
    if not ids:
        raise ValueError(
            "the engine needs an EOS token: neither the tokenizer nor model.generation_config has one"
        )
    return ids
