"""Out-of-memory help: when a step runs out of device memory, say on which rank and in which phase,
what the estimator predicted for that phase, and the cheapest combinations of changes that the
estimator says would fit (`fit_search`), as `--set` options to paste, instead of a bare allocator
traceback.
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

import torch

from ..config import RunConfig
from ..hardware import device_name
from ..memory.estimate import estimate_all_ranks
from ..units import size_text
from .fit_search import describe_fits, find_fits, hardware_for, usable_bytes

log = logging.getLogger(__name__)

# The trainer's phases, as the estimator names them.
PHASE_OF = {"forward": "forward", "backward": "backward", "optimizer step": "optimizer",
            "checkpoint save": "checkpoint", "pipeline step": "backward", "evaluation": "forward"}


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocator's out-of-memory error (CUDA, NPU, or the CPU allocator)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def device_memory_bytes(device: torch.device) -> int | None:
    """Memory of one device: the GPU/NPU's total; for the CPU the machine's physical memory, or less where
    the process is limited (`ulimit -v`, a cgroup's memory.max)."""
    if device.type in ("cuda", "npu"):
        module = torch.get_device_module(device.type)
        return int(module.get_device_properties(device).total_memory)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return min([physical] + process_limits())


def process_limits() -> list[int]:
    """Bytes this process may not exceed, where set: the address-space and data limits (`ulimit -v`,
    `ulimit -d`) and the cgroup's memory limit (v2 memory.max, v1 memory.limit_in_bytes)."""
    limits = []
    for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 says "no limit" with a huge number, v2 with "max"
            limits.append(int(text))
    return limits


def explain_out_of_memory(cfg: RunConfig, world: int, rank: int, phase: str, device: torch.device,
                          pp_rank: int = 0, processes_here: int = 1) -> str:
    """The message for an out-of-memory error in `phase` on `rank` (pipeline rank `pp_rank`; the machine
    runs `processes_here` of the ranks): the prediction for that phase, and the one or two cheapest
    combinations of changes that the estimator says would fit, as `--set` options (`fit_search`)."""
    capacity = device_memory_bytes(device)
    where = f"rank {rank} ran out of {device.type} memory during the {phase}"
    try:
        ranks = estimate_all_ranks(cfg, world, device.type)
    except Exception as exc:  # noqa: BLE001 - the help must never hide the original error
        log.debug("no estimate for the out-of-memory help: %s", exc)
        return f"{where}; lower memory with optimize.recompute, parallel.zero_stage or train.micro_batch_size"
    current = ranks[min(pp_rank, len(ranks) - 1)]
    predicted = current.phases.get(PHASE_OF.get(phase, "backward"), current.peak)
    have = size_text(capacity) if capacity else "unknown"
    lines = [f"{where} (the estimate for that phase: {size_text(predicted)}; peak {size_text(current.peak)} "
             f"in the {current.peak_phase}; this device has {have})."]
    if not capacity:
        return "\n".join(lines + ["`shardwise estimate CONFIG --set ...` shows what lowers the estimate."])
    try:
        hw = hardware_for(device.type, device_name(device), capacity)
        usable = usable_bytes(capacity, hw, processes_here)
        return "\n".join(lines + describe_fits(find_fits(cfg, world, device.type, hw, usable)))
    except Exception as exc:  # noqa: BLE001
        log.debug("no search for the out-of-memory help: %s", exc)
        return "\n".join(lines)
