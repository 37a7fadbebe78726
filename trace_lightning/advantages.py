"""Advantage estimators: pure torch functions, each with a plain-loop `*_reference` twin for tests.

Leaf-level estimators (`grpo`, `dr_grpo`, `rloo`, `tree_grpo`) give one advantage per leaf, i.e. per
complete trajectory, from that leaf's reward and the rewards of its group. Tree-level estimators work
per node: `tree_segment` from backed-up node values, and `node_advantages_from_leaves` turns any
leaf-level advantage into a node-level one, because in a tree every node's action tokens are trained
exactly once (see `tree.py`) and so need a single advantage even when several leaves pass through them.

Groups are given as integer labels, one per leaf; labels need not be contiguous or sorted. Statistics
are computed with `torch.unique(return_inverse=True)` and `index_add_`, never a Python loop over groups.

Degenerate groups are defined, never NaN: a group of one leaf, or a group whose rewards are all equal,
carries no contrast, so every leaf in it gets exactly 0.0 from every leaf-level estimator here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from trace_lightning.tree import RolloutTree, backup

# Added to the group standard deviation in `grpo`. Peers differ (TRL 1e-4, verl 1e-6, OpenRLHF 1e-9);
# we follow verl 0.9.1 so its published values are our test goldens. The epsilon only guards the
# division: zero-variance groups are set to exactly 0 explicitly, so it never has to absorb a 0/0.
GRPO_EPS = 1e-6
SHARED_PREFIX = ("mean", "sum")  # how a prefix shared by several leaves is credited (TreeGRPO.shared_prefix)


def _group_index(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense group index per leaf and the size of each group.  # [L], [n_groups]"""
    _, inverse = torch.unique(groups, return_inverse=True)  # [L] in 0..n_groups-1
    counts = torch.bincount(inverse)  # [n_groups]
    return inverse, counts


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of `x` over the leaves of each group.  # [n_groups]"""
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def _group_extreme(x: torch.Tensor, inverse: torch.Tensor, n_groups: int, how: str) -> torch.Tensor:
    """The largest ("amax") or smallest ("amin") of `x` over the leaves of each group.  # [n_groups]"""
    start = -math.inf if how == "amax" else math.inf
    return torch.full((n_groups,), start, dtype=x.dtype, device=x.device).scatter_reduce(0, inverse, x, how)


def _differs(
    x: torch.Tensor, inverse: torch.Tensor, n_groups: int, among: torch.Tensor | None = None
) -> torch.Tensor:
    """Whether two of each group's values differ at all (exactly, not through a variance whose squares
    may underflow), counting only the leaves in `among` where given.  # [n_groups]"""
    high = x if among is None else torch.where(among, x, -math.inf)
    low = x if among is None else torch.where(among, x, math.inf)
    return _group_extreme(high, inverse, n_groups, "amax") > _group_extreme(low, inverse, n_groups, "amin")


