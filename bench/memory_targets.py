#!/usr/bin/env python
"""Memory beside speed against the peers' published figures, and the memory targets of issues 13 and 25,
from the estimator and the step-time model on the planner's catalogue (estimates, not measurements).

    python bench/memory_targets.py [--json]

First the peer table (issue 25): for each published torchtune and Unsloth figure, the peer's memory and
tokens/s beside ours on the same card (device GiB, host GiB, predicted step time and tokens/s): the
peer's exact setting reproduced as a row, then the fastest layout `shardwise plan` finds within the peer's
memory, and its step against the same workload's step with unlimited memory. Then the lever sweep of
issue 13 (each target's per-device peak for a few lever settings) and the planner's own targets.

Published references (their figures are measured on their hardware, ours are estimated on the RTX4090
catalogue entry until a GPU measures them with bench/gpu_checks.sh):
- torchtune README, "Memory and training speed" (Llama 3.1 8B, batch 2, packed to 2048 tokens, torch.compile,
  one RTX 4090): full fine-tune 18.9 GiB at 1,650 tokens/s (recipes/configs/llama3_1/8B_full_single_device:
  bf16 weights, bitsandbytes' PagedAdamW8bit, optimizer in backward, activation checkpointing, chunked
  loss), LoRA 16.2 GiB at 3,083 tokens/s, QLoRA 7.4 GiB at 2,413 tokens/s.
- Unsloth README (Llama 3.1 8B Instruct, 4-bit QLoRA on every linear, rank 32, batch 1): on a 24 GB card
  78,475 tokens of context (memory only; no tokens/s published).
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
from typing import Any, Optional

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
from shardwise.step_time import predict_step  # noqa: E402
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


# --- the peer table (issue 25) ---------------------------------------------------------------------


@dataclass
class Peer:
    """A published peer figure and the workload it measured, as a shardwise run config."""

    name: str
    published: str  # the peer's memory and speed, as published
    raw: dict[str, Any]  # the workload
    peer_setting: list[str]  # --set overrides that reproduce the peer's settings
    limit_gib: float  # the peer's memory: the planner's budget for our best layout
    # --set overrides of what the planner is given besides shardwise's defaults (label -> overrides)
    planned: dict[str, list[str]] = field(default_factory=dict)


RTX4090 = "RTX4090"
# torchtune's "dtype: bf16" is pure bf16 (weights, gradients, optimizer state: our O3); its full fine-tune adds
# bitsandbytes' PagedAdamW8bit stepped in backward, activation checkpointing and a chunked loss, no clipping.
PURE_BF16 = ["optimize.precision_level=O3", "optimize.recompute=full", "optimize.chunked_loss=true"]
IN_BACKWARD_8BIT = ["train.optimizer_in_backward=true", "train.max_grad_norm=null"]
TORCHTUNE_FULL = PURE_BF16 + IN_BACKWARD_8BIT + ["train.optimizer=paged_adamw_8bit"]
# The same, with torchao's 8-bit AdamW, whose state the planner can stream (offload_optimizer: stream).
STREAMED_8BIT = ["optimize.precision_level=O3"] + IN_BACKWARD_8BIT + ["train.optimizer=adamw_8bit"]
PEERS = [
    Peer("Llama-3.1-8B full fine-tune, 1 x RTX 4090", "torchtune 18.9 GiB, 1,650 tokens/s",
         _run(LLAMA3_8B, 2048, 2, train={"global_batch_size": 2}), TORCHTUNE_FULL, 18.9,
         {"planner, pure bf16, 8-bit AdamW in backward (torchao's, streamable)": STREAMED_8BIT}),
    Peer("Llama-3.1-8B LoRA r=16, 1 x RTX 4090", "torchtune 16.2 GiB, 3,083 tokens/s",
         _run(LLAMA3_8B, 2048, 2, lora=LORA, train={"global_batch_size": 2}), PURE_BF16, 16.2,
         {"planner, pure bf16": ["optimize.precision_level=O3"]}),
    Peer("Llama-3.1-8B QLoRA r=16 (NF4 base), 1 x RTX 4090", "torchtune 7.4 GiB, 2,413 tokens/s",
         _run(LLAMA3_8B, 2048, 2, lora={**LORA, "target_modules": "all-linear", "quantize_base": "nf4"},
              train={"global_batch_size": 2}), PURE_BF16, 7.4,
         {"planner, pure bf16": ["optimize.precision_level=O3"]}),
]
UNSLOTH_CONTEXT = 78475  # tokens of context Unsloth fits on a 24 GB card (QLoRA r=32 all-linear, batch 1)


def _ours(cfg: Any, hw: Any) -> dict[str, Any]:
    """Our estimate of a run on one device of `hw`: device and host GiB, step seconds, tokens/s."""
    est = estimate_memory(cfg, 1, hw.kind)
    step = predict_step(cfg, 1, hw)
    return {"device_gib": round(est.peak / GIB, 2), "tensor_gib": round(est.detail["tensor_peak"] / GIB, 2),
            "host_gib": round(est.host / GIB, 2), "step_s": round(step.total, 3),
            "tokens_per_s": round(step.tokens_per_s)}


def _planned(cfg: Any, hw: Any, limit_gib: float) -> tuple[Optional[Any], str]:
    """The fastest layout `shardwise plan` finds with `limit_gib` of usable device memory (the memory margin
    and the runtime's reserve on top, as `plan` takes them), and its description."""
    margin = 0.10
    sized = dataclasses.replace(hw, memory_gib=(limit_gib + hw.reserved_gib) / (1 - margin))
    result = plan(PlanRequest(cfg=cfg, devices=1, hardware=sized, pins={}, memory_margin=margin, offload=True, top=1),
                  advise=False)
    return (result.best, result.best.layout.describe()) if result.best is not None else (None, "nothing fits")


def peer_rows() -> list[dict[str, Any]]:
    """Each peer figure: the peer's setting reproduced, our planner's best within the peer's memory (with
    the peer's optimizer and precision settings, and with our defaults), and the unlimited-memory step."""
    hw = get_hardware(RTX4090)
    rows = []
    for peer in PEERS:
        default = resolve_config(peer.raw)
        setting = resolve_config(apply_overrides(peer.raw, peer.peer_setting))
        unlimited = predict_step(default, 1, hw).total
        row = {"workload": peer.name, "peer": peer.published, "limit_gib": peer.limit_gib,
               "unlimited_step_s": round(unlimited, 3), "rows": []}
        row["rows"].append({"what": "the peer's setting", **_ours(setting, hw)})
        options = {label: resolve_config(apply_overrides(peer.raw, sets)) for label, sets in peer.planned.items()}
        for label, cfg in {**options, "planner, shardwise's defaults": default}.items():
            best, how = _planned(cfg, hw, peer.limit_gib)
            if best is None:
                row["rows"].append({"what": label, "layout": how})
                continue
            ours = {"device_gib": round(best.memory.peak / GIB, 2),
                    "tensor_gib": round(best.memory.detail["tensor_peak"] / GIB, 2),
                    "host_gib": round(best.memory.host / GIB, 2), "step_s": round(best.step.total, 3),
                    "tokens_per_s": round(best.step.tokens_per_s)}
            row["rows"].append({"what": label, "layout": how, **ours,
                                "vs_unlimited": round(best.step.total / unlimited, 2)})
        rows.append(row)
    rows.append(_unsloth_row(hw))
    return rows


def _unsloth_row(hw: Any) -> dict[str, Any]:
    """Unsloth's long-context QLoRA figure: the longest sequence (a multiple of 1,024) whose estimate fits the
    same 24 GB card at batch 1 with full recompute and offloaded activations, and its predicted speed."""
    def cfg_for(seq: int) -> Any:
        raw = _run({**LLAMA3_8B, "max_position_embeddings": max(seq, 8192)}, seq, 1,
                   lora={"r": 32, "alpha": 32, "target_modules": "all-linear", "quantize_base": "nf4"},
                   train={"global_batch_size": 1},
                   optimize={"recompute": "full", "offload_activations": True, "loss_chunk_tokens": 1024})
        return resolve_config(raw)

    usable = (hw.memory_gib - hw.reserved_gib) * GIB
    low, high = 1024, 512 * 1024
    while high - low > 1024:  # the estimate grows with the sequence
        mid = (low + high) // 2 // 1024 * 1024
        low, high = (mid, high) if estimate_memory(cfg_for(mid), 1, hw.kind).peak <= usable else (low, mid)
    cfg = cfg_for(low)
    return {"workload": "Llama-3.1-8B QLoRA r=32 all-linear, batch 1, the longest context on 1 x 24 GB",
            "peer": f"Unsloth {UNSLOTH_CONTEXT:,} tokens (24 GB; no tokens/s published)", "limit_gib": hw.memory_gib,
            "rows": [{"what": f"longest context that fits: {low:,} tokens (recompute full, activations offloaded)",
                      **_ours(cfg, hw)}]}


def print_peers(rows: list[dict[str, Any]]) -> None:
    print("Peers, memory beside speed (ours: estimates on the RTX4090 catalogue entry; theirs: published, measured)")
    print()
    print("Device GiB: the estimate with the CUDA allocator's 10% allowance (what `plan` fits), and the tensors alone")
    print("(comparable with a peak of allocated memory).")
    print()
    print("| workload | peer (published) | ours | device GiB | tensors GiB | host GiB | step s | tokens/s "
          "| x unlimited |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        for i, ours in enumerate(r["rows"]):
            what = ours["what"] + (f": {ours['layout']}" if ours.get("layout") else "")
            print(f"| {r['workload'] if i == 0 else ''} | {r['peer'] if i == 0 else ''} | {what} | "
                  f"{ours.get('device_gib', '-')} | {ours.get('tensor_gib', '-')} | {ours.get('host_gib', '-')} | "
                  f"{ours.get('step_s', '-')} | {ours.get('tokens_per_s', '-')} | {ours.get('vs_unlimited', '-')} |")
    for r in rows:
        if "unlimited_step_s" in r:
            print(f"\n{r['workload']}: the same workload with unlimited memory (shardwise's defaults) takes "
                  f"{r['unlimited_step_s']} s a step", end="")
    print("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args()
    peers, single, planned = peer_rows(), single_device_rows(), planner_rows()
    if args.json:
        print(json.dumps({"peers": peers, "estimates": single, "planner": planned}, indent=1))
        return 0
    print_peers(peers)
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
