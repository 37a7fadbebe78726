"""Evaluation a user can trust: `samples` episodes of each task, pass@1 and pass@k with standard errors.

The `eval` settings group (`EvalSettings`) says how: how many episodes per task, at which temperature
(0: greedy), on which tasks and how often during training. `Evaluator` plays the episodes outside
every training stream, on the collector's engine synced to the current policy, and scores them; the
predictor's Monte Carlo probe plays the same way.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1). With n episodes
of a task, c of them successes (reward >= tree.SUCCESS), the unbiased estimate of P(at least one of k
episodes succeeds) is

    pass@k(task) = 1 - C(n - c, k) / C(n, k)        (1 when n - c < k)

and pass@1 reduces to c / n. The score is the mean over tasks.

The standard error is that of a mean over tasks (the central limit theorem over tasks, as in Miller
2024, "Adding Error Bars to Evals", arXiv 2411.00640): the sample standard deviation (ddof 1) of the
per-task estimates divided by sqrt(tasks). It counts both the spread between tasks and the sampling
noise within each task, so it says how far the score would move on another draw of tasks and
episodes, not only of episodes. More episodes per task shrink only the second part: with tasks that
are always or never solved, only more tasks make it small.

A learning curve evaluates the same tasks every time, so the change since its first point is paired
by task: its standard error is that of the per-task differences (`paired_change`), usually far
smaller than either point's own, because each task's difficulty cancels.

Where the environment gives tasks attributes (`envs.base.HasAttributes`, e.g. math_tool's "steps=2"),
the result also holds pass@1 per value of the coarsest one (`EvalResult.by_group`), with the same SE
over that group's tasks: on a task of mixed difficulty it shows which levels a policy gained or traded.

Example: 2 tasks, 4 episodes each, 1 and 3 successes. pass@1 per task 1/4 and 3/4: mean 0.5, SE =
std([0.25, 0.75], ddof=1) / sqrt(2) = 0.3536 / 1.4142 = 0.25. pass@2 per task: 1 - C(3,2)/C(4,2) =
1 - 3/6 = 0.5 and 1 - C(1,2)/C(4,2) = 1 (fewer than 2 failures): mean 0.75, SE = 0.3536/1.4142 = 0.25.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.engines.base import GenerationEngine, SamplingParams
from trace_lightning.envs.base import Environment
from trace_lightning.iteration import Branch
from trace_lightning.runner import EpisodeLimits, ReActRunner, stop_reason_key
from trace_lightning.tree import SUCCESS, RolloutTree

TASK_SETS = ("held_out", "train", "all")


@dataclass(frozen=True)
class EvalSettings:
    """The `eval` config group: how the policy is evaluated, during training and by
    `python -m trace_lightning.evaluate`.

    samples: episodes per task (n of pass@k). k: the pass@k reported besides pass@1 (null: `samples`).
    temperature: null samples at the training temperature (`sampling.temperature`); 0 decodes greedily
    (then one episode per task: the environments are deterministic, so more would repeat it).
    tasks: `held_out` (the `data.held_out` tasks, never trained on), `train` or `all`.
    every_n_iterations: during training, evaluate before the first iteration, after every this many,
    and after the last. seed: the episodes' torch seed, the same at every evaluation.
    """

    samples: int = 4
    k: int | None = None
    temperature: float | None = None
    tasks: str = "held_out"
    every_n_iterations: int = 4
    seed: int = 1_000_003

    def __post_init__(self) -> None:
        if self.samples < 1 or self.every_n_iterations < 1:
            raise ValueError(
                f"eval.samples={self.samples} and eval.every_n_iterations={self.every_n_iterations} must "
                "be >= 1"
            )
        if self.k is not None and not 1 <= self.k <= self.samples:
            raise ValueError(f"eval.k={self.k} must be in [1, eval.samples={self.samples}], or null")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.temperature={self.temperature} must be >= 0 (0: greedy), or null")
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(
                f"eval.temperature=0 decodes greedily: eval.samples={self.samples} would play the same "
                "episode again; set eval.samples=1, or a temperature > 0"
            )
        if self.tasks not in TASK_SETS:
            raise ValueError(f"eval.tasks={self.tasks!r} must be one of {', '.join(TASK_SETS)}")

    @property
    def pass_k(self) -> int:
        return self.k if self.k is not None else self.samples

    def sampling(self, training: SamplingParams) -> SamplingParams:
        """The training SamplingParams at the evaluation's temperature (stop strings, lengths kept)."""
        return training if self.temperature is None else replace(training, temperature=self.temperature)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of one task from n episodes with c successes (exact integers)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (ddof 1); the SE is NaN with fewer than 2 values."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    return float(x.mean()), se


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: per-task success counts and the scores derived from them."""

    task_ids: tuple[int, ...]
    successes: tuple[int, ...]  # per task, out of `samples`
    samples: int  # episodes per task
    k: int
    temperature: float  # 0: greedy
    pass_at_1: float
    pass_at_1_se: float
    pass_at_k: float
    pass_at_k_se: float
    reward: float  # mean episode reward
    turns: float  # mean policy turns per episode
    seconds: float  # wall time of the evaluation
    groups: tuple[str, ...] = ()  # per task, its coarsest attribute ("": none); () when the env has none

    @property
    def episodes(self) -> int:
        return len(self.task_ids) * self.samples

    def by_group(self) -> dict[str, tuple[float, float, int]]:
        """pass@1, its SE over the group's tasks, and the group's task count, per value of the tasks'
        coarsest attribute (sorted); {} when the tasks carry no attributes."""
        if not any(self.groups):
            return {}
        rates: dict[str, list[float]] = {}
        for group, wins in zip(self.groups, self.successes, strict=True):
            rates.setdefault(group or "none", []).append(wins / self.samples)
        return {g: (*mean_and_se(r), len(r)) for g, r in sorted(rates.items())}

    def metrics(self) -> dict[str, float]:
        """MLflow keys (`@` is not allowed in them): eval/pass_at_1, eval/pass_at_<k>, with `_se`."""
        out = {
            "eval/pass_at_1": self.pass_at_1,
            "eval/pass_at_1_se": self.pass_at_1_se,
            f"eval/pass_at_{self.k}": self.pass_at_k,
            f"eval/pass_at_{self.k}_se": self.pass_at_k_se,
            "eval/reward": self.reward,
            "eval/turns": self.turns,
            "eval/tasks": float(len(self.task_ids)),
            "eval/samples": float(self.samples),
            "eval/seconds": self.seconds,
        }
        for group, (p1, _, _) in self.by_group().items():  # the runner's rule for a safe key segment
            out[f"eval/pass_at_1/{stop_reason_key(group)}"] = p1
        return {key: value for key, value in out.items() if math.isfinite(value)}


def score(
    trees: Sequence[RolloutTree], k: int, temperature: float, seconds: float, groups: Sequence[str] = ()
) -> EvalResult:
    """The result of one evaluation: one tree per task, its leaves the task's episodes (all of them
    bare rollouts from the root, the same number per task); `groups`: each task's coarsest attribute,
    in the trees' order (or none)."""
    counts = [len(t.leaves()) for t in trees]
    if not trees or len(set(counts)) != 1:
        raise ValueError(f"an evaluation needs the same number of episodes for every task, got {counts}")
    if groups and len(groups) != len(trees):
        raise ValueError(f"score: {len(groups)} groups for {len(trees)} tasks; give one per task or none")
    n = counts[0]
    leaves = [[float(t.nodes[x].reward or 0.0) for x in t.leaves()] for t in trees]
    wins = [sum(r >= SUCCESS for r in rewards) for rewards in leaves]
    p1, p1_se = mean_and_se([c / n for c in wins])
    pk, pk_se = mean_and_se([pass_at_k(n, c, k) for c in wins])
    return EvalResult(
        task_ids=tuple(t.task_id for t in trees),
        successes=tuple(wins),
        samples=n,
        k=k,
        temperature=temperature,
        pass_at_1=p1,
        pass_at_1_se=p1_se,
        pass_at_k=pk,
        pass_at_k_se=pk_se,
        reward=float(np.mean([r for rewards in leaves for r in rewards])),
        turns=float(np.mean([t.nodes[x].depth for t in trees for x in t.leaves()])),
        seconds=seconds,
        groups=tuple(groups),
    )


