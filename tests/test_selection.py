"""Stage 1 exploration and calibration (selection.py): pools, visit caps, the gate, Thompson sampling."""

import numpy as np
import pytest

from trace_lightning.allocation import BetaPrior
from trace_lightning.selection import Selection
from trace_lightning.tree import RolloutTree


def test_plain_pool_is_a_draw_without_replacement():
    sel, rng = Selection(), np.random.default_rng(3)
    pool = sel.draw_pool(list(range(20)), 8, 0, rng)
    assert len(set(pool)) == 8 and set(pool) <= set(range(20))


def test_epoch_pools_make_every_task_a_candidate_once_per_pass():
    sel, rng = Selection(epoch_pools=True), np.random.default_rng(1)
    tasks = list(range(12))
    first_pass = [t for it in range(3) for t in sel.draw_pool(tasks, 4, it, rng)]
    assert sorted(first_pass) == tasks  # 3 pools of 4 cover the 12 tasks exactly once
    second_pass = [t for it in range(3, 6) for t in sel.draw_pool(tasks, 4, it, rng)]
    assert sorted(second_pass) == tasks
    assert first_pass != second_pass  # a fresh shuffle


def tree_with_bare_outcomes(task_id, outcomes, predicted=0.5):
    tree = RolloutTree(task_id, prompt_ids=[1])
    tree.root.predicted = predicted
    for r in outcomes:
        node = tree.add_turn(0, "bare", [5], [])
        tree.finish(node, float(r), "done")
    return tree


def test_visit_cap_excludes_prompts_that_trained_too_often():
    sel = Selection(max_visits=2, visit_window=3)
    for it in range(2):
        sel.observe(it, [tree_with_bare_outcomes(0, [1, 0])], np.array([0.5]), set())
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert 0 not in sel.draw_pool(list(range(5)), 4, 2, rng)
    # Three iterations later the visits have left the window: task 0 is a candidate again.
    sel.observe(4, [tree_with_bare_outcomes(1, [1, 0])], np.array([0.5]), set())
    assert any(0 in sel.draw_pool(list(range(5)), 4, 5, rng) for _ in range(20))


def observe_slice(sel, iteration, predicted, outcomes):
    """One iteration whose every tree was an unbiased-slice group with these bare outcomes."""
    trees = [
        tree_with_bare_outcomes(i, o, p) for i, (p, o) in enumerate(zip(predicted, outcomes, strict=True))
    ]
    return sel.observe(iteration, trees, np.array(predicted), {t.task_id for t in trees})


def skill_by_hand(p, outcomes, reference):
    """1 - sum (p - y)^2 / sum (reference - y)^2 over every outcome, from the definition."""
    pairs = [(pi, r, y) for pi, r, ys in zip(p, reference, outcomes, strict=True) for y in ys]
    return 1 - sum((pi - y) ** 2 for pi, _, y in pairs) / sum((r - y) ** 2 for _, r, y in pairs)


# Success rates 0.1, 0.3, 0.6, 0.9 and four outcomes each that match them as closely as 4 draws can.
RATES = [0.1, 0.3, 0.6, 0.9]
OUTCOMES = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_the_skill_gate_opens_for_an_oracle_and_stays_closed_for_a_constant():
    pool = np.array([0.5, 0.45, 0.05, 0.95])
    oracle = Selection(explore_groups=4, explore_size=4, gate_skill=0.05, gate_min_samples=8)
    constant = Selection(explore_groups=4, explore_size=4, gate_skill=0.05, gate_min_samples=8)
    rng = np.random.default_rng(0)
    assert oracle.estimates(pool, [0, 1, 2, 3], BetaPrior(), rng).tolist() == [0.5] * 4  # no evidence yet
    for it in range(2):
        quality = observe_slice(oracle, it, RATES, OUTCOMES)
        observe_slice(constant, it, [0.5] * 4, OUTCOMES)  # the outcomes' own base rate, 8 of 16
    open_, skill = oracle.gate()
    # the base rate known before each iteration: 0.5 at first (none), then iteration 0's 8 of 16
    assert open_ and skill == pytest.approx(skill_by_hand(RATES * 2, OUTCOMES * 2, [0.5] * 8))
    assert quality.slice_skill == pytest.approx(skill_by_hand(RATES, OUTCOMES, [0.5] * 4))
    assert oracle.estimates(pool, [0, 1, 2, 3], BetaPrior(), rng).tolist() == pool.tolist()
    closed, constant_skill = constant.gate()
    assert not closed and constant_skill == pytest.approx(0.0, abs=1e-12)
    assert constant.estimates(pool, [0, 1, 2, 3], BetaPrior(), rng).tolist() == [0.5] * 4  # uniform Stage 1


