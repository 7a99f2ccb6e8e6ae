"""Profiling: run real steps of planned layouts on the devices present, compare, and calibrate the model.

`measure_layout(cfg, devices, steps)` starts one process per device (forked on a CPU, spawned on
GPUs/NPUs), each running the real `Trainer` on random tokens for `warmup + steps` optimizer steps,
and reads the step times from the run's metrics.jsonl (one record per step). With `memory=True` the
same processes then run two more steps under `shardwise.memory.measure`'s tensor tracker and report
each rank's peak of live tensor bytes (the quantity the estimator predicts); on GPUs the trainer's
`max_memory_allocated` is reported as well.

`calibrate(hardware, runs)` fits the parts of the cost model that depend on the machine to measured
step times: the achievable compute fraction `compute_efficiency` and communication efficiency
`comm_efficiency`, and on a CPU also the cores' worth of compute several processes get together
(`cores_per_node`) and tensor parallelism's host work per layer (`tp_layer_overhead_us`). It
minimises the squared log ratio of predicted to measured time (a scan of each field, then
Nelder-Mead in log space), with a weak pull toward the catalogue's values so that a field the runs
cannot see (communication, when only one device ran) stays where it was. `profile_plan` does all of
it for the top layouts of a plan and plans again with the calibrated hardware.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import socket
import statistics
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..config import RunConfig, validate
from ..data.packing import PackedDataset
from ..data.shards import token_dtype
from ..errors import ConfigError, DeviceError
from ..hardware import Hardware
from ..parallel.launch import shutdown
from ..step_time import StepTime, predict_step
from ..train.metrics import read_metrics
from ..train.probe import measure_training
from ..train.trainer import Trainer
from ..units import GIB
from .report import candidate_table
from .search import PlanResult, plan

PRIOR_WEIGHT = 0.001  # pull of the catalogue values in the fit (log space): holds what the runs cannot see


@dataclass
class Run:
    """A measured layout: its config, device count, and what the processes reported."""

    cfg: RunConfig
    devices: int
    step_times: list[float]  # seconds, measured steps only (warm-up left out)
    memory_peaks: list[int] = field(default_factory=list)  # per rank, live tensor bytes (tracker)
    allocated_gb: Optional[float] = None  # the trainer's peak_memory_gb (GPU: max_memory_allocated, max over ranks)
    label: str = ""
    nodes: Optional[int] = None
    estimate_peak: Optional[int] = None  # the estimator's peak for the busiest rank, bytes
    statistic: str = "median"  # or "quartile": the lower quartile, robust to bursts of load on a shared machine

    @property
    def step_s(self) -> float:
        """The measured step time: the median (or lower quartile) of the measured steps."""
        if self.statistic == "quartile" and len(self.step_times) >= 4:
            return statistics.quantiles(self.step_times, n=4)[0]
        return statistics.median(self.step_times)

    @property
    def memory_peak(self) -> Optional[int]:
        """The largest rank's peak of live tensor bytes."""
        return max(self.memory_peaks) if self.memory_peaks else None


# --- running real steps ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, raw: dict[str, Any], memory: bool, threads: int, nice: int,
            out: Any) -> None:
    """One rank: train, then (optionally) two tracked steps; report step times (rank 0) and memory peaks."""
    if nice:
        os.nice(nice)  # a bench on a shared machine: other jobs disturb a higher-priority process less

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    logging.getLogger("shardwise").setLevel(logging.WARNING)  # the plan's report is the output, not the runs' logs
    try:
        cfg = validate(raw)
        data = synthetic_dataset(cfg)
        Trainer(cfg, train_dataset=data).train(overwrite=True)
        times, allocated = [], None
        if rank == 0:
            tokens = cfg.global_batch_size(world) * cfg.data.seq_length
            records = read_metrics(Path(cfg.train.output_dir))  # bounded, each line checked
            times = [tokens / r["tokens_per_s"] for r in records if _positive(r.get("tokens_per_s"))]
            # CUDA/NPU: max_memory_allocated over the ranks (on a CPU it is the process RSS: not tensors).
            allocated = max((r["peak_memory_gb"] for r in records if _positive(r.get("peak_memory_gb"))),
                            default=None)
        peak = None
        if memory:
            mem_raw = json.loads(json.dumps(raw))
            mem_raw["train"]["output_dir"] = raw["train"]["output_dir"] + "_memory"
            peak = measure_training(validate(mem_raw), data, steps=2, save=False).peak
        out.put(("ok", rank, times, peak, allocated))
        shutdown()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None, None))


