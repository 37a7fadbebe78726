"""Hostile model output against ordinary user environments, measured through the product's own paths:
`python benchmarks/hostile_envs.py` (about a minute on 2 cores).

1. Training: `debug=fast` (the CLI's `build` and `fit`, 2 iterations) with a user environment whose
   tool exits like argparse on bad arguments (`SystemExit(2)`), one that echoes the JSON escape
   `\\ud800` (a lone surrogate), and one that returns 4,000 characters of a 4-token code point. Prints
   whether the fit finished, the episodes by stop reason, and the longest episode in tokens against
   `data.max_episode_tokens`.
2. The checker's command line (`python -m trace_lightning.check`) on those environments and on one
   whose step never returns: its exit status, its wall time and the problems it names.
3. A typed tool called with the schema-violating arguments `{"a": "x" * 15000, "b": 80000}`: the time
   to its tool-error observation and the process's memory growth over 1,000 calls.

Writes benchmarks/results/hostile_envs.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning as L
from hydra import compose, initialize_config_dir

from trace_lightning import config
from trace_lightning import trainer as cli
from trace_lightning.envs.base import Task, Transition
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.envs.tools import ToolEnv

OUT = Path(__file__).with_name("results") / "hostile_envs.json"
WIDE = "\U000f0000"  # a private-use code point: four bytes, four tokens in a byte-level BPE


class ArgparseEnv(ChainEnv):
    """A tool that parses the policy's text with argparse: an odd-length action is a bad argument."""

    name = "argparse_tool"

    def step(self, task: Any, state: Any, action_text: str) -> Transition:
        if len(action_text) % 2:
            parser = argparse.ArgumentParser(prog="lookup")
            parser.add_argument("--code", required=True)
            parser.parse_args(action_text.split())  # SystemExit(2): --code is missing
        return super().step(task, state, action_text)


class EchoEnv(ChainEnv):
    """A tool that echoes its JSON argument: the escape `\\ud800` becomes a lone surrogate."""

    name = "echo_tool"

    def step(self, task: Any, state: Any, action_text: str) -> Transition:
        tr = super().step(task, state, action_text)
        echo = json.loads('"\\ud800"')
        return tr if tr.done else replace(tr, observation=f"<observation>{echo}{action_text}</observation>")


class WideEnv(ChainEnv):
    """A tool that returns 4,000 characters of a 4-token code point every turn."""

    name = "wide_tool"

    def step(self, task: Any, state: Any, action_text: str) -> Transition:
        tr = super().step(task, state, action_text)
        return tr if tr.done else replace(tr, observation=WIDE * 4000)


class HangingEnv(ChainEnv):
    """A step that never returns."""

    name = "hanging_tool"

    def step(self, task: Any, state: Any, action_text: str) -> Transition:
        time.sleep(10**6)
        raise AssertionError("unreachable")


class Record(L.Callback):
    """Every iteration's episodes: stop reasons and their length in tokens after the prompt."""

    def __init__(self) -> None:
        self.stops: Counter[str] = Counter()
        self.longest = 0
        self.iterations = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = trainer.datamodule.report  # type: ignore[attr-defined]
        self.iterations += 1
        for tree in report.local_trees:
            for leaf in tree.leaves():
                self.stops[str(tree.nodes[leaf].stop_reason)] += 1
                self.longest = max(self.longest, len(tree.token_ids(leaf)) - len(tree.prompt_ids))


def train(env: str, out: Path) -> dict[str, Any]:
    config.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "debug=fast",
                f"output_root={out}",
                f"run_dir={out}/{env}",
                "logger=none",
                "~callbacks.progress",
                f"env._target_=hostile_envs.{env}",
            ],
        )
    module, data, trainer = cli.build(cfg)
    record = Record()
    trainer.callbacks.append(record)
    t0 = time.perf_counter()
    try:
        trainer.fit(module, datamodule=data)
        finished = trainer.current_epoch == cfg.trainer.max_epochs
    except BaseException as err:  # what ended the fit is the measurement
        finished = False
        record.stops[f"fit raised {type(err).__name__}"] += 1
    return {
        "finished": finished,
        "iterations": record.iterations,
        "seconds": round(time.perf_counter() - t0, 1),
        "stop_reasons": dict(record.stops),
        "longest_episode_tokens": record.longest,
        "max_episode_tokens": int(cfg.data.max_episode_tokens),
    }


def check(env: str) -> dict[str, Any]:
    here = Path(__file__).parent
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trace_lightning.check", f"env._target_=hostile_envs.{env}", "env=chain"],
        env={**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    problems = [line[2:] for line in proc.stdout.splitlines() if line.startswith("- ")]
    return {
        "exit": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "problems": [p[:160] for p in problems],
        "stderr_tail": proc.stderr[-300:] if proc.returncode not in (0, 1) else "",
    }


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def schema_violation(calls: int = 1000) -> dict[str, Any]:
    tasks = [Task(0, "What is 6 times 7?", ("42",))]
    env = ToolEnv((multiply,), tasks, lambda task, reply: float(reply == "42"))
    task = env.tasks()[0]
    state = env.initial_state(task)
    call = {"name": "multiply", "arguments": {"a": "x" * 15000, "b": 80000}}
    action = f"<tool_call>{json.dumps(call)}</tool_call>"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        tr = env.step(task, state, action)
        times.append(time.perf_counter() - t0)
    first = times[0]  # includes building jsonschema's validator for the tool
    times.sort()
    return {
        "first_ms": round(1000 * first, 3),
        "observation": tr.observation[:200],
        "done": tr.done,
        "median_ms": round(1000 * times[len(times) // 2], 3),
        "max_ms": round(1000 * times[-1], 3),
        "peak_rss_growth_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before, 1),
        "calls": calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # `hostile_envs.<Env>` as Hydra targets
    results: dict[str, Any] = {"schema_violation": schema_violation()}
    print("schema-violating multiply:", json.dumps(results["schema_violation"]))
    with TemporaryDirectory() as tmp:
        results["train"] = {env: train(env, Path(tmp)) for env in ("ArgparseEnv", "EchoEnv", "WideEnv")}
    for env, row in results["train"].items():
        print(f"debug=fast with {env}: {json.dumps(row)}")
    results["check"] = {env: check(env) for env in ("ArgparseEnv", "EchoEnv", "WideEnv", "HangingEnv")}
    for env, row in results["check"].items():
        print(f"check {env}: exit {row['exit']} in {row['seconds']} s")
        for p in row["problems"]:
            print(f"    - {p}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
