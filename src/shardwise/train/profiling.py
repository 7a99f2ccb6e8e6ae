"""train.profile: a torch.profiler trace of a few optimizer steps, and what it says.

`StepProfiler` records steps start_step..start_step+steps-1 (1-based, as metrics.jsonl numbers them) of
rank 0 (the other ranks run the same steps; one trace keeps the files small and the run unslowed there):
CPU operators, and on CUDA the kernels too, without shapes or stacks. The step before start_step, when
there is one, warms the profiler up and is not recorded. After the last recorded step it writes, into
RUN_DIR/profile/:

- `trace_rank0.json`: the Chrome / Perfetto trace (open it in https://ui.perfetto.dev or chrome://tracing);
  its ProfilerStep#k spans are the recorded steps, k counted from 0 at the first step this process ran;
  a span runs from one `step` call to the next and holds whatever the loop did in between (with `step`
  called at the end of each loop iteration: step k's data loading, the step itself, and its logging,
  checkpoint save or evaluation);
- `memory_snapshot.pickle` (CUDA only): torch's allocator history over the recorded steps, for
  https://pytorch.org/memory_viz;
- `summary.json`, read by `shardwise report`:
  - "steps": the recorded steps (1-based), e.g. [3, 4];
  - "top_operators": the TOP_OPERATORS operators with the most self time, most first, each
    {"name", "self_time_ms" (summed over the recorded steps, in milliseconds), "share" (of all operators'
    self time)}: CPU time on a CPU, device time on CUDA;
  - "shares": {"compute", "communication", "idle"}, fractions of the recorded steps' time that sum to 1;
  - "trace": "profile/trace_rank0.json" (relative to RUN_DIR).

The shares split the recorded steps' time into three. That time is their ProfilerStep spans on the host;
on CUDA it runs on to the end of the last kernel when the device finishes after the host (the host only
queues kernels, so the last step's kernels can run after its span). Communication: the main thread inside a
collective (on a CPU, also within an operator that calls it), or a collective running elsewhere (gloo's
worker threads, NCCL kernels) while nothing computes: exposed communication, since what overlaps
computation costs no time. Compute: the rest of the time some computation runs (on a CPU a top-level
operator on the main thread, backward included; on CUDA a kernel that is no NCCL kernel). Idle: the rest
(the host waiting or running Python between operators, on CUDA the device starved). `is_communication`
says which names are collectives: c10d's operators (c10d::allreduce_, _c10d_functional::wait_tensor) and
the backends' annotations and kernels (gloo:all_reduce, nccl:all_gather, ncclDevKernel_*, HCCL's
hcom_* / Hccl*). The backends' annotations are the only annotations that count as work: FSDP::all_gather_copy_in
and its like are annotations around copies and c10d operators.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerAction, ProfilerActivity

from ..config.schema import ProfileConfig
from ..files import write_text_atomic

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"
SUMMARY_FILE = "summary.json"
MEMORY_SNAPSHOT_FILE = "memory_snapshot.pickle"
TOP_OPERATORS = 15
COLLECTIVE_OPERATORS = ("c10d::", "_c10d_functional::", "c10d_functional::", "_c10d_functional_autograd::",
                        "record_param_comms")  # name prefixes: torch.distributed's operators
BACKEND_MARKERS = ("gloo", "nccl", "hccl", "hcom", "mpi:", "ucc:")  # in the backends' annotations and kernels
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot (the newest)
Intervals = Sequence[tuple[float, float]]  # (start, end) in microseconds
STEP_SPAN = "ProfilerStep"  # its events are named ProfilerStep#k in the trace, ProfilerStep* in prof.events()


def trace_file(rank: int) -> str:
    """The trace's file name in RUN_DIR/profile/."""
    return f"trace_rank{rank}.json"


def is_communication(name: str) -> bool:
    """Whether an operator, annotation or kernel of this name is a collective: a torch.distributed operator
    (c10d::allreduce_, _c10d_functional::all_gather_into_tensor) or a backend's (gloo:all_reduce,
    ncclDevKernel_AllReduce_Sum_bf16_RING_LL, hcom_allReduce_). Names are matched by prefix or backend, not by
    words such as "broadcast" or "all_gather", which computing names hold too (aten::broadcast_tensors,
    FSDP::all_gather_copy_in)."""
    low = name.lower()
    return low.startswith(COLLECTIVE_OPERATORS) or any(marker in low for marker in BACKEND_MARKERS)


