"""The predictor during an iteration: the scorer Stage 1 and Stage 2 call, and the refit after the
rollouts (docs/algorithm.md#predictor-targets-and-the-refit).

`IterationScorer` returns the head's predictions (or the cold-start prior's mean) and keeps every scored
prefix's head input, keyed (task_id, node_id); `refit` then turns this iteration's trees into targets
for those inputs and fits the head on them with the recent ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from trace_lightning.allocation import BetaPrior
from trace_lightning.predictor.features import PrefixScorer
from trace_lightning.predictor.refit import PredictorFit, replay_entry
from trace_lightning.tree import RolloutTree

Features = dict[tuple[int, int], torch.Tensor]  # (task_id, node_id) -> the head's input there [F]


class IterationScorer:
    """The scorer one iteration runs with (`iteration.Scorer`).

    With the scorer's `posterior_features` the head's input also carries the prompt's decayed posterior
    mean and log(1 + decayed visits) as they were before this iteration."""

    def __init__(self, scorer: PrefixScorer, prior: BetaPrior, use_prior: bool) -> None:
        self.scorer, self.prior, self.use_prior = scorer, prior, use_prior
        self.features: Features = {}

    def __call__(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        out = []
        for tree, nodes, f in zip(trees, node_ids, self.scorer.features(trees, node_ids), strict=True):
            if self.scorer.posterior_features:  # after the policy states, before the text columns
                cut, post = self.scorer.policy_width, self._posterior(tree.task_id).expand(len(f), -1)
                f = torch.cat([f[:, :cut], post, f[:, cut:]], dim=1)
            self.features.update({(tree.task_id, int(n)): row for n, row in zip(nodes, f, strict=True)})
            prior = np.repeat(self.prior.mean([tree.task_id]), len(nodes))
            out.append(prior if self.use_prior else self.scorer.predict(f))
        return out

    def _posterior(self, task_id: int) -> torch.Tensor:
        mean, visits = self.prior.mean([task_id])[0], self.prior.visits([task_id])[0]
        return torch.tensor([mean, math.log1p(visits)], dtype=torch.float32)


def refit(
    fit: PredictorFit,
    scorer: PrefixScorer,
    pool: Sequence[RolloutTree],
    trees: Sequence[RolloutTree],
    features: Features,
    iteration: int,
) -> float:
    """Fit the head on this and recent iterations' V̂ targets, before the policy trains on them; the
    refit's last minibatch loss. The candidates' root features move the head's input statistics first.

    Root targets are the mean of the bare rollouts only; a prefix's target is its subtree mean."""
    scaler = getattr(scorer.head, "scaler", None)
    if scaler is not None:
        roots = [features[(t.task_id, 0)] for t in pool if (t.task_id, 0) in features]
        if roots:
            scaler.update(torch.stack(roots)[:, : scaler.mean.numel()])  # the standardised columns
    for tree in trees:
        entry = replay_entry(tree, features, iteration)
        if entry is not None:
            fit.add(tree.task_id, entry)
    return fit.fit(scorer.head, iteration)
