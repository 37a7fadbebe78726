"""`HFEngine`: the CPU default engine, transformers `generate` on the very module the trainer updates.

Three things go beyond a plain `generate` call:

- Shared prefill. A tree node expanded into n children sends n identical prompts. Each distinct prompt
  of a batch is run through the model once (all but its last token), the KV cache rows are then
  copied n times with `Cache.batch_select_indices`, and `generate` continues from that cache: it only
  runs the last prompt token of each row before sampling. Compute is shared; cache memory is not.
- Stop strings are matched on the decoded completion only, never on the prompt (see `_StopStrings`),
  and a completion ends exactly with the token that completes the first stop string.
- Log-probabilities are log_softmax(logits / T) of the sampled tokens: the raw model logits at the
  sampling temperature, BEFORE top-p truncation. They are the engine's view, used to check
  engine/trainer agreement; the trainer recomputes its own log-probs for the loss. With top_p < 1 the
  probability a kept token was actually drawn with is higher by the top-p renormalisation; that
  number is not reported. They are recorded step by step (`_SampledLogProbs`) rather than with
  `output_logits=True`, which keeps every step's [B, V] logits (16 x 512 x 49k fp32 = 1.6 GB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from trace_lightning.engines.base import Completion, EngineStats, FinishReason, SamplingParams, eos_ids
from trace_lightning.engines.kv import CACHE_KWARG, fan_out, prefill

# Generation-config fields whose neutral value is None: a model default there would silently change the
# sampling distribution, and `generate` fills None fields from `model.generation_config`.
_DISTORTING_FIELDS = (
    "bad_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "top_h",
    "guidance_scale",
    "min_p",
    "watermarking_config",
)


@dataclass
class _Group:
    """One distinct prompt of a chunk and the output rows that continue it."""

    prompt: tuple[int, ...]
    rows: list[int] = field(default_factory=list)


class HFEngine:
    """`GenerationEngine` over a transformers causal LM (plain or PEFT-wrapped)."""

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int = 16) -> None:
        if max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size={max_batch_size} must be >= 1")
        self.model, self.tokenizer, self.max_batch_size = model, tokenizer, max_batch_size
        self.stats = EngineStats()
        self.eos_ids = eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids)
        _check_generation_config(model.generation_config)

    def sync_weights(self) -> None:
        """Nothing to do: the engine samples from the module the optimizer updates, so it always sees the
        current weights. Kept for the protocol (vLLM needs a real copy)."""

    def sleep(self) -> None:
        """Nothing to free: the weights are the trainer's own."""

    def close(self) -> None:
        """Nothing to release."""

    def take_stats(self) -> EngineStats:
        stats, self.stats = self.stats, EngineStats()
        return stats

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("HFEngine.generate: every prompt needs at least one token")
        if not prompts:  # the runner's turn with nothing left to sample
            return []
        self.stats.calls += 1
        out: list[Completion | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling; the trainer's mode is restored below
        try:
            with torch.no_grad():
                for chunk in _plan_chunks(prompts, self.max_batch_size):
                    rows = [r for g in chunk for r in g.rows]
                    for r, completion in zip(rows, self._generate_chunk(chunk, params), strict=True):
                        out[r] = completion
        finally:
            self.model.train(was_training)
        return [c for c in out if c is not None]

    def _generate_chunk(self, groups: list[_Group], params: SamplingParams) -> list[Completion]:
        """Sample every row of `groups` (group-major order) in one `generate` call."""
        device = self.model.device
        ids, mask = _left_pad([list(g.prompt) for g in groups], self.pad_id)  # [U, L]
        ids, mask = ids.to(device), mask.to(device)
        counts = torch.tensor([len(g.rows) for g in groups])  # [U]
        src = torch.repeat_interleave(torch.arange(len(groups)), counts).to(device)  # [B]: row -> its prompt
        # The shared prompt tokens (all but the last) run once, at the positions generate derives from
        # the attention mask, so the cache lines up with them; each distinct prompt's KV goes to its n rows.
        positions = (mask[:, :-1].cumsum(-1) - 1).clamp(min=0)  # [U, L-1]
        cache = fan_out(prefill(self.model, ids[:, :-1], mask[:, :-1], positions)[0], src)
        # The shared part ran once per distinct prompt; generate runs the last prompt token once per row.
        self.stats.prefill_tokens += int(mask[:, :-1].sum()) + len(src)
        self.stats.reused_prefill_tokens += sum((len(g.rows) - 1) * (len(g.prompt) - 1) for g in groups)

        stops = _StopStrings(self.tokenizer, params.stop, prompt_len=ids.shape[1], batch_size=len(src))
        logprobs = _SampledLogProbs(params.temperature or 1.0)  # greedy (0): the model's own log-probs
        sequences = self.model.generate(
            input_ids=ids[src],
            attention_mask=mask[src],
            generation_config=self._generation_config(params),
            logits_processor=LogitsProcessorList([logprobs]),
            stopping_criteria=StoppingCriteriaList([stops]),
            **{CACHE_KWARG: cache},
        )
        token_logp = logprobs.finish(sequences).cpu()  # [B, T]
        tokens = sequences[:, ids.shape[1] :].cpu()  # [B, T]
        completions = [self._finish(tokens[b], token_logp[b], stops.stop_step[b]) for b in range(len(src))]
        self.stats.generated_tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        # Every sampling field set explicitly: `generate` fills unset ones from the model's own defaults
        # (e.g. top_k=50), which would silently change the distribution we sample from. Temperature 0 is
        # greedy decoding (evaluation only); the neutral 1.0s keep `generate` from warning about them.
        greedy = params.temperature == 0
        return GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=None if greedy else 0,  # greedy decoding reads no top_k (set, transformers warns)
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            num_beams=1,
            num_return_sequences=1,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            use_cache=True,
            remove_invalid_values=False,
            return_dict_in_generate=False,
        )

    def _finish(self, tokens: torch.Tensor, logp: torch.Tensor, stop_step: int | None) -> Completion:
        """Cut one row at its first EOS or stop string (inclusive); what follows is generate's padding."""
        ends: list[tuple[int, FinishReason]] = []
        is_eos = torch.isin(tokens, torch.tensor(sorted(self.eos_ids)))  # [T]
        if is_eos.any():
            ends.append((int(is_eos.nonzero()[0]) + 1, "eos"))
        if stop_step is not None:
            ends.append((stop_step + 1, "stop"))
        ends.append((len(tokens), "length"))  # last: a stop or EOS on the final allowed token wins the tie
        n, reason = min(ends, key=lambda e: e[0])
        return Completion(token_ids=tokens[:n].tolist(), logprobs=logp[:n].tolist(), finish_reason=reason)


