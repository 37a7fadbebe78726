"""`check_environment`: the shipped environments pass it, the example environment of docs/extending.md
passes it and plugs into the trainer's config and the warm start, and each rule it states catches an
environment that breaks it, naming the problem."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from trace_lightning import config
from trace_lightning.demos import demonstrations
from trace_lightning.envs.base import (
    HasActions,
    HasAttributes,
    HasDemonstration,
    HasPromptIds,
    HasTools,
    Task,
    Transition,
)
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.envs.check import RUNNER_EPISODE_TOKENS, RUNNER_OBSERVATION_CHARS, check_environment
from trace_lightning.envs.decisive import DecisiveEnv
from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.runner import EpisodeLimits

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "capitals"
SEARCHPATH = f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]"


def shipped(name: str):
    if name == "search_qa":
        from trace_lightning.envs.search_qa import SearchQAEnv

        return SearchQAEnv()
    if name == "bfcl":
        from trace_lightning.envs.bfcl import BFCLEnv

        return BFCLEnv("base")
    return {"chain": ChainEnv(n_tasks=8), "math_tool": MathToolEnv(n_tasks=20, difficulty=2)}.get(
        name, DecisiveEnv(20, 5)
    )


@pytest.mark.parametrize("name", ["chain", "math_tool", "decisive", "search_qa", "bfcl"])
def test_the_shipped_environments_pass(name):
    """Each shipped environment against the demonstration-free hostile actions (empty, untagged,
    unterminated and nested tags, a megabyte of text, 5,000-digit and non-finite numbers, 990-deep
    brackets, forged chat markers, lone surrogates): no exception, valid transitions, exact re-entry."""
    assert check_environment(shipped(name)) == []


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def test_the_example_environment_plugs_into_the_config_the_check_and_the_warm_start(example_on_path):
    config.check_overrides(["env=capitals", "env.n_tasks=50", SEARCHPATH])  # its keys are known
    with pytest.raises(config.UnknownSettingError, match="env.n_tasks"):
        config.check_overrides(["env=capitals", "env.n_taks=50", SEARCHPATH])
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["env=capitals", SEARCHPATH])
    env = instantiate(cfg.env)
    assert check_environment(env) == []
    demos, missing = demonstrations(env, {0, 1, 2, 3})
    assert missing == 0 and all(d.reward == 1.0 and len(d.actions) == 3 for d in demos)


def test_the_optional_hooks_are_read_through_the_protocols_of_envs_base():
    """An environment has a hook when its class defines it; a subclass that sets it to None has none, as
    the `getattr(env, hook, None)` probes these protocols replaced read it."""
    env = MathToolEnv(n_tasks=4)
    assert isinstance(env, HasDemonstration) and isinstance(env, HasActions)
    assert isinstance(env, HasAttributes)
    assert not isinstance(env, HasPromptIds) and not isinstance(env, HasTools)

    class WithoutDemonstrations(MathToolEnv):
        demonstration = None

    assert not isinstance(WithoutDemonstrations(n_tasks=4), HasDemonstration)
    with pytest.raises(ValueError, match="no demonstrations"):
        demonstrations(WithoutDemonstrations(n_tasks=4), {0})


def test_the_check_command_reports_the_example_ok():
    proc = subprocess.run(
        [sys.executable, "-m", "trace_lightning.check", "env=capitals", SEARCHPATH],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(EXAMPLE), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "env=capitals: OK" in proc.stdout


def test_the_old_command_line_fails_naming_the_new_one():
    """`python -m trace_lightning.envs.check` moved to `trace_lightning.check` (envs/ may not read the
    config); the old one must not exit 0 as if it had checked something."""
    proc = subprocess.run(
        [sys.executable, "-m", "trace_lightning.envs.check", "env=capitals"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "python -m trace_lightning.check" in proc.stderr


def test_the_check_cuts_observations_where_the_runner_does_by_default():
    """envs/check.py writes the runner's defaults out instead of importing the runner (envs/ stands
    alone); they must stay the runner's."""
    defaults = EpisodeLimits()
    assert defaults.max_observation_chars == RUNNER_OBSERVATION_CHARS
    assert defaults.max_episode_tokens == RUNNER_EPISODE_TOKENS


class Broken:
    """A one-task environment whose `step` breaks one rule, chosen by `fault`."""

    name = "broken"
    system_prompt = "Reply <answer>x</answer>."
    stop_strings = ("</answer>",)

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.calls = 0

    def tasks(self):
        return [Task(0, "?", ("x",))]

    def initial_state(self, task):
        return [] if self.fault == "unhashable" else ()

    def step(self, task, state, action_text):
        self.calls += 1
        if self.fault == "raises" and "<answer>" in action_text:
            raise KeyError("boom")
        if self.fault == "mutates":
            state.append(1) if isinstance(state, list) else None
        if self.fault == "random":
            return Transition(f"{random.random()}", False, None, None, state)
        if self.fault == "nan":
            return Transition("", True, math.nan, "answer", state)
        return Transition("", True, 1.0, "answer", state)


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("raises", "step raised KeyError"),
        ("random", "two different transitions"),
        ("nan", "a final reward must be finite"),
        ("unhashable", "unhashable list"),
    ],
)
def test_each_broken_rule_is_named(fault, named):
    problems = check_environment(Broken(fault))
    assert any(named in p for p in problems), problems


def test_a_step_that_changes_its_input_state_is_named():
    @dataclasses.dataclass
    class Box:  # mutable and unhashable-by-eq: the check sees the state change under it
        n: int = 0
        __hash__ = object.__hash__

    class Mutating(Broken):
        def initial_state(self, task):
            return Box()

        def step(self, task, state, action_text):
            state.n += 1
            return Transition("<observation>ok</observation>", False, None, None, state)

    problems = check_environment(Mutating("none"))
    assert any("changed the state it was given" in p for p in problems), problems


def test_the_example_trains_from_the_cli_as_the_guide_says(tmp_path):
    """docs/extending.md's commands, with the tiny model of `debug=fast` (one iteration)."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "trace_lightning.trainer", "debug=fast", "env=capitals", SEARCHPATH),
            *("trainer.max_epochs=1", "logger=none", f"output_root={tmp_path}", f"run_dir={tmp_path}/run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PYTHONPATH": str(EXAMPLE),
            "PATH": "/usr/bin:/bin",
            "HF_HUB_OFFLINE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
        },
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRACE summary: 1 iterations" in proc.stdout
    assert "capitals_env.CapitalsEnv" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()


def test_the_trainer_refuses_a_broken_user_environment_at_start_up():
    """What the runner cannot contain refuses the run; a step that raises only warns (the runner ends
    those episodes with env_error and goes on)."""
    from trace_lightning.trainer import check_env_at_start

    with pytest.raises(ValueError, match=r"env=broken breaks rules(.|\n)*two different transitions"):
        check_env_at_start(Broken("random"))
    with pytest.raises(ValueError, match=r"env=broken breaks rules(.|\n)*unhashable list"):
        check_env_at_start(Broken("unhashable"))
    with pytest.warns(
        UserWarning, match=r"env=broken has problems the runner contains(.|\n)*step raised KeyError"
    ):
        check_env_at_start(Broken("raises"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env_at_start(Broken("none"))  # a sound one passes


@pytest.mark.parametrize(
    ("fault", "held"), [("raises", True), ("nan", True), ("random", False), ("unhashable", False)]
)
def test_contained_problems_are_the_ones_the_runner_survives(fault, held):
    problems = check_environment(Broken(fault))
    assert problems and all(p.contained == held for p in problems), [(p, p.contained) for p in problems]
