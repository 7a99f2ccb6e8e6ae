"""Checkpoints resumed under another layout through the Trainer (issue 4, item 5): 1 process ->
DP2 x TP2 (ZeRO 3), TP2 -> PP2, PP2 -> DP2 (ZeRO 3), 1 process -> CP2 (ZeRO 3). Every layout computes one
process's losses, so the resumed curve must equal the uninterrupted one-process curve, which is the target layout's too
(relative error <= harness.SCALAR_RTOL, 5e-6; measured <= 1.7e-7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..train.conftest import with_changes
from .harness import assert_values_close, run_distributed
from .test_trainer_pipeline import STEPS, _config, _train


def _checkpoint(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / "step_00000002")


def _two_ranks(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    # TP2 writes steps 1-2; PP2 continues them.
    _train(_config(root / "tp2", tp=2, max_steps=2))
    tp_to_pp = _train(_config(root / "tp_to_pp", pp=2), resume=_checkpoint(root / "tp2")).losses
    # PP2 writes steps 1-2; DP2 with ZeRO 3 continues them.
    _train(_config(root / "pp2", pp=2, max_steps=2))
    pp_to_dp = _train(_config(root / "pp_to_dp", dp=2, zero=3), resume=_checkpoint(root / "pp2")).losses
    # Context parallelism (CP2, ZeRO 3 over the dp x cp ranks) continues one process's steps 1-2.
    single_to_cp = _train(with_changes(_config(root / "single_to_cp", zero=3), parallel={"context_parallel": 2}),
                          resume=_checkpoint(root / "single")).losses
    return {"tp_to_pp": tp_to_pp, "pp_to_dp": pp_to_dp, "single_to_cp2": single_to_cp}


def _four_ranks(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    return {"single_to_dp2_tp2": _train(_config(root / "single_to_2d", dp=2, tp=2, zero=3),
                                        resume=_checkpoint(root / "single")).losses}


@pytest.mark.timeout(600)
def test_checkpoints_resume_under_another_layout(tmp_path: Path) -> None:
    reference = _train(_config(tmp_path / "reference")).losses
    _train(_config(tmp_path / "single", max_steps=2))
    results = run_distributed(_two_ranks, 2, tmp_path, timeout=300)
    results += run_distributed(_four_ranks, 4, tmp_path, timeout=300)
    for rank, rank_result in enumerate(results):
        for name, got in rank_result.items():
            assert sorted(got) == list(range(3, STEPS + 1)), name
            assert_values_close([got[s] for s in sorted(got)], [reference[s] for s in sorted(got)], what="loss",
                                label=f"{name} (worker result {rank})")
