"""Pure rollout allocators: how a fixed leaf budget is spread over prompts (Stage 1) and over the turn
prefixes of their bare rollouts (Stage 2).  See docs/algorithm.md#stage-1-roots and #stage-2-prefixes.

An allocator is a `TreeAllocator`: a root rule plus, optionally, a prefix rule and the continuation
multiplier N.  With N > 0 the leaf budget L splits into M = L / (1 + N) bare rollouts and, per prompt
i, m_i * N continuations, so every allocator spends exactly the same number of leaves.

Budget rules (never a silent change):
  * L must be a multiple of (1 + N), and of group_size * (1 + N) for fixed-group root rules;
  * a pool with fewer candidates than the root rule needs raises `BudgetError`;
  * a root budget smaller than one minimal group raises `BudgetError`;
  * a prompt whose bare rollouts all ended after one turn has no turn prefix to branch from; its
    m_i * N continuations then start from the prompt itself (more rollouts of the same prompt), so
    the budget is still spent in full and Stage 2 stays local to each prompt (see `iteration.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from trace_lightning.budget import Budget, BudgetError
from trace_lightning.pricing import Pricing

# Predictions are clipped away from 0 and 1 so that every gain stays strictly positive: a saturated
# predictor then still prefers the least-decided anchor instead of an arbitrary one.
PROB_EPS = 1e-4


# --------------------------------------------------------------------------- Stage 1: roots


def v_root(v: np.ndarray, m: np.ndarray) -> np.ndarray:
    """P(m rollouts of a prompt with success probability v are mixed) = 1 - v^m - (1-v)^m for m >= 2.

    m = 0 and m = 1 can never be mixed, so both are exactly 0 (the formula would give -1 at m = 0,
    which once made the program charge every skipped prompt and open as many groups as it could).
    """
    v, m = np.asarray(v, dtype=np.float64), np.asarray(m)
    return np.asarray(np.where(m >= 2, 1.0 - v**m - (1.0 - v) ** m, 0.0), dtype=np.float64)


# V_root(v, 2) / 2 = V_root(v, 3) / 3 = v(1 - v): groups of 2 and 3 tie per rollout, so many optima
# exist. A bonus far below any real difference in the objective makes the program pick, among
# (numerically) equal optima, the one that trains the most prompts: more prompts is more contrast per
# batch for the same expected number of mixed groups.
BREADTH_TIE_BREAK = 1e-9


def solve_roots(
    predicted: np.ndarray,
    n_roots: int,
    min_group: int = 2,
    max_per_prompt: int | None = 16,
    leaves_per_root: int = 1,
    breadth: float = 0.0,
) -> np.ndarray:
    """Exact Stage 1: integer m_i in {0} ∪ [min_group, cap] with sum m_i = n_roots maximising
    sum V_root(v_i, leaves_per_root * m_i), by dynamic programming over the budget
    (docs/algorithm.md#stage-1-roots: a plain greedy is not exact because of the first block of
    `min_group` rollouts).

    `breadth` >= 0 adds that much to the objective for every prompt trained (our choice, 0 = the paper's
    objective): a hedge against a predictor whose confident estimates would concentrate the budget on
    a few prompts. `leaves_per_root` = 1 + N counts the continuations each bare rollout brings to its prompt
    (our choice, off by default): the prompt's tree is mixed when any of its leaves differ.

    O(P * n_roots * cap) with one vectorised step per prompt. Among optima the one with the most
    prompts wins (`BREADTH_TIE_BREAK`); remaining ties give the later prompt the smaller count (the
    backward pass decides the last prompt first, taking its smallest tied size), so the result is a
    deterministic function of the input order. E.g. v = [0.5, 0.5], n_roots = 5 -> [3, 2].

    Example: v = [0.5, 0.9, 0.5], n_roots = 4, min_group = 2 -> [2, 0, 2]
    (two groups of 2 at v = 0.5 give 0.5 + 0.5; a group of 4 at v = 0.5 gives only 0.875).
    """
    v = np.clip(np.asarray(predicted, dtype=np.float64), PROB_EPS, 1.0 - PROB_EPS)  # [P]
    cap = n_roots if max_per_prompt is None else min(max_per_prompt, n_roots)
    _check_root_budget(len(v), n_roots, min_group, cap)
    sizes = np.concatenate([[0], np.arange(min_group, cap + 1)])  # [S]
    gains = v_root(v[:, None], leaves_per_root * sizes[None, :])  # [P, S]
    gains = gains + (breadth + BREADTH_TIE_BREAK) * (sizes[None, :] > 0)
    counts = solve_counts(gains, sizes, n_roots)
    if counts is None:
        raise BudgetError(
            f"cannot split {n_roots} root rollouts into groups of {min_group}..{cap} over {len(v)} "
            "prompts; change budget.leaves or allocator.max_per_prompt"
        )
    return counts


def solve_counts(gains: np.ndarray, sizes: np.ndarray, total: int) -> np.ndarray | None:
    """The exact separable integer program behind Stage 1 and Knapsack RL: one size per item from
    `sizes` [S] with the sizes summing to `total`, maximising sum gains[i, size index] ([P, S]), by
    dynamic programming over the budget. None when no choice sums to `total`.

    O(P * total * S) with one vectorised step per item. Ties give the later item the smaller size (the
    backward pass decides the last item first, taking its smallest tied size), so the result is a
    deterministic function of the input order."""
    budget_idx = np.arange(total + 1)  # [B]
    prev = budget_idx[None, :] - sizes[:, None]  # [S, B] budget before adding this item
    valid = prev >= 0
    best = np.full(total + 1, -np.inf)  # best[b]: max objective using exactly b so far
    best[0] = 0.0
    choice = np.zeros((len(gains), total + 1), dtype=np.int64)  # [P, B] index into sizes
    for i in range(len(gains)):
        cand = np.where(valid, best[np.maximum(prev, 0)] + gains[i][:, None], -np.inf)  # [S, B]
        choice[i] = cand.argmax(axis=0)
        best = cand.max(axis=0)
    if not np.isfinite(best[total]):
        return None
    counts = np.zeros(len(gains), dtype=np.int64)
    b = total
    for i in range(len(gains) - 1, -1, -1):
        counts[i] = sizes[choice[i, b]]
        b -= counts[i]
    return counts


def knapsack_value(v: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Knapsack RL's value of m rollouts of a prompt with success probability v (Li et al., "Knapsack RL",
    ICML 2026): P(the group is mixed) times v (1 - v)^2, their measure of what one informative group
    is worth to the gradient, which favours prompts the policy still mostly fails."""
    v = np.asarray(v, dtype=np.float64)
    return np.asarray(v_root(v, m) * v * (1.0 - v) ** 2, dtype=np.float64)


