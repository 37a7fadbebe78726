import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning import allocation as alloc
from trace_lightning.allocation import PrefixCandidate, solve_prefixes, solve_roots, v_root
from trace_lightning.budget import Budget, BudgetError


def mixed_prob(v, m):
    """V_root as docs/algorithm.md#stage-1-roots states it, written out: P(m Bernoulli(v) rollouts are
    not all equal); 0 for m < 2."""
    if m < 2:
        return 0.0
    return 1.0 - v**m - (1.0 - v) ** m


def brute_force_roots(v, n_roots, min_group, cap, leaves_per_root=1, breadth=0.0):
    """(best objective, most prompts among the optima) over every allocation with
    m_i in {0} ∪ [min_group, cap] and sum = n_roots; predictions clipped to [1e-4, 1 - 1e-4] as the
    solver documents. (-inf, 0) when no allocation exists."""
    v = [min(max(x, 1e-4), 1 - 1e-4) for x in v]
    sizes = [0, *range(min_group, cap + 1)]
    best, most = -np.inf, 0
    for ms in itertools.product(sizes, repeat=len(v)):
        if sum(ms) != n_roots:
            continue
        prompts = sum(m > 0 for m in ms)
        value = sum(mixed_prob(x, leaves_per_root * m) for x, m in zip(v, ms, strict=True))
        value += breadth * prompts
        if value > best + 1e-7:
            best, most = value, prompts
        elif value > best - 1e-7:
            best, most = max(best, value), max(most, prompts)
    return best, most


def brute_force_prefixes(q, budget):
    best = -np.inf
    for ks in itertools.product(range(budget + 1), repeat=len(q)):
        if sum(ks) == budget:
            best = max(best, float(sum(1 - qi**k for qi, k in zip(q, ks, strict=True))))
    return best


def test_worked_example():
    # two groups of 2 at v = 0.5 give 0.5 + 0.5 = 1.0; one group of 4 gives 1 - 2/16 = 0.875
    assert solve_roots(np.array([0.5, 0.9, 0.5]), 4).tolist() == [2, 0, 2]


def test_greedy_trap_is_solved_exactly():
    # A gain-per-unit greedy opens the v=0.5 pair (+0.5), then prefers its third rollout (+0.25)
    # over the v=0.3 pair (+0.42, i.e. 0.21 a rollout), ending at [4, 0] = 0.875; the optimum is
    # [2, 2] = 0.5 + (1 - 0.09 - 0.49) = 0.92.
    counts = solve_roots(np.array([0.5, 0.3]), 4, max_per_prompt=None)
    assert counts.tolist() == [2, 2]


def test_v_root_is_zero_below_a_pair():
    v = np.array([0.0, 0.3, 0.5, 1.0])
    assert v_root(v, np.zeros(4, dtype=int)).tolist() == [0.0] * 4
    assert v_root(v, np.ones(4, dtype=int)).tolist() == [0.0] * 4
    assert v_root(np.array([0.5]), np.array([2])).tolist() == [0.5]


def test_issue_11_example_skips_hopeless_prompts():
    # [6, 0, 0]: 1 - 2 / 64 = 0.969; [2, 2, 2]: 0.5 + 2 * 2 * 0.02 * 0.98 = 0.578
    assert solve_roots(np.array([0.5, 0.02, 0.02]), 6).tolist() == [6, 0, 0]


def test_ties_between_pairs_and_triples_go_to_more_prompts():
    # Three prompts at v = 0.5 with 6 rollouts: [3, 3, 0] and [2, 2, 2] both give 1.5; train three.
    assert solve_roots(np.full(3, 0.5), 6).tolist() == [2, 2, 2]


def random_root_case(rng):
    """Small random Stage 1 problems, with extreme predictions and budgets that force skipping."""
    kind = rng.integers(3)
    n = int(rng.integers(1, 5))
    if kind == 0:
        v = rng.uniform(0, 1, size=n)
    elif kind == 1:  # near-decided prompts: the optimum skips them
        v = rng.choice([0.0, 1e-6, 0.01, 0.5, 0.99, 1 - 1e-6, 1.0], size=n)
    else:  # equal predictions: only the tie-break decides
        v = np.full(n, rng.choice([0.2, 0.5, 0.7]))
    return v, int(rng.integers(2, 10)), int(rng.integers(1, 4)), int(rng.integers(2, 7))


