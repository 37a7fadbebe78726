"""Stage 2 priced in generated tokens (docs/algorithm.md#stage-2-priced-in-tokens; our design).

The spec's Stage 2 spends a fixed m_i * N continuations per prompt wherever the predictor's V̂ says a
flip is likeliest. On a real model that spent about half of the continuations where the outcome was
already decided (the last turn of a math_tool episode copies the calculator's result), and each of them
cost tokens that more root rollouts could have used. Priced, each continuation must earn its tokens:

  * a candidate prefix c of a bare rollout with outcome r costs t_c tokens: what that rollout generated
    after c (known exactly once the bare rollouts are done);
  * its flip probability f_c (P(a continuation from c ends with the other outcome)) comes from flip
    rates measured online, by the number of turns the bare rollout still had after c and by r
    (`FlipRates`: decayed Beta counts, shrunk towards the pooled rate, which starts at a pessimistic
    prior): the posterior mean, or with `Pricing.confidence` = z the mean less z posterior standard
    deviations, so Stage 2 spends only where flips were measured to pay;
  * with `Pricing.growth` = g a bucket buys at most g times its decayed count of measured continuations
    an iteration (`FlipRates.caps`), so one lucky flip buys a few more measurements, not the iteration;
  * the measurement itself is a fixed, small spend: `probe` continuations an iteration at candidates
    drawn uniformly, whatever their price (an unbiased sample of every bucket, and the only Stage 2
    spend while no bucket has earned more);
  * both sides are counted in leaves that carry a learning signal: the k-th continuation at c adds
    f_c (1 - f_c)^(k-1) flips (the spec's V_pref gain), each worth `FLIP_WORTH` = 2 leaves (the
    continuation and the bare rollout it contrasts with); a root group earns its leaves when mixed;
  * the exchange rate is what roots earn: leaves of mixed bare groups per bare token, on this
    iteration's bare rollouts and the decayed record of earlier ones (`FlipRates.root_rate`), so a
    continuation's t_c tokens could have earned rate * t_c;
  * `Pricing.worth="tokens"` counts both sides in tokens that get a contrast instead of leaves: a flip
    at c is worth FLIP_WORTH * t_c (the continuation's tokens and the bare rollout's after c), a root
    group the tokens of its rollouts when mixed. A continuation then pays when FLIP_WORTH f_c beats the
    share of root tokens that mix, whatever its length: in leaves, a short last turn (a flip there
    contrasts a few answer tokens) looks as valuable as a whole mixed rollout at a fraction of its cost.

`solve_priced` takes the continuations whose expected worth beats what their tokens earn as roots; every
continuation it does not take goes back to Stage 1 as more root groups (iteration.py). A decided
prefix, whose measured flip rate is near 0, gets nothing; on a task where no prefix pays, TRACE is
GRPO plus the probe.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trace_lightning.tree import SUCCESS, RolloutTree, bare_outcomes


@dataclass(frozen=True)
class Pricing:
    """How Stage 2 prices continuations (`allocator.pricing`): the prior of the flip-rate table.

    Before any measurement every bucket believes `flip_prior`, worth `prior_strength` continuations; each
    iteration multiplies every count by `decay`, so the table follows a policy that changes. `probe`
    continuations an iteration measure it, at uniformly drawn candidates."""

    flip_prior: float = 0.05
    prior_strength: float = 4.0
    decay: float = 0.9
    max_turns_left: int = 3  # buckets: 1, 2, ..., max_turns_left or more turns left after the prefix
    probe: int = 2
    worth: str = "leaves"  # what a learning signal is counted in: "leaves" or "tokens" (see `flip_worth`)
    confidence: float = 0.0  # z: a bucket priced z posterior std below its mean flip rate (`FlipRates.price`)
    growth: float | None = None  # a bucket buys at most growth x its measured continuations (None: no cap)

    def __post_init__(self) -> None:
        if self.worth not in WORTH:
            raise ValueError(f"allocator.pricing.worth={self.worth!r}: use one of {list(WORTH)}")
        if self.growth is not None and self.growth < 0:
            raise ValueError(f"allocator.pricing.growth={self.growth} must be >= 0, or null for no cap")
        if self.confidence < 0:
            raise ValueError(
                f"allocator.pricing.confidence={self.confidence} must be >= 0 (0: the posterior mean)"
            )
        if not 0.0 < self.flip_prior < 1.0 or self.prior_strength <= 0:
            raise ValueError(
                f"allocator.pricing.flip_prior={self.flip_prior} must be in (0, 1) and prior_strength="
                f"{self.prior_strength} > 0"
            )
        if not 0.0 < self.decay <= 1.0 or self.max_turns_left < 1 or self.probe < 0:
            raise ValueError(
                f"allocator.pricing.decay={self.decay} must be in (0, 1], max_turns_left="
                f"{self.max_turns_left} >= 1 and probe={self.probe} >= 0"
            )


WORTH = ("leaves", "tokens")
Bucket = tuple[int, bool]  # (turns the bare rollout had left after the prefix, capped; its success)


@dataclass(frozen=True)
class PricedCandidate:
    """A prefix where a continuation may start, with what it costs and what it is expected to earn."""

    node_id: int
    bucket: Bucket
    tokens: int  # what the bare rollout generated after this prefix: a continuation's expected cost
    flip: float  # estimated P(a continuation ends with the other outcome)


@dataclass(frozen=True)
class Flips:
    """What one iteration's continuations did: per depth of their start prefix (index = depth)."""

    continuations: tuple[int, ...]
    flips: tuple[int, ...]


