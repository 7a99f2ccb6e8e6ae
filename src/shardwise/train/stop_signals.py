"""Stopping a run cleanly when the scheduler asks (preemption), and saving on a wall-clock interval.

SLURM and Kubernetes end a job with SIGTERM and kill it a grace period later; SLURM's
`--signal=USR1@120` sends SIGUSR1 two minutes before the time limit. `StopSignals` records either
signal in a rank (the handlers only note which one came; a second one changes nothing), and the
trainer then finishes the step it is in, saves a checkpoint and returns, so that `--resume auto`
continues where the run stopped. SIGINT keeps its default (KeyboardInterrupt).

A signal may reach one rank only, or the ranks at different steps, yet every rank must stop after
the same step or the checkpoint's collective save would hang. `StopVote` makes them agree: after
each step every rank starts an all-reduce (MAX) of [signal number or 0, save due] in a small CPU
int64 tensor and waits for it after the next step, when it is long done; all ranks then read the
same values after the same step. The tensor stays on the CPU, over gloo (on CUDA the default
group's "cpu:gloo" side; under HCCL, which has no CPU side, a gloo group of its own), so the step
never waits for the device. "save due" is rank 0's clock saying that
train.save_minutes have passed since the last save. In one process there is no collective and the
decision is taken at once.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from time import monotonic
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..parallel.collectives import distributed, group_device_types, to_group_device

#: The signals that stop a run after the current step with a checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Between `install()` and `restore()`: SIGTERM and SIGUSR1 are recorded in `received` (the first
    one's number, 0 before any) instead of ending the process. Installed from the main thread only
    (Python allows no other; elsewhere nothing changes); `restore()` puts the previous handlers back."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: object) -> None:
        # Runs between two bytecodes of the main thread: note the signal, nothing else.
        if not self.received:
            self.received = signum


@dataclass(frozen=True)
class StopDecision:
    """What every rank does after a step: stop (the signal that asked, or 0) and / or save."""

    signal: int = 0
    save_due: bool = False

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name


class StopVote:
    """The ranks' agreement, one step late, on stopping (a signal reached any rank) and on saving
    (rank 0: `save_minutes` passed since the last save). Call `after_step()` once after every step on
    every rank, `saved()` after every checkpoint save, and `close()` when the loop ends."""

    def __init__(self, signals: StopSignals, save_minutes: Optional[float], is_main: bool) -> None:
        self.signals = signals
        self.save_s = None if save_minutes is None else save_minutes * 60.0
        self.is_main = is_main
        self.collective = distributed() and dist.get_world_size() > 1
        # The vote stays on the CPU, so that reading it never waits for the device: over the default
        # group's gloo side (CUDA: "cuda:nccl,cpu:gloo"), or a gloo group of its own (HCCL has no CPU side).
        self.group = None
        if self.collective and "cpu" not in group_device_types():
            self.group = dist.new_group(backend="gloo")
        self._last_save = monotonic()
        self._asked = False  # rank 0 voted "save due" and no save has happened since
        self._in_flight: Optional[tuple[Any, torch.Tensor]] = None  # the previous step's vote

    def after_step(self) -> StopDecision:
        """Cast this step's vote; return the decision for the step just done: in one process this
        vote, else the previous step's, agreed by all ranks (nothing before the first has come back)."""
        vote = [self.signals.received, int(self._save_due())]
        if not self.collective:
            return StopDecision(vote[0], bool(vote[1]))
        # A fresh tensor each step: the one in flight is not touched until its reduction is done.
        t = to_group_device(torch.tensor(vote, dtype=torch.int64), self.group)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        previous, self._in_flight = self._in_flight, (work, t)
        if previous is None:
            return StopDecision()
        previous[0].wait()
        stop, save = previous[1].tolist()
        return StopDecision(int(stop), bool(save))

    def saved(self) -> None:
        """A checkpoint was just saved: the save_minutes interval starts again."""
        self._last_save = monotonic()
        self._asked = False

    def close(self) -> None:
        """Wait for the last vote (every rank cast as many, so it completes)."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            previous[0].wait()

    def _save_due(self) -> bool:
        if self.save_s is None or not self.is_main or self._asked:
            return False
        self._asked = monotonic() - self._last_save >= self.save_s
        return self._asked
