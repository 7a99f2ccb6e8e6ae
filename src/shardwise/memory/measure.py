"""Exact accounting of live tensor memory on one process, and the training phase of its peak.

`MemoryTracker` is a TorchDispatchMode: every tensor an op creates or reads is traced to its storage,
and the bytes of the storages alive are summed (views share a storage and count once; a storage
counts from its creation to its release, and `UntypedStorage.resize_`, which FSDP2 uses to free and
re-allocate all-gathered parameters without an op, is followed too). What it counts is the quantity
`estimate_memory` predicts: the bytes of tensor storages this process allocates, on its own threads,
on the device type given (all but "meta" by default). It does not count allocator rounding or
caching, memory outside tensors (the Python heap, gloo/NCCL internal buffers), or tensors created on
other threads (gloo's worker threads). Under tensor parallelism a DTensor op runs its local ops
inside this mode's own dispatch, so they are not seen one by one: the op's result is counted, a
temporary inside the op is not.

Phases: "forward" from a module's forward pre-hook, "backward" while autograd runs a backward pass
(recomputed forwards included), "optimizer" inside `optimizer.step` and wherever `mark` says so (the
trainer's phase hook marks the end of a step's forward/backward: unscale, clipping, fp32 master
copies), "checkpoint" likewise. `shardwise.train.probe.measure_training` runs the Trainer for a few
steps under a tracker and reports the peak of each phase.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, Iterator, Optional

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "backward", "optimizer", "checkpoint")


@dataclass
class Measurement:
    """Peak live tensor bytes on one process: overall, per phase, and what was live at the peak."""

    peak: int
    peak_phase: str
    phases: dict[str, int]  # phase -> its largest live total
    split: dict[str, int] = field(default_factory=dict)  # at the peak: params, grads, optimizer, masters, other
    rank: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"rank": self.rank, "peak": self.peak, "peak_phase": self.peak_phase, "phases": dict(self.phases),
                "split": dict(self.split)}


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages; records the peak (and per-phase peaks) while recording.

    Use as a context manager around the work (it must be active before the tensors to count are
    created); `start_recording()` opens the measured window. `device_type`: count only storages on
    that device type ("cuda", "cpu"); None counts every device but "meta".
    """

    def __init__(self, device_type: Optional[str] = None, detail: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self.detail = detail  # remember the op, shape and phase that created each storage (slower)
        self._origin: dict[int, str] = {}  # creation number -> "phase op shape dtype" (with detail)
        self.live = 0
        self.peak = 0
        self.peak_phase = "forward"
        self.phase_peaks: dict[str, int] = {}
        self.recording = False
        self._sizes: dict[int, int] = {}  # storage key -> bytes
        self._serials: dict[int, int] = {}  # storage key -> creation number (keys are addresses, reused)
        self._created = 0
        self._at_peak: dict[int, int] = {}  # creation number -> bytes, of the storages live at the peak
        self._at_phase_peak: dict[str, dict[int, int]] = {}  # the same at each phase's peak (with detail)
        self._explicit: list[str] = []  # phases entered with `phase()`
        self._sticky = "forward"  # the phase set by the last hook
        self._optimizer_depth = 0
        self._handles: list[Any] = []
        self._orig_resize: Any = None

    # --- the window and phases ---------------------------------------------------------------------

    def start_recording(self) -> None:
        """Open the window: from now on peaks are recorded (starting from what is live now)."""
        self.recording = True
        self._observe()

    def stop_recording(self) -> None:
        """Close the window."""
        self.recording = False

    def current_phase(self) -> str:
        """The phase the next allocation is attributed to."""
        if self._explicit:
            return self._explicit[-1]
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self._optimizer_depth:
            return "optimizer"
        return self._sticky

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute everything inside the block to phase `name` (e.g. "checkpoint")."""
        self._explicit.append(name)
        try:
            yield
        finally:
            self._explicit.pop()

    def mark(self, name: str) -> None:
        """Set the phase until the next hook changes it (e.g. "optimizer" after the last backward)."""
        self._sticky = name

    # --- counting ----------------------------------------------------------------------------------

    def _observe(self) -> None:
        if not self.recording:
            return
        phase = self.current_phase()
        if self.live > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = self.live
            if self.detail:
                self._at_phase_peak[phase] = {self._serials[k]: n for k, n in self._sizes.items()}
        if self.live > self.peak:
            self.peak = self.live
            self.peak_phase = phase
            self._at_peak = {self._serials[k]: n for k, n in self._sizes.items()}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._serials.pop(key, None)

    def _track_storage(self, st: torch.UntypedStorage, origin: Any = None) -> None:
        key = st._cdata
        size = st.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = size
            self._serials[key] = self._created
            if self.detail:
                self._origin[self._created] = f"{self.current_phase()} {origin}"
            self._created += 1
            self.live += size
            weakref.finalize(st, self._free, key)
        elif size != old:  # resized in place
            self._sizes[key] = size
            self.live += size - old

    def _track(self, t: torch.Tensor, func: Any = None) -> None:
        if t.device.type == "meta" or (self.device_type is not None and t.device.type != self.device_type):
            return
        if t.is_sparse or getattr(t, "is_nested", False):
            return
        if hasattr(t, "_local_tensor"):  # a DTensor: its memory is its local shard's
            t = t._local_tensor
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            # A wrapper subclass (torchao's 8-bit state): its memory is its plain parts'; the storage it
            # reports itself is a stand-in of its nominal dtype and shape, never allocated.
            for part in t.__tensor_flatten__()[0]:
                self._track(getattr(t, part), func)
            return
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - tensors without a storage (e.g. functional wrappers)
            return
        self._track_storage(st, f"{func} {tuple(t.shape)} {t.dtype}" if self.detail else None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        # Inputs too: tensors made outside any op (torch.from_numpy batches) are counted when first used.
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._track(t)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, func)
        self._observe()
        return out

    def track_existing(self, tensors: Any) -> None:
        """Count tensors that exist already (created before the tracker was entered)."""
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._track(t)

    # --- what was live at the peak -----------------------------------------------------------------

    def split_at_peak(self, groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
        """Bytes of the storages live at the peak that back each group's (still live) tensors; the rest as "other"."""
        left = dict(self._at_peak)
        out = {}
        for name, tensors in groups.items():
            total = 0
            for t in tensors:
                if hasattr(t, "_local_tensor"):
                    t = t._local_tensor
                serial = self._serials.get(t.untyped_storage()._cdata)
                total += left.pop(serial, 0) if serial is not None else 0
            out[name] = total
        out["other"] = sum(left.values())
        return out

    def peak_storages(self, top: int = 30, phase: Optional[str] = None) -> list[tuple[int, str]]:
        """The largest storages live at the peak (of `phase`, with detail=True): (bytes, "phase op shape dtype")."""
        snapshot = self._at_peak if phase is None else self._at_phase_peak.get(phase, {})
        items = sorted(snapshot.items(), key=lambda kv: -kv[1])[:top]
        return [(n, self._origin.get(serial, "?")) for serial, n in items]

    def measurement(self, groups: Optional[dict[str, list[torch.Tensor]]] = None, rank: int = 0) -> Measurement:
        """The recorded peaks (and the split of the peak when `groups` is given)."""
        return Measurement(peak=self.peak, peak_phase=self.peak_phase, phases=dict(self.phase_peaks),
                           split=self.split_at_peak(groups) if groups else {}, rank=rank)

    # --- hooks -------------------------------------------------------------------------------------

    def __enter__(self) -> "MemoryTracker":

        def forward_pre(_module: Any, _args: Any) -> None:
            if torch._C._current_graph_task_id() == -1 and not self._optimizer_depth:
                self._sticky = "forward"

        def opt_pre(*_a: Any) -> None:
            self._optimizer_depth += 1

        def opt_post(*_a: Any) -> None:
            self._optimizer_depth = max(0, self._optimizer_depth - 1)

        self._handles = [register_module_forward_pre_hook(forward_pre), register_optimizer_step_pre_hook(opt_pre),
                         register_optimizer_step_post_hook(opt_post)]
        # FSDP2 frees and re-allocates all-gathered parameters with UntypedStorage.resize_, which is no op.
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        @wraps(orig)
        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            if st._cdata in tracker._sizes:
                tracker._track_storage(st)
                tracker._observe()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
            for h in self._handles:
                h.remove()
            self._handles = []
