"""The step-time model: FLOPs per pipeline rank, communication costs, bubbles, the physical limit."""

from __future__ import annotations

import pytest

from shardwise.hardware import get_hardware
from shardwise.memory.estimate import run_flops
from shardwise.models import flops_per_token
from shardwise.resolve import resolve_config as validate
from shardwise.step_time import (
    all_reduce_time,
    gather_time,
    lora_adapter_params,
    model_flops_per_token,
    physical_limit,
    predict_step,
    rank_loads,
)


def config(preset: str = "llama_7b", seq: int = 2048, gbs: int = 64, mbs: int = 1, lora: bool = False,
           **parallel: object):
    raw = {"model": {"preset": preset}, "data": {"seq_length": seq}, "optimize": {"mixed_precision": "bf16"},
           "train": {"max_steps": 1, "global_batch_size": gbs, "micro_batch_size": mbs},
           "parallel": {"data_parallel": -1, **parallel}}
    if lora:
        raw["lora"] = {"r": 8}
    return validate(raw)


@pytest.mark.parametrize("parallel", [{}, {"pipeline_parallel": 2, "micro_batch_num": 8},
                                      {"pipeline_parallel": 4, "micro_batch_num": 8, "virtual_stages": 2,
                                       "schedule": "interleaved_1f1b"},
                                      {"pipeline_parallel": 2, "micro_batch_num": 8, "virtual_stages": 2,
                                       "schedule": "zero_bubble"}])
def test_rank_flops_add_up_to_the_model_flops(parallel: dict) -> None:
    cfg = config(**parallel)
    loads = rank_loads(cfg)
    assert sum(load.flops_per_token for load in loads) == pytest.approx(flops_per_token(cfg.model, 2048), rel=1e-12)
    assert sum(load.layers for load in loads) == 32
    assert sum(load.embedding for load in loads) == 1 and sum(load.head for load in loads) == 1
    if parallel.get("schedule") == "zero_bubble":  # ZB-V: rank 0 holds the first and the last stage
        assert loads[0].embedding and loads[0].head


def test_frozen_weights_skip_their_weight_gradients() -> None:
    full, lora = config(), config(lora=True)
    m = full.model
    h, inter, s = 4096, 11008, 2048
    qkv, wo, mlp = 3 * h * h, h * h, 3 * h * inter
    adapter_a, adapter_b = 8 * h, h * 8  # r x in, out x r for each of q, k, v, o (all 4096 wide)
    scores = 4 * 32 * 128 * s  # QK^T and AV forward; x3 with backward
    # Layer 0: its input is the frozen embedding, so q/k/v base weights run forward only (2) and their
    # adapters' A skip the input gradient (4); o and the MLP read inputs that need gradients (base 4,
    # o's A 6); every B reads its A's output (6).
    first = 2 * qkv + 4 * (wo + mlp) + 4 * 3 * adapter_a + 6 * adapter_a + 6 * 4 * adapter_b + 3 * scores
    # Later layers: every base weight 4, every adapter weight 6.
    later = 4 * (qkv + wo + mlp) + 6 * 4 * (adapter_a + adapter_b) + 3 * scores
    expected = first + 31 * later + 4 * m.vocab_size * h  # the frozen head still passes gradients down
    assert model_flops_per_token(lora) == pytest.approx(expected, rel=1e-12)
    assert sum(load.flops_per_token for load in rank_loads(lora)) == pytest.approx(expected, rel=1e-12)
    assert model_flops_per_token(full) == flops_per_token(m, 2048)
    assert lora_adapter_params(lora) == 4 * (adapter_a + adapter_b)
    lim = physical_limit(lora, get_hardware("Ascend910B3"))
    assert lim["tokens_per_s_per_device"] == pytest.approx(313e12 / expected)
    assert lim["full_training_flops_per_token"] == flops_per_token(m, 2048)


def test_the_planner_and_the_trainer_count_the_same_flops() -> None:
    """rank_loads splits `run_flops` (the trainer's MFU count) over the stages, recompute included."""
    cfg = validate({"model": {"preset": "llama_7b"}, "data": {"seq_length": 2048}, "freeze": {"embeddings": True,
                    "layers": 3}, "optimize": {"recompute": "full", "recompute_every": 2},
                    "parallel": {"pipeline_parallel": 2, "micro_batch_num": 4},
                    "train": {"max_steps": 1, "global_batch_size": 8, "micro_batch_size": 1}})
    flops = run_flops(cfg)
    loads = rank_loads(cfg)
    assert loads[0].flops_per_token == pytest.approx(sum(flops.layers[:16]))
    assert loads[1].flops_per_token == pytest.approx(sum(flops.layers[16:]) + flops.head)
    assert sum(load.flops_per_token for load in loads) == pytest.approx(flops.total) == model_flops_per_token(cfg)
    # The three frozen bottom layers run forward only; recompute repeats layers 0, 2, .. of each stage.
    assert flops.layers[0] == flops.layers_forward[0] < flops.layers[3] / 2
    forward = flops.layers_forward
    assert loads[0].recompute_flops_per_token == pytest.approx(sum(forward[i] for i in range(0, 16, 2)))
    # The last stage's chunked loss computes its logits again in backward (a pipeline): 2 FLOPs per output weight.
    head_again = 2 * cfg.model.vocab_size * cfg.model.hidden_size
    assert loads[1].recompute_flops_per_token == pytest.approx(sum(forward[i] for i in range(16, 32, 2)) + head_again)


