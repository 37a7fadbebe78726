"""MutableEnv: a reset/step object becomes a functional environment by replaying the action prefix
from a seeded reset; it passes check_environment, re-enters prefixes exactly, a non-reproducible
object is a named ReplayMismatch, and every object built is closed (a raising step or close included)."""

from __future__ import annotations

import itertools

import pytest

from trace_lightning.envs.base import Task
from trace_lightning.envs.check import check_environment
from trace_lightning.envs.mutable import MutableEnv, ReplayMismatch

TASKS = [Task(i, f"Reach {3 + i}. Reply <add>n</add>.", (str(3 + i),)) for i in range(4)]


class Counter:
    """Mutable: a running total the actions add to; done when it reaches the task's target."""

    def reset(self, task, seed):
        self.total, self.target = 0, int(task.answer[0])

    def step(self, action):
        digits = "".join(c for c in action if c.isdigit())[:3]
        self.total += int(digits) if digits else 0
        if self.total >= self.target:
            return "", float(self.total == self.target), True
        return f"total {self.total}", None, False


class Drifting(Counter):
    """Not reproducible: every new object observes something else."""

    ids = itertools.count()

    def step(self, action):
        observation, reward, done = super().step(action)
        return (f"{observation} #{next(self.ids)}", reward, done)


def env(make):
    return MutableEnv(make, TASKS, "counter", "Add numbers.", ("</add>",))


def test_a_mutable_environment_becomes_a_functional_one():
    counter = env(Counter)
    assert check_environment(counter) == []
    task = TASKS[0]  # target 3
    one = counter.step(task, counter.initial_state(task), "<add>1</add>")
    assert (one.observation, one.done, one.state) == ("total 1", False, (("<add>1</add>", "total 1"),))
    # two continuations from the same prefix, as Stage 2 makes them: each replays the prefix afresh
    win, loss = (counter.step(task, one.state, a) for a in ("<add>2</add>", "<add>5</add>"))
    assert (win.done, win.reward, loss.done, loss.reward) == (True, 1.0, True, 0.0)


def test_a_replay_that_does_not_reproduce_is_a_named_error():
    drifting = env(Drifting)
    task = TASKS[0]
    one = drifting.step(task, (), "<add>1</add>")
    with pytest.raises(ReplayMismatch, match="task 0, turn 0: replaying the same actions"):
        drifting.step(task, one.state, "<add>1</add>")
    assert any("two different transitions" in p for p in check_environment(drifting))  # caught up front


class Tracked(Counter):
    """Counts how many objects are built and closed; `fail_on` makes step raise on that action, and
    `close_raises` makes close() raise (after counting it)."""

    def __init__(self, counts: dict[str, int], fail_on: str = "", close_raises: bool = False):
        self.counts, self.fail_on, self.close_raises = counts, fail_on, close_raises
        counts["built"] += 1

    def step(self, action):
        if self.fail_on and action == self.fail_on:
            raise RuntimeError("the step failed")
        return super().step(action)

    def close(self):
        self.counts["closed"] += 1
        if self.close_raises:
            raise OSError("close failed")


@pytest.mark.parametrize("close_raises", [False, True])
def test_every_object_built_is_closed_even_when_its_step_or_its_close_raises(close_raises, caplog):
    counts = {"built": 0, "closed": 0}
    tracked = env(lambda: Tracked(counts, fail_on="<add>9</add>", close_raises=close_raises))
    for task in TASKS:  # per task: 3 + i steps of +1 to the target, then one step that raises
        state = tracked.initial_state(task)
        while not (tr := tracked.step(task, state, "<add>1</add>")).done:
            state = tr.state
        with pytest.raises(RuntimeError, match="the step failed"):  # the step's error, not close's
            tracked.step(task, state[:1], "<add>9</add>")
    assert counts["built"] == sum(3 + i + 1 for i in range(4)) == 22
    assert counts["closed"] == counts["built"]
    assert ("close() raised OSError" in caplog.text) == close_raises


def test_objects_without_a_callable_close_are_left_alone():
    class NotCallable(Counter):
        close = "not a method"

    assert env(NotCallable).step(TASKS[0], (), "<add>1</add>").observation == "total 1"
