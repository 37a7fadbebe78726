"""Stage 1 exploration and calibration (selection.py): pools, visit caps, the gate, Thompson sampling."""

import itertools

import numpy as np
import pytest

from trace_lightning.allocation import BetaPrior
from trace_lightning.selection import Selection, auroc
from trace_lightning.tree import RolloutTree


def pairs_auroc(scores, labels):
    """Share of (positive, negative) pairs the scores order correctly, ties half: AUROC by definition."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auroc_matches_pair_count():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 12))
        scores = rng.choice([0.1, 0.2, 0.3, 0.5, 0.9], size=n)  # ties included
        labels = rng.integers(0, 2, size=n)
        if labels.all() or not labels.any():
            assert np.isnan(auroc(scores, labels))
            continue
        assert auroc(scores, labels) == pytest.approx(pairs_auroc(scores, labels), abs=1e-6)


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
        sel.observe(it, [tree_with_bare_outcomes(0, [1, 0])], np.array([0.5]))
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert 0 not in sel.draw_pool(list(range(5)), 4, 2, rng)
    # Three iterations later the visits have left the window: task 0 is a candidate again.
    sel.observe(4, [tree_with_bare_outcomes(1, [1, 0])], np.array([0.5]))
    assert any(0 in sel.draw_pool(list(range(5)), 4, 5, rng) for _ in range(20))


def observe_roots(sel, iteration, predicted, mixed):
    trees = [
        tree_with_bare_outcomes(i, [1, 0] if m else [1, 1], p)
        for i, (p, m) in enumerate(zip(predicted, mixed, strict=True))
    ]
    return sel.observe(iteration, trees, np.array(predicted))


def test_gate_closes_on_predictions_that_do_not_rank_mixed_prompts():
    sel = Selection(gate_auroc=0.6, gate_min_samples=4)
    pred = np.array([0.5, 0.45, 0.05, 0.95])
    assert sel.estimates(pred, [0, 1, 2, 3], BetaPrior(), np.random.default_rng(0)).tolist() == [0.5] * 4
    # Predictions near 0.5 (high p(1-p)) were the unmixed ones: AUROC 0, the gate stays closed.
    quality = observe_roots(sel, 0, [0.5, 0.45, 0.05, 0.95], [False, False, True, True])
    assert not sel.gate()[0] and quality.auroc_mixed == 0.0
    # Good rankings over the window open it: the raw predictions then reach Stage 1.
    observe_roots(sel, 1, [0.5, 0.45, 0.05, 0.95], [True, True, False, False])
    observe_roots(sel, 2, [0.5, 0.45, 0.05, 0.95], [True, True, False, False])
    open_, value = sel.gate()
    assert open_ and value == pytest.approx(
        pairs_auroc([0.25, 0.2475, 0.0475, 0.0475] * 3, [0, 0, 1, 1] + [1, 1, 0, 0] * 2)
    )
    assert sel.estimates(pred, [0, 1, 2, 3], BetaPrior(), np.random.default_rng(0)).tolist() == pred.tolist()


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
    sel = Selection(thompson=True, predictor_strength=100.0, gate_auroc=0.9)
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
    a = Selection(epoch_pools=True, max_visits=1, gate_auroc=0.5)
    rng = np.random.default_rng(0)
    a.draw_pool(list(range(10)), 3, 0, rng)
    observe_roots(a, 0, [0.5, 0.2], [True, False])
    b = Selection(epoch_pools=True, max_visits=1, gate_auroc=0.5)
    b.load_state_dict(a.state_dict())
    state = rng.bit_generator.state
    first = a.draw_pool(list(range(10)), 3, 1, rng)
    rng.bit_generator.state = state
    assert b.draw_pool(list(range(10)), 3, 1, rng) == first


def test_bad_values_name_their_key():
    with pytest.raises(ValueError, match="selection.gate_auroc"):
        Selection(gate_auroc=1.5)
    with pytest.raises(ValueError, match="selection.max_visits"):
        Selection(max_visits=0)
    with pytest.raises(ValueError, match="data.pool_size"):
        Selection().draw_pool([0, 1], 3, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cold_start.decay"):
        BetaPrior(decay=0.0)