@pytest.mark.parametrize("leaves_per_root, breadth", [(1, 0.0), (3, 0.0), (1, 0.2)])
def test_roots_match_independent_brute_force(leaves_per_root, breadth):
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(1600):
        v, n_roots, min_group, cap = random_root_case(rng)
        best, most = brute_force_roots(v.tolist(), n_roots, min_group, cap, leaves_per_root, breadth)
        try:
            counts = solve_roots(v, n_roots, min_group, cap, leaves_per_root, breadth)
        except BudgetError:
            assert best == -np.inf, (v, n_roots, min_group, cap)
            continue
        assert counts.sum() == n_roots
        assert all(m == 0 or min_group <= m <= min(cap, n_roots) for m in counts)
        clipped = np.clip(v, 1e-4, 1 - 1e-4)
        got = sum(mixed_prob(x, leaves_per_root * int(m)) for x, m in zip(clipped, counts, strict=True))
        got += breadth * int((counts > 0).sum())
        assert got == pytest.approx(best, abs=1e-7), (v, n_roots, min_group, cap, counts)
        assert int((counts > 0).sum()) == most, (v, n_roots, min_group, cap, counts)
        checked += 1
    assert checked >= 1000


@settings(max_examples=150, deadline=None)
@given(q=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), budget=st.integers(0, 6))
def test_prefixes_match_brute_force(q, budget):
    q = np.array(q)
    ks = solve_prefixes(q, budget)
    assert ks.sum() == budget
    assert float(np.sum(1 - q**ks)) == pytest.approx(brute_force_prefixes(q, budget), abs=1e-12)


def test_prefix_budget_goes_where_the_outcome_may_flip():
    # On a success (r=1), risky prefixes (low V) get continuations; on a failure, promising ones.
    cands = [PrefixCandidate(1, True, 0.95), PrefixCandidate(2, True, 0.4), PrefixCandidate(3, False, 0.1)]
    ks = alloc.ActivePrefixes()(cands, 3, np.random.default_rng(0))
    assert ks[1] >= 2 and ks[0] == 0


def test_deterministic_given_seed():
    v = np.random.default_rng(3).random(64)
    for make in (alloc.uniform, alloc.pcl, alloc.trace, alloc.random_expand):
        a, b = make(), make()
        budget = Budget(48)
        ca = a.allocate_roots(v, budget, np.random.default_rng(11))
        cb = b.allocate_roots(v, budget, np.random.default_rng(11))
        assert ca.tolist() == cb.tolist()


def test_pcl_picks_closest_to_half():
    v = np.array([0.1, 0.45, 0.9, 0.55, 0.5, 0.0])
    counts = alloc.pcl(group_size=2).allocate_roots(v, Budget(6), np.random.default_rng(0))
    assert counts.tolist() == [0, 2, 0, 2, 2, 0]


ALLOCATORS = [
    alloc.uniform(4),
    alloc.pcl(4),
    alloc.random_expand(2, 2),
    alloc.trace(2),
    alloc.trace_root_only(2),
    alloc.trace_prefix_only(2, 2),
]


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, len(ALLOCATORS) - 1),
    preds=st.lists(st.floats(0.0, 1.0), min_size=8, max_size=60),
    groups=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_root_budget_is_exact_or_a_clear_error(which, preds, groups, seed):
    allocator = ALLOCATORS[which]
    budget = Budget(leaves=12 * groups)  # a multiple of 4, and of 2 * (1 + 2)
    try:
        counts = allocator.allocate_roots(np.array(preds), budget, np.random.default_rng(seed))
    except BudgetError as err:
        assert "data.pool_size" in str(err) or "budget.leaves" in str(err)
        return
    assert counts.sum() * (1 + allocator.expansion) == budget.leaves
    assert (counts >= 0).all()


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, len(ALLOCATORS) - 1),
    preds=st.lists(st.floats(0.0, 1.0), max_size=12),
    wins=st.lists(st.booleans(), min_size=12, max_size=12),
    n_bare=st.integers(1, 5),
)
def test_prefix_budget_is_m_times_n(which, preds, wins, n_bare):
    allocator = ALLOCATORS[which]
    cands = [PrefixCandidate(i, w, p) for i, (p, w) in enumerate(zip(preds, wins, strict=False))]
    ks = allocator.allocate_prefixes(cands, n_bare, np.random.default_rng(0))
    assert len(ks) == len(cands)
    assert ks.sum() == (n_bare * allocator.expansion if cands else 0)


