"""Why did active root allocation not help in benchmarks/learning.py? Can the online predictor head
tell the candidate prompts apart at all?

    .venv/bin/python benchmarks/head_diagnosis.py                          # seed 0, 30 iterations (~2 min)
    .venv/bin/python benchmarks/head_diagnosis.py --predictor-lr 1e-2      # the same with a 10x head lr
    .venv/bin/python benchmarks/head_diagnosis.py --refit-steps 100        # + a head refit on replayed roots
    .venv/bin/python benchmarks/head_diagnosis.py --quick                  # the test suite runs this

learning.py's setting (its defaults: chain task, 32 tasks, warm start to success 0.45, 24 leaves per
iteration, pool 16), one seed, `trace` and `uniform` from the same warm start. Every 5 iterations it
prints the spread (std) of the head's root predictions over the candidate pool, their mean, and the
bias (predicted minus realised success) on the prompts that got rollouts; at the end, how many
distinct tasks each method trained on and its evaluation success. JSON next to learning.json.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import tempfile
from pathlib import Path

import learning
import numpy as np
import torch

from trace_lightning import allocation as alloc
from trace_lightning.envs.chain import ChainEnv
from trace_lightning.models import build_tiny_model
from trace_lightning.module import TraceModule


def refit_head(module: TraceModule, replay: collections.deque, steps: int) -> None:
    """`steps` head-only AdamW steps on the replayed roots: hidden state at each prompt's last token
    under the current policy, target its realised success, weight its leaf count."""
    prompts = [p for p, _, _ in replay]
    with torch.no_grad():
        hidden, offset = module._scoring_hidden(prompts, min(len(p) for p in prompts) - 1)
        rows = torch.arange(len(prompts))
        cols = torch.tensor([len(p) - 1 for p in prompts]) - offset
        features = hidden[rows, cols]  # [R, H]
    target = torch.tensor([v for _, v, _ in replay], dtype=torch.float32)
    weight = torch.tensor([w for _, _, w in replay], dtype=torch.float32)
    opt = torch.optim.AdamW(module.head.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = (weight * (torch.sigmoid(module.head(features)) - target) ** 2).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def run(name: str, allocator, model_dir: str, warm, env, args, predictor_lr: float, refit: int) -> dict:
    torch.manual_seed(args.seed)
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr)
    module = TraceModule(model_dir, optimizer, predictor_width=64, predictor_lr=predictor_lr)
    module.policy.load_state_dict(warm)
    data = learning.make_data(allocator, args.leaves, env, args, args.seed)
    opt = module.configure_optimizers()
    picked: collections.Counter[int] = collections.Counter()
    replay: collections.deque = collections.deque(maxlen=10 * args.pool)  # about 10 iterations of roots
    rows = []
    for it in range(1, args.iterations + 1):
        learning.train_iteration(module, data, opt, it)
        row = learning.iteration_row(data) | {"iteration": it}
        picked.update(t.task_id for t in data.report.result.trees)
        if refit:
            for t in data.report.result.trees:
                won = [t.nodes[x].reward >= 0.5 for x in t.leaves()]
                replay.append((t.prompt_ids, float(np.mean(won)), float(len(won))))
            refit_head(module, replay, refit)
        rows.append(row | {"pool_pred_mean": float(np.mean(data.report.result.pool_predicted))})
        if it % 5 == 0 or it == args.iterations:
            print(
                f"  {name:8s} it {it:3d}: pool prediction mean {rows[-1]['pool_pred_mean']:.3f} "
                f"std {row['pool_pred_sd']:.4f}; bias on sampled prompts {row['root_pred_bias']:+.3f}",
                flush=True,
            )
    success = learning.evaluate(module, env, args, args.seed)
    print(f"  {name}: {len(picked)} distinct tasks, most sampled {picked.most_common(3)}; eval {success:.3f}")
    return {"method": name, "rows": rows, "distinct_tasks": len(picked), "eval_success": success}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--predictor-lr", type=float, default=1e-3, help="TraceModule's default is 1e-3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--refit-steps",
        type=int,
        default=0,
        help="after each iteration, this many head-only steps on ~10 iterations of replayed roots",
    )
    p.add_argument("--quick", action="store_true", help="2 iterations, a short warm start")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/head_diagnosis.json"))
    own, rest = p.parse_known_args()
    args = learning.parse_args(rest)  # learning.py's task, warm start and training settings
    args.iterations, args.seed = own.iterations, own.seed
    if own.quick:
        args.iterations, args.sft_steps, args.sft_min, args.eval_samples = 2, 25, 25, 1
    torch.set_num_threads(2)
    env = ChainEnv(n_tasks=args.tasks, turns=args.turns, n_choices=args.choices, seed=args.seed)
    model_dir = tempfile.mkdtemp()
    build_tiny_model(model_dir, hidden_size=args.hidden, layers=args.layers, seed=args.seed)
    torch.manual_seed(args.seed)
    warm_module = TraceModule(model_dir, functools.partial(torch.optim.AdamW, lr=args.lr), predictor_width=64)
    warm_info = learning.warm_start(warm_module, env, args, args.seed)
    print(f"warm start: {warm_info}")
    warm = {k: v.clone() for k, v in warm_module.policy.state_dict().items()}
    methods = {
        "trace": alloc.trace(args.expansion, max_per_prompt=args.max_per_prompt),
        "uniform": alloc.uniform(4),
    }
    runs = [
        run(n, a, model_dir, warm, env, args, own.predictor_lr, own.refit_steps) for n, a in methods.items()
    ]
    own.out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "predictor_lr": own.predictor_lr,
        "refit_steps": own.refit_steps,
        "iterations": args.iterations,
        "seed": args.seed,
    }
    own.out.write_text(json.dumps({"config": config, "warm_start": warm_info, "runs": runs}, indent=1))
    print(f"wrote {own.out}")


if __name__ == "__main__":
    main()
