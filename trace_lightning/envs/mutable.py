"""An adapter for a mutable environment, the gymnasium / OpenEnv convention: an object with
`reset(task, seed)` and `step(action) -> (observation, reward, done)` that changes as it is stepped.

The runner needs to re-enter any turn prefix (Stage 2 continues episodes from the middle), so
`MutableEnv` keeps no live object: its state is the tuple of (action, observation) pairs so far, and
each step builds a fresh object, resets it with a seed fixed per task, replays the prefix and checks
that every replayed observation is the one recorded. A mismatch (an environment that is not
reproducible from its seed) is a `ReplayMismatch` naming the turn, which ends that episode with
`env_error`; it never passes silently. Replay costs one call per earlier turn, so keep episodes short
or the object cheap to build.

Every object built is discarded when its step returns or raises, so `MutableEnv` calls its `close()`
then (in a `finally`, where the object has a callable `close`): an object holding a file, a socket or
a subprocess releases it at every step, not at garbage collection. A `close()` that raises is logged
and contained; it never ends the episode or hides the step's own exception.

    env = MutableEnv(lambda: MyGame(), tasks, name="game", system_prompt="...", stop_strings=("</move>",))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from trace_lightning.envs.base import Task, Transition

log = logging.getLogger(__name__)


class ReplayMismatch(RuntimeError):
    """Replaying an action prefix from the seeded reset did not reproduce a recorded observation."""


class MutableEnv:
    """The functional `Environment` over `make()`'s mutable objects; see the module docstring."""

    def __init__(
        self,
        make: Callable[[], Any],
        tasks: Sequence[Task],
        name: str,
        system_prompt: str,
        stop_strings: tuple[str, ...] = (),
        seed: int = 0,
    ) -> None:
        self.make, self._tasks, self.seed = make, list(tasks), seed
        self.name, self.system_prompt, self.stop_strings = name, system_prompt, tuple(stop_strings)

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def initial_state(self, task: Task) -> tuple[tuple[str, str], ...]:
        return ()

    def _replay(self, env: Any, task: Task, state: tuple[tuple[str, str], ...]) -> None:
        env.reset(task, seed=self.seed * 1_000_003 + task.task_id)
        for turn, (action, recorded) in enumerate(state):
            observation = env.step(action)[0]
            if observation != recorded:
                raise ReplayMismatch(
                    f"task {task.task_id}, turn {turn}: replaying the same actions after reset(seed) gave "
                    f"another observation ({observation[:60]!r}, recorded {recorded[:60]!r}); make "
                    "reset(task, seed) and step(action) reproducible, or write a functional environment"
                )

    def step(self, task: Task, state: tuple[tuple[str, str], ...], action_text: str) -> Transition:
        env = self.make()
        try:
            self._replay(env, task, state)
            observation, reward, done = env.step(action_text)
        finally:  # the object is discarded here, whether the step returned or raised
            close_quietly(env)
        if done:
            return Transition("", True, reward, "done", state)
        return Transition(observation, False, None, None, (*state, (action_text, observation)))


def close_quietly(obj: Any) -> None:
    """Calls `obj.close()` if it has a callable one. An exception from it is logged, not raised: a
    failed release must not end the run nor replace the exception of the step that failed."""
    try:
        close = getattr(obj, "close", None)
        if callable(close):
            close()
    except Exception as err:
        log.warning("%s.close() raised %s; ignored", type(obj).__name__, type(err).__name__)
