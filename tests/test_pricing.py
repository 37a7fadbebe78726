"""Stage 2 priced in tokens, the gate that closes to GRPO, Knapsack RL's allocator and the pooled
attribute estimates. Every expected value is derived here from the formulas, by hand or by brute force."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning import allocation as alloc
from trace_lightning.envs.synthetic import make_tasks
from trace_lightning.iteration import build_trees
from trace_lightning.pricing import (
    FlipRates,
    PricedCandidate,
    Pricing,
    continuation_outcomes,
    fill_best,
    probe,
    signal_leaves,
    signal_tokens,
    solve_priced,
)
from trace_lightning.selection import Selection
from trace_lightning.simulator import ChainSimulator, oracle_scores
from trace_lightning.tree import RolloutTree

TASKS = {t.task_id: t for t in make_tasks(300, turns=4, seed=1)}


def _objective(k, f, t, rate, w=None):
    """sum_c w_c [1 - (1 - f_c)^k_c] - rate * sum_c k_c t_c, written from the definition (by default a
    flip is worth two leaves with a signal: w_c = 2)."""
    w = [2.0] * len(f) if w is None else w
    return sum(wc * (1 - (1 - fc) ** kc) for wc, kc, fc in zip(w, k, f, strict=True)) - rate * sum(
        kc * tc for kc, tc in zip(k, t, strict=True)
    )


@settings(max_examples=60, deadline=None)
@given(
    f=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3),
    t=st.lists(st.integers(1, 20), min_size=3, max_size=3),
    budget=st.integers(0, 4),
    rate=st.floats(0.0, 1.0),
    in_tokens=st.booleans(),
)
def test_solve_priced_is_the_brute_force_optimum(f, t, budget, rate, in_tokens):
    """In leaves a flip is worth 2 (the default); in tokens (worth="tokens") 2 t_c, the rate in that unit."""
    t = t[: len(f)]
    w = [2.0 * tc for tc in t] if in_tokens else [2.0] * len(f)
    k = solve_priced(
        np.array(f), np.array(t, dtype=float), budget, rate, worth=np.array(w) if in_tokens else None
    )
    assert k.sum() <= budget and (k >= 0).all()
    best = max(
        _objective(c, f, t, rate, w)
        for c in itertools.product(range(budget + 1), repeat=len(f))
        if sum(c) <= budget
    )
    assert _objective(k, f, t, rate, w) == pytest.approx(best, abs=1e-9)


def test_a_cheap_last_turn_is_a_bargain_in_leaves_but_not_in_tokens():
    """A last turn of 8 tokens that flips 5% of the time, against roots where 30% of 1,000 bare tokens sit
    in mixed groups of 4 rollouts of 100 tokens (3 signal leaves per 1,000 tokens)."""
    f, t = np.array([0.05]), np.array([8.0])
    leaves, tokens = FlipRates(Pricing()), FlipRates(Pricing(worth="tokens"))
    # leaves: 2 * 0.05 = 0.1 against 0.003 * 8 = 0.024: bought, and again while 0.1 * 0.95^k > 0.024
    assert solve_priced(f, t, 40, 0.003, worth=leaves.flip_worth(t)).tolist() == [28]
    # tokens: 2 * 0.05 * 8 = 0.8 against 0.3 * 8 = 2.4: never
    assert solve_priced(f, t, 40, 0.3, worth=tokens.flip_worth(t)).tolist() == [0]
    assert tokens.flip_worth(np.array([8.0, 100.0])).tolist() == [16.0, 200.0]
    assert leaves.flip_worth(np.array([8.0, 100.0])).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="allocator.pricing.worth"):
        Pricing(worth="flips")


def test_solve_priced_by_hand():
    # nets at candidate 0: 2 * 0.5 - 0.04 * 10 = 0.6, then 2 * 0.25 - 0.4 = 0.1, then 0.25 - 0.4 < 0;
    # candidate 1 never flips: 0 - 0.08 < 0
    assert solve_priced(np.array([0.5, 0.0]), np.array([10.0, 2.0]), 3, 0.04).tolist() == [2, 0]
    # no measured exchange rate yet: the whole budget goes by flip probability
    assert solve_priced(np.array([0.5, 0.1]), np.array([10.0, 2.0]), 3, None).tolist() == [
        3,
        0,
    ]  # 0.125 > 0.1


def _hand_tree():
    """Bare A: n1 (5 tokens) -> n2 (4) -> n3 (3) wins; bare B: n4 -> n5 loses; a continuation from n1
    (n6 -> n7) loses: a flip with 2 turns left; one from n2 (n8) wins: no flip, 1 turn left."""
    t = RolloutTree(0)
    n1 = t.add_turn(0, "bare", [1] * 5, [])
    n2 = t.add_turn(n1, "bare", [1] * 4, [])
    n3 = t.add_turn(n2, "bare", [1] * 3, [])
    t.finish(n3, 1.0, "answer")
    n4 = t.add_turn(0, "bare", [1], [])
    n5 = t.add_turn(n4, "bare", [1], [])
    t.finish(n5, 0.0, "answer")
    n6 = t.add_turn(n1, "expand", [1], [])
    n7 = t.add_turn(n6, "expand", [1], [])
    t.finish(n7, 0.0, "answer")
    n8 = t.add_turn(n2, "expand", [1], [])
    t.finish(n8, 1.0, "answer")
    return t


def test_continuation_outcomes_and_flip_rates_by_hand():
    tree = _hand_tree()
    assert continuation_outcomes(tree) == [(1, 2, True, True), (2, 1, True, False)]
    rates = FlipRates(Pricing(flip_prior=0.2, prior_strength=2.0, decay=0.5))
    flips = rates.observe([tree], signal=2, bare_tokens=14)
    assert flips.continuations == (0, 1, 1) and flips.flips == (0, 1, 0)  # by start depth
    # pooled: (1 flip + 2 * 0.2) / (2 tries + 2) = 0.35; bucket (2, won): (1 + 2 * 0.35) / (1 + 2)
    assert rates.rate((2, True)) == pytest.approx(1.7 / 3)
    assert rates.rate((1, True)) == pytest.approx(0.7 / 3)
    assert rates.posterior((2, True)) == pytest.approx((1 + 2 * 0.35, 0 + 2 * 0.65))
    assert rates.root_rate() == pytest.approx(2 / 14)
    assert rates.root_rate(signal=4, tokens=26) == pytest.approx(6 / 40)  # with this iteration's roots
    rates.observe([], 0, 0)  # a second iteration fades every count by the decay
    assert rates.counts[(2, True)] == (0.5, 0.5) and rates.roots == (1.0, 7.0)


def test_signal_leaves_count_the_bare_rollouts_of_mixed_groups():
    lost = RolloutTree(1)
    for _ in range(3):
        leaf = lost.add_turn(0, "bare", [1], [])
        lost.finish(leaf, 0.0, "answer")
    assert signal_leaves([_hand_tree(), lost]) == 2  # one win and one loss; three losses earn nothing
    # in tokens: the bare turns of the mixed group, 5 + 4 + 3 and 1 + 1 (continuations are not roots)
    assert signal_tokens([_hand_tree(), lost]) == 14
    assert FlipRates(Pricing(worth="tokens")).signal([_hand_tree(), lost]) == 14
    assert FlipRates(Pricing()).signal([_hand_tree(), lost]) == 2


def test_the_probe_picks_distinct_candidates_uniformly():
    picks = np.array([probe(5, 2, np.random.default_rng(s)) for s in range(2000)])  # [2000, 5]
    assert (picks.sum(axis=1) == 2).all() and picks.max() == 1  # two distinct candidates each time
    assert np.abs(picks.mean(axis=0) - 2 / 5).max() < 0.04  # each with probability 2/5 (SE about 0.011)
    assert probe(1, 2, np.random.default_rng(0)).tolist() == [1]  # fewer candidates than the probe
    assert probe(0, 2, np.random.default_rng(0)).tolist() == []


@settings(max_examples=60, deadline=None)
@given(
    f=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3),
    t=st.lists(st.integers(1, 20), min_size=3, max_size=3),
    start=st.lists(st.integers(0, 1), min_size=3, max_size=3),
    extra=st.integers(0, 3),
    rate=st.floats(0.0, 0.2),
)
def test_solve_priced_from_the_probe_is_the_brute_force_optimum_above_it(f, t, start, extra, rate):
    t, start = t[: len(f)], start[: len(f)]
    budget = sum(start) + extra
    k = solve_priced(np.array(f), np.array(t, dtype=float), budget, rate, start=np.array(start))
    assert k.sum() <= budget and all(kc >= sc for kc, sc in zip(k, start, strict=True))
    best = max(
        _objective(c, f, t, rate)
        for c in itertools.product(range(budget + 1), repeat=len(f))
        if sum(c) <= budget and all(cc >= sc for cc, sc in zip(c, start, strict=True))
    )
    assert _objective(k, f, t, rate) == pytest.approx(best, abs=1e-9)


def test_posterior_means_start_pessimistic_and_follow_the_counts():
    rates = FlipRates(Pricing(flip_prior=0.05, prior_strength=4.0))
    assert rates.rate((1, True)) == pytest.approx(0.05)  # nothing measured: the prior
    rates.counts = {(1, True): (6.0, 8.0)}  # 6 flips in 8: pooled (6 + 0.2) / 12, then (6 + 4 p) / 12
    pooled = (6 + 4 * 0.05) / (8 + 4)
    assert rates.rate((1, True)) == pytest.approx((6 + 4 * pooled) / (8 + 4))
    assert rates.rate((2, False)) == pytest.approx(pooled)  # unmeasured: the pooled rate


def test_confidence_prices_a_bucket_below_its_mean_by_its_posterior_spread():
    # one flip in 2 tries, nothing else measured: pooled (1 + 4 * 0.05) / (2 + 4) = 0.2, posterior
    # Beta(1 + 0.8, 1 + 3.2) = Beta(1.8, 4.2): mean 0.3, sd sqrt(1.8 * 4.2 / (36 * 7)) = 0.1732
    sure = FlipRates(Pricing(confidence=1.0), counts={(1, True): (1.0, 2.0)})
    assert sure.price((1, True)) == pytest.approx(0.3 - 0.17321, abs=1e-5)
    assert FlipRates(Pricing(), counts={(1, True): (1.0, 2.0)}).price((1, True)) == pytest.approx(0.3)
    # 300 flips in 1,000 tries: the bound keeps nearly the mean (sd about 0.0144)
    many = FlipRates(Pricing(confidence=1.0), counts={(1, True): (300.0, 1000.0)})
    assert many.rate((1, True)) - many.price((1, True)) == pytest.approx(0.0144, abs=2e-4)
    assert FlipRates(Pricing(confidence=9.0)).price((1, True)) == 0.0  # floored at 0
    assert sure.candidates(_hand_tree())[1].flip == pytest.approx(sure.price((1, True)))
    with pytest.raises(ValueError, match="allocator.pricing.confidence"):
        Pricing(confidence=-1.0)


@settings(max_examples=60, deadline=None)
@given(
    f=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3),
    t=st.lists(st.integers(1, 20), min_size=3, max_size=3),
    groups=st.lists(st.integers(0, 1), min_size=3, max_size=3),
    caps=st.lists(st.integers(0, 3), min_size=2, max_size=2),
    budget=st.integers(0, 4),
    rate=st.floats(0.0, 0.2),
)
def test_solve_priced_within_group_caps_is_the_brute_force_optimum(f, t, groups, caps, budget, rate):
    k = solve_priced(np.array(f), np.array(t, dtype=float), budget, rate, groups=np.array(groups), caps=caps)
    feasible = [
        c
        for c in itertools.product(range(budget + 1), repeat=3)
        if sum(c) <= budget and all(sum(c[i] for i in range(3) if groups[i] == g) <= caps[g] for g in (0, 1))
    ]
    assert tuple(k) in feasible
    assert _objective(k, f, t, rate) == pytest.approx(
        max(_objective(c, f, t, rate) for c in feasible), abs=1e-9
    )


def test_growth_caps_a_bucket_at_its_measured_continuations():
    rates = FlipRates(Pricing(growth=1.5), counts={(1, True): (1.0, 2.0), (2, False): (0.0, 0.7)})
    assert rates.caps([(1, True), (2, False), (3, True)]).tolist() == [3, 1, 0]  # floor(1.5 n)
    assert FlipRates(Pricing()).caps([(1, True)]) is None
    with pytest.raises(ValueError, match="allocator.pricing.growth"):
        Pricing(growth=-1.0)
    # one flip in two tries prices (1, True) at 0.286 (pooled (1 + 0.2) / (2.7 + 4), then (1 + 4 pooled)
    # / (2 + 4)); at 0.01 leaves per token every 8-token candidate pays 2 f - 0.08 > 0, and a growth of 1
    # takes two of them (two measured continuations)
    assert rates.price((1, True)) == pytest.approx((1 + 4 * 1.2 / 6.7) / 6)
    cands = [PricedCandidate(i, (1, True), 8, rates.price((1, True))) for i in range(10)]
    capped = FlipRates(Pricing(growth=1.0), counts=rates.counts)
    assert capped.buy(cands, 20, 0.01).tolist() == [1, 1] + [0] * 8
    assert FlipRates(Pricing(), counts=rates.counts).buy(cands, 20, 0.01).sum() == 20


def test_fill_best_spends_every_extra_leaf_at_the_best_net():
    # nets: 2 * 0.5 - 0.1 * 10 = 0 and 2 * 0.2 - 0.1 * 2 = 0.2, then 2 * 0.16 - 0.2 = 0.12
    got = fill_best(np.array([0.5, 0.2]), np.array([10.0, 2.0]), np.array([0, 0]), 2, 0.1)
    assert got.tolist() == [0, 2]


def test_candidates_cost_what_their_bare_rollout_generated_after_them():
    rates = FlipRates(Pricing())
    cands = {c.node_id: c for c in rates.candidates(_hand_tree())}
    assert set(cands) == {1, 2, 4}  # non-leaf turns of bare rollouts only
    assert (cands[1].tokens, cands[1].bucket) == (4 + 3, (2, True))
    assert (cands[2].tokens, cands[2].bucket) == (3, (1, True))
    assert (cands[4].tokens, cands[4].bucket) == (1, (1, False))


def _trace_run(rates, seed, steer, leaves=24, pool=16, probe=0, allocator=None):
    rng = np.random.default_rng(seed)
    trees = [RolloutTree(int(i)) for i in rng.choice(len(TASKS), size=pool, replace=False)]
    allocator = allocator or alloc.trace(2, group_size=4, pricing=Pricing(probe=probe))
    return build_trees(
        trees,
        allocator,
        alloc.Budget(leaves),
        lambda t, n: oracle_scores(TASKS, t, n),
        ChainSimulator(TASKS),
        rng,
        steer=steer,
        rates=rates,
    )


def _no_flips() -> FlipRates:
    """A table that has measured no flip in any bucket, and roots that earn."""
    rates = FlipRates(Pricing())
    rates.counts = {(d, won): (0.0, 1000.0) for d in (1, 2, 3) for won in (False, True)}
    rates.roots = (10.0, 100.0)
    return rates


@pytest.mark.parametrize("priced", [True, False])
def test_a_closed_gate_is_grpo(priced):
    """Closed, trace is `allocator=uniform`: from the same draws, the same groups of 4 on the same
    prompts, every leaf a bare rollout (no probe, nothing expanded), whatever the flip table says."""
    rates = _no_flips()
    rates.counts[(3, False)] = (900.0, 1000.0)  # flips that would pay: a closed gate still spends none
    trace = alloc.trace(2, group_size=4, pricing=Pricing(probe=2) if priced else None)
    for seed in range(20):
        closed = _trace_run(rates, seed, steer=False, allocator=trace)
        grpo = _trace_run(None, seed, steer=True, allocator=alloc.uniform(4))
        assert closed.root_counts.tolist() == grpo.root_counts.tolist()
        assert sorted(int(m) for m in closed.root_counts if m) == [4] * 6
        assert closed.ledger.leaves == {"bare": 24, "expand": 0} and closed.ledger.returned == 0
        assert [t.task_id for t in closed.trees] == [t.task_id for t in grpo.trees]


def test_priced_stage2_spends_only_where_flips_pay_and_returns_the_rest():
    rates = _no_flips()
    for won in (False, True):
        rates.counts[(3, won)] = (500.0, 1000.0)  # only prefixes with 3+ turns left ever flip
    it = _trace_run(rates, seed=3, steer=True)
    assert it.ledger.leaves_used == 24
    starts = [
        (t, n) for t in it.trees for n in t.nodes if n.stage == "expand" and t.nodes[n.parent].stage == "bare"
    ]
    assert starts  # depth-1 prefixes of 4-turn rollouts have 3 turns left: worth it
    for tree, node in starts:
        parent = tree.nodes[node.parent]
        bare_leaf = next(
            x for x in tree.leaves() if tree.nodes[x].stage == "bare" and node.parent in tree.path(x)
        )
        assert tree.nodes[bare_leaf].depth - parent.depth >= 3
    assert it.ledger.leaves["expand"] + it.ledger.returned == 16


def test_the_probe_runs_whatever_the_price_and_the_rest_goes_back():
    """Nothing pays: 2 probe continuations at 2 distinct prefixes, the other 14 leaves back to Stage 1's
    program as groups within [min_group, max_per_prompt] on candidates it had left out (8 + 14 = 22 bare)."""
    for seed in range(20):
        it = _trace_run(_no_flips(), seed, steer=True, probe=2)
        starts = [  # a continuation's first turn: an expand node under a bare one
            (t.task_id, n.parent)
            for t in it.trees
            for n in t.nodes
            if n.stage == "expand" and t.nodes[n.parent].stage != "expand"
        ]
        assert len(starts) == len(set(starts)) == 2
        assert it.ledger.leaves == {"bare": 22, "expand": 2} and it.ledger.returned == 14
        assert it.root_counts.sum() == 22 and all(2 <= m <= 16 for m in it.root_counts if m)


def test_priced_budgets_split_by_one_plus_n_leaves():
    """Priced, the closed rule spreads a remainder, so any multiple of 1 + N is a budget (unpriced, the
    groups of 4 need multiples of (1 + N) * 4)."""
    assert alloc.trace(2, group_size=4, pricing=Pricing()).leaf_step() == 3
    assert alloc.trace(2, group_size=4).leaf_step() == 12
    it = _trace_run(_no_flips(), seed=0, steer=True, leaves=21, probe=2)  # M = 7
    assert it.ledger.leaves_used == 21 and it.ledger.leaves["expand"] == 2
    closed = _trace_run(_no_flips(), seed=0, steer=False, leaves=21)  # GRPO's groups, remainder spread
    assert sorted(int(m) for m in closed.root_counts if m) == [4, 4, 4, 4, 5]


@pytest.mark.parametrize(
    ("n", "pool", "sizes"),
    [(8, 5, [4, 4]), (10, 5, [5, 5]), (13, 5, [4, 4, 5]), (3, 5, [3]), (1, 5, [1]), (30, 5, [6] * 5)],
)
def test_spread_groups_by_hand(n, pool, sizes):
    got = alloc.UniformRoots(4, spread=True)(np.full(pool, 0.5), n, np.random.default_rng(0))
    assert sorted(int(m) for m in got if m) == sizes and got.sum() == n


def test_a_priced_allocator_needs_the_flip_rates():
    with pytest.raises(ValueError, match="FlipRates"):
        _trace_run(None, seed=0, steer=True)


@settings(max_examples=40, deadline=None)
@given(
    gains=st.lists(st.lists(st.floats(0, 1), min_size=3, max_size=3), min_size=1, max_size=4),
    total=st.integers(0, 12),
)
def test_solve_counts_is_the_brute_force_optimum(gains, total):
    sizes = np.array([0, 2, 3])
    got = alloc.solve_counts(np.array(gains), sizes, total)
    feasible = [c for c in itertools.product(range(3), repeat=len(gains)) if sizes[list(c)].sum() == total]
    if not feasible:
        assert got is None
        return
    best = max(sum(gains[i][c[i]] for i in range(len(gains))) for c in feasible)
    index = {0: 0, 2: 1, 3: 2}
    assert sum(gains[i][index[int(m)]] for i, m in enumerate(got)) == pytest.approx(best)


def test_knapsack_value_by_hand():
    # v = 0.5, m = 2: P(mixed) = 1 - 0.25 - 0.25 = 0.5, times 0.5 * 0.25
    assert alloc.knapsack_value(np.array(0.5), np.array(2)) == pytest.approx(0.0625)
    # v = 0.2, m = 3: 1 - 0.008 - 0.512 = 0.48, times 0.2 * 0.64
    assert alloc.knapsack_value(np.array(0.2), np.array(3)) == pytest.approx(0.48 * 0.128)


def test_knapsack_spends_grpos_prompts_with_at_least_two_each_by_brute_force():
    v = np.array([0.5, 0.02, 0.3, 0.9, 0.6, 0.1])
    counts = alloc.knapsack(group_size=4, min_group=2, max_per_prompt=8).allocate_roots(
        v, alloc.Budget(12), np.random.default_rng(0)
    )
    chosen = np.flatnonzero(counts)
    assert len(chosen) == 3 and counts.sum() == 12 and counts[chosen].min() >= 2

    def value(vi, m):  # P(mixed) * v (1 - v)^2, from the definition
        return (1 - vi**m - (1 - vi) ** m) * vi * (1 - vi) ** 2

    best = max(
        sum(value(v[i], m) for i, m in zip(chosen, ms, strict=True))
        for ms in itertools.product(range(2, 9), repeat=3)
        if sum(ms) == 12
    )
    assert sum(value(v[i], counts[i]) for i in chosen) == pytest.approx(best)


def test_pooled_rates_by_hand():
    sel = Selection(attributes=True, attribute_strength=4.0)
    sel.pooled = {(): (6.0, 10.0), ("steps=1",): (9.0, 10.0)}
    root = (6 + 4 * 0.5) / 14  # all tasks, shrunk towards 0.5
    got = sel.pooled_rates([("steps=1",), ("steps=3",)])
    assert got[0] == pytest.approx((9 + 4 * root) / 14)
    assert got[1] == pytest.approx(root)  # no record at this level: the parent's rate


def test_pooled_outcomes_count_every_level_and_fade():
    sel = Selection(attributes=True, attribute_decay=0.5)
    tree = _hand_tree()  # two bare rollouts: one win, one loss
    sel.pool_outcomes([tree], {0: ("steps=2", "hard_ops=1")})
    assert sel.pooled == {(): (1.0, 2.0), ("steps=2",): (1.0, 2.0), ("steps=2", "hard_ops=1"): (1.0, 2.0)}
    sel.pool_outcomes([], {})
    assert sel.pooled[()] == (0.5, 1.0)
    restored = Selection(attributes=True)
    restored.load_state_dict(sel.state_dict())
    assert restored.pooled == sel.pooled
