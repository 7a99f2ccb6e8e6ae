"""train.loggers: W&B (offline) and MLflow (a file: store in tmp) get the same records as metrics.jsonl, a
resumed run continues the same tracker run, and a logger that is not installed is refused before training."""

import shutil
import signal
import sys
from pathlib import Path

import pytest

from shardwise.errors import ConfigError
from shardwise.train import loop, trackers
from shardwise.train.metrics import MetricsWriter
from shardwise.train.trainer import Trainer

from ..parallel.harness import run_distributed
from .conftest import SEQ, make_tokens, read_metrics, tiny_config


def _numeric(record):
    """The record as a tracker should get it: every numeric field (booleans as 0/1) but the step, as floats."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def _two_part_run(cfg, dataset):
    """4 steps with an eval at step 4, then the step-4 checkpoint dropped and steps 3-4 run again (resume):
    the records the two runs appended to metrics.jsonl, in order."""
    run_dir = Path(cfg.train.output_dir)
    eval_set = type(dataset)(make_tokens(600, seed=1), SEQ)
    Trainer(cfg, train_dataset=dataset, eval_dataset=eval_set).train(overwrite=True)
    first = read_metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    Trainer(cfg, train_dataset=dataset, eval_dataset=eval_set).train(resume="auto")
    final = read_metrics(run_dir)
    return first + final[final.index({"step": 2, "resumed": True}):]


# --- the config ------------------------------------------------------------------------------------------------


def test_loggers_default_follows_train_tensorboard_and_unknown_names_are_refused(tmp_path):
    assert tiny_config(tmp_path, tensorboard=True).train.loggers == ["tensorboard"]
    assert tiny_config(tmp_path).train.loggers == []  # tiny_config turns tensorboard off
    both = tiny_config(tmp_path, tensorboard=True, loggers=["mlflow", "mlflow"])
    assert both.train.loggers == ["tensorboard", "mlflow"] and both.train.tensorboard
    only = tiny_config(tmp_path, loggers=["wandb"])
    assert only.train.loggers == ["wandb"] and not only.train.tensorboard
    with pytest.raises(ConfigError, match=r"train\.loggers.*'neptune'.*tensorboard, wandb, mlflow"):
        tiny_config(tmp_path, loggers=["neptune"])
    with pytest.raises(ConfigError, match=r"train\.tensorboard is false"):
        tiny_config(tmp_path, loggers=["tensorboard"])


def test_a_logger_that_is_not_installed_is_refused_before_training(tmp_path, dataset, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, find_spec says absent
    cfg = tiny_config(tmp_path, loggers=["wandb"])
    with pytest.raises(ConfigError, match=r"train\.loggers asks for wandb.*pip install 'shardwise\[wandb\]'"):
        Trainer(cfg, train_dataset=dataset).train(overwrite=True)
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"pip install 'shardwise\[wandb\]'"):  # every rank refuses, not only 0
        MetricsWriter(tmp_path / "other", loggers=["wandb"], enabled=False)


def test_flatten_cuts_long_values():
    flat = trackers.flatten({"a": {"b": 1, "c": {"d": "x" * 2000}}, "e": [1, 2]})
    assert flat == {"a.b": "1", "a.c.d": "x" * trackers.PARAM_CHARS, "e": "[1, 2]"}


# --- MLflow ------------------------------------------------------------------------------------------------------


def test_mlflow_gets_the_records_of_metrics_jsonl_and_a_resume_continues_its_run(tmp_path, dataset, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = tiny_config(tmp_path, loggers=["mlflow"], save_steps=2, eval_steps=4)
    appended = _two_part_run(cfg, dataset)
    run_id = trackers.read_ids(tmp_path / "run")["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    assert len(client.search_runs([client.get_experiment_by_name("run").experiment_id])) == 1  # one run, resumed
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "4" and run.data.params["train.loggers"] == "['mlflow']"
    # Every numeric field of every record both runs appended (eval and resume marker included), at its step;
    # steps 3 and 4 twice, as metrics.jsonl got them twice.
    expected: dict[str, list] = {}
    for record in appended:
        for key, value in _numeric(record).items():
            expected.setdefault(key, []).append((record["step"], value))
    assert {"loss", "eval_loss", "eval_perplexity", "resumed", "mfu", "tokens_per_s"} <= expected.keys()
    for key, values in expected.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = sorted(values)  # steps exactly, values within rounding (approx takes no tuples)
        assert [step for step, _ in got] == [step for step, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12), key
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 3, 4, 4]


def test_a_failure_while_the_loop_opens_ends_the_tracker_run_and_restores_the_signal_handlers(tmp_path, dataset,
                                                                                            monkeypatch):
    """The loop's observers open inside the block that closes them: a failure after the trackers started and
    the stop signals were installed (here: the stop vote) ends the MLflow run as FAILED, not left RUNNING, and
    puts the previous SIGTERM handler back."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    def refuse(*args, **kwargs):
        raise OSError("the stop vote cannot start")

    monkeypatch.setattr(loop, "StopVote", refuse)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(OSError, match="stop vote"):
        Trainer(tiny_config(tmp_path, loggers=["mlflow"]), train_dataset=dataset).train(overwrite=True)
    assert signal.getsignal(signal.SIGTERM) is before
    run_id = trackers.read_ids(tmp_path / "run")["mlflow"]
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FAILED"


