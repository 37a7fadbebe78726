"""ReAct demonstrations built from each environment's own gold data, for the supervised warm start.

A demonstration is the turns an agent should take: tool calls, then the answer. Its observations
are never written by hand: every action is replayed through the real environment, which returns the
observation (the BM25 tool's real search result, the calculator's real output) and, on the answer,
the reward. Only demonstrations whose tool result shows the gold and whose answer the environment
scores 1.0 are kept, so the model is taught to read its answer from the tool, never to guess.

- search_qa: `<search>` the question (or, when that misses, the cited page's title with it), then
  `<answer>` the gold.
- math_tool (generated problems): one `<calculate>` per step the problem's sentences spell out, each
  on the calculator's previous result, then `<answer>` the gold. GSM8K problems are skipped: their
  text does not determine an expression.
- bfcl: the entry's ground-truth calls, one `<tool_call>` per turn with the API's real results, and a
  short reply ending each user turn; kept when BFCL's verdict on the whole conversation is 1.0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trace_lightning.envs.base import Task
from trace_lightning.envs.bfcl import call_text, keyword_call
from trace_lightning.envs.scoring import normalize_answer


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


def _shows(observation: str, golds: Sequence[str]) -> bool:
    text = normalize_answer(observation)
    return any(normalize_answer(g) and normalize_answer(g) in text for g in golds)


def _accept(demo: Demonstration | None) -> bool:
    return demo is not None and demo.reward == 1.0 and _shows(demo.observations[-1], demo.task.answer)


def search_qa_demo(env: Any, task: Task) -> Demonstration | None:
    """Search the question (then the cited title with it), answer the gold; None if no search shows it."""
    question = task.question.rstrip("?").strip()
    titles = getattr(env, "cited", {}).get(task.task_id, ())
    queries = [question, *(f"{title} {question}" for title in titles)]
    for query in queries:
        demo = replay(env, task, [f"<search>{query}</search>", f"<answer>{task.answer[0]}</answer>"])
        if _accept(demo):
            return demo
    return None


_START = re.compile(r"^\w+ has (\d+) ")
_STEPS = (
    (re.compile(r"buys (\d+) more"), "+"),
    (re.compile(r"gives away (\d+)"), "-"),
    (re.compile(r"ends up with (\d+) times as many"), "*"),
    (re.compile(r"splits them into (\d+) equal groups"), "/"),
)


def generated_steps(question: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(starting number, [(operator, number), ...]) that a generated word problem spells out, or None.

    Reads the sentences `math_tool.generate_problems` writes; any other text gives None.
    """
    start = _START.match(question)
    if start is None:
        return None
    steps = []
    for sentence in question.split(". ")[1:]:
        for pattern, op in _STEPS:
            if (m := pattern.search(sentence)) is not None:
                steps.append((op, m.group(1)))
                break
    return start.group(1), steps


def generated_expression(question: str) -> str | None:
    """The arithmetic a generated word problem spells out as one expression ("(12 + 7) * 3"), or None."""
    read = generated_steps(question)
    if read is None:
        return None
    expression, steps = read
    for op, number in steps:
        expression = f"({expression} {op} {number})"
    return expression[1:-1] if expression.startswith("(") else expression


def math_tool_demo(env: Any, task: Task) -> Demonstration | None:
    """One `<calculate>` per step of the story, each on the previous result (the calculator's real
    output), then the answer; None for problems we cannot read. A story of one step is one call."""
    read = generated_steps(task.question)
    if read is None:
        return None
    value, steps = read
    actions: list[str] = []
    for op, number in steps:
        actions.append(f"<calculate>{value} {op} {number}</calculate>")
        shown = _calculated(env, task, actions)
        if shown is None:
            return None
        value = shown
    if not actions:  # a story with no step: the calculator confirms the number
        actions.append(f"<calculate>{value}</calculate>")
    demo = replay(env, task, [*actions, f"<answer>{task.answer[0]}</answer>"])
    return demo if _accept(demo) else None


def _calculated(env: Any, task: Task, actions: Sequence[str]) -> str | None:
    """The number the calculator showed after the last of `actions` (played from the task's start)."""
    state, observation = env.initial_state(task), ""
    for action in actions:
        tr = env.step(task, state, action)
        if tr.done or tr.tool_error:
            return None
        state, observation = tr.state, tr.observation
    m = re.search(r"= (-?[\d.]+)", observation)
    return m.group(1) if m else None


BFCL_DONE = "Done."  # the reply that ends a user turn whose request the calls fulfilled
BFCL_CANNOT = "I cannot do that with the functions I have, or a value I need is missing. Please tell me more."


def bfcl_demo(env: Any, task: Task) -> Demonstration | None:
    """The entry's ground truth played through the environment: each call as the policy writes it (one
    per turn, real execution results as observations), then a reply ending the user turn ("Done.", or
    saying it cannot where the ground truth makes no call); kept only when BFCL's verdict is 1.0."""
    entry = env.entries[task.task_id]
    actions: list[str] = []
    for turn in entry.ground_truth:
        actions += [call_text(keyword_call(entry, call)) for call in turn]
        actions.append(BFCL_DONE if turn else BFCL_CANNOT)
    demo = replay(env, task, actions)
    return demo if demo is not None and demo.reward == 1.0 else None


BUILDERS = {"search_qa": search_qa_demo, "math_tool": math_tool_demo, "bfcl": bfcl_demo}


def own_demo(env: Any, task: Task) -> Demonstration | None:
    """A user environment's demonstration: the actions its `demonstration(task)` returns (None: none for
    this task), replayed through the environment and kept when they score 1.0."""
    actions = env.demonstration(task)
    if not actions:
        return None
    demo = replay(env, task, tuple(actions))
    return demo if demo is not None and demo.reward == 1.0 else None


def demonstrations(env: Any, task_ids: set[int]) -> tuple[list[Demonstration], int]:
    """(demonstrations for the tasks in `task_ids`, how many of those tasks got none). An environment
    with a `demonstration(task) -> list of action texts | None` method supplies its own (docs/extending.md);
    the shipped ones are built here from their gold data."""
    if hasattr(env, "demonstration"):
        build = own_demo
    elif env.name in BUILDERS:
        build = BUILDERS[env.name]
    else:
        raise ValueError(
            f"the warm start has no demonstrations for env={env.name!r}: give the environment a method "
            "`demonstration(task) -> list[str] | None` returning the actions of a successful episode "
            f"(docs/extending.md); built in: {sorted(BUILDERS)}"
        )
    demos = [d for t in env.tasks() if t.task_id in task_ids if (d := build(env, t)) is not None]
    return demos, len(task_ids) - len(demos)
