"""What a device can do: the catalogue the planner and the trainer's MFU both read, and this CPU's peak.

Every figure is per device (one GPU, one NPU, or one CPU process). Bandwidths are GB/s (1e9 bytes)
in one direction; `intra` links join the devices of one node (NVLink, HCCS, shared memory), `inter`
links join nodes (InfiniBand, RoCE), counted per device (a node with 8 GPUs and 8 x 400 Gb/s NICs
gives 50 GB/s). Memory is GiB. Peak TFLOP/s are dense (no sparsity) and come from `PEAK_TFLOPS`,
the table the trainer's MFU also divides by (`device_peak`), so that a plan and a run speak of the
same MFU.

Two fractions turn peaks into predictions: `compute_efficiency` (the share of peak FLOP/s that
large training matmuls reach in eager PyTorch) and `comm_efficiency` (the share of a link's nominal
bandwidth that collectives reach). `shardwise plan --profile N` fits both on the devices present.

A user file (`--hardware-file my.yaml`) holds one mapping per device name, with the fields of
`Hardware` (name comes from the key); `like: H100` starts from a catalogue entry:

    my-h800:
      like: H100
      inter_bandwidth_gbps: 25      # 200 Gb/s per GPU between nodes
    tiny-gpu:
      memory_gib: 24
      tflops_16: 165
      tflops_32: 82.6
      intra_bandwidth_gbps: 32

The peak MFU divides by (`device_peak`) is `train.peak_tflops` when configured, else the table for
GPUs/NPUs, else the best matmul rate ever measured on this CPU, kept in `cpu_peak.json` in the cache
directory: a measurement taken while other jobs ran is low, and must neither be used nor replace a
better one.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .data.files import default_cache_dir
from .errors import ConfigError
from .files import write_json_atomic
from .untrusted import int_field, kind_of, number_field, read_json_object, read_yaml, str_field

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per device (no sparsity) by dtype family: "16" for bf16/fp16, "32" for fp32
# (on NVIDIA: TF32 tensor cores, which torch uses for fp32 matmuls only when allowed, so we take
# the plain fp32 figure). Sources: vendor data sheets. "8": dense float8 (e4m3/e5m2) tensor-core peak
# with fp32 accumulation, where the device has float8 tensor cores (optimize.float8): half the
# "with sparsity" figure of the data sheets: H100 SXM and H200 3,958 -> 1,979, H100 PCIe 3,026 -> 1,513
# (NVIDIA H100 and H200 Tensor Core GPU data sheets; H800 has H100's compute), L40S 1,466 -> 733 (L40S
# data sheet), RTX 4090 330.3 with fp32 accumulate (NVIDIA Ada Lovelace architecture whitepaper, appendix A).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"16": 989.0, "32": 67.0, "8": 1979.0},
    "H100": {"16": 989.0, "32": 67.0, "8": 1979.0},
    "H800": {"16": 989.0, "32": 67.0, "8": 1979.0},
    "A100": {"16": 312.0, "32": 19.5},
    "A800": {"16": 312.0, "32": 19.5},
    "L40S": {"16": 362.0, "32": 91.6, "8": 733.0},
    "A10": {"16": 125.0, "32": 31.2},
    "V100": {"16": 125.0, "32": 15.7},
    "RTX 4090": {"16": 165.2, "32": 82.6, "8": 330.3},
    "Ascend910B1": {"16": 414.0, "32": 103.5},
    "Ascend910B2": {"16": 376.0, "32": 94.0},
    "Ascend910B3": {"16": 313.0, "32": 78.3},
    "Ascend910B4": {"16": 280.0, "32": 70.0},
}


def table_peak_tflops(device_name: str, fp32: bool) -> tuple[str, float] | None:
    """(table key, dense peak TFLOP/s) of the device whose name contains a key of `PEAK_TFLOPS`
    (spaces ignored: "NVIDIA H100 80GB HBM3" is an H100), None when none does."""
    name = device_name.replace(" ", "")
    for key, peaks in PEAK_TFLOPS.items():
        if key.replace(" ", "") in name:
            return key, peaks["32" if fp32 else "16"]
    return None


@dataclass(frozen=True)
class Hardware:
    """One kind of device and the links between such devices."""

    name: str
    memory_gib: float                     # device memory (CPU: the node's RAM, shared by its processes)
    tflops_16: float                      # dense bf16/fp16 peak
    tflops_32: float                      # dense fp32 peak (not TF32)
    memory_bandwidth_gbps: float          # device memory bandwidth (the optimizer step is bound by it)
    intra_bandwidth_gbps: float           # per device, one direction, inside a node
    inter_bandwidth_gbps: float           # per device, one direction, between nodes
    intra_latency_us: float = 5.0         # per collective step inside a node
    inter_latency_us: float = 15.0        # per collective step between nodes
    devices_per_node: int = 8
    host_bandwidth_gbps: float = 25.0     # device <-> host (PCIe), for CPU offload
    tflops_8: float = 0.0                 # dense float8 peak (optimize.float8); 0: no float8 tensor cores
    reserved_gib: float = 1.0             # taken by the runtime (CUDA context, CANN workspace) before any tensor
    compute_efficiency: float = 0.45      # achievable fraction of peak FLOP/s for training matmuls
    comm_efficiency: float = 0.8          # achievable fraction of link bandwidth for collectives
    comm_overlap: float = 0.9             # share of concurrent compute that can hide data-parallel traffic
    tp_layer_overhead_us: float = 0.0     # host time per layer and micro-batch that tensor parallelism's
                                          # DTensor dispatch adds (hidden behind GPU kernels; a CPU pays it)
    kind: str = "cuda"                    # "cuda", "npu" or "cpu": how memory is estimated and runs are launched
    cores_per_node: Optional[float] = None  # CPU: cores' worth of compute; more busy processes share them
    source: str = ""                      # where the numbers come from

    def peak_tflops(self, precision: str) -> float:
        """Peak TFLOP/s for a training precision ("fp32", "bf16", "fp16")."""
        return self.tflops_32 if precision == "fp32" else self.tflops_16

    def nodes_for(self, devices: int) -> int:
        """Nodes that `devices` devices fill."""
        return max(1, -(-devices // self.devices_per_node))

    def with_changes(self, **changes: Any) -> "Hardware":
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line: memory, peaks and links."""
        if self.kind == "cpu":
            return (f"{self.name}: one-thread processes on {self.cores_per_node:g} cores' worth of compute, "
                    f"{self.tflops_32:g} TFLOP/s fp32 each, {self.memory_gib:g} GiB RAM, "
                    f"{self.intra_bandwidth_gbps:g} GB/s between processes")
        return (f"{self.name}: {self.memory_gib:g} GiB, {self.tflops_16:g} TFLOP/s bf16 / {self.tflops_32:g} fp32, "
                f"links {self.intra_bandwidth_gbps:g} GB/s in a node ({self.devices_per_node} per node), "
                f"{self.inter_bandwidth_gbps:g} GB/s between nodes")