class _SampledLogProbs(LogitsProcessor):
    """Records log_softmax(logits / T) of each sampled token, holding one step's [B, V] at a time.

    `generate` puts custom processors after the (here all disabled) penalty processors and before the
    temperature/top-p warpers, so `scores` are the raw logits. The token drawn from step t is only
    known at step t+1 (or in the final sequences), hence the one-step lag.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # [B, V] log-probs of the step whose token is not known yet
        self.steps: list[torch.Tensor] = []  # one [B] per generated token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._collect(input_ids)
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        return scores

    def _collect(self, input_ids: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))  # [B]
            self.pending = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        self._collect(sequences)
        return torch.stack(self.steps, dim=1)  # [B, T]


class _StopStrings(StoppingCriteria):
    """Ends a row at the first step whose decoded completion contains a stop string, and records that step.

    transformers' own `stop_strings` matcher reads the whole sequence, prompt included, so a prompt
    ending in part of a stop string could end a turn after one token; past that point the row is only
    padding and its true end cannot be recovered. Decoding just the completion's tail avoids both.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int, batch_size: int) -> None:
        self.tokenizer, self.stops, self.prompt_len = tokenizer, tuple(stops), prompt_len
        self.stop_step: list[int | None] = [None] * batch_size
        # A token holds at least one byte, so this many tokens always cover a stop string that the newest
        # token completes; the margin covers tokens that decode to nothing (skipped specials).
        self.window = max((len(s.encode()) for s in self.stops), default=0) + 8

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        done = torch.tensor([s is not None for s in self.stop_step], device=input_ids.device)  # [B]
        if not self.stops:
            return done
        step = input_ids.shape[1] - self.prompt_len - 1
        tails = input_ids[:, max(self.prompt_len, input_ids.shape[1] - self.window) :].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        for b, text in enumerate(texts):
            if self.stop_step[b] is None and any(s in text for s in self.stops):
                self.stop_step[b] = step
                done[b] = True
        return done


def _plan_chunks(prompts: Sequence[Sequence[int]], max_rows: int) -> list[list[_Group]]:
    """Group identical prompts (first-seen order) and pack them into chunks of at most `max_rows` rows.
    A group larger than the space left is split; each part then gets its own prefill."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(r)
    chunks: list[list[_Group]] = [[]]
    used = 0
    for prompt, rows in groups.items():
        for r in rows:
            if used == max_rows:
                chunks.append([])
                used = 0
            if not chunks[-1] or chunks[-1][-1].prompt != prompt:
                chunks[-1].append(_Group(prompt))
            chunks[-1][-1].rows.append(r)
            used += 1
    return [c for c in chunks if c]


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs], dtype=torch.long)  # [U, L]
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)  # [U, L]
    return ids, mask


def _check_generation_config(config: GenerationConfig) -> None:
    set_fields = [name for name in _DISTORTING_FIELDS if getattr(config, name, None) is not None]
    if set_fields:
        raise ValueError(
            f"model.generation_config sets {set_fields}, which would change the sampling distribution; "
            "HFEngine samples from plain temperature/top-p: set them to None on model.generation_config."
        )
