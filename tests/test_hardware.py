"""The hardware catalogue, user YAML files, custom hardware, and the peak FLOP/s that MFU divides by."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import shardwise.hardware as hardware
from shardwise.errors import ConfigError
from shardwise.hardware import (
    CATALOGUE,
    PEAK_TFLOPS,
    Peak,
    best_rate,
    custom_hardware,
    device_peak,
    get_hardware,
    keep_best,
    load_hardware_file,
    measured_cpu_flops,
    table_peak_tflops,
)


def test_catalogue_holds_the_devices_of_the_issue() -> None:
    for name in ("H100", "H100-PCIe", "H200", "A100-40GB", "A100-80GB", "Ascend910B1", "Ascend910B2", "Ascend910B3",
                 "Ascend910B4", "cpu"):
        assert name in CATALOGUE
    # The peaks are the ones MFU is measured against during training.
    assert CATALOGUE["H100"].tflops_16 == PEAK_TFLOPS["H100"]["16"] == 989.0
    assert CATALOGUE["A100-40GB"].memory_gib == 40 and CATALOGUE["A100-80GB"].memory_gib == 80
    assert CATALOGUE["Ascend910B3"].tflops_16 == PEAK_TFLOPS["Ascend910B3"]["16"]
    assert CATALOGUE["Ascend910B4"].memory_gib == 32
    cpu = CATALOGUE["cpu"]
    assert cpu.kind == "cpu" and 1 <= cpu.cores_per_node <= 2 and cpu.tflops_32 > 0 and cpu.intra_bandwidth_gbps > 0


def test_device_names_find_their_table_peak() -> None:
    assert table_peak_tflops("NVIDIA H100 80GB HBM3", fp32=False) == ("H100", 989.0)
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB", fp32=True) == ("A100", 19.5)
    assert table_peak_tflops("NVIDIA GeForce RTX 4090", fp32=False) == ("RTX 4090", 165.2)
    assert table_peak_tflops("Ascend910B3", fp32=False) == ("Ascend910B3", 313.0)
    assert table_peak_tflops("Some Future GPU", fp32=False) is None


class _FakeClock:
    """A clock that moves only when the timed function runs, by the durations given."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations = 0.0, iter(durations)

    def __call__(self) -> float:
        return self.now

    def run(self) -> None:
        self.now += next(self.durations)


def test_best_rate_keeps_the_fastest_timed_call() -> None:
    # The untimed first call is the fastest; then 0.2, 0.1, 0.4, 0.3 s fill the 1 s budget.
    clock = _FakeClock([0.01, 0.2, 0.1, 0.4, 0.3])
    assert best_rate(clock.run, work=1.0, seconds=1.0, clock=clock) == pytest.approx(10.0)
    # At least three timed calls, however long they take.
    clock = _FakeClock([0.0, 5.0, 4.0, 8.0])
    assert best_rate(clock.run, work=2.0, seconds=1.0, clock=clock) == pytest.approx(0.5)


def test_names_are_found_case_insensitively_and_by_alias() -> None:
    assert get_hardware("h100").name == "H100"
    assert get_hardware("910B").name == "Ascend910B3"
    assert get_hardware("a100").name == "A100-80GB"


def test_user_file(tmp_path: Path) -> None:
    path = tmp_path / "hw.yaml"
    path.write_text("my-h800:\n  like: H100\n  inter_bandwidth_gbps: 25\n"
                    "small-gpu:\n  memory_gib: 24\n  tflops_16: 165\n  intra_bandwidth_gbps: 32\n")
    table = load_hardware_file(path)
    assert table["my-h800"].tflops_16 == 989 and table["my-h800"].inter_bandwidth_gbps == 25
    small = table["small-gpu"]
    assert (small.memory_gib, small.tflops_16, small.tflops_32, small.inter_bandwidth_gbps) == (24, 165, 165 / 8, 32)
    assert get_hardware("MY-H800", table).name == "my-h800"
    path.write_text("bad:\n  memory_gb: 24\n")
    with pytest.raises(ConfigError, match="memory_gb is not a hardware field; did you mean memory_gib"):
        load_hardware_file(path)
    path.write_text("bad:\n  memory_gib: 24\n")
    with pytest.raises(ConfigError, match="needs tflops_16, intra_bandwidth_gbps"):
        load_hardware_file(path)


def test_custom_hardware() -> None:
    hw = custom_hardware(48, 362, 32)
    assert (hw.memory_gib, hw.tflops_16, hw.intra_bandwidth_gbps) == (48, 362, 32)
    with pytest.raises(ConfigError, match="--tflops -1"):
        custom_hardware(48, -1, 32)


# --- the peak ------------------------------------------------------------------------------------------------


def _no_measurement(*args, **kwargs) -> float:
    raise AssertionError("the CPU peak was measured")


def test_a_configured_peak_wins_and_nothing_is_measured(monkeypatch) -> None:
    monkeypatch.setattr(hardware, "matmul_flops", _no_measurement)
    assert device_peak(torch.device("cpu"), torch.float32, 2.5) == Peak(2.5e12, "train.peak_tflops")
    assert math.isnan(device_peak(torch.device("cpu"), torch.float32, measure=False).flops)


def test_the_cpu_peak_is_the_best_measured_and_the_cache_changes_only_when_beaten(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    rates = iter([5e10, 3e10, 8e10])
    monkeypatch.setattr(hardware, "matmul_flops", lambda dtype, seconds=0.5: next(rates))
    cache = tmp_path / "cpu_peak.json"
    cache.write_text(json.dumps({"another cpu|4|torch.float32|2.0": 9e11}))
    assert measured_cpu_flops() == 5e10
    written = cache.read_bytes()
    stamp = cache.stat().st_mtime_ns
    assert measured_cpu_flops() == 5e10  # a busy measurement: the best so far is used, the file untouched
    assert cache.read_bytes() == written and cache.stat().st_mtime_ns == stamp
    peak = device_peak(torch.device("cpu"), torch.float32)
    assert peak == Peak(8e10, "measured on this CPU")
    known = json.loads(cache.read_text())
    assert sorted(known.values()) == [8e10, 9e11]  # other keys are kept
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_torn_cache_file_is_replaced(tmp_path) -> None:
    cache = tmp_path / "cpu_peak.json"
    cache.write_text('{"key": 1e1')
    assert keep_best(cache, "key", 4.0) == 4.0 and json.loads(cache.read_text()) == {"key": 4.0}