def _positive(value: Any) -> bool:
    """A finite positive number (a record's figure that can be divided by or compared)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def synthetic_dataset(cfg: RunConfig) -> Any:
    """Random tokens, enough for the run's steps: the time of a step does not depend on the text."""
    seq = cfg.data.seq_length
    samples = (cfg.train.max_steps or 1) * (cfg.train.global_batch_size or 1) + 1
    rng = np.random.default_rng(cfg.train.seed)
    tokens = rng.integers(0, cfg.model.vocab_size, size=samples * seq + 1).astype(token_dtype(cfg.model.vocab_size))
    return PackedDataset(tokens, seq)


def run_config(cfg: RunConfig, devices: int, steps: int, warmup: int, out_dir: str, device: str,
               threads: int) -> dict[str, Any]:
    """The raw config of a profiling run: `cfg` for warmup + steps steps, a metrics record per step."""
    raw = cfg.model_dump(mode="json")
    raw["parallel"]["data_parallel"] = cfg.parallel.dp_degree(devices)
    raw["train"].update(output_dir=out_dir, max_steps=warmup + steps, log_steps=1, save_steps=None, eval_steps=None,
                        progress_bar=False, tensorboard=False, loggers=[], epochs=None, profile=None,
                        save_minutes=None)
    raw["run"].update(device=device, num_threads=threads)
    raw["model"]["init_from"] = None
    raw["data"]["train_files"] = []
    return raw


def measure_layout(cfg: RunConfig, devices: int, steps: int, warmup: int = 1, memory: bool = True,
                   device: str = "cpu", threads: Optional[int] = None, timeout: float = 1800.0,
                   label: str = "", nice: int = 0) -> Run:
    """Run `warmup + steps` real steps of `cfg` on `devices` local processes; the measured steps' times.

    `nice` changes the processes' scheduling priority (negative: higher, needs the privilege)."""
    if steps < 1:
        raise ConfigError(f"--profile {steps}: give at least 1 step to measure")
    check_devices(device, devices)
    threads = threads or 1  # on a CPU a device is a one-thread process, as the catalogue's cpu entry
    with tempfile.TemporaryDirectory(prefix="shardwise_profile_") as tmp:
        raw = run_config(cfg, devices, steps, warmup, str(Path(tmp) / "run"), device, threads)
        ctx = mp.get_context("fork" if device == "cpu" else "spawn")
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, devices, port, raw, memory, threads, nice, out), daemon=True)
                 for r in range(devices)]
        for p in procs:
            p.start()
        results: dict[int, tuple] = {}
        try:
            while len(results) < devices:
                try:
                    status, rank, payload, peak, allocated = out.get(timeout=timeout)
                except queue.Empty:
                    raise DeviceError(f"profiling {label or 'a layout'} timed out after {timeout:.0f} s") from None
                if status == "error":
                    raise DeviceError(f"profiling {label or 'a layout'}: rank {rank} failed: {payload}")
                results[rank] = (payload, peak, allocated)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    times = results[0][0][warmup:]
    if not times:
        raise DeviceError(f"profiling {label or 'a layout'}: the run's metrics.jsonl holds no step time after the "
                          f"{warmup} warm-up step(s)")
    peaks = [results[r][1] for r in range(devices) if results[r][1] is not None]
    allocated = results[0][2] if device != "cpu" else None
    return Run(cfg=cfg, devices=devices, step_times=times, memory_peaks=peaks, allocated_gb=allocated, label=label)


