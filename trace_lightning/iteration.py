"""One TRACE iteration of tree building, independent of what generates the turns.

    candidate pool -> score roots -> Stage 1 counts -> bare rollouts
                   -> score prefixes -> Stage 2 counts per prompt -> continuations

The episode runner (an LLM through a generation engine, or the synthetic simulator) and the scorer
(the learned predictor, a cold-start prior, or an oracle) are plugged in as callables, so the
benchmark and the training DataModule run the very same allocation path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from trace_lightning.allocation import PrefixCandidate, TreeAllocator
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.pricing import FlipRates, fill_best, probe
from trace_lightning.tree import RolloutTree, Stage, backup


@dataclass(frozen=True)
class Branch:
    """Run `count` episodes, each continuing from node `node_id` of `tree` to termination."""

    tree: RolloutTree
    node_id: int
    count: int
    stage: Stage


class EpisodeRunner(Protocol):
    def __call__(self, branches: Sequence[Branch], ledger: BudgetLedger, rng: np.random.Generator) -> None:
        """Append each branch's episodes to its tree, charging generated tokens to the ledger."""
        ...


class Scorer(Protocol):
    def __call__(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Predicted success probability of each requested prefix, one array per tree."""
        ...


@dataclass(frozen=True)
class Shard:
    """This process's part of a multi-process iteration. Every process allocates the whole pool with
    the same gathered predictions and the same allocation RNG, so Stage 1 is identical everywhere; the
    prompts that got rollouts are then split between the processes by `balance`, each rolls out its
    own, and Stage 2 (local to a prompt) draws from the process's own `rng`."""

    root_scores: np.ndarray  # [P] predictions over the whole pool, gathered from every process
    rank: int
    world: int
    rng: np.random.Generator  # this process's stream for everything after Stage 1


def balance(counts: np.ndarray, world: int) -> np.ndarray:
    """Owner process of each pool entry [P] (-1: no rollouts): largest groups first, each to the
    process with the fewest leaves so far (ties to the lower rank), so that processes finish together.

    Example: counts [2, 0, 6, 2, 2], world 2 -> owners [1, -1, 0, 1, 1] (rank 0: 6 leaves, rank 1: 6).
    """
    owner = np.full(len(counts), -1)
    load = np.zeros(world, dtype=np.int64)
    for i in sorted(np.flatnonzero(counts > 0), key=lambda i: (-int(counts[i]), int(i))):
        rank = int(np.argmin(load))
        owner[i], load[rank] = rank, load[rank] + int(counts[i])
    return owner


@dataclass
class Iteration:
    """What one iteration built: the trees of the prompts that got rollouts, and what it spent."""

    trees: list[RolloutTree]
    ledger: BudgetLedger
    pool_predicted: np.ndarray  # [P] root predictions over the whole candidate pool
    root_counts: np.ndarray  # [P] bare rollouts per candidate (0 = skipped)


def build_trees(
    pool: Sequence[RolloutTree],
    allocator: TreeAllocator,
    budget: Budget,
    score: Scorer,
    run: EpisodeRunner,
    rng: np.random.Generator,
    shard: Shard | None = None,
    root_scores: np.ndarray | None = None,
    reserved: np.ndarray | None = None,
    steer: bool = True,
    rates: FlipRates | None = None,
    root_predicted: np.ndarray | None = None,
) -> Iteration:
    """Spend `budget` over `pool` (fresh trees holding only their prompt) with `allocator`.

    Stage 1 runs on `root_scores` [P] when given (e.g. exploration estimates, `selection.py`), else on
    `score` at every root; `reserved` [P] fixes some candidates' bare counts (the unbiased slice).
    With a `shard`, the root counts cover the whole pool (and sum to the global budget) but only the
    owned prompts are rolled out; the returned trees and ledger are this process's part.
    `steer=False`: the skill gate is closed; an allocator with a `closed` rule is then GRPO: that rule
    spends the whole budget on bare rollouts and Stage 2 does not run (`TreeAllocator.closes`). With the
    allocator's `pricing`, Stage 2 is priced on `rates` (required then) and what it does not spend
    becomes more root groups on candidates Stage 1 left out (`_expand_priced`).
    `root_predicted` [P]: what each root records as its prediction (`RolloutTree.root.predicted`, what
    gauges judge; e.g. the calibrated predictor's output where Stage 1 ran on exploration estimates);
    by default the scores Stage 1 ran on.
    """
    ledger = BudgetLedger(budget)
    if shard is not None:
        predicted = _checked([shard.root_scores], "roots")[0]
    elif root_scores is not None:
        predicted = _checked([np.asarray(root_scores, dtype=np.float64)], "roots")[0]
    else:
        predicted = np.concatenate(_checked(score(pool, [[0]] * len(pool)), "roots")) if pool else np.zeros(0)
    counts = allocator.allocate_roots(predicted, budget, rng, reserved, steer)
    recorded = predicted if root_predicted is None else np.asarray(root_predicted, dtype=np.float64)
    for tree, v in zip(pool, recorded, strict=True):
        tree.root.predicted = float(v)
    owner = np.zeros(len(pool), dtype=np.int64) if shard is None else balance(counts, shard.world)
    mine = [i for i, m in enumerate(counts) if m > 0 and owner[i] == (0 if shard is None else shard.rank)]
    trees, active_counts = [pool[i] for i in mine], counts[mine]
    local_rng = rng if shard is None else shard.rng
    ledger.reserve_leaves(int(active_counts.sum()), "bare")
    run([Branch(t, 0, int(m), "bare") for t, m in zip(trees, active_counts, strict=True)], ledger, local_rng)
    if allocator.expansion == 0 or allocator.closes(steer):
        return Iteration(trees, ledger, predicted, counts)
    if allocator.pricing is None:
        _expand(trees, active_counts, allocator, score, run, ledger, local_rng)
        return Iteration(trees, ledger, predicted, counts)
    if rates is None:
        raise ValueError(f"allocator {allocator.name} prices Stage 2 and needs the run's FlipRates")
    spare = [i for i, m in enumerate(counts) if m == 0 and (shard is None or i % shard.world == shard.rank)]
    back = _expand_priced(
        trees, pool, spare, predicted[spare], allocator, rates, run, ledger, local_rng, steer
    )
    counts = counts.copy()
    counts[spare] = back  # the rollouts Stage 2 gave back count as bare rollouts of their prompts
    trees = trees + [pool[i] for i, m in zip(spare, back, strict=True) if m]
    return Iteration(trees, ledger, predicted, counts)


def prefix_candidates(tree: RolloutTree) -> list[int]:
    """Non-leaf turn prefixes (depth >= 1): where Stage 2 may start a continuation."""
    return [n.id for n in tree.nodes if n.depth >= 1 and n.reward is None]


def _expand(
    trees: list[RolloutTree],
    n_bare: np.ndarray,
    allocator: TreeAllocator,
    score: Scorer,
    run: EpisodeRunner,
    ledger: BudgetLedger,
    rng: np.random.Generator,
) -> None:
    """Stage 2: score every candidate prefix, then split m_i * N continuations within each prompt."""
    node_ids = [prefix_candidates(t) for t in trees]
    scores = _checked(score(trees, node_ids), "prefixes") if trees else []
    branches = []
    for tree, nodes, v, m in zip(trees, node_ids, scores, n_bare, strict=True):
        won = backup(tree).successes  # each bare prefix has exactly one leaf below it: its rollout
        for n, p in zip(nodes, v, strict=True):
            tree.nodes[n].predicted = float(p)
        cands = [PrefixCandidate(n, bool(won[n] > 0), float(p)) for n, p in zip(nodes, v, strict=True)]
        if not cands:  # every bare rollout ended after one turn: the prompt is the only prefix left
            branches.append(Branch(tree, 0, int(m) * allocator.expansion, "expand"))
            continue
        ks = allocator.allocate_prefixes(cands, int(m), rng)
        branches += [Branch(tree, c.node_id, int(k), "expand") for c, k in zip(cands, ks, strict=True) if k]
    ledger.reserve_leaves(sum(b.count for b in branches), "expand")
    run(branches, ledger, rng)


def _expand_priced(
    trees: list[RolloutTree],
    pool: Sequence[RolloutTree],
    spare: list[int],
    spare_predicted: np.ndarray,
    allocator: TreeAllocator,
    rates: FlipRates,
    run: EpisodeRunner,
    ledger: BudgetLedger,
    rng: np.random.Generator,
    steer: bool,
) -> np.ndarray:
    """Stage 2 priced in tokens over the whole iteration (pricing.py): of the m * N continuations the
    budget holds, the probe's (uniform candidates) and those whose expected flips beat what their tokens
    earn as roots run (`FlipRates.buy`, each bucket within what it has measured where `growth` caps it);
    the rest go back to Stage 1 (`TreeAllocator.give_back`) over the `spare` pool
    candidates it left out, in the same pass. Leaves that Stage 1 cannot split grow its last group, or
    without one go to the best remaining prefixes. Bare rollouts per spare candidate [S]."""
    assert allocator.pricing is not None
    budget = sum(len(t.leaves()) for t in trees) * allocator.expansion
    cands = [(t, c) for t in trees for c in rates.candidates(t)]  # priced at `FlipRates.price`
    flip = np.array([c.flip for _, c in cands], dtype=np.float64)  # [C]
    tokens = np.array([c.tokens for _, c in cands], dtype=np.float64)  # [C]
    for t, c in cands:
        t.nodes[c.node_id].predicted = 1.0 - c.flip if c.bucket[1] else c.flip  # V̂ the price implies
    rate = rates.root_rate(rates.signal(trees), ledger.tokens["bare"])  # with this iteration's roots
    measured = probe(len(cands), min(allocator.pricing.probe, budget), rng)  # [C]
    counts = rates.buy([c for _, c in cands], budget, rate, measured)  # [C]
    back = allocator.give_back(spare_predicted, budget - int(counts.sum()), rng, steer)  # [S]
    left = budget - int(counts.sum()) - int(back.sum())
    if left and back.sum():  # leaves Stage 1 could not split: the last group given back grows
        back[np.flatnonzero(back)[-1]] += left
        left = 0
    if left and cands:  # no group given back: the best remaining prefixes, even at a loss
        counts, left = fill_best(flip, tokens, counts, left, rate, rates.flip_worth(tokens)), 0
    branches = [Branch(t, c.node_id, int(k), "expand") for (t, c), k in zip(cands, counts, strict=True) if k]
    if left:  # no prefix and no spare candidate: more rollouts of the first prompt, as `_expand` does
        branches.append(Branch(trees[0], 0, left, "expand"))
    ledger.reserve_leaves(sum(b.count for b in branches), "expand")
    ledger.reserve_leaves(int(back.sum()), "bare")
    ledger.returned += int(back.sum())
    roots = [Branch(pool[i], 0, int(m), "bare") for i, m in zip(spare, back, strict=True) if m]
    run(branches + roots, ledger, rng)
    return back


def _checked(scores: list[np.ndarray], what: str) -> list[np.ndarray]:
    """Predictions enter allocation here: a NaN or inf would silently skew it, so it stops the run."""
    for v in scores:
        if not np.all(np.isfinite(v)):
            raise ValueError(
                f"the predictor returned non-finite success probabilities for {what} "
                f"({v[~np.isfinite(v)][:3]}); check the predictor head (predictor.lr, a NaN loss) "
                "or the cold-start prior"
            )
    return scores
