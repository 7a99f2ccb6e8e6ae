"""train.loggers: W&B (offline) and MLflow (a file: store in tmp) get the same records as metrics.jsonl, a
resumed run continues the same tracker run, and a logger that is not installed is refused before training."""

import shutil
import sys
from pathlib import Path

import pytest

from shardwise.errors import ConfigError
from shardwise.train import trackers
from shardwise.train import trainer as trainer_module
from shardwise.train.metrics import MetricsWriter
from shardwise.train.trainer import Trainer

from .conftest import SEQ, make_tokens, read_metrics, tiny_config


@pytest.fixture
def wired(monkeypatch):
    """Trainer.train -> MetricsWriter with train.loggers and the config dict (what the trainer passes once the
    line is wired; setdefault leaves a wired call as it is)."""
    def make(cfg):
        def writer(*args, **kwargs):
            kwargs.setdefault("loggers", cfg.train.loggers)
            kwargs.setdefault("config", cfg.model_dump(mode="json"))
            return MetricsWriter(*args, **kwargs)
        monkeypatch.setattr(trainer_module, "MetricsWriter", writer)
        return cfg
    return make


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


def test_a_logger_that_is_not_installed_is_refused_before_training(tmp_path, dataset, monkeypatch, wired):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, find_spec says absent
    cfg = wired(tiny_config(tmp_path, loggers=["wandb"]))
    with pytest.raises(ConfigError, match=r"train\.loggers asks for wandb.*pip install 'shardwise\[wandb\]'"):
        Trainer(cfg, train_dataset=dataset).train(overwrite=True)
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"pip install 'shardwise\[wandb\]'"):  # every rank refuses, not only 0
        MetricsWriter(tmp_path / "other", loggers=["wandb"], enabled=False)


def test_flatten_cuts_long_values():
    flat = trackers.flatten({"a": {"b": 1, "c": {"d": "x" * 2000}}, "e": [1, 2]})
    assert flat == {"a.b": "1", "a.c.d": "x" * trackers.PARAM_CHARS, "e": "[1, 2]"}


# --- MLflow ------------------------------------------------------------------------------------------------------


def test_mlflow_gets_the_records_of_metrics_jsonl_and_a_resume_continues_its_run(tmp_path, dataset, monkeypatch,
                                                                                wired):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = wired(tiny_config(tmp_path, loggers=["mlflow"], save_steps=2, eval_steps=4))
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
        assert got == pytest.approx(sorted(values), rel=1e-12), key
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 3, 4, 4]


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
                                                                                       monkeypatch, wired):
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
    cfg = wired(tiny_config(tmp_path, loggers=["wandb"], save_steps=2, eval_steps=4))
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