def paired_change(before: EvalResult, after: EvalResult) -> tuple[float, float]:
    """pass@1 after minus before over the tasks both evaluated, and its paired standard error (the SE
    of the per-task differences)."""
    start = dict(zip(before.task_ids, before.successes, strict=True))
    diffs = [
        c / after.samples - start[t] / before.samples
        for t, c in zip(after.task_ids, after.successes, strict=True)
        if t in start
    ]
    return mean_and_se(diffs)


@dataclass
class Evaluator:
    """Episodes played outside the budget with the current policy: the held-out evaluation
    (`evaluate`) and the predictor's probe (`probe`).

    `engine(module)` is the run's engine synced to the module's weights (`RolloutCollector.synced_engine`);
    everything else is the run's environment, episode limits, training sampling and task split;
    `groups` maps a task id to its coarsest attribute, for pass@1 by group (tasks not in it: none).
    Playing changes neither what the next iteration samples nor what it reports (`play`)."""

    env: Environment
    limits: EpisodeLimits
    sampling: SamplingParams
    train_ids: list[int]
    held_out: list[int]
    engine: Callable[[Any], GenerationEngine]
    groups: Mapping[int, str] = field(default_factory=dict)

    def tasks(self, which: str) -> list[int]:
        """The task ids of an `eval.tasks` choice: held_out, train or all."""
        return {
            "held_out": self.held_out,
            "train": self.train_ids,
            "all": sorted(self.train_ids + self.held_out),
        }[which]

    def evaluate(self, module: Any, settings: EvalSettings, bar: Any = None) -> EvalResult | None:
        """`settings.samples` episodes of every task in `settings.tasks` at the evaluation's temperature,
        scored (`score`). None: no such task (data.held_out=0). `bar` (a tqdm bar, or anything with
        `update` and `set_postfix_str`) counts the episodes as they end and shows, after each batched
        turn, the turns played and the episodes still running (batched episodes tend to end together)."""
        task_ids = self.tasks(settings.tasks)
        if not task_ids:
            return None
        start, sampling = time.perf_counter(), settings.sampling(self.sampling)
        hooks: tuple[Any, Any] = (None, None)
        if bar is not None:
            hooks = (
                lambda: bar.update(1),
                lambda turns, running: bar.set_postfix_str(f"turn {turns} played, {running} running"),
            )
        trees = self.play(module, task_ids, settings.samples, settings.seed, sampling, *hooks)
        groups = [self.groups.get(t, "") for t in task_ids] if self.groups else []
        return score(trees, settings.pass_k, sampling.temperature, time.perf_counter() - start, groups)

    def probe(self, module: Any, task_ids: Sequence[int], samples: int, seed: int) -> np.ndarray:
        """Successes of `samples` episodes of each task [P] at the training temperature: a Monte Carlo
        estimate of V(prompt), for gauging the predictor."""
        trees = self.play(module, task_ids, samples, seed)
        return np.array([sum(float(t.nodes[x].reward or 0.0) >= SUCCESS for x in t.leaves()) for t in trees])

    def play(
        self,
        module: Any,
        task_ids: Sequence[int],
        samples: int,
        seed: int,
        sampling: SamplingParams | None = None,
        on_episode_end: Callable[[], None] | None = None,
        on_turn: Callable[[int, int], None] | None = None,
    ) -> list[RolloutTree]:
        """`samples` bare episodes of each task: a runner of its own (its counters are not the
        iteration's), the torch RNG saved and restored around a draw seeded with `seed`, and the
        engine's counters for these episodes taken and dropped. `sampling`: another temperature than
        the training one (an evaluation's); `on_episode_end`, `on_turn`: a progress display's hooks
        (`ReActRunner`)."""
        engine = self.engine(module)
        runner = ReActRunner(engine, module.tokenizer, self.env, sampling or self.sampling, self.limits)
        runner.on_episode_end, runner.on_turn = on_episode_end, on_turn
        trees = [runner.new_tree(t) for t in task_ids]
        ledger = BudgetLedger(Budget(max(1, len(trees) * samples)))
        ledger.reserve_leaves(len(trees) * samples, "bare")
        saved_rng = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            runner([Branch(t, 0, samples, "bare") for t in trees], ledger, np.random.default_rng(seed))
        finally:
            torch.set_rng_state(saved_rng)
            engine.take_stats()
        engine.sleep()
        return trees