def test_clear_errors():
    with pytest.raises(BudgetError, match="data.pool_size"):
        alloc.uniform(4).allocate_roots(np.full(3, 0.5), Budget(16), np.random.default_rng(0))
    with pytest.raises(BudgetError, match="multiple of 1 \\+ allocator.expansion"):
        alloc.trace(2).allocate_roots(np.full(8, 0.5), Budget(10), np.random.default_rng(0))
    with pytest.raises(BudgetError, match="minimal group"):
        alloc.trace(2, min_group=2).allocate_roots(np.full(8, 0.5), Budget(3), np.random.default_rng(0))
    with pytest.raises(BudgetError, match="max_per_prompt"):
        solve_roots(np.full(2, 0.5), 40, max_per_prompt=16)
    with pytest.raises(BudgetError, match="multiple of allocator.group_size"):
        alloc.uniform(4).allocate_roots(np.full(8, 0.5), Budget(6), np.random.default_rng(0))
    with pytest.raises(BudgetError, match="budget.leaves"):
        Budget(0)
    with pytest.raises(BudgetError, match="prefix rule"):
        alloc.TreeAllocator("bad", alloc.UniformRoots(2), None, expansion=1)


def test_beta_prior_cold_start():
    prior = alloc.BetaPrior(alpha=1, beta=1, warmup=2)
    assert prior.active(0) and prior.active(1) and not prior.active(2)
    prior.update(5, successes=3, failures=1)
    np.testing.assert_allclose(prior.mean([5, 6]), [4 / 6, 0.5])
    restored = alloc.BetaPrior(warmup=2)
    restored.load_state_dict(prior.state_dict())
    assert restored.counts == prior.counts
    with pytest.raises(ValueError, match="cold_start.alpha"):
        alloc.BetaPrior(alpha=0)


def test_reserved_rollouts_are_kept_and_the_rule_splits_the_rest():
    """The unbiased slice (selection.explore_groups): reserved counts stay, Stage 1 fills the others."""
    v = np.array([0.5, 0.5, 0.02, 0.5, 0.5])
    reserved = np.array([2, 0, 0, 0, 0])
    counts = alloc.trace(expansion=1, max_per_prompt=4).allocate_roots(
        v, Budget(12), np.random.default_rng(0), reserved
    )
    assert counts[0] == 2 and counts.sum() == 6 and counts[2] == 0  # 4 more on the uncertain others
    assert counts[1:].tolist().count(2) == 2
    whole = alloc.uniform(2).allocate_roots(v, Budget(4), np.random.default_rng(0), np.array([2, 2, 0, 0, 0]))
    assert whole.tolist() == [2, 2, 0, 0, 0]  # the slice took the whole budget
    with pytest.raises(BudgetError, match="selection.explore_groups"):
        alloc.uniform(2).allocate_roots(v, Budget(4), np.random.default_rng(0), np.array([2, 2, 2, 0, 0]))


@pytest.mark.parametrize("name", ["trace", "trace_root_only", "trace_prefix_only", "random_expand"])
def test_every_tree_allocator_runs_without_continuations(name):
    """N = 0 (`allocator.expansion=0`): Stage 1 alone spends every leaf on bare rollouts."""
    allocator = getattr(alloc, name)(expansion=0)
    assert allocator.prefixes is None and allocator.n_roots(Budget(12)) == 12
    counts = allocator.allocate_roots(np.linspace(0.1, 0.9, 8), Budget(12), np.random.default_rng(0))
    assert counts.sum() == 12


def test_root_only_ablation_takes_traces_stage1_breadth():
    """Table 1's "active root" row runs trace's Stage 1, breadth included: the same root counts."""
    v, budget, rng = np.linspace(0.05, 0.95, 10), Budget(16), np.random.default_rng(0)
    for breadth in (0.0, 0.2, 1.0):
        root_only = alloc.trace_root_only(1, 2, 8, breadth).allocate_roots(v, budget, rng)
        np.testing.assert_array_equal(
            root_only, alloc.trace(1, 2, 8, breadth=breadth).allocate_roots(v, budget, rng)
        )
    wide = alloc.trace_root_only(1, 2, 8, 1.0).allocate_roots(v, budget, rng)
    assert (wide > 0).sum() > (alloc.trace_root_only(1, 2, 8).allocate_roots(v, budget, rng) > 0).sum()
    with pytest.raises(BudgetError, match="allocator.breadth"):
        alloc.trace_root_only(breadth=-1.0)
