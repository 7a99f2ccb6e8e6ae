"""The end of a run on its console: its main figures and one or two suggestions drawn from them.

`RunTally` adds the figures up in the loop (tokens and skipped steps of every booked step, the host's
time in the data loader, the time set aside for work that is no training step, checkpoints written, the
last metrics record); `RunFigures` is what the summary is made from, and `summary_lines(figures)` the lines,
a pure function. Two throughputs are given: in the training steps (the wall time less checkpoint saves,
evaluation and profile writing: what the metrics records measure) and over the whole wall time. Each
suggestion has its threshold here:

- data loading: the host spent more than DATA_SHARE of the training-step time (the wall time when that is
  not known) in the loader's `next_step()`;
- memory: on a GPU/NPU the peak stayed below LOW_MEMORY_SHARE of the device's memory;
- MFU: on a GPU/NPU below LOW_MFU (in the training steps, when known);
- skipped steps: more than SKIPPED_SHARE of the steps were skipped (fp16 overflow, or non-finite losses).

At most MAX_SUGGESTIONS of them, in that order of what usually costs the most.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

DATA_SHARE = 0.10
LOW_MEMORY_SHARE = 0.50
LOW_MFU = 0.30
SKIPPED_SHARE = 0.01
MAX_SUGGESTIONS = 2
ACCELERATORS = ("cuda", "npu")


@dataclass
class RunFigures:
    """A finished run's figures (this process's part of the run: a resumed run counts from its resume)."""

    steps: int  # optimizer steps this run trained
    last_step: int  # the step it ended at
    tokens: int  # real tokens over all ranks
    wall_s: float  # the loop's wall time: steps, logging, checkpoints, evaluation
    data_s: float  # of it, the host's time in the data loader
    mfu: float  # at the tokens/s over the wall time; nan when the peak is unknown
    peak_memory_gb: float  # the largest of any rank (the last metrics record)
    capacity_gb: Optional[float]  # one device's memory (a CPU: the host's)
    device_type: str
    final_loss: float  # the last step's loss
    eval_loss: Optional[float]
    checkpoints: int  # written by this run
    skipped_steps: int
    mixed_precision: str
    recompute: str
    step_s: Optional[float] = None  # of the wall time, inside training steps (RunTally.step_s); None: not known
    step_mfu: float = math.nan  # at the tokens/s in the training steps
    compiled: Optional[bool] = None  # whether run.compile compiled the blocks; None: not known

    @property
    def tokens_per_s(self) -> float:
        """Over the whole wall time: checkpoint saves, evaluation and profile writing included."""
        return _share(self.tokens, self.wall_s)

    @property
    def step_tokens_per_s(self) -> Optional[float]:
        """In the training steps only (None when their time is not known)."""
        return None if self.step_s is None else _share(self.tokens, self.step_s)

    @property
    def data_basis(self) -> str:
        """What the data-loading share is of: the training-step time, or the wall time when that is not known."""
        return "wall time" if self.step_s is None else "training-step time"

    @property
    def data_share(self) -> float:
        """The host's time in the data loader, of the `data_basis`."""
        return _share(self.data_s, self.wall_s if self.step_s is None else self.step_s)

    @property
    def judged_mfu(self) -> float:
        """The MFU a suggestion judges: in the training steps when known, else over the wall time."""
        return self.mfu if math.isnan(self.step_mfu) else self.step_mfu


