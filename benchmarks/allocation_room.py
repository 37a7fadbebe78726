"""How much root allocation can buy over GRPO, and how much of it a predictor of a given skill reaches.

    python benchmarks/allocation_room.py           # the figures in docs/algorithm.md (about a minute)
    python benchmarks/allocation_room.py --quick   # the test suite's smoke run

No policy and no training: each trial draws a pool of `--pool` candidate success rates v from a mixture
like the testbed's and the paper's settings (a share almost always failing, Beta(0.3, 8); a share almost
always succeeding, Beta(8, 0.3); the rest spread, Beta(1.2, 1.2)) and spends `--roots` bare rollouts on
it. The score is the expected number of mixed prompts (a group holding both outcomes), computed exactly
from v for the allocation each rule picks: sum over prompts of 1 - v^m - (1 - v)^m.

Rules, each at the same rollouts:
- grpo: groups of 4 on randomly drawn prompts (`UniformRoots`); pairs: groups of 2;
- trace, knapsack: Stage 1's exact program (`ActiveRoots`) and Knapsack RL (`KnapsackRoots`) fed
  (a) the true rates, (b) a noisy predictor h = sigmoid(shrink * logit(v) + N(0, sd^2)), whose skill is
  reported as the Spearman correlation of h with v over the pool;
- screen K: an in-budget two-phase Stage 1: pairs on K prompts first, then the rest of the budget by the
  exact program on each prompt's Beta posterior (prior Beta(0.6, 0.6)), prompts never screened at the
  prior. A screened pair that already differs is mixed and gets nothing more.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from trace_lightning import allocation as alloc

PRIOR = 0.6  # Beta(PRIOR, PRIOR) on a prompt never seen: the screen's prior
CAP = 16  # rollouts per prompt at most, as the shipped trace and knapsack allocators


def draw_pool(rng: np.random.Generator, size: int, shares: tuple[float, float]) -> np.ndarray:
    """Success rates: `shares` = (almost never, almost always) solved, the rest spread."""
    u = rng.random(size)
    hard, easy, mid = rng.beta(0.3, 8.0, size), rng.beta(8.0, 0.3, size), rng.beta(1.2, 1.2, size)
    return np.where(u < shares[0], hard, np.where(u < shares[0] + shares[1], easy, mid))


def expected_mixed(v: np.ndarray, counts: np.ndarray) -> float:
    """Expected prompts whose `counts` rollouts hold both outcomes: sum 1 - v^m - (1 - v)^m."""
    trained = counts > 0  # a prompt given no rollout is not a group
    m, p = counts[trained], v[trained]
    return float(np.sum(1.0 - p**m - (1.0 - p) ** m))


def noisy(v: np.ndarray, sd: float, shrink: float, rng: np.random.Generator) -> np.ndarray:
    p = np.clip(v, 1e-3, 1.0 - 1e-3)
    z = shrink * np.log(p / (1.0 - p)) + rng.normal(0.0, sd, len(v))
    return 1.0 / (1.0 + np.exp(-z))


def screen(v: np.ndarray, roots: int, k: int, rng: np.random.Generator) -> float:
    """Pairs on the first `k` prompts, then the exact program on the posteriors; the realised mixed count
    of the whole two-phase allocation, averaged exactly over the second phase's outcomes."""
    first = rng.binomial(2, v[:k])  # [k] successes of each screened pair
    sizes = np.arange(0, CAP + 1)  # [S] second-phase rollouts per prompt

    # E[x^m] for x ~ Beta(a, b) is prod_{j < m} (a + j) / (a + b + j); both rows depend on m only
    def beta_power(a: float, b: float) -> np.ndarray:  # [S]
        return np.array([np.prod((a + np.arange(m)) / (a + b + np.arange(m))) for m in sizes])

    # a screened pair that agreed: its repeated outcome's rate is Beta(PRIOR + 2, PRIOR) either way,
    # and m more end it mixed unless they all repeat it
    agreed = 1.0 - beta_power(PRIOR + 2, PRIOR)
    # never screened: E[1 - v^m - (1 - v)^m] under the prior, for groups of 2 or more
    unseen = np.where(sizes >= 2, 1.0 - 2.0 * beta_power(PRIOR, PRIOR), -np.inf)
    unseen[0] = 0.0
    gains = np.tile(unseen, (len(v), 1))  # [P, S] P(the prompt ends mixed) after that many more
    gains[:k] = agreed
    gains[:k][first == 1] = 0.0  # already mixed: more rollouts buy nothing
    extra = alloc.solve_counts(gains, sizes, roots - 2 * k)  # [P]
    assert extra is not None
    total = extra.copy()
    total[:k] += 2
    # exact expectation over the second phase given the first: a screened prompt that agreed on s in {0, 2}
    # ends mixed unless every extra rollout repeats its outcome
    mixed = 0.0
    for i in range(len(v)):
        if i < k:
            if first[i] == 1:
                mixed += 1.0
            elif extra[i]:
                repeat = v[i] if first[i] == 2 else 1.0 - v[i]
                mixed += 1.0 - repeat ** extra[i]
        elif total[i]:
            mixed += 1.0 - v[i] ** total[i] - (1.0 - v[i]) ** total[i]
    return mixed


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    shares = (args.never, args.always)
    grpo, pairs = alloc.UniformRoots(group_size=4), alloc.UniformRoots(group_size=2)
    trace = alloc.ActiveRoots(min_group=2, max_per_prompt=CAP)
    knapsack = alloc.KnapsackRoots(group_size=4, min_group=2, max_per_prompt=CAP)
    base: dict[str, list[float]] = {"grpo": [], "pairs": [], "trace_true_v": [], "knapsack_true_v": []}
    screens: dict[int, list[float]] = {k: [] for k in args.screen}
    skills = [(sd, shrink) for sd in args.noise for shrink in args.shrink]
    by_skill: dict[tuple[float, float], dict[str, list[float]]] = {
        s: {"spearman": [], "trace": [], "knapsack": []} for s in skills
    }
    for _ in range(args.trials):
        v = draw_pool(rng, args.pool, shares)
        base["grpo"].append(expected_mixed(v, grpo(v, args.roots, rng)))
        base["pairs"].append(expected_mixed(v, pairs(v, args.roots, rng)))
        base["trace_true_v"].append(expected_mixed(v, trace(v, args.roots, rng)))
        base["knapsack_true_v"].append(expected_mixed(v, knapsack(v, args.roots, rng)))
        for k in screens:
            screens[k].append(screen(v, args.roots, k, rng))
        for sd, shrink in skills:
            h = noisy(v, sd, shrink, rng)
            row = by_skill[(sd, shrink)]
            row["spearman"].append(float(spearmanr(v, h).statistic))
            row["trace"].append(expected_mixed(v, trace(h, args.roots, rng)))
            row["knapsack"].append(expected_mixed(v, knapsack(h, args.roots, rng)))
    g = float(np.mean(base["grpo"]))
    return {
        "config": vars(args),
        "mixed": {k: float(np.mean(x)) for k, x in base.items()},
        "screen": {str(k): float(np.mean(x)) for k, x in screens.items()},
        "by_skill": [
            {
                "noise_sd": sd,
                "shrink": shrink,
                "spearman": float(np.mean(row["spearman"])),
                "trace_x_grpo": float(np.mean(row["trace"])) / g,
                "knapsack_x_grpo": float(np.mean(row["knapsack"])) / g,
            }
            for (sd, shrink), row in by_skill.items()
        ],
    }


