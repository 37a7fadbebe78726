"""What `callbacks.TreeArtifacts` writes for an iteration: its trees as JSON, one drawing and a table
of decoded samples. Plain functions of the report, so a benchmark or a notebook can write the same
files without a Trainer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_lightning.plots import draw_tree
from trace_lightning.tree import SUCCESS, RolloutTree, backup

if TYPE_CHECKING:  # the report is only read here
    from trace_lightning.report import IterationReport


def iteration_record(report: IterationReport) -> dict[str, Any]:
    """Everything needed to redraw or re-score the iteration later, as plain JSON."""
    res = report.result
    ledger = {"budget": vars(res.ledger.budget), "leaves": res.ledger.leaves, "tokens": res.ledger.tokens}
    ledger["tokens_by_depth"] = {str(d): n for d, n in sorted(res.ledger.tokens_by_depth.items())}
    return {
        "iteration": report.iteration,
        "used_prior": report.used_prior,
        "task_ids": [t.task_id for t in res.trees],
        "pool_predicted": res.pool_predicted.tolist(),
        "root_counts": res.root_counts.tolist(),
        "ledger": ledger,
        "trees": [t.to_dict() for t in res.trees],
    }


def tree_to_draw(trees: list[RolloutTree]) -> RolloutTree:
    """The mixed tree with the most leaves (the first on ties), else the tree with the most leaves."""
    mixed = [t for t in trees if backup(t, SUCCESS).mixed[0]]
    return max(mixed or trees, key=lambda t: len(t.leaves()))


def samples_markdown(trees: list[RolloutTree], tokenizer: Any, n: int = 4, chars: int = 300) -> str:
    """A table of the first bare rollout of the first `n` trees, response text cut to `chars`."""
    rows = ["| task | reward | stop | response |", "|---|---|---|---|"]
    for tree in [t for t in trees if t.leaves()][:n]:
        leaf = tree.nodes[min(tree.leaves())]
        text = tokenizer.decode(tree.token_ids(leaf.id)[len(tree.prompt_ids) :], skip_special_tokens=True)
        text = text[:chars].replace("|", "\\|").replace("\n", "<br>")
        rows.append(f"| {tree.task_id} | {leaf.reward:.2f} | {leaf.stop_reason} | {text} |")
    return "\n".join(rows) + "\n"


def write_artifacts(report: IterationReport, out_dir: Path, tokenizer: Any) -> list[tuple[str, Path]]:
    """Write the iteration's tree JSON, one tree drawing and the sample table; (folder, path) each."""
    stem = f"iteration_{report.iteration:04d}"
    (out_dir / "trees").mkdir(parents=True, exist_ok=True)
    (out_dir / "samples").mkdir(parents=True, exist_ok=True)
    record = out_dir / "trees" / f"{stem}.json"
    record.write_text(json.dumps(iteration_record(report)))
    out = [("trees", record)]
    if report.result.trees:
        out.append(("trees", draw_tree(tree_to_draw(report.result.trees), out_dir / "trees" / f"{stem}.png")))
        table = out_dir / "samples" / f"{stem}.md"
        table.write_text(samples_markdown(report.result.trees, tokenizer))
        out.append(("samples", table))
    return out
