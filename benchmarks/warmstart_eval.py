"""Held-out success and turns of a policy on search_qa or math_tool, before and after the warm start.

.venv/bin/python benchmarks/warmstart_eval.py                               # SmolLM2 as shipped
.venv/bin/python benchmarks/warmstart_eval.py --model outputs/warmstart/<run>/model
.venv/bin/python benchmarks/warmstart_eval.py --model gemma3_270m           # Gemma 3 270M base

The held-out tasks are those `python -m trace_lightning.warmstart` never trains on (same seed and
`--held-out`). Each is played `--samples` times with the transformers engine at temperature 0.8, the
same sampling seed for every model (a paired comparison). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from trace_lightning.budget import Budget, BudgetLedger
from trace_lightning.engines.base import SamplingParams
from trace_lightning.engines.hf import HFEngine
from trace_lightning.envs.math_tool import MathToolEnv
from trace_lightning.envs.search_qa import SearchQAEnv
from trace_lightning.iteration import Branch
from trace_lightning.models import build_policy, prepare_gemma3, prepare_smollm2
from trace_lightning.runner import EpisodeLimits, ReActRunner
from trace_lightning.tree import SUCCESS
from trace_lightning.warmstart import split_tasks

SHIPPED = {"smollm2": prepare_smollm2, "gemma3_270m": prepare_gemma3}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2", help=f"a model folder, or a shipped model: {', '.join(SHIPPED)}"
    )
    parser.add_argument("--env", choices=["search_qa", "math_tool"], default="search_qa")
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    env = (
        SearchQAEnv(reward="f1", untagged_reply="answer")
        if args.env == "search_qa"
        else MathToolEnv(seed=args.seed)
    )
    _, held = split_tasks([t.task_id for t in env.tasks()], args.held_out, args.seed)
    path = SHIPPED[args.model]() if args.model in SHIPPED else args.model
    loading = time.perf_counter()
    model, tokenizer = build_policy(path)
    load_seconds = time.perf_counter() - loading
    model.eval()
    runner = ReActRunner(
        HFEngine(model, tokenizer), tokenizer, env, SamplingParams(48, 0.8, 1.0), EpisodeLimits(3, 768)
    )
    trees = [runner.new_tree(t) for t in sorted(held)]
    ledger = BudgetLedger(Budget(len(trees) * args.samples))
    ledger.reserve_leaves(len(trees) * args.samples, "bare")
    torch.manual_seed(args.seed + 1)
    start = time.perf_counter()
    runner([Branch(t, 0, args.samples, "bare") for t in trees], ledger, np.random.default_rng(0))
    leaves = [t.nodes[leaf] for t in trees for leaf in t.leaves()]
    per_task = [float(np.mean([t.nodes[leaf].reward >= SUCCESS for leaf in t.leaves()])) for t in trees]
    result = {
        "model": args.model,
        "env": args.env,
        "held_out_task_ids": sorted(held),
        "samples": args.samples,
        "success": float(np.mean(per_task)),
        "success_se": float(np.std(per_task, ddof=1) / np.sqrt(len(per_task))),
        "turns_mean": float(np.mean([leaf.depth for leaf in leaves])),
        "tool_calls": runner.counters.tool_calls,
        "stop_reasons": dict(runner.counters.stop_reasons),
        "seconds": round(time.perf_counter() - start, 1),
        "seconds_per_episode": round((time.perf_counter() - start) / len(leaves), 2),
        "load_seconds": round(load_seconds, 1),  # the cached HF folder; the one-off conversion is not counted
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
