#!/usr/bin/env python
"""Where a training step's time goes on a GPU, and whether the step waits for the device.

    python bench/step_profile.py CONFIG [--set k=v ...] [--steps N] [--trace OUT.json]

Trains N steps (the Trainer, synthetic tokens) under torch.profiler, recording steps 3 to N-1 (after
compilation and the first optimizer state). Prints one JSON object: the operators with the most
device time, the share of the recorded wall time the device was busy (kernels and copies), and the
host-side calls that wait for the device (`cudaStreamSynchronize`, `cudaDeviceSynchronize`,
`cudaEventSynchronize`, synchronous `cudaMemcpy`, and `aten::_local_scalar_dense`, which is what
`.item()` / `.tolist()` run), per recorded step. A sync-free step shows none of them except one
`cudaEventSynchronize` per step: the trainer reading the previous step's figures, which waits only for
that step while this one is queued. Needs CUDA (bench/gpu_checks.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_throughput's synthetic data
from train_throughput import synthetic_dataset  # noqa: E402

from shardwise.config import load_config  # noqa: E402
from shardwise.train.trainer import Trainer  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense")
SKIP = 3  # steps before recording: compile, optimizer state, allocator warm-up


def summarize(prof: Any, recorded_steps: int) -> dict[str, Any]:
    """Top operators by device time, the device's busy share, and the waits per step."""
    events = prof.key_averages()
    device_time = [(e.key, e.self_device_time_total) for e in events if e.self_device_time_total > 0]
    device_time.sort(key=lambda kv: -kv[1])
    busy_us = sum(t for _, t in device_time)
    waits = {name: 0 for name in WAITS}
    for e in events:
        if e.key in waits:
            waits[e.key] += e.count
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if kernels:
        wall_us = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    else:
        wall_us = 0
    return {
        "recorded_steps": recorded_steps,
        "top_device_ops": [{"op": k, "ms_per_step": round(t / 1e3 / recorded_steps, 3),
                            "share": round(t / busy_us, 4)} for k, t in device_time[:15]] if busy_us else [],
        "device_busy_share": round(busy_us / wall_us, 4) if wall_us else None,
        "device_ms_per_step": round(busy_us / 1e3 / recorded_steps, 3),
        "waits_per_step": {k: round(v / recorded_steps, 2) for k, v in waits.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trace", default=None, help="write the Chrome / Perfetto trace here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/step_profile.py profiles CUDA steps: run it on a GPU")
    recorded = args.steps - SKIP - 1
    if recorded < 1:
        raise SystemExit(f"--steps must be at least {SKIP + 2}")
    with tempfile.TemporaryDirectory(prefix="shardwise-profile-") as tmp:
        cfg = load_config(args.config, args.overrides + [
            f"train.output_dir={tmp}", f"train.max_steps={args.steps}", "train.save_steps=null",
            f"train.log_steps={args.steps}", "run.device=cuda"])
        ds = synthetic_dataset(cfg, cfg.global_batch_size() * (args.steps + 1))
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=SKIP - 1, warmup=1, active=recorded, repeat=1))
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            with prof:
                Trainer(cfg, train_dataset=ds).train(overwrite=True)
        finally:
            hook.remove()
    out = {"config": args.config, "overrides": args.overrides, **summarize(prof, recorded)}
    if args.trace:
        prof.export_chrome_trace(args.trace)
        out["trace"] = args.trace
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
