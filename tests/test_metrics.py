"""The pure room for the numbers: `metrics.py` loads no Lightning (and no torch at import), and the
budget-unit vocabulary has one definition that `compare` reads. The metric values themselves are
checked on hand-built trees in test_callbacks.py and test_console.py."""

import os
import subprocess
import sys
from pathlib import Path

from test_callbacks import make_report

from trace_lightning import compare, metrics
from trace_lightning.tree import SUCCESS, tree_stats

ROOT = Path(__file__).parents[1]


def test_importing_metrics_loads_no_lightning_and_no_torch():
    heavy = ("lightning", "pytorch_lightning", "torch", "torchmetrics")
    code = f"import sys, trace_lightning.metrics; print(sorted(m for m in {heavy} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, whatever is installed
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=env
    )
    assert loaded.stdout.strip() == "[]"


def test_compare_plots_against_exactly_the_budget_units():
    assert list(compare.UNITS) == list(metrics.BUDGET_UNITS)
    assert compare.UNITS["tool_calls"] == "budget/tool_calls"


def test_the_shares_the_console_and_the_logs_share():
    # test_callbacks' report: a mixed tree (3 leaves, 1 win, mixed at its root and at prefix 1) and
    # a failed one (2 leaves); leaf depths 2, 1, 2, 1, 1
    trees = make_report().result.trees
    stats = [tree_stats(t, SUCCESS) for t in trees]
    assert (metrics.success_rate(trees), metrics.turns_mean(trees)) == (0.2, 1.4)
    assert metrics.effective_ratio(stats) == 0.5
    assert (metrics.mixed_roots(stats), metrics.mixed_prefixes(stats)) == (1, 1)
    assert (metrics.success_rate([]), metrics.turns_mean([]), metrics.effective_ratio([])) == (0.0, 0.0, 0.0)
