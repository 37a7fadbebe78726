"""A multi-turn task family where allocation matters (the allocation testbed): heterogeneous difficulty and
one decisive turn per task, as text a tiny language model can play.

Each turn shows a letter and the policy answers `<choose>letter</choose>`. On ordinary turns the
answer is the shown letter. On the task's decisive turn the shown letter comes with a shift k and
the shifted letter ("F+2=H"), and the answer is the shifted letter; the question says in advance
which key shifts and by how much. Tasks differ in turns (2-4), letters (A-H or A-P), the position and shift of
the decisive turn (k = 0..3) and the mistakes allowed (0 or 1). An episode:

    question:    "3 keys, 0 errors ok, A-H. Key 2 +2. Key 1: C."
    turn 1:      "<choose>C</choose>"   observation: "<observation>ok. Key 2: F+2=H.</observation>"
    turn 2:      "<choose>H</choose>"   observation: "<observation>ok. Key 3: B.</observation>"
    turn 3:      "<choose>B</choose>"   -> solved, reward 1

Where difficulty comes from: the supervised warm start (`teacher_pick`) imitates a teacher that
always copies on ordinary turns and at the decisive turn applies the shift only with probability
`TEACHER_SHIFT_ACCURACY[k]`, otherwise copies the letter unshifted (the natural mistake). So after the
warm start tasks with k = 3 and no mistake allowed almost never succeed, tasks with one mistake
allowed or k = 0 almost always do, and k = 1, 2 sit in between; the prefix just before the decisive
turn is the knife edge. Held-out tasks come from another seed and are never trained on.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.choice import choose_step

SYSTEM_PROMPT = "Reply <choose>letter</choose>."
TEACHER_SHIFT_ACCURACY = (1.0, 0.7, 0.35, 0.0)  # P(the warm-start teacher applies shift k correctly)


@dataclass(frozen=True)
class DecisiveTask:
    task_id: int
    shown: tuple[str, ...]  # the letter shown at each turn
    decisive: int  # the turn (0-based) whose answer is shifted
    shift: int  # k: places the decisive letter moves on
    tolerance: int  # mistakes allowed
    n_letters: int

    @property
    def turns(self) -> int:
        return len(self.shown)

    def answer(self, turn: int) -> str:
        letter = self.shown[turn]
        return chr(ord(letter) + self.shift) if turn == self.decisive else letter

    def cue(self, turn: int) -> str:
        """What the environment shows for `turn`: "C", or "F+2=H" on the decisive turn (the shifted
        letter is spelled out: the task tests whether the policy takes it, not letter arithmetic)."""
        if turn != self.decisive:
            return self.shown[turn]
        return f"{self.shown[turn]}+{self.shift}={self.answer(turn)}"


def make_decisive_tasks(
    n: int, seed: int, first_id: int = 0, exclude: frozenset[tuple[object, ...]] = frozenset()
) -> list[DecisiveTask]:
    """`n` tasks drawn independently: turns 2-4, 8 or 16 letters, shift 0-3 (weights 10/30/30/30%),
    one mistake allowed for 20%. Decisive letters leave room for the shift (no wrap-around). A draw
    whose `content` is in `exclude` is skipped (the held-out split excludes every training task)."""
    rng = np.random.default_rng(seed)
    tasks: list[DecisiveTask] = []
    while len(tasks) < n:
        turns, n_letters = int(rng.integers(2, 5)), int(rng.choice([8, 16]))
        decisive, shift = int(rng.integers(turns)), int(rng.choice(4, p=[0.1, 0.3, 0.3, 0.3]))
        letters = string.ascii_uppercase[:n_letters]
        shown = [letters[int(rng.integers(n_letters))] for _ in range(turns)]
        shown[decisive] = letters[int(rng.integers(n_letters - shift))]
        task = DecisiveTask(
            first_id + len(tasks), tuple(shown), decisive, shift, int(rng.random() < 0.2), n_letters
        )
        if content(task) not in exclude:
            tasks.append(task)
    return tasks


def content(task: DecisiveTask) -> tuple[object, ...]:
    """What the policy sees and is scored on, without the id: two tasks with equal content are one task."""
    return (task.shown, task.decisive, task.shift, task.tolerance, task.n_letters)


def render_question(task: DecisiveTask) -> str:
    last = string.ascii_uppercase[task.n_letters - 1]
    shift = f"Key {task.decisive + 1} +{task.shift}"
    return f"{task.turns} keys, {task.tolerance} errors ok, A-{last}. {shift}. Key 1: {task.cue(0)}."


class DecisiveEnv:
    """`DecisiveTask`s through text; reward 1.0 when all keys are answered within the tolerance.

    State: `(turn, mistakes)`. A pick that is not one of the task's letters is a format error and
    leaves the state unchanged. `split="heldout"` gives `heldout_tasks` tasks from another seed, with
    ids after the training ones and none equal to a training task (`content`), so the two sets never
    share a task, not even a verbatim copy under another id.
    """

    name = "decisive"
    system_prompt = SYSTEM_PROMPT
    stop_strings = ("</choose>",)
    actions = ("choose",)

    def __init__(
        self, n_tasks: int = 1000, heldout_tasks: int = 200, split: str = "train", seed: int = 0
    ) -> None:
        if n_tasks < 1 or heldout_tasks < 0 or split not in ("train", "heldout"):
            raise ValueError(
                f"env.n_tasks={n_tasks} must be >= 1, env.heldout_tasks={heldout_tasks} >= 0 and "
                f"env.split={split!r} 'train' or 'heldout'"
            )
        if split == "train":
            self.decisive_tasks = make_decisive_tasks(n_tasks, seed)
        else:
            train = frozenset(content(t) for t in make_decisive_tasks(n_tasks, seed))
            self.decisive_tasks = make_decisive_tasks(heldout_tasks, seed + 1_000_003, n_tasks, train)
        self.by_id = {t.task_id: t for t in self.decisive_tasks}
        self._tasks = [Task(t.task_id, render_question(t), (t.answer(0),)) for t in self.decisive_tasks]

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def attributes(self, task: Task) -> tuple[str, ...]:
        """What the question states, coarse to fine (`envs.base.HasAttributes`): the mistakes allowed,
        the decisive key's shift, the keys. "3 keys, 0 errors ok, A-H. Key 2 +2. ..." -> ("errors_ok=0",
        "shift=2", "keys=3"). Pooled success rates over these carry over to prompts never drawn before."""
        spec = self.by_id[task.task_id]
        return f"errors_ok={spec.tolerance}", f"shift={spec.shift}", f"keys={spec.turns}"

    def initial_state(self, task: Task) -> tuple[int, int]:
        return (0, 0)

    def step(self, task: Task, state: tuple[int, int], action_text: str) -> Transition:
        spec = self.by_id[task.task_id]
        letters = string.ascii_uppercase[: spec.n_letters]
        return choose_step(
            action_text,
            state,
            letters,
            spec.answer(state[0]),
            spec.tolerance,
            spec.turns,
            lambda arg: f"{arg!r} is not a letter of A-{letters[-1]}.",
            lambda right, turn: f"{'ok' if right else 'no'}. Key {turn + 1}: {spec.cue(turn)}.",
        )


def teacher_pick(cue: str, rng: np.random.Generator) -> str:
    """The warm start's imperfect teacher, from the cue alone: the shown letter on ordinary turns
    ("C"); on the decisive turn ("F+2=H") the shifted letter with probability
    `TEACHER_SHIFT_ACCURACY[k]`, else the shown letter unshifted (it forgot the shift)."""
    if "=" not in cue:
        return cue
    shown, rest = cue.split("+")
    shift, shifted = rest.split("=")
    return shifted if rng.random() < TEACHER_SHIFT_ACCURACY[int(shift)] else shown