def _peaks(table_key: str) -> dict[str, float]:
    return {"tflops_16": PEAK_TFLOPS[table_key]["16"], "tflops_32": PEAK_TFLOPS[table_key]["32"],
            "tflops_8": PEAK_TFLOPS[table_key].get("8", 0.0)}


# Link figures: NVLink 4 (H100/H200 SXM) 900 GB/s both directions = 450 each way; NVLink 3 (A100 SXM)
# 600 -> 300; PCIe Gen5 x16 64 GB/s, Gen4 32 GB/s each way. Between nodes one NIC per GPU: NDR
# InfiniBand 400 Gb/s = 50 GB/s (H100/H200), HDR 200 Gb/s = 25 GB/s (A100). Ascend 910B (Atlas 800T
# A2): HCCS full mesh, 7 x 56 GB/s links, taken as 196 GB/s each way; 8 x 200 GbE RoCE = 25 GB/s per
# NPU (seed 002's cluster has 100 GbE: pass --inter-bandwidth-gbps 12.5). Memory bandwidths and sizes
# are the vendors' data sheets. compute_efficiency: shardwise reached 38.4% MFU with qwen2_1.5b in
# bf16 on one H200, optimizer step included (bench/README.md), so about 0.42 for the matmuls;
# the older A100 reaches a larger share of its lower peak; Ascend figures are public reports.
_NVIDIA = "NVIDIA data sheets; compute_efficiency from shardwise on one H200 (bench/README.md)"
_ASCEND = "Huawei Atlas 800T A2 / 910B public specifications (approximate); fit with --profile"

