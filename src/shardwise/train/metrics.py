"""Throughput, MFU and memory: what each step costs, logged to the console, JSONL and TensorBoard."""

from __future__ import annotations

import json
import logging
import platform
import resource
import time
from pathlib import Path
from typing import Any

import torch

from ..data.pretrain import default_cache_dir

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per device (no sparsity) by dtype family: "16" for bf16/fp16, "32" for fp32
# (on NVIDIA: TF32 tensor cores, which torch uses for fp32 matmuls only when allowed, so we take
# the plain fp32 figure). Sources: vendor data sheets.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"16": 989.0, "32": 67.0},
    "H100": {"16": 989.0, "32": 67.0},
    "H800": {"16": 989.0, "32": 67.0},
    "A100": {"16": 312.0, "32": 19.5},
    "A800": {"16": 312.0, "32": 19.5},
    "L40S": {"16": 362.0, "32": 91.6},
    "A10": {"16": 125.0, "32": 31.2},
    "V100": {"16": 125.0, "32": 15.7},
    "RTX 4090": {"16": 165.2, "32": 82.6},
    "Ascend910B1": {"16": 414.0, "32": 103.5},
    "Ascend910B2": {"16": 376.0, "32": 94.0},
    "Ascend910B3": {"16": 313.0, "32": 78.3},
    "Ascend910B4": {"16": 280.0, "32": 70.0},
}


def device_name(device: torch.device) -> str:
    """A human name of the device (GPU/NPU model or CPU model)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float | None = None) -> float:
    """Peak FLOP/s for MFU: configured, else the table for GPUs/NPUs, else measured on this CPU."""
    if configured_tflops:
        return configured_tflops * 1e12
    family = "32" if dtype == torch.float32 else "16"
    if device.type != "cpu":
        name = device_name(device).replace(" ", "")
        for key, peaks in PEAK_TFLOPS.items():
            if key.replace(" ", "") in name:
                return peaks[family] * 1e12
        log.warning("no peak FLOP/s known for %s; set train.peak_tflops for a meaningful MFU", name)
        return float("nan")
    return measured_cpu_flops(dtype)


def measured_cpu_flops(dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> float:
    """Best matmul FLOP/s this CPU reaches with the current thread count.

    Measured at every start (about half a second) and kept as the maximum ever seen on disk: a
    measurement taken while the machine was busy would otherwise understate the peak for good.
    """
    threads = torch.get_num_threads()
    key = f"{device_name(torch.device('cpu'))}|{threads}|{dtype}|{torch.__version__}"
    cache = Path(default_cache_dir()) / "cpu_peak.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    n = 1024
    # A private generator: drawing from the global one would shift dropout masks after a resume.
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, dtype=dtype) for _ in range(2))
    fresh = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        fresh = max(fresh, 4 * 2 * n**3 / (time.perf_counter() - t0))
    best = max(fresh, float(known.get(key, 0.0)))
    if best > known.get(key, 0.0):
        known[key] = best
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        except OSError:
            pass
    return best


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (accelerators only; CPU reports the process peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)  # type: ignore[attr-defined]


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory, or on CPU the process's peak resident set size, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2**30  # type: ignore[attr-defined]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsWriter:
    """Appends one JSON object per record to RUN_DIR/metrics.jsonl, and TensorBoard when present."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                log.debug("tensorboard is not installed; skipping event files")

    def write(self, record: dict[str, Any]) -> None:
        """Record metrics for `record['step']`."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        """Flush TensorBoard."""
        if self.tb is not None:
            self.tb.close()
