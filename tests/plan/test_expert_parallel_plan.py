"""Expert parallelism in the step-time model and the planner: the all-to-alls of every MoE block, the experts'
gradients summed over their replicas only, each rank stepping its share of the experts; `shardwise plan`
ranks MoE layouts with the expert-parallel degree as one more dimension, only those the trainer runs."""

from __future__ import annotations

import pytest

from shardwise.errors import ConfigError
from shardwise.hardware import get_hardware
from shardwise.plan import PlanRequest, plan
from shardwise.resolve import resolve_config as validate
from shardwise.step_time import _link, all_reduce_time, all_to_all_time, predict_step, rank_loads, work_of

H100 = get_hardware("H100")


def moe(devices: int = 16, ep: int = 1, zero: int = 0, recompute: str = "none", preset: str = "qwen3_30b_a3b"):
    return validate({"model": {"preset": preset}, "data": {"seq_length": 4096},
                     "optimize": {"mixed_precision": "bf16", "recompute": recompute},
                     "train": {"max_steps": 1, "micro_batch_size": 1, "global_batch_size": devices},
                     "parallel": {"data_parallel": devices, "expert_parallel": ep, "zero_stage": zero}})


def test_expert_all_to_alls_follow_the_maths() -> None:
    """Four exchanges per MoE block and micro-batch, each of the rank's routed copies [tokens x k, hidden] in
    bf16 over the expert-parallel group (inside a node for EP8), two more for a recomputed forward."""
    cfg = moe(ep=8)
    m = cfg.model
    step = predict_step(cfg, 16, H100)
    one = all_to_all_time(4096 * m.num_experts_per_tok * m.hidden_size * 2, 8, _link(H100, False, 1.0))
    assert step.ep_comm == pytest.approx(48 * 4 * one, rel=1e-12)
    assert predict_step(moe(ep=1), 16, H100).ep_comm == 0
    full = predict_step(moe(ep=8, recompute="full"), 16, H100)
    assert full.ep_comm == pytest.approx(48 * 6 * one, rel=1e-12)
    across = predict_step(moe(devices=32, ep=16), 32, H100)  # 16 ranks span two nodes: the slow link
    assert across.ep_comm > 3 * step.ep_comm


def test_each_rank_reduces_and_steps_only_its_share_of_the_experts() -> None:
    """With EP over every data-parallel rank the experts' gradients need no reduction and each rank steps
    1/ep of them; the rest of the model is reduced and stepped as without expert parallelism."""
    m = moe().model
    experts = rank_loads(moe())[0].expert_params
    assert experts == 48 * 3 * m.num_experts * m.hidden_size * m.moe_intermediate_size
    plain, ep16 = predict_step(moe(), 16, H100), predict_step(moe(ep=16), 16, H100)
    link = _link(H100, True, 1.0)  # 16 ranks: two nodes
    loads = rank_loads(moe())[0]
    dense_grads = (loads.trainable - experts) * 4  # bf16 O2: fp32 gradients
    assert ep16.dp_comm == pytest.approx(all_reduce_time(dense_grads, 16, link)
                                         - min(all_reduce_time(dense_grads, 16, link) * (1 - 1 / 48),
                                               H100.comm_overlap * (ep16.compute + ep16.recompute) * 2 / 3), rel=1e-9)
    assert ep16.dp_comm < plain.dp_comm / 5  # the experts are most of the gradient bytes
    assert ep16.optimizer == pytest.approx(plain.optimizer * (loads.trainable - experts * 15 / 16)
                                           / loads.trainable, rel=1e-9)
    ep8 = predict_step(moe(ep=8), 16, H100)  # two replicas of each expert: their gradients summed over 2
    assert plain.dp_comm > ep8.dp_comm > ep16.dp_comm


