"""Pure drawings of rollout trees for the artifact callback (no Lightning, no logging).

The figure is built with matplotlib's object API (`Figure` renders through the Agg canvas by
itself), so nothing here switches the process-wide pyplot backend or keeps open figures around.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from trace_lightning.tree import SUCCESS, RolloutTree, backup

COLOURS = {"success": "#2ca02c", "failure": "#d62728", "mixed": "#ff7f0e", "open": "#9e9e9e"}
BASE_SIZE, PREDICTED_SIZE = 40.0, 260.0  # marker area: base plus predicted p times this


def layout(tree: RolloutTree) -> np.ndarray:
    """Top-down positions [n_nodes, 2]: childless nodes spread evenly left to right in depth-first
    order, each parent centred over its children, depth going downwards (y = -depth)."""
    xy = np.zeros((len(tree.nodes), 2))
    slot = 0
    stack = [0]
    while stack:  # depth-first, children in creation order, so sibling subtrees never cross
        node = tree.nodes[stack.pop()]
        xy[node.id, 1] = -node.depth
        if not node.children:
            xy[node.id, 0], slot = slot, slot + 1
        stack.extend(reversed(node.children))
    for node in reversed(tree.nodes):  # children have larger ids: reverse order is bottom-up
        if node.children:
            xy[node.id, 0] = float(np.mean(xy[node.children, 0]))
    return xy


def outcome_colours(tree: RolloutTree, success_threshold: float = SUCCESS) -> list[str]:
    """Per node: green if every leaf below succeeded, red if all failed, orange if mixed, grey if none."""
    b = backup(tree, success_threshold)
    out = []
    for n in range(len(tree.nodes)):
        if b.leaves[n] == 0:
            out.append(COLOURS["open"])
        elif b.mixed[n]:
            out.append(COLOURS["mixed"])
        else:
            out.append(COLOURS["success"] if b.successes[n] == b.leaves[n] else COLOURS["failure"])
    return out


def draw_tree(tree: RolloutTree, path: str | Path, success_threshold: float = SUCCESS) -> Path:
    """Draw `tree` to a PNG at `path`: outcome colours, marker size from the predicted p where the
    predictor scored the node, expansion-stage nodes outlined in blue with dashed edges."""
    xy = layout(tree)
    width = float(np.clip(0.35 * (xy[:, 0].max() + 1), 4.0, 30.0))
    height = float(np.clip(1.0 * (-xy[:, 1].min() + 1), 3.0, 16.0))
    fig = Figure(figsize=(width, height), dpi=100)
    ax = fig.add_subplot()
    for node in tree.nodes[1:]:
        (px, py), (cx, cy) = xy[node.parent], xy[node.id]
        style = "--" if node.stage == "expand" else "-"
        ax.plot([px, cx], [py, cy], style, color="#757575", linewidth=0.8, zorder=1)
    sizes = [BASE_SIZE + PREDICTED_SIZE * (n.predicted or 0.0) for n in tree.nodes]
    edges = ["#1f4fff" if n.stage == "expand" else "black" for n in tree.nodes]
    widths = [2.0 if n.stage == "expand" else 0.6 for n in tree.nodes]
    colours = outcome_colours(tree, success_threshold)
    ax.scatter(xy[:, 0], xy[:, 1], s=sizes, c=colours, edgecolors=edges, linewidths=widths, zorder=2)
    value = backup(tree, success_threshold).value[0]
    ax.set_title(f"task {tree.task_id}: {len(tree.leaves())} leaves, root V̂ = {value:.2f}", fontsize=9)
    ax.set_ylabel("depth (turns)")
    depths = sorted({n.depth for n in tree.nodes})
    ax.set_yticks([-d for d in depths], [str(d) for d in depths])
    ax.set_xticks([])
    ax.legend(handles=_legend(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def _legend() -> list[Line2D]:
    dots = [
        Line2D([], [], marker="o", linestyle="", color=colour, label=name) for name, colour in COLOURS.items()
    ]
    return [*dots, Line2D([], [], linestyle="--", color="#1f4fff", label="expand stage")]
