"""MutableEnv: a reset/step object becomes a functional environment by replaying the action prefix
from a seeded reset; it passes check_environment, re-enters prefixes exactly, and a non-reproducible
object is a named ReplayMismatch."""

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