def check_devices(device: str, devices: int) -> None:
    """Refuse to profile on devices that are not here."""
    if device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif device == "npu":
        have = torch.npu.device_count() if hasattr(torch, "npu") else 0  # type: ignore[attr-defined]
    else:
        return
    if have < devices:
        raise DeviceError(f"--profile runs on the devices present: the plan is for {devices} {device.upper()} "
                          f"device(s), this machine has {have}; run it on the target machine, or plan for "
                          "--hardware cpu to profile here")


# --- calibration ----------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Fitted hardware and how well it explains the runs."""

    hardware: Hardware
    before: list[float]  # predicted step seconds per run with the catalogue's values
    after: list[float]  # with the fitted values
    measured: list[float]

    def errors(self, after: bool = True) -> list[float]:
        """Relative error of each prediction, (predicted - measured) / measured."""
        pred = self.after if after else self.before
        return [p / m - 1 for p, m in zip(pred, self.measured)]


def _predict_all(runs: list[Run], hw: Hardware) -> list[float]:
    return [predict_step(r.cfg, r.devices, hw, r.nodes).total for r in runs]


FIT = ("compute_efficiency", "comm_efficiency")


def calibrate(hw: Hardware, runs: list[Run], fit: Optional[tuple[str, ...]] = None) -> Calibration:
    """Fit `fit` fields of `hw` to the runs' median step times: least squares of the log ratio of
    predicted to measured time, with a weak pull to the prior values, by a coarse scan of each field
    and then Nelder-Mead in log space (the fields are correlated, e.g. compute speed and cores).

    Default fields: FIT, and on a CPU also `cores_per_node` (the compute the cores really give several
    processes at once: hyper-threads and other jobs make it less than the count) and
    `tp_layer_overhead_us` (DTensor's host work, which a CPU pays in full)."""
    if not runs:
        raise ConfigError("calibration needs at least one measured run")
    fit = fit or (FIT + (("cores_per_node", "tp_layer_overhead_us") if hw.cores_per_node else ()))
    measured = [r.step_s for r in runs]
    prior = [max(float(getattr(hw, name)), 1e-9) for name in fit]
    # Bounds, as factors of the prior; cores between one and this machine's count (the runs were here).
    cores = float(max(os.cpu_count() or 1, hw.cores_per_node or 1))
    low = [math.log(1.0 if n == "cores_per_node" else p0 / 30) for n, p0 in zip(fit, prior)]
    high = [math.log(cores if n == "cores_per_node" else p0 * 300.0 if n.endswith("_us") else max(1.0, 3 * p0))
            for n, p0 in zip(fit, prior)]

    def loss(x: list[float]) -> float:
        x = [min(max(v, lo), hi) for v, lo, hi in zip(x, low, high)]
        trial = hw.with_changes(**{n: math.exp(v) for n, v in zip(fit, x)})
        err = sum(math.log(p / m) ** 2 for p, m in zip(_predict_all(runs, trial), measured))
        return err + PRIOR_WEIGHT * sum((v - math.log(p0)) ** 2 for v, p0 in zip(x, prior))

    start = [math.log(p0) for p0 in prior]
    scanned = list(start)
    for i in range(len(fit)):  # a coarse scan of each field in turn
        grid = [low[i] + (high[i] - low[i]) * k / 12 for k in range(13)]
        scanned[i] = min(grid + [scanned[i]], key=lambda v: loss(scanned[:i] + [v] + scanned[i + 1:]))
    # Several starts (the prior, the scan's best, fixed points spread over the box): the fields trade off
    # against each other, so one simplex can stop in a poorer valley.
    rng = random.Random(0)
    starts = [start, scanned] + [[rng.uniform(lo, hi) for lo, hi in zip(low, high)] for _ in range(4)]
    best = min((_nelder_mead(loss, x, step=0.5) for x in starts), key=loss)
    best = [min(max(v, lo), hi) for v, lo, hi in zip(best, low, high)]
    fitted = hw.with_changes(**{n: math.exp(v) for n, v in zip(fit, best)},
                             source=f"{hw.source}; calibrated on {len(runs)} run(s)")
    return Calibration(hardware=fitted, before=_predict_all(runs, hw), after=_predict_all(runs, fitted),
                       measured=measured)


