"""The synthetic chain task (`envs/synthetic.py`) as text, so that a language model can play it.

The question shows a key -> letter table, listed in a shuffled order, and asks for key 1; each
observation says whether the last pick was right and asks for the next key. The policy answers
`<choose>letter</choose>`. The right letter for key t is the task's answer at turn t, so the state
(turn, mistakes) and the win/loss rule are exactly those of `ChainTask`, and `true_value` gives the
exact V of the reference policy at any state.

The text is kept short for a tiny model with a byte-level tokenizer. An episode with 4 turns:

    question:     "Table: 3=A 1=C 4=B 2=D. 1 mistake allowed. Key 1?"
    turn 1:       "<choose>C</choose>"    observation: "<observation>right. Key 2?</observation>"
    ...           (about 200 characters in all)
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence

from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.choice import choose_step
from trace_lightning.envs.synthetic import ChainTask, make_tasks

SYSTEM_PROMPT = "Look up each key in the table and reply <choose>letter</choose>."


def render_question(task: ChainTask, n_choices: int, order_seed: int) -> str:
    """The task's table (keys 1..turns, shuffled by `order_seed`), its tolerance and the first key."""
    keys = list(range(1, task.turns + 1))
    random.Random(order_seed).shuffle(keys)
    letters = string.ascii_uppercase[:n_choices]
    table = " ".join(f"{key}={letters[task.answers[key - 1]]}" for key in keys)
    allowed = "1 mistake allowed" if task.tolerance == 1 else f"{task.tolerance} mistakes allowed"
    return f"Table: {table}. {allowed}. Key 1?"


class ChainEnv:
    """`ChainTask`s from `make_tasks` played through text; reward 1.0 on a win, 0.0 on a loss.

    State: `(turn, mistakes)`, as in `synthetic.state_of`. A pick that is not one of the letters is a
    format error and leaves the state unchanged. `chain_tasks` keeps the underlying tasks, in the
    same order as `tasks()`, for oracle values.
    """

    name = "chain"
    system_prompt = SYSTEM_PROMPT
    stop_strings = ("</choose>",)
    actions = ("choose",)

    def __init__(self, n_tasks: int = 256, turns: int = 4, n_choices: int = 4, seed: int = 0) -> None:
        if n_tasks < 1 or not 2 <= n_choices <= 26:
            raise ValueError(
                f"env.n_tasks must be >= 1 and env.n_choices in 2..26, got {n_tasks}, {n_choices}"
            )
        self.n_choices = n_choices
        self.letters = string.ascii_uppercase[:n_choices]
        self.chain_tasks: list[ChainTask] = make_tasks(n_tasks, turns=turns, n_choices=n_choices, seed=seed)
        self._tasks = [
            Task(
                t.task_id,
                render_question(t, n_choices, order_seed=seed * 1_000_003 + t.task_id),
                tuple(self.letters[a] for a in t.answers),
            )
            for t in self.chain_tasks
        ]

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def initial_state(self, task: Task) -> tuple[int, int]:
        return (0, 0)

    def step(self, task: Task, state: tuple[int, int], action_text: str) -> Transition:
        chain = self.chain_tasks[task.task_id]
        return choose_step(
            action_text,
            state,
            self.letters,
            self.letters[chain.answers[state[0]]],
            chain.tolerance,
            chain.turns,
            lambda arg: f"{arg!r} is not a choice: write one letter of {self.letters}.",
            lambda right, turn: f"{'right' if right else 'wrong'}. Key {turn + 1}?",
        )