class StepProfiler:
    """torch.profiler over the steps of train.profile: `start(first_step)` before the loop, `step(done)` once per
    loop iteration after optimizer step `done` (1-based; at the iteration's end, the span of step k holds all
    of its iteration), `stop()` when the loop ends (in a finally).
    Without a profile, on ranks other than 0 or when the run starts past start_step, every call does nothing."""

    def __init__(self, spec: Optional[ProfileConfig], run_dir: Path, device: torch.device, rank: int) -> None:
        self.spec = spec
        self.dir = Path(run_dir) / PROFILE_DIR
        self.device = device
        self.rank = rank
        self.on = spec is not None and rank == 0
        self.recorded: list[int] = []
        self.summary: Optional[dict[str, Any]] = None  # once written
        self._prof: Any = None
        self._first = 1
        self._memory = device.type == "cuda"  # the allocator's history: CUDA only

    @property
    def last_step(self) -> int:
        return self.spec.start_step + self.spec.steps - 1

    def start(self, first_step: int, total_steps: int) -> "StepProfiler":
        """Begin before the loop's first step, the 1-based `first_step` (the run ends after `total_steps`)."""
        if not self.on:
            return self
        if not first_step <= self.spec.start_step <= total_steps:
            log.warning("train.profile: this run trains steps %d-%d, and start_step %d is not among them; nothing "
                        "is profiled (set train.profile.start_step within them)", first_step, total_steps,
                        self.spec.start_step)
            self.on = False
            return self
        if self.last_step > total_steps:
            log.warning("train.profile: the run ends at step %d, so steps %d-%d are profiled, not %d", total_steps,
                        self.spec.start_step, total_steps, self.spec.steps)
        self._first = first_step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = torch.profiler.profile(activities=activities, schedule=self._action, on_trace_ready=self._write,
                                            record_shapes=False, with_stack=False, profile_memory=False)
        self._prof.start()
        if first_step == self.spec.start_step:
            self._record_memory()
        return self

    def step(self, done: int) -> float:
        """After optimizer step `done` (1-based): moves the profiler on; after the last step, writes the files.
        Returns the seconds that took (starting the trace, writing the files), for the metrics to leave out."""
        if self._prof is None:
            return 0.0
        if self.spec.start_step <= done <= self.last_step:
            self.recorded.append(done)
        if done + 1 == self.spec.start_step:
            self._record_memory()
        begun = time.perf_counter()
        self._prof.step()
        return time.perf_counter() - begun

    def stop(self) -> None:
        """End profiling (the loop has ended); the files are written now if the run ended inside the window.
        A failure to write them is logged, not raised: it must not replace the error that ended a run."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            prof.stop()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("train.profile: writing the profile failed: %s", exc)
        finally:
            self._stop_memory()

    # --- the schedule and the files ----------------------------------------------------------------------------

    def _action(self, n: int) -> ProfilerAction:
        """The profiler's action for its n-th step (0 = the first step this process runs)."""
        step = self._first + n
        if step < self.spec.start_step - 1 or step > self.last_step:
            return ProfilerAction.NONE
        if step < self.spec.start_step:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if step == self.last_step else ProfilerAction.RECORD

    def _record_memory(self) -> None:
        if self._memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def _stop_memory(self) -> None:
        if self._memory:
            self._memory = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write(self, prof: Any) -> None:
        """on_trace_ready: the trace, the memory snapshot and the summary."""
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / trace_file(self.rank)
        prof.export_chrome_trace(str(trace))
        if self._memory:
            torch.cuda.memory._dump_snapshot(str(self.dir / MEMORY_SNAPSHOT_FILE))
            self._stop_memory()
        on_device = self.device.type == "cuda"
        self.summary = {"steps": list(self.recorded),
                        "top_operators": top_operators(prof.key_averages(), on_device),
                        "shares": time_shares(prof.events(), on_device),
                        "trace": f"{PROFILE_DIR}/{trace.name}"}
        write_text_atomic(self.dir / SUMMARY_FILE, json.dumps(self.summary, indent=1) + "\n")
        shares = self.summary["shares"]
        log.info("profile of steps %s: compute %.0f%%, communication %.0f%%, idle %.0f%% of the time; top operator "
                 "%s; trace and summary in %s", _steps_text(self.recorded), 100 * shares["compute"],
                 100 * shares["communication"], 100 * shares["idle"],
                 (self.summary["top_operators"] or [{"name": "none"}])[0]["name"], self.dir)