class RunTally:
    """The figures of a run as its loop books them."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.ended: Optional[float] = None  # end(): the loop's end, before the run's files are closed
        self.aside_s = 0.0  # work that is no training step: checkpoint saves, evaluation, profile writing
        self.steps = 0
        self.tokens = 0
        self.skipped = 0
        self.data_s = 0.0
        self.checkpoints = 0
        self.last_record: Optional[Mapping[str, Any]] = None

    def booked(self, real_tokens: int, skipped: bool) -> None:
        """One step's figures, once read."""
        self.steps += 1
        self.tokens += real_tokens
        self.skipped += int(skipped)

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Time work that is no training step (a checkpoint save, an evaluation), left out of `step_s`."""
        begun = time.perf_counter()
        try:
            yield
        finally:
            self.aside_s += time.perf_counter() - begun

    def set_aside(self, seconds: float) -> None:
        """Leave `seconds` measured elsewhere (the profiler's writing) out of `step_s`."""
        self.aside_s += seconds

    def end(self, now: Optional[float] = None) -> None:
        """The loop has ended: the wall time stops here (closing the trackers' runs is not the run's)."""
        self.ended = time.perf_counter() if now is None else now

    def elapsed(self, now: Optional[float] = None) -> float:
        """The wall time since the loop began, to its end() (or to now)."""
        until = self.ended if self.ended is not None else (time.perf_counter() if now is None else now)
        return until - self.start

    def step_s(self, now: Optional[float] = None) -> float:
        """Of the wall time, the time inside training steps: the rest once the work set aside is taken out."""
        return max(self.elapsed(now) - self.aside_s, 0.0)


def summary_lines(f: RunFigures) -> list[str]:
    """The end-of-run summary: the figures, then the suggestions (each line starts "suggestion: ")."""
    if f.steps == 0:
        return [f"run summary: no step trained (the run was already at step {f.last_step})"]
    memory = "peak memory not measured" if math.isnan(f.peak_memory_gb) else f"peak memory {f.peak_memory_gb:.2f} GiB"
    if f.capacity_gb and not math.isnan(f.peak_memory_gb):
        memory += f" of {f.capacity_gb:.1f} GiB ({100 * f.peak_memory_gb / f.capacity_gb:.0f}%)"
    loss = f"final loss {f.final_loss:.4f}" + (f", eval loss {f.eval_loss:.4f}" if f.eval_loss is not None else "")
    lines = [
        f"run summary: {f.steps} steps (to step {f.last_step}), {f.tokens:,} tokens in {f.wall_s:.1f} s",
        "throughput: " + _throughput(f),
        f"{memory}; {loss}; {f.checkpoints} checkpoint(s) written; {f.skipped_steps} step(s) skipped; "
        f"data loading {100 * f.data_share:.0f}% of the {f.data_basis}",
    ]
    return lines + [f"suggestion: {s}" for s in suggestions(f)]


def _throughput(f: RunFigures) -> str:
    """Tokens/s (and MFU) in the training steps, then over the whole wall time, each labelled."""
    overall = (f"{f.tokens_per_s:,.0f} tokens/s over the wall time (checkpoints, evaluation and profiling "
               f"included{_mfu(f.mfu)})")
    if f.step_tokens_per_s is None:
        return overall
    return f"{f.step_tokens_per_s:,.0f} tokens/s in the training steps ({f.step_s:.1f} s{_mfu(f.step_mfu)}), " + overall


def _mfu(value: float) -> str:
    return "" if math.isnan(value) else f"; MFU {100 * value:.1f}%"


def suggestions(f: RunFigures) -> list[str]:
    """What the figures suggest, at most MAX_SUGGESTIONS (see the module's docstring for the thresholds)."""
    found = []
    if f.data_share > DATA_SHARE:
        found.append(f"the data loader took {100 * f.data_share:.0f}% of the {f.data_basis} (above "
                     f"{100 * DATA_SHARE:.0f}%): raise data.num_workers, or prepare the data once ahead of the run "
                     "(shardwise prepare)")
    on_accelerator = f.device_type in ACCELERATORS
    if on_accelerator and f.capacity_gb and f.peak_memory_gb < LOW_MEMORY_SHARE * f.capacity_gb:
        # recompute: auto already recomputes only what memory needs; full and selective can be lowered
        less = "" if f.recompute in ("none", "auto") else f", or recompute less (optimize.recompute is {f.recompute})"
        found.append(f"peak memory {f.peak_memory_gb:.1f} GiB is under {100 * LOW_MEMORY_SHARE:.0f}% of the "
                     f"device's {f.capacity_gb:.0f} GiB: raise train.micro_batch_size (lowering "
                     f"optimize.gradient_accumulation_steps keeps the batch){less}")
    mfu = f.judged_mfu
    if on_accelerator and not math.isnan(mfu) and mfu < LOW_MFU:
        where = "" if math.isnan(f.step_mfu) else " in the training steps"
        compile_ = "" if f.compiled else "run.compile: true, "
        found.append(f"MFU {100 * mfu:.0f}%{where} is below {100 * LOW_MFU:.0f}%: try {compile_}a larger "
                     "train.micro_batch_size, and `shardwise plan` for a layout that communicates less")
    skipped = _share(f.skipped_steps, f.steps)
    if skipped > SKIPPED_SHARE:
        fix = ("fp16 overflowed: use optimize.mixed_precision: bf16 where the device has it"
               if f.mixed_precision == "fp16" else "lower train.lr or raise train.warmup_steps")
        found.append(f"{f.skipped_steps} of {f.steps} steps were skipped (above {100 * SKIPPED_SHARE:.0f}%): {fix}")
    return found[:MAX_SUGGESTIONS]


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0
