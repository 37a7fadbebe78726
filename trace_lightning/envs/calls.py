"""Calls into an environment that cannot hang or crash their caller: `call_with_timeout` runs one in a
worker thread under a deadline, and `describe_error` names what it raised in one bounded line.

The runner plays every step through them, and `envs/check.py` every probe, so a step the check
reports as hanging is one the runner would abandon (`env_timeout`), and the other way round. They
live here, inside `envs/`, so that the check needs nothing from outside the folder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
MAX_ERROR_CHARS = 500  # an error message kept for the log; a huge one would only bloat the report


class StepTimeout(Exception):
    """`env.step` did not return within the runner's `step_timeout`."""


def call_with_timeout(fn: Callable[[], T], timeout: float | None) -> T:
    """`fn()`, or `StepTimeout` when it has not returned after `timeout` seconds (None: no limit).

    A Python thread cannot be killed, so a call that times out is abandoned: it keeps running in the
    background until it returns by itself, and its result is dropped (environments are functional, so
    it changes nothing we keep). It runs in a fresh daemon thread rather than a ThreadPoolExecutor
    worker because the interpreter joins executor workers at exit: one hung step would keep the
    finished training process alive forever. A fresh thread costs ~0.1 ms, nothing next to a turn of
    generation. Tools that run code (the sandboxed python tool) enforce their own process timeout;
    this one is the last line of defence, and it means `env.step` must not rely on running in the
    main thread (no `signal.alarm`).

    A call that returns after `timeout` is a `StepTimeout` too: a tool that holds the GIL (a C loop, a
    huge integer power) keeps this thread from waking at its deadline, so `join` returns only once the
    call is done, late. Accepting that result would reward a step that overran its bound.
    """
    if timeout is None:
        return fn()
    box: list[tuple[bool, Any, float]] = []
    began = time.monotonic()

    def target() -> None:
        try:
            box.append((True, fn(), time.monotonic()))
        except BaseException as err:  # handed to the caller, who decides what is fatal
            box.append((False, err, time.monotonic()))

    thread = threading.Thread(target=target, name="env-step", daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        raise StepTimeout(f"env.step did not return within {timeout} s")
    ok, value, ended = box[0]
    if ended - began > timeout:
        raise StepTimeout(f"env.step returned after {ended - began:.2f} s, past its {timeout} s")
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def describe_error(err: BaseException) -> str:
    """`Type: message`, bounded, and safe even when the exception's own __str__ raises."""
    try:
        text = str(err)
    except Exception:
        text = "<unprintable>"
    return f"{type(err).__name__}: {text}"[:MAX_ERROR_CHARS]