CATALOGUE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("H100", memory_gib=80, **_peaks("H100"), memory_bandwidth_gbps=3350, intra_bandwidth_gbps=450,
             inter_bandwidth_gbps=50, host_bandwidth_gbps=64, compute_efficiency=0.42, source=_NVIDIA + "; SXM5"),
    Hardware("H100-PCIe", memory_gib=80, tflops_16=756, tflops_32=51, tflops_8=1513, memory_bandwidth_gbps=2000,
             intra_bandwidth_gbps=64, inter_bandwidth_gbps=25, intra_latency_us=10, host_bandwidth_gbps=64,
             compute_efficiency=0.42, source=_NVIDIA + "; PCIe Gen5 between GPUs, one 400 Gb/s NIC per 2 GPUs"),
    Hardware("H200", memory_gib=141, **_peaks("H200"), memory_bandwidth_gbps=4800, intra_bandwidth_gbps=450,
             inter_bandwidth_gbps=50, host_bandwidth_gbps=64, compute_efficiency=0.42, source=_NVIDIA + "; SXM"),
    Hardware("A100-40GB", memory_gib=40, **_peaks("A100"), memory_bandwidth_gbps=1555, intra_bandwidth_gbps=300,
             inter_bandwidth_gbps=25, host_bandwidth_gbps=32, compute_efficiency=0.5, source=_NVIDIA + "; SXM4"),
    Hardware("A100-80GB", memory_gib=80, **_peaks("A100"), memory_bandwidth_gbps=2039, intra_bandwidth_gbps=300,
             inter_bandwidth_gbps=25, host_bandwidth_gbps=32, compute_efficiency=0.5, source=_NVIDIA + "; SXM4"),
    # A 24 GB consumer card (torchtune publishes its memory figures on one): no NVLink, PCIe 4.0 x16
    # between cards. compute_efficiency is A100's, assumed, not measured on such a card.
    Hardware("RTX4090", memory_gib=24, **_peaks("RTX 4090"), memory_bandwidth_gbps=1008, intra_bandwidth_gbps=25,
             inter_bandwidth_gbps=12.5, intra_latency_us=10, host_bandwidth_gbps=25, compute_efficiency=0.5,
             source="NVIDIA Ada data sheet (GeForce RTX 4090: 24 GB GDDR6X, bf16 dense with fp32 accumulate); "
                    "PCIe 4.0 x16 between cards"),
    Hardware("Ascend910B1", memory_gib=64, **_peaks("Ascend910B1"), memory_bandwidth_gbps=1600,
             intra_bandwidth_gbps=196, inter_bandwidth_gbps=25, intra_latency_us=8, inter_latency_us=20,
             host_bandwidth_gbps=32, reserved_gib=2.5, compute_efficiency=0.4, kind="npu", source=_ASCEND),
    Hardware("Ascend910B2", memory_gib=64, **_peaks("Ascend910B2"), memory_bandwidth_gbps=1600,
             intra_bandwidth_gbps=196, inter_bandwidth_gbps=25, intra_latency_us=8, inter_latency_us=20,
             host_bandwidth_gbps=32, reserved_gib=2.5, compute_efficiency=0.4, kind="npu", source=_ASCEND),
    Hardware("Ascend910B3", memory_gib=64, **_peaks("Ascend910B3"), memory_bandwidth_gbps=1600,
             intra_bandwidth_gbps=196, inter_bandwidth_gbps=25, intra_latency_us=8, inter_latency_us=20,
             host_bandwidth_gbps=32, reserved_gib=2.5, compute_efficiency=0.4, kind="npu", source=_ASCEND),
    Hardware("Ascend910B4", memory_gib=32, **_peaks("Ascend910B4"), memory_bandwidth_gbps=800,
             intra_bandwidth_gbps=196, inter_bandwidth_gbps=25, intra_latency_us=8, inter_latency_us=20,
             host_bandwidth_gbps=32, reserved_gib=2.5, compute_efficiency=0.4, kind="npu", source=_ASCEND),
    # This machine, measured: a device is one process with one thread. Peaks, memory and gloo rates
    # are the best of `plan.calibrate.measure_cpu` runs on 2026-11-30 (1024 x 1024 matmuls, a 64 MiB
    # copy, gloo all-reduce bus bandwidth of 64 MiB and latency of 4 bytes between 2 processes; the
    # machine was shared with other jobs, so best-of). The efficiencies, the 2 vCPUs' worth for several
    # processes at once (1.82 cores) and TP's host work are fitted by bench/plan_calibration.py
    # (bench/README.md, "Planner calibration"); gloo's all-reduce is CPU work here, so comm_efficiency is low.
    Hardware("cpu", memory_gib=23.5, tflops_16=0.0157, tflops_32=0.149, memory_bandwidth_gbps=8.8,
             intra_bandwidth_gbps=1.10, inter_bandwidth_gbps=1.10, intra_latency_us=121, inter_latency_us=121,
             devices_per_node=64, host_bandwidth_gbps=8.8, reserved_gib=0.0, compute_efficiency=0.289,
             comm_efficiency=0.070, comm_overlap=0.0, tp_layer_overhead_us=30500.0, kind="cpu", cores_per_node=1.82,
             source="measured on this machine (measure_cpu + bench/plan_calibration.py, 2026-11-30)"),
)}

