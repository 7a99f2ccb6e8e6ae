"""Asynchronous checkpoint saves (train.async_save): staged in host memory, written in the background,
published atomically later.

Every test holds the background write back (a gate on `storage._write_tensors`) until the training state
has moved on, so that a save that did not copy the state, or published before its write finished, shows
deterministically, whatever the thread scheduling. Checkpoints are read back through the normal load
path (the trust checks of `checkpoint.format` included) and compared with a synchronous save's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager

from shardwise.checkpoint import format as ckpt_format
from shardwise.checkpoint import storage
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.storage import (
    METADATA_FILE,
    list_checkpoints,
    read_saved_tensors,
    read_trainer_state,
    resolve_resume,
    step_dir,
)
from shardwise.data.packing import PackedDataset
from shardwise.errors import CheckpointError
from shardwise.train.trainer import Trainer

from ..parallel.harness import run_distributed
from ..train.conftest import SEQ, make_tokens, tiny_config
from .test_distributed import STATE, _dump, _fsdp, _Loader, _model, _optimizer, _plain_load, _train


class _Gate:
    """Holds every background write back until `open()` (then lets the writes through, one per open)."""

    def __init__(self) -> None:
        self.opened = threading.Semaphore(0)
        self.original = storage._write_tensors

    def write(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the background write, held back
        if not self.opened.acquire(timeout=60):
            raise TimeoutError("the test never let the background write through")
        return self.original(*args, **kwargs)

    def open(self) -> None:
        self.opened.release()


@pytest.fixture
def gate(monkeypatch):  # noqa: ANN001, ANN201
    g = _Gate()
    monkeypatch.setattr(storage, "_write_tensors", g.write)
    return g


def _checkpointer(run_dir: Path, model, opt, async_save: bool) -> Checkpointer:  # noqa: ANN001
    run_dir.mkdir(parents=True, exist_ok=True)
    return Checkpointer(run_dir, [model], opt, loader=_Loader(STATE["loader"]), async_save=async_save)


def _saved(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read back in this process through the checked load path."""
    out = {}
    for group, names in read_trainer_state(path)["shapes"].items():
        out.update({f"{group}.{n}": t for n, t in read_saved_tensors(path, group, sorted(names)).items()})
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want) and want
    for name in want:
        assert torch.equal(got[name], want[name]), name


# --- one process ---------------------------------------------------------------------------------------------


def test_async_save_writes_the_state_at_the_save_not_later(tmp_path, gate):
    model = _model(seed=0)
    opt = _optimizer(model)
    _train(model, opt, steps=2, seed=0)
    ref = _dump(model, opt)
    sync_path = _checkpointer(tmp_path / "sync", model, opt, async_save=False).save(2)
    ckpt = _checkpointer(tmp_path / "async", model, opt, async_save=True)
    path = ckpt.save(2)
    _train(model, opt, steps=1, seed=1)  # the state moves on while the write is held back
    assert not path.exists() and list_checkpoints(tmp_path / "async") == []  # nothing published yet
    gate.open()
    assert ckpt.wait() == path and ckpt.wait() is None  # published once; a second wait has nothing to do
    assert list_checkpoints(tmp_path / "async") == [path]
    _assert_equal(_saved(path), _saved(sync_path))
    assert read_trainer_state(path) == read_trainer_state(sync_path)
    assert (path / "rng_rank0.json").read_text() == (sync_path / "rng_rank0.json").read_text()
    # and the normal resume path takes it
    got, state = _plain_load(tmp_path / "async")
    assert state["step"] == 2
    _assert_equal(got, ref)


