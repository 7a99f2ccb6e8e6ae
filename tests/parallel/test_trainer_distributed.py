"""The Trainer under data parallelism: every ZeRO stage gives one process's losses, and checkpoints
move between layouts (DP2 -> DP2 resume, DP2 ZeRO-3 -> 1 process, 1 process -> DP2 ZeRO-1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.data.pretrain import PackedDataset
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, tiny_config, with_changes
from .harness import run_distributed

STEPS = 5


def _config(run_dir: Path, dp: int = 1, zero: int = 0, **train: object):  # noqa: ANN202
    # A constant LR, so that a run cut short has the weights of the longer run at the same step.
    fields = {"output_dir": str(run_dir), "max_steps": STEPS, "decay_style": "constant",
              "micro_batch_size": 4 // dp, **train}
    base = tiny_config(run_dir.parent, **fields)
    return with_changes(base, parallel={"data_parallel": dp, "zero_stage": zero})


def _train(cfg, resume: str | None = None) -> dict[int, float]:  # noqa: ANN001
    result = Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume=resume)
    return result.losses


def _dp_runs(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    out = {}
    for zero in (0, 1, 2, 3):
        out[f"zero{zero}"] = _train(_config(root / f"zero{zero}", dp=2, zero=zero))
    out["accum"] = _train(with_changes(_config(root / "accum", dp=2, zero=3),
                                       optimize={"gradient_accumulation_steps": 2},
                                       train={"micro_batch_size": 1}))
    out["recompute"] = _train(with_changes(_config(root / "recompute", dp=2, zero=2),
                                           optimize={"recompute": "full"}))
    # Resume under the same layout: steps 1-2, then 3-5 from the step-2 checkpoint.
    _train(_config(root / "resumed", dp=2, zero=3, max_steps=2))
    out["resumed"] = _train(_config(root / "resumed", dp=2, zero=3, save_steps=2), resume="auto")
    # A single-process checkpoint (written by the parent) continued under DP2 with ZeRO-1.
    out["from_single"] = _train(_config(root / "from_single", dp=2, zero=1), resume="auto")
    out["replicas_checked"] = _train(_config(root / "checked", dp=2, zero=1, check_replicas_steps=1))
    return out


@pytest.mark.timeout(600)
def test_data_parallel_trainer_matches_one_process_and_checkpoints_reshard(tmp_path: Path) -> None:
    single = _train(_config(tmp_path / "single"))
    _train(_config(tmp_path / "from_single", max_steps=2))  # continued by the DP2 workers
    results = run_distributed(_dp_runs, 2, tmp_path, timeout=540)
    for rank_result in results:  # every rank reports the same, global loss
        for name in ("zero0", "zero1", "zero2", "zero3", "accum", "recompute", "replicas_checked"):
            got = rank_result[name]
            assert sorted(got) == list(range(1, STEPS + 1)), name
            assert [got[s] for s in got] == pytest.approx([single[s] for s in got], abs=1e-4), name
        for name in ("resumed", "from_single"):
            got = rank_result[name]
            assert sorted(got) == [3, 4, 5], name
            assert [got[s] for s in (3, 4, 5)] == pytest.approx([single[s] for s in (3, 4, 5)], abs=1e-4), name
    # The DP2 ZeRO-3 checkpoint continues in one process.
    continued = _train(_config(tmp_path / "zero3", max_steps=STEPS + 2), resume="auto")
    assert sorted(continued) == [STEPS + 1, STEPS + 2]
    # Metrics come from rank 0 only: one record per step.
    records = [json.loads(line) for line in (tmp_path / "zero3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][:STEPS] == list(range(1, STEPS + 1))
    assert all(r["tokens_per_s_per_device"] * 2 == pytest.approx(r["tokens_per_s"]) for r in records[:STEPS])


def _tp_config(run_dir: Path, dp: int, tp: int, zero: int = 0, **train: object):  # noqa: ANN202
    return with_changes(_config(run_dir, dp=dp, zero=zero, **train), parallel={"tensor_parallel": tp})


def _tp_runs(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    if world == 2:
        return {"tp2": _train(_tp_config(root / "tp2", dp=1, tp=2)),
                "tp2_no_sp": _train(with_changes(_tp_config(root / "tp2_no_sp", dp=1, tp=2),
                                                 parallel={"sequence_parallel": False}))}
    return {"dp2_tp2_zero3": _train(_tp_config(root / "dp2_tp2", dp=2, tp=2, zero=3))}


@pytest.mark.timeout(600)
def test_tensor_parallel_and_2d_trainer_match_one_process(tmp_path: Path) -> None:
    single = _train(_config(tmp_path / "single"))
    results = run_distributed(_tp_runs, 2, tmp_path, timeout=300) + run_distributed(_tp_runs, 4, tmp_path,
                                                                                     timeout=300)
    for rank_result in results:
        for name, got in rank_result.items():
            assert sorted(got) == list(range(1, STEPS + 1)), name
            # AdamW turns TP's ~1e-8 summation-order noise into ~1e-5 weight differences (sign-like
            # first updates), so the losses agree to 1e-4 rather than bit for bit.
            assert [got[s] for s in got] == pytest.approx([single[s] for s in got], abs=1e-4), name
    # The TP2 checkpoint continues in one process.
    continued = _train(_config(tmp_path / "tp2", max_steps=STEPS + 1), resume="auto")
    assert sorted(continued) == [STEPS + 1]


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


def _memory_and_precision_runs(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    if world == 4:  # HSDP: 2 replicas x 2 shards
        return {"hsdp": _train(with_changes(_config(root / "hsdp", dp=4, zero=3, check_replicas_steps=2),
                                            parallel={"data_parallel_replicate": 2}))}
    bf16 = {"mixed_precision": "bf16", "precision_level": "O2"}
    return {
        "offload": _train(with_changes(_config(root / "offload", dp=2, zero=3),
                                       optimize={"offload_optimizer": True})),
        "bf16_o2_zero3": _compute_dtype(with_changes(_config(root / "bf16_zero3", dp=2, zero=3), optimize=bf16)),
        "bf16_o2_zero1": _compute_dtype(with_changes(_config(root / "bf16_zero1", dp=2, zero=1), optimize=bf16)),
    }


@pytest.mark.timeout(600)
def test_offload_hsdp_and_bf16_under_data_parallel(tmp_path: Path) -> None:
    single = _train(_config(tmp_path / "single"))
    single_bf16 = _train(with_changes(_config(tmp_path / "single_bf16"),
                                      optimize={"mixed_precision": "bf16", "precision_level": "O2"}))
    results = run_distributed(_memory_and_precision_runs, 2, tmp_path, timeout=300)
    results += run_distributed(_memory_and_precision_runs, 4, tmp_path, timeout=300)
    for rank_result in results:
        for name, got in rank_result.items():
            if name.startswith("bf16"):
                # bf16 compute (FSDP2's policy casts the fp32 master shards), the same curve as one
                # bf16 process within bf16's rounding.
                got, dtype = got
                assert dtype == "torch.bfloat16", (name, dtype)
                assert [got[s] for s in got] == pytest.approx([single_bf16[s] for s in got], abs=1e-2), name
            else:
                assert sorted(got) == list(range(1, STEPS + 1)), name
                assert [got[s] for s in got] == pytest.approx([single[s] for s in got], abs=1e-4), name
