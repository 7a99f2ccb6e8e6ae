"""The Trainer under data and tensor parallelism: checkpoints move between layouts (DP2 -> DP2
resume, DP2 ZeRO-3 -> 1 process, 1 process -> DP2 ZeRO-1, TP2 -> 1 process), metrics come from
rank 0, and bf16 compute matches one bf16 process.

Whether each layout trains like one process is test_trainer_parity.py's matrix (plain SGD, strict
per-tensor checks). The runs here use AdamW, whose state must survive the resharding; their losses
are compared with one process's with harness.assert_values_close: relative error <= SCALAR_RTOL
(5e-6; measured <= 2.4e-7, TP2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.data.packing import PackedDataset
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, tiny_config, with_changes
from .harness import SCALAR_RTOL, assert_values_close, run_distributed

STEPS = 5


def _config(run_dir: Path, dp: int = 1, zero: int = 0, **train: object):  # noqa: ANN202
    # A constant LR, so that a run cut short has the weights of the longer run at the same step; a
    # given peak skips measuring the CPU's for MFU (most of such a short run's time).
    fields = {"output_dir": str(run_dir), "max_steps": STEPS, "decay_style": "constant",
              "micro_batch_size": 4 // dp, "peak_tflops": 1.0, **train}
    base = tiny_config(run_dir.parent, **fields)
    return with_changes(base, parallel={"data_parallel": dp, "zero_stage": zero})


def _train(cfg, resume: str | None = None) -> dict[int, float]:  # noqa: ANN001
    result = Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume=resume)
    return result.losses


def _assert_losses(got: dict[int, float], want: dict[int, float], steps: list[int], label: str,
                   rtol: float = SCALAR_RTOL) -> None:
    assert sorted(got) == steps, label
    assert_values_close([got[s] for s in steps], [want[s] for s in steps], rtol=rtol, what="loss", label=label)


def _dp_runs(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    out = {"zero3": _train(_config(root / "zero3", dp=2, zero=3))}
    # Resume under the same layout: steps 1-2, then 3-5 from the step-2 checkpoint.
    _train(_config(root / "resumed", dp=2, zero=3, max_steps=2))
    out["resumed"] = _train(_config(root / "resumed", dp=2, zero=3, save_steps=2), resume="auto")
    # A single-process checkpoint (written by the parent) continued under DP2 with ZeRO-1.
    out["from_single"] = _train(_config(root / "from_single", dp=2, zero=1), resume="auto")
    # ZeRO-1's evenly sharded state (each rank's part of every tensor) continued under ZeRO-3, and (by
    # the parent) in one process.
    _train(_config(root / "zero1", dp=2, zero=1, max_steps=2))
    out["zero1_to_zero3"] = _train(_config(root / "zero1_to_zero3", dp=2, zero=3),
                                   resume=str(root / "zero1" / "checkpoints" / "step_00000002"))
    return out


@pytest.mark.timeout(600)
def test_data_parallel_checkpoints_reshard(tmp_path: Path) -> None:
    single = _train(_config(tmp_path / "single"))
    _train(_config(tmp_path / "from_single", max_steps=2))  # continued by the DP2 workers
    results = run_distributed(_dp_runs, 2, tmp_path, timeout=540)
    for rank, rank_result in enumerate(results):  # every rank reports the same, global loss
        _assert_losses(rank_result["zero3"], single, list(range(1, STEPS + 1)), f"zero3 rank {rank}")
        for name in ("resumed", "from_single", "zero1_to_zero3"):
            _assert_losses(rank_result[name], single, [3, 4, 5], f"{name} rank {rank}")
    _assert_losses(_train(_config(tmp_path / "zero1"), resume="auto"), single, [3, 4, 5], "zero1 -> one process")
    # The DP2 ZeRO-3 checkpoint continues in one process.
    continued = _train(_config(tmp_path / "zero3", max_steps=STEPS + 2), resume="auto")
    assert sorted(continued) == [STEPS + 1, STEPS + 2]
    # Metrics come from rank 0 only: one record per step.
    records = [json.loads(line) for line in (tmp_path / "zero3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][:STEPS] == list(range(1, STEPS + 1))
    assert all(r["tokens_per_s_per_device"] * 2 == pytest.approx(r["tokens_per_s"]) for r in records[:STEPS])


def _tp_config(run_dir: Path, dp: int, tp: int, zero: int = 0, **train: object):  # noqa: ANN202
    return with_changes(_config(run_dir, dp=dp, zero=zero, **train), parallel={"tensor_parallel": tp})


def _compute_dtype(cfg) -> tuple[dict[int, float], str]:  # noqa: ANN001
    """Losses of a run and the dtype its first attention projection computes in afterwards."""
    import torch

    trainer = Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ))
    losses = trainer.train().losses
    seen = []
    wq = trainer.model.layers["0"].attention.wq
    handle = wq.register_forward_hook(lambda mod, args, out: seen.append(str(out.dtype)))
    with torch.no_grad():
        trainer.model(torch.zeros(1, SEQ, dtype=torch.long))
    handle.remove()
    return losses, seen[0]


def _tp_and_bf16_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    bf16 = {"mixed_precision": "bf16", "precision_level": "O2"}
    return {
        "tp2": _train(_tp_config(root / "tp2", dp=1, tp=2)),
        "bf16_o2_zero3": _compute_dtype(with_changes(_config(root / "bf16_zero3", dp=2, zero=3), optimize=bf16)),
        "bf16_o2_zero1": _compute_dtype(with_changes(_config(root / "bf16_zero1", dp=2, zero=1), optimize=bf16)),
    }


@pytest.mark.timeout(600)
def test_tensor_parallel_checkpoint_and_bf16_under_data_parallel(tmp_path: Path) -> None:
    single = _train(_config(tmp_path / "single"))
    single_bf16 = _train(with_changes(_config(tmp_path / "single_bf16"),
                                      optimize={"mixed_precision": "bf16", "precision_level": "O2"}))
    for rank, rank_result in enumerate(run_distributed(_tp_and_bf16_runs, 2, tmp_path, timeout=300)):
        _assert_losses(rank_result["tp2"], single, list(range(1, STEPS + 1)), f"tp2 rank {rank}")
        for name in ("bf16_o2_zero3", "bf16_o2_zero1"):
            # bf16 compute (FSDP2's policy casts the fp32 master shards), the same curve as one bf16
            # process within bf16's rounding (measured <= 6e-5 relative).
            got, dtype = rank_result[name]
            assert dtype == "torch.bfloat16", (name, dtype)
            _assert_losses(got, single_bf16, list(range(1, STEPS + 1)), f"{name} rank {rank}", rtol=6e-4)
    # The TP2 checkpoint continues in one process.
    continued = _train(_config(tmp_path / "tp2", max_steps=STEPS + 1), resume="auto")
    assert sorted(continued) == [STEPS + 1]
