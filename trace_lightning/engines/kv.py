"""Run a shared token prefix once and hand its KV cache to many rows: the one helper the transformers
engine (each distinct prompt once, then its n continuations) and predictor scoring (a candidate pool's
common chat-template prefix once, then every prompt's own tokens) both use."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, GenerationMixin

# transformers 5.x renamed `past_key_values` to `cache` (the old name warns until 5.40);
# 4.x only knows the old one.
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


def prefill(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    hidden_states: bool = False,
) -> tuple[DynamicCache, Any]:
    """Run `ids` [U, L] once into a fresh cache; (cache, the model's output, None when L = 0).

    Only the last position's logits are computed (`logits_to_keep=1`): callers want the cache, and
    optionally the hidden states, not full-vocabulary logits over the prefix."""
    cache = DynamicCache(config=model.config)
    if ids.shape[1] == 0:
        return cache, None
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=hidden_states,
        logits_to_keep=1,
        **{CACHE_KWARG: cache},
    )
    return cache, out


def fan_out(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """The cache with row i holding prefix `rows[i]`'s KV (rows [B] index the prefilled batch)."""
    cache.batch_select_indices(rows)
    return cache
