"""Out-of-memory help: when a step runs out of device memory, say on which rank and in which phase,
what the estimator predicted for that phase, and which cheapest changes the estimator says would fit,
instead of a bare allocator traceback.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..config import RunConfig, validate
from ..memory.estimate import estimate_all_ranks
from ..units import size_text

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
    """Memory of one device: the GPU/NPU's total, or the machine's physical memory for the CPU."""
    if device.type in ("cuda", "npu"):
        module = torch.get_device_module(device.type)
        return int(module.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _variant(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig | None:
    raw = cfg.model_dump()
    raw["model"].pop("init_from", None)  # the architecture is already resolved; the weights do not matter
    for section, values in sections.items():
        raw[section] = {**(raw.get(section) or {}), **values}
    try:
        return validate(raw)
    except Exception:  # noqa: BLE001 - a change this layout cannot take is simply not offered
        return None


def cheaper_layouts(cfg: RunConfig, world: int) -> list[tuple[str, RunConfig]]:
    """Single changes that lower memory, cheapest (in step time) first, each as a valid config."""
    p, o, t = cfg.parallel, cfg.optimize, cfg.train
    ga = cfg.gradient_accumulation(world)
    out: list[tuple[str, RunConfig | None]] = []
    if o.recompute != "full":
        if o.recompute == "none":
            out.append(("optimize.recompute: selective", _variant(cfg, optimize={"recompute": "selective"})))
        out.append(("optimize.recompute: full", _variant(cfg, optimize={"recompute": "full", "recompute_every": 1})))
    dp = p.dp_degree(world)
    if dp > 1 and p.zero_stage < 3:
        stage = p.zero_stage + 1
        out.append((f"parallel.zero_stage: {stage}", _variant(cfg, parallel={"zero_stage": stage})))
    if t.micro_batch_size > 1:
        half = t.micro_batch_size // 2
        changes: dict[str, Any] = {"micro_batch_size": half}
        opt = {"gradient_accumulation_steps": ga * 2} if t.global_batch_size is None else {}
        out.append((f"train.micro_batch_size: {half} with twice the gradient accumulation",
                    _variant(cfg, train=changes, optimize=opt)))
    if o.mixed_precision == "fp32":
        out.append(("optimize.mixed_precision: bf16", _variant(cfg, optimize={"mixed_precision": "bf16"})))
    if dp > 1 and dp % 2 == 0:
        for key, label in (("tensor_parallel", "tensor"), ("pipeline_parallel", "pipeline")):
            degree = getattr(p, key) * 2
            extra = {"micro_batch_num": max(p.micro_batch_num, 2)} if key == "pipeline_parallel" else {}
            out.append((f"parallel.{key}: {degree} ({label} parallel, data_parallel {dp // 2})",
                        _variant(cfg, parallel={key: degree, "data_parallel": dp // 2, **extra})))
    if p.zero_stage >= 2 and not o.offload_optimizer:
        out.append(("optimize.offload_optimizer: true (CPU offload)",
                    _variant(cfg, optimize={"offload_optimizer": True})))
    return [(what, c) for what, c in out if c is not None]


def explain_out_of_memory(cfg: RunConfig, world: int, rank: int, phase: str, device: torch.device,
                          pp_rank: int = 0) -> str:
    """The message for an out-of-memory error in `phase` on `rank` (pipeline rank `pp_rank`): the
    prediction for that phase and the cheapest single changes that the estimator says would fit."""
    def estimate(c: RunConfig, devices: int, kind: str) -> Any:
        ranks = estimate_all_ranks(c, devices, kind)
        return ranks[min(pp_rank, len(ranks) - 1)]  # a variant may have fewer pipeline ranks

    capacity = device_memory_bytes(device)
    where = f"rank {rank} ran out of {device.type} memory during the {phase}"
    try:
        current = estimate(cfg, world, device.type)
    except Exception as exc:  # noqa: BLE001 - the help must never hide the original error
        log.debug("no estimate for the out-of-memory help: %s", exc)
        return f"{where}; lower memory with optimize.recompute, parallel.zero_stage or train.micro_batch_size"
    predicted = current.phases.get(PHASE_OF.get(phase, "backward"), current.peak)
    have = size_text(capacity) if capacity else "unknown"
    lines = [f"{where} (the estimate for that phase: {size_text(predicted)}; peak {size_text(current.peak)} "
             f"in the {current.peak_phase}; this device has {have})."]
    fits = []
    for what, variant in cheaper_layouts(cfg, world):
        try:
            peak = estimate(variant, world, device.type).peak
        except Exception:  # noqa: BLE001
            continue
        if capacity is None or peak < 0.9 * capacity:  # the planner's safety margin
            fits.append(f"  {what}: {size_text(peak)}")
    if fits:
        lines.append("Changes the estimator says would fit (cheapest first; `shardwise estimate CONFIG --set ...` "
                     "checks others):")
        lines += fits[:4]
    else:
        lines.append("No single change fits this device; combine them (`shardwise plan` searches layouts), or use "
                     "more devices.")
    return "\n".join(lines)
