"""From an iteration's trees to typed training batches.

1. Node advantages for every tree with one estimator (`advantages.Estimator`), under the once-per-node
   rule of `tree.py`: leaf-level estimators hand each node the mean advantage of the leaves below it.
2. One sequence per leaf: the full token path root -> leaf. Its loss mask covers the action tokens of
   the nodes that this leaf owns (each node is owned by exactly one leaf), and its predictor targets
   are the prefixes it owns, read at the last token of each prefix.
3. Right-padded micro-batches (`RolloutBatch`); old log-probs are filled in by the module. A packed
   batch also carries its trees laid out once per node (`packing.py`): the module then runs that
   instead of the per-leaf rows, and maps the results back to the per-leaf layout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trace_lightning.advantages import Estimator, node_advantages
from trace_lightning.packing import PackedRows, budget_groups, pack, packed_tokens, right_pad
from trace_lightning.tree import RolloutTree, predictor_targets


@dataclass(frozen=True)
class LeafSequence:
    tree_index: int
    leaf: int
    token_ids: list[int]  # [T] prompt and every turn down to the leaf
    loss_mask: list[int]  # [T] 1 on the action tokens of the nodes this leaf owns
    advantages: list[float]  # [T] the owning node's advantage on those tokens, 0 elsewhere
    pred_positions: list[int]  # [K] last token of each prefix whose target this sequence carries
    pred_targets: list[float]  # [K] V̂ of those prefixes
    pred_weights: list[float]  # [K] their leaf counts
    engine_logprobs: list[float]  # [T] the engine's log-prob on the trained tokens, NaN elsewhere or unknown


@dataclass
class RolloutBatch:
    """One micro-batch of leaf sequences, right-padded."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] trainable action tokens
    advantages: torch.Tensor  # [B, T]
    old_logprobs: torch.Tensor  # [B, T] log pi_old(token_t | tokens_<t); 0 at t = 0, on padding and, in a
    # packed batch, off the trained tokens (only those are scored)
    pred_rows: torch.Tensor  # [K] sequence index of each predictor target
    pred_cols: torch.Tensor  # [K] token position of each predictor target
    pred_targets: torch.Tensor  # [K]
    pred_weights: torch.Tensor  # [K]
    packed: PackedRows | None = None  # the same sequences tree-packed; None: run the rows as they are


def leaf_sequences(trees: Sequence[RolloutTree], node_adv: Sequence[np.ndarray]) -> list[LeafSequence]:
    out = []
    for ti, (tree, a) in enumerate(zip(trees, node_adv, strict=True)):
        owner = tree.owner_leaf()
        targets = predictor_targets(tree)
        target_of = {
            int(n): (float(v), float(w))
            for n, v, w in zip(targets.node_ids, targets.values, targets.leaf_counts, strict=True)
        }
        for leaf in tree.leaves():
            out.append(_sequence(tree, ti, leaf, owner, a, target_of))
    return out


def _sequence(
    tree: RolloutTree,
    ti: int,
    leaf: int,
    owner: np.ndarray,
    a: np.ndarray,
    target_of: dict[int, tuple[float, float]],
) -> LeafSequence:
    ids, mask, advs = list(tree.prompt_ids), [0] * len(tree.prompt_ids), [0.0] * len(tree.prompt_ids)
    engine = [math.nan] * len(tree.prompt_ids)
    positions, targets, weights = [], [], []

    def add_target(node: int) -> None:
        if owner[node] == leaf and node in target_of:
            positions.append(len(ids) - 1)
            targets.append(target_of[node][0])
            weights.append(target_of[node][1])

    add_target(0)
    for n in tree.path(leaf):
        node = tree.nodes[n]
        owned = owner[n] == leaf
        ids += node.action_ids + node.obs_ids
        mask += [int(owned)] * len(node.action_ids) + [0] * len(node.obs_ids)
        advs += [float(a[n]) if owned else 0.0] * len(node.action_ids) + [0.0] * len(node.obs_ids)
        known = owned and len(node.action_logprobs) == len(node.action_ids)
        engine += (node.action_logprobs if known else [math.nan] * len(node.action_ids)) + [math.nan] * len(
            node.obs_ids
        )
        add_target(n)
    return LeafSequence(ti, leaf, ids, mask, advs, positions, targets, weights, engine)


def collate(seqs: Sequence[LeafSequence], pad_id: int) -> RolloutBatch:
    """Right-pad a list of sequences into one micro-batch."""
    input_ids, attention_mask = right_pad([s.token_ids for s in seqs], pad_id)
    width = input_ids.shape[1]

    def pad(rows: list[list[float]] | list[list[int]], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)

    rows = [i for i, s in enumerate(seqs) for _ in s.pred_positions]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=pad([s.loss_mask for s in seqs], 0, torch.long),
        advantages=pad([s.advantages for s in seqs], 0.0, torch.float32),
        old_logprobs=torch.zeros(len(seqs), width),
        pred_rows=torch.tensor(rows, dtype=torch.long),
        pred_cols=torch.tensor([p for s in seqs for p in s.pred_positions], dtype=torch.long),
        pred_targets=torch.tensor([t for s in seqs for t in s.pred_targets], dtype=torch.float32),
        pred_weights=torch.tensor([w for s in seqs for w in s.pred_weights], dtype=torch.float32),
    )


