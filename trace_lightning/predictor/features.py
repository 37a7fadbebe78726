"""What the head reads at a turn prefix. By default (`PredictorSettings`) hashed uni- and bigrams of the
prefix's text and the prompt's posterior features, which do not drift as the policy trains; with
`predictor.policy_features=true`, also the policy's (or a companion LM's) final hidden states.

`PrefixScorer` is handed the rollout model and runs each rollout once: attention is causal, so the
state at the end of turn t has seen exactly H_t, and one forward pass over a bare rollout reads every
prefix on it. A candidate pool shares its chat template and system prompt, so that common token prefix
runs once and its KV cache is copied to every row (`engines/kv.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trace_lightning.engines.kv import CACHE_KWARG, fan_out, prefill
from trace_lightning.packing import right_pad
from trace_lightning.predictor.head import SuccessHead, gather_positions
from trace_lightning.tree import RolloutTree

SCORE_BATCH_SIZE = 16  # rollouts per scoring forward pass
MIN_SHARED_PREFIX = 16  # below this, one plain forward pass is cheaper than the cache bookkeeping


def ngram_features(token_ids: Sequence[int], buckets: int) -> torch.Tensor:
    """Presence of the prefix's token unigrams and bigrams, hashed into `buckets` columns [buckets].

    Text features do not drift as the policy trains (its hidden states do), so a predictor on them
    keeps what it learned about a prompt's wording. The hash is a fixed affine map per
    n-gram, the same in every process and run. Example: ids [5, 7], 8 buckets -> columns 5 % 8,
    7 % 8 and (5 * 1_000_003 + 7 + 1) % 8 set to 1."""
    ids = np.asarray(token_ids, dtype=np.int64)
    bigrams = ids[:-1] * 1_000_003 + ids[1:] + 1
    out = torch.zeros(buckets)
    out[torch.as_tensor(np.concatenate([ids, bigrams]) % buckets)] = 1.0
    return out


class PrefixScorer:
    """Features [n, F] and predictions Ṽ [n] at requested turn prefixes, for the collector.

    `model` returns the network to read (the rollout policy, which under FSDP2 is an unsharded copy
    made on first use, or a frozen companion); `head` is the module's `SuccessHead`. A row is
    [policy states (`policy_width`) ; hashed n-grams of the prefix's tokens (`text_buckets`)]:
    `pooling` "last_mean" appends the mean of the states over the prefix to the last one (2H), and
    `policy_features=False` leaves the states out. With `posterior_features` the collector inserts the
    prompt's posterior statistics after the policy states (`IterationScorer`).

    Why the mean (measured on benchmarks/learning.py's testbed): the last token's state is
    about what comes next, not about the task; a head fitted to 150 prompts on it correlated 0.41 with
    their success, on the mean 0.75.
    """

    def __init__(
        self,
        model: Callable[[], torch.nn.Module],
        tokenizer: Any,
        head: SuccessHead,
        pooling: str,
        posterior_features: bool = False,
        text_buckets: int = 0,
        policy_features: bool = True,
    ) -> None:
        self.model, self.tokenizer, self.head, self.pooling = model, tokenizer, head, pooling
        self.posterior_features, self.text_buckets = posterior_features, text_buckets
        self.policy_features = policy_features

    @property
    def policy_width(self) -> int:
        """Columns of policy states at the start of a row (0 when `policy_features` is off)."""
        if not self.policy_features:
            return 0
        hidden = int(self.model().config.hidden_size)
        return hidden * (2 if self.pooling == "last_mean" else 1)

    @property
    def width(self) -> int:
        """F: the width of `features` rows."""
        return self.policy_width + self.text_buckets

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> np.ndarray:
        """P(success) [K] from head inputs [K, F]."""
        if len(features) == 0:
            return np.zeros(0, dtype=np.float64)
        device = next(self.head.parameters()).device
        return torch.sigmoid(self.head(features.to(device))).double().cpu().numpy()

    @torch.no_grad()
    def features(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The head's input at each requested prefix, one [n_i, F] tensor per tree. Prefixes on the same
        rollout share one forward pass over it (its lowest-id leaf's path, `RolloutTree.owner_leaf`)."""
        states = self._states(trees, node_ids) if self.policy_features else None
        if not self.text_buckets:
            assert states is not None
            return states
        text = [
            torch.stack([ngram_features(t.token_ids(n), self.text_buckets) for n in nodes])
            if len(nodes)
            else torch.zeros(0, self.text_buckets)
            for t, nodes in zip(trees, node_ids, strict=True)
        ]
        return text if states is None else [torch.cat(pair, dim=1) for pair in zip(states, text, strict=True)]

    def _states(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The policy-state part of every requested row [n_i, policy_width]."""
        reads: dict[tuple[int, int], list[int]] = {}  # (tree, node whose path is run) -> prefixes read on it
        for ti, (tree, nodes) in enumerate(zip(trees, node_ids, strict=True)):
            owner = tree.owner_leaf()
            for n in nodes:
                reads.setdefault((ti, int(owner[n]) if owner[n] >= 0 else n), []).append(n)
        jobs = [(ti, src, prefixes) for (ti, src), prefixes in reads.items()]
        found: dict[tuple[int, int], torch.Tensor] = {}
        for start in range(0, len(jobs), SCORE_BATCH_SIZE):
            found.update(self._read_chunk(trees, jobs[start : start + SCORE_BATCH_SIZE]))
        return [
            torch.stack([found[(ti, n)] for n in nodes]) if len(nodes) else torch.zeros(0, self.policy_width)
            for ti, nodes in enumerate(node_ids)
        ]

    def _read_chunk(
        self, trees: Sequence[RolloutTree], chunk: list[tuple[int, int, list[int]]]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """One forward pass over the chunk's rollouts; the features at every prefix read on them."""
        seqs = [trees[ti].token_ids(src) for ti, src, _ in chunk]
        rows = torch.tensor([r for r, (_, _, prefixes) in enumerate(chunk) for _ in prefixes])
        cols = torch.tensor([len(trees[ti].token_ids(n)) - 1 for ti, _, prefixes in chunk for n in prefixes])
        hidden, offset, before = self._hidden(seqs, int(cols.min()))
        rows, at = rows.to(hidden.device), cols.to(hidden.device)
        picked = gather_positions(hidden, rows, at - offset).float()  # [K, H]
        if self.pooling == "last_mean":
            sums = hidden.cumsum(1) + before  # [B, T - c, H]: sum of the states at positions <= t
            mean = sums[rows, at - offset] / (at[:, None] + 1)  # [K, H]
            picked = torch.cat([picked, mean.float()], dim=1)  # [K, 2H]
        keys = [(ti, n) for ti, _, prefixes in chunk for n in prefixes]
        return dict(zip(keys, picked.cpu(), strict=True))

    def _hidden(self, seqs: list[list[int]], first_read: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Last hidden states for right-padded `seqs` [B, T - c, H] from position c on, and the sum of
        the states at positions 0..c-1 [H] (for mean pooling).

        The chunk's common token prefix, up to the first position read, runs once and its KV cache is
        copied to every row (104 of ~121 tokens per prompt on search_qa); only the rest runs per row.
        Same states, less compute."""
        model, pad = self.model(), self.tokenizer.pad_token_id
        device = next(model.parameters()).device
        shared = min(common_prefix_len(seqs), first_read, min(len(s) for s in seqs) - 1)
        if len(seqs) == 1 or shared < MIN_SHARED_PREFIX:
            ids, mask = right_pad(seqs, pad)
            # logits_to_keep=1: the head reads hidden states only; full-vocabulary logits would be wasted
            out = model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                output_hidden_states=True,
                logits_to_keep=1,
            )
            hidden = out.hidden_states[-1]
            return hidden, 0, torch.zeros(hidden.shape[-1], device=device)
        prefix = torch.tensor([seqs[0][:shared]], device=device)
        cache, first = prefill(model, prefix, hidden_states=True)
        fan_out(cache, torch.zeros(len(seqs), dtype=torch.long, device=device))
        ids, suffix_mask = right_pad([s[shared:] for s in seqs], pad)
        mask = torch.cat([torch.ones(len(seqs), shared, dtype=torch.long), suffix_mask], dim=1)
        positions = shared + torch.arange(ids.shape[1]).expand(len(seqs), -1)
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            output_hidden_states=True,
            logits_to_keep=1,
            **{CACHE_KWARG: cache},
        )
        return out.hidden_states[-1], shared, first.hidden_states[-1][0].sum(0)


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix every sequence starts with."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n
