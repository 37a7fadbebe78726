"""Which prompts Stage 1 sees, and with what success estimates: exploration and calibration around the
exact V_root program (docs/algorithm.md#exploration-and-the-skill-gate; each option is our choice,
off by default and ablated in benchmarks/learning.py).

A deterministic argmax over a flat or miscalibrated predictor ranks prompts by noise, keeps picking the
same few and only ever gets labels for what it picked (measured on the allocation testbed: below
GRPO). The options:

* `epoch_pools`: candidate pools are drawn from a shuffled pass over all tasks, so every task is a
  candidate once per pass before any task is a candidate again;
* `max_visits` within `visit_window` iterations: a prompt that trained that often lately is not a
  candidate (the pool is filled with others while enough remain);
* an unbiased slice (`explore_groups`): that many groups of `explore_size` bare rollouts go to
  candidates drawn uniformly from the pool before Stage 1 splits the rest. They train like any group,
  and their outcomes are labels the predictor did not choose: the only ones on which its skill can be
  measured (on the prompts it picks, every prediction sits near 0.5, and an oracle scores no better
  than a constant there);
* a skill gate (`gate_skill`): the predictor steers only while the Brier skill of its predictions on
  the slice's outcomes over the last `gate_window` iterations is at least the threshold, the skill
  being measured against the base rate known when they were made (the share of successes among the
  bare rollouts of the `gate_window` iterations before; `gauges.skill_against`): both forecasts are
  out of sample. Otherwise every candidate gets v = 0.5, which makes Stage 1 uniform (groups of
  `min_group` over a random pool). An oracle scores well above 0, that base rate exactly 0;
* `thompson`: the program runs on a sample v_i ~ Beta(a_i, b_i) of each candidate's success rate,
  where the per-prompt decayed Beta counts (`BetaPrior`) are combined with the predictor's estimate
  p_i worth `predictor_strength` pseudo-observations (only while the gate is open):
      a_i = alpha + s_i + k * p_i,   b_i = beta + f_i + k * (1 - p_i).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trace_lightning.allocation import BetaPrior
from trace_lightning.gauges import skill_against
from trace_lightning.tree import RolloutTree, bare_outcomes


@dataclass(frozen=True)
class RootQuality:
    """How well the raw root predictions of one iteration matched its bare rollouts (out of sample: the
    predictions were made before these outcomes were seen)."""

    pool_spread: float  # std of the predictions over the candidate pool
    slice_skill: float  # Brier skill on this iteration's unbiased slice (NaN: no slice, or one outcome)
    gate_open: bool  # whether the predictor steered this iteration's Stage 1
    gate_skill: float  # the windowed skill the gate decided on (NaN before enough samples)


@dataclass
class Selection:
    """The `selection.*` config group: `config.register` generates it from these defaults, the only ones."""

    thompson: bool = False  # run the V_root program on posterior samples
    predictor_strength: float = 8.0  # pseudo-observations the predictor's estimate is worth in them
    explore_groups: int = 0  # groups on uniformly drawn candidates each iteration (the unbiased slice)
    explore_size: int = 2  # bare rollouts per slice group
    gate_skill: float | None = None  # predictions steer only while their slice skill is >= this
    gate_window: int = 4  # iterations of evidence for the gate
    gate_min_samples: int = 8  # slice outcomes needed before the gate can open
    epoch_pools: bool = False  # candidate pools from shuffled passes over all tasks
    max_visits: int | None = None  # trainings a prompt may have within visit_window iterations
    visit_window: int = 8
    visits: dict[int, list[int]] = field(default_factory=dict)  # task_id -> iterations it trained in
    # (iteration, prediction, base rate then, successes, rollouts) of each slice candidate, last gate_window
    history: list[tuple[int, float, float, float, float]] = field(default_factory=list)
    outcomes: list[tuple[int, float, float]] = field(default_factory=list)  # (it, successes, rollouts), all

    order: list[int] = field(default_factory=list)  # epoch_pools: the current pass, not yet drawn
    # Pooled success rates by the task's attributes (an environment's `attributes(task)`, coarse to fine):
    # on fresh prompts, where no per-prompt record exists, they are what transfers between prompts.
    attributes: bool = False  # Stage 1's estimates are the pooled rates where the env has attributes
    attribute_strength: float = 4.0  # pseudo-rollouts a level's rate is shrunk towards its parent's with
    attribute_decay: float = 0.8  # every pooled count is multiplied by this once per iteration
    pooled: dict[tuple[str, ...], tuple[float, float]] = field(default_factory=dict)  # key -> (wins, n)
    # While the estimates steer: candidates of one attribute cell (the finest key) beyond cell_quota
    # times the prompts GRPO would train from that cell (at least 1) get estimate 0, so Stage 1 spends
    # on them only what nothing else earns more with. Pooled rates are equal within a cell, and the exact
    # program would otherwise fill the best cell with the whole budget (measured on the testbed: 65% of
    # the rollouts on one cell against GRPO's 38%). null: no quota.
    cell_quota: float | None = None

    def __post_init__(self) -> None:
        if self.predictor_strength < 0 or self.gate_window < 1 or self.visit_window < 1:
            raise ValueError(
                f"selection.predictor_strength={self.predictor_strength} must be >= 0, selection."
                f"gate_window={self.gate_window} and selection.visit_window={self.visit_window} >= 1"
            )
        if self.explore_groups < 0 or self.explore_size < 2:
            raise ValueError(
                f"selection.explore_groups={self.explore_groups} must be >= 0 and selection.explore_size="
                f"{self.explore_size} >= 2 (a group of one is never mixed)"
            )
        if self.gate_skill is not None and not -1.0 <= self.gate_skill < 1.0:
            raise ValueError(
                f"selection.gate_skill={self.gate_skill} must be in [-1, 1) (0: better than the base rate), "
                "or null for no gate"
            )
        if self.gate_skill is not None and self.explore_groups == 0:
            raise ValueError(
                "selection.gate_skill needs outcomes the predictor did not choose: set "
                "selection.explore_groups > 0, or selection.gate_skill=null"
            )
        if self.attribute_strength <= 0 or not 0.0 < self.attribute_decay <= 1.0:
            raise ValueError(
                f"selection.attribute_strength={self.attribute_strength} must be > 0 and selection."
                f"attribute_decay={self.attribute_decay} in (0, 1]"
            )
        if self.cell_quota is not None and self.cell_quota <= 0:
            raise ValueError(f"selection.cell_quota={self.cell_quota} must be > 0, or null for no quota")
        if self.max_visits is not None and self.max_visits < 1:
            raise ValueError(f"selection.max_visits={self.max_visits} must be >= 1, or null for no cap")

    # ------------------------------------------------------------------ candidate pool

    def draw_pool(
        self, task_ids: Sequence[int], size: int, iteration: int, rng: np.random.Generator
    ) -> list[int]:
        """`size` distinct candidate task ids for this iteration."""
        if size > len(task_ids):
            raise ValueError(
                f"data.pool_size={size} exceeds the {len(task_ids)} tasks of the environment; lower "
                "data.pool_size or use an env with more tasks"
            )
        if not self.epoch_pools and self.max_visits is None:  # the plain draw (kept bit-for-bit)
            return [int(task_ids[i]) for i in rng.choice(len(task_ids), size=size, replace=False)]
        capped = self._capped(iteration)
        if not self.epoch_pools:
            eligible = [t for t in task_ids if t not in capped]
            if len(eligible) < size:
                eligible = list(task_ids)
            return [int(eligible[i]) for i in rng.choice(len(eligible), size=size, replace=False)]
        pool: list[int] = []
        for _ in range(2):  # the rest of this pass, then (if short) a fresh pass
            if not self.order:
                self.order = [int(task_ids[i]) for i in rng.permutation(len(task_ids))]
            take = [t for t in self.order if t not in capped and t not in pool][: size - len(pool)]
            self.order = [t for t in self.order if t not in take]
            pool += take
            if len(pool) == size:
                return pool
        fill = [int(t) for t in task_ids if t not in pool]  # too many capped: fill the pool anyway
        return pool + [fill[i] for i in rng.choice(len(fill), size=size - len(pool), replace=False)]

    def _capped(self, iteration: int) -> set[int]:
        if self.max_visits is None:
            return set()
        recent = {t: sum(i > iteration - self.visit_window for i in its) for t, its in self.visits.items()}
        return {t for t, n in recent.items() if n >= self.max_visits}

    # ------------------------------------------------------------------ estimates

    def explore(self, pool_size: int, rng: np.random.Generator) -> np.ndarray:
        """Bare rollouts reserved for the unbiased slice [P]: `explore_groups` candidates drawn uniformly,
        `explore_size` each (zeros when there is no slice; the draw uses `rng` only then)."""
        reserved = np.zeros(pool_size, dtype=np.int64)
        if self.explore_groups:
            reserved[rng.choice(pool_size, size=min(self.explore_groups, pool_size), replace=False)] = (
                self.explore_size
            )
        return reserved

    def gate(self) -> tuple[bool, float]:
        """(predictions may steer, the windowed slice skill behind that decision)."""
        p, ref, s, n = (np.array([h[i] for h in self.history]) for i in (1, 2, 3, 4))
        value = skill_against(p, ref, s, n) if n.sum() >= self.gate_min_samples else float("nan")
        if self.gate_skill is None:
            return True, value
        return bool(np.isfinite(value) and value >= self.gate_skill), value

    def estimates(
        self, predicted: np.ndarray, task_ids: Sequence[int], prior: BetaPrior, rng: np.random.Generator
    ) -> np.ndarray:
        """The success estimates Stage 1 optimises over [P], from the raw predictions [P]."""
        steer, _ = self.gate()
        if not self.thompson:
            return predicted if steer else np.full(len(predicted), 0.5)
        s, f = prior.successes_failures(task_ids)
        k = self.predictor_strength if steer else 0.0
        return rng.beta(prior.alpha + s + k * predicted, prior.beta + f + k * (1.0 - predicted))

    def quota(self, estimates: np.ndarray, keys: Sequence[tuple[str, ...]], trained: float) -> np.ndarray:
        """`estimates` [P] with the candidates beyond their cell's quota set to 0 (none without
        `cell_quota`). A cell of n candidates among P keeps ceil(cell_quota * n * trained / P) of them,
        at least 1, where `trained` is how many prompts GRPO would train from the pool: those whose
        estimate is nearest 0.5, the pool's order among ties.

        Example: quota 1, trained 2, keys (a, a, a, b), estimates (0.5, 0.6, 0.9, 0.2): cell a keeps
        ceil(1.5) = 2 candidates (0.5 and 0.6), b its one -> (0.5, 0.6, 0, 0.2)."""
        out = np.array(estimates, dtype=np.float64)
        if self.cell_quota is None:
            return out
        cells: dict[tuple[str, ...], list[int]] = {}
        for i, key in enumerate(keys):
            cells.setdefault(tuple(key), []).append(i)
        for members in cells.values():
            keep = max(1, int(np.ceil(self.cell_quota * len(members) * trained / len(keys) - 1e-9)))
            ranked = sorted(members, key=lambda i: abs(out[i] - 0.5))  # stable: pool order among ties
            out[ranked[keep:]] = 0.0
        return out

    def pooled_rates(self, keys: Sequence[tuple[str, ...]]) -> np.ndarray:
        """Each task's success estimate from the pooled bare outcomes of tasks that share its attributes
        [P]: the rate of all tasks, then of those sharing the first attribute, the first two, ...,
        each level's rate shrunk towards its parent's by `attribute_strength` pseudo-rollouts.

        Example: all tasks 6 of 10, key ("steps=1",) 9 of 10, strength 4: root (6 + 2) / 14 = 0.571
        (itself shrunk towards 0.5), then (9 + 4 * 0.571) / 14 = 0.806."""
        out = np.empty(len(keys))
        for i, key in enumerate(keys):
            rate = 0.5
            for depth in range(len(key) + 1):
                wins, n = self.pooled.get(tuple(key[:depth]), (0.0, 0.0))
                rate = (wins + self.attribute_strength * rate) / (n + self.attribute_strength)
            out[i] = rate
        return out

    def pool_outcomes(self, trees: Sequence[RolloutTree], keys: dict[int, tuple[str, ...]]) -> None:
        """Fade the pooled counts, then add every tree's bare outcomes at each level of its key."""
        d = self.attribute_decay
        self.pooled = {k: (w * d, n * d) for k, (w, n) in self.pooled.items()}
        for tree in trees:
            outcomes, key = bare_outcomes(tree), keys.get(tree.task_id, ())
            for depth in range(len(key) + 1):
                wins, n = self.pooled.get(tuple(key[:depth]), (0.0, 0.0))
                self.pooled[tuple(key[:depth])] = (wins + float(outcomes.sum()), n + float(len(outcomes)))

    # ------------------------------------------------------------------ after the rollouts

    def base_rate(self) -> float:
        """The share of successes among the unbiased slice's bare rollouts of the last `gate_window`
        iterations (0.5 before any): the constant forecast the gate's skill is measured against."""
        wins, n = sum(o[1] for o in self.outcomes), sum(o[2] for o in self.outcomes)
        return wins / n if n else 0.5

    def observe(
        self, iteration: int, trees: Sequence[RolloutTree], pool_predicted: np.ndarray, slice_ids: set[int]
    ) -> RootQuality:
        """Record visits and the gate's evidence (the slice's predictions, made before its outcomes, and
        the base rate known then); how the root predictions fared."""
        steer, gate_value = self.gate()
        base, new = self.base_rate(), []
        for tree in trees:
            self.visits.setdefault(tree.task_id, []).append(iteration)
            outcomes = bare_outcomes(tree)
            if tree.task_id in slice_ids and len(outcomes):
                pred = float(tree.root.predicted)  # type: ignore[arg-type]
                new.append((iteration, pred, base, float(outcomes.sum()), float(len(outcomes))))
        # The base rate is the slice's own: Stage 1's picks lean towards mixed prompts, so counting them
        # would set a reference that a forecast with no skill beats (or loses to) by construction.
        wins = [bare_outcomes(t) for t in trees if t.task_id in slice_ids]
        self.outcomes = [o for o in self.outcomes if o[0] > iteration - self.gate_window]
        total = (float(sum(w.sum() for w in wins)), float(sum(len(w) for w in wins)))
        self.outcomes.append((iteration, *total))
        self.history = [h for h in self.history if h[0] > iteration - self.gate_window] + new
        self.visits = {
            t: [i for i in its if i > iteration - self.visit_window] for t, its in self.visits.items()
        }
        self.visits = {t: its for t, its in self.visits.items() if its}
        p, ref, s, n = (np.array([h[i] for h in new]) for i in (1, 2, 3, 4))
        return RootQuality(
            pool_spread=float(np.std(pool_predicted)) if len(pool_predicted) else float("nan"),
            slice_skill=skill_against(p, ref, s, n) if len(new) else float("nan"),
            gate_open=steer,
            gate_skill=gate_value,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "visits": {str(t): list(v) for t, v in self.visits.items()},
            "history": [list(h) for h in self.history],
            "outcomes": [list(o) for o in self.outcomes],
            "order": list(self.order),
            "pooled": [[list(k), w, n] for k, (w, n) in self.pooled.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.visits = {int(t): [int(i) for i in v] for t, v in state["visits"].items()}
        # Rows of an older gate's evidence (first lists for the AUROC gate, then 4 fields)
        # cannot feed this gate, which starts its window empty (tests/checkpoints/test_checkpoint_compat.py).
        rows = [h for h in state["history"] if len(h) == 5]  # (iteration, p, reference, successes, n)
        self.history = [(int(h[0]), *(float(x) for x in h[1:])) for h in rows]  # type: ignore[misc]
        self.outcomes = [(int(i), float(s), float(n)) for i, s, n in state.get("outcomes", [])]
        self.order = [int(t) for t in state["order"]]
        self.pooled = {tuple(str(x) for x in k): (float(w), float(n)) for k, w, n in state.get("pooled", [])}