def test_the_planner_chooses_expert_parallelism_among_layouts_the_trainer_runs() -> None:
    """Qwen3-30B-A3B on 64 H100s: the best layout spreads the experts over a node's ranks (EP8), and every
    layout ranked is one the trainer runs: no context parallelism, the expert-parallel degree dividing the
    data-parallel ranks and the experts (all the data-parallel ranks under tensor parallelism); pipelines are
    among them."""
    cfg = moe(devices=64)
    res = plan(PlanRequest(cfg=cfg, devices=64, hardware=H100, top=50, pins={"tp": [1, 2], "pp": [1, 2]}))
    assert res.best is not None and res.best.layout.ep == 8
    assert res.best.step.ep_comm > 0 and res.best.fits
    for c in res.ranked:
        lay = c.layout
        assert lay.cp == 1 and lay.dp * lay.tp * lay.pp == 64 and 128 % lay.ep == 0 and lay.dp % lay.ep == 0
        assert lay.tp == 1 or lay.ep in (1, lay.dp)
        assert c.cfg.parallel.expert_parallel == lay.ep
    assert any(c.layout.pp > 1 and c.layout.ep > 1 for c in res.ranked)
    pinned = plan(PlanRequest(cfg=cfg, devices=64, hardware=H100, top=5, pins={"ep": [1]}))
    assert pinned.best is None or pinned.best.layout.ep == 1


def test_tensor_parallel_ranks_each_run_the_whole_router_and_experts() -> None:
    """Under tensor parallelism a MoE block's router and routed experts run whole on every rank of the group
    (parallel/tensor.py), so only the rest of the FLOPs is divided by tp."""
    one = moe(devices=8, ep=8)
    two = validate({**one.model_dump(), "parallel": {**one.parallel.model_dump(), "tensor_parallel": 2,
                                                     "data_parallel": 4, "expert_parallel": 4}})
    load = rank_loads(one)[0]
    m = one.model
    routed_weights = m.hidden_size * m.num_experts + 3 * m.hidden_size * m.moe_intermediate_size * m.num_experts_per_tok
    assert load.routed_flops_per_token == pytest.approx(48 * 6 * routed_weights, rel=1e-12)
    rate = H100.peak_tflops("bf16") * 1e12 * H100.compute_efficiency
    micro_batches = 2  # 8 sequences a step over 4 data-parallel ranks
    assert predict_step(two, 8, H100).compute == pytest.approx(
        micro_batches * 4096 * (load.flops_per_token + load.routed_flops_per_token) / 2 / rate, rel=1e-9)


def test_an_uneven_load_slows_every_rank_to_the_busiest_ones() -> None:
    """--expert-imbalance 1.5: the busiest rank receives and computes 1.5x its even share of the routed copies,
    so each exchange moves 1.5x the bytes and the step's compute grows by half the routed experts' FLOPs; without
    expert parallelism (every expert on every rank) the imbalance changes nothing."""
    cfg = moe(ep=8)
    even, uneven = (predict_step(cfg, 16, H100, work=work_of(cfg, imbalance)) for imbalance in (1.0, 1.5))
    m = cfg.model
    one = all_to_all_time(1.5 * 4096 * m.num_experts_per_tok * m.hidden_size * 2, 8, _link(H100, False, 1.0))
    assert uneven.ep_comm == pytest.approx(48 * 4 * one, rel=1e-12) and uneven.ep_comm > 1.4 * even.ep_comm
    load = rank_loads(cfg)[0]
    rate = H100.peak_tflops("bf16") * 1e12 * H100.compute_efficiency
    assert uneven.compute - even.compute == pytest.approx(4096 * 0.5 * load.routed_flops_per_token / rate, rel=1e-9)
    plain = moe(ep=1)
    assert predict_step(plain, 16, H100, work=work_of(plain, 1.5)).total == predict_step(plain, 16, H100).total
    with pytest.raises(ConfigError, match="at least 1.0"):
        work_of(cfg, 0.8)


def test_latent_attention_down_projections_run_whole_on_every_tensor_parallel_rank() -> None:
    """DeepSeek-V3 under TP2: its query and key/value down projections are replicated (parallel/tensor.py), so
    each rank computes them whole, as it does the routed experts; the rest of the FLOPs is divided by tp."""
    one = moe(devices=8, ep=8, preset="deepseek_v3_671b")
    two = validate({**one.model_dump(), "parallel": {**one.parallel.model_dump(), "tensor_parallel": 2,
                                                     "data_parallel": 4, "expert_parallel": 4}})
    load = rank_loads(one)[0]
    m = one.model
    down = m.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)
    assert load.latent_down_flops_per_token == pytest.approx(61 * 6 * down, rel=1e-12)
    rate = H100.peak_tflops("bf16") * 1e12 * H100.compute_efficiency
    whole = load.routed_flops_per_token + load.latent_down_flops_per_token
    assert predict_step(two, 8, H100).compute == pytest.approx(
        2 * 4096 * (load.flops_per_token + whole) / 2 / rate, rel=1e-9)
