"""What a run prints at its end: its main figures and one or two suggestions drawn from them.

`RunTally` adds the figures up in the loop (tokens and skipped steps of every booked step, the host's time
in the data loader, checkpoints written, the last metrics record); `RunFigures` is what the summary is
made from, and `summary_lines(figures)` the lines, a pure function. Each suggestion has its threshold here:

- data loading: the host spent more than DATA_SHARE of the wall time in the loader's `next_step()`;
- memory: on a GPU/NPU the peak stayed below LOW_MEMORY_SHARE of the device's memory;
- MFU: on a GPU/NPU below LOW_MFU;
- skipped steps: more than SKIPPED_SHARE of the steps were skipped (fp16 overflow, or non-finite losses).

At most MAX_SUGGESTIONS of them, in that order of what usually costs the most.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

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
    mfu: float  # at the mean tokens/s over the wall time; nan when the peak is unknown
    peak_memory_gb: float  # the largest of any rank (the last metrics record)
    capacity_gb: Optional[float]  # one device's memory (a CPU: the host's)
    device_type: str
    final_loss: float  # the last step's loss
    eval_loss: Optional[float]
    checkpoints: int  # written by this run
    skipped_steps: int
    mixed_precision: str
    recompute: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class RunTally:
    """The figures of a run as its loop books them."""

    def __init__(self, start: float) -> None:
        self.start = start
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

    def elapsed(self, now: Optional[float] = None) -> float:
        return (time.perf_counter() if now is None else now) - self.start


def summary_lines(f: RunFigures) -> list[str]:
    """The end-of-run summary: the figures, then the suggestions (each line starts "suggestion: ")."""
    mfu = "" if math.isnan(f.mfu) else f", MFU {100 * f.mfu:.1f}%"
    memory = f"peak memory {f.peak_memory_gb:.2f} GiB"
    if f.capacity_gb:
        memory += f" of {f.capacity_gb:.1f} GiB ({100 * f.peak_memory_gb / f.capacity_gb:.0f}%)"
    loss = f"final loss {f.final_loss:.4f}" + (f", eval loss {f.eval_loss:.4f}" if f.eval_loss is not None else "")
    lines = [
        f"run summary: {f.steps} steps (to step {f.last_step}), {f.tokens:,} tokens in {f.wall_s:.1f} s: "
        f"{f.tokens_per_s:,.0f} tokens/s over the wall time{mfu}",
        f"{memory}; {loss}; {f.checkpoints} checkpoint(s) written; {f.skipped_steps} step(s) skipped; "
        f"data loading {100 * _share(f.data_s, f.wall_s):.0f}% of the wall time",
    ]
    return lines + [f"suggestion: {s}" for s in suggestions(f)]


def suggestions(f: RunFigures) -> list[str]:
    """What the figures suggest, at most MAX_SUGGESTIONS (see the module's docstring for the thresholds)."""
    found = []
    data = _share(f.data_s, f.wall_s)
    if data > DATA_SHARE:
        found.append(f"the data loader took {100 * data:.0f}% of the wall time (above {100 * DATA_SHARE:.0f}%): "
                     "raise data.num_workers, or prepare the data once ahead of the run (shardwise prepare)")
    on_accelerator = f.device_type in ACCELERATORS
    if on_accelerator and f.capacity_gb and f.peak_memory_gb < LOW_MEMORY_SHARE * f.capacity_gb:
        less = "" if f.recompute == "none" else f", or recompute less (optimize.recompute is {f.recompute})"
        found.append(f"peak memory {f.peak_memory_gb:.1f} GiB is under {100 * LOW_MEMORY_SHARE:.0f}% of the "
                     f"device's {f.capacity_gb:.0f} GiB: raise train.micro_batch_size (lowering "
                     f"optimize.gradient_accumulation_steps keeps the batch){less}")
    if on_accelerator and not math.isnan(f.mfu) and f.mfu < LOW_MFU:
        found.append(f"MFU {100 * f.mfu:.0f}% is below {100 * LOW_MFU:.0f}%: try run.compile: true, a larger "
                     "train.micro_batch_size, and `shardwise plan` for a layout that communicates less")
    skipped = _share(f.skipped_steps, f.steps)
    if skipped > SKIPPED_SHARE:
        fix = ("fp16 overflowed: use optimize.mixed_precision: bf16 where the device has it"
               if f.mixed_precision == "fp16" else "lower train.lr or raise train.warmup_steps")
        found.append(f"{f.skipped_steps} of {f.steps} steps were skipped (above {100 * SKIPPED_SHARE:.0f}%): {fix}")
    return found[:MAX_SUGGESTIONS]


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0
