"""The estimator and the step-time model count each offload lever where it lives (issue 13, item 5): the
device figure without what went to the host, the host figure beside it; on the CPU (one memory) the
two together are the count that bench/memory_check.py holds against measurement."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config import RunConfig
from shardwise.hardware import get_hardware
from shardwise.memory.estimate import PHASES, estimate_memory
from shardwise.models import build_model
from shardwise.resolve import resolve_config as validate
from shardwise.step_time import predict_step

GIB = 2**30


def _cfg(tmp: Path, preset: str = "llama3_8b", **optimize: object) -> RunConfig:
    seq = 2048 if preset == "llama3_8b" else 256
    return validate({"model": {"preset": preset}, "data": {"seq_length": seq},
                     "train": {"output_dir": str(tmp), "max_steps": 1, "micro_batch_size": 2},
                     "optimize": {"mixed_precision": "bf16", "recompute": "full", **optimize}})


def test_offloaded_optimizer_leaves_weights_on_the_device_and_the_rest_on_the_host(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "demo_llama", offload_optimizer=True)
    plain = estimate_memory(_cfg(tmp_path, "demo_llama"), 1, "cuda")
    off = estimate_memory(cfg, 1, "cuda")
    params = list(build_model(cfg.model).parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    assert off.grads == 0 and off.optimizer == 0 and off.params == plain.params
    # fp32 master 4 + its gradient 4 + the pinned bf16 buffer 2 + AdamW's two fp32 moments 8, and a step each.
    assert off.host == n * 18 + 4 * tensors
    assert off.host_phases["checkpoint"] == n * 14 + 4 * tensors  # no gradients between steps
    assert off.peak < plain.peak - n * 12  # masters, moments (and more) left the device
    assert off.phases["optimizer"] == off.phases["checkpoint"]  # the update runs on the host


def test_offloaded_activations_leave_the_blocks_saved_tensors_on_the_host(tmp_path: Path) -> None:
    for recompute in ("none", "full"):
        plain = estimate_memory(_cfg(tmp_path, "demo_llama", recompute=recompute), 1, "cuda")
        off = estimate_memory(_cfg(tmp_path, "demo_llama", recompute=recompute, offload_activations=True), 1, "cuda")
        kept = plain.detail["layer_activation_bytes"] * plain.detail["layers_on_rank"]
        assert off.detail["host_offload"]["activations"] == kept, recompute
        assert off.activations == 0 and off.phases["forward"] < plain.phases["forward"], recompute


def test_on_the_cpu_device_and_host_add_up_to_the_phases(tmp_path: Path) -> None:
    for optimize in ({"offload_optimizer": True}, {"offload_activations": True},
                     {"offload_optimizer": True, "offload_activations": True, "gradient_accumulation_steps": 2}):
        est = estimate_memory(_cfg(tmp_path, "demo_llama", **optimize), 1, "cpu")
        for phase in PHASES:
            assert est.detail["device_phases"][phase] + est.host_phases[phase] == est.phases[phase], (optimize, phase)
        assert "host memory is the device's" in est.table()


def test_both_offloads_leave_the_bf16_weights_and_little_else_on_the_device(tmp_path: Path) -> None:
    """Llama-3-8B with masters, state and saved block inputs on the host: the device figure is the bf16
    weights, one block's gradient in transit, the head's chunk and the transients (no published target:
    the peer figures are bench/memory_targets.py's to compare)."""
    cfg = _cfg(tmp_path, offload_optimizer=True, offload_activations=True, loss_chunk_tokens=256)
    est = estimate_memory(cfg, 1, "cuda")
    n = sum(p.numel() for p in build_model(cfg.model, device="meta").parameters())
    rope = 2 * cfg.model.max_position_embeddings * cfg.model.head_dim * 4  # the rotary tables, fp32
    assert est.params == 2 * n + rope and est.grads == 0 and est.optimizer == 0
    assert est.activations == 0  # at the forward peak every block's input is already on the host
    assert est.host_phases["checkpoint"] >= n * 14  # fp32 master, the bf16 buffer and both fp32 moments
    assert 2 * n < est.peak < 2 * n * 1.25


def test_streamed_optimizer_state_lives_on_the_host_and_streams_through_the_device(tmp_path: Path) -> None:
    """offload_optimizer stream: masters and moments in host memory; the gradients stay on the device
    (none at all in backward, where each is applied and freed) and one unit of state passes through."""
    plain = estimate_memory(_cfg(tmp_path, "demo_llama"), 1, "cuda")
    after = estimate_memory(_cfg(tmp_path, "demo_llama", offload_optimizer="stream"), 1, "cuda")
    in_backward = estimate_memory(validate({**_cfg(tmp_path, "demo_llama", offload_optimizer="stream").model_dump(),
                                            "train": {"output_dir": str(tmp_path), "max_steps": 1,
                                                      "micro_batch_size": 2, "optimizer_in_backward": True,
                                                      "max_grad_norm": None}}), 1, "cuda")
    params = list(build_model(_cfg(tmp_path, "demo_llama").model).parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    for est in (after, in_backward):
        assert est.optimizer == 0 and est.params == plain.params
        assert est.host == n * 12 + 4 * tensors  # fp32 master and two fp32 moments, a step count each
    assert after.phases["optimizer"] > after.phases["checkpoint"]  # the gradients and one unit in flight
    assert in_backward.grads == 0 and in_backward.peak < after.peak
    for est in (plain, after, in_backward):  # the rows add up to the peak
        assert est.params + est.grads + est.optimizer + est.activations + est.buffers == est.detail["tensor_peak"]


def test_the_async_save_host_copy_is_counted_in_host_memory(tmp_path: Path) -> None:
    """train.async_save keeps one host copy of what a checkpoint saves for the whole run: bf16 weights,
    fp32 masters and both fp32 moments at O2 (and a step count per tensor); on a CPU that is the one
    memory, so the phases grow by it too."""
    cfg = _cfg(tmp_path, "demo_llama")
    saving = validate({**cfg.model_dump(), "train": {**cfg.train.model_dump(), "async_save": True}})
    params = list(build_model(cfg.model).parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    for device in ("cuda", "cpu"):
        plain, staged = estimate_memory(cfg, 1, device), estimate_memory(saving, 1, device)
        copy = n * (2 + 4 + 8) + 4 * tensors
        assert staged.detail["async_save_host_bytes"] == copy, device
        assert staged.host - plain.host == copy, device
        grow = staged.detail["tensor_peak"] - plain.detail["tensor_peak"]
        assert grow == (copy if device == "cpu" else 0), device


def test_the_table_shows_only_the_gradients_that_exist_at_the_peak(tmp_path: Path) -> None:
    """With the optimizer in backward no full set of gradients exists: the gradients row is 0 and the rows
    still add up to the peak; after a backward (no accumulation) the gradients row is the whole set."""
    cfg = _cfg(tmp_path, "demo_llama")
    raw = cfg.model_dump()
    raw["train"].update(optimizer_in_backward=True, max_grad_norm=None)
    est = estimate_memory(validate(raw), 1, "cuda")
    assert est.grads == 0
    assert est.params + est.grads + est.optimizer + est.activations + est.buffers == est.detail["tensor_peak"]
    row = next(line for line in est.table().splitlines() if line.strip().startswith("gradients"))
    assert row.split()[-2:] == ["0.000", "GiB"]


def test_step_time_hides_the_streamed_state_behind_the_backward_it_runs_in(tmp_path: Path) -> None:
    """offload_optimizer stream: the state crosses the host link in and out each step; in backward the
    copies hide behind the backward's compute, after it only behind the other updates; 8-bit state is a
    quarter of fp32's traffic, and bitsandbytes' paged state is charged only for what does not fit."""
    hw = get_hardware("RTX4090")
    inbw = {"optimizer_in_backward": True, "max_grad_norm": None}

    def step(train: dict, **optimize: object):  # noqa: ANN202
        cfg = _cfg(tmp_path, **optimize)
        return predict_step(validate({**cfg.model_dump(), "train": {**cfg.train.model_dump(), **train}}), 1, hw)

    after = step({}, offload_optimizer="stream", recompute="full")
    during = step(inbw, offload_optimizer="stream", recompute="full")
    eight = step({**inbw, "optimizer": "adamw_8bit"}, offload_optimizer="stream", recompute="full",
                 precision_level="O3")
    n = 8.03e9
    traffic = 2 * n * (8 + 4) / (hw.host_bandwidth_gbps * 1e9)  # fp32 moments and master, in and out
    assert after.offload == pytest.approx(traffic - hw.comm_overlap * after.optimizer, rel=0.01)
    assert during.offload < after.offload
    # 4 bytes an element in and out (2 each way, the directions at once) hide behind the backward but for
    # one block's share, which has no compute left to hide behind
    each_way = n * 2 / (hw.host_bandwidth_gbps * 1e9)
    assert eight.offload == pytest.approx(each_way / 32, rel=0.01)
    assert during.optimizer == after.optimizer  # the update's own arithmetic is the device's either way
    roomy = step({**inbw, "optimizer": "paged_adamw_8bit"}, precision_level="O3", recompute="full")
    assert roomy.offload > 0  # 15 GiB of 8-bit state beside 16 GiB of bf16 weights on a 24 GB card


def test_step_time_charges_the_host_link_for_each_lever(tmp_path: Path) -> None:
    hw = get_hardware("RTX4090")
    plain = predict_step(_cfg(tmp_path), 1, hw)
    opt = predict_step(_cfg(tmp_path, offload_optimizer=True), 1, hw)
    both = predict_step(_cfg(tmp_path, offload_optimizer=True, offload_activations=True), 1, hw)
    assert plain.offload == 0 and opt.offload > 0 and both.offload > opt.offload
    n = 8.03e9
    # At least the 16-bit weights coming back over the link, and the host's AdamW slower than the device's.
    assert opt.offload >= n * 2 / (hw.host_bandwidth_gbps * 1e9) * 0.99
    assert opt.optimizer > plain.optimizer