def _check_root_budget(pool: int, n_roots: int, min_group: int, cap: int) -> None:
    if min_group < 1:
        raise BudgetError(f"allocator.min_group={min_group} must be >= 1")
    if n_roots < min_group:
        raise BudgetError(
            f"{n_roots} root rollouts is less than one minimal group (allocator.min_group="
            f"{min_group}); raise budget.leaves or lower allocator.expansion"
        )
    if pool * cap < n_roots:
        raise BudgetError(
            f"candidate pool of {pool} prompts x allocator.max_per_prompt={cap} < {n_roots} root "
            "rollouts; raise data.pool_size or allocator.max_per_prompt"
        )


# --------------------------------------------------------------------------- Stage 2: prefixes


@dataclass(frozen=True)
class PrefixCandidate:
    """A non-leaf turn prefix of a bare rollout: where a continuation may start."""

    node_id: int
    success: bool  # outcome of the bare rollout this prefix lies on (r_ij)
    predicted: float  # Ṽ(H_ijt)


def repeat_prob(candidates: Sequence[PrefixCandidate]) -> np.ndarray:
    """q = r V + (1 - r)(1 - V): P(a continuation repeats the bare rollout's outcome).  # [C]"""
    v = np.clip([c.predicted for c in candidates], PROB_EPS, 1.0 - PROB_EPS)
    r = np.array([c.success for c in candidates], dtype=np.float64)
    return np.asarray(r * v + (1.0 - r) * (1.0 - v), dtype=np.float64)


