"""`optimize.recompute: auto`: per layer the least recompute that fits the device, by the estimator.

Each pipeline rank's layers (those that keep activations; a frozen bottom keeps none) are upgraded
one step at a time, bottom first: none -> selective for each layer in turn, then selective -> full.
Selective first because it frees most of a block's activations for a small share of its forward
(`docs/memory.md`), full only where selective is not enough. A rank's peak depends only on its own
layers, and it falls with every step, so each rank's number of steps is found by bisection, all
ranks at once (one `estimate_all_ranks` per round). Under a pipeline the first ranks keep more
micro-batches in flight, so they get more recompute. The plan goes into `optimize.recompute_layers`
(the config in force records it) before the model is built; the recompute wrappers and the
estimator read the same list.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import ConfigError
from ..units import gib
from .estimate import estimate_all_ranks

FIT_FRACTION = 0.9  # of the device's memory a plan may fill (the planner's and the OOM help's margin)


def resolve_auto_recompute(cfg: Any, devices: Optional[int], device: str, capacity: Optional[int]) -> Any:
    """`cfg` with `recompute: auto` resolved into a per-layer plan for devices of `capacity` bytes
    (unchanged when recompute is not auto or the plan is given)."""
    o = cfg.optimize
    if o.recompute != "auto" or o.recompute_layers is not None:
        return cfg
    if not capacity:
        raise ConfigError("optimize.recompute auto needs the device's memory, which is unknown here; give "
                          "optimize.recompute none, selective or full, or a per-layer optimize.recompute_layers")
    plan = choose_recompute_layers(cfg, devices, device, int(capacity * FIT_FRACTION))
    return with_recompute_layers(cfg, plan)


def with_recompute_layers(cfg: Any, plan: list[str]) -> Any:
    """`cfg` with the per-layer plan `plan` (recompute auto)."""
    optimize = cfg.optimize.model_copy(update={"recompute": "auto", "recompute_layers": list(plan)})
    return cfg.model_copy(update={"optimize": optimize})


def describe_plan(plan: list[str]) -> str:
    """'layers 0-3 selective, 4-7 none' style."""
    runs: list[tuple[int, int, str]] = []
    for i, mode in enumerate(plan):
        if runs and runs[-1][2] == mode:
            runs[-1] = (runs[-1][0], i, mode)
        else:
            runs.append((i, i, mode))
    parts = [f"{a}-{b} {m}" if a != b else f"{a} {m}" for a, b, m in runs]
    return "layers " + ", ".join(parts)


def _plan(num_layers: int, steps: dict[int, int], order: dict[int, list[int]]) -> list[str]:
    """The plan where pipeline rank r took steps[r] upgrades over its layers order[r]."""
    plan = ["none"] * num_layers
    for r, k in steps.items():
        layers = order[r]
        for i in layers[:k]:
            plan[i] = "selective"
        for i in layers[:max(0, k - len(layers))]:
            plan[i] = "full"
    return plan


def choose_recompute_layers(cfg: Any, devices: Optional[int], device: str, budget: int) -> list[str]:
    """The per-layer plan with the least recompute whose estimated peak is at most `budget` bytes on
    every device; a ConfigError when even full recompute of every layer does not fit."""
    n = cfg.model.num_layers

    def peaks(plan: list[str]) -> list[Any]:
        return estimate_all_ranks(with_recompute_layers(cfg, plan), devices, device)

    first = peaks(["none"] * n)
    order = {r: e.detail["layers_with_activations"] for r, e in enumerate(first)}
    low = {r: 0 for r in order}
    high = {r: 2 * len(layers) for r, layers in order.items()}
    if all(e.peak <= budget for e in first):
        return ["none"] * n
    most = peaks(_plan(n, high, order))
    over = [(r, e) for r, e in enumerate(most) if e.peak > budget]
    if over:
        r, e = max(over, key=lambda x: x[1].peak)
        where = f" on pipeline rank {r}" if len(most) > 1 else ""
        lowers = "" if e.peak_phase in ("forward", "backward") else ", which recompute does not lower"
        raise ConfigError(
            f"optimize.recompute auto: even full recompute of every layer needs {gib(e.peak, 2)} per device{where} "
            f"({e.peak_phase} peak{lowers}), above the {gib(budget, 2)} a device may fill ({FIT_FRACTION:.0%} of "
            "its memory). Lower train.micro_batch_size (with more gradient accumulation) or data.seq_length, raise "
            "parallel.zero_stage, use bf16, tensor or pipeline parallelism, or CPU offload; `shardwise estimate "
            "CONFIG --set optimize.recompute=full` shows where the memory goes (docs/memory.md, 'When a run runs "
            "out of memory')")
    for r, e in enumerate(first):
        if e.peak <= budget:
            high[r] = 0
    while any(low[r] < high[r] for r in order):
        mid = {r: (low[r] + high[r]) // 2 for r in order}
        estimates = peaks(_plan(n, {r: mid[r] if low[r] < high[r] else high[r] for r in order}, order))
        for r in order:
            if low[r] < high[r]:
                if estimates[r].peak <= budget:
                    high[r] = mid[r]
                else:
                    low[r] = mid[r] + 1
    return _plan(n, high, order)
