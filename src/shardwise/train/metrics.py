"""Throughput, MFU and memory: what each step costs, logged to the console, JSONL, TensorBoard, W&B and MLflow.

tokens/s counts real tokens: the input tokens of a step that are not padding, over all ranks (packed
pre-training has none; padded instruction data does), with the tokens that carry a loss beside them
(`target_tokens_per_s`). MFU is the training FLOPs a token costs (`memory.estimate.run_flops`:
frozen weights cost less) times real tokens/s per device over the device's peak FLOP/s
(`shardwise.hardware.device_peak`: `train.peak_tflops` when configured, else the catalogue's table
for GPUs/NPUs, else the best matmul rate ever measured on this CPU). An MFU above 1 means the peak is too
low: the record then says `peak_in_doubt: true` and a warning (once) says to set train.peak_tflops.

`metrics.jsonl` holds one JSON object per line, each written with a single write, so a killed run
can at worst leave a torn last line; a resumed run first keeps only the whole records up to the step
it resumes from, so the file stays one curve.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

import torch

from ..errors import ConfigError, ShardwiseError
from ..files import write_text_atomic
from ..hardware import Peak
from ..loss import IGNORE_INDEX
from ..parallel.collectives import max_over
from ..units import GIB
from ..untrusted import MiB, fail, parse_json, read_bytes
from .trackers import FAILED, FINISHED, Tracker, TrackerError, check_installed, close_all, open_trackers

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


# --- MFU ------------------------------------------------------------------------------------------------


class MfuMeter:
    """MFU = training FLOPs per token x real tokens/s per device / peak, watching the peak.

    An MFU above 1 cannot happen with a true peak: the figure is too low (a CPU measured while other
    jobs ran, or a configured value below the device's). The MFU is still reported, flagged in doubt,
    and the first time a warning says so and how to fix it.
    """

    def __init__(self, flops_per_token: float, peak: Peak) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.warned = False

    def of(self, tokens_per_s_per_device: float) -> tuple[float, bool]:
        """(MFU, whether the peak is in doubt)."""
        if not self.peak.flops or math.isnan(self.peak.flops):
            return float("nan"), False
        mfu = tokens_per_s_per_device * self.flops_per_token / self.peak.flops
        doubt = mfu > 1.0
        if doubt and not self.warned:
            self.warned = True
            log.warning("MFU %.0f%% is above 100%%: the peak it divides by (%.4g TFLOP/s, %s) is too low%s. "
                        "MFU is logged with peak_in_doubt: true; set train.peak_tflops to this device's dense "
                        "peak for a true figure", 100 * mfu, self.peak.flops / 1e12, self.peak.source,
                        _doubt_reason(self.peak.source))
        return mfu, doubt


def _doubt_reason(source: str) -> str:
    if source.startswith("measured"):
        return " (it was measured while other work shared the CPU)"
    if source == "train.peak_tflops":
        return " (the configured train.peak_tflops is below what this run computes)"
    return ""


# --- tokens of a step ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTokens:
    """What one optimizer step processed, over all ranks."""

    real: int  # input tokens that are not padding
    target: int  # label positions that carry a loss


def padding_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """True at the padding positions of a batch [B, T]; None when the batch marks no padding.

    The batch contract (data/instruction.py) pads a row after its last sample with a document of its own,
    whose labels are all ignored, while every real sample keeps at least one target (samples without
    one are left out). So a row's padding is its last document when that document has no target.
    Labels of -100 alone do not mark padding: prompt tokens carry them too. Packed pre-training
    windows end in a document with targets, and batches without `document_ids` have no padding.
    """
    doc = batch.get("document_ids")
    if doc is None:
        return None
    last = doc == doc[:, -1:]
    no_target = ~((batch["labels"] != IGNORE_INDEX) & last).any(dim=1, keepdim=True)
    return last & no_target


def count_real_tokens(micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> int:
    """Input tokens that are not padding, over the micro-batches of one step (on this rank)."""
    total = 0
    for mb in micro_batches:
        pad = padding_mask(mb)
        total += mb["input_ids"].numel() - (int(pad.sum()) if pad is not None else 0)
    return total


# --- the cost of compiling -----------------------------------------------------------------------------------


class CompileClock:
    """What torch.compile cost a compiled run, reported once: the first step (which compiles the blocks'
    forward and backward) against the second (which runs them compiled). `tick(now)` after each of the
    first steps (their figures read, so the times cover finished work) returns the line to log, once."""

    def __init__(self, compiled: bool, start: float) -> None:
        self.waiting = compiled
        self.stamps = [start]

    def tick(self, now: float) -> str | None:
        """Stamp the end of a step; after the second, the report (and the clock stops)."""
        self.stamps.append(now)
        if len(self.stamps) < 3:
            return None
        self.waiting = False
        first, second = self.stamps[1] - self.stamps[0], self.stamps[2] - self.stamps[1]
        return (f"torch.compile: the first step took {first:.2f} s, the second {second:.2f} s, so compiling cost "
                f"about {max(first - second, 0.0):.1f} s (once per process; a new batch shape compiles again)"
                f"{_eager_fallbacks()}")


def _eager_fallbacks() -> str:
    """torch's count of frames it failed to compile (they ran eagerly), when there are any."""
    frames = torch._dynamo.utils.counters.get("frames", {})
    failed = frames.get("total", 0) - frames.get("ok", 0)
    return f"; {failed} of {frames['total']} frames failed to compile and ran eagerly (see torch's warnings)" \
        if failed > 0 else ""


# --- the records -------------------------------------------------------------------------------------------


class Window:
    """The steps between two log lines, turned into one record."""

    def __init__(self, start: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.start = start  # reset after work that is not training (checkpoint saves, evaluation)
        self.clock = clock
        self.losses: list[float] = []
        self.real_tokens = 0
        self.target_tokens = 0
        self.skipped = 0

    def add(self, loss: float, real_tokens: int, target_tokens: int, skipped: bool) -> None:
        """Count one step (its tokens over all ranks; a skipped step's loss is left out of the mean)."""
        if not skipped:
            self.losses.append(loss)
        self.skipped += int(skipped)
        self.real_tokens += real_tokens
        self.target_tokens += target_tokens

    def record(self, step: int, lr: float, grad_norm: float, loss_scale: float, mfu: MfuMeter,
               device: torch.device, world_size: int = 1) -> dict[str, Any]:
        """The window as one JSON-ready record: tokens/s of real tokens over all ranks (targets beside
        them), per device, MFU per device, peak memory the largest of any rank (a collective: every
        rank calls this)."""
        elapsed = max(self.clock() - self.start, 1e-9)
        tps = self.real_tokens / elapsed
        per_device = tps / world_size
        value, doubt = mfu.of(per_device)
        loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        memory = max_over(peak_memory_gb(device)) if world_size > 1 else peak_memory_gb(device)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": loss_scale,
                  "tokens_per_s": tps, "target_tokens_per_s": self.target_tokens / elapsed,
                  "tokens_per_s_per_device": per_device, "mfu": value, "peak_in_doubt": doubt,
                  "peak_memory_gb": memory, "skipped_steps": self.skipped,
                  "device": device.type}  # what peak_memory_gb measured: device memory, or a CPU's resident set
        if device.type == "cpu":  # what that resident set holds beside the tensors: the runtime's own memory
            record["runtime_rss_gb"] = max_over(RUNTIME_RSS_GB) if world_size > 1 else RUNTIME_RSS_GB
        return record


def format_record(r: Mapping[str, Any]) -> str:
    """One console line for a training record."""
    doubt = " (peak in doubt)" if r.get("peak_in_doubt") else ""
    return (f"step {r['step']} loss {r['loss']:.4f} lr {r['lr']:.3g} grad_norm {r['grad_norm']:.3f} "
            f"loss_scale {r['loss_scale']:g} tokens/s {r['tokens_per_s']:.0f} "
            f"(targets {r['target_tokens_per_s']:.0f}) mfu {r['mfu'] * 100:.1f}%{doubt} "
            f"peak_mem {r['peak_memory_gb']:.2f}GiB")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (accelerators only; CPU reports the process peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)  # type: ignore[attr-defined]


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory, or on CPU the process's peak resident set size, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / GIB  # type: ignore[attr-defined]
    return _peak_rss_gb()


def _peak_rss_gb() -> float:
    """The process's peak resident set size so far, in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


# The runtime's own resident memory: the process's peak resident set when this module was loaded (the
# interpreter, torch and shardwise's other libraries, before any model, data or optimizer state exists).
# A CPU's peak_memory_gb, its peak resident set, holds it beside the tensors that the memory estimate
# counts; the records carry it (`runtime_rss_gb`) so that the report can set estimate + runtime beside it.
RUNTIME_RSS_GB = _peak_rss_gb()


# --- metrics.jsonl ------------------------------------------------------------------------------------------


MAX_METRICS_READ = 64 * MiB  # what a reader takes of a metrics.jsonl: its last 64 MiB (some 150,000 records)
MAX_METRICS_KEPT = 1 << 30  # what a resumed run rewrites: a larger file is left as it is


def _parse_lines(data: bytes, source: str | os.PathLike = METRICS_FILE) -> tuple[list[tuple[bytes, dict[str, Any]]],
                                                                                int]:
    """(line, record) of every whole JSON-object line, and how many lines were not one (not UTF-8, not
    JSON, nested too deep, an integer of more than 40 digits: `untrusted.parse_json`)."""
    records, bad = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = parse_json(line, source, ShardwiseError, allow_nonfinite=True)
        except ShardwiseError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append((line, record))
        else:
            bad += 1
    return records, bad


@dataclass
class MetricsRead:
    """What a reader got of a metrics.jsonl: its records, the lines that were none, and how many bytes
    at its start were left unread (a file larger than `MAX_METRICS_READ` is read from its tail)."""

    records: list[dict[str, Any]]
    bad_lines: int = 0
    skipped_bytes: int = 0


def _metrics_path(path: str | Path) -> Path:
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics_file(path: str | Path, limit: int = MAX_METRICS_READ) -> MetricsRead:
    """The records of a metrics.jsonl (or of RUN_DIR/metrics.jsonl) from elsewhere: a regular file only
    (a FIFO or a link to /dev/zero would be read forever), at most its last `limit` bytes (from the
    first whole line there), each line a JSON object within `untrusted`'s bounds; a line that is not
    one (the torn last line of a killed run, or damage) is counted, not raised. ShardwiseError naming
    the file when it cannot be read at all."""
    path = _metrics_path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        fail(ShardwiseError, path, f"cannot be read ({e.strerror or e})")
    if not stat.S_ISREG(st.st_mode):
        fail(ShardwiseError, path, "is not a regular file (a device, a FIFO or a directory)",
             "give the run directory whose metrics.jsonl the run wrote")
    skipped = max(0, st.st_size - limit)
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                fail(ShardwiseError, path, "is not a regular file")
            f.seek(skipped)
            data = f.read(limit)
    except OSError as e:
        fail(ShardwiseError, path, f"cannot be read ({e.strerror or e})")
    if skipped:
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else b""
    records, bad = _parse_lines(data, path)
    return MetricsRead([record for _, record in records], bad, skipped)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (or of RUN_DIR/metrics.jsonl), skipping a line that is not a
    whole JSON object (the torn last line of a killed run); `read_metrics_file` says what was left out."""
    return read_metrics_file(path).records


def keep_records_through(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl (atomically) with only its whole records of steps <= `step`: a run
    resumed from the checkpoint of `step` logs the later steps again, and the file stays one curve.
    A file that is not a regular one is refused (ConfigError naming it); one larger than
    `MAX_METRICS_KEPT` is left as it is, with a warning (its records are kept, not read into memory)."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_file() and path.stat().st_size > MAX_METRICS_KEPT:
        log.warning("%s is larger than %d bytes: left as it is (the records after step %d stay before the resumed "
                    "run's)", path, MAX_METRICS_KEPT, step)
        return
    data = read_bytes(path, ConfigError, limit=MAX_METRICS_KEPT,
                      advice="move it out of the run directory so that the resumed run starts a new one")
    records, bad = _parse_lines(data, path)
    kept = [line for line, r in records if isinstance(r.get("step"), int) and r["step"] <= step]
    dropped = len(records) - len(kept)
    if not dropped and not bad:
        return
    write_text_atomic(path, "".join(line.decode("utf-8") + "\n" for line in kept))
    log.info("%s: kept the %d records through step %d, dropped %d after it%s", path, len(kept), step, dropped,
             f" and {bad} torn line(s)" if bad else "")


def open_for_append(path: Path) -> int:
    """A descriptor appending to the regular file `path` (created if absent), never through a symbolic
    link (the run directory's files are the run's own) and never a FIFO or device (which would block or
    swallow the records); a ConfigError naming the path otherwise."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot append to {path}: {e.strerror or e}; it must be a regular file of the run "
                          "directory (not a symbolic link): move it away and start again") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file (a FIFO or a device?); move it away and start again")
    os.set_blocking(fd, True)
    return fd


class MetricsWriter:
    """Appends one JSON object per record to RUN_DIR/metrics.jsonl, and to the other `loggers`: TensorBoard
    when present, W&B and MLflow (trackers.py: the same records). `loggers` None means the old switch:
    ["tensorboard"] when `tensorboard`, else none. `config` (the run config as a dict) goes to the trackers
    (W&B config, MLflow parameters).

    `resume_step`: the run continues from the checkpoint of this step, so records after it (logged
    by the run before it stopped) are dropped first, from the file and from TensorBoard's view, and the
    first record written after it is preceded by {"step": resume_step, "resumed": true}.

    A tracker that does not start on rank 0 is not raised here, where the other ranks would go on alone:
    `start_failed` says so (False on the other ranks), and every rank calls `check_started(world_size)` right
    after making the writer, which raises on all of them together (one max-reduce of `start_failed`). Until
    then nothing is logged (`write` raises the error). A tracker whose `write` fails later is dropped with a
    warning. `close(status)` ends the trackers' runs as FINISHED, FAILED or KILLED (trackers.py).
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True,
                 resume_step: int | None = None, loggers: Sequence[str] | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        loggers = list(loggers) if loggers is not None else (["tensorboard"] if tensorboard else [])
        check_installed(loggers)  # on every rank, so that no rank goes on alone
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.tb = None
        self.trackers: list[Tracker] = []
        self.start_error: TrackerError | None = None  # rank 0's, when a tracker did not start
        self._fd: int | None = None
        self._resumed_at = None
        if not enabled:
            return
        try:
            self.trackers = open_trackers(loggers, self.run_dir, config, resume=bool(resume_step))
        except TrackerError as exc:  # raised by raise_start_failure, once every rank knows (see the class)
            self.start_error = exc
            return
        if resume_step is not None:
            keep_records_through(self.path, resume_step)
        self._fd = open_for_append(self.path)
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional extra: shardwise[tensorboard]

                # purge_step hides the events a stopped run logged after the step it resumes from.
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
            except ImportError:
                log.debug("tensorboard is not installed; skipping event files")
        # Where the curve continues (`shardwise report` marks it): written with the first record after the resume,
        # so that a finished run resumed at its end is left as it was.
        self._resumed_at = resume_step or None

    @property
    def start_failed(self) -> bool:
        """Whether a tracker did not start (on rank 0; the other ranks open none)."""
        return self.start_error is not None

    def check_started(self, world_size: int = 1) -> None:
        """On every rank, before any step: raise on all ranks when a tracker did not start on rank 0 (a
        collective over the ranks when `world_size` > 1)."""
        failed = float(self.start_failed)
        if (max_over(failed) if world_size > 1 else failed) > 0:
            self.raise_start_failure()

    def raise_start_failure(self) -> NoReturn:
        """Raise why the trackers did not start: rank 0's error (the logger, the run directory, the fix); on the
        other ranks an error that points to rank 0's."""
        if self.start_error is not None:
            raise self.start_error
        raise TrackerError(f"train.loggers: a tracker did not start on rank 0 for the run in {self.run_dir}, so "
                           "every rank stops; rank 0's error names the logger and the fix")

    def write(self, record: dict[str, Any]) -> None:
        """Record metrics for `record['step']`: one line, in one write (a kill cannot tear it but mid-write)."""
        if self.start_error is not None:
            raise self.start_error
        if not self.enabled or self._fd is None:
            return
        if self._resumed_at:
            self._append_and_track({"step": self._resumed_at, "resumed": True})
            self._resumed_at = None
        self._append_and_track(record)
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def _append_and_track(self, record: dict[str, Any]) -> None:
        """The line of metrics.jsonl, and the same record to each tracker (W&B, MLflow)."""
        self._append(record)
        for tracker in list(self.trackers):
            try:
                tracker.write(record)
            except Exception as exc:  # noqa: BLE001 - rank 0 alone must not raise mid-run (see the class)
                log.warning("train.loggers: %s failed to log step %s (%s: %s) and gets no more records for the run "
                            "in %s; metrics.jsonl holds them all", tracker.name, record.get("step"),
                            type(exc).__name__, exc, self.run_dir)
                self.trackers.remove(tracker)
                close_all([tracker], FAILED, self.run_dir)

    def _append(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record) + "\n").encode("utf-8")
        while data:  # a regular file takes the whole write at once; a short write is finished here
            data = data[os.write(self._fd, data):]

    def close(self, status: str = FINISHED) -> None:
        """Close the file, flush TensorBoard and end the trackers' runs with `status`: FINISHED, FAILED (training
        raised) or KILLED (stopped by a signal). A tracker that fails to close is logged, not raised."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        trackers, self.trackers = self.trackers, []
        close_all(trackers, status, self.run_dir)