def solve_prefixes(q: np.ndarray, budget: int) -> np.ndarray:
    """Exact Stage 2 for one prompt: k_c >= 0 with sum k_c = budget maximising sum (1 - q_c^k_c).

    The k-th continuation at c gains q^(k-1)(1 - q), decreasing in k, so taking the best marginal
    gain each time (a heap) is optimal. Ties go to the lower candidate index.
    """
    counts = np.zeros(len(q), dtype=np.int64)
    if budget <= 0 or len(q) == 0:
        return counts
    heap = [(-(1.0 - float(qc)), c) for c, qc in enumerate(q)]
    heapq.heapify(heap)
    for _ in range(budget):
        _, c = heapq.heappop(heap)
        counts[c] += 1
        heapq.heappush(heap, (-(float(q[c]) ** counts[c]) * (1.0 - float(q[c])), c))
    return counts


# --------------------------------------------------------------------------- rules and allocators


class RootRule(Protocol):
    def __call__(self, predicted: np.ndarray, n_roots: int, rng: np.random.Generator) -> np.ndarray:
        """Bare rollouts per candidate prompt.  # [P] int, sums to n_roots"""
        ...


class PrefixRule(Protocol):
    def __call__(
        self, candidates: Sequence[PrefixCandidate], budget: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Continuations per candidate prefix of one prompt.  # [C] int, sums to budget"""
        ...


@dataclass(frozen=True)
class UniformRoots:
    """GRPO: `n_roots / group_size` prompts drawn uniformly from the pool, `group_size` each.

    `spread`: any `n_roots` >= 1 splits, the remainder one more rollout each for the first groups drawn
    (10 as groups of 4 -> 4 + 1, 4 + 1; 3 -> one group of 3; never more groups than prompts), so a
    budget need not be a multiple of the group size (TRACE's closed rule: its budgets are split by
    1 + N, not by (1 + N) * group_size)."""

    group_size: int = 4
    spread: bool = False

    def __call__(self, predicted: np.ndarray, n_roots: int, rng: np.random.Generator) -> np.ndarray:
        size, extra = self.group_size, 0
        if self.spread and n_roots >= 1 and len(predicted):  # at most one group per prompt
            n_groups = min(max(n_roots // size, 1), len(predicted))
            size, extra = n_roots // n_groups, n_roots % n_groups
        else:
            n_groups = _n_groups(len(predicted), n_roots, size)
        chosen = rng.choice(len(predicted), size=n_groups, replace=False)
        counts = np.zeros(len(predicted), dtype=np.int64)
        counts[chosen] = size
        counts[chosen[:extra]] += 1
        return counts


@dataclass(frozen=True)
class ClosestToHalfRoots:
    """PCL: the prompts whose predicted success is closest to 0.5, `group_size` rollouts each."""

    group_size: int = 4

    def __call__(self, predicted: np.ndarray, n_roots: int, rng: np.random.Generator) -> np.ndarray:
        n = _n_groups(len(predicted), n_roots, self.group_size)
        order = np.lexsort((np.arange(len(predicted)), np.abs(np.asarray(predicted) - 0.5)))
        counts = np.zeros(len(predicted), dtype=np.int64)
        counts[order[:n]] = self.group_size
        return counts


@dataclass(frozen=True)
class ActiveRoots:
    """TRACE Stage 1: the exact V_root optimum (`solve_roots`)."""

    min_group: int = 2
    max_per_prompt: int | None = 16
    leaves_per_root: int = 1  # 1 + N to count each bare rollout's continuations in V_root (our choice)
    breadth: float = 0.0  # objective bonus per trained prompt (our choice)

    def __call__(self, predicted: np.ndarray, n_roots: int, rng: np.random.Generator) -> np.ndarray:
        return solve_roots(
            predicted, n_roots, self.min_group, self.max_per_prompt, self.leaves_per_root, self.breadth
        )


@dataclass(frozen=True)
class KnapsackRoots:
    """Knapsack RL (Li et al., ICML 2026) on our predictions: `n_roots / group_size` prompts drawn
    uniformly from the pool, as GRPO trains, each given `min_group` rollouts; the rest of the budget goes
    where `knapsack_value` gains most (exact, `solve_counts`), at most `max_per_prompt` per prompt."""

    group_size: int = 4
    min_group: int = 2
    max_per_prompt: int = 16

    def __call__(self, predicted: np.ndarray, n_roots: int, rng: np.random.Generator) -> np.ndarray:
        cap = min(self.max_per_prompt, n_roots)
        if not 1 <= self.min_group <= self.group_size <= cap:  # refused before any draw from `rng`
            raise BudgetError(
                f"allocator.min_group={self.min_group} <= group_size={self.group_size} <= max_per_prompt="
                f"{self.max_per_prompt} must hold (the knapsack splits what GRPO would spend)"
            )
        n_groups = _n_groups(len(predicted), n_roots, self.group_size)
        chosen = rng.choice(len(predicted), size=n_groups, replace=False)
        v = np.clip(np.asarray(predicted, dtype=np.float64)[chosen], PROB_EPS, 1.0 - PROB_EPS)  # [G]
        sizes = np.arange(self.min_group, cap + 1)  # [S]
        gains = knapsack_value(v[:, None], sizes[None, :])  # [G, S]
        picked = solve_counts(gains, sizes, n_roots)
        assert picked is not None, "min_group <= group_size <= cap always admits a split"
        counts = np.zeros(len(predicted), dtype=np.int64)
        counts[chosen] = picked
        return counts


@dataclass(frozen=True)
class RandomPrefixes:
    """TreePO / Tree-GRPO style: each continuation starts at a uniformly random candidate prefix."""

    def __call__(
        self, candidates: Sequence[PrefixCandidate], budget: int, rng: np.random.Generator
    ) -> np.ndarray:
        if not candidates:
            return np.zeros(0, dtype=np.int64)
        return np.bincount(rng.integers(len(candidates), size=budget), minlength=len(candidates))


@dataclass(frozen=True)
class ActivePrefixes:
    """TRACE Stage 2: the exact V_pref optimum (`solve_prefixes`)."""

    def __call__(
        self, candidates: Sequence[PrefixCandidate], budget: int, rng: np.random.Generator
    ) -> np.ndarray:
        return solve_prefixes(repeat_prob(candidates), budget)


def _n_groups(pool: int, n_roots: int, group_size: int) -> int:
    if group_size < 1:
        raise BudgetError(f"allocator.group_size={group_size} must be >= 1")
    if n_roots % group_size:
        raise BudgetError(
            f"{n_roots} root rollouts is not a multiple of allocator.group_size={group_size}; "
            "make budget.leaves a multiple of group_size * (1 + expansion)"
        )
    if n_roots // group_size > pool:
        raise BudgetError(
            f"{n_roots // group_size} groups of {group_size} need that many prompts but the candidate "
            f"pool has {pool}; raise data.pool_size or lower budget.leaves"
        )
    return n_roots // group_size


@dataclass(frozen=True)
class TreeAllocator:
    """A root rule, an optional prefix rule and the continuation multiplier N (`expansion`)."""

    name: str
    roots: RootRule
    prefixes: PrefixRule | None = None
    expansion: int = 0
    # GRPO's equal groups while the predictor has no measured skill (selection.gate_skill): with the gate
    # closed the whole budget is bare rollouts under this rule and Stage 2 does not run (`closes`).
    closed: RootRule | None = None
    pricing: Pricing | None = None  # Stage 2 priced in tokens (pricing.py) instead of m_i * N per prompt

    def __post_init__(self) -> None:
        if self.expansion < 0:
            raise BudgetError(f"allocator.expansion={self.expansion} must be >= 0")
        if (self.expansion > 0) != (self.prefixes is not None):
            raise BudgetError(
                f"allocator {self.name}: expansion={self.expansion} needs a prefix rule exactly when "
                "expansion > 0 (the named allocators pass one only then)"
            )

    def leaf_step(self, steer: bool = True) -> int:
        """The leaves this allocator can split budgets by: (1 + N) times the root rules' group size (a
        rule that `spread`s its remainder splits any count). While the gate `closes` it to GRPO, the
        closed rule's own group size: a token budget then buys whole GRPO groups, as `uniform` does,
        not groups of 3 and 4 where GRPO's are all 4."""
        if self.closes(steer):
            return int(getattr(self.closed, "group_size", 1))
        group = max(
            1 if getattr(rule, "spread", False) else int(getattr(rule, "group_size", 1))
            for rule in (self.roots, self.closed)
            if rule
        )
        return (1 + self.expansion) * group

    def closes(self, steer: bool) -> bool:
        """Whether this iteration is GRPO's: the skill gate is closed (`steer=False`) and there is a
        `closed` rule, so every leaf is a bare rollout under it and no prefix is expanded."""
        return not steer and self.closed is not None

    def root_rule(self, steer: bool) -> RootRule:
        """Stage 1's rule: `roots` while the estimates steer, the `closed` one (where set) otherwise."""
        return self.roots if steer or self.closed is None else self.closed

    def steered(self, steer: bool) -> bool:
        """Whether the estimates steered this iteration's Stage 1: the gate is open (`steer`) and its rule
        reads them (GRPO's uniform groups read none, whatever the gate says)."""
        return steer and not isinstance(self.root_rule(steer), UniformRoots)

    def give_back(
        self, predicted: np.ndarray, leaves: int, rng: np.random.Generator, steer: bool = True
    ) -> np.ndarray:
        """Bare rollouts [S] for candidates Stage 1 left out (`predicted` [S]), from `leaves` that priced
        Stage 2 did not spend: Stage 1's rule again (the `closed` one while the gate is closed) on the
        most of them, at most `leaves`, it can split over these candidates (zeros: none).

        Example: closed rule groups of 4, 10 leaves -> 8 of them as two groups of 4."""
        rule = self.root_rule(steer)
        for n in range(leaves, 0, -1):
            try:  # the rules refuse a count they cannot split before they draw from `rng`
                return rule(predicted, n, rng)
            except BudgetError:
                continue
        return np.zeros(len(predicted), dtype=np.int64)

    def can_spend(self, leaves: int, pool_size: int, steer: bool = True) -> bool:
        """Whether this allocator can spend exactly `leaves` over a pool of `pool_size` candidates, with
        the gate open (`steer`) or closed: tried on flat estimates and a throwaway RNG, so no run's
        draws are touched."""
        try:
            self.allocate_roots(
                np.full(pool_size, 0.5), Budget(leaves), np.random.default_rng(0), steer=steer
            )
        except BudgetError:
            return False
        return True

    def n_roots(self, budget: Budget, steer: bool = True) -> int:
        """M = L / (1 + N): bare rollouts, so that M (1 + N) leaves are spent in all; L itself while the
        gate `closes` the allocator to GRPO."""
        if self.closes(steer):
            return budget.leaves
        if budget.leaves % (1 + self.expansion):
            raise BudgetError(
                f"budget.leaves={budget.leaves} is not a multiple of 1 + allocator.expansion="
                f"{1 + self.expansion}; every allocator must spend exactly the same leaves"
            )
        return budget.leaves // (1 + self.expansion)

    def allocate_roots(
        self,
        predicted: np.ndarray,
        budget: Budget,
        rng: np.random.Generator,
        reserved: np.ndarray | None = None,
        steer: bool = True,
    ) -> np.ndarray:
        """Bare rollouts per candidate [P], summing to M. `reserved` [P] fixes some candidates' counts in
        advance (the unbiased slice, `selection.explore_groups`); the root rule splits the rest of M
        over the other candidates. `steer=False` (the skill gate is closed): the `closed` rule instead,
        where there is one, on all L leaves (`n_roots`).

        Example: M = 8, reserved [2, 0, 0, 2] -> the rule places 4 rollouts among candidates 1 and 2."""
        predicted, n_roots = np.asarray(predicted, dtype=np.float64), self.n_roots(budget, steer)
        fixed = np.zeros(len(predicted), dtype=np.int64) if reserved is None else np.asarray(reserved)
        if fixed.sum() > n_roots:
            raise BudgetError(
                f"the unbiased slice takes {int(fixed.sum())} of {n_roots} root rollouts; lower "
                "selection.explore_groups or raise budget.leaves"
            )
        counts = fixed.astype(np.int64).copy()
        free, left = fixed == 0, n_roots - int(fixed.sum())
        if left:  # the slice may take the whole root budget: then there is nothing left to allocate
            counts[free] = self.root_rule(steer)(predicted[free], left, rng)
        assert counts.sum() == n_roots, f"{self.name}: root rule broke the budget"
        return counts

    def allocate_prefixes(
        self, candidates: Sequence[PrefixCandidate], n_bare: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Continuations per candidate of one prompt with `n_bare` bare rollouts: m_i * N in all."""
        if self.prefixes is None or not candidates:
            return np.zeros(len(candidates), dtype=np.int64)
        counts = self.prefixes(candidates, n_bare * self.expansion, rng)
        assert counts.sum() == n_bare * self.expansion, f"{self.name}: prefix rule broke the budget"
        return counts


# The named allocators of the paper's comparison (Hydra configs point `_target_` at these).


def uniform(group_size: int = 4) -> TreeAllocator:
    return TreeAllocator("uniform", UniformRoots(group_size))


def pcl(group_size: int = 4) -> TreeAllocator:
    return TreeAllocator("pcl", ClosestToHalfRoots(group_size))


def random_expand(group_size: int = 2, expansion: int = 2) -> TreeAllocator:
    return TreeAllocator(
        "random_expand", UniformRoots(group_size), RandomPrefixes() if expansion else None, expansion
    )


def knapsack(group_size: int = 4, min_group: int = 2, max_per_prompt: int = 16) -> TreeAllocator:
    return TreeAllocator("knapsack", KnapsackRoots(group_size, min_group, max_per_prompt))


def trace(
    expansion: int = 2,
    min_group: int = 2,
    max_per_prompt: int | None = 16,
    count_continuations: bool = False,
    breadth: float = 0.0,
    group_size: int | None = None,
    pricing: Pricing | None = None,
) -> TreeAllocator:
    """`count_continuations`: Stage 1 scores a prompt by V_root over all its m_i (1 + N) leaves instead
    of its m_i bare rollouts (our variant: continuations can make a root mixed too). `breadth`: an
    objective bonus per trained prompt (see `solve_roots`). `group_size`: while the skill gate is closed,
    Stage 1 is GRPO's groups of this size (None: the exact program on flat estimates). `pricing`: Stage 2
    priced in tokens, its unspent continuations given back to Stage 1 (pricing.py; None: the spec's
    m_i * N per prompt)."""
    if breadth < 0:
        raise BudgetError(f"allocator.breadth={breadth} must be >= 0 (0: the spec's objective)")
    per_root = 1 + expansion if count_continuations else 1
    return TreeAllocator(
        "trace",
        ActiveRoots(min_group, max_per_prompt, per_root, breadth),
        ActivePrefixes() if expansion else None,
        expansion,
        # priced, Stage 1's budget is L / (1 + N) whatever the group size: the closed rule spreads the
        # remainder over its groups, so token budgets are not rounded to (1 + N) * group_size leaves
        closed=None if group_size is None else UniformRoots(group_size, spread=pricing is not None),
        pricing=pricing if expansion else None,
    )


def trace_root_only(
    expansion: int = 2, min_group: int = 2, max_per_prompt: int | None = 16, breadth: float = 0.0
) -> TreeAllocator:
    """Table 1 "active root / uniform prefix": trace's Stage 1 (with its `breadth`), random prefixes."""
    if breadth < 0:
        raise BudgetError(f"allocator.breadth={breadth} must be >= 0 (0: the spec's objective)")
    return TreeAllocator(
        "trace_root_only",
        ActiveRoots(min_group, max_per_prompt, 1, breadth),
        RandomPrefixes() if expansion else None,
        expansion,
    )


def trace_prefix_only(group_size: int = 2, expansion: int = 2) -> TreeAllocator:
    """Table 1 "uniform root / active prefix"."""
    return TreeAllocator(
        "trace_prefix_only", UniformRoots(group_size), ActivePrefixes() if expansion else None, expansion
    )


# --------------------------------------------------------------------------- cold start


@dataclass
class BetaPrior:
    """Per-prompt Beta(alpha, beta) posterior of the success rate, from bare rollouts only (each is an
    independent draw of V(prompt); continuations condition on prefixes Stage 2 chose).

    It is the allocation signal for the first `warmup` iterations, before the learned predictor has
    seen any tree targets, and the per-prompt evidence of Thompson sampling (`selection.py`). With
    `decay` < 1 every count is multiplied by it once per iteration, so old evidence about a policy
    that has since changed fades (decay 1 keeps every count).

    For prefixes the prior has no information beyond the prompt, so a prefix gets its prompt's mean.
    """

    alpha: float = 1.0
    beta: float = 1.0
    warmup: int = 1
    decay: float = 1.0
    counts: dict[int, tuple[float, float]] = field(default_factory=dict)  # task_id -> (succ, fail)

    def __post_init__(self) -> None:
        if self.alpha <= 0 or self.beta <= 0:
            raise ValueError(f"cold_start.alpha={self.alpha}, beta={self.beta}: both must be > 0")
        if self.warmup < 0:
            raise ValueError(f"cold_start.warmup={self.warmup} must be >= 0 (0 disables the prior)")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"cold_start.decay={self.decay} must be in (0, 1] (1: no decay)")

    def active(self, iteration: int) -> bool:
        return iteration < self.warmup

    def successes_failures(self, task_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Decayed success and failure counts [P] each."""
        sf = np.array([self.counts.get(t, (0.0, 0.0)) for t in task_ids], dtype=np.float64).reshape(-1, 2)
        return sf[:, 0], sf[:, 1]

    def mean(self, task_ids: Sequence[int]) -> np.ndarray:
        s, f = self.successes_failures(task_ids)
        return np.asarray((self.alpha + s) / (self.alpha + self.beta + s + f), dtype=np.float64)

    def visits(self, task_ids: Sequence[int]) -> np.ndarray:
        """Decayed number of observed rollouts per prompt [P]."""
        s, f = self.successes_failures(task_ids)
        return np.asarray(s + f, dtype=np.float64)

    def step(self) -> None:
        """One iteration passed: fade every count by `decay`."""
        if self.decay < 1.0:
            self.counts = {t: (s * self.decay, f * self.decay) for t, (s, f) in self.counts.items()}

    def update(self, task_id: int, successes: float, failures: float) -> None:
        s, f = self.counts.get(task_id, (0.0, 0.0))
        self.counts[task_id] = (s + successes, f + failures)

    def state_dict(self) -> dict[str, object]:
        return {"counts": {str(k): list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        counts = state["counts"]
        assert isinstance(counts, dict)
        self.counts = {int(k): (float(v[0]), float(v[1])) for k, v in counts.items()}
