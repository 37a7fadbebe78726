"""The predictor's gauges (predictor/gauges.py), each checked against its definition by hand or by
enumeration."""

import itertools
from math import comb

import numpy as np
import pytest

from trace_lightning import gauges


def test_average_ranks_share_ties():
    assert gauges.average_ranks(np.array([10, 30, 10, 20])).tolist() == [1.5, 4.0, 1.5, 3.0]


def test_spearman_on_a_hand_example_and_constants():
    # ranks of b: [1, 3, 2, 4]; d = [0, -1, 1, 0]; rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert gauges.spearman(np.array([1, 2, 3, 4]), np.array([10, 30, 20, 40])) == pytest.approx(0.8)
    assert np.isnan(gauges.spearman(np.array([0.5, 0.5, 0.5]), np.array([0.1, 0.2, 0.3])))


def test_noise_ceiling_steps_the_split_half_spearman_up_to_both_halves():
    # ranks differ by d = -1, 1, -1, 1, 0: rho = 1 - 6 * 4 / (5 * 24) = 0.8; 2 * 0.8 / 1.8 = 0.8889
    a, b = np.array([1, 2, 3, 4, 5]), np.array([2, 1, 4, 3, 5])
    assert gauges.noise_ceiling(a, b) == pytest.approx(np.sqrt(1.6 / 1.8))
    assert np.isnan(gauges.noise_ceiling(a, -b))  # halves that disagree: no ceiling
    assert np.isnan(gauges.noise_ceiling(a, np.ones(5)))  # a constant half: Spearman undefined


def test_brier_and_its_base_rate_against_every_outcome():
    p, s, n = np.array([0.5, 1.0, 0.2]), np.array([1, 2, 0]), np.array([2, 2, 3])
    outcomes = [(0.5, 1), (0.5, 0), (1.0, 1), (1.0, 1), (0.2, 0), (0.2, 0), (0.2, 0)]
    assert gauges.brier(p, s, n) == pytest.approx(np.mean([(q - y) ** 2 for q, y in outcomes]))
    rate = 3 / 7
    assert gauges.base_rate_brier(s, n) == pytest.approx(np.mean([(rate - y) ** 2 for _, y in outcomes]))
    assert gauges.brier_skill(np.full(3, rate), s, n) == pytest.approx(0.0)
    assert np.isnan(gauges.brier_skill(p, np.zeros(3), n))  # all failures: nothing to beat


def mixed_share_by_enumeration(k, n, m):
    """Share of the m-subsets of the n recorded episodes (k successes) that hold both outcomes."""
    episodes = [1] * k + [0] * (n - k)
    subsets = list(itertools.combinations(range(n), m))
    return np.mean([0 < sum(episodes[i] for i in c) < m for c in subsets])


def test_mixed_probability_estimate_is_the_share_of_mixed_subsets():
    for n in range(2, 7):
        for k in range(n + 1):
            for m in range(0, n + 1):
                got = gauges.mixed_prob_unbiased(np.array([k]), np.array([n]), np.array([m]))[0]
                want = mixed_share_by_enumeration(k, n, m) if m >= 2 else 0.0
                assert got == pytest.approx(want), (k, n, m)
    with pytest.raises(ValueError, match="probe episodes"):
        gauges.mixed_prob_unbiased(np.array([1]), np.array([2]), np.array([3]))


@pytest.mark.parametrize(("v", "n", "m"), [(0.3, 6, 3), (0.5, 4, 2), (0.9, 8, 5)])
def test_mixed_probability_estimate_is_unbiased(v, n, m):
    """Averaged over the binomial distribution of k, it equals 1 - v^m - (1 - v)^m exactly."""
    mean = sum(
        comb(n, k)
        * v**k
        * (1 - v) ** (n - k)
        * gauges.mixed_prob_unbiased(np.array([k]), np.array([n]), np.array([m]))[0]
        for k in range(n + 1)
    )
    assert mean == pytest.approx(1 - v**m - (1 - v) ** m)


def test_random_pairs_average_over_every_choice_of_candidates():
    s, n = np.array([0, 3, 5, 8, 2]), np.full(5, 8)
    per = gauges.mixed_prob_unbiased(s, n, np.full(5, 2))
    choices = list(itertools.combinations(range(5), 2))  # 4 root rollouts: 2 pairs on distinct candidates
    want = np.mean([per[list(c)].sum() for c in choices])
    assert gauges.expected_mixed_random_pairs(4, s, n) == pytest.approx(want)
    assert gauges.expected_mixed(np.array([2, 0, 2, 0, 0]), s, n) == pytest.approx(per[0] + per[2])


def test_the_true_v_allocation_puts_groups_on_the_most_uncertain_candidates():
    counts = gauges.true_v_allocation(np.array([0, 4, 8, 4, 1]), np.full(5, 8), 4, max_per_prompt=8)
    assert counts.tolist() == [0, 2, 0, 2, 0]  # the two rates of 0.5


def test_skill_against_a_reference_forecast():
    p, ref = np.array([0.9, 0.1]), np.array([0.5, 0.5])
    assert gauges.skill_against(p, ref, np.array([1, 0]), np.array([1, 1])) == pytest.approx(1 - 0.01 / 0.25)
    assert gauges.skill_against(ref, ref, np.array([1, 0]), np.array([1, 1])) == 0.0


def test_a_group_larger_than_the_probe_counts_as_a_group_of_the_probes_size():
    """Candidate 0: 1 success in 4 episodes, a group of 6 -> scored as a group of 4: every 4-subset of the
    4 episodes holds the success and 3 failures, so it is mixed (1.0). Candidate 1: a pair from 2 of 4."""
    counts, successes, samples = np.array([6, 2]), np.array([1, 2]), np.array([4, 4])
    pair = 1 - (comb(2, 2) + comb(2, 2)) / comb(4, 2)  # 4 of the 6 pairs hold one success: 2/3
    assert gauges.expected_mixed(counts, successes, samples) == pytest.approx(1.0 + pair)
    with pytest.raises(ValueError, match="a group of 6 needs at least 6"):
        gauges.mixed_prob_unbiased(successes, samples, counts)