# Names people use for the same devices.
ALIASES = {"rtx-4090": "RTX4090", "4090": "RTX4090",
           "h100-sxm": "H100", "h100sxm": "H100", "h100-80gb": "H100", "h200-sxm": "H200", "a100": "A100-80GB",
           "a100-40g": "A100-40GB", "a100-80g": "A100-80GB", "910b": "Ascend910B3", "ascend910b": "Ascend910B3",
           "910b1": "Ascend910B1", "910b2": "Ascend910B2", "910b3": "Ascend910B3", "910b4": "Ascend910B4"}

_FIELDS = {f.name for f in dataclasses.fields(Hardware)}


def known_names(extra: dict[str, Hardware] | None = None) -> list[str]:
    """Catalogue names (and a user file's)."""
    return list(CATALOGUE) + [n for n in (extra or {}) if n not in CATALOGUE]


def get_hardware(name: str, extra: dict[str, Hardware] | None = None) -> Hardware:
    """A catalogue (or user file) entry by name, case-insensitive; ConfigError listing the known ones."""
    table = {**CATALOGUE, **(extra or {})}
    by_lower = {k.lower(): k for k in table}
    key = by_lower.get(name.lower()) or ALIASES.get(name.lower())
    if key is None:
        close = difflib.get_close_matches(name, list(table), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"hardware {name!r} is not known{hint} Known: {', '.join(known_names(extra))}. "
                          "Describe your own with --memory-gb, --tflops and --bandwidth-gbps, or in a YAML file "
                          "given with --hardware-file")
    return table[key]


def custom_hardware(memory_gb: float, tflops: float, bandwidth_gbps: float, base: Hardware | None = None,
                    name: str = "custom") -> Hardware:
    """A device described on the command line: memory (GiB), bf16 peak TFLOP/s, link GB/s."""
    for what, value in (("--memory-gb", memory_gb), ("--tflops", tflops), ("--bandwidth-gbps", bandwidth_gbps)):
        if value is not None and value <= 0:
            raise ConfigError(f"{what} {value}: give a positive number")
    base = base or CATALOGUE["H100"].with_changes(name=name, source="given on the command line")
    changes: dict[str, Any] = {}
    if memory_gb is not None:
        changes["memory_gib"] = memory_gb
    if tflops is not None:
        changes.update(tflops_16=tflops,
                       tflops_32=base.tflops_32 * tflops / base.tflops_16 if base.tflops_16 else tflops,
                       tflops_8=base.tflops_8 * tflops / base.tflops_16 if base.tflops_16 else 0.0)
    if bandwidth_gbps is not None:
        changes["intra_bandwidth_gbps"] = bandwidth_gbps
    return base.with_changes(**changes)


# Each field of a hardware file: (lowest, highest) for numbers; the kind's names; None: any short text.
_POSITIVE = ("memory_gib", "tflops_16", "tflops_32", "memory_bandwidth_gbps", "intra_bandwidth_gbps",
             "inter_bandwidth_gbps", "host_bandwidth_gbps")
_FRACTIONS = ("compute_efficiency", "comm_efficiency", "comm_overlap")
_KINDS = ("cuda", "npu", "cpu")
_MAX_FIGURE = 1e9  # no device has a billion GiB, TFLOP/s or GB/s


