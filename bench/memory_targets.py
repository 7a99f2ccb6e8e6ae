#!/usr/bin/env python
"""Issue 13's memory targets, from the estimator (estimates, not measurements) on the planner's catalogue.

    python bench/memory_targets.py [--json]

Each target is a workload (model, sequence, micro-batch, layout, device) and a limit. For each, the
estimator's per-device peak is printed for a few lever settings (`--set`-style overrides: the
defaults of the run, then combinations of the memory levers), with the smallest that the current
code accepts; a setting whose keys the code does not know yet is reported as missing. Two targets
are the planner's: pinned to a published layout, does `shardwise plan` fit it without CPU offload
(torchtitan's Llama-3.1-70B) or without full recompute (Meta's Llama 3 405B)?

Published references (their memory is measured on their hardware, ours is estimated):
- torchtune, Llama-3-8B, seq 2048, batch 2: full fine-tune 18.9 GiB on one RTX 4090, LoRA 16.2 GiB,
  QLoRA 7.4 GiB (torchtune README, "Memory and training speed").
- torchtitan, Llama-3.1-70B on 256 H100 (FSDP 32 x TP 8), local batch 16, seq 8192, full activation
  checkpointing: 71.9 GiB (benchmarks/llama3_h100_202412_torchtitan.md, table 4; 96 GB H100s).
- Meta, Llama 3 405B: TP 8, CP 1, PP 16, DP 64 at sequence 8192 (The Llama 3 Herd of Models, table 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
try:
    import shardwise  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

from shardwise.config import apply_overrides  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.hardware import get_hardware  # noqa: E402
from shardwise.memory.estimate import estimate_memory  # noqa: E402
from shardwise.plan.search import PlanRequest, plan  # noqa: E402
from shardwise.resolve import resolve_config  # noqa: E402
from shardwise.units import GIB  # noqa: E402

# Llama 3 405B (The Llama 3 Herd of Models, table 3); there is no preset for it.
LLAMA3_405B = dict(preset="llama3_70b", hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                   intermediate_size=53248)

# Lever settings tried on every single-device target, in order; later ones add levers.
FULL = ["optimize.recompute=full"]
CHUNKED = FULL + ["optimize.chunked_loss=true"]
FUSED = CHUNKED + ["train.optimizer_impl=fused"]
IN_BACKWARD = FUSED + ["train.optimizer_in_backward=true", "train.max_grad_norm=null"]
LEVERS: dict[str, list[str]] = {
    "defaults": [],
    "full recompute": FULL,
    "+ chunked loss": CHUNKED,
    "+ fused AdamW": FUSED,
    "+ optimizer in backward": IN_BACKWARD,
    "+ 16-bit optimizer states": IN_BACKWARD + ["train.optimizer_state_dtype=bf16"],
    "+ 8-bit AdamW": CHUNKED + ["train.optimizer=adamw_8bit", "train.optimizer_in_backward=true",
                                "train.max_grad_norm=null"],
    "+ offload optimizer": CHUNKED + ["optimize.offload_optimizer=true"],
    "+ offload optimizer, activations": CHUNKED + ["optimize.offload_optimizer=true",
                                                   "optimize.offload_activations=true"],
    "+ offload optimizer, activations, loss chunks of 256": CHUNKED + [
        "optimize.offload_optimizer=true", "optimize.offload_activations=true", "optimize.loss_chunk_tokens=256"],
    # FSDP2's CPU offload, on one device a one-process group: parameters (LoRA's bf16 base too), gradients
    # and optimizer state in host memory, each block copied in for its forward and backward.
    "+ offload params": CHUNKED + ["optimize.offload_params=true"],
    "+ offload params, activations": CHUNKED + ["optimize.offload_params=true", "optimize.offload_activations=true"],
    "full recompute, O3 (pure bf16)": FULL + ["optimize.precision_level=O3"],
}


@dataclass
class Target:
    """A workload, where it runs, and the limit its per-device estimate must stay within."""

    name: str
    raw: dict[str, Any]
    devices: int
    hardware: str
    limit_gib: float
    levers: list[str] = field(default_factory=lambda: list(LEVERS))
    reference: str = ""


def _run(model: dict, seq: int, mbs: int, **sections: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"model": model, "data": {"seq_length": seq},
                           "train": {"max_steps": 1, "micro_batch_size": mbs},
                           "optimize": {"mixed_precision": "bf16"}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


LLAMA3_8B = {"preset": "llama3_8b"}
LORA = {"r": 16, "alpha": 32}
TARGETS = [
    Target("Llama-3-8B full fine-tune, 1 GPU, seq 2048, mbs 2", _run(LLAMA3_8B, 2048, 2), 1, "RTX4090", 18.0,
           reference="torchtune 18.9 GiB (RTX 4090)"),
    Target("Llama-3-8B LoRA r=16, 1 GPU, seq 2048, mbs 2", _run(LLAMA3_8B, 2048, 2, lora=LORA), 1, "RTX4090", 15.0,
           reference="torchtune 16.2 GiB"),
    # As torchtune's QLoRA: adapters (and the 4-bit base) on every block linear; offload is refused with a
    # quantised base, so it is not among the levers.
    Target("Llama-3-8B QLoRA r=16, 1 GPU, seq 2048, mbs 2",
           _run(LLAMA3_8B, 2048, 2, lora={**LORA, "target_modules": "all-linear", "quantize_base": "nf4"}), 1,
           "RTX4090", 7.0, levers=[name for name in LEVERS if "offload" not in name],
           reference="torchtune 7.4 GiB"),
    Target("Llama-3-8B QLoRA r=16, 1 GPU, seq 2048, mbs 2, activations offloaded, pure bf16 (O3)",
           _run(LLAMA3_8B, 2048, 2, lora={**LORA, "target_modules": "all-linear", "quantize_base": "nf4"},
                optimize={"offload_activations": True, "precision_level": "O3"}), 1,
           "RTX4090", 7.0, levers=["defaults", "full recompute", "+ 16-bit optimizer states", "+ 8-bit AdamW"],
           reference="torchtune 7.4 GiB"),
    Target("Llama-3-8B LoRA r=16, DP8 ZeRO-0 (per GPU)",
           _run(LLAMA3_8B, 2048, 2, lora=LORA, parallel={"data_parallel": 8}), 8, "H100", 0.0,
           reference="<= 1.05 x the one-GPU LoRA figure"),
    Target("Llama-3-8B FSDP8 (ZeRO-3), seq 8192, mbs 1, accumulation 4, selective recompute",
           _run(LLAMA3_8B, 8192, 1, parallel={"data_parallel": 8, "zero_stage": 3},
                optimize={"gradient_accumulation_steps": 4, "recompute": "selective"}),
           8, "H100", 80.0, levers=["defaults", "+ chunked loss"], reference="fits an 80 GB H100"),
]


def estimate(raw: dict[str, Any], overrides: list[str], devices: int, kind: str) -> float | str:
    """The per-device peak in GiB, or why the setting cannot be estimated."""
    try:
        cfg = resolve_config(apply_overrides(raw, overrides))
        return estimate_memory(cfg, devices, kind).peak / GIB
    except ConfigError as e:
        text = str(e)
        return "lever missing" if "unknown key" in text else f"refused: {text[:100]}"


def single_device_rows() -> list[dict[str, Any]]:
    rows = []
    one_gpu_lora: dict[str, float] = {}
    for t in TARGETS:
        hw = get_hardware(t.hardware)
        results = {name: estimate(t.raw, LEVERS[name], t.devices, hw.kind) for name in t.levers}
        numbers = {k: v for k, v in results.items() if isinstance(v, float)}
        best = min(numbers, key=numbers.get) if numbers else None
        limit = t.limit_gib
        if t.name.startswith("Llama-3-8B LoRA r=16, 1 GPU"):
            one_gpu_lora = numbers
        if limit == 0.0 and best in one_gpu_lora:  # DP8 LoRA: against one GPU with the same levers
            limit = 1.05 * one_gpu_lora[best]
        rows.append({"target": t.name, "device": f"{t.devices} x {t.hardware}", "limit_gib": round(limit, 2),
                     "reference": t.reference, "results": {k: (round(v, 2) if isinstance(v, float) else v)
                                                          for k, v in results.items()},
                     "best": best, "best_gib": round(numbers[best], 2) if best else None,
                     "meets": bool(best) and numbers[best] <= limit})
    return rows


def planner_rows() -> list[dict[str, Any]]:
    rows = []
    cases = [
        ("torchtitan Llama-3.1-70B, 256 H100, FSDP 32 x TP 8, local batch 16, seq 8192: fits without offload",
         _run({"preset": "llama3_70b"}, 8192, 16, train={"global_batch_size": 512}), 256, "H100",
         {"tp": [8], "dp": [32], "pp": [1]}, False),
        ("Meta Llama 3 405B, TP 8 x PP 16 x DP 64, seq 8192: fits without full recompute",
         _run(LLAMA3_405B, 8192, 1, train={"global_batch_size": 2048}), 8192, "H100",
         {"tp": [8], "pp": [16], "dp": [64], "recompute": ["none", "selective"]}, True),
    ]
    # The single-device full fine-tune: what the planner picks on the 24 GB card with the target as its memory.
    cases.append(("Llama-3-8B full fine-tune, 1 RTX4090, seq 2048, mbs 2: the planner finds a layout within 18 GiB",
                  _run(LLAMA3_8B, 2048, 2, train={"global_batch_size": 2}), 1, "RTX4090", {}, True, 18.0))
    for name, raw, devices, hw_name, pins, offload, *limit in cases:
        try:
            cfg = resolve_config(raw)
            hw = get_hardware(hw_name)
            margin = 0.10
            if limit:  # the device as large as the target: usable memory (less the margin and reserve) = limit
                hw = dataclasses.replace(hw, memory_gib=(limit[0] + hw.reserved_gib) / (1 - margin))
            result = plan(PlanRequest(cfg=cfg, devices=devices, hardware=hw, pins=pins, memory_margin=margin,
                                      offload=offload, top=3), advise=bool(limit))
            best = result.best
            found = (f"fits: {best.memory.peak / GIB:.1f} GiB ({best.layout.describe()})" if best is not None else
                     f"does not fit: the smallest needs {result.smallest.memory.peak / GIB:.1f} GiB"
                     if result.smallest is not None else "does not fit")
            rows.append({"target": name, "result": found, "meets": best is not None})
        except ConfigError as e:
            rows.append({"target": name, "result": f"refused: {e}", "meets": False})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args()
    single, planned = single_device_rows(), planner_rows()
    if args.json:
        print(json.dumps({"estimates": single, "planner": planned}, indent=1))
        return 0
    print("| target | device | limit GiB | best setting | estimate GiB | meets | published |")
    print("| --- | --- | ---: | --- | ---: | --- | --- |")
    for r in single:
        print(f"| {r['target']} | {r['device']} | {r['limit_gib']} | {r['best'] or '-'} | {r['best_gib'] or '-'} | "
              f"{'yes' if r['meets'] else 'no'} | {r['reference']} |")
    print()
    for r in single:
        print(f"{r['target']}:")
        for name, value in r["results"].items():
            print(f"  {name:26s} {value}")
    print()
    for r in planned:
        print(f"{'yes' if r['meets'] else 'no '}  {r['target']}: {r['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