def _centred(
    rewards: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """r - group mean, with degenerate groups forced to exactly 0.

    Returns the centred rewards [L], the dense group index of each leaf [L], the group sizes
    [n_groups], and whether each leaf's group has any contrast (>= 2 leaves, not all rewards equal)
    [L]. Forcing degenerate groups to 0 matters because a float mean such as (0.1 + 0.1 + 0.1) / 3
    need not equal 0.1 exactly.
    """
    inverse, counts = _group_index(groups)
    n_groups = counts.numel()
    # Shift each group by its largest reward before averaging: r - max is exact for rewards within a
    # factor of two of each other (Sterbenz), so a group of huge, nearly equal rewards keeps its spread
    # instead of losing it to the mean's rounding, which would break the symmetry of r - mean.
    shifted = rewards - _group_extreme(rewards, inverse, n_groups, "amax")[inverse]  # [L], <= 0
    mean = _group_sum(shifted, inverse, n_groups) / counts.to(rewards.dtype)  # [n_groups]
    # a group has contrast when some reward is below its largest (r - max of distinct floats is never 0);
    # this implies the group has >= 2 leaves
    contrast = (_group_extreme(shifted, inverse, n_groups, "amin") < 0)[inverse]  # [L]
    centred = torch.where(contrast, shifted - mean[inverse], torch.zeros_like(rewards))  # [L]
    return centred, inverse, counts, contrast


def grpo(rewards: torch.Tensor, groups: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO advantage (Shao et al. 2024): (r - group mean) / (group std + eps).

    The std is unbiased (divides by G - 1), as in verl 0.9.1. Groups of one leaf and groups whose
    rewards are all equal give exactly 0.0.

    Example: one group with rewards [1, 0, 0, 1] has mean 0.5 and unbiased std sqrt(1/3) = 0.5774,
    so the advantages are [+0.866, -0.866, -0.866, +0.866].

    Args:
        rewards: [L] float, one reward per leaf.
        groups: [L] long, the group label of each leaf.
        eps: added to the std; see `GRPO_EPS` for the choice.

    Returns:
        [L] advantages, same dtype as `rewards`.
    """
    centred, inverse, counts, contrast = _centred(rewards, groups)
    sq_sum = _group_sum(centred.square(), inverse, counts.numel())  # [n_groups]
    # Clamping G - 1 at 1 only affects size-1 groups, whose centred values are already exactly 0.
    std = (sq_sum / (counts - 1).clamp(min=1).to(rewards.dtype)).sqrt()[inverse]  # [L]
    return torch.where(contrast, centred / (std + eps), torch.zeros_like(rewards))


def dr_grpo(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantage (Liu et al. 2025): r - group mean, with no division by the std.

    Example: rewards [0, 0, 0, 1] in one group -> [-0.25, -0.25, -0.25, +0.75].
    """
    return _centred(rewards, groups)[0]


def rloo(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO advantage (Ahmadian et al. 2024): r - mean of the other members of the group.

    The leave-one-out baseline equals G / (G - 1) * (r - group mean), which is what we compute.
    Example: rewards [0, 0, 0, 1] -> [-1/3, -1/3, -1/3, +1.0]. Groups of one leaf give 0.
    """
    centred, inverse, counts, _ = _centred(rewards, groups)
    sizes = counts[inverse].to(rewards.dtype)  # [L], size of each leaf's group
    # Size-1 groups have centred == 0, so clamping the denominator only avoids a 0/0.
    return centred * sizes / (sizes - 1).clamp(min=1)


def tree_grpo(
    rewards: torch.Tensor,
    local_groups: torch.Tensor,
    global_groups: torch.Tensor,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """Tree-GRPO advantage (Ji et al. 2025): GRPO within the local group plus GRPO within the global one.

    In our trees each prompt has exactly one tree. The local group of a leaf is the subtree of the
    bare rollout it descends from (all leaves below the same depth-1 node: that bare rollout plus the
    continuations branched from its prefixes); the global group is every leaf of the prompt. The local
    term contrasts continuations of a shared prefix, the global term contrasts whole strategies.

    Example: leaves with rewards [1, 0, 1, 1], local groups [0, 0, 1, 1], one global group ->
    local [+0.707, -0.707, 0, 0] + global [+0.5, -1.5, +0.5, +0.5] = [+1.207, -2.207, +0.5, +0.5].
    """
    return grpo(rewards, local_groups, eps) + grpo(rewards, global_groups, eps)


def tree_grpo_bounded(
    rewards: torch.Tensor,
    local_groups: torch.Tensor,
    global_groups: torch.Tensor,
    bare: torch.Tensor,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """Tree-GRPO whose prompt term is measured on the bare rollouts and whose subtree term is bounded.

    Prompt term: (r - m) / (s + eps) for every leaf of the prompt, with m and s the mean and unbiased std
    of the prompt's *bare* leaves only (0 for the whole prompt when those have no contrast). Bare
    rollouts are an unbiased sample of the prompt; continuations are not (Stage 2 sends them where a
    flip is likely), so counting them in the baseline would make a rare flip among near-copies look
    rarer than the prompt's own success rate says. Subtree term: r - the subtree's mean, not divided by
    its std: the value difference of taking this continuation from its prefix, in [-1, 1], as TreeRL's
    segment advantage is. With no continuation the result is GRPO over the bare rollouts.

    Example: bare leaves [1, 0] and one continuation of the first (reward 0): prompt term m = 0.5,
    s = 0.707 -> [+0.707, -0.707, -0.707]; subtree term (leaves 0 and 2 share a subtree) [+0.5, 0, -0.5];
    sum [+1.207, -0.707, -1.207]. A rare flip among near-copies: bare [1, 1] and three continuations of
    the first, [1, 1, 0]: no prompt term (the bare pair agrees), the flip gets -0.75 and its subtree's
    successes +0.25 each, where plain `tree_grpo` gives the flip -1.79 - 1.50 = -3.29.

    Args:
        rewards: [L] float; local_groups, global_groups: [L] long, as in `tree_grpo`.
        bare: [L] bool, whether each leaf ends a bare rollout (not a continuation).
    """
    return bare_prompt_term(rewards, global_groups, bare, eps) + dr_grpo(rewards, local_groups)


def bare_prompt_term(
    rewards: torch.Tensor, global_groups: torch.Tensor, bare: torch.Tensor, eps: float = GRPO_EPS
) -> torch.Tensor:
    """`tree_grpo_bounded`'s prompt term [L]: (r - m) / (s + eps) with m, s the mean and unbiased std of
    the group's bare leaves (0 for the whole group when those have no contrast)."""
    inverse, counts = _group_index(global_groups)
    n = counts.numel()
    weight = bare.to(rewards.dtype)  # [L]
    n_bare = _group_sum(weight, inverse, n)  # [n_groups]
    mean = _group_sum(rewards * weight, inverse, n) / n_bare.clamp(min=1)  # [n_groups]
    sq = _group_sum((rewards - mean[inverse]).square() * weight, inverse, n)  # [n_groups]
    std = (sq / (n_bare - 1).clamp(min=1)).sqrt()  # [n_groups]
    contrast = _differs(rewards, inverse, n, among=bare)  # [n_groups]: two bare leaves that differ
    return torch.where(contrast[inverse], (rewards - mean[inverse]) / (std[inverse] + eps), 0.0)  # [L]


def tree_segment(
    values: torch.Tensor,
    parents: torch.Tensor,
    roots: torch.Tensor,
    leaf_counts: torch.Tensor,
    scale_by_leaves: bool = False,
) -> torch.Tensor:
    """Node advantage from backed-up values (TreeRL-style, Hou et al. 2025).

    For the tokens of turn s: A(s) = [V̂(s) - V̂(parent(s))] + [V̂(s) - V̂(root)]. The first term is
    the local gain of taking this turn from its prefix, the second the gain over the prompt's average.
    Root nodes (parent == -1) get 0. With `scale_by_leaves`, A(s) is divided by sqrt(leaf_counts[s]),
    as in TreeRL, so that nodes shared by many leaves do not dominate the update.

    Several trees may be concatenated in one call; `roots` says which root each node belongs to.
    V̂ is NaN for a node with no leaf below it (see `tree.backup`). Such nodes should not occur in a
    finished tree, but if they do they get 0: they have no trajectory to train. A node with a leaf
    below always has finite parent and root values, since those subtrees contain the same leaf.

    Example: root value 0.5, turn 1 value 1.0 (its parent is the root), turn 2 value 0.0 with parent
    turn 1 -> A = [0, (1 - 0.5) + (1 - 0.5), (0 - 1) + (0 - 0.5)] = [0, 1.0, -1.5].

    Args:
        values: [n_nodes] float, V̂ per node (mean leaf reward of its subtree).
        parents: [n_nodes] long, parent index, -1 for roots.
        roots: [n_nodes] long, index of each node's root.
        leaf_counts: [n_nodes] long, number of leaves in each node's subtree.
        scale_by_leaves: divide by sqrt(leaf_counts).

    Returns:
        [n_nodes] advantages.
    """
    parent_values = values[parents.clamp(min=0)]  # [n_nodes]; roots read themselves, masked below
    adv = (values - parent_values) + (values - values[roots])  # [n_nodes]
    if scale_by_leaves:
        adv = adv / leaf_counts.clamp(min=1).to(values.dtype).sqrt()
    trainable = (parents >= 0) & (leaf_counts > 0)  # [n_nodes]
    return torch.where(trainable, adv, torch.zeros_like(adv))


def branch_weights(parents: np.ndarray) -> np.ndarray:
    """Each node's share of one trajectory's weight [n_nodes]: 1 for a first turn (each is one sample
    from the prompt, as a GRPO rollout is), and below that the parent's share split evenly over its
    children, w(s) = w(parent(s)) / children(parent(s)).

    A turn prefix with its bare turn and k continuations has k + 1 samples of the next turn where the
    policy's own distribution visits that state once; weighting each one's prompt-level credit by
    1 / (k + 1) keeps it at the scale of the bare rollout it grew from (`TreeGRPO.branch_weight`), so
    copies of a decided prefix (k continuations that all end like the bare rollout) cannot outweigh
    the rest of the batch.

    Example: root 0 -> turn 1 -> turns 2 (bare), 3 and 4 (continuations of turn 1); turn 2 -> turns 5
    (bare) and 6 -> weights [1, 1, 1/3, 1/3, 1/3, 1/6, 1/6].

    Args:
        parents: [n_nodes] long, parent index, -1 for roots; parents[i] < i.
    """
    parents = np.asarray(parents, dtype=np.int64)
    children = np.bincount(parents[parents >= 0], minlength=len(parents))  # [n_nodes]
    depth = np.zeros(len(parents), dtype=np.int64)  # [n_nodes]
    up = parents.copy()
    while (up >= 0).any():  # one step per level: every node still below a root climbs together
        depth += up >= 0
        up = np.where(up >= 0, parents[np.maximum(up, 0)], -1)
    weight = np.ones(len(parents))  # [n_nodes]
    for d in range(2, int(depth.max(initial=0)) + 1):  # parents are shallower, so already weighted
        at = np.flatnonzero(depth == d)
        weight[at] = weight[parents[at]] / children[parents[at]]
    return weight


def node_advantages_from_leaves(
    parents: torch.Tensor, leaf_index: torch.Tensor, leaf_adv: torch.Tensor, reduce: str = "mean"
) -> torch.Tensor:
    """Node advantage = mean advantage of the leaves in the node's subtree (the once-per-node rule).

    A node's tokens are trained once, yet every leaf below it judged them, so they take the mean of
    those leaves' advantages. For a leaf itself this is its own advantage; nodes with no leaf below
    get 0. `reduce="sum"` gives the sum instead: the weight the node's tokens would get if every leaf's
    sequence trained them (once per leaf), so a prefix shared by k leaves weighs k times more.
    Requires parents[i] < i for every non-root node (true for ids in creation order, and kept when
    trees are concatenated with offsets), which guarantees the upward walk ends.

    Vectorised over leaves: all leaves climb one level at a time together (`cur = parents[cur]`), each
    step adding every leaf's advantage to the node it currently stands on, so the loop runs once per
    level of depth, not once per node.

    Example: root 0 -> node 1 -> leaves 2 (adv +1) and 3 (adv -0.5) -> node 1 gets 0.25.

    Args:
        parents: [n_nodes] long, parent index, -1 for roots.
        leaf_index: [L] long, node id of each leaf.
        leaf_adv: [L] float, advantage of each leaf.
        reduce: "mean" (once per node) or "sum" (the weight of once per leaf).

    Returns:
        [n_nodes] node advantages, dtype of `leaf_adv`.
    """
    if reduce not in SHARED_PREFIX:
        raise ValueError(f"advantage.shared_prefix={reduce!r}: use one of {list(SHARED_PREFIX)}")
    n = parents.numel()
    ids = torch.arange(n, device=parents.device)  # [n_nodes]
    if bool((parents >= ids).any()):
        raise ValueError("node_advantages_from_leaves needs parents[i] < i: number nodes in creation order")
    sums = torch.zeros(n, dtype=leaf_adv.dtype, device=leaf_adv.device)  # [n_nodes]
    counts = torch.zeros(n, dtype=leaf_adv.dtype, device=leaf_adv.device)  # [n_nodes]
    cur, adv = leaf_index, leaf_adv  # [L'], the leaves still climbing and their advantages
    while cur.numel() > 0:
        sums.index_add_(0, cur, adv)
        counts.index_add_(0, cur, torch.ones_like(adv))
        cur = parents[cur]  # [L'], one level up; roots step to -1
        alive = cur >= 0
        cur, adv = cur[alive], adv[alive]
    if reduce == "sum":
        return sums  # 0 where no leaf is below
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))


# ---------------------------------------------------------------------------------------------------
# Plain-loop references: the same definitions written the obvious way, used only to check the above.
# ---------------------------------------------------------------------------------------------------


def _members(groups: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups.tolist()):
        out[g].append(i)
    return out


def _leaf_reference(rewards: torch.Tensor, groups: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    r = rewards.tolist()
    out = [0.0] * len(r)
    for idx in _members(groups).values():
        vals = [r[i] for i in idx]
        g = len(vals)
        if g < 2 or min(vals) == max(vals):
            continue  # no contrast: every member keeps 0.0
        mean = sum(vals) / g
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (g - 1))
        for i in idx:
            if kind == "grpo":
                out[i] = (r[i] - mean) / (std + eps)
            elif kind == "dr_grpo":
                out[i] = r[i] - mean
            else:  # rloo: baseline is the mean of the other g - 1 members
                out[i] = r[i] - (sum(vals) - r[i]) / (g - 1)
    return torch.tensor(out, dtype=rewards.dtype)


def grpo_reference(rewards: torch.Tensor, groups: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    return _leaf_reference(rewards, groups, "grpo", eps)


def dr_grpo_reference(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return _leaf_reference(rewards, groups, "dr_grpo", 0.0)


def rloo_reference(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return _leaf_reference(rewards, groups, "rloo", 0.0)


def tree_grpo_reference(
    rewards: torch.Tensor,
    local_groups: torch.Tensor,
    global_groups: torch.Tensor,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    return grpo_reference(rewards, local_groups, eps) + grpo_reference(rewards, global_groups, eps)


def tree_grpo_bounded_reference(
    rewards: torch.Tensor,
    local_groups: torch.Tensor,
    global_groups: torch.Tensor,
    bare: torch.Tensor,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    r, is_bare = rewards.tolist(), bare.tolist()
    out = dr_grpo_reference(rewards, local_groups).tolist()
    for idx in _members(global_groups).values():
        base = [r[i] for i in idx if is_bare[i]]
        if len(base) < 2 or min(base) == max(base):
            continue  # the bare rollouts carry no contrast: no prompt term
        mean = sum(base) / len(base)
        std = math.sqrt(sum((v - mean) ** 2 for v in base) / (len(base) - 1))
        for i in idx:
            out[i] += (r[i] - mean) / (std + eps)
    return torch.tensor(out, dtype=rewards.dtype)


def tree_segment_reference(
    values: torch.Tensor,
    parents: torch.Tensor,
    roots: torch.Tensor,
    leaf_counts: torch.Tensor,
    scale_by_leaves: bool = False,
) -> torch.Tensor:
    v, p, rt, c = values.tolist(), parents.tolist(), roots.tolist(), leaf_counts.tolist()
    out = [0.0] * len(v)
    for s in range(len(v)):
        if p[s] < 0 or c[s] == 0:
            continue
        a = (v[s] - v[p[s]]) + (v[s] - v[rt[s]])
        out[s] = a / math.sqrt(c[s]) if scale_by_leaves else a
    return torch.tensor(out, dtype=values.dtype)


def node_advantages_from_leaves_reference(
    parents: torch.Tensor, leaf_index: torch.Tensor, leaf_adv: torch.Tensor
) -> torch.Tensor:
    p = parents.tolist()
    sums, counts = [0.0] * len(p), [0] * len(p)
    for leaf, a in zip(leaf_index.tolist(), leaf_adv.tolist(), strict=True):
        node = leaf
        while node >= 0:  # walk from the leaf up to its root, inclusive
            sums[node] += a
            counts[node] += 1
            node = p[node]
    out = [s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)]
    return torch.tensor(out, dtype=leaf_adv.dtype)


# --------------------------------------------------------------------------- estimators over trees
# What the `advantage` config group selects (conf/advantage/*.yaml): each applies one of the functions
# above to an iteration's trees and returns every node's advantage.


def _forest(trees: Sequence[RolloutTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenated parents (offset, -1 at roots), per-node tree index and node offsets per tree."""
    offsets = np.cumsum([0, *(len(t.nodes) for t in trees)])
    parents = np.concatenate(
        [np.where(t.parents() >= 0, t.parents() + o, -1) for t, o in zip(trees, offsets, strict=False)]
    )
    tree_of = np.concatenate([np.full(len(t.nodes), i) for i, t in enumerate(trees)])
    return parents, tree_of, offsets


class Estimator(Protocol):
    """Node advantages of every node of every tree (one array per tree, root = 0). The `advantage`
    config group selects one by `_target_` (conf/advantage/*.yaml)."""

    name: str

    def __call__(self, trees: Sequence[RolloutTree]) -> list[np.ndarray]: ...


def _per_tree(trees: Sequence[RolloutTree], offsets: np.ndarray, flat: torch.Tensor) -> list[np.ndarray]:
    flat_np = flat.numpy()
    return [flat_np[offsets[i] : offsets[i + 1]] for i in range(len(trees))]


def _from_leaves(
    trees: Sequence[RolloutTree], leaf_advantages: Callable[..., torch.Tensor], reduce: str = "mean"
) -> list[np.ndarray]:
    """A leaf-level estimator's advantages, handed to the nodes under the once-per-node rule (`reduce`:
    see `node_advantages_from_leaves`). `leaf_advantages(rewards [L], prompt groups [L], first-turn
    groups [L], bare [L])` -> [L], `bare` saying which leaves end a bare rollout."""
    if not trees:
        return []
    parents, tree_of, offsets = _forest(trees)
    leaf_ids = np.concatenate(
        [np.array(t.leaves(), dtype=np.int64) + o for t, o in zip(trees, offsets, strict=False)]
    )
    rewards = torch.tensor(
        [n.reward for t in trees for n in t.nodes if n.reward is not None], dtype=torch.float64
    )
    groups = torch.tensor(tree_of[leaf_ids])
    local = torch.tensor(_depth_one_ancestor(parents, leaf_ids))
    bare = torch.tensor([t.nodes[i].stage == "bare" for t in trees for i in t.leaves()], dtype=torch.bool)
    leaf_adv = leaf_advantages(rewards, groups, local, bare)
    flat = node_advantages_from_leaves(torch.tensor(parents), torch.tensor(leaf_ids), leaf_adv, reduce)
    return _per_tree(trees, offsets, flat)


def _prompt_groups(
    trees: Sequence[RolloutTree], leaf_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[np.ndarray]:
    """A leaf-level estimator over each prompt's leaves: `leaf_fn(rewards [L], groups [L]) -> [L]`."""
    return _from_leaves(trees, lambda r, groups, *_: leaf_fn(r, groups))


@dataclass(frozen=True)
class GRPO:
    """Leaf reward standardised within its prompt's leaves (`advantages.grpo`)."""

    name = "grpo"

    def __call__(self, trees: Sequence[RolloutTree]) -> list[np.ndarray]:
        return _prompt_groups(trees, grpo)


@dataclass(frozen=True)
class DrGRPO:
    """Leaf reward centred within its prompt's leaves, no std division (`advantages.dr_grpo`)."""

    name = "dr_grpo"

    def __call__(self, trees: Sequence[RolloutTree]) -> list[np.ndarray]:
        return _prompt_groups(trees, dr_grpo)


@dataclass(frozen=True)
class RLOO:
    """Leaf reward minus the mean of its prompt's other leaves (`advantages.rloo`)."""

    name = "rloo"

    def __call__(self, trees: Sequence[RolloutTree]) -> list[np.ndarray]:
        return _prompt_groups(trees, rloo)


@dataclass(frozen=True)
class TreeGRPO:
    """GRPO within the leaf's first-turn subtree plus GRPO within the prompt (`advantages.tree_grpo`).

    `shared_prefix`: a prefix shared by k leaves trains once with the mean of their advantages ("mean",
    the default) or with their sum ("sum": the weight it would have if each leaf's sequence trained it).
    `bounded`: the prompt term's mean and std come from the bare rollouts only and the subtree term is
    centred, not standardised (`advantages.tree_grpo_bounded`), so a rare flip among near-copies gets a
    bounded advantage instead of one that grows with the number of copies.
    `branch_weight`: the prompt term of every node is scaled by its `branch_weights` share, so the turns
    sampled from one prefix (its bare turn and the continuations started there) together carry the
    prompt-level credit of one trajectory's turn; the subtree term, the contrast the tree itself
    measured between those samples, keeps its full weight. k continuations that all end like their bare
    rollout add no subtree term, and so no more weight than the bare rollout alone."""

    shared_prefix: str = "mean"
    bounded: bool = False
    branch_weight: bool = False
    name = "tree_grpo"

    def __post_init__(self) -> None:
        if self.shared_prefix not in SHARED_PREFIX:
            raise ValueError(
                f"advantage.shared_prefix={self.shared_prefix!r}: use one of {list(SHARED_PREFIX)}"
            )

    def __call__(self, trees: Sequence[RolloutTree]) -> list[np.ndarray]:
        if not self.branch_weight:
            if self.bounded:
                return _from_leaves(
                    trees, lambda r, g, local, bare: tree_grpo_bounded(r, local, g, bare), self.shared_prefix
                )
            return _from_leaves(trees, lambda r, g, local, _: tree_grpo(r, local, g), self.shared_prefix)
        if self.bounded:  # the two terms of tree_grpo_bounded, then of tree_grpo
            prompt_fn, subtree_fn = (lambda r, g, _, bare: bare_prompt_term(r, g, bare)), dr_grpo
        else:
            prompt_fn, subtree_fn = (lambda r, g, *_: grpo(r, g)), grpo
        prompt = _from_leaves(trees, prompt_fn, self.shared_prefix)
        subtree = _from_leaves(trees, lambda r, _, local, __: subtree_fn(r, local), self.shared_prefix)
        return [s + p * branch_weights(t.parents()) for p, s, t in zip(prompt, subtree, trees, strict=True)]


@dataclass(frozen=True)
class TreeSegment:
    """Per node from backed-up values: [V̂(s) - V̂(parent)] + [V̂(s) - V̂(root)] (`advantages.tree_segment`);
    `scale_by_leaves` divides by sqrt(leaves below), as TreeRL does."""

    scale_by_leaves: bool = False
    name = "tree_segment"

    def __call__(self, trees: Sequence[RolloutTree]) -> list[np.ndarray]:
        if not trees:
            return []
        parents, tree_of, offsets = _forest(trees)
        backups = [backup(t) for t in trees]
        values = torch.tensor(np.concatenate([b.value for b in backups]))
        roots = torch.tensor(offsets[tree_of])
        leaves = torch.tensor(np.concatenate([b.leaves for b in backups]))
        flat = tree_segment(values, torch.tensor(parents), roots, leaves, self.scale_by_leaves)
        return _per_tree(trees, offsets, flat)


# Every estimator by name: for benchmarks' command-line flags and tests that try them all. The trainer
# selects one by `_target_` (conf/advantage/*.yaml), not by this table.
ESTIMATORS: dict[str, Callable[[], Estimator]] = {
    e.name: e for e in (GRPO, DrGRPO, RLOO, TreeGRPO, TreeSegment)
}


def node_advantages(trees: Sequence[RolloutTree], estimator: Estimator) -> list[np.ndarray]:
    """Advantage of every node of every tree (one array per tree, root = 0)."""
    return estimator(trees)


def _depth_one_ancestor(parents: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The first-turn node above each node: which bare rollout (or root continuation) it descends from."""
    out = nodes.copy()
    while True:
        up = parents[out]
        climbing = (up >= 0) & (parents[np.maximum(up, 0)] >= 0)
        if not climbing.any():
            return out
        out = np.where(climbing, up, out)