def _steps_text(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else (str(steps[0]) if steps else "none")


# --- the summary ------------------------------------------------------------------------------------------------


def top_operators(averages: Iterable[Any], on_device: bool = False, n: int = TOP_OPERATORS) -> list[dict[str, Any]]:
    """The `n` operators with the most self time (`prof.key_averages()` rows: CPU time, or on CUDA the device
    time of the host-side operators, not the kernel rows, which would count it twice), each with its share of
    all operators' self time. Step spans and other annotations (record_function) are no operator."""
    rows = []
    for avg in averages:
        if avg.is_user_annotation or avg.key.startswith(STEP_SPAN):
            continue
        if on_device and avg.device_type != DeviceType.CPU:
            continue
        us = avg.self_device_time_total if on_device else avg.self_cpu_time_total
        rows.append((avg.key, float(us)))
    total = sum(us for _, us in rows)
    rows.sort(key=lambda row: -row[1])
    return [{"name": name, "self_time_ms": us / 1000, "share": us / total if total > 0 else 0.0}
            for name, us in rows[:n]]


def time_shares(events: Iterable[Any], on_device: bool = False) -> dict[str, float]:
    """Compute, communication and idle shares of the recorded steps' wall time, from `prof.events()`
    (see the module's docstring)."""
    events = list(events)
    spans = [e for e in events if e.is_user_annotation and e.name.startswith(STEP_SPAN)
             and e.device_type == DeviceType.CPU]
    main = spans[0].thread if spans else None
    compute, blocking, background = [], [], []
    for e in events:
        # gloo's and NCCL's collectives are annotations (gloo:all_reduce); other annotations are no work of their own
        if e.is_async or e.name.startswith(STEP_SPAN) or (e.is_user_annotation and not is_communication(e.name)):
            continue
        interval = (e.time_range.start, e.time_range.end)
        if on_device:  # the device's kernels; the host only queues them
            if e.device_type == DeviceType.CUDA:
                (background if is_communication(e.name) else compute).append(interval)
        elif e.device_type == DeviceType.CPU:
            if e.thread != main:
                if is_communication(e.name):
                    background.append(interval)  # a backend's worker thread (gloo)
            elif is_communication(e.name):
                blocking.append(interval)  # the main thread inside a collective, at any depth
            elif _top_level(e):
                compute.append(interval)
    steps = [(e.time_range.start, e.time_range.end) for e in spans]
    if on_device:
        steps = _until_the_device_is_done(steps, compute + background)
    return shares_of(steps, compute, background, blocking)


def _until_the_device_is_done(steps: list[tuple[float, float]],
                              kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The steps' host spans, run on to the end of the last kernel when the device finishes after the host."""
    if not steps or not kernels:
        return steps
    host_end, device_end = max(end for _, end in steps), max(end for _, end in kernels)
    return steps + [(host_end, device_end)] if device_end > host_end else steps


def _top_level(event: Any) -> bool:
    """An operator inside no other operator (step spans and other annotations do not count)."""
    parent = event.cpu_parent
    while parent is not None and parent.is_user_annotation:
        parent = parent.cpu_parent
    return parent is None


def shares_of(steps: Intervals, compute: Intervals, communication: Intervals,
              blocking: Intervals = ()) -> dict[str, float]:
    """Shares of the steps' time (a list of intervals) spent communicating, computing and neither; they sum to
    1 (all idle without step time). `blocking`: collectives the computing thread is inside, which count as
    communication even within a computing operator (a CPU's top-level operator holds the collectives it
    calls); `compute`: computation, less that; `communication`: collectives elsewhere (a backend's thread, the
    device), counted only while nothing computes (exposed)."""
    window = _union(steps)
    total = _length(window)
    if total <= 0:
        return {"compute": 0.0, "communication": 0.0, "idle": 1.0}
    blocked = _intersect(_union(blocking), window)
    computing = _subtract(_intersect(_union(compute), window), blocked)
    talking = _subtract(_union(blocked + _intersect(_union(communication), window)), computing)
    compute_share, communication_share = _length(computing) / total, _length(talking) / total
    return {"compute": compute_share, "communication": communication_share,
            "idle": max(1.0 - compute_share - communication_share, 0.0)}


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time two sorted, disjoint interval lists share."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time of `a` outside `b` (both sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        cur, k = start, j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)
