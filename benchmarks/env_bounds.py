"""What the environments' bounds cost and stop, measured: `python benchmarks/env_bounds.py`.

BFCL runs model-written calls in the trainer's own process, so its bounds are the ones that matter:
- the simulated world: how large the ground truth's worlds get (every entry of every subset), and how
  many calls a policy needs to grow a world to the cap by copying a folder into itself, with the
  largest step's time and the process's peak memory on the way;
- the arguments: how long the refusal of a call that would hold the GIL takes;
- the cost of the guards: replaying every ground-truth call, per call.
And for every shipped environment, the slowest step over the hostile outputs of the default suite's
adversarial tests. Writes benchmarks/results/env_bounds.json (`--out` elsewhere); about 3 s.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

from trace_lightning.envs.bfcl import BFCLEnv
from trace_lightning.envs.bfcl import world as bfcl_world
from trace_lightning.envs.bfcl.data import SUBSETS, load_entries
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.search_qa import SearchQAEnv

OUT = Path(__file__).with_name("results") / "env_bounds.json"


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ground_truth() -> dict[str, Any]:
    """The largest world and result each subset's ground truth builds, and the replay's cost per call."""
    out: dict[str, Any] = {}
    for subset in SUBSETS:
        replay, worlds, results, n_calls = bfcl_world.Replay(4), [], [], 0
        began = time.perf_counter()
        for entry in load_entries(subset):
            calls = tuple(c for turn in entry.ground_truth for c in turn)
            instances, outputs = replay.after(entry, calls)
            n_calls += len(calls)
            worlds.append(bfcl_world.world_size(instances, 10**7))
            results.append(max(map(len, outputs), default=0))
        seconds = time.perf_counter() - began
        out[subset] = {
            "max_world_chars": max(worlds),
            "max_result_chars": max(results),
            "calls": n_calls,
            "ms_per_call": round(1000 * seconds / n_calls, 3),
        }
    return out


def growth() -> dict[str, Any]:
    """`cp d<k> d<k+1>` twice doubles the listing of the file system: how far it gets before the cap."""
    env = BFCLEnv("base", max_calls_per_turn=200)
    task = next(t for t in env.tasks() if "cp" in bfcl_world.owners(env.entries[t.task_id]))
    actions = [
        call("mkdir", dir_name="d0"),
        call("cd", folder="d0"),
        call("touch", file_name="f"),
        call("cd", folder=".."),
    ]
    for k in range(40):
        actions += [call("cp", source=f"d{k}", destination=f"d{k + 1}")] * 2
    state, slowest, before, n = env.initial_state(task), 0.0, peak_mb(), 0
    for action in actions:
        n += 1
        began = time.perf_counter()
        tr = env.step(task, state, action)
        slowest = max(slowest, time.perf_counter() - began)
        if tr.done:
            break
        state = tr.state
    return {
        "calls_until_end": n,
        "stop_reason": tr.stop_reason,
        "reward": tr.reward,
        "slowest_step_ms": round(1000 * slowest, 1),
        "peak_rss_mb_before": round(before, 1),
        "peak_rss_mb_after": round(peak_mb(), 1),
        "cap_chars": env.replay.max_world_chars,
    }


def refusals() -> dict[str, float]:
    """Milliseconds to answer each call that would otherwise hold the GIL for seconds to hours."""
    env = BFCLEnv("base")
    task = next(t for t in env.tasks() if "MathAPI" in env.entries[t.task_id].classes)
    out = {}
    for label, name, arguments in [
        ("power 2**(10**9)", "power", {"base": 2, "exponent": 10**9}),
        ("square_root to 10**8 places", "square_root", {"number": 2, "precision": 10**8}),
        ("round_number to -(10**9) places", "round_number", {"number": 12345, "decimal_places": -(10**9)}),
    ]:
        began = time.perf_counter()
        tr = env.step(task, env.initial_state(task), call(name, **arguments))
        assert tr.tool_error, tr.observation
        out[label] = round(1000 * (time.perf_counter() - began), 2)
    return out


def hostile_steps() -> dict[str, float]:
    """The slowest step, in ms, over hostile outputs in each tag of each shipped environment."""
    outputs = {
        "megabyte": lambda tag: f"<{tag}>" + "x" * 1_000_000 + f"</{tag}>",
        "flood": lambda tag: f"<{tag}>1</{tag}>" * 10_000,
        "deep": lambda tag: f'<{tag}>{{"name": "x", "arguments": {{"v": {"[" * 990 + "]" * 990}}}}}</{tag}>',
        "huge_int": lambda tag: f"<{tag}>{'9' * 5000}</{tag}>",
        "power_tower": lambda tag: f"<{tag}>9**9**9**9</{tag}>",
    }
    envs = {
        "search_qa": SearchQAEnv(),
        "math_tool": MathToolEnv(n_tasks=4, difficulty=2),
        "bfcl": BFCLEnv("base"),
        "chain": ChainEnv(n_tasks=4),
    }
    out = {}
    for name, env in envs.items():
        task, slowest = next(iter(env.tasks())), 0.0
        tags = [s.strip("</>") for s in env.stop_strings]
        env.step(task, env.initial_state(task), f"<{tags[0]}>1</{tags[0]}>")  # loads a search index once
        for tag in tags:
            for make in outputs.values():
                began = time.perf_counter()
                env.step(task, env.initial_state(task), make(tag))
                slowest = max(slowest, time.perf_counter() - began)
        out[name] = round(1000 * slowest, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes")
    args = parser.parse_args()
    result = {
        "ground_truth": ground_truth(),
        "growth": growth(),
        "refusal_ms": refusals(),
        "hostile_slowest_step_ms": hostile_steps(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
