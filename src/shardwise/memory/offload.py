"""CPU offload of the optimizer (ZeRO-Offload) and of the activations saved for backward.

`HostMasters` (optimize.offload_optimizer: cpu), as DeepSpeed's ZeRO-Offload: the optimizer's weights
(fp32 masters at precision O2, copies in the weights' own dtype otherwise) and, since the optimizer
steps them, its state live in host memory; the model's parameters and activations stay on the device.
During backward a post-accumulate-grad hook copies each gradient, as soon as it is final, into a
pinned host buffer of the parameter's dtype (non-blocking) and frees the device gradient; the copy is
added (in the master's dtype) into the master's gradient once it has landed, so gradients accumulate
over micro-batches in fp32 on the host exactly as `precision.MasterWeights` accumulates them on the
device. The trainer then unscales, clips (the norm of these host gradients) and steps the optimizer on
the CPU (torch's fused CPU AdamW by default), and `masters_to_model` rounds the updated masters into
the same pinned buffers on the host and copies them to the device parameters (non-blocking: the next
forward, on the same stream, waits for them). Under ZeRO 2/3 each rank keeps the masters of its own
shards (DTensors whose local tensors are on the CPU, as FSDP2's CPU offload makes them), so clipping,
checkpoints and resumes in another layout work as with the device's shards.

Host memory per trained parameter: the master (4 bytes at O0-O2, 2 at O3), its gradient (the same),
the pinned buffer (the parameter's dtype) and the optimizer state. Only the buffers are pinned: they
are all that crosses the bus; the masters and the state never leave the host, and page-locking them
too would take that much memory from the operating system for nothing.

`ActivationOffload` (optimize.offload_activations) is a saved-tensors hook pair: every tensor autograd
saves in the forward (except parameters, which stay where they are) is copied to host memory (pinned
where there is an accelerator) and copied back when the backward needs it. A storage saved through
several tensors (one input of three projections, views of one tensor) is copied once. The outputs a
selective-recompute block keeps, which torch's checkpoint caches past the hooks, go through the same
pair (`parallel.recompute.selective_outputs_through`): out when the block's forward ends, back when
its recompute starts.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..parallel.dtensors import local_tensor
from ..parallel.recompute import selective_outputs_through
from .lane import Lane


def can_pin(device: torch.device) -> bool:
    """Whether host buffers for `device` can (and should) be page-locked: only with an accelerator."""
    return device.type != "cpu" and torch.accelerator.is_available()


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as `param` is: a DTensor of the same mesh and placements around it, or `local` itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


class HostMasters:
    """The optimizer's weights in host memory (optimize.offload_optimizer: cpu); see the module docstring.

    `named_params`: the trainable parameters (names as checkpoints give them). `master_dtype`: the dtype
    the optimizer steps (fp32, or the 16-bit dtype at O3). Has the interface of
    `precision.MasterWeights` that the trainer and the checkpointer use.
    """

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], master_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device = device
        self.model_params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        pin = can_pin(device)
        self.buffers: list[torch.Tensor] = []  # pinned host buffers in each parameter's dtype (both directions)
        self.masters: list[torch.Tensor] = []
        with torch.no_grad():
            for p in self.model_params:
                local = local_tensor(p).detach()
                self.buffers.append(torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin))
                master = local.to(device="cpu", dtype=master_dtype, copy=True)
                self.masters.append(like_param(p, master).requires_grad_(True))
        self._index = {id(p): i for i, p in enumerate(self.model_params)}
        self._in_flight: list[Any] = [None] * len(self.model_params)  # a copy into buffer i not yet added
        self._hooks = [p.register_post_accumulate_grad_hook(self._to_host) for p in self.model_params]

    def named_masters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, host master) pairs, named like the model parameters."""
        return zip(self.names, self.masters)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The host master of a model parameter (the parameter itself when it has none, being frozen)."""
        i = self._index.get(id(param))
        return param if i is None else self.masters[i]

    @torch.no_grad()
    def _to_host(self, p: torch.Tensor) -> None:
        """Start copying p's final gradient to its host buffer; free the device gradient."""
        i = self._index[id(p)]
        if self._in_flight[i] is not None:  # an earlier micro-batch's copy: add it before reusing the buffer
            self._add(i)
        self.buffers[i].copy_(local_tensor(p.grad), non_blocking=True)
        self._in_flight[i] = self._copy_event()
        p.grad = None

    def _copy_event(self) -> Any:
        """Something that says when the copy just queued has landed (True: it has, on a CPU run)."""
        if self.device.type == "cpu":
            return True
        event = torch.Event(device=self.device)
        event.record()
        return event

    @torch.no_grad()
    def _add(self, i: int) -> None:
        """Add buffer i (landed, or waited for) into master i's gradient, in the master's dtype."""
        event = self._in_flight[i]
        if event is not True:
            event.synchronize()
        self._in_flight[i] = None
        m = self.masters[i]
        if m.grad is None:
            m.grad = like_param(m, self.buffers[i].to(local_tensor(m).dtype, copy=True))
        else:
            local_tensor(m.grad).add_(self.buffers[i])

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """Every gradient of the step into the host masters' gradients (before unscaling and clipping):
        copies still on the way are waited for; a gradient no hook took (written by hand) goes too."""
        for p in self.model_params:
            if p.grad is not None:
                self._to_host(p)
        for i, event in enumerate(self._in_flight):
            if event is not None:
                self._add(i)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """The updated masters into the device parameters: rounded to the parameters' dtype on the host,
        into the pinned buffers, then copied over without waiting (the next forward's stream does)."""
        for p, m, buffer in zip(self.model_params, self.masters, self.buffers):
            buffer.copy_(local_tensor(m))
            local_tensor(p).copy_(buffer, non_blocking=True)

    @torch.no_grad()
    def model_to_masters(self) -> None:
        """Refresh the masters from the model (after loading weights that carry no masters)."""
        for p, m in zip(self.model_params, self.masters):
            local_tensor(m).copy_(local_tensor(p))

    def host_bytes(self) -> int:
        """Bytes of host memory held now: masters, their gradients and the buffers (not the optimizer state)."""
        tensors = [local_tensor(m) for m in self.masters] + self.buffers
        tensors += [local_tensor(m.grad) for m in self.masters if m.grad is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Within it, what autograd saves for backward, and what selective-recompute blocks keep, goes to host
    memory and comes back when used (optimize.offload_activations); parameters stay. Enter it around a
    micro-batch's forward. `blocks`: the model's transformer blocks, whose starts group the copies (each
    block's copies come back together, the next block's while it runs)."""

    def __init__(self, device: torch.device, blocks: Sequence[nn.Module] = ()) -> None:
        self.device = device
        self.pin = can_pin(device)
        self.lane = Lane(device)
        self.blocks = list(blocks)
        self._copies: Optional[SavedCopies] = None
        self._scope = contextlib.ExitStack()
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> None:
        # This forward's copies; the saved tensors keep them (and through them the copies) until backward.
        self._copies = SavedCopies(self.lane, self.pin, back_to_device=self.device.type != "cpu")
        for block in self.blocks:
            handle = block.register_forward_pre_hook(lambda *_, c=self._copies: c.next_block())
            self._scope.callback(handle.remove)
        self._scope.enter_context(selective_outputs_through(self._pack, self._unpack))
        super().__enter__()

    def __exit__(self, *args: Any) -> None:
        self._copies = None
        super().__exit__(*args)
        self._scope.close()

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter) or t.is_sparse or type(t) is not torch.Tensor:
            return t  # a weight (or a view of one: linear saves weight.t()) stays; so do tensor subclasses
        assert self._copies is not None, "ActivationOffload packs only inside its `with` block"
        i = self._copies.copy_out(t, base)
        return (self._copies.hosts[i], self._copies, i, t.device, t.dtype, t.storage_offset(), t.shape, t.stride())

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, copies, i, device, dtype, offset, shape, stride = packed
        raw = copies.take(i) if copies.back_to_device else host
        return torch.empty(0, dtype=dtype, device=device).set_(raw.untyped_storage(), offset, shape, stride)


class SavedCopies:
    """One forward's host copies under `ActivationOffload`, in groups: what was saved before the first
    block (group 0), then in each block (a block's group also holds what follows it up to the next block:
    the last one's holds the head's).

    Out: each storage is copied once (a storage saved through several tensors, one input of three
    projections or views of one tensor, shares its copy) on the side stream, after the compute stream has
    made it; the caching allocator keeps the device memory until the copy is done. When block g starts,
    the host waits for block g-2's copies to have landed, so at most two blocks' copies are in flight.

    Back (`back_to_device`; a CPU run reads the host copies in place): when backward first needs a
    storage of group g, all of group g is fetched on the side stream, and group g-1 with it, so the next
    block's tensors arrive while this one's backward runs; a device copy is dropped once every tensor saved
    through it has been taken, and the compute stream waits for its fetch before use."""

    def __init__(self, lane: Lane, pin: bool, back_to_device: bool) -> None:
        self.lane, self.pin, self.back_to_device = lane, pin, back_to_device
        self.hosts: list[torch.Tensor] = []  # the host copies, in the order they were made
        self.groups: list[list[int]] = [[]]  # indices of the copies made in each group
        self.group_of: list[int] = []  # the group of each copy
        self.last_group: list[int] = []  # the last group that saved a tensor through each copy
        self.untaken: list[int] = []  # per copy: tensors saved through it that backward has not taken yet
        self.landed: list[Any] = []  # per finished group: an event after its copies (None on a CPU)
        self.fetched: set[int] = set()  # groups whose copies were sent back to the device
        self.position = 1 << 62  # the group backward is in: the lowest last group of a copy taken so far
        self.on_device: dict[int, tuple[torch.Tensor, Any]] = {}  # copy index -> (device copy, its event)
        # id of a saved tensor's base (itself, or what it is a view of) -> (that base, weakly; its copy's index)
        self._by_base: dict[int, tuple[Any, int]] = {}

    def next_block(self) -> None:
        """A block's forward starts: a new group; the host waits for the copies two groups back."""
        self.landed.append(self.lane.mark())
        self.groups.append([])
        if len(self.landed) >= 2:
            self.lane.landed(self.landed[-2])

    def copy_out(self, t: torch.Tensor, base: torch.Tensor) -> int:
        """The index of the host copy of t's storage, copying it first if this forward has not yet."""
        # One copy per tensor and its views: a view keeps its base alive, so while the view is saved the
        # base is the one that was copied (a dead base's id may be another tensor's: then it is a miss).
        seen = self._by_base.get(id(base))
        if seen is not None and seen[0]() is base:
            i = seen[1]
        else:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            host = torch.empty(flat.shape, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            made = self.lane.mark(self.lane.compute_stream())
            with self.lane.stream:
                self.lane.wait(self.lane.stream, made)
                host.copy_(flat, non_blocking=self.pin)
            self.lane.used_on([flat], self.lane.stream)
            i = len(self.hosts)
            self.hosts.append(host)
            self.groups[-1].append(i)
            self.group_of.append(len(self.groups) - 1)
            self.last_group.append(0)
            self.untaken.append(0)
            self._by_base[id(base)] = (weakref.ref(base), i)
        self.untaken[i] += 1
        self.last_group[i] = len(self.groups) - 1
        return i

    def take(self, i: int) -> torch.Tensor:
        """Copy i's storage on the device, for backward: fetched with its group (and the group before it,
        ahead of use) if it is not there yet. Backward runs the groups from the last down: it is in the
        lowest group whose copies it has taken, each copy counted in the last group that saved a tensor
        through it (a storage the blocks share, the RoPE tables, is copied in the first block's group and
        taken in every block's backward)."""
        self.position = g = min(self.position, self.last_group[i])
        self._fetch(g)
        self._fetch(g - 1)
        if i not in self.on_device:  # taken more often than saved (a graph kept for a second backward)
            self.on_device.update(self._send([i]))
        raw, ready = self.on_device[i]
        compute = self.lane.compute_stream()
        self.lane.wait(compute, ready)
        self.lane.used_on([raw], compute)
        self.untaken[i] -= 1
        if self.untaken[i] <= 0:
            del self.on_device[i]  # the tensors made from it keep it as long as autograd needs them
        return raw

    def _fetch(self, g: int) -> None:
        """Send group g's copies (those backward still needs) back to the device, once."""
        if g < 0 or g in self.fetched:
            return
        self.fetched.add(g)
        self.on_device.update(self._send([i for i in self.groups[g] if self.untaken[i] > 0]))

    def _send(self, indices: list[int]) -> dict[int, tuple[torch.Tensor, Any]]:
        """Copies `indices` to the device on the side stream, each with the event after them."""
        with self.lane.stream:
            raws = {i: self.hosts[i].to(self.lane.device, non_blocking=self.pin, copy=True) for i in indices}
        ready = self.lane.mark()
        return {i: (raw, ready) for i, raw in raws.items()}


def master_dtype_for(param_dtype: torch.dtype, master_weights: bool) -> torch.dtype:
    """The dtype the offloaded optimizer steps: fp32 where the level keeps masters (O2) or the weights
    are fp32; the weights' own 16-bit dtype at O3."""
    return torch.float32 if master_weights else param_dtype
