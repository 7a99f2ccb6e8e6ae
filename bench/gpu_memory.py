#!/usr/bin/env python
"""Device memory against the estimate, on a GPU: torch.cuda.max_memory_allocated / max_memory_reserved
of a few real training steps per configuration, beside `shardwise estimate`'s figure for the same run.

    python bench/gpu_memory.py [--only NAME,...] [--steps N]

Each configuration trains `--steps` optimizer steps (the Trainer, synthetic tokens, one device) after
the peak counters are reset at the start of training. The estimate's `peak` includes its allocator
overhead, which is compared with `reserved`; `peak - overhead` is compared with `allocated`. Prints one
JSON line per configuration, then a Markdown table. Needs CUDA (a lent GPU: bench/gpu_checks.sh).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_throughput's synthetic data
from train_throughput import synthetic_dataset  # noqa: E402

from shardwise.config import load_config  # noqa: E402
from shardwise.memory.estimate import estimate_memory  # noqa: E402
from shardwise.parallel.launch import shutdown  # noqa: E402
from shardwise.train.trainer import Trainer  # noqa: E402

BASE = "bench/bench_llama.yaml"
QWEN = ["model.preset=qwen2_1.5b", "optimize.mixed_precision=bf16", "data.seq_length=4096", "train.micro_batch_size=1"]
STREAM = ["optimize.offload_optimizer=stream", "optimize.recompute=full"]
IN_BACKWARD = ["train.optimizer_in_backward=true", "train.max_grad_norm=null"]
CONFIGS: dict[str, list[str]] = {
    "bench_llama bf16 O2 seq 2048 x 8": ["optimize.mixed_precision=bf16", "data.seq_length=2048",
                                          "model.max_position_embeddings=2048", "train.micro_batch_size=8"],
    "qwen2_1.5b bf16 O2 full recompute": QWEN + ["optimize.recompute=full"],
    "qwen2_1.5b bf16 O2 selective recompute": QWEN + ["optimize.recompute=selective", "train.micro_batch_size=2"],
    "qwen2_1.5b bf16 O3 8-bit AdamW": QWEN + ["optimize.precision_level=O3", "train.optimizer=adamw_8bit",
                                              "optimize.recompute=full"],
    "qwen2_1.5b stream optimizer O2 in backward": QWEN + STREAM + IN_BACKWARD,
    "qwen2_1.5b stream 8-bit AdamW O3 in backward": QWEN + STREAM + IN_BACKWARD + [
        "optimize.precision_level=O3", "train.optimizer=adamw_8bit"],
    "qwen2_1.5b paged 8-bit AdamW O3 in backward": QWEN + IN_BACKWARD + [
        "optimize.precision_level=O3", "train.optimizer=paged_adamw_8bit", "optimize.recompute=full"],
    "qwen2_1.5b LoRA r16": QWEN + ["lora.r=16", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                                   "optimize.recompute=full"],
    "qwen2_1.5b QLoRA nf4": QWEN + ["lora.r=16", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                                    "lora.quantize_base=nf4", "optimize.recompute=full"],
    "qwen2_1.5b offload params": QWEN + ["optimize.offload_params=true", "optimize.recompute=full"],
    "qwen2_1.5b LoRA r16 offload params": QWEN + ["lora.r=16", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                                                  "optimize.recompute=full", "optimize.offload_params=true"],
    "qwen2_1.5b LoRA r16 offload half the blocks, activations": QWEN + [
        "lora.r=16", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "optimize.recompute=none",
        "optimize.offload_params=true", "optimize.offload_params_blocks=14", "optimize.offload_activations=true"],
}


def log(msg: str) -> None:
    print(f"[gpu_memory {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(name: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """Train `steps` steps of one configuration; its peaks and the estimate, in GiB."""
    with tempfile.TemporaryDirectory(prefix="shardwise-gpu-memory-") as tmp:
        cfg = load_config(BASE, overrides + [f"train.output_dir={tmp}", f"train.max_steps={steps}",
                                             "train.save_steps=null", "run.device=cuda"])
        est = estimate_memory(cfg, 1, "cuda")
        ds = synthetic_dataset(cfg, cfg.global_batch_size() * (steps + 1))
        gc.collect()
        torch.cuda.empty_cache()
        trainer = Trainer(cfg, train_dataset=ds)
        try:
            trainer.train(overwrite=True)
        finally:
            shutdown()  # offload_params on one device forms a one-process group: not into the next row
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        host_bytes = getattr(trainer.state.optimizer, "host_bytes", None)
        host = host_bytes() if host_bytes is not None else None
        del trainer
    gib = 2**30
    return {"name": name, "overrides": overrides, "estimate_gib": round(est.peak / gib, 3),
            "estimate_without_overhead_gib": round((est.peak - est.overhead) / gib, 3),
            "estimate_phase": est.peak_phase, "max_allocated_gib": round(allocated / gib, 3),
            "max_reserved_gib": round(reserved / gib, 3),
            "allocated_error": round((est.peak - est.overhead) / allocated - 1, 4),
            "reserved_error": round(est.peak / reserved - 1, 4),
            "estimate_host_gib": round(est.host / gib, 3),
            "optimizer_host_gib": round(host / gib, 3) if host is not None else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_memory.py measures CUDA memory: run it on a GPU")
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    rows = []
    for name in names:
        log(name)
        try:
            rows.append(measure(name, CONFIGS[name], args.steps))
        except Exception as exc:  # noqa: BLE001 - one failing row must not cost the others
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| configuration | estimate (GiB) | max reserved | error | estimate - overhead | max allocated | error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:120]} | | | | | |")
            continue
        print(f"| {r['name']} | {r['estimate_gib']} | {r['max_reserved_gib']} | {r['reserved_error']:+.1%} | "
              f"{r['estimate_without_overhead_gib']} | {r['max_allocated_gib']} | {r['allocated_error']:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
