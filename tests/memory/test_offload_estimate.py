"""The estimator and the step-time model count each offload lever where it lives (issue 13, item 5): the
device figure without what went to the host, the host figure beside it; on the CPU (one memory) the
two together are the count that bench/memory_check.py holds against measurement."""

from __future__ import annotations

from pathlib import Path

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


def test_llama3_8b_full_fine_tune_fits_24_gb_with_both_offloads(tmp_path: Path) -> None:
    """Issue 13's target: bf16 weights on the device, masters, state and saved block inputs on the host."""
    est = estimate_memory(_cfg(tmp_path, offload_optimizer=True, offload_activations=True, loss_chunk_tokens=256),
                          1, "cuda")
    assert est.peak <= 18 * GIB, est.table()
    assert est.host > 100 * GIB


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