@dataclass
class FlipRates:
    """Online flip rates per bucket and the roots' exchange rate; the collector owns and checkpoints it."""

    pricing: Pricing = field(default_factory=Pricing)
    counts: dict[Bucket, tuple[float, float]] = field(default_factory=dict)  # bucket -> (flips, tries)
    roots: tuple[float, float] = (0.0, 0.0)  # decayed (what mixed bare groups earned, bare tokens)

    def posterior(self, bucket: Bucket) -> tuple[float, float]:
        """Beta(a, b) of a bucket's flip rate: its counts, with a prior of `prior_strength` continuations
        at the pooled rate of all buckets, which is itself shrunk towards `flip_prior`."""
        p = self.pricing
        flips, tries = (sum(c[i] for c in self.counts.values()) for i in (0, 1))
        pooled = (flips + p.prior_strength * p.flip_prior) / (tries + p.prior_strength)
        f, n = self.counts.get(bucket, (0.0, 0.0))
        return f + p.prior_strength * pooled, n - f + p.prior_strength * (1.0 - pooled)

    def rate(self, bucket: Bucket) -> float:
        """Posterior mean flip rate of a bucket."""
        a, b = self.posterior(bucket)
        return a / (a + b)

    def price(self, bucket: Bucket) -> float:
        """The flip rate Stage 2 prices a bucket at: its posterior mean less `confidence` posterior standard
        deviations, floored at 0. A bucket spends beyond the probe only once its flips are measured well
        enough to pay at that lower rate: one flip in two tries moves the mean a lot and the bound little,
        while a rate measured over many continuations keeps nearly its mean."""
        a, b = self.posterior(bucket)
        sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))
        return max(0.0, a / (a + b) - self.pricing.confidence * sd)

    def caps(self, buckets: Sequence[Bucket]) -> np.ndarray | None:
        """Continuations each bucket may buy beyond the probe this iteration [len(buckets)]: `growth` times
        its decayed count of measured continuations, rounded down (None without `growth`). Spend follows
        evidence: a bucket that one lucky flip made look profitable buys a few more measurements, not the
        iteration's whole m * N, and a bucket whose flips keep paying can grow its spend every iteration."""
        if self.pricing.growth is None:
            return None
        tries = np.array([self.counts.get(b, (0.0, 0.0))[1] for b in buckets], dtype=np.float64)
        return np.floor(self.pricing.growth * tries + 1e-9).astype(np.int64)

    def buy(
        self,
        cands: Sequence[PricedCandidate],
        budget: int,
        rate: float | None,
        start: np.ndarray | None = None,
    ) -> np.ndarray:
        """Continuations per candidate [C] (`solve_priced` at their prices, in `worth`'s unit, each bucket
        within its `caps`), at most `budget` in all, `start` (the probe's) counted in."""
        flip = np.array([c.flip for c in cands], dtype=np.float64)  # [C]
        tokens = np.array([c.tokens for c in cands], dtype=np.float64)  # [C]
        buckets = sorted({c.bucket for c in cands})
        groups = np.array([buckets.index(c.bucket) for c in cands], dtype=np.int64)  # [C]
        worth = self.flip_worth(tokens)
        return solve_priced(flip, tokens, budget, rate, start, worth, groups, self.caps(buckets))

    def root_rate(self, signal: float = 0.0, tokens: float = 0.0) -> float | None:
        """What mixed bare groups earn per bare token (`signal`'s unit), over the decayed record and `signal`
        more in `tokens` more bare tokens (this iteration's so far); None before any bare token was seen."""
        total = self.roots[1] + tokens
        return (self.roots[0] + signal) / total if total > 0 else None

    def flip_worth(self, tokens: np.ndarray) -> np.ndarray:
        """What one flip earns at candidates costing `tokens` [C], in the unit of `signal`: FLIP_WORTH
        leaves, or under `worth="tokens"` the FLIP_WORTH * t_c tokens it gives a contrast to (the
        continuation and the bare rollout's own tokens after the prefix). Counted in tokens, a flip after
        the last turn is worth as little as the turn is long, so a cheap continuation is no bargain."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return FLIP_WORTH * tokens if self.pricing.worth == "tokens" else np.full(len(tokens), FLIP_WORTH)

    def signal(self, trees: Sequence[RolloutTree]) -> int:
        """What root groups earned, in `flip_worth`'s unit: `signal_leaves`, or the tokens of those leaves."""
        return signal_tokens(trees) if self.pricing.worth == "tokens" else signal_leaves(trees)

    def bucket(self, turns_left: int, success: bool) -> Bucket:
        return (min(max(turns_left, 1), self.pricing.max_turns_left), bool(success))

    def candidates(
        self, tree: RolloutTree, flips: dict[Bucket, float] | None = None
    ) -> list[PricedCandidate]:
        """The non-leaf turn prefixes of a tree's bare rollouts, priced at `flips` (one rate per bucket;
        None: `price`, the posterior means by default)."""
        out = []
        for leaf in tree.leaves():
            if tree.nodes[leaf].stage != "bare":
                continue
            path, won = tree.path(leaf), float(tree.nodes[leaf].reward or 0.0) >= SUCCESS
            after = np.cumsum([len(tree.nodes[n].action_ids) for n in path][::-1])[
                ::-1
            ]  # [T] tokens from n on
            for i, n in enumerate(path[:-1]):
                bucket = self.bucket(len(path) - 1 - i, won)
                flip = self.price(bucket) if flips is None else flips[bucket]
                out.append(PricedCandidate(n, bucket, max(int(after[i + 1]), 1), flip))
        return out

    def observe(self, trees: Sequence[RolloutTree], signal: int, bare_tokens: int) -> Flips:
        """Fade the old counts, then count this iteration's continuations (a flip: the continuation's
        outcome differs from the bare rollout through its start prefix) and the roots' yield (`signal`, in
        the unit of `FlipRates.signal`, over `bare_tokens`)."""
        d = self.pricing.decay
        self.counts = {b: (f * d, n * d) for b, (f, n) in self.counts.items()}
        self.roots = (self.roots[0] * d + signal, self.roots[1] * d + bare_tokens)
        by_depth: dict[int, list[int]] = {}
        for tree in trees:
            for start, turns_left, won, flipped in continuation_outcomes(tree):
                b = self.bucket(turns_left, won)
                f, n = self.counts.get(b, (0.0, 0.0))
                self.counts[b] = (f + flipped, n + 1.0)
                row = by_depth.setdefault(tree.nodes[start].depth, [0, 0])
                row[0], row[1] = row[0] + 1, row[1] + int(flipped)
        depth = max(by_depth, default=0)
        return Flips(
            tuple(by_depth.get(i, [0, 0])[0] for i in range(depth + 1)),
            tuple(by_depth.get(i, [0, 0])[1] for i in range(depth + 1)),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"counts": [[t, s, f, n] for (t, s), (f, n) in self.counts.items()], "roots": list(self.roots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {(int(t), bool(s)): (float(f), float(n)) for t, s, f, n in state["counts"]}
        self.roots = (float(state["roots"][0]), float(state["roots"][1]))


def continuation_outcomes(tree: RolloutTree) -> list[tuple[int, int, bool, bool]]:
    """(start prefix, turns the bare rollout had left after it, the bare outcome, whether the continuation
    flipped it) for every continuation that starts at a turn prefix of a bare rollout."""
    bare_leaf: dict[int, int] = {}  # bare prefix -> the one bare leaf below it
    for leaf in tree.leaves():
        if tree.nodes[leaf].stage == "bare":
            for n in tree.path(leaf):
                bare_leaf[n] = leaf
    out = []
    for leaf in tree.leaves():
        node = tree.nodes[leaf]
        if node.stage != "expand":
            continue
        first = next(n for n in tree.path(leaf) if tree.nodes[n].stage == "expand")
        start = tree.nodes[first].parent
        if start is None or start not in bare_leaf:  # a continuation from the prompt itself
            continue
        bare = tree.nodes[bare_leaf[start]]
        won, cont_won = float(bare.reward or 0.0) >= SUCCESS, float(node.reward or 0.0) >= SUCCESS
        out.append((start, bare.depth - tree.nodes[start].depth, won, won != cont_won))
    return out


# A flip is worth two leaves with a learning signal: the continuation and the bare rollout it contrasts
# with (one if that rollout's group was mixed already, all of the group's and one more if it was not).
FLIP_WORTH = 2.0


def signal_leaves(trees: Sequence[RolloutTree]) -> int:
    """Bare rollouts in mixed bare groups: what root groups earned, in the unit `solve_priced` prices."""
    groups = [bare_outcomes(tree) for tree in trees]
    return sum(len(won) for won in groups if 0 < won.sum() < len(won))


def signal_tokens(trees: Sequence[RolloutTree]) -> int:
    """The generated tokens of the bare rollouts in mixed bare groups (`signal_leaves`, counted in tokens)."""
    total = 0
    for tree in trees:
        won = bare_outcomes(tree)
        if 0 < won.sum() < len(won):
            total += sum(len(n.action_ids) for n in tree.nodes if n.stage == "bare")
    return total


def solve_priced(
    flip: np.ndarray,
    tokens: np.ndarray,
    budget: int,
    rate: float | None,
    start: np.ndarray | None = None,
    worth: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    caps: np.ndarray | None = None,
) -> np.ndarray:
    """Continuations per candidate [C], at most `budget` in all (`start` [C], e.g. the probe's, counted
    in and kept), maximising
        sum_c w_c [1 - (1 - f_c)^k_c]  -  rate * sum_c k_c t_c,
    the learning signal that flips create (`worth` w [C] per flip, default FLIP_WORTH leaves) minus what
    the same tokens earn as root groups (`rate`: signal per token, in w's unit; None before any
    measurement: 0). The k-th continuation at c nets w_c f_c (1 - f_c)^(k-1) - rate t_c, which falls
    with k, so taking the best positive net value while the budget lasts is exact. With `groups` [C]
    (group ids) and `caps` [G], the continuations taken beyond `start` in group g are at most caps[g];
    nested capacity limits keep the greedy choice exact. Ties go to the lower index.

    Example: f = [0.5, 0.0], t = [10, 2], budget 3, rate 0.04 -> [2, 0] (nets 1 - 0.4 = 0.6, then
    0.1 at candidate 0, then 0.25 - 0.4 < 0; candidate 1 never flips)."""
    counts = (
        np.zeros(len(flip), dtype=np.int64) if start is None else np.asarray(start, dtype=np.int64).copy()
    )
    price = 0.0 if rate is None else rate
    w = np.full(len(flip), FLIP_WORTH) if worth is None else np.asarray(worth, dtype=np.float64)  # [C]
    heap = [
        (-(float(wc) * float(f) * (1.0 - float(f)) ** int(k) - price * float(t)), c)
        for c, (wc, f, t, k) in enumerate(zip(w, flip, tokens, counts, strict=True))
    ]
    heapq.heapify(heap)
    room = None if caps is None else np.asarray(caps, dtype=np.int64).copy()  # [G] left in each group
    while heap and counts.sum() < budget:
        net, c = heapq.heappop(heap)
        if -net <= 0.0:
            break
        if room is not None and groups is not None:
            if room[groups[c]] <= 0:  # its group is full: c leaves the heap
                continue
            room[groups[c]] -= 1
        counts[c] += 1
        f = float(flip[c])
        heapq.heappush(heap, (-(float(w[c]) * f * (1.0 - f) ** counts[c] - price * float(tokens[c])), c))
    return counts


def probe(n_candidates: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """The measurement: one continuation at each of `n` candidates drawn uniformly without replacement
    (all of them when there are fewer) [C]."""
    counts = np.zeros(n_candidates, dtype=np.int64)
    counts[rng.choice(n_candidates, size=min(n, n_candidates), replace=False)] = 1
    return counts


def fill_best(
    flip: np.ndarray,
    tokens: np.ndarray,
    counts: np.ndarray,
    extra: int,
    rate: float | None,
    worth: np.ndarray | None = None,
) -> np.ndarray:
    """`extra` more continuations on top of `counts`, each at the best remaining net value even when it
    is negative (leaves that cannot form a whole root group must still be spent); `worth` as in
    `solve_priced`."""
    counts = counts.copy()
    price = 0.0 if rate is None else rate
    w = np.full(len(flip), FLIP_WORTH) if worth is None else np.asarray(worth, dtype=np.float64)  # [C]
    for _ in range(extra):
        net = w * flip * (1.0 - flip) ** counts - price * tokens  # [C]
        counts[int(np.argmax(net))] += 1
    return counts
