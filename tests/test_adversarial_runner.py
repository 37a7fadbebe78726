"""Hostile model output against an ordinary user environment: what its tools make of the policy's text
must end only that episode, fit the episode's token bound, and never reach the metric logger unchecked.

A tool that parses its arguments with argparse exits (`SystemExit(2)`); one that echoes the JSON escape
`\\ud800` returns a lone surrogate the tokenizer refuses; one that echoes 4,000 characters of a 4-token
code point returns 16,000 tokens; one that holds the GIL returns only after its timeout; and a stop
reason such as `../../../etc/passwd` would become a metric key. Each runs one real iteration on the tiny
Qwen3 with the scripted engine of test_runner.py.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_metric
from test_runner import (
    MAX_EPISODE_TOKENS,
    SAMPLING,
    FaultyEnv,
    ScriptedEngine,
    assert_faulted,
    build,
    leaves_of,
    make_module,
)

from trace_lightning import runner as runner_module
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.envs.base import Transition
from trace_lightning.envs.calls import StepTimeout, call_with_timeout
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.iteration import Branch
from trace_lightning.metrics import _key_safe
from trace_lightning.module import TraceModule
from trace_lightning.runner import (
    TRUNCATION_MARK,
    EpisodeLimits,
    ReActRunner,
    stop_reason_key,
)

WIDE = "\U000f0000"  # a private-use code point: four bytes, four tokens in a byte-level BPE


@pytest.fixture
def module(tiny_model_dir: str) -> TraceModule:
    torch.manual_seed(0)
    return make_module(tiny_model_dir)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets abandoned hung steps finish when the test ends."""
    event = threading.Event()
    yield event
    event.set()


def held_gil() -> int:
    """~0.2 s in one C call (`sum` over a range never returns to the bytecode loop), so no other
    thread runs, and the runner's timed join cannot wake, until it is done."""
    return sum(range(10**7))


# --------------------------------------------------------------------------- the fault boundary


def argparse_tool(tr: Transition) -> Transition:
    parser = argparse.ArgumentParser(prog="lookup")
    parser.add_argument("--code", required=True)
    parser.parse_args(["--bogus"])
    return tr


def test_a_tool_that_exits_ends_only_its_episode_naming_the_env(module: TraceModule, capsys: Any):
    env = FaultyEnv(argparse_tool, when=lambda text: "B" in text)
    data, batches = build(module, env)
    n = assert_faulted(data, batches, module, "env_error")
    errors = data.report.counters.env_errors
    assert len(errors) == n == env.faults
    assert all(e.startswith("SystemExit: 2") and "env=chain" in e and "env.step" in e for e in errors)
    assert any(leaf.stop_reason != "env_error" for leaf in leaves_of(data))  # the others went on
    assert "usage: lookup" in capsys.readouterr().err


@pytest.mark.parametrize("step_timeout", [30.0, None], ids=["in_a_thread", "inline"])
def test_keyboard_interrupt_still_stops_the_run(module: TraceModule, step_timeout: float | None):
    def interrupted(tr: Transition) -> Transition:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(module, FaultyEnv(interrupted), step_timeout=step_timeout)


def test_a_lone_surrogate_in_an_observation_is_made_encodable(module: TraceModule):
    echo = json.loads('"\\ud800"')  # what a tool that echoes its JSON argument returns for this escape
    env = FaultyEnv(
        lambda tr: tr if tr.done else replace(tr, observation=f"<observation>{echo}</observation>")
    )
    data, _ = build(module, env)
    counters = data.report.counters
    assert env.faults and not counters.env_errors
    observed = [n.obs_ids for t in data.report.result.trees for n in t.nodes if n.obs_ids]
    assert observed and all("<observation>?</observation>" in module.tokenizer.decode(o) for o in observed)


def test_a_tokenizer_that_raises_on_an_observation_is_env_error(module: TraceModule, monkeypatch: Any):
    def refuse(tokenizer: Any, observation: str, action_ids: list[int]) -> Any:
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

    monkeypatch.setattr(runner_module, "observation_parts", refuse)
    data, batches = build(module, ChainEnv(n_tasks=24, turns=3, seed=0))
    n = assert_faulted(data, batches, module, "env_error")
    errors = data.report.counters.env_errors
    assert len(errors) == n and all(e.startswith("TypeError") and "observation" in e for e in errors)


# --------------------------------------------------------------------------- the token bound


class WideEnv(ChainEnv):
    """A user's environment whose tool returns 4,000 characters of a 4-token code point every turn."""

    def step(self, task: Any, state: Any, action_text: str) -> Transition:
        tr = super().step(task, state, action_text)
        return tr if tr.done else replace(tr, observation=WIDE * 4000)


