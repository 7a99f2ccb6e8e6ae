"""Profiling: real steps of a layout in local processes, and the calibration fit."""

from __future__ import annotations

import pytest

from shardwise.hardware import get_hardware
from shardwise.memory.estimate import estimate_memory
from shardwise.plan.profile import Run, calibrate, measure_layout
from shardwise.resolve import resolve_config as validate
from shardwise.step_time import predict_step


def config(**parallel: int):  # noqa: ANN201
    return validate({"model": {"preset": "demo_llama"}, "data": {"seq_length": 256},
                     "parallel": {"data_parallel": 1, **parallel},
                     "train": {"max_steps": 1, "global_batch_size": 16, "micro_batch_size": 4}})


def test_calibration_recovers_the_machine() -> None:
    hw = get_hardware("cpu")
    truth = hw.with_changes(compute_efficiency=0.3, comm_efficiency=0.2, cores_per_node=1.4,
                            tp_layer_overhead_us=3000.0)
    layouts = [(config(), 1), (config(data_parallel=2), 2), (config(tensor_parallel=2), 2),
               (config(pipeline_parallel=2, micro_batch_num=4), 2), (config(data_parallel=4), 4),
               (config(data_parallel=2, tensor_parallel=2), 4), (config(data_parallel=2, zero_stage=3), 2)]
    runs = [Run(cfg=cfg, devices=n, step_times=[predict_step(cfg, n, truth).total]) for cfg, n in layouts]
    cal = calibrate(hw, runs)
    assert max(abs(e) for e in cal.errors()) < 0.02
    assert max(abs(e) for e in cal.errors(after=False)) > 0.3  # the catalogue values were far off
    assert cal.hardware.compute_efficiency == pytest.approx(0.3, rel=0.1)
    assert cal.hardware.cores_per_node == pytest.approx(1.4, rel=0.1)


def test_measure_a_data_parallel_layout() -> None:
    cfg = validate({"model": {"preset": "tiny_llama"}, "data": {"seq_length": 64},
                    "parallel": {"data_parallel": 2, "zero_stage": 1},
                    "train": {"max_steps": 1, "global_batch_size": 8, "micro_batch_size": 2}})
    run = measure_layout(cfg, 2, steps=2, warmup=1, memory=True, label="DP2 ZeRO-1")
    assert len(run.step_times) == 2 and all(t > 0 for t in run.step_times)
    assert len(run.memory_peaks) == 2
    # The estimator counts the same live tensor bytes the tracker measures.
    assert run.memory_peak == pytest.approx(estimate_memory(cfg, 2, "cpu").peak, rel=0.10)
