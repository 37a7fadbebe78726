"""Shared fixtures: one tiny random Qwen3 per session, loaded fresh per test.

The environment variables are set at import so that everything later in the session runs offline and
without OpenMP busy-waiting (which slows torch 20-100x when processes share cores).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from helpers.optin import OPT_IN, required

from trace_lightning.models import build_policy, build_tiny_model


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked with an opt-in resource it lacks skips with the reason, or fails where the run
    requires that resource (`TRACE_REQUIRE`, set by the CI step that installs it; see helpers/optin.py)."""
    for name, opt_in in OPT_IN.items():
        if item.get_closest_marker(name) is None or opt_in.present():
            continue
        if name in required():
            pytest.fail(f"{name} is required in this run (TRACE_REQUIRE) but absent: {opt_in.reason}")
        pytest.skip(opt_in.reason)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture
def tiny_policy(tiny_model_dir: str):
    """(model, tokenizer), loaded per test (~20 ms) so a test may train or edit it freely."""
    return build_policy(tiny_model_dir)
