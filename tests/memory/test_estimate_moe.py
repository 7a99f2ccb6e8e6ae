"""The estimator on mixture-of-experts models: the experts' weights as the model holds them (each
expert-parallel rank its share, outside FSDP2), and the estimate saying what it only approximates."""

from __future__ import annotations

from pathlib import Path

from shardwise.memory.estimate import estimate_memory
from shardwise.models import build_model

from ..train.conftest import tiny_config, with_changes

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_expert_parallel_ranks_hold_their_share_of_the_experts(tmp_path: Path) -> None:
    base = with_changes(tiny_config(tmp_path), model=MOE, parallel={"data_parallel": 2, "zero_stage": 0})
    ep = with_changes(base, parallel={"expert_parallel": 2})
    model = build_model(base.model, device="meta")
    expert_bytes = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 4  # fp32
    whole, shared = estimate_memory(base, 2, "cpu"), estimate_memory(ep, 2, "cpu")
    assert whole.params - shared.params == expert_bytes // 2  # each of the 2 ranks keeps half the experts
    assert "mixture-of-experts" in whole.detail["approximate"] and "approximate:" in whole.table()
    dense = estimate_memory(tiny_config(tmp_path), 1, "cpu")
    assert "approximate" not in dense.detail
