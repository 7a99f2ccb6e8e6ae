"""Weights & Biases and MLflow: optional loggers (`train.loggers`) that receive the records of metrics.jsonl.

`MetricsWriter` (metrics.py) makes them on rank 0 only and hands each one every record it appends to
metrics.jsonl: every numeric field, at the record's `step` (evaluation records and the resume marker
too). Each tracker's run id is kept in RUN_DIR/trackers.json, so a resumed run (`--resume`) continues
the same W&B / MLflow run instead of starting another. The libraries are extras (`shardwise[wandb]`,
`shardwise[mlflow]`), imported inside functions; `check_installed` refuses a logger that is asked for
but missing, on every rank, before any step.

W&B honours its own environment (WANDB_MODE=offline, WANDB_API_KEY, WANDB_ENTITY; WANDB_PROJECT, else
project "shardwise"); its files go to RUN_DIR/wandb. MLflow logs to MLFLOW_TRACKING_URI, else
file:RUN_DIR/mlruns (a file store: MLFLOW_ALLOW_FILE_STORE is set to true unless set already, as MLflow 3
refuses it otherwise), in the experiment MLFLOW_EXPERIMENT_NAME, else the run directory's name.

A tracker that does not start (wandb.init or MLflow's first call fails: no login, a server out of reach)
raises TrackerError naming the logger, the run directory and the fix; MetricsWriter keeps it for the loop,
which stops every rank together. A tracker whose logging fails later is dropped with a warning (every
record is still in metrics.jsonl): raising on rank 0 alone would leave the other ranks waiting in their
next collective. `close(status)` ends each run as FINISHED, FAILED (training raised) or KILLED (stopped
by a signal): W&B with exit code 0 or 1 (a signal stop also marks it preempting), MLflow with that status.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError, ShardwiseError
from ..files import write_text_atomic
from ..untrusted import read_json_object

log = logging.getLogger(__name__)

MODULES = {"wandb": "wandb", "mlflow": "mlflow"}
EXTRAS = {"wandb": "pip install 'shardwise[wandb]'", "mlflow": "pip install 'shardwise[mlflow]'"}
IDS_FILE = "trackers.json"
MAX_IDS_FILE = 1 << 16
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
PARAM_CHARS = 500  # MLflow's smallest limit on a parameter's value (older servers); longer values are cut
PARAMS_PER_BATCH = 100  # MLflow's limit on the parameters of one log_batch call
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"  # how a run ended (MLflow's RunStatus names)
STATUSES = (FINISHED, FAILED, KILLED)


class TrackerError(ShardwiseError):
    """A tracker (W&B, MLflow) did not start; the message names the logger, the run directory and the fix."""


def check_installed(loggers: Sequence[str]) -> None:
    """Raise ConfigError naming the extra to install for each tracker in `loggers` that is not installed."""
    missing = [name for name in loggers if name in MODULES and importlib.util.find_spec(MODULES[name]) is None]
    if missing:
        raise ConfigError("; ".join(f"train.loggers asks for {name}, which is not installed: {EXTRAS[name]} "
                                    f"(or take {name} out of train.loggers)" for name in missing))


def numeric_fields(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric fields (booleans as 0/1) but `step`, as floats."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as {"section.key": text}, each text cut to PARAM_CHARS characters."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:PARAM_CHARS]
    return out


# --- the run ids of RUN_DIR ---------------------------------------------------------------------------------


def read_ids(run_dir: Path) -> dict[str, str]:
    """The tracker run ids kept in RUN_DIR/trackers.json ({} when there are none)."""
    path = run_dir / IDS_FILE
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        ids = read_json_object(path, ConfigError, limit=MAX_IDS_FILE)
    except ConfigError as e:  # damaged: a new run is no loss (metrics.jsonl holds every record)
        log.warning("%s; the trackers start new runs", e)
        return {}
    # Only the ids shardwise writes (W&B: 8 letters and digits; MLflow: 32 hex digits) go to a tracker.
    kept = {k: v for k, v in ids.items() if k in MODULES and isinstance(v, str) and _RUN_ID.fullmatch(v)}
    if len(kept) != len(ids):
        log.warning("%s holds entries that are not a tracker's run id; they are ignored", path)
    return kept


def keep_id(run_dir: Path, tracker: str, run_id: str) -> None:
    """Record a tracker's run id in RUN_DIR/trackers.json (beside the others)."""
    ids = read_ids(run_dir)
    if ids.get(tracker) != run_id:
        write_text_atomic(run_dir / IDS_FILE, json.dumps({**ids, tracker: run_id}, indent=1) + "\n")


# --- the trackers -------------------------------------------------------------------------------------------


