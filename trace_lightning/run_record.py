"""The MLflow side of a run's life: who is running it, what happens when it dies, and resuming it.

Each start writes `<run_dir>/process.json` (pid, host, MLflow run id and store). A process killed with
SIGKILL cannot tell MLflow it stopped, so its run stays RUNNING; the next start in the same run_dir
finds the record, sees that the pid is gone and marks the run KILLED (`close_dead_run`). That covers a
run killed before its first checkpoint, which no resume would ever reopen.

`ResumableMLFlowLogger` continues a run across resumes, also into a new or moved run_dir:
- MLflow params are write-once, and some change on resume (the tiny model lives under run_dir, so
  `model_path` moves with it). A param already logged keeps its first value; a changed one is kept as
  the tag `resumed/<key>`, instead of MLflow's "Changing param values" error.
- A kill mid-iteration has logged steps past the checkpoint the run resumes from; resume is exact, so
  the resumed run logs the same steps again. A (metric, step) already in the run is not logged twice,
  which keeps one value per metric and step (also for Lightning's `epoch`, which it logs twice at an
  epoch's last step: with the step metrics and with the epoch metrics, the same value).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from trace_lightning.checkpoints.files import pid_alive, write_atomic

RECORD = "process.json"


def _rank() -> int:
    """The global rank Lightning read from the environment (0 outside multi-process training)."""
    return int(getattr(rank_zero_only, "rank", 0))


def write_record(run_dir: Path, mlflow_run_id: str | None, tracking_uri: str | None) -> None:
    """Who runs `run_dir` now (rank zero only: it is the process that owns the MLflow run)."""
    if _rank() != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "mlflow_run_id": mlflow_run_id}
    write_atomic(run_dir / RECORD, json.dumps({**record, "tracking_uri": tracking_uri}).encode())


def close_dead_run(run_dir: Path) -> str | None:
    """Mark the MLflow run of a dead process KILLED; the run id it closed, or None."""
    path = run_dir / RECORD
    if _rank() != 0 or not path.is_file():
        return None
    record = json.loads(path.read_text())
    run_id, uri = record.get("mlflow_run_id"), record.get("tracking_uri")
    if run_id is None or record.get("host") != socket.gethostname() or pid_alive(int(record["pid"])):
        return None  # no MLflow run, another host's process (cannot be checked), or still running
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    if not _run_exists(client, run_id) or client.get_run(run_id).info.status != "RUNNING":
        return None
    client.set_terminated(run_id, status="KILLED")
    rank_zero_warn(f"MLflow run {run_id} of {run_dir} was left RUNNING by a dead process: marked KILLED")
    return str(run_id)


def _run_exists(client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException:
        return False
    return True


def run_in_store(tracking_uri: str, run_id: str) -> bool:
    """Whether the store holds this run (a run_dir moved under another output_root has a new store)."""
    from mlflow.tracking import MlflowClient

    return _run_exists(MlflowClient(tracking_uri), run_id)


class ResumableMLFlowLogger(MLFlowLogger):
    """Lightning's MLFlowLogger that a resumed run can continue without errors or duplicate steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logged_upto: dict[str, int] | None = None  # metric -> last step already in the run

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        params = _flatten_dict(_convert_params(params))
        existing = self.experiment.get_run(self.run_id).data.params
        new = {k: v for k, v in params.items() if k not in existing}
        changed = {k: v for k, v in params.items() if k in existing and str(v)[:250] != existing[k]}
        for key, value in changed.items():
            self.experiment.set_tag(self.run_id, f"resumed/{key}", str(value)[:5000])
        if new:
            super().log_hyperparams(new)

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        upto, step = self._steps_already_logged(), step or 0
        fresh = {k: v for k, v in metrics.items() if step > upto.get(self._prefixed(k), -1)}
        upto.update({self._prefixed(k): step for k in fresh})
        if fresh:
            super().log_metrics(fresh, step)

    def _prefixed(self, key: str) -> str:
        return f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key

    def _steps_already_logged(self) -> dict[str, int]:
        """Read once per process: the last step of every metric the run holds (empty for a new run)."""
        if self._logged_upto is None:
            client, run_id = self.experiment, self.run_id
            keys = client.get_run(run_id).data.metrics
            self._logged_upto = {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in keys}
        return self._logged_upto


# MLflow 3's UI has two views, GenAI (runs listed as "Evaluation runs", traces first) and Model
# training. Its UIs before 3.17 chose by this experiment tag ("custom_model_development" is what their
# "Model training" choice writes); 3.17.2's UI ignores the tag and follows its sidebar switch, which
# a link sets with `?workflowType=machine_learning` (checked in headless Chromium, tests/test_mlflow_ui.py).
# So we tag the experiment and print links that carry the parameter.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def mark_model_training(logger: Any) -> None:
    """Tag the MLflow experiment as one for model training (the marker MLflow 3 UIs before 3.17 read)."""
    if isinstance(logger, MLFlowLogger) and logger.experiment_id is not None:
        logger.experiment.set_experiment_tag(logger.experiment_id, *EXPERIMENT_KIND)
