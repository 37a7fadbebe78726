"""An environment written outside the package, as docs/extending.md walks through it: two-hop
questions over a small table of countries, answered with a `<lookup>` tool.

    "Of the countries with codes FR and DE, which has more people? Answer with its capital."
    turn 1: <lookup>FR</lookup>  ->  <observation>FR: France, capital Paris, population 68 million
    turn 2: <lookup>DE</lookup>  ->  <observation>DE: Germany, capital Berlin, population 84 million
    turn 3: <answer>Berlin</answer>  (reward 1.0)

Three policy turns, so a tree can branch after either lookup. The state is a tuple of the codes looked
up so far: an immutable value, so a continuation re-enters a prefix exactly.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Sequence

from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.tools import ToolEnv

COUNTRIES = {  # code: (name, capital, population in millions)
    "FR": ("France", "Paris", 68),
    "DE": ("Germany", "Berlin", 84),
    "IT": ("Italy", "Rome", 59),
    "ES": ("Spain", "Madrid", 48),
    "PL": ("Poland", "Warsaw", 37),
    "NL": ("Netherlands", "Amsterdam", 18),
    "SE": ("Sweden", "Stockholm", 10),
    "PT": ("Portugal", "Lisbon", 10.4),
    "GR": ("Greece", "Athens", 10.2),
    "AT": ("Austria", "Vienna", 9),
    "CH": ("Switzerland", "Bern", 8.8),
    "NO": ("Norway", "Oslo", 5.5),
    "FI": ("Finland", "Helsinki", 5.6),
    "IE": ("Ireland", "Dublin", 5.3),
    "JP": ("Japan", "Tokyo", 124),
    "KR": ("South Korea", "Seoul", 52),
    "EG": ("Egypt", "Cairo", 112),
    "KE": ("Kenya", "Nairobi", 55),
    "PE": ("Peru", "Lima", 34),
    "CA": ("Canada", "Ottawa", 40),
    "AU": ("Australia", "Canberra", 27),
}
SYSTEM_PROMPT = (
    "Answer the question. To see a country's facts, write <lookup>CODE</lookup> (one code per turn). "
    "When you know the answer, write <answer>the capital</answer>."
)
ACTION = re.compile(r"<(lookup|answer)>(.*?)</\1>", re.DOTALL)
MAX_LOOKUPS = 4


class CapitalsEnv:
    """Two-hop questions: which of two countries has more people, answered with its capital."""

    name = "capitals"
    system_prompt = SYSTEM_PROMPT
    stop_strings = ("</lookup>", "</answer>")

    def __init__(self, n_tasks: int = 200, seed: int = 0) -> None:
        pairs = list(itertools.combinations(sorted(COUNTRIES), 2))
        random.Random(seed).shuffle(pairs)
        if not 1 <= n_tasks <= len(pairs):
            raise ValueError(f"env.n_tasks={n_tasks} must be in [1, {len(pairs)}] (pairs of countries)")
        self._pairs = pairs[:n_tasks]
        self._tasks = []
        for i, (a, b) in enumerate(self._pairs):
            bigger = max((a, b), key=lambda c: COUNTRIES[c][2])
            question = (
                f"Of the countries with codes {a} and {b}, which has more people? Answer with its capital."
            )
            self._tasks.append(Task(i, question, (COUNTRIES[bigger][1],)))

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def initial_state(self, task: Task) -> tuple[str, ...]:
        return ()  # the codes looked up so far

    def step(self, task: Task, state: tuple[str, ...], action_text: str) -> Transition:
        match = ACTION.search(action_text)
        if match is None:
            note = "<observation>Write <lookup>CODE</lookup> or <answer>capital</answer>.</observation>"
            return Transition(note, False, None, None, state, format_error=True)
        tool, arg = match.group(1), match.group(2).strip()
        if tool == "answer":
            right = arg.lower() == task.answer[0].lower()
            return Transition("", True, 1.0 if right else 0.0, "answer", state)
        if len(state) >= MAX_LOOKUPS:
            return Transition("", True, 0.0, "too_many_lookups", state, tool="lookup", tool_error=True)
        code = arg.upper()[:8]
        if code not in COUNTRIES:
            note = f"<observation>No country with code {code!r}.</observation>"
            return Transition(note, False, None, None, (*state, code), tool="lookup", tool_error=True)
        name, capital, people = COUNTRIES[code]
        fact = f"<observation>{code}: {name}, capital {capital}, population {people} million</observation>"
        return Transition(fact, False, None, None, (*state, code), tool="lookup")

    def demonstration(self, task: Task) -> list[str]:
        """A successful episode's actions, for the warm start: look both up, then answer."""
        a, b = self._pairs[task.task_id]
        return [f"<lookup>{a}</lookup>", f"<lookup>{b}</lookup>", f"<answer>{task.answer[0]}</answer>"]


def lookup(code: str) -> str:
    """A country's name, capital and population.

    Args:
        code: the country's two-letter code, e.g. FR
    """
    name, capital, people = COUNTRIES[code.strip().upper()]  # an unknown code raises: a tool error
    return f"{code.upper()}: {name}, capital {capital}, population {people} million"


class CapitalsToolEnv(ToolEnv):
    """The same questions with `lookup` as a typed tool: its schema is generated from the signature and
    docstring, the chat template renders it, and calls are parsed in `tool_format` (hermes: Qwen-style
    `<tool_call>` JSON; llama3_json). The final reply is the capital."""

    name = "capitals_tools"
    system_prompt = "Answer the question. Look countries up with the tool, then reply with the capital only."
    tools = (lookup,)

    def __init__(self, n_tasks: int = 200, seed: int = 0, tool_format: str = "hermes") -> None:
        self.tool_format = tool_format
        super().__init__()
        self._env = CapitalsEnv(n_tasks, seed)

    def tasks(self) -> Sequence[Task]:
        return self._env.tasks()

    def score(self, task: Task, reply: str) -> float:
        return float(reply.strip().rstrip(".").lower() == task.answer[0].lower())

    def demonstration(self, task: Task) -> list[str]:
        a, b = self._env._pairs[task.task_id]
        calls = [json.dumps({"name": "lookup", "arguments": {"code": c}}) for c in (a, b)]
        if self.tool_format == "llama3_json":
            calls = [json.dumps({"name": "lookup", "parameters": {"code": c}}) for c in (a, b)]
            return [*calls, task.answer[0]]
        return [*(f"<tool_call>{c}</tool_call>" for c in calls), task.answer[0]]