class WandbTracker:
    """One W&B run per run directory: `resume` continues the run whose id RUN_DIR keeps. Records are logged
    against their `step` field (wandb.define_metric), so the steps a resumed run logs again after its
    checkpoint are kept rather than dropped as out of order."""

    name = "wandb"
    fix = ("log in (`wandb login`, or set WANDB_API_KEY), or set WANDB_MODE=offline to log into RUN_DIR/wandb and "
           "`wandb sync` later, or take wandb out of train.loggers")

    def __init__(self, run_dir: Path, config: Mapping[str, Any] | None, resume: bool) -> None:
        import wandb  # optional extra: shardwise[wandb]

        run_id = read_ids(run_dir).get("wandb") if resume else None
        run_id = run_id or uuid.uuid4().hex[:8]  # W&B ids: lower-case letters and digits
        keep_id(run_dir, "wandb", run_id)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardwise"), name=run_dir.name,
                              dir=str(run_dir), config=dict(config or {}), resume="allow", id=run_id)
        self.run_id = run_id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: Mapping[str, Any]) -> None:
        """Log the record's numeric fields with its step."""
        self.run.log({"step": record["step"], **numeric_fields(record)})

    def close(self, status: str = FINISHED) -> None:
        """Finish the run: exit code 0 when FINISHED, else 1; a signal stop (KILLED) is marked preempting."""
        if status == KILLED:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == FINISHED else 1)


class MlflowTracker:
    """One MLflow run per run directory, through MlflowClient (no global active run): parameters are the
    flattened config (logged when the run is created), metrics are logged at step=record["step"];
    `resume` reopens the run whose id RUN_DIR keeps."""

    name = "mlflow"
    fix = ("check that MLFLOW_TRACKING_URI names a server this process can reach (or unset it to log into "
           "RUN_DIR/mlruns), or take mlflow out of train.loggers")

    def __init__(self, run_dir: Path, config: Mapping[str, Any] | None, resume: bool) -> None:
        from mlflow.tracking import MlflowClient  # optional extra: shardwise[mlflow]

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.resolve() / "mlruns").as_uri()
        if self.uri.startswith("file:"):  # MLflow 3 refuses its file store (in maintenance) unless allowed
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        run_id = read_ids(run_dir).get("mlflow") if resume else None
        if run_id and self._exists(run_id):
            self.client.update_run(run_id, status="RUNNING")
        else:
            if run_id:
                log.warning("MLflow run %s (RUN_DIR/%s) is not in %s; starting a new run", run_id, IDS_FILE, self.uri)
            run_id = self._create(run_dir.name, config or {})
        self.run_id = run_id
        keep_id(run_dir, "mlflow", run_id)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def _create(self, name: str, config: Mapping[str, Any]) -> str:
        from mlflow.entities import Param

        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or name
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, v) for k, v in flatten(config).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=params[i:i + PARAMS_PER_BATCH])
        return run_id

    def write(self, record: Mapping[str, Any]) -> None:
        """Log the record's numeric fields at its step, in one batch."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(record["step"])) for k, v in numeric_fields(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = FINISHED) -> None:
        """End the run with `status` (FINISHED, FAILED or KILLED)."""
        self.client.set_terminated(self.run_id, status=status)


Tracker = WandbTracker | MlflowTracker
KINDS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(loggers: Sequence[str], run_dir: Path, config: Mapping[str, Any] | None,
                  resume: bool) -> list[Tracker]:
    """The trackers of `loggers` (tensorboard is not one of them: MetricsWriter writes it), opened. When one
    does not start, those opened before it are closed (FAILED) and TrackerError says which and the fix."""
    opened: list[Tracker] = []
    for name in loggers:
        if name not in KINDS:
            continue
        kind = KINDS[name]
        try:
            opened.append(kind(run_dir, config, resume))
        except Exception as exc:  # noqa: BLE001 - any failure to start is reported the same way, with its cause
            close_all(opened, FAILED, run_dir)
            raise TrackerError(f"train.loggers: {name} did not start for the run in {run_dir} "
                               f"({type(exc).__name__}: {exc}); {kind.fix.replace('RUN_DIR', str(run_dir))}") from exc
    return opened


def close_all(trackers: Sequence[Tracker], status: str, run_dir: Path) -> None:
    """Close each tracker's run with `status`; a failure is logged (naming the logger), not raised, so that it
    neither keeps the other trackers open nor replaces the error that ended training."""
    if status not in STATUSES:
        raise ValueError(f"tracker status {status!r}: one of {', '.join(STATUSES)}")
    for tracker in trackers:
        try:
            tracker.close(status)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("train.loggers: closing %s's run for %s failed (%s: %s); metrics.jsonl holds every record",
                        tracker.name, run_dir, type(exc).__name__, exc)
