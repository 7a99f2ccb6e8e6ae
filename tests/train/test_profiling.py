"""train.profile: the trace, its summary and what its shares mean (train/profiling.py).

The runs: one process profiling steps 2-3 of a tiny model (a valid Chrome trace, summary.json in the
schema the report reads, shares that sum to 1, matmuls among the top operators, the recorded steps
exactly the asked ones); two gloo ranks under data parallelism (a communication share above 0, rank 0's
files only); a run without a profile (no profile directory). The share arithmetic and the collective
names are checked on their own against numbers worked out by hand.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from shardwise.data.packing import PackedDataset
from shardwise.errors import ConfigError
from shardwise.train.profiling import (
    MEMORY_SNAPSHOT_FILE,
    PROFILE_DIR,
    SUMMARY_FILE,
    is_communication,
    shares_of,
    time_shares,
    top_operators,
    trace_file,
)
from shardwise.train.trainer import Trainer

from ..parallel.harness import run_distributed
from .conftest import SEQ, make_tokens, tiny_config, with_changes

PROFILE = {"start_step": 2, "steps": 2}


def _train(cfg) -> object:  # noqa: ANN001
    return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(overwrite=True)


def _check_summary(summary: dict, steps: list[int]) -> None:
    assert set(summary) == {"steps", "top_operators", "shares", "trace"}
    assert summary["steps"] == steps
    assert summary["trace"] == f"{PROFILE_DIR}/{trace_file(0)}"
    assert set(summary["shares"]) == {"compute", "communication", "idle"}
    assert all(0.0 <= v <= 1.0 for v in summary["shares"].values())
    assert sum(summary["shares"].values()) == pytest.approx(1.0, abs=1e-6)
    ops = summary["top_operators"]
    assert 0 < len(ops) <= 15
    assert all(set(op) == {"name", "self_time_ms", "share"} for op in ops)
    times = [op["self_time_ms"] for op in ops]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert 0 < sum(op["share"] for op in ops) <= 1 + 1e-9
    assert not any(op["name"].startswith("ProfilerStep") for op in ops)


def test_profile_writes_a_trace_and_its_summary(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, profile=PROFILE)
    result = _train(cfg)
    assert result.step == 4  # the profile does not change the run
    out = tmp_path / "run" / PROFILE_DIR
    trace = json.loads((out / trace_file(0)).read_text())
    events = trace["traceEvents"]
    # Exactly the two asked steps are in the trace (not the warm-up step 1, nor step 4).
    assert len([e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]) == 2
    assert any(e.get("cat") == "cpu_op" for e in events)
    summary = json.loads((out / SUMMARY_FILE).read_text())
    _check_summary(summary, [2, 3])
    names = {op["name"] for op in summary["top_operators"]}
    assert names & {"aten::mm", "aten::addmm"}, names
    assert summary["shares"]["compute"] > 0.2  # a matmul-bound step is mostly computing
    assert summary["shares"]["communication"] == 0.0  # one process: nothing to communicate
    assert (out / MEMORY_SNAPSHOT_FILE).exists() == torch.cuda.is_available()  # CUDA only (run.device auto)


def test_no_profile_writes_nothing(tmp_path: Path) -> None:
    _train(tiny_config(tmp_path, max_steps=2))
    assert not (tmp_path / "run" / PROFILE_DIR).exists()


def test_a_run_resumed_past_start_step_profiles_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _train(tiny_config(tmp_path, max_steps=2))
    cfg = tiny_config(tmp_path, profile=PROFILE)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume="auto")
    assert "this run trains steps 3-4, and start_step 2 is not among them; nothing is profiled" in caplog.text
    assert not (tmp_path / "run" / PROFILE_DIR).exists()


def test_a_window_past_the_run_is_cut_or_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        _train(tiny_config(tmp_path / "cut", max_steps=3, profile={"start_step": 2, "steps": 5}))
        _train(tiny_config(tmp_path / "past", max_steps=3, profile={"start_step": 4, "steps": 1}))
    assert "the run ends at step 3, so steps 2-3 are profiled, not 5" in caplog.text
    summary = json.loads((tmp_path / "cut" / "run" / PROFILE_DIR / SUMMARY_FILE).read_text())
    _check_summary(summary, [2, 3])  # written when the loop ended inside the window
    assert "this run trains steps 1-3, and start_step 4 is not among them" in caplog.text
    assert not (tmp_path / "past" / "run" / PROFILE_DIR).exists()
    with pytest.raises(ConfigError, match="train.profile.start_step"):
        tiny_config(tmp_path, profile={"start_step": 0, "steps": 1})


def _two_ranks(rank: int, world: int, root: Path) -> dict:
    cfg = with_changes(tiny_config(root, max_steps=3, micro_batch_size=2, profile=PROFILE),
                       parallel={"data_parallel": 2})
    Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    out = root / "run" / PROFILE_DIR
    if rank == 0:
        return json.loads((out / SUMMARY_FILE).read_text())
    return {}


@pytest.mark.timeout(300)
def test_two_ranks_show_communication(tmp_path: Path) -> None:
    summary, _ = run_distributed(_two_ranks, 2, tmp_path, timeout=240)
    _check_summary(summary, [2, 3])
    assert summary["shares"]["communication"] > 0
    out = tmp_path / "run" / PROFILE_DIR
    assert sorted(p.name for p in out.iterdir()) == [SUMMARY_FILE, trace_file(0)]  # rank 0's files only


def test_collective_names() -> None:
    # gloo's and c10d's as a 2-rank gloo run records them (torch 2.13), NCCL's and HCCL's (Ascend) kernels.
    for name in ("c10d::allreduce_", "gloo:all_reduce", "nccl:all_gather", "_c10d_functional::reduce_scatter_tensor",
                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "c10d::broadcast_", "gloo:send", "c10d::_allgather_base_",
                 "gloo:barrier", "_c10d_functional::wait_tensor", "ncclKernel_AllGather_RING_LL_Sum_int8_t",
                 "hcom_allReduce__123_0", "HcclAllReduce", "hccl:all_reduce", "record_param_comms"):
        assert is_communication(name), name
    # Computation whose names hold a collective's words: FSDP's copy-in is an annotation around copies.
    for name in ("aten::mm", "aten::broadcast_tensors", "aten::copy_", "AddmmBackward0", "FSDP::all_gather_copy_in",
                 "FSDP::all_gather_copy_out", "aten::_foreach_add_"):
        assert not is_communication(name), name


def test_shares_by_hand() -> None:
    # Two steps of 10 and 10 time units with a gap between them (not step time).
    steps = [(0, 10), (20, 30)]
    # Computing 0-4 and 6-8 (overlapping intervals count once) and 20-25: 11 units; a collective runs 3-7
    # (exposed 4-6: 2 units) and 25-27 (2 units), and 12-15 between the steps (not counted); idle 5 units.
    compute = [(0, 4), (1, 3), (6, 8), (20, 25)]
    communication = [(3, 7), (12, 15), (25, 27)]
    shares = shares_of(steps, compute, communication)
    assert shares == pytest.approx({"compute": 11 / 20, "communication": 4 / 20, "idle": 5 / 20})
    assert shares_of([], compute, communication) == {"compute": 0.0, "communication": 0.0, "idle": 1.0}
    # The computing thread inside a collective communicates, even within a computing operator (5-8 of 0-10);
    # a background collective counts only where nothing computes (8-9 is hidden, 7-9 of the second case
    # is not).
    assert shares_of([(0, 10)], [(0, 10)], [(8, 9)], blocking=[(5, 8)]) == pytest.approx(
        {"compute": 0.7, "communication": 0.3, "idle": 0.0})
    assert shares_of([(0, 10)], [(0, 5)], [(7, 9)], blocking=[(4, 6)]) == pytest.approx(
        {"compute": 0.4, "communication": 0.4, "idle": 0.2})
    # Communication wholly hidden behind computation costs no time.
    assert shares_of([(0, 10)], [(0, 10)], [(2, 5)]) == pytest.approx({"compute": 1.0, "communication": 0.0,
                                                                       "idle": 0.0})


def _event(name: str, start: float, end: float, device: DeviceType = DeviceType.CPU, thread: int = 1,
           annotation: bool = False, parent: object = None) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           thread=thread, is_user_annotation=annotation, is_async=False, cpu_parent=parent)


def test_shares_from_events_on_the_cpu_and_on_cuda() -> None:
    """The events as prof.events() gives them (fakes): which count as compute, communication, neither."""
    step = _event("ProfilerStep*", 0, 100, annotation=True)
    op = _event("aten::linear", 0, 40, parent=step)
    nested = _event("aten::mm", 5, 30, parent=op)  # inside a top-level operator: not counted again
    fsdp = _event("FSDP::pre_forward", 40, 60, annotation=True, parent=step)
    under_annotation = _event("aten::copy_", 45, 50, parent=fsdp)  # top-level: annotations do not count
    collective = _event("c10d::allreduce_", 60, 70, parent=step)
    gloo = _event("gloo:all_reduce", 65, 80, thread=2, annotation=True)  # a worker thread: exposed 70-80
    kernel = _event("sm90_gemm", 10, 50, device=DeviceType.CUDA)
    nccl = _event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 40, 90, device=DeviceType.CUDA)
    events = [step, op, nested, fsdp, under_annotation, collective, gloo, kernel, nccl]
    # CPU: compute 0-40 and 45-50; communication 60-80; the kernels are no CPU time.
    assert time_shares(events) == pytest.approx({"compute": 0.45, "communication": 0.2, "idle": 0.35})
    # CUDA: compute is the kernels' 10-50, communication the NCCL kernel's exposed 50-90; host ops not at all.
    assert time_shares(events, on_device=True) == pytest.approx({"compute": 0.4, "communication": 0.4,
                                                                 "idle": 0.2})


def test_top_operators_on_cuda_leave_kernel_rows_out() -> None:
    def row(key: str, cpu_us: float, device_us: float, device: DeviceType = DeviceType.CPU,
            annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(key=key, self_cpu_time_total=cpu_us, self_device_time_total=device_us,
                               device_type=device, is_user_annotation=annotation)

    rows = [row("aten::mm", 100, 3000), row("aten::add", 300, 1000), row("sm90_gemm", 0, 3000, DeviceType.CUDA),
            row("ProfilerStep*", 5000, 0, annotation=True), row("Optimizer.step#AdamW.step", 900, 0, annotation=True)]
    assert top_operators(rows) == [{"name": "aten::add", "self_time_ms": 0.3, "share": 0.75},
                                   {"name": "aten::mm", "self_time_ms": 0.1, "share": 0.25},
                                   {"name": "sm90_gemm", "self_time_ms": 0.0, "share": 0.0}]
    assert top_operators(rows, on_device=True) == [{"name": "aten::mm", "self_time_ms": 3.0, "share": 0.75},
                                                   {"name": "aten::add", "self_time_ms": 1.0, "share": 0.25}]


def test_shares_on_cuda_cover_the_kernels_that_run_after_the_host_span() -> None:
    """The host queues a step's kernels and ends its span before the device has run them all: the shares cover
    the device's time to the last kernel, not only the host span (the kernels cut off at 100 would be lost)."""
    step = _event("ProfilerStep*", 0, 100, annotation=True)
    gemm = _event("sm90_gemm", 40, 130, device=DeviceType.CUDA)
    nccl = _event("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 130, 160, device=DeviceType.CUDA)
    # Time 0-160: compute 40-130, exposed communication 130-160, idle 0-40.
    assert time_shares([step, gemm, nccl], on_device=True) == pytest.approx(
        {"compute": 90 / 160, "communication": 30 / 160, "idle": 40 / 160})
    # A device that finishes within the host span: the span is the time, as before.
    assert time_shares([step, _event("sm90_gemm", 10, 60, device=DeviceType.CUDA)], on_device=True) == \
        pytest.approx({"compute": 0.5, "communication": 0.0, "idle": 0.5})
