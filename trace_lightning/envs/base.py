"""The `Environment` protocol: tasks, a verifier, tools, and re-enterable state.

Environments are functional: `step(task, state, action_text)` returns the next state instead of
mutating one, so a tree node can keep the state it had (a snapshot) and a continuation branched from
that node starts from exactly that state. States must be immutable values (tuples, frozen
dataclasses).

Beyond the `Environment` protocol an environment may define optional hooks, each declared below as a
runtime-checkable protocol that the code reading it tests with `isinstance`: `attributes`
(`HasAttributes`), `demonstration` (`HasDemonstration`), `prompt_ids` (`HasPromptIds`), and the
declarations the environment check probes, `tools` (`HasTools`) and `actions` (`HasActions`).

`transition_problem` says what the runner and `envs/check.py` both refuse in a `Transition`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Task:
    """One prompt of a task set."""

    task_id: int
    question: str  # the user message
    answer: tuple[str, ...]  # accepted answers (the verifier's ground truth)


@dataclass(frozen=True)
class Transition:
    """What the environment returns after one policy turn."""

    observation: str  # text appended as the environment's reply (masked from every loss); "" when done
    done: bool
    reward: float | None  # set when done: 1.0 success, 0.0 failure, or a bounded score in [0, 1]
    stop_reason: str | None  # set when done, e.g. "answer"
    state: Any  # the environment state after this turn
    format_error: bool = False  # the turn had no parseable action (an error observation explains why)
    tool: str | None = None  # the tool called this turn, if any
    tool_error: bool = False  # the tool was called but failed (bad argument, crash, timeout)


_BOOL = (bool, np.bool_)  # numpy comparisons give np.bool_, which is as good a flag as bool


def transition_problem(tr: object) -> str | None:
    """Why `tr` is not a transition the runner can use, or None when it is.

    Nothing is clamped or coerced: a NaN reward or a reward of 1.7 is an environment bug, and training
    on it would hide the bug while corrupting the advantages.
    """
    if not isinstance(tr, Transition):
        return f"step returned {type(tr).__name__}, not a Transition"
    if not isinstance(tr.done, _BOOL):
        return f"done={tr.done!r} is not a bool"
    if not isinstance(tr.observation, str):
        return f"observation is {type(tr.observation).__name__}, not str"
    if not (isinstance(tr.format_error, _BOOL) and isinstance(tr.tool_error, _BOOL)):
        return f"format_error={tr.format_error!r} and tool_error={tr.tool_error!r} must be bools"
    if tr.tool is not None and not isinstance(tr.tool, str):
        return f"tool={tr.tool!r} is not a str or None"
    if tr.done:
        return _final_problem(tr.reward, tr.stop_reason)
    return None


def _final_problem(reward: object, stop_reason: object) -> str | None:
    """A final transition needs a finite reward in [0, 1] and a string stop reason (or None)."""
    if isinstance(reward, _BOOL) or not isinstance(reward, numbers.Real):
        return f"done with reward={reward!r}: a final reward must be a number in [0, 1]"
    if not (math.isfinite(reward) and 0.0 <= float(reward) <= 1.0):
        return f"done with reward={reward!r}: a final reward must be finite and in [0, 1]"
    if stop_reason is not None and not isinstance(stop_reason, str):
        return f"stop_reason={stop_reason!r} is not a str"
    return None


class Environment(Protocol):
    name: str
    system_prompt: str  # describes the tools and the action format to the policy
    stop_strings: tuple[str, ...]  # closing action tags: generation of a turn stops at the first one

    def tasks(self) -> Sequence[Task]: ...

    def initial_state(self, task: Task) -> Any: ...

    def step(self, task: Task, state: Any, action_text: str) -> Transition: ...


@runtime_checkable
class HasAttributes(Protocol):
    """Optional: attributes of a task that carry over between prompts, ordered coarse to fine.

    E.g. ("steps=2", "hard_ops=1", "magnitude=3") for a generated math problem: pooled success
    statistics group tasks by the first attribute, then by the first two, and so on. An environment
    without the method gets no attributes (the trainer then relies on the text predictor); a task
    whose attributes cannot be read gets `()`.
    """

    def attributes(self, task: Task) -> tuple[str, ...]: ...


@runtime_checkable
class HasDemonstration(Protocol):
    """Optional: the actions of a successful episode of `task`, or None where there is none.

    The warm start (`demos.py`) replays them through `step` and keeps those that score 1.0; without the
    method an environment has no warm start. `envs/check.py` plays them before its hostile probes.
    """

    def demonstration(self, task: Task) -> Sequence[str] | None: ...


@runtime_checkable
class HasPromptIds(Protocol):
    """Optional: the task's prompt as token ids, for an environment whose prompt differs by task beyond
    the user message (bfcl: each entry's function docs). The runner and the warm start then use it
    instead of templating `system_prompt` and `task.question` (`runner.task_prompt_ids`)."""

    def prompt_ids(self, task: Task, tokenizer: Any) -> list[int]: ...


@runtime_checkable
class HasTools(Protocol):
    """Optional: the environment's tools as typed functions (`envs/tools.py` ToolEnv). `envs/check.py`
    calls each with hostile values, written in the environment's `tool_format` (a key of `envs/tools.py`
    PARSERS; in every format it knows when the environment names none)."""

    tools: Sequence[Callable[..., Any]]


@runtime_checkable
class HasActions(Protocol):
    """Optional: the action tags the environment reads (`("search", "answer")`); `envs/check.py` sends
    malformed and hostile text inside each, as well as inside each stop string's tag."""

    actions: Sequence[str]


def split_tasks(task_ids: Sequence[int], held_out: int, seed: int) -> tuple[set[int], set[int]]:
    """(training ids, held-out ids): a seeded permutation, the first `held_out` held out. The warm start,
    the trainer (`data.held_out`) and `benchmarks/real_learning.py` all use it, so for the same seed and
    count they hold out the same tasks."""
    ids = np.array(sorted(task_ids))
    if not 0 <= held_out < len(ids):
        raise ValueError(f"held_out={held_out} must be between 0 and {len(ids) - 1} ({len(ids)} tasks)")
    perm = np.random.default_rng(seed + 7).permutation(ids)
    return {int(i) for i in perm[held_out:]}, {int(i) for i in perm[:held_out]}
