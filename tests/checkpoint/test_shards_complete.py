"""A checkpoint is never declared complete with shard files missing (a rank's files on a disk of its
node's own, or lost since): the publishing rank checks every shard file DCP's metadata names before the
rename, and `is_complete` (what `--resume auto` takes) checks them too; ranks that see different
checkpoints stop together. Ranks that really do not share the run directory:
tests/train/test_shared_storage.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import storage
from shardwise.checkpoint.checkpointer import _agree_on_checkpoint
from shardwise.checkpoint.format import JsonMetadataWriter
from shardwise.data.packing import PackedDataset
from shardwise.errors import CheckpointError
from shardwise.train.trainer import Trainer

from ..parallel.harness import run_distributed
from ..train.conftest import SEQ, make_tokens, tiny_config


class _LosesAShard(JsonMetadataWriter):
    """The metadata written, then the shard file gone: as rank 0 sees a rank's file on another disk."""

    def finish(self, metadata, results) -> None:  # noqa: ANN001
        super().finish(metadata, results)
        for shard in Path(self.path).glob("*.distcp"):
            shard.unlink()


def _tensors(value: float) -> dict:
    return {"model": {"w": torch.full((4, 3), value)}, "optim": {"w.exp_avg": torch.zeros(4, 3)}}


def test_a_checkpoint_missing_a_shard_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = storage.save_checkpoint(tmp_path, 1, _tensors(1.0), {"loader": {}})
    monkeypatch.setattr(storage, "JsonMetadataWriter", _LosesAShard)
    with pytest.raises(CheckpointError) as e:
        storage.save_checkpoint(tmp_path, 2, _tensors(2.0), {"loader": {}})
    msg = str(e.value)
    assert "step_00000002 was not published" in msg and "__0_0.distcp" in msg
    assert "ReadWriteMany" in msg and "is still the one before it" in msg
    assert not storage.step_dir(tmp_path, 2).exists()
    assert storage.list_checkpoints(tmp_path) == [first]
    assert storage.resolve_resume("auto", tmp_path) == first


def test_is_complete_is_false_with_a_shard_missing(tmp_path: Path) -> None:
    first = storage.save_checkpoint(tmp_path, 1, _tensors(1.0), {"loader": {}})
    second = storage.save_checkpoint(tmp_path, 2, _tensors(2.0), {"loader": {}})
    assert storage.is_complete(second) and storage.missing_shards(second) == []
    (second / "__0_0.distcp").unlink()
    assert storage.missing_shards(second) == ["__0_0.distcp"]
    assert not storage.is_complete(second)
    assert storage.resolve_resume("auto", tmp_path) == first
    with pytest.raises(CheckpointError, match=r"shard file\(s\) __0_0.distcp are missing"):
        storage.resolve_resume(str(second), tmp_path)
    with pytest.raises(CheckpointError, match="__0_0.distcp are missing"):
        storage.find_checkpoint(second)


def _train(run_dir: Path, resume: str | None = None, **train: object) -> dict[int, float]:
    cfg = tiny_config(run_dir.parent, output_dir=str(run_dir), decay_style="constant", **train)
    return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume=resume).losses


def test_resume_auto_takes_the_checkpoint_before_one_that_lost_a_shard(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    want = _train(tmp_path / "whole")
    real = storage.JsonMetadataWriter

    def writer(path, **kwargs):  # noqa: ANN001, ANN202 - the step-4 save loses its shard before publishing
        return (_LosesAShard if Path(path).name == ".step_00000004.tmp" else real)(path, **kwargs)

    monkeypatch.setattr(storage, "JsonMetadataWriter", writer)
    run = tmp_path / "cut"
    with pytest.raises(CheckpointError, match="step_00000004 was not published"):
        _train(run, save_steps=2)
    assert [p.name for p in storage.list_checkpoints(run)] == ["step_00000002"]
    monkeypatch.setattr(storage, "JsonMetadataWriter", real)
    resumed = _train(run, resume="auto")
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-6)


def _resolve_different(rank: int, world: int, root: Path) -> str:
    _agree_on_checkpoint(storage.step_dir(root, 4), root)  # every rank sees step 4: fine
    try:  # rank 1 sees only step 2 (its own disk), rank 0 step 4
        _agree_on_checkpoint(storage.step_dir(root, 4 if rank == 0 else 2), root)
    except CheckpointError as e:
        return str(e)
    return "resumed"


def test_ranks_that_see_different_checkpoints_stop_together(tmp_path: Path) -> None:
    for msg in run_distributed(_resolve_different, 2, tmp_path, timeout=120):
        assert "the ranks do not see the same checkpoints" in msg and "step 4 on some ranks and step 2" in msg
