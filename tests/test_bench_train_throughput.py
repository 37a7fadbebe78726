import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_throughput_quick_mode(tmp_path):
    out = tmp_path / "train_throughput.json"
    subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py", "--quick", "--reps", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.read_text())
    for allocator in ("trace", "uniform"):
        row = result[allocator]
        assert row["leaves"] == 12
        # each leaf repeats its prompt per-leaf; packed, the trees' shared tokens are computed once
        assert row["packed"]["tokens"]["real"] < row["per_leaf"]["tokens"]["real"]
        assert row["per_leaf"]["train_seconds"] > 0 and row["packed"]["train_seconds"] > 0
    assert result["packed_speedup"] == result["trace"]["train_speedup"] > 0
    assert result["grad_max_rel_diff"] <= 1e-4
    check = result["grad_check"]
    assert abs(check["loss_packed"] - check["loss_per_leaf"]) <= 1e-5 * max(1.0, abs(check["loss_per_leaf"]))
    assert "vs_trl" not in result  # quick mode runs no TRL