def test_saves_go_on_with_a_stager_that_empties_itself_after_each_save(tmp_path, monkeypatch):
    # torch 2.11's DefaultStager._stage ends with `self._state_dict_stager.close()`: its buffers and the
    # table it copies with are gone, and a second stage raises KeyError. Here 2.13's stager is made to do
    # the same; every save must still hold the state at its step.
    original = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):  # noqa: ANN001, ANN003, ANN202
        staged = original(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged
    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    model = _model(seed=0)
    opt = _optimizer(model)
    ckpt = _checkpointer(tmp_path, model, opt, async_save=True)
    for step in (1, 2, 3):
        _train(model, opt, steps=1, seed=step)
        want = _dump(model, opt)
        path = ckpt.save(step)
        assert ckpt.wait() == path
        got, state = _plain_load(tmp_path)
        assert state["step"] == step
        _assert_equal(got, want)


def test_a_failed_background_write_raises_at_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = _model(seed=0)
    opt = _optimizer(model)
    _train(model, opt, steps=1, seed=0)
    ckpt = _checkpointer(tmp_path, model, opt, async_save=True)
    first = ckpt.save(1)
    original = ckpt_format.JsonMetadataWriter.write_data

    def disk_full(self, plan, planner):  # noqa: ANN001, ANN202 - the write of step 2 only
        if "step_00000002" in str(self.path):
            raise OSError("No space left on device (test)")
        return original(self, plan, planner)
    monkeypatch.setattr(ckpt_format.JsonMetadataWriter, "write_data", disk_full)
    second = ckpt.save(2)  # publishes step 1 first
    assert list_checkpoints(tmp_path) == [first]
    with pytest.raises(CheckpointError) as e:
        ckpt.wait()
    assert str(second) in str(e.value) and "No space left on device (test)" in str(e.value)
    assert ckpt.wait() is None  # raised once, then dropped
    assert resolve_resume("auto", tmp_path) == first and not (tmp_path / "checkpoints" / ".step_00000002.tmp").exists()
    assert ckpt.save(3) == step_dir(tmp_path, 3)
    assert ckpt.load("auto") == 3 and ckpt.wait() is None  # a load publishes the pending save first


def test_wait_while_training_raises_publishes_a_finished_save_and_never_raises(tmp_path, monkeypatch, caplog):
    model = _model(seed=0)
    opt = _optimizer(model)
    _train(model, opt, steps=1, seed=0)
    ckpt = _checkpointer(tmp_path, model, opt, async_save=True)
    first = ckpt.save(1)
    assert ckpt.wait(training_failed=True) == first  # a save of a finished step is still published

    def fail(self, plan, planner):  # noqa: ANN001, ANN202
        raise OSError("write failed (test)")
    monkeypatch.setattr(ckpt_format.JsonMetadataWriter, "write_data", fail)
    ckpt.save(2)
    assert ckpt.wait(training_failed=True) is None  # logged, not raised over the training error
    assert "step_00000002" in caplog.text and "write failed (test)" in caplog.text
    assert list_checkpoints(tmp_path) == [first]


def test_training_with_async_saves_resumes_with_identical_losses(tmp_path):
    ds = PackedDataset(make_tokens(), SEQ)
    sync_cfg = tiny_config(tmp_path / "sync", max_steps=6, save_steps=3)
    full = Trainer(sync_cfg, train_dataset=ds).train().losses
    cfg = tiny_config(tmp_path / "async", max_steps=6, save_steps=3, async_save=True)
    trainer = Trainer(cfg, train_dataset=ds)
    result = trainer.train()
    assert trainer.state.checkpointer.wait() is None  # train() published the last checkpoint before returning
    assert result.last_checkpoint == step_dir(cfg.train.output_dir, 6) and result.last_checkpoint.is_dir()
    assert result.losses == pytest.approx(full, abs=0, rel=0)
    for step in (3, 6):
        _assert_equal(_saved(step_dir(cfg.train.output_dir, step)), _saved(step_dir(sync_cfg.train.output_dir, step)))
    trainer = Trainer(cfg, train_dataset=ds)
    resumed = trainer.train(resume=str(step_dir(cfg.train.output_dir, 3)), overwrite=True)
    trainer.state.checkpointer.wait()
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == pytest.approx(full[step], abs=1e-6, rel=0)


# --- two ranks, ZeRO-3 ------------------------------------------------------------------------------------------


def _zero3_worker(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    tmp = Path(tmp)
    gate = _Gate()
    storage._write_tensors = gate.write
    out: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(_model(seed=1), mesh)
    opt = _optimizer(model)
    _train(model, opt, steps=2, seed=10 + rank)
    ckpt = Checkpointer(tmp / "run", [model], opt, loader=_Loader(STATE["loader"]), async_save=True)
    out["own_group"] = ckpt._group is not None and ckpt._group != dist.group.WORLD
    ref = _dump(model, opt)  # the state at the save
    path = ckpt.save(2)
    _train(model, opt, steps=1, seed=20 + rank)  # training goes on while the write is held back
    out["published_before_wait"] = path.exists()
    gate.open()
    out["path"] = str(ckpt.wait())
    if rank == 0:
        torch.save(ref, tmp / "ref.pt")

    # A background write that fails on rank 1 only: every rank raises at wait; step 2 stays the newest.
    if rank == 1:
        def fail(self, plan, planner):  # noqa: ANN001, ANN202
            raise OSError("write failed on rank 1 (test)")
        ckpt_format.JsonMetadataWriter.write_data = fail
    ckpt.save(3)
    gate.open()
    try:
        ckpt.wait()
        out["failure"] = None
    except CheckpointError as e:
        out["failure"] = str(e)
    dist.barrier()
    out["newest"] = resolve_resume("auto", tmp / "run").name
    out["entries"] = sorted(p.name for p in (tmp / "run" / "checkpoints").iterdir())
    return out


@pytest.mark.timeout(300)
def test_zero3_async_save_loads_into_one_process(tmp_path):
    results = run_distributed(_zero3_worker, 2, str(tmp_path))
    for r in results:
        assert r["own_group"] and not r["published_before_wait"]
        assert r["path"].endswith("step_00000002")
        assert r["failure"] is not None and "step_00000003" in r["failure"] and "rank 1" in r["failure"]
        assert r["newest"] == "step_00000002" and r["entries"] == ["step_00000002"]
    assert "write failed on rank 1 (test)" in results[1]["failure"]
    got, state = _plain_load(tmp_path / "run")
    assert state["step"] == 2 and state["loader"] == STATE["loader"]
    _assert_equal(got, torch.load(tmp_path / "ref.pt", weights_only=True))


# --- a process killed before its background write was published ---------------------------------------------

# The child trains with async saves every 2 steps; the background write of the step-4 checkpoint hangs once
# it has written every tensor and the metadata (DCP's last act), before the checkpoint is published.
CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from shardwise.resolve import resolve_config as validate
from shardwise.data.packing import PackedDataset
from shardwise.checkpoint.format import JsonMetadataWriter
from shardwise.train.trainer import Trainer

raw, tokens_file = json.loads(sys.argv[1]), sys.argv[2]
marker = Path(raw["train"]["output_dir"]) / "KILL_ME_NOW"
original_finish = JsonMetadataWriter.finish
def finish_then_hang(self, metadata, results):
    original_finish(self, metadata, results)
    if "step_00000004" in str(self.path):
        marker.touch()
        time.sleep(600)
JsonMetadataWriter.finish = finish_then_hang
Trainer(validate(raw), train_dataset=PackedDataset(np.load(tokens_file), raw["data"]["seq_length"])).train()
"""


def test_a_process_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path / "run", max_steps=6, save_steps=2, async_save=True)
    tokens_file = tmp_path / "tokens.npy"
    np.save(tokens_file, make_tokens())
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg.model_dump(mode="json")), str(tokens_file)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    marker = Path(cfg.train.output_dir) / "KILL_ME_NOW"
    deadline = time.time() + 240
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError("child exited early:\n" + proc.stdout.read().decode())
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("child never reached the kill point")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = Path(cfg.train.output_dir) / "checkpoints"
    # Step 2 is the newest good checkpoint, the one --resume auto takes ...
    assert [p.name for p in list_checkpoints(cfg.train.output_dir)] == ["step_00000002"]
    assert resolve_resume("auto", cfg.train.output_dir).name == "step_00000002"
    # ... though every tensor and the metadata of step 4 are on disk: under the temporary name only.
    assert (root / ".step_00000004.tmp" / METADATA_FILE).exists() and not (root / "step_00000004").exists()
    ds = PackedDataset(make_tokens(), SEQ)
    trainer = Trainer(cfg, train_dataset=ds)
    resumed = trainer.train(resume="auto")
    trainer.state.checkpointer.wait()
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    full = Trainer(tiny_config(tmp_path / "full", max_steps=6), train_dataset=ds).train().losses
    for step in (3, 4, 5, 6):
        assert resumed.losses[step] == pytest.approx(full[step], abs=1e-6, rel=0)
    assert [p.name for p in list_checkpoints(cfg.train.output_dir)] == [
        "step_00000002", "step_00000004", "step_00000006"]
    assert not (root / ".step_00000004.tmp").exists()  # cleaned by the next save


# --- CUDA (a lent GPU: bench/gpu_checks.sh runs async_save_cuda.py) ------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fsdp2_async_save_stages_into_pinned_memory(tmp_path):
    script = Path(__file__).with_name("async_save_cuda.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result
