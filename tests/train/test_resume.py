"""Kill a real training process and resume: the losses must match an uninterrupted run exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.checkpoint.storage import METADATA_FILE, list_checkpoints
from shardwise.train.trainer import Trainer

from .conftest import SEQ, make_tokens, read_metrics, tiny_config

# The child trains with the same data and config as the parent, and calls `hook` (test code patched
# in here, not in shardwise) at a chosen moment so that the parent can kill it there.
CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from shardwise.resolve import resolve_config as validate
from shardwise.data.packing import PackedDataset
from shardwise.checkpoint import checkpointer as ckpt
from shardwise.checkpoint.format import JsonMetadataWriter
from shardwise.train.trainer import Trainer

raw, tokens_file, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = validate(raw)
ds = PackedDataset(np.load(tokens_file), raw["data"]["seq_length"])
marker = Path(raw["train"]["output_dir"]) / "KILL_ME_NOW"

if mode == "after_save":
    original = ckpt.save_checkpoint
    def save_then_wait(run_dir, step, *a, **k):
        path = original(run_dir, step, *a, **k)
        if step == 3:
            marker.touch()
            time.sleep(600)
        return path
    ckpt.save_checkpoint = save_then_wait
else:  # "during_save": hang inside the write of the step-4 checkpoint, before it is renamed into place
    original_finish = JsonMetadataWriter.finish
    def finish_then_wait(self, metadata, results):
        original_finish(self, metadata, results)
        if "step_00000004" in str(self.path):
            marker.touch()
            time.sleep(600)
    JsonMetadataWriter.finish = finish_then_wait
Trainer(cfg, train_dataset=ds).train(overwrite=True)
"""


def _start_and_kill(tmp_path: Path, cfg, mode: str) -> None:
    tokens_file = tmp_path / "tokens.npy"
    import numpy as np

    np.save(tokens_file, make_tokens())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg.model_dump(mode="json")),
                             str(tokens_file), mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


def test_killed_run_resumes_with_identical_losses(tmp_path):
    from shardwise.data.packing import PackedDataset

    ds = PackedDataset(make_tokens(), SEQ)
    full = Trainer(tiny_config(tmp_path / "full", max_steps=6), train_dataset=ds).train().losses

    cfg = tiny_config(tmp_path / "killed", max_steps=6, save_steps=3)
    _start_and_kill(tmp_path, cfg, "after_save")
    assert [p.name for p in list_checkpoints(cfg.train.output_dir)] == ["step_00000003"]
    before_kill = {r["step"]: r["loss"] for r in read_metrics(Path(cfg.train.output_dir)) if "loss" in r}
    assert before_kill == pytest.approx({s: full[s] for s in (1, 2, 3)}, abs=1e-6, rel=0)
    resumed = Trainer(cfg, train_dataset=ds).train(resume="auto")
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == pytest.approx(full[step], abs=1e-6, rel=0)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    from shardwise.data.packing import PackedDataset

    cfg = tiny_config(tmp_path / "run", max_steps=6, save_steps=2)
    _start_and_kill(tmp_path, cfg, "during_save")
    root = Path(cfg.train.output_dir) / "checkpoints"
    # The half-written step-4 checkpoint exists only under its temporary name ...
    assert (root / ".step_00000004.tmp" / METADATA_FILE).exists()
    # ... and is never taken for a checkpoint: step 2 is the newest good one, and it loads.
    assert [p.name for p in list_checkpoints(cfg.train.output_dir)] == ["step_00000002"]
    ds = PackedDataset(make_tokens(), SEQ)
    resumed = Trainer(cfg, train_dataset=ds).train(resume="auto")
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    assert not (root / ".step_00000004.tmp").exists()  # cleaned by the next save
    assert [p.name for p in list_checkpoints(cfg.train.output_dir)] == [
        "step_00000002", "step_00000004", "step_00000006"]


def test_checkpoints_hold_no_pickle(tmp_path):
    from shardwise.data.packing import PackedDataset

    cfg = tiny_config(tmp_path, max_steps=2)
    result = Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    ckpt_dir = result.last_checkpoint
    names = {p.name for p in ckpt_dir.iterdir()}
    assert ".metadata" not in names and METADATA_FILE in names
    json.loads((ckpt_dir / METADATA_FILE).read_text())
    # every tensor file holds torch-saved tensors only: weights_only loading must accept them all
    state = json.loads((ckpt_dir / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["loader"]["consumed"] == 2 * 4
