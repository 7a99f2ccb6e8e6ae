"""Checkpoints resumed under another layout through the Trainer (issue 4, item 5): 1 process ->
DP2 x TP2 (ZeRO 3), TP2 -> PP2, PP2 -> DP2 (ZeRO 3), 1 process -> CP2 (ZeRO 3). Every layout computes one
process's losses, so the resumed curve must equal the uninterrupted one-process curve, which is the target layout's too
(relative error <= harness.SCALAR_RTOL, 5e-6; measured <= 1.7e-7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..train.conftest import with_changes
from .harness import assert_values_close, run_distributed
from .test_trainer_pipeline import MICRO, ROWS, STEPS, _config, _train

# A mixture of experts (4 experts, top 2, the router's bias moved every step) for expert parallelism's reshards.
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "router_score": "sigmoid",
       "router_bias": True, "moe_bias_update_rate": 0.01, "moe_aux_loss_coef": 0.01}


def _moe(run_dir: Path, ep: int = 1, dp: int = 0, **train: object):  # noqa: ANN202
    """The MoE run with its experts over `ep` of `dp` (default ep) data-parallel ranks (ZeRO 3: below dp the
    experts are sharded over their replicas too), ROWS samples a step as always."""
    cfg = _config(run_dir, **train)
    dp = dp or ep
    accumulation = ROWS // dp // cfg.train.micro_batch_size if dp <= MICRO else 1
    return with_changes(cfg, model=MOE, train={"micro_batch_size": ROWS // dp // accumulation},
                        parallel={"data_parallel": dp, "zero_stage": 3 if dp > 1 else 0, "expert_parallel": ep},
                        optimize={"gradient_accumulation_steps": accumulation})


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
    # Expert parallelism: EP2 (ZeRO 3) continues one process's MoE steps 1-2, and writes its own for EP1 and EP4.
    single_to_ep2 = _train(_moe(root / "moe_single_to_ep2", ep=2), resume=_checkpoint(root / "moe_single")).losses
    _train(_moe(root / "moe_ep2", ep=2, max_steps=2))
    return {"tp_to_pp": tp_to_pp, "pp_to_dp": pp_to_dp, "single_to_cp2": single_to_cp,
            "moe_single_to_ep2": single_to_ep2}


def _four_ranks(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    return {"single_to_dp2_tp2": _train(_config(root / "single_to_2d", dp=2, tp=2, zero=3),
                                        resume=_checkpoint(root / "single")).losses,
            "moe_ep2_to_ep4": _train(_moe(root / "moe_ep2_to_ep4", ep=4), resume=_checkpoint(root / "moe_ep2")).losses,
            # EP2 within DP4: each expert sharded over its two replicas as well
            "moe_single_to_ep2_dp4": _train(_moe(root / "moe_single_to_ep2_dp4", ep=2, dp=4),
                                            resume=_checkpoint(root / "moe_single")).losses,
            "moe_ep2_dp4_written": _train(_moe(root / "moe_ep2_dp4", ep=2, dp=4, max_steps=2)).losses}


@pytest.mark.timeout(600)
def test_checkpoints_resume_under_another_layout(tmp_path: Path) -> None:
    reference = _train(_config(tmp_path / "reference")).losses
    moe_reference = _train(_moe(tmp_path / "moe_reference")).losses
    _train(_config(tmp_path / "single", max_steps=2))
    _train(_moe(tmp_path / "moe_single", max_steps=2))
    results = run_distributed(_two_ranks, 2, tmp_path, timeout=300)
    results += run_distributed(_four_ranks, 4, tmp_path, timeout=300)
    # EP2's checkpoints (within DP2, and within DP4 with the experts sharded over replicas) continued by one process
    results.append({"moe_ep2_to_single": _train(_moe(tmp_path / "moe_ep2_to_single"),
                                                resume=_checkpoint(tmp_path / "moe_ep2")).losses,
                    "moe_ep2_dp4_to_single": _train(_moe(tmp_path / "moe_ep2_dp4_to_single"),
                                                    resume=_checkpoint(tmp_path / "moe_ep2_dp4")).losses})
    for rank, rank_result in enumerate(results):
        rank_result.pop("moe_ep2_dp4_written", None)  # steps 1-2 only: the checkpoint is what it is for
        for name, got in rank_result.items():
            assert sorted(got) == list(range(3, STEPS + 1)), name
            want = moe_reference if name.startswith("moe") else reference
            assert_values_close([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], what="loss",
                                label=f"{name} (worker result {rank})")