def play(runner: ReActRunner, leaves: int = 8) -> list[Any]:
    """Every episode of `leaves` episodes over 4 tasks, played by `runner` as the collector does."""
    trees = [runner.new_tree(t) for t in list(runner.tasks)[:4]]
    ledger = BudgetLedger(Budget(leaves))
    ledger.reserve_leaves(leaves, "bare")
    runner([Branch(t, 0, leaves // 4, "bare") for t in trees], ledger, np.random.default_rng(0))
    return trees


@pytest.mark.parametrize("max_episode_tokens", [MAX_EPISODE_TOKENS, 768])
def test_no_episode_holds_more_tokens_than_max_episode_tokens(module: TraceModule, max_episode_tokens: int):
    tok = module.tokenizer
    assert len(tok(WIDE * 4000, add_special_tokens=False)["input_ids"]) >= 16_000  # the premise
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=max_episode_tokens)
    runner = ReActRunner(
        ScriptedEngine(None, tok), tok, WideEnv(n_tasks=8, turns=3, seed=0), SAMPLING, limits
    )
    trees = play(runner)
    for tree in trees:
        for leaf in tree.leaves():
            assert len(tree.token_ids(leaf)) - len(tree.prompt_ids) <= max_episode_tokens
    cut = [n.obs_ids for t in trees for n in t.nodes if n.obs_ids]
    assert cut and runner.counters.truncated_observations >= len(cut)
    for obs in cut:  # marked, and still closed by the template's next assistant header
        assert TRUNCATION_MARK in tok.decode(obs) and tok.decode(obs).endswith("<|im_start|>assistant\n")
    assert not {"env_error", "env_invalid", "env_timeout"} & set(runner.counters.stop_reasons)


def test_observations_never_run_past_the_models_context(module: TraceModule):
    tok = module.tokenizer
    env = WideEnv(n_tasks=8, turns=3, seed=0)
    context = len(runner_module.task_prompt_ids(tok, env, env.tasks()[0])) + 40
    tok.model_max_length = context  # the model's context, tighter here than max_episode_tokens
    runner = ReActRunner(ScriptedEngine(None, tok), tok, env, SAMPLING, EpisodeLimits(max_episode_tokens=768))
    for tree in play(runner):
        assert all(len(tree.token_ids(leaf)) <= context for leaf in tree.leaves())


# --------------------------------------------------------------------------- late returns


def test_a_call_that_holds_the_gil_past_its_timeout_times_out():
    with pytest.raises(StepTimeout, match="returned after"):
        call_with_timeout(held_gil, 0.01)
    assert call_with_timeout(lambda: 7, 5.0) == 7


def test_a_step_that_returned_late_is_env_timeout_not_a_win(module: TraceModule):
    def late_win(tr: Transition) -> Transition:
        held_gil()
        return replace(tr, done=True, reward=1.0, stop_reason="late_win")

    env = FaultyEnv(late_win, when=lambda text: "B" in text)
    data, batches = build(module, env, step_timeout=0.05)
    assert_faulted(data, batches, module, "env_timeout")
    counters = data.report.counters
    assert "late_win" not in counters.stop_reasons and counters.env_timeouts >= env.faults > 0


def test_abandoned_hung_steps_do_not_block(release: threading.Event):
    with pytest.raises(StepTimeout, match="did not return"):
        call_with_timeout(release.wait, 0.05)


# --------------------------------------------------------------------------- stop reasons as metric keys

HOSTILE_REASONS = ["r" * 260, "../../../etc/passwd", "retry//again", "max_steps/", "./x"]


def test_the_hostile_names_are_keys_mlflow_refuses():  # so the tests below are not vacuous
    for name in HOSTILE_REASONS:
        with pytest.raises(MlflowException):
            _validate_metric(f"rollout/stop/{name}", 1.0, 0, 0)


@pytest.mark.parametrize("normalise", [stop_reason_key, _key_safe], ids=["runner", "callbacks"])
def test_stop_reasons_become_keys_mlflow_accepts(normalise: Any):
    for name in [*HOSTILE_REASONS, "", "answer", "turn_cap", "world-cap"]:
        key = normalise(name)
        _validate_metric(f"rollout/stop/{key}", 1.0, 0, 0)  # raises on a key MLflow refuses
        assert 0 < len(key) <= 64
    assert normalise("answer") == "answer" and normalise("") == "env_invalid"
    assert normalise("../../../etc/passwd") == "_________etc_passwd"


def test_the_runner_normalises_an_environments_stop_reasons(module: TraceModule):
    names = iter(HOSTILE_REASONS * 10)
    env = FaultyEnv(lambda tr: replace(tr, done=True, reward=1.0, stop_reason=next(names)))
    data, _ = build(module, env)
    reasons = data.report.counters.stop_reasons
    assert set(reasons) <= {stop_reason_key(n) for n in HOSTILE_REASONS} and sum(reasons.values()) == 8
    for reason in reasons:
        _validate_metric(f"rollout/stop/{reason}", 1.0, 0, 0)
    assert all(leaf.reward == 1.0 for leaf in leaves_of(data))  # a verdict with an odd name still scores
