#!/usr/bin/env python
"""Training throughput with each side alone in a fresh process, as in real use: for settings that hold for a
whole process (`run.keep_host_memory`, the host allocator), which an in-process comparison cannot separate.

    python bench/process_throughput.py bench/bench_llama.yaml [--set k=v ...] [--rounds R] [--steps N]
                                       [--warmup W] [--sides shardwise,shardwise_system_malloc,...]

Sides (default: all five), each run as `python bench/process_throughput.py --child SIDE ...`:
- shardwise: the Trainer with the config's settings (on a CPU: malloc keeps freed memory);
- shardwise_system_malloc: the same with `run.keep_host_memory=false` (malloc as it is);
- shardwise_compiled: the Trainer with `run.compile=true`;
- plain, plain_compiled: train_throughput.py's hand-written loop, eager and under `torch.compile(model)`, in a
  process whose malloc is left as it is (what a loop written by hand runs with).

Each round runs every side once, in an order that rotates from round to round, so that a slow spell of the
shared machine falls on different sides. A child trains W warm-up steps (a compiled side compiles in the
first) and N measured ones, timed as train_throughput.py times them (an optimizer step post-hook); the parent
prints one JSON line: each side's median step over its rounds, tokens/s,
and the ratios of shardwise to every other side and to the faster plain loop. Losses of all sides are compared
(fp32: the same model, batches and optimizer, so they agree to the compiled graphs' rounding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import StepClock, log, run_plain, run_shardwise, synthetic_dataset  # noqa: E402

from shardwise.config import load_config  # noqa: E402
from shardwise.parallel.launch import resolve_device  # noqa: E402

SIDES = ("shardwise", "shardwise_system_malloc", "shardwise_compiled", "plain", "plain_compiled")
OVERRIDES = {"shardwise_system_malloc": ["run.keep_host_memory=false"], "shardwise_compiled": ["run.compile=true"]}


def child(side: str, config: str, overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """One side's run in this process: its step times and losses."""
    cfg = load_config(config, overrides + OVERRIDES.get(side, []))
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    device = resolve_device(cfg.run.device)
    n_steps = warmup + steps
    ds = synthetic_dataset(cfg, max(cfg.global_batch_size() * (n_steps + 1), 64))
    clock = StepClock(device)
    sync_at = {warmup - 1, n_steps - 1}
    if side.startswith("shardwise"):
        run = run_shardwise(cfg, ds, n_steps, clock, sync_at, None)
    else:
        run = run_plain(cfg, ds, n_steps, clock, sync_at, None, device, compiled=side == "plain_compiled")
    measured = run["step_s"][warmup:]
    return {"side": side, "step_s": [round(s, 4) for s in measured], "losses": run["losses"],
            "tokens_per_step": cfg.global_batch_size() * cfg.data.seq_length, "threads": torch.get_num_threads()}


def run_child(side: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, args.config, "--child", side, "--warmup", str(args.warmup),
           "--steps", str(args.steps)] + [a for o in args.overrides for a in ("--set", o)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"side {side} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per side and round (default 4)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them (>= 2, default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every side once (default 3)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {', '.join(SIDES)}")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 2 or args.steps < 1 or args.rounds < 1:
        ap.error("--warmup must be at least 2 (the first step compiles, the second is the first timed), "
                 "--steps and --rounds at least 1")
    if args.child:
        print(json.dumps(child(args.child, args.config, args.overrides, args.warmup, args.steps)), flush=True)
        return 0
    sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or "shardwise" not in sides:
        ap.error(f"--sides: {unknown or 'shardwise is missing'}; choose from {', '.join(SIDES)} (shardwise among them)")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    started = time.perf_counter()
    for r in range(args.rounds):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        for side in order:
            run = run_child(side, args)
            runs[side].append(run)
            log(f"round {r + 1} {side:24s} median step {statistics.median(run['step_s']):.3f} s")
    tokens = runs["shardwise"][0]["tokens_per_step"]
    summary = {}
    for side, rs in runs.items():
        step = statistics.median(statistics.median(x["step_s"]) for x in rs)
        summary[side] = {"step_s_median": round(step, 4), "tokens_per_s": round(tokens / step, 2),
                         "round_medians": [round(statistics.median(x["step_s"]), 4) for x in rs]}
    sw = summary["shardwise"]["tokens_per_s"]
    ratios = {f"shardwise/{s}": round(sw / summary[s]["tokens_per_s"], 4) for s in sides if s != "shardwise"}
    plains = [s for s in ("plain", "plain_compiled") if s in sides]
    if plains:
        ratios["shardwise/faster_plain"] = round(sw / max(summary[s]["tokens_per_s"] for s in plains), 4)
    if "shardwise_compiled" in sides and "plain_compiled" in sides:
        ratios["shardwise_compiled/plain_compiled"] = round(
            summary["shardwise_compiled"]["tokens_per_s"] / summary["plain_compiled"]["tokens_per_s"], 4)
    reference = runs["shardwise"][0]["losses"]
    loss_diff = max(abs(a - b) for rs in runs.values() for x in rs for a, b in zip(x["losses"], reference))
    result = {"bench": "process_throughput", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "config": os.path.basename(args.config), "overrides": args.overrides, "warmup": args.warmup,
              "steps": args.steps, "rounds": args.rounds, "threads": runs["shardwise"][0]["threads"],
              "nproc": os.cpu_count(), "torch": torch.__version__, "tokens_per_step": tokens, "sides": summary,
              "ratios": ratios, "max_abs_loss_diff": loss_diff, "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(result), flush=True)
    log("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