def test_the_gate_forgets_evidence_older_than_its_window():
    sel = Selection(explore_groups=4, explore_size=4, gate_skill=0.05, gate_min_samples=8, gate_window=2)
    for it in range(2):
        observe_slice(sel, it, RATES, OUTCOMES)
    assert sel.gate()[0]
    for it in range(2, 4):  # now the predictions are reversed: worse than the base rate
        observe_slice(sel, it, RATES[::-1], OUTCOMES)
    open_, skill = sel.gate()
    assert not open_ and skill == pytest.approx(skill_by_hand(RATES[::-1] * 2, OUTCOMES * 2, [0.5] * 8))


def test_only_the_slice_feeds_the_gate():
    sel = Selection(explore_groups=1, gate_skill=0.05, gate_min_samples=2)
    trees = [tree_with_bare_outcomes(0, [1, 1], 0.9), tree_with_bare_outcomes(1, [0, 1], 0.5)]
    sel.observe(0, trees, np.array([0.9, 0.5]), {1})
    assert [h[1:] for h in sel.history] == [(0.5, 0.5, 1.0, 2.0)]  # prediction, base rate, wins, rollouts
    assert sel.base_rate() == 0.5  # and only the slice's rollouts make the base rate: 1 of 2


def test_a_forecast_without_skill_scores_zero_whatever_stage_1_picked():
    """The slice succeeds 1 in 4; Stage 1's picks (mixed by design) 1 in 2. The constant forecast at the
    slice's own rate has no skill, so its score against the base rate must be 0. (Were the picks in the
    base rate, the reference would be 8 of 20 = 0.4 and the same forecast would score 0.11.)"""
    sel = Selection(explore_groups=2, explore_size=4, gate_skill=0.05, gate_min_samples=8, gate_window=2)
    for it in range(4):
        slice_trees = [tree_with_bare_outcomes(i, [1, 0, 0, 0], 0.25) for i in (0, 1)]
        picked = [tree_with_bare_outcomes(i, [1, 0], 0.25) for i in range(2, 8)]
        sel.observe(it, slice_trees + picked, np.full(8, 0.25), {0, 1})
    open_, skill = sel.gate()  # the window's rows (iterations 2, 3) were scored against 0.25
    assert skill == pytest.approx(0.0, abs=1e-12) and not open_
    assert sel.base_rate() == 0.25


def test_the_slice_reserves_uniformly_drawn_groups():
    sel, rng = Selection(explore_groups=3, explore_size=2), np.random.default_rng(0)
    draws = np.array([sel.explore(10, rng) for _ in range(3000)])
    assert set(np.unique(draws)) == {0, 2} and (draws.sum(1) == 6).all()
    assert draws.mean(0) / 2 == pytest.approx(np.full(10, 0.3), abs=0.03)  # each candidate 3 in 10
    assert Selection().explore(5, rng).tolist() == [0] * 5


def test_thompson_samples_the_posterior_of_counts_and_prediction():
    prior = BetaPrior()
    prior.update(7, 6.0, 2.0)
    sel = Selection(thompson=True, predictor_strength=4.0)
    rng = np.random.default_rng(0)
    draws = np.array([sel.estimates(np.array([0.25, 0.9]), [7, 8], prior, rng) for _ in range(20000)])
    # Beta(1 + 6 + 4 * 0.25, 1 + 2 + 4 * 0.75) = Beta(8, 6): mean 8/14; task 8 has no counts: Beta(4.6, 1.4)
    assert draws[:, 0].mean() == pytest.approx(8 / 14, abs=0.01)
    assert draws[:, 1].mean() == pytest.approx(4.6 / 6.0, abs=0.01)
    assert draws[:, 0].var() == pytest.approx(8 * 6 / (14**2 * 15), rel=0.1)