def test_physical_limit_of_seed_002() -> None:
    cfg = config("llm_100b", seq=4096, gbs=512)
    lim = physical_limit(cfg, get_hardware("Ascend910B3"))
    assert lim["peak_flops"] == 313e12
    assert lim["flops_per_token"] == flops_per_token(cfg.model, 4096)
    assert lim["tokens_per_s_per_device"] == pytest.approx(741.5, abs=1)  # 15,000 is 20x above it


def test_collective_costs() -> None:
    link = (100e9, 10e-6)
    assert all_reduce_time(1e9, 4, link) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9 + 6 * 10e-6)
    assert gather_time(1e9, 4, link) == pytest.approx(3 / 4 * 1e9 / 100e9 + 3 * 10e-6)
    assert all_reduce_time(1e9, 1, link) == 0


def test_step_parts_follow_the_layout() -> None:
    hw = get_hardware("H100")
    dp = predict_step(config(), 8, hw)
    assert dp.tp_comm == 0 and dp.pp_comm == 0 and dp.bubble == 0 and dp.dp_comm >= 0
    assert dp.tokens_per_step == 64 * 2048 and dp.detail["gradient_accumulation"] == 8
    # Compute: the model FLOPs of 8 micro-batches of 2048 tokens at 42% of 989 TFLOP/s.
    assert dp.compute == pytest.approx(8 * 2048 * flops_per_token(config().model, 2048) / (0.42 * 989e12))
    tp = predict_step(config(tensor_parallel=2), 8, hw)
    assert tp.tp_comm > 0 and tp.compute == pytest.approx(dp.compute)  # half the work, twice the micro-batches
    # Per layer and micro-batch: 4 all-reduce volumes of the [1, 2048, 4096] bf16 activations, plus the
    # embedding's and the output's 2 each, over NVLink at 80% of 450 GB/s with 5 us per ring step.
    one = all_reduce_time(2048 * 4096 * 2, 2, (0.8 * 450e9, 5e-6))
    assert tp.tp_comm == pytest.approx(16 * (32 * 4 + 4) * one)


def test_bubble_per_schedule() -> None:
    hw = get_hardware("H100")
    bubbles = {}
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)):
        s = predict_step(config(pipeline_parallel=2, micro_batch_num=8, schedule=schedule, virtual_stages=v), 8, hw)
        bubbles[schedule] = s.bubble / s.detail["micro_batch_time"]
    # Filling and draining pass once through the other stage, a little lighter than the last one (which
    # also runs the output projection); interleaving halves that, zero-bubble leaves a third.
    assert 0.9 < bubbles["1f1b"] < 1.0
    assert bubbles["interleaved_1f1b"] == pytest.approx(bubbles["1f1b"] / 2, rel=1e-3)  # (twice the sends)
    assert bubbles["zero_bubble"] == pytest.approx(bubbles["1f1b"] / 3)


def test_recompute_costs_a_forward() -> None:
    hw = get_hardware("H100")
    none = predict_step(config(), 8, hw)
    full = predict_step(config().model_copy(update={"optimize": config().optimize.model_copy(
        update={"recompute": "full"})}), 8, hw)
    # A forward is a third of the layers' training FLOPs (the output head is not recomputed).
    assert 0.30 < full.recompute / none.compute < 1 / 3


def test_cpu_processes_beyond_the_cores_share_them() -> None:
    hw = get_hardware("cpu")

    def cfg(**parallel: int):  # noqa: ANN202
        return validate({"model": {"preset": "demo_llama"}, "data": {"seq_length": 256},
                         "parallel": {"data_parallel": 1, **parallel},
                         "train": {"max_steps": 1, "global_batch_size": 16, "micro_batch_size": 4}})

    hw = hw.with_changes(cores_per_node=2.0)
    two, four = predict_step(cfg(data_parallel=2), 2, hw), predict_step(cfg(data_parallel=4), 4, hw)
    assert two.detail["slowdown"] == 1
    # Four processes on two cores: twice as slow while all of them compute or move bytes.
    assert four.detail["slowdown"] == pytest.approx(2, rel=0.01)
    assert four.compute == pytest.approx(two.compute / 2 * four.detail["slowdown"])  # half the samples each
    # A 4-stage pipeline keeps fewer than two processes busy on average: no slowdown.
    pipe = predict_step(cfg(pipeline_parallel=4, micro_batch_num=4), 4, hw)
    assert pipe.detail["slowdown"] == 1 and pipe.detail["busy"] / pipe.total * 4 < 2


def test_zero_2_3_reduce_scatter_per_micro_batch_or_per_step() -> None:
    """parallel.reduce_gradients: auto (ZeRO 2/3: every micro-batch) reduce-scatters the gradients once per
    micro-batch, once_per_step once; ZeRO 0/1 all-reduce once per step either way."""
    hw = get_hardware("H100")
    every = predict_step(config(zero_stage=3), 8, hw)
    once = predict_step(config(zero_stage=3, reduce_gradients="once_per_step"), 8, hw)
    ga = every.detail["gradient_accumulation"]
    assert ga == 8
    # 6.7e9 bf16-O2 parameters' fp32 gradients over 8 ranks on NVLink: (ga - 1) more reduce-scatters.
    grads = sum(load.trainable for load in every.detail["loads"]) * 4
    rs = gather_time(grads, 8, (0.8 * 450e9, 5e-6))
    assert every.detail["dp_comm_total"] - once.detail["dp_comm_total"] == pytest.approx((ga - 1) * rs)
    assert every.total > once.total and every.compute == once.compute
    zero1 = predict_step(config(zero_stage=1), 8, hw)
    assert zero1.detail["dp_comm_total"] < every.detail["dp_comm_total"]