def _hardware_name(name: Any, path: str | os.PathLike) -> str:
    """An entry's name: a line of text (it is printed in tables and drawn on charts)."""
    if not isinstance(name, str) or not 0 < len(name) <= 200 or not name.isprintable():
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise ConfigError(f"{path}: the entry {shown} needs a name of 1 to 200 printable characters (no line "
                          "breaks or control characters)")
    return name


def _hardware_fields(fields: dict, name: str, path: str | os.PathLike) -> dict[str, Any]:
    """The fields of one entry, each checked for its type and range (ConfigError naming entry and field)."""
    where = f"{path}: {name}"
    out: dict[str, Any] = {}
    for key in fields:
        if key in _POSITIVE or key in _FRACTIONS or key in ("tflops_8", "reserved_gib", "intra_latency_us",
                                                           "inter_latency_us", "tp_layer_overhead_us"):
            hi = 1.0 if key in _FRACTIONS else _MAX_FIGURE
            value = number_field(fields, key, where, ConfigError, lo=0.0, hi=hi)
            if value == 0 and (key in _POSITIVE or key in ("compute_efficiency", "comm_efficiency")):
                raise ConfigError(f"{where}: {key!r} is 0, but it must be positive")
            out[key] = value
        elif key == "cores_per_node":
            value = number_field(fields, key, where, ConfigError, lo=0.0, hi=_MAX_FIGURE, default=None)
            if value == 0:
                raise ConfigError(f"{where}: 'cores_per_node' is 0, but it must be positive (or left out)")
            out[key] = value
        elif key == "devices_per_node":
            out[key] = int_field(fields, key, where, ConfigError, lo=1, hi=1_000_000)
        elif key == "kind":
            out[key] = str_field(fields, key, where, ConfigError, max_len=10)
            if out[key] not in _KINDS:
                raise ConfigError(f"{where}: 'kind' is {out[key]!r}; give one of {', '.join(_KINDS)}")
        elif key == "source":
            out[key] = str_field(fields, key, where, ConfigError, max_len=1000)
    return out


def load_hardware_file(path: str | os.PathLike) -> dict[str, Hardware]:
    """Entries of a user YAML file (name -> fields, `like: NAME` to start from a known entry), each
    field checked for its type and range: ConfigError naming the file, the entry and the field."""
    raw = read_yaml(path, ConfigError, advice="see `shardwise plan --list-hardware` and docs for the format")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: holds {kind_of(raw)}, not a mapping of device names to their fields")
    out: dict[str, Hardware] = {}
    for name, fields in raw.items():
        name = _hardware_name(name, path)
        if not isinstance(fields, dict):
            raise ConfigError(f"{path}: {name} must be a mapping of fields ({', '.join(sorted(_FIELDS - {'name'}))})")
        fields = dict(fields)
        like = fields.pop("like", None)
        unknown = sorted((k for k in fields if k not in _FIELDS or k == "name"), key=str)
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), sorted(_FIELDS), n=1, cutoff=0.5)
            raise ConfigError(f"{path}: {name}.{str(unknown[0])[:100]} is not a hardware field"
                              + (f"; did you mean {close[0]}?" if close else "")
                              + f" Fields: {', '.join(sorted(_FIELDS - {'name'}))}")
        fields = _hardware_fields(fields, name, path)
        if like is not None:
            if not isinstance(like, str) or len(like) > 200:
                raise ConfigError(f"{path}: {name}.like is {kind_of(like)}; give the name of a known device")
            base = get_hardware(like, out)
            source = fields.pop("source", f"{path} (like {base.name})")
            out[name] = base.with_changes(name=name, source=source, **fields)
            continue
        required = ("memory_gib", "tflops_16", "intra_bandwidth_gbps")
        missing = [f for f in required if f not in fields]
        if missing:
            raise ConfigError(f"{path}: {name} needs {', '.join(missing)} (or `like: H100` to start from a "
                              "known device)")
        fields.setdefault("tflops_32", fields["tflops_16"] / 8)
        fields.setdefault("memory_bandwidth_gbps", 1000.0)
        fields.setdefault("inter_bandwidth_gbps", fields["intra_bandwidth_gbps"])
        fields.setdefault("source", str(path))
        out[name] = Hardware(name=name, **fields)
    return out