def collate_packed(seqs: Sequence[LeafSequence], trees: Sequence[RolloutTree], pad_id: int) -> RolloutBatch:
    """`collate`, plus the same sequences tree-packed (`packing.py`): each of their trees' nodes once."""
    batch = collate(seqs, pad_id)
    keys = [(s.tree_index, s.leaf) for s in seqs]
    batch.packed = pack(trees, keys, pad_id, _rows(trees, keys))
    return batch


def _rows(trees: Sequence[RolloutTree], keys: Sequence[tuple[int, int]]) -> list[int]:
    """A packed row per sequence: trees share a row while it stays within the longest tree's length.

    Attention costs the square of a row's length, so one long row of many trees would cost more than
    the trees in rows of their own; short trees (GRPO groups) still fill rows together, with little
    padding. First-fit, longest tree first."""
    leaves: dict[int, list[int]] = {}
    for ti, leaf in keys:
        leaves.setdefault(ti, []).append(leaf)
    size = {ti: packed_tokens(trees[ti], ls) for ti, ls in leaves.items()}
    cap, used, row_of = max(size.values()), list[int](), dict[int, int]()
    for ti in sorted(size, key=lambda t: -size[t]):
        row = next((r for r, u in enumerate(used) if u + size[ti] <= cap), len(used))
        used += [0] if row == len(used) else []
        used[row] += size[ti]
        row_of[ti] = row
    return [row_of[ti] for ti, _ in keys]


# --------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class Batching:
    """How sampled trees become micro-batches (the `data` group's batching keys and the `advantage`
    group's estimator): the one entry point from trees to training batches."""

    micro_batch_size: int  # leaf sequences per micro-batch, used only when micro_batch_tokens is None
    micro_batch_tokens: int | None  # packed tokens per micro-batch (whole trees where they fit)
    estimator: Estimator
    steps: int | None = None  # optimizer steps per iteration (None: one per micro-batch)
    spread: bool = False  # deal each tree's leaves across the steps instead of cutting the leaves in runs

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"data.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"data.micro_batch_tokens={self.micro_batch_tokens} must be >= 1, or null to batch "
                "data.micro_batch_size sequences at a time"
            )
        if self.steps is not None and self.steps < 1:
            raise ValueError(
                f"data.steps_per_iteration={self.steps} must be >= 1, or null for one step per micro-batch"
            )
        if self.spread and self.steps is None:
            raise ValueError(
                "data.spread_trees=true deals leaves across a fixed number of steps: set "
                "data.steps_per_iteration=N too, or drop data.spread_trees"
            )

    def plan(self, trees: Sequence[RolloutTree]) -> list[list[list[LeafSequence]]]:
        """The micro-batches of each optimizer step, each micro-batch its leaf sequences (with node
        advantages).

        With `steps` set, the leaves (in tree order) are split into that many runs of as equal a count
        as they allow, whatever the allocator, so every method makes the same number of optimizer steps;
        each run is then cut into micro-batches of up to `micro_batch_tokens` packed tokens (whole trees
        where they fit, `packing.budget_groups`), or `micro_batch_size` sequences when that is None.
        A step gets no leaves only when there are fewer leaves than steps. With `steps` None, every
        micro-batch is a step of its own.

        With `spread`, the leaves are dealt to the steps like cards instead (leaf i of the iteration, in
        tree order, to step i mod `steps`): the same count per step, but a tree of g leaves reaches
        min(g, steps) steps, so every step holds as many distinct prompts as the iteration allows; a
        step's leaves stay in tree order, so what one tree has there still packs together."""
        seqs = leaf_sequences(trees, node_advantages(trees, self.estimator))
        if self.steps is None:
            return [[chunk] for chunk in self._chunks(trees, seqs)]
        if self.spread:
            return [self._chunks(trees, seqs[s :: self.steps]) for s in range(self.steps)]
        cuts = np.linspace(0, len(seqs), self.steps + 1).round().astype(int)
        return [self._chunks(trees, seqs[a:b]) for a, b in itertools.pairwise(cuts)]

    def _chunks(self, trees: Sequence[RolloutTree], seqs: list[LeafSequence]) -> list[list[LeafSequence]]:
        if not seqs:
            return []
        if self.micro_batch_tokens is not None:
            keys = [(s.tree_index, s.leaf) for s in seqs]
            return [[seqs[j] for j in g] for g in budget_groups(trees, keys, self.micro_batch_tokens)]
        size = self.micro_batch_size
        return [seqs[i : i + size] for i in range(0, len(seqs), size)]


def step_layout(plan: Sequence[Sequence[Sequence[LeafSequence]]], per_step: int) -> list[list[LeafSequence]]:
    """The plan's micro-batches in training order, each step padded with empty ones (which train
    nothing) to `per_step` micro-batches, so that a fixed gradient accumulation of `per_step` ends every
    step where the plan says."""
    return [chunk for step in plan for chunk in [*step, *[[]] * (per_step - len(step))]]


def micro_batches(
    plan: Sequence[Sequence[LeafSequence]],
    trees: Sequence[RolloutTree],
    count: int,
    pad_id: int,
    idle: list[int],
) -> list[RolloutBatch]:
    """`count` micro-batches: the plan's, tree-packed, then batches that train nothing (one `idle` prompt,
    all-zero loss mask) up to `count`, so that every process runs the same number (DDP synchronises
    each backward)."""
    n = len(idle)
    idle_seq = LeafSequence(0, 0, list(idle), [0] * n, [0.0] * n, [], [], [], [math.nan] * n)
    return [collate_packed(c, trees, pad_id) if c else collate([idle_seq], pad_id) for c in plan] + [
        collate([idle_seq], pad_id) for _ in range(count - len(plan))
    ]