def test_thompson_with_a_closed_gate_ignores_the_prediction():
    sel = Selection(thompson=True, predictor_strength=100.0, explore_groups=1, gate_skill=0.9)
    rng = np.random.default_rng(0)
    draws = np.array([sel.estimates(np.array([0.99]), [0], BetaPrior(), rng)[0] for _ in range(20000)])
    assert draws.mean() == pytest.approx(0.5, abs=0.01)  # Beta(1, 1)


def test_decayed_counts_fade_once_per_iteration():
    prior = BetaPrior(decay=0.5)
    prior.update(0, 4.0, 0.0)
    prior.step()
    prior.update(0, 0.0, 2.0)
    assert prior.successes_failures([0])[0].tolist() == [2.0]
    assert prior.mean([0]).tolist() == [pytest.approx((1 + 2) / (2 + 4))]


def test_state_round_trip_continues_identically():
    a = Selection(epoch_pools=True, max_visits=1, explore_groups=2, gate_skill=0.5)
    rng = np.random.default_rng(0)
    a.draw_pool(list(range(10)), 3, 0, rng)
    observe_slice(a, 0, [0.5, 0.2], [[1, 0], [0, 0]])
    b = Selection(epoch_pools=True, max_visits=1, explore_groups=2, gate_skill=0.5)
    b.load_state_dict(a.state_dict())
    assert b.history == a.history and len(a.history) == 2
    state = rng.bit_generator.state
    first = a.draw_pool(list(range(10)), 3, 1, rng)
    rng.bit_generator.state = state
    assert b.draw_pool(list(range(10)), 3, 1, rng) == first


def test_bad_values_name_their_key():
    with pytest.raises(ValueError, match="selection.gate_skill"):
        Selection(explore_groups=1, gate_skill=1.5)
    with pytest.raises(ValueError, match="selection.explore_groups"):
        Selection(gate_skill=0.0)  # a gate with no slice to measure on
    with pytest.raises(ValueError, match="selection.explore_size"):
        Selection(explore_groups=1, explore_size=1)
    with pytest.raises(ValueError, match="selection.max_visits"):
        Selection(max_visits=0)
    with pytest.raises(ValueError, match="selection.cell_quota"):
        Selection(cell_quota=0.0)
    with pytest.raises(ValueError, match="data.pool_size"):
        Selection().draw_pool([0, 1], 3, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cold_start.decay"):
        BetaPrior(decay=0.0)


def test_the_cell_quota_worked_example():
    keys = [("a",), ("a",), ("a",), ("b",)]
    got = Selection(cell_quota=1.0).quota(np.array([0.5, 0.6, 0.9, 0.2]), keys, trained=2)
    # cell a: ceil(1 * 3 * 2 / 4) = 2 kept, those nearest 0.5; cell b: ceil(0.5) = 1
    assert got.tolist() == [0.5, 0.6, 0.0, 0.2]
    assert Selection().quota(np.array([0.5, 0.6, 0.9, 0.2]), keys, trained=2).tolist() == [0.5, 0.6, 0.9, 0.2]


@pytest.mark.parametrize("seed", range(20))
def test_the_cell_quota_keeps_each_cells_share_and_its_most_uncertain(seed):
    rng = np.random.default_rng(seed)
    pool, trained = int(rng.integers(4, 40)), float(rng.integers(1, 12))
    q = float(rng.choice([0.5, 1.0, 2.0]))
    keys = [(f"x={rng.integers(3)}", f"y={rng.integers(3)}") for _ in range(pool)]
    v = rng.uniform(0.01, 0.99, pool)
    got = Selection(cell_quota=q).quota(v, keys, trained)
    for cell in set(keys):
        idx = [i for i in range(pool) if keys[i] == cell]
        kept = [i for i in idx if got[i] > 0]
        dropped = [i for i in idx if got[i] == 0]
        share = q * len(idx) * trained / pool  # the cell's share of GRPO's prompts, times the quota
        assert len(kept) == min(len(idx), max(1, int(np.ceil(share - 1e-9))))
        assert all(got[i] == v[i] for i in kept)  # kept estimates are untouched
        if kept and dropped:  # nothing dropped is nearer 0.5 than anything kept
            assert max(abs(v[i] - 0.5) for i in kept) <= min(abs(v[i] - 0.5) for i in dropped)
