"""How good the predictor is, measured against outcomes it did not choose.

Two sources of such outcomes: a Monte Carlo probe (S episodes of every pool candidate, outside the
budget: `collector.RolloutCollector.probe`) and the unbiased slice of Stage 1 (groups on uniformly
drawn candidates, `selection.explore_groups`). The gauges here are pure functions (numpy only, part
of the pure core, so selection.py's gate can use them) of predictions and outcome counts, so an oracle
and a constant can be checked against them by hand:

* Spearman correlation of the predictions with the probed success rates (ranking);
* the Brier score against every probe episode, next to the base rate's Brier score (calibration and
  resolution together; the base rate is the probe's own mean, the strongest constant there is);
* the expected number of mixed groups an allocation of root rollouts buys, evaluated with the unbiased
  estimator of V_root from the probe's outcomes (not the plug-in estimate, which is biased low).
"""

from __future__ import annotations

from math import comb

import numpy as np

from trace_lightning.allocation import solve_roots


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of their ranks: [10, 30, 10] -> [1.5, 3, 1.5]."""
    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return np.asarray(((ends - counts + 1 + ends) / 2)[inverse], dtype=np.float64)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation: Pearson's on average ranks; NaN when either side is constant."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(average_ranks(a), average_ranks(b))[0, 1])


def noise_ceiling(half_a: np.ndarray, half_b: np.ndarray) -> float:
    """The Spearman a predictor that knew every candidate's true success rate would reach against the
    rates of both halves pooled: split-half reliability r = Spearman(half_a, half_b), stepped up to the
    pooled sample by Spearman-Brown (2r / (1 + r)), and its square root (the correlation of the truth
    with a measurement of that reliability). NaN when r is undefined or <= 0.

    Example: halves that agree with r = 0.6 -> reliability 0.75 -> ceiling 0.866."""
    r = spearman(half_a, half_b)
    return float(np.sqrt(2 * r / (1 + r))) if np.isfinite(r) and r > 0 else float("nan")


def brier(p: np.ndarray, successes: np.ndarray, samples: np.ndarray) -> float:
    """Mean (p_i - y)^2 over every outcome y of every candidate i, with `successes[i]` of `samples[i]`
    outcomes being 1: sum_i [s_i (1 - p_i)^2 + (n_i - s_i) p_i^2] / sum_i n_i.

    Example: p = [0.5, 1.0], 1 of 2 and 2 of 2 successes -> (2 * 0.25 + 0) / 4 = 0.125."""
    p, s, n = (np.asarray(x, dtype=np.float64) for x in (p, successes, samples))
    return float(np.sum(s * (1 - p) ** 2 + (n - s) * p**2) / np.sum(n))


def base_rate_brier(successes: np.ndarray, samples: np.ndarray) -> float:
    """The Brier score of predicting the outcomes' own mean for every candidate: b (1 - b)."""
    rate = float(np.sum(successes) / np.sum(samples))
    return rate * (1 - rate)


def brier_skill(p: np.ndarray, successes: np.ndarray, samples: np.ndarray) -> float:
    """1 - Brier / base-rate Brier: > 0 when the predictions beat the best constant, 1 for a perfect
    forecast of every outcome; NaN when the outcomes are all equal (no constant can be beaten)."""
    base = base_rate_brier(successes, samples)
    return 1.0 - brier(p, successes, samples) / base if base > 0 else float("nan")


def skill_against(p: np.ndarray, reference: np.ndarray, successes: np.ndarray, samples: np.ndarray) -> float:
    """1 - Brier(p) / Brier(reference): skill over a forecast made at the same time as p (the base rate
    known before the outcomes), so neither side has seen them. A predictor equal to the reference
    scores exactly 0, one that beats it more than 0; NaN when the reference is perfect.

    Example: p = [0.9, 0.1], reference [0.5, 0.5], outcomes 1 and 0 -> 1 - 0.01 / 0.25 = 0.96."""
    ref = brier(reference, successes, samples)
    return 1.0 - brier(p, successes, samples) / ref if ref > 0 else float("nan")


def mixed_prob_unbiased(successes: np.ndarray, samples: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Unbiased estimate of V_root(v_i, m_i) = 1 - v^m - (1 - v)^m from k_i successes in n_i episodes.

    v^m is estimated by C(k, m) / C(n, m): the chance that m of the n recorded episodes, drawn without
    replacement, all succeeded (a U-statistic; needs m <= n). m < 2 gives 0, as V_root does.
    Example: k = 1 of n = 2, m = 2 -> 1 - 0 - 0 = 1 (the two recorded episodes are the pair).  # [P]
    """
    out = np.zeros(len(m))
    for i, (k, n, mi) in enumerate(zip(successes, samples, m, strict=True)):
        k, n, mi = int(k), int(n), int(mi)
        if mi < 2:
            continue
        if mi > n:
            raise ValueError(f"a group of {mi} needs at least {mi} probe episodes per candidate, got {n}")
        out[i] = 1.0 - (comb(k, mi) + comb(n - k, mi)) / comb(n, mi)
    return out


def expected_mixed(counts: np.ndarray, successes: np.ndarray, samples: np.ndarray) -> float:
    """Expected number of candidates whose `counts[i]` bare rollouts are mixed. A group larger than the
    probe's episodes of its candidate is scored as a group of that many: a lower bound, since
    V_root(v, m) grows with m, where an unbiased estimate does not exist."""
    return float(mixed_prob_unbiased(successes, samples, np.minimum(counts, samples)).sum())


def expected_mixed_random_pairs(n_roots: int, successes: np.ndarray, samples: np.ndarray) -> float:
    """Expected mixed groups from n_roots / 2 pairs on distinct candidates drawn uniformly: by symmetry,
    (n_roots / 2) times the mean over candidates of P(a pair is mixed)."""
    pairs = np.full(len(successes), 2)
    return float(n_roots // 2 * mixed_prob_unbiased(successes, samples, pairs).mean())


def true_v_allocation(
    successes_a: np.ndarray, samples_a: np.ndarray, n_roots: int, max_per_prompt: int
) -> np.ndarray:
    """The exact V_root allocation (`allocation.solve_roots`) on probed success rates. Evaluate it on
    other episodes than the ones it was chosen on, or the ceiling is biased upwards (winner's curse)."""
    v = np.asarray(successes_a) / np.asarray(samples_a)  # [P]
    return solve_roots(v, n_roots, max_per_prompt=max_per_prompt)