def _nelder_mead(f: Any, x0: list[float], step: float, iterations: int = 300, tol: float = 1e-7) -> list[float]:
    """Minimise f from x0 with the Nelder-Mead simplex (reflection 1, expansion 2, contraction 1/2)."""
    n = len(x0)
    simplex = [list(x0)] + [[v + (step if j == i else 0.0) for j, v in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]

        def towards(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, simplex[-1])]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                simplex = [simplex[0]] + [[b + 0.5 * (v - b) for b, v in zip(simplex[0], x)] for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]



# --- profile a plan -------------------------------------------------------------------------------


@dataclass
class ProfileResult:
    """Measured runs of a plan's top layouts, the calibration, and the plan made again with it."""

    runs: list[Run]
    predicted: list[StepTime]  # before calibration, per run
    calibration: Calibration
    replanned: PlanResult  # with the calibrated hardware
    hardware: Hardware  # before calibration

    def report(self) -> str:
        """Predicted against measured, the fitted fractions, and the re-ranked plan."""
        hw0, hw1 = self.hardware, self.calibration.hardware
        lines = ["", "profile (median of the measured steps; memory: peak live tensor bytes of the busiest rank)"]
        head = ("layout", "predicted s", "measured s", "error", "calibrated s", "error", "memory est GiB",
                "measured GiB")
        rows = [head]
        for run, pred, after in zip(self.runs, self.predicted, self.calibration.after):
            est = run.estimate_peak
            mem = run.memory_peak
            rows.append((run.label, f"{pred.total:.3g}", f"{run.step_s:.3g}",
                         f"{100 * (pred.total / run.step_s - 1):+.0f}%",
                         f"{after:.3g}", f"{100 * (after / run.step_s - 1):+.0f}%",
                         f"{est / GIB:.3g}" if est else "-", f"{mem / GIB:.3g}" if mem else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in rows]
        changed = [f"{name} {getattr(hw0, name):.3g} -> {getattr(hw1, name):.3g}"
                   for name in ("compute_efficiency", "comm_efficiency", "cores_per_node", "tp_layer_overhead_us")
                   if getattr(hw0, name) != getattr(hw1, name)]
        lines.append(f"calibrated {hw1.name}: " + (", ".join(changed) or "no change"))
        lines += ["", "re-ranked with the calibrated model:"]
        if self.replanned.ranked:
            lines.append(candidate_table(self.replanned.ranked))
        return "\n".join(lines)


def profile_plan(result: PlanResult, steps: int, top: int = 3, warmup: int = 1, memory: bool = True,
                 memory_fn: Any = None) -> ProfileResult:
    """Run the plan's `top` layouts for `steps` steps each, calibrate, and plan again."""
    req = result.request
    hw = req.hardware
    if not result.ranked:
        raise ConfigError("nothing to profile: no layout fits")
    chosen = result.ranked[:top]
    runs = []
    for c in chosen:
        run = measure_layout(c.cfg, req.devices, steps, warmup=warmup, memory=memory, device=hw.kind,
                             label=c.layout.describe())
        run.estimate_peak = c.peak
        run.nodes = req.nodes
        runs.append(run)
    calibration = calibrate(hw, runs)
    replanned = plan(dataclasses.replace(req, hardware=calibration.hardware), memory_fn)
    return ProfileResult(runs=runs, predicted=[c.step for c in chosen], calibration=calibration, replanned=replanned,
                         hardware=hw)