def report(result: dict) -> None:
    c, m = result["config"], result["mixed"]
    g = m["grpo"]
    print(
        f"{c['trials']} pools of {c['pool']} candidates, {c['roots']} rollouts each; expected mixed prompts "
        f"(x GRPO's groups of 4)"
    )
    for name, x in m.items():
        print(f"  {name:18s} {x:6.2f}  {x / g:5.2f}x")
    for k, x in result["screen"].items():
        print(f"  {'screen ' + k:18s} {x:6.2f}  {x / g:5.2f}x   (pairs on {k} prompts, then the program)")
    print("a noisy predictor: Spearman with the true rates -> trace's and knapsack's mixed prompts x GRPO's")
    print(f"  {'noise sd':>8s} {'shrink':>6s} {'Spearman':>8s} {'trace':>7s} {'knapsack':>8s}")
    for row in result["by_skill"]:
        print(
            f"  {row['noise_sd']:8.1f} {row['shrink']:6.1f} {row['spearman']:8.2f} "
            f"{row['trace_x_grpo']:6.2f}x {row['knapsack_x_grpo']:7.2f}x"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few trials, for the test suite")
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--roots", type=int, default=48)
    parser.add_argument("--never", type=float, default=0.25, help="share of prompts almost never solved")
    parser.add_argument("--always", type=float, default=0.20, help="share of prompts almost always solved")
    parser.add_argument("--noise", type=float, nargs="*", default=[0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--shrink", type=float, nargs="*", default=[1.0, 0.5])
    parser.add_argument("--screen", type=int, nargs="*", default=[12, 16, 20])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/allocation_room.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.noise, args.shrink, args.screen = 20, [0.0, 2.0], [1.0], [12]
    began = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - began
    report(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
