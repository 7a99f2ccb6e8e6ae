"""Random state across a resume under tensor parallelism with dropout (each TP rank's own stream is
saved and restored), and a resume on another layout (every rank re-seeded alike, and said so)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shardwise.data.packing import PackedDataset
from shardwise.train import trainer as trainer_module
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, tiny_config, with_changes
from .harness import run_distributed


def _config(run_dir: Path, steps: int, dp: int = 1, tp: int = 1):  # noqa: ANN202
    base = tiny_config(run_dir.parent, output_dir=str(run_dir), max_steps=steps, save_steps=2,
                       decay_style="constant", micro_batch_size=4 // dp)
    return with_changes(base, model={"dropout": 0.2}, parallel={"data_parallel": dp, "tensor_parallel": tp})


def _train(cfg, resume: str | None = None) -> dict[int, float]:  # noqa: ANN001
    return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume=resume).losses


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _runs(rank: int, world: int, root: Path) -> dict:
    out = {"full": _train(_config(root / "full", 4, tp=2))}
    _train(_config(root / "resumed", 2, tp=2))
    out["resumed"] = _train(_config(root / "resumed", 4, tp=2), resume="auto")
    # The same resume with the tensor-parallel streams left out of the checkpoint: the test bites.
    original = trainer_module.rank_rng
    trainer_module.rank_rng = lambda part: None
    try:
        _train(_config(root / "forgotten", 2, tp=2))
        out["forgotten"] = _train(_config(root / "forgotten", 4, tp=2), resume="auto")
    finally:
        trainer_module.rank_rng = original
    # A one-process checkpoint (written by the parent) resumed on two ranks.
    handler = _Messages()
    logging.getLogger("shardwise").addHandler(handler)
    try:
        out["more_ranks"] = _train(_config(root / "more_ranks", 4, dp=2), resume="auto")
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    out["messages"] = handler.messages
    return out


@pytest.mark.timeout(600)
def test_random_streams_survive_a_resume_and_a_new_layout_is_reseeded(tmp_path: Path) -> None:
    _train(_config(tmp_path / "more_ranks", 2))
    results = run_distributed(_runs, 2, tmp_path, timeout=540)
    for res in results:
        full, resumed = res["full"], res["resumed"]
        assert sorted(resumed) == [3, 4]
        # Exact: each TP rank's dropout masks continue where they were (sequence-parallel shards).
        assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]
        forgotten = res["forgotten"]
        assert [forgotten[s] for s in (3, 4)] != [full[s] for s in (3, 4)]
        assert sorted(res["more_ranks"]) == [3, 4]
    said = [m for m in results[0]["messages"] if "re-seeded" in m]
    assert len(said) == 1, results[0]["messages"]
    assert "1 rank(s) (dp 1 x tp 1 x pp 1)" in said[0] and "2 rank(s) (dp 2 x tp 1 x pp 1)" in said[0]
    assert "dropout masks differ" in said[0]
    assert not [m for m in results[1]["messages"] if "re-seeded" in m]  # said once, by rank 0
