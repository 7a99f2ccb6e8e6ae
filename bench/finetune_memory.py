#!/usr/bin/env python
"""Fine-tuning memory and speed: full fine-tuning, LoRA and frozen layers on the bench model.

    python bench/finetune_memory.py [bench/bench_llama.yaml] [--steps N] [--warmup W] [--rounds R]
                                    [--threads T] [--variants full,lora_r8,...] [--set k=v ...]
    python bench/finetune_memory.py --table RESULTS.jsonl    # the Markdown table of saved JSON lines

Runs `bench/train_throughput.py` once per variant, each in a fresh process (so no memory or state
carries over), with the variant's `--set` overrides on top of the config:

    full                    every weight trains
    lora_r8, lora_r16       LoRA (alpha = 2r) on the attention projections q, k, v, o; base weights frozen
    freeze_bottom_half      freeze.layers = num_layers / 2
    freeze_bottom_half_emb  the same and freeze.embeddings = true

Each run compares the shardwise Trainer with the plain PyTorch loop (which applies the same LoRA /
freezing) and probes the peak live tensor bytes, split into parameters, gradients, optimizer state
and the rest (activations, temporaries) at the peak. Prints one JSON line per variant on stdout and
a Markdown table on stderr (with the progress of the runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.resolve import load_run_config as load_config

BENCH = Path(__file__).resolve().parent / "train_throughput.py"
ATTENTION = "[q_proj, k_proj, v_proj, o_proj]"


def log(msg: str) -> None:
    print(f"[finetune {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def variants(num_layers: int) -> dict[str, list[str]]:
    """Each variant's `--set` overrides."""
    half = num_layers // 2
    return {
        "full": [],
        "lora_r8": [f"lora={{r: 8, alpha: 16, target_modules: {ATTENTION}}}"],
        "lora_r16": [f"lora={{r: 16, alpha: 32, target_modules: {ATTENTION}}}"],
        "freeze_bottom_half": [f"freeze.layers={half}"],
        "freeze_bottom_half_emb": [f"freeze.layers={half}", "freeze.embeddings=true"],
    }


def run_variant(config: str, overrides: list[str], bench_args: list[str]) -> dict[str, Any]:
    """train_throughput.py in a fresh process; its JSON result."""
    cmd = [sys.executable, str(BENCH), config, *bench_args]
    for o in overrides:
        cmd += ["--set", o]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def side(r: dict[str, Any]) -> dict[str, Any]:
    """The memory and speed fields of one side of a train_throughput result."""
    keys = ("peak_tensor_mem_gb", "peak_split_mib", "tokens_per_s_median", "tokens_per_s_best_step", "round_spread")
    return {k: r[k] for k in keys}


def summary(name: str, overrides: list[str], r: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """One variant's JSON line."""
    return {
        "bench": "finetune_memory", "variant": name, "overrides": overrides, "config": r["config"],
        "model": r["model"], "params": r["params"], "trainable_params": r["trainable_params"],
        "trainable_share": round(r["trainable_params"] / r["params"], 5),
        "tokens_per_step": r["tokens_per_step"], "precision": r["precision"], "device": r["device"],
        "threads": r["threads"], "steps": r["steps"], "rounds": r["rounds"],
        "shardwise": side(r["shardwise"]), "plain": side(r["plain"]),
        "ratio": r["ratio"], "ratio_best_step": r["ratio_best_step"],
        "max_abs_loss_diff": r["max_abs_loss_diff"], "disturbed": r["disturbed"], "wall_s": round(wall_s, 1),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: trainable parameters, peak memory and its split (shardwise side), tokens/s of both sides.

    tokens/s: median over rounds, then in parentheses the fastest step's rate (a shared CPU only slows steps).
    """
    lines = [
        "| variant | trainable params | peak GiB (shardwise / plain) | params MiB | grads MiB | optimizer MiB "
        "| rest MiB | tokens/s shardwise (best step) | tokens/s plain (best step) | ratio (best step) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        sw, pl = row["shardwise"], row["plain"]
        split = sw["peak_split_mib"] or {}
        cells = [
            row["variant"],
            f"{row['trainable_params']:,} ({100 * row['trainable_share']:.2f}%)",
            f"{sw['peak_tensor_mem_gb']:.3f} / {pl['peak_tensor_mem_gb']:.3f}",
            *(f"{split.get(k, float('nan')):,.1f}" for k in ("params", "grads", "optimizer", "rest")),
            f"{sw['tokens_per_s_median']:,.0f} ({sw['tokens_per_s_best_step']:,.0f})",
            f"{pl['tokens_per_s_median']:,.0f} ({pl['tokens_per_s_best_step']:,.0f})",
            f"{row['ratio']:.3f} ({row['ratio_best_step']:.3f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parent / "bench_llama.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra overrides for every variant")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per round and side (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (default 1)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per variant (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: run.num_threads)")
    ap.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--table", metavar="JSONL", default=None,
                    help="only print the Markdown table of saved JSON lines (this script's stdout)")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]))
        return 0

    cfg = load_config(args.config, args.overrides)
    table = variants(cfg.model.num_layers)
    names = args.variants.split(",") if args.variants else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(table)}")
    bench_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    if args.threads:
        bench_args += ["--threads", str(args.threads)]

    rows = []
    t_all = time.perf_counter()
    for name in names:
        overrides = [*args.overrides, *table[name]]
        log(f"{name}: {' '.join(table[name]) or '(no overrides)'}")
        t0 = time.perf_counter()
        row = summary(name, overrides, run_variant(args.config, overrides, bench_args), time.perf_counter() - t0)
        print(json.dumps(row), flush=True)
        rows.append(row)
    log(f"{len(rows)} variants in {time.perf_counter() - t_all:.0f} s")
    print("\n" + markdown(rows), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
