"""Planner calibration on this machine: predicted against measured step times of DP, TP and PP layouts.

Runs real `Trainer` steps of one small model under several layouts on 1-4 local CPU processes
(`shardwise.plan.profile.measure_layout`: forked gloo processes, random tokens, one metrics record
per step), predicts each step with the cost model (`shardwise.step_time.predict_step`) using the
catalogue's `cpu` entry, fits the entry's machine-dependent fields to all runs (compute and
communication efficiency, the cores' worth for several processes, tensor parallelism's host work:
`shardwise.plan.profile.calibrate`), and prints, per layout, the prediction before and after the
fit, the measured median, their relative errors, and the leave-one-out error (the fit made without
that layout, then used to predict it). The goal: every calibrated prediction within 25%.

    .venv/bin/python bench/plan_calibration.py --rounds 4 --steps 3  # ~13 min on 2 busy vCPUs
    .venv/bin/python bench/plan_calibration.py --refit OLD_OUTPUT    # the current model on old times
    .venv/bin/python bench/plan_calibration.py --measure-hardware   # matmul, memory and gloo rates only

Rounds repeat the whole list of layouts (interleaved, so that a burst of load from other processes
falls on different layouts each round); a layout's measured time is the median over all its
measured steps of all rounds. Progress goes to stderr; the table (Markdown) and one JSON line to
stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.hardware import get_hardware
from shardwise.plan.calibrate import measure_cpu
from shardwise.plan.profile import Run, calibrate, measure_layout
from shardwise.resolve import resolve_config as validate
from shardwise.step_time import predict_step

# name -> (processes, parallel section, micro-batch size)
LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "1 process": (1, {}, 4),
    "DP2": (2, {"data_parallel": 2}, 4),
    "DP2 ZeRO-3": (2, {"data_parallel": 2, "zero_stage": 3}, 4),
    "TP2": (2, {"tensor_parallel": 2}, 4),
    "PP2 1F1B": (2, {"pipeline_parallel": 2, "micro_batch_num": 4}, 4),
    "DP4": (4, {"data_parallel": 4}, 4),
    "DP2 x TP2": (4, {"data_parallel": 2, "tensor_parallel": 2}, 4),
    "DP2 x PP2": (4, {"data_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2}, 4),
    "TP2 x PP2": (4, {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 4}, 4),
    "PP4 1F1B": (4, {"pipeline_parallel": 4, "micro_batch_num": 4}, 4),
}


def log(msg: str) -> None:
    print(f"[calibration {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def layout_config(model: str, seq: int, global_batch: int, parallel: dict[str, Any], mbs: int) -> Any:
    """A run config of the bench model under one layout."""
    return validate({"model": {"preset": model}, "data": {"seq_length": seq},
                     "parallel": {"data_parallel": 1, **parallel},
                     "train": {"max_steps": 1, "global_batch_size": global_batch, "micro_batch_size": mbs,
                               "seed": 0}})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo_llama", help="model preset (default demo_llama)")
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    ap.add_argument("--rounds", type=int, default=4, help="passes over the layouts (default 4)")
    ap.add_argument("--only", default=None, help="comma-separated layout names")
    ap.add_argument("--nice", type=int, default=-10,
                    help="priority change of the measured processes (default -10: other jobs on a shared machine "
                         "disturb them less; 0 to run as usual)")
    ap.add_argument("--measure-hardware", action="store_true", help="measure this CPU (matmul, memory, gloo) and exit")
    ap.add_argument("--statistic", choices=["median", "quartile"], default="median",
                    help="a layout's measured time: the median of its measured steps, or their lower quartile "
                         "(robust to bursts of load from other jobs on a shared machine)")
    ap.add_argument("--refit", metavar="JSON", default=None,
                    help="no new runs: take the step times of an earlier run's JSON line (this script's last "
                         "output line) and fit the current cost model to them")
    args = ap.parse_args()

    if args.measure_hardware:
        print(json.dumps(measure_cpu(seconds=3.0)))
        return 0
    names = [n.strip() for n in args.only.split(",")] if args.only else list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    hw = get_hardware("cpu")
    cfgs = {n: layout_config(args.model, args.seq_length, args.global_batch, LAYOUTS[n][1], LAYOUTS[n][2])
            for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    started = time.time()
    if args.refit:
        earlier = json.loads(Path(args.refit).read_text().strip().splitlines()[-1])
        for row in earlier["rows"]:
            if row["layout"] in times:
                times[row["layout"]] = row["step_times"]
        names = [n for n in names if times[n]]
        args.steps, args.warmup = earlier["steps"], earlier["warmup"]
        measured_rounds, args.rounds = earlier["rounds"], 0
    else:
        measured_rounds = args.rounds
    for rnd in range(args.rounds):
        for name in names:
            procs = LAYOUTS[name][0]
            run = measure_layout(cfgs[name], procs, args.steps, warmup=args.warmup, memory=False, label=name,
                                 nice=args.nice)
            times[name] += run.step_times
            log(f"round {rnd + 1} {name}: steps {', '.join(f'{t:.3f}' for t in run.step_times)} s")
    runs = [Run(cfg=cfgs[n], devices=LAYOUTS[n][0], step_times=times[n], label=n, statistic=args.statistic)
            for n in names]
    cal = calibrate(hw, runs)
    loo = []  # leave-one-out: fit on the others, predict this one
    for i, run in enumerate(runs):
        others = runs[:i] + runs[i + 1:]
        fitted = calibrate(hw, others).hardware if others else hw
        loo.append(predict_step(run.cfg, run.devices, fitted).total)

    print("| layout | processes | predicted (catalogue) s | measured s (median, min) | calibrated s | error | "
          "leave-one-out s | error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for run, before, after, out in zip(runs, cal.before, cal.after, loo):
        err, loo_err = after / run.step_s - 1, out / run.step_s - 1
        print(f"| {run.label} | {run.devices} | {before:.3f} | {run.step_s:.3f} ({min(run.step_times):.3f}) | "
              f"{after:.3f} | {100 * err:+.1f}% | {out:.3f} | {100 * loo_err:+.1f}% |")
        rows.append({"layout": run.label, "processes": run.devices, "predicted_catalogue_s": before,
                     "measured_s": run.step_s, "measured_min_s": min(run.step_times), "step_times": run.step_times,
                     "calibrated_s": after, "error": err, "leave_one_out_s": out, "leave_one_out_error": loo_err})
    worst = max(abs(r["error"]) for r in rows)
    fitted = cal.hardware
    fields = ("compute_efficiency", "comm_efficiency", "cores_per_node", "tp_layer_overhead_us")
    print("\nfitted: " + ", ".join(f"{f} {getattr(hw, f):.3g} -> {getattr(fitted, f):.3g}" for f in fields)
          + f"; worst calibrated error {100 * worst:.1f}% ({'within' if worst <= 0.25 else 'OUTSIDE'} 25%)")
    print(json.dumps({"model": args.model, "seq_length": args.seq_length, "global_batch": args.global_batch,
                      "steps": args.steps, "warmup": args.warmup, "rounds": measured_rounds, "rows": rows,
                      "statistic": args.statistic, "peak_tflops": hw.tflops_32,
                      **{f: getattr(fitted, f) for f in fields},
                      "worst_error": worst, "elapsed_s": time.time() - started,
                      "load_average": list(os.getloadavg())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
