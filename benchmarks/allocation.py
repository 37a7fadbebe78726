"""Allocation benchmark: every allocator at an equal leaf budget on the synthetic chain task.

    python benchmarks/allocation.py                 # full run (about a minute on 2 cores)
    python benchmarks/allocation.py --quick         # a few iterations, for the test suite

For each predictor (the exact V "oracle", the oracle with logit noise "noisy", and a small MLP
"learned" online on the tree targets, with a Beta-prior cold start) every allocator spends the same
leaves per iteration over the same task pool. Printed and written as JSON: effective ratio (share of
prompts whose tree is mixed), mixed anchors per 100 leaves at root and prefix level, contrastive
pairs per leaf, and the ratio of each allocator's effective ratio to `uniform` in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from trace_lightning import allocation as alloc
from trace_lightning.envs.synthetic import ChainTask, make_tasks
from trace_lightning.iteration import build_trees
from trace_lightning.predictor import PredictorFit, ReplayEntry
from trace_lightning.simulator import ChainSimulator, oracle_scores, state_of
from trace_lightning.tree import RolloutTree, bare_outcomes, predictor_targets, tree_stats

PREDICTORS = ("oracle", "noisy", "learned")


def allocators(expansion: int) -> list[alloc.TreeAllocator]:
    counting = alloc.trace(expansion=expansion, count_continuations=True)
    return [
        alloc.uniform(group_size=4),
        alloc.pcl(group_size=4),
        alloc.random_expand(group_size=2, expansion=expansion),
        alloc.trace_root_only(expansion=expansion),
        alloc.trace_prefix_only(group_size=2, expansion=expansion),
        alloc.trace(expansion=expansion),
        # Stage 1 scored by V_root over each prompt's m (1 + N) leaves
        alloc.TreeAllocator("trace_count_cont", counting.roots, counting.prefixes, expansion),
    ]


class LearnedPredictor:
    """A two-layer MLP on what an agent could observe: task features, turn, mistakes so far.

    Refitted after every iteration with the trainer's own schedule (`PredictorFit`): head-only steps on
    the V̂ targets of the prompts seen in the last `window` iterations (the latest targets of a prompt
    win; its root target from bare rollouts only), weighted by leaf count. A Beta prior stands in
    before the first fit.
    """

    def __init__(self, tasks: dict[int, ChainTask], seed: int, window: int = 30, steps: int = 200) -> None:
        torch.manual_seed(seed)
        n_in = len(next(iter(tasks.values())).features) + 4
        self.net = torch.nn.Sequential(
            torch.nn.Linear(n_in, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1), torch.nn.Flatten(0)
        )  # [K, F] -> logits [K]
        self.refit = PredictorFit(steps=steps, window=window, batch_size=256, lr=1e-2, seed=seed)
        self.tasks = tasks
        self.prior = alloc.BetaPrior(warmup=1)
        self.iteration = 0

    def _features(self, tree: RolloutTree, nodes: list[int]) -> torch.Tensor:
        task = self.tasks[tree.task_id]
        rows = []
        for n in nodes:
            turn, mistakes = state_of(tree, n)
            rows.append(
                [*task.features, turn / task.turns, mistakes, task.tolerance, task.tolerance - mistakes]
            )
        return torch.tensor(rows, dtype=torch.float32).reshape(len(nodes), len(task.features) + 4)  # [K, F]

    def __call__(self, trees, node_ids) -> list[np.ndarray]:
        if self.prior.active(self.iteration):
            return [
                np.repeat(self.prior.mean([t.task_id]), len(n)) for t, n in zip(trees, node_ids, strict=True)
            ]
        with torch.no_grad():
            return [
                torch.sigmoid(self.net(self._features(t, list(n)))).numpy()
                for t, n in zip(trees, node_ids, strict=True)
            ]

    def fit(self, trees: list[RolloutTree]) -> None:
        for tree in trees:
            tg = predictor_targets(tree)
            bare = bare_outcomes(tree)
            values, counts = tg.values.copy(), tg.leaf_counts.astype(np.float64)
            root = tg.node_ids == 0
            values[root], counts[root] = bare.mean(), len(bare)  # the root learns from bare rollouts only
            self.refit.add(
                tree.task_id,
                ReplayEntry(
                    self.iteration,
                    self._features(tree, tg.node_ids.tolist()),
                    torch.tensor(values, dtype=torch.float32),
                    torch.tensor(counts, dtype=torch.float32),
                ),
            )
            self.prior.update(tree.task_id, float(bare.sum()), float(len(bare) - bare.sum()))
        self.refit.fit(self.net, self.iteration)
        self.iteration += 1


def make_scorer(kind: str, tasks: dict[int, ChainTask], noise: float, seed: int):
    if kind == "learned":
        return LearnedPredictor(tasks, seed)
    rng = np.random.default_rng(seed + 1)

    def score(trees, node_ids):
        exact = oracle_scores(tasks, trees, node_ids)
        if kind == "oracle":
            return exact
        return [_logit_noise(v, noise, rng) for v in exact]

    return score


def _logit_noise(v: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    v = np.clip(v, 1e-3, 1 - 1e-3)
    logit = np.log(v / (1 - v)) + sigma * rng.normal(size=v.shape)
    return 1.0 / (1.0 + np.exp(-logit))


@dataclass
class Row:
    predictor: str
    allocator: str
    effective_ratio: float
    root_mixed_per_100: float
    prefix_mixed_per_100: float
    contrastive_pairs_per_leaf: float
    prefix_pairs_per_leaf: float
    prompts_per_iter: float
    mixed_prompts_per_iter: float
    leaves_per_iter: float
    tokens_per_iter: float
    ratio_to_uniform: float = float("nan")


def run_one(
    kind: str, allocator: alloc.TreeAllocator, tasks: list[ChainTask], args, seed: int
) -> dict[str, float]:
    task_map = {t.task_id: t for t in tasks}
    score = make_scorer(kind, task_map, args.noise, seed)
    sim, rng, budget = ChainSimulator(task_map), np.random.default_rng(seed), alloc.Budget(args.leaves)
    per_iter = []
    for _ in range(args.iterations):
        pool = [RolloutTree(int(i)) for i in rng.choice(len(tasks), size=args.pool, replace=False)]
        it = build_trees(pool, allocator, budget, score, sim, rng)
        assert it.ledger.leaves_used <= budget.leaves  # the invariant, checked on every iteration
        stats = [tree_stats(t) for t in it.trees]
        leaves = it.ledger.leaves_used
        per_iter.append(
            {
                "effective_ratio": np.mean([s.mixed for s in stats]),
                "root_mixed_per_100": 100 * sum(s.mixed_by_depth[0] for s in stats) / leaves,
                "prefix_mixed_per_100": 100 * sum(sum(s.mixed_by_depth[1:]) for s in stats) / leaves,
                "contrastive_pairs_per_leaf": sum(s.contrastive_pairs for s in stats) / leaves,
                "prefix_pairs_per_leaf": sum(s.prefix_contrastive_pairs for s in stats) / leaves,
                "prompts_per_iter": len(it.trees),
                "mixed_prompts_per_iter": sum(s.mixed for s in stats),
                "leaves_per_iter": leaves,
                "tokens_per_iter": it.ledger.tokens_used,
            }
        )
        if isinstance(score, LearnedPredictor):
            score.fit(it.trees)
    return {k: float(np.mean([r[k] for r in per_iter])) for k in per_iter[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument(
        "--leaves", type=int, default=192, help="leaves per iteration, the same for every allocator"
    )
    p.add_argument("--pool", type=int, default=256, help="candidate prompts per iteration")
    p.add_argument("--tasks", type=int, default=2000, help="size of the task set the pool is drawn from")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--expansion", type=int, default=2, help="N: continuations per bare rollout")
    p.add_argument("--noise", type=float, default=0.5, help="logit noise of the 'noisy' predictor")
    p.add_argument("--hidden-noise", type=float, default=0.3, help="task difficulty no feature reveals")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="3 iterations, 1 seed: a smoke run for tests")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/allocation.json"))
    args = p.parse_args()
    torch.set_num_threads(1)  # the predictor is tiny: extra threads only add synchronisation
    if args.quick:
        args.iterations, args.seeds = 3, 1
    tasks = make_tasks(args.tasks, turns=args.turns, hidden_noise=args.hidden_noise, seed=0)
    start, rows = time.perf_counter(), []
    for kind in PREDICTORS:
        for allocator in allocators(args.expansion):
            runs = [run_one(kind, allocator, tasks, args, seed) for seed in range(args.seeds)]
            rows.append(
                Row(kind, allocator.name, **{k: float(np.mean([r[k] for r in runs])) for k in runs[0]})
            )
        base = next(r.effective_ratio for r in rows if r.predictor == kind and r.allocator == "uniform")
        for r in rows:
            if r.predictor == kind:
                r.ratio_to_uniform = r.effective_ratio / base
    elapsed = time.perf_counter() - start
    print_table(rows)
    print(
        f"\n{args.iterations} iterations x {args.seeds} seeds, {args.leaves} leaves/iteration, "
        f"pool {args.pool}, N={args.expansion}: {elapsed:.1f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(
        json.dumps({"config": config, "seconds": elapsed, "rows": [asdict(r) for r in rows]}, indent=2)
    )


COLUMNS = [  # (header, Row field, format)
    ("predictor", "predictor", "9s"),
    ("allocator", "allocator", "18s"),
    ("eff.ratio", "effective_ratio", "9.3f"),
    ("x uniform", "ratio_to_uniform", "9.2f"),
    ("root mix/100", "root_mixed_per_100", "12.1f"),
    ("prefix mix/100", "prefix_mixed_per_100", "14.1f"),
    ("pairs/leaf", "contrastive_pairs_per_leaf", "10.2f"),
    ("prompts", "prompts_per_iter", "7.1f"),
    ("mixed prompts", "mixed_prompts_per_iter", "13.1f"),
    ("tokens", "tokens_per_iter", "7.0f"),
]


def print_table(rows: list[Row]) -> None:
    width = [(fmt[:-1].split(".")[0], ">" if fmt.endswith("f") else "<") for _, _, fmt in COLUMNS]
    head = " ".join(f"{h:{align}{w}}" for (h, _, _), (w, align) in zip(COLUMNS, width, strict=True))
    print(head)
    print("-" * len(head))
    for r in rows:
        print(" ".join(f"{getattr(r, field):{fmt}}" for _, field, fmt in COLUMNS))


if __name__ == "__main__":
    main()
