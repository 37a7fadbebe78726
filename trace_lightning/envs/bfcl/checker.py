"""BFCL's multi-turn verdict, written by us from the behaviour its checker documents
(`bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py` in bfcl-eval 2026.3.23, read, not
copied). At the end of every user turn t whose ground truth is not empty:

1. the model made at least one call during turn t (BFCL: `empty_turn_model_response`);
2. state check: for every involved class, each non-private attribute of the ground-truth instance
   (its `vars()` not starting with "_"), after replaying the ground truth of turns 0..t, equals (`!=`
   is False) the same attribute of the model's instance after all the model's calls so far;
3. response check: each execution result of turn t's ground truth is found among the execution
   results of ALL the model's calls so far (a call made in an earlier turn need not be repeated),
   each model result matched at most once. Order is not enforced: BFCL compares as multisets, since
   many turns have parallel calls (its `_is_subsequence_unordered`).

A turn whose ground truth is empty (miss_param's turn without the parameter) is not checked, though
the calls made in it count for the later turns (BFCL's `multi_turn_irrelevance_checker`, which would
require no call there, is not called by its evaluation in this version). An entry passes only if every
turn passes and the conversation was played to its end: BFCL fails an entry whose model was
force-quit (too many steps in a turn).

Diagnostics (logged, not rewarded unless `env.reward=turns`): turns passed, the share of equal
attributes over the checked turns (state score), and the share of ground-truth calls the model made
with the same arguments (call overlap; positional and keyword forms compared after binding).
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trace_lightning.envs.bfcl.data import Call
from trace_lightning.envs.bfcl.world import Instances, api_class


@dataclass(frozen=True)
class TurnVerdict:
    """The check at the end of one user turn."""

    turn: int
    checked: bool  # False where the ground truth is empty (not checked)
    called: bool  # the model made at least one call during the turn
    state_ok: bool
    response_ok: bool
    attributes_equal: int  # non-private attributes equal to the ground truth's (state score numerator)
    attributes: int
    missing: tuple[str, ...]  # ground-truth results not found among the model's

    @property
    def passed(self) -> bool:
        return not self.checked or (self.called and self.state_ok and self.response_ok)


def compare_states(model: Instances, truth: Instances) -> tuple[int, int, tuple[str, ...]]:
    """(equal attributes, compared attributes, the differing `Class.attribute` names)."""
    equal, total, differing = 0, 0, []
    for name, reference in truth.items():
        for attribute, value in vars(reference).items():
            if attribute.startswith("_"):
                continue
            total += 1
            if getattr(model[name], attribute) != value:
                differing.append(f"{name}.{attribute}")
            else:
                equal += 1
    return equal, total, tuple(differing)


def missing_results(expected: Iterable[str], produced: Iterable[str]) -> tuple[str, ...]:
    """The expected results not found in `produced`, each produced result matched at most once.

    Example: expected ["a", "a", "b"], produced ["b", "a", "c"] -> ("a",).
    """
    pool = Counter(produced)
    missing = []
    for result in expected:
        if pool[result] > 0:
            pool[result] -= 1
        else:
            missing.append(result)
    return tuple(missing)


def check_turn(
    turn: int,
    model: Instances,
    truth: Instances,
    model_results: Sequence[str],
    truth_turn_results: Sequence[str],
    called: bool,
    checked: bool,
) -> TurnVerdict:
    """The verdict of user turn `turn`. `model_results`: every result of the model's calls so far, all
    turns; `truth_turn_results`: those of this turn's ground truth; `checked`: its ground truth is not
    empty."""
    equal, total, differing = compare_states(model, truth)
    missing = missing_results(truth_turn_results, model_results)
    return TurnVerdict(turn, checked, called, not differing, not missing, equal, total, missing)


def official_reward(verdicts: Sequence[TurnVerdict], n_turns: int) -> float:
    """1.0 when the conversation reached its end and every turn passed, else 0.0."""
    return float(len(verdicts) == n_turns and all(v.passed for v in verdicts))


def turns_reward(verdicts: Sequence[TurnVerdict], n_turns: int) -> float:
    """The share of the entry's turns that passed (a turn never reached counts as failed)."""
    return sum(v.passed for v in verdicts) / n_turns


def state_score(verdicts: Sequence[TurnVerdict]) -> float:
    """Equal attributes over compared attributes, over the checked turns (1.0 when none was checked)."""
    checked = [v for v in verdicts if v.checked]
    total = sum(v.attributes for v in checked)
    return sum(v.attributes_equal for v in checked) / total if total else 1.0


def call_overlap(model_calls: Sequence[tuple[str, Call]], truth_calls: Sequence[tuple[str, Call]]) -> float:
    """The share of ground-truth calls the model also made (same function, same bound arguments with
    defaults filled in, each model call matched once). Items are (class name, call)."""
    if not truth_calls:
        return 1.0
    made = Counter(_bound(cls, call) for cls, call in model_calls)
    hits = 0
    for cls, call in truth_calls:
        key = _bound(cls, call)
        if made[key] > 0:
            made[key] -= 1
            hits += 1
    return hits / len(truth_calls)


def _bound(cls_name: str, call: Call) -> tuple[str, str]:
    """(name, canonical arguments): positional and keyword forms of one call compare equal."""
    args, kwargs = call.values()
    try:
        signature = inspect.signature(getattr(api_class(cls_name), call.name))
        bound = signature.bind(None, *args, **kwargs)  # None stands for self
        bound.apply_defaults()
    except (TypeError, ValueError, AttributeError):  # a call that does not bind stays as written
        return call.name, call.arguments
    arguments = dict(list(bound.arguments.items())[1:])
    return call.name, json.dumps(arguments, sort_keys=True, default=str)
