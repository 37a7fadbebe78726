"""ReAct demonstrations for the supervised warm start, from each environment's `demonstration(task)`.

A demonstration is the turns an agent should take: tool calls, then the answer. The environment says
which actions (`demonstration(task) -> list[str] | None`, docs/extending.md); their observations are
never written by hand: every action is replayed through the real environment, which returns the
observation (the BM25 tool's real search result, the calculator's real output, the API's result) and,
on the answer, the reward. Only demonstrations that score 1.0 are kept. The shipped environments'
methods are written so the model is taught to read its answer from the tool, never to guess:

- search_qa: `<search>` the question (or, when that misses, a cited page's title with it) until a
  result shows the gold, then `<answer>` the gold.
- math_tool (generated problems): one `<calculate>` per step the problem's sentences spell out, each
  on the calculator's previous result, then `<answer>` the gold. GSM8K problems have none: their
  text does not determine an expression.
- bfcl: the entry's ground-truth calls, one `<tool_call>` per turn with the API's real results, and a
  short reply ending each user turn; kept when BFCL's verdict on the whole conversation is 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trace_lightning.envs.base import HasDemonstration, Task


@dataclass(frozen=True)
class Demonstration:
    task: Task
    actions: tuple[str, ...]  # the policy's turns, in order; the last one is the answer
    observations: tuple[str, ...]  # the environment's reply after each turn but the last
    reward: float  # what the environment gave the final turn


def replay(env: Any, task: Task, actions: Sequence[str]) -> Demonstration | None:
    """Play `actions` through `env`; the demonstration, or None if it ends early or never ends."""
    state, observations = env.initial_state(task), []
    for i, action in enumerate(actions):
        tr = env.step(task, state, action)
        if tr.done:  # an answer before the last action is not the demonstration we meant
            if i < len(actions) - 1:
                return None
            return Demonstration(task, tuple(actions), tuple(observations), float(tr.reward))
        observations.append(tr.observation)
        state = tr.state
    return None


def demonstrate(env: Any, task: Task) -> Demonstration | None:
    """The environment's demonstration of `task`: the actions its `demonstration(task)` returns (None:
    none for this task), replayed through the environment and kept when they score 1.0."""
    actions = env.demonstration(task)
    if not actions:
        return None
    demo = replay(env, task, tuple(actions))
    return demo if demo is not None and demo.reward == 1.0 else None


def demonstrations(env: Any, task_ids: set[int]) -> tuple[list[Demonstration], int]:
    """(demonstrations for the tasks in `task_ids`, how many of those tasks got none)."""
    if not isinstance(env, HasDemonstration):
        raise ValueError(
            f"the warm start has no demonstrations for env={env.name!r}: give the environment a method "
            "`demonstration(task) -> list[str] | None` returning the actions of a successful episode "
            "(docs/extending.md)"
        )
    demos = [d for t in env.tasks() if t.task_id in task_ids if (d := demonstrate(env, t)) is not None]
    return demos, len(task_ids) - len(demos)