# --- measuring this CPU -------------------------------------------------------------------------------


def best_rate(fn: Callable[[], Any], work: float, seconds: float, min_trials: int = 3,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """The best work/s of `fn` over repeated calls for about `seconds` (at least `min_trials` calls).

    A busy machine only ever slows a call down, so the fastest call is the closest to the machine's
    own rate; the first call (thread start-up, first-touch allocation) is not timed.
    """
    fn()
    best, trials, end = 0.0, 0, clock() + seconds
    while trials < min_trials or clock() < end:
        t0 = clock()
        fn()
        best = max(best, work / max(clock() - t0, 1e-12))
        trials += 1
    return best


def matmul_flops(dtype: torch.dtype = torch.float32, seconds: float = 0.5, n: int = 1024,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Best FLOP/s of an n x n matmul on this CPU with the current thread count (`best_rate`)."""
    # A private generator: drawing from the global one would shift dropout masks after a resume.
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    return best_rate(lambda: a @ b, 2 * n**3, seconds, clock=clock)


def cpu_peak_cache() -> Path:
    """The file that keeps the best CPU matmul rate measured so far, per CPU, threads, dtype and torch."""
    return Path(default_cache_dir()) / "cpu_peak.json"


def measured_cpu_flops(dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> float:
    """The best matmul FLOP/s this CPU has reached with the current thread count.

    Measured at every start (`matmul_flops`: the fastest of short trials over about `seconds`) and
    compared with the best ever measured, kept on disk: a measurement taken while the machine was
    busy is low, and must neither be used nor replace a better one. The file is written only when
    the new measurement beats it.
    """
    key = f"{device_name(torch.device('cpu'))}|{torch.get_num_threads()}|{dtype}|{torch.__version__}"
    return keep_best(cpu_peak_cache(), key, matmul_flops(dtype, seconds))


def keep_best(path: Path, key: str, value: float) -> float:
    """max(value, the figure stored under `key` in the JSON file `path`); the file is rewritten (whole,
    atomically, other keys kept) only when `value` is higher."""
    best = _read_json(path).get(key, 0.0)
    if value <= best:
        return float(best)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        known = _read_json(path)  # again: another process may have written since
        known[key] = max(value, float(known.get(key, 0.0)))
        write_json_atomic(path, known)
    except OSError as e:
        log.debug("could not keep the CPU peak in %s: %s", path, e)
    return value


def _read_json(path: Path) -> dict[str, float]:
    """The measured peaks kept in `path`: each a finite positive number (anything else in a damaged or
    foreign file is left out, and is replaced when the file is written again)."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        known = read_json_object(path, ConfigError, limit=1 << 20)
    except ConfigError as e:
        log.debug("%s; it is measured again", e)
        return {}
    return {k: float(v) for k, v in known.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e30}


# --- the peak FLOP/s that MFU divides by -------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s, and where the figure comes from (said when it is in doubt)."""

    flops: float  # FLOP/s per device; NaN when unknown
    source: str  # "train.peak_tflops", "the H100 table entry", "measured on this CPU"


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


def device_peak(device: torch.device, dtype: torch.dtype, configured_tflops: float | None = None,
                measure: bool = True) -> Peak:
    """The peak MFU divides by: configured, else the table for GPUs/NPUs, else measured on this CPU.

    `measure=False` leaves a CPU's peak unknown instead of measuring it: ranks that log nothing skip
    the measurement, which would otherwise run on every rank at once and slow each other's down.
    """
    if configured_tflops:
        return Peak(configured_tflops * 1e12, "train.peak_tflops")
    if device.type != "cpu":
        name = device_name(device)
        found = table_peak_tflops(name, fp32=dtype == torch.float32)
        if found is None:
            log.warning("no peak FLOP/s known for %s; set train.peak_tflops for a meaningful MFU", name)
            return Peak(float("nan"), f"unknown for {name}")
        return Peak(found[1] * 1e12, f"the {found[0]} table entry")
    if not measure:
        return Peak(float("nan"), "not measured on this rank")
    return Peak(measured_cpu_flops(dtype), "measured on this CPU")


def peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float | None = None) -> float:
    """Peak FLOP/s for MFU (`device_peak`'s figure)."""
    return device_peak(device, dtype, configured_tflops).flops
