"""Shared test helpers (plain functions; fixtures live in conftest.py)."""

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

from trace_lightning.advantages import TreeGRPO
from trace_lightning.budget import Budget
from trace_lightning.data import DataSettings, RolloutDataModule
from trace_lightning.engines.base import SamplingParams
from trace_lightning.models import build_policy
from trace_lightning.module import TraceModule
from trace_lightning.predictor import PredictorSettings

DDP_WORKER = Path(__file__).with_name("ddp_worker.py")


def quiet_trainer(**overrides) -> L.Trainer:
    """A CPU Trainer for one-iteration-per-epoch tests: no logger, checkpoints, bars or summary."""
    kwargs = {
        "max_epochs": 1,
        "reload_dataloaders_every_n_epochs": 1,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**kwargs, **overrides})


def run_ddp_worker(out: Path, *overrides: str) -> list[list[dict]]:
    """`tests/helpers/ddp_worker.py` on 2 CPU processes with this interpreter; what each rank recorded."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(DDP_WORKER), str(out), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def listening(port: int) -> set[str]:
    """The local addresses with a TCP socket in LISTEN state on `port`, read from /proc/net (the
    kernel's own table: IPv4 as little-endian hex, IPv6 as four little-endian words)."""
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(address)
            if width == 8:
                out.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                out.add(socket.inet_ntop(socket.AF_INET6, words))
    return out


def require_bwrap() -> None:
    """Skip where the python tool's jail cannot run here (bubblewrap missing, or no namespaces allowed), or
    where it refuses for want of a cgroup (a non-root user without cgroup delegation). In CI, which installs
    bubblewrap and runs as root, a missing or broken bubblewrap fails instead."""
    import pytest

    problem, cgroup = _jail_problem()
    if problem is not None:
        if os.environ.get("CI") and not cgroup:
            pytest.fail(f"{problem}; CI must provide a working bubblewrap (.ci/run installs it)")
        pytest.skip(problem)


def require_cgroup() -> None:
    """Skip where no cgroup can be made for a call (the tool refuses before it starts bwrap)."""
    import pytest

    from trace_lightning.envs.sandbox.cgroup import CgroupUnavailableError, call_group

    try:
        with call_group(64 * 2**20, 4):
            pass
    except CgroupUnavailableError as err:
        pytest.skip(f"the python tool refuses to run without a cgroup per call here: {err}")


@functools.cache
def _jail_problem() -> tuple[str | None, bool]:
    """(why the jail cannot run here, whether it is for want of a cgroup), or (None, False)."""
    import shutil

    from trace_lightning.envs.sandbox import SandboxLimits, check_sandbox
    from trace_lightning.envs.sandbox.cgroup import CgroupUnavailableError
    from trace_lightning.envs.sandbox.jail import JailUnavailableError

    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed: `apt-get install -y bubblewrap` (or `make system-deps`)", False
    try:
        check_sandbox(SandboxLimits())
    except CgroupUnavailableError as err:
        return f"the python tool refuses to run without a cgroup per call here: {err}", True
    except JailUnavailableError as err:
        return f"bubblewrap cannot build its jail here: {err}", False
    return None, False


# The head as the joint loss trains it (coef > 0 reads the prefix's last state): what most module tests check.
JOINT_HEAD = PredictorSettings.policy_state(
    width=16, coef=1.0, pooling="last", standardize=False, refit_steps=0
)
TEST_SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)


def trace_module(
    model_dir, optimizer=None, *, adapter=None, sampling=TEST_SAMPLING, predictor=JOINT_HEAD, **kw
):
    """A TraceModule on the policy in `model_dir` (AdamW lr 1e-2 unless `optimizer` is given)."""
    optimizer = optimizer or functools.partial(torch.optim.AdamW, lr=1e-2)
    return TraceModule(
        build_policy(model_dir, adapter), optimizer, sampling=sampling, predictor=predictor, **kw
    )


def rollout_data(
    env,
    allocator,
    engine,
    sampling=TEST_SAMPLING,
    leaves=12,
    max_tokens=None,
    *,
    estimator=TreeGRPO(),
    cold_start=None,
    selection=None,
    predictor_fit=None,
    seed=0,
    **settings,
):
    """A RolloutDataModule; `settings` are DataSettings fields (micro-batches by count unless given)."""
    settings = {"micro_batch_tokens": None, **settings}
    return RolloutDataModule(
        env,
        allocator,
        engine,
        sampling=sampling,
        budget=Budget(leaves, max_tokens),
        settings=DataSettings(**settings),
        estimator=estimator,
        cold_start=cold_start,
        selection=selection,
        predictor_fit=predictor_fit,
        seed=seed,
    )