def test_mlflow_defaults_to_a_file_store_in_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    (tmp_path / "demo").mkdir()
    writer = MetricsWriter(tmp_path / "demo", loggers=["mlflow"], config={"train": {"lr": 0.1}})
    writer.write({"step": 1, "loss": 2.5, "device": "cpu"})
    writer.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "demo" / "mlruns").as_uri())
    run_id = trackers.read_ids(tmp_path / "demo")["mlflow"]
    assert client.get_experiment_by_name("demo") is not None
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 2.5)]
    assert client.get_run(run_id).data.params == {"train.lr": "0.1"}


# --- W&B (offline) ---------------------------------------------------------------------------------------------


def test_wandb_offline_gets_the_records_of_metrics_jsonl_and_a_resume_continues_its_run(tmp_path, dataset,
                                                                                       monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, inits = [], []
    original_log, original_init = wandb.sdk.wandb_run.Run.log, wandb.init

    def spy_log(self, data, *args, **kwargs):
        logged.append(dict(data))
        return original_log(self, data, *args, **kwargs)

    def spy_init(*args, **kwargs):
        inits.append(kwargs)
        return original_init(*args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy_log)
    monkeypatch.setattr(wandb, "init", spy_init)
    cfg = tiny_config(tmp_path, loggers=["wandb"], save_steps=2, eval_steps=4)
    appended = _two_part_run(cfg, dataset)
    # The same records, in the same order, as the two runs appended to metrics.jsonl.
    assert len(logged) == len(appended)
    for got, record in zip(logged, appended):
        assert got == pytest.approx({"step": record["step"], **_numeric(record)}, rel=1e-12)
    # Both runs are the one W&B run: the id kept in RUN_DIR, resume="allow"; its offline files are in RUN_DIR.
    run_id = trackers.read_ids(tmp_path / "run")["wandb"]
    assert [i["id"] for i in inits] == [run_id, run_id] and all(i["resume"] == "allow" for i in inits)
    assert inits[0]["name"] == "run" and inits[0]["config"]["train"]["max_steps"] == 4
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_a_new_run_gets_a_new_tracker_id(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    ids = []
    (tmp_path / "r").mkdir()
    for resume_step in (None, 2, None):
        MetricsWriter(tmp_path / "r", loggers=["mlflow"], resume_step=resume_step).close()
        ids.append(trackers.read_ids(tmp_path / "r")["mlflow"])
    assert ids[0] == ids[1] != ids[2]


# --- how a run ends, and trackers that fail -------------------------------------------------------------------


def test_mlflow_run_of_a_failed_or_stopped_run_is_not_left_running(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    for name, status in (("failed", trackers.FAILED), ("stopped", trackers.KILLED), ("done", trackers.FINISHED)):
        (tmp_path / name).mkdir()
        writer = MetricsWriter(tmp_path / name, loggers=["mlflow"])
        writer.write({"step": 1, "loss": 2.0})
        writer.close(status)
        assert client.get_run(trackers.read_ids(tmp_path / name)["mlflow"]).info.status == status
    with pytest.raises(ValueError, match="one of FINISHED, FAILED, KILLED"):
        trackers.close_all([], "CRASHED", tmp_path)


def test_wandb_run_of_a_failed_run_finishes_with_a_nonzero_exit_code(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    finished, preempting = [], []
    original_finish, original_mark = wandb.sdk.wandb_run.Run.finish, wandb.sdk.wandb_run.Run.mark_preempting

    def spy_finish(self, *args, **kwargs):
        finished.append(kwargs.get("exit_code", args[0] if args else None))
        return original_finish(self, *args, **kwargs)

    def spy_mark(self):
        preempting.append(True)
        return original_mark(self)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "finish", spy_finish)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "mark_preempting", spy_mark)
    for name, status in (("failed", trackers.FAILED), ("stopped", trackers.KILLED)):
        (tmp_path / name).mkdir()
        writer = MetricsWriter(tmp_path / name, loggers=["wandb"])
        writer.write({"step": 1, "loss": 2.0})
        writer.close(status)
    assert finished == [1, 1] and preempting == [True]  # only the signal stop is marked preempting


class _Fake:
    """A tracker that records what it gets and fails where told."""

    name, fix = "mlflow", "the fix for RUN_DIR"
    made: list = []

    def __init__(self, run_dir, config, resume, fail_start=False, fail_write_at=None, fail_close=False):
        if fail_start:
            raise ConnectionError("no route to host")
        self.got, self.closed, self.fail_write_at, self.fail_close = [], [], fail_write_at, fail_close
        _Fake.made.append(self)

    def write(self, record):
        if record["step"] == self.fail_write_at:
            raise ConnectionError("server went away")
        self.got.append(record["step"])

    def close(self, status):
        self.closed.append(status)
        if self.fail_close:
            raise ConnectionError("server went away")


def _fake(monkeypatch, name, **behaviour):
    monkeypatch.setitem(trackers.KINDS, name, type(f"Fake_{name}", (_Fake,), {
        "name": name, "__init__": lambda self, *a: _Fake.__init__(self, *a, **behaviour)}))


def test_a_tracker_that_does_not_start_on_rank_0_is_kept_for_every_rank_to_stop(tmp_path, monkeypatch):
    _Fake.made = []
    _fake(monkeypatch, "mlflow")
    _fake(monkeypatch, "wandb", fail_start=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    writer = MetricsWriter(tmp_path, loggers=["mlflow", "wandb"], resume_step=1)  # rank 0: does not raise here
    assert writer.start_failed
    assert _Fake.made[0].closed == [trackers.FAILED]  # the tracker opened before it is not left running
    with pytest.raises(trackers.TrackerError) as failure:
        writer.raise_start_failure()
    message = str(failure.value)
    assert f"wandb did not start for the run in {tmp_path}" in message and "ConnectionError: no route" in message
    assert f"the fix for {tmp_path}" in message
    with pytest.raises(trackers.TrackerError):  # nothing is logged past it, should the loop not check
        writer.write({"step": 2, "loss": 1.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # left as it was
    other = MetricsWriter(tmp_path, loggers=["mlflow", "wandb"], enabled=False)  # another rank
    assert not other.start_failed
    with pytest.raises(trackers.TrackerError, match=r"did not start on rank 0 .*every rank stops"):
        other.raise_start_failure()


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    _Fake.made = []
    _fake(monkeypatch, "mlflow", fail_write_at=2)
    _fake(monkeypatch, "wandb", fail_close=True)
    writer = MetricsWriter(tmp_path, loggers=["mlflow", "wandb"])
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 1.0})  # raising here, on rank 0 alone, would hang the other ranks
    writer.close()  # wandb's close fails: logged, not raised
    failing, healthy = _Fake.made
    assert failing.got == [1] and failing.closed == [trackers.FAILED]
    assert healthy.got == [1, 2, 3] and healthy.closed == [trackers.FINISHED]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert "mlflow failed to log step 2" in caplog.text and "closing wandb's run" in caplog.text


def test_wandb_that_cannot_log_in_names_the_fix(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def no_key(*args, **kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    writer = MetricsWriter(tmp_path, loggers=["wandb"])
    with pytest.raises(trackers.TrackerError) as failure:
        writer.raise_start_failure()
    message = str(failure.value)
    assert message.startswith(f"train.loggers: wandb did not start for the run in {tmp_path} (UsageError: No API")
    assert f"WANDB_MODE=offline to log into {tmp_path}/wandb" in message
    assert "take wandb out of train.loggers" in message


class _NoStart:
    name, fix = "mlflow", "reach the server"

    def __init__(self, *args):
        raise ConnectionError("no route to host")


def _start_fails_on_rank_0(rank, world, root):
    trackers.KINDS["mlflow"] = _NoStart  # a forked worker: nothing to restore
    writer = MetricsWriter(root, loggers=["mlflow"], enabled=rank == 0)
    try:
        writer.check_started(world)
    except trackers.TrackerError as exc:
        return str(exc)
    return "went on"


@pytest.mark.timeout(120)
def test_every_rank_stops_when_a_tracker_does_not_start_on_rank_0(tmp_path):
    pytest.importorskip("mlflow")
    first, second = run_distributed(_start_fails_on_rank_0, 2, tmp_path, timeout=90)
    assert first.startswith("train.loggers: mlflow did not start") and "reach the server" in first
    assert "did not start on rank 0" in second and "every rank stops" in second
    (tmp_path / "ok").mkdir()
    writer = MetricsWriter(tmp_path / "ok", loggers=[])
    writer.check_started(1)  # nothing failed: nothing raised
    writer.close()
