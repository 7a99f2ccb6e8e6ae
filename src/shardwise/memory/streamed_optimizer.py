"""Optimizer state in host memory, updated on the device (optimize.offload_optimizer: stream).

`StreamedAdam` keeps AdamW's (or Adam's) moments, step counts and, at precision O2, the fp32 masters
(`StreamMasters`) in pinned host memory, and updates each parameter on the device: the parameter's state
is copied in on a side stream (the `Lane`) while the previous parameter is being updated, torch's fused
Adam kernel updates it where its gradient is, and the result is copied back on the side stream while the
next one is updated. Only one parameter's state (plus the one being fetched and the one being written
back) is on the device at a time. With `train.optimizer_in_backward` each update runs as soon as autograd
has the parameter's whole gradient, so the copies hide behind the rest of the backward; without it the
updates run after the backward (clipping, accumulation and fp16 loss scaling work as on the plain path)
and the copies hide only behind each other's updates.

What crosses the bus per trained element and step: the two moments in and out (4 bytes each in fp32, 2
with `train.optimizer_state_dtype: bf16`, which the device widens to fp32 for the update and rounds back),
the fp32 master in and out at O2, and nothing else: gradients and weights stay on the device. Compared
with `memory.offload.HostMasters` (optimize.offload_optimizer: cpu, DeepSpeed's ZeRO-Offload), which runs
the whole update on the host CPU, the arithmetic stays on the device, so a step costs the copies (hidden
behind the backward with the optimizer in backward) instead of a host AdamW over every parameter.

Gradients: at O2 they accumulate over micro-batches in the weights' 16-bit dtype on the device (an fp32
gradient per weight would cost the device the memory the lever saves); with one micro-batch per step (the
optimizer in backward) nothing accumulates. Under ZeRO 2/3 each rank streams the state of its own shards.

On a CPU run "host" and "device" are one memory; the same copies (real copies, not aliases) and the same
stream calls run, with the side stream a CPU stream and every event already complete, so the arithmetic
and the bookkeeping are what an accelerator runs.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_update

from ..parallel.dtensors import local_tensor
from .offload import can_pin

STREAMED_STATE = ("exp_avg", "exp_avg_sq", "step")  # what a parameter's state holds, besides its master


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as `param` is: a DTensor of the same mesh and placements around it, or `local` itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _host_copy(local: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host copy of `local` in `dtype`, page-locked where there is an accelerator to copy from."""
    host = torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=pin)
    host.copy_(local)
    return host


class Lane:
    """The side stream that copies state between host and device, and the events that order it against
    the compute stream. On a CPU the stream is a CPU stream and every event is already complete."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerated = device.type != "cpu"
        self.stream = torch.Stream(device=device)

    def mark(self, stream: Any = None) -> Any:
        """An event at the current end of `stream` (default: the side stream); None on a CPU."""
        if not self.accelerated:
            return None
        return (stream or self.stream).record_event()

    def compute_stream(self) -> Any:
        """The stream the update kernels run on."""
        return torch.accelerator.current_stream(self.device) if self.accelerated else None

    def wait(self, stream: Any, event: Any) -> None:
        """Make `stream` wait for `event` (nothing to wait for on a CPU)."""
        if event is not None:
            stream.wait_event(event)

    def used_on(self, tensors: list[torch.Tensor], stream: Any) -> None:
        """Tell the caching allocator that `tensors` (allocated on another stream) are used on `stream`."""
        if self.accelerated:
            for t in tensors:
                t.record_stream(stream)

    def synchronize(self) -> None:
        """Wait on the host for every copy queued so far (before the host reads or writes the state)."""
        if self.accelerated:
            self.stream.synchronize()


class StreamMasters:
    """The fp32 masters of 16-bit weights (level O2) in pinned host memory, for `StreamedAdam`.

    Has the interface of `precision.MasterWeights` that the checkpointer uses (`named_masters`,
    `masters_to_model`, `model_to_masters`): checkpoints hold the same "master" group as any O2 run. The
    trainer's step does not call `masters_to_model`: the streamed update writes the rounded weights itself."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
        self.names = [n for n, _ in named_params]
        self.model_params = [p for _, p in named_params]
        pin = can_pin(device)
        with torch.no_grad():
            self.masters = [_like(p, _host_copy(local_tensor(p).detach(), torch.float32, pin))
                            for p in self.model_params]
        self._index = {id(p): i for i, p in enumerate(self.model_params)}
        self.lane: Optional[Lane] = None  # set by StreamedAdam: copies in flight to wait for

    def named_masters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, host master) pairs, named like the model parameters."""
        return zip(self.names, self.masters)

    def master_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The host master of a model parameter (None for one without: frozen)."""
        i = self._index.get(id(param))
        return None if i is None else self.masters[i]

    def grads_to_masters(self) -> None:
        """Nothing to move: the gradients stay on the device, where the update reads them."""

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """The masters into the device parameters, rounded (after a checkpoint loaded the masters)."""
        self._settle()
        for p, m in zip(self.model_params, self.masters):
            local_tensor(p).copy_(local_tensor(m))

    @torch.no_grad()
    def model_to_masters(self) -> None:
        """Refresh the masters from the model (after loading weights that carry no masters)."""
        self._settle()
        for p, m in zip(self.model_params, self.masters):
            local_tensor(m).copy_(local_tensor(p))

    def _settle(self) -> None:
        if self.lane is not None:
            self.lane.synchronize()


class StreamedAdam(torch.optim.Adam):
    """Adam / AdamW with its state (and `masters`, at O2) in host memory, each parameter updated on the
    device by torch's fused kernel as its turn comes (see the module docstring).

    `params`: the device parameters (or groups of them), which hold the gradients and get the update.
    `decoupled`: AdamW's weight decay. `state_dtype`: the moments' dtype in host memory (None: fp32 for
    fp32 or O2 weights, the weights' own 16-bit dtype at O3). `masters`: the O2 masters, or None.
    `prefetch`: how many parameters' state are fetched ahead of the one being updated.

    A step honours `found_inf` (set by `train.optim.step_unless` or the optimizer in backward) on the
    device: a non-finite step leaves weights, moments, masters and step counts as they were.
    """

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 decoupled: bool, device: torch.device, state_dtype: Optional[torch.dtype] = None,
                 masters: Optional[StreamMasters] = None, prefetch: int = 1) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True,
                         decoupled_weight_decay=decoupled)
        self.fused = True  # the optimizer in backward passes its running non-finite flag as `found_inf`
        self.device, self.state_dtype, self.masters, self.prefetch = device, state_dtype, masters, prefetch
        self.lane = Lane(device)
        if masters is not None:
            masters.lane = self.lane
        self.pin = can_pin(device)
        self.ordered = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self.ordered)}
        self._group = {id(p): g for g in self.param_groups for p in g["params"]}
        # The order the updates ran in last step (the optimizer in backward: the order gradients became
        # final), which the next step's prefetch follows; until a step has run, the reverse of the
        # parameters' order (the backward's, roughly).
        self._order = list(reversed(range(len(self.ordered))))
        self._seen: list[int] = []
        self._fetched: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self.bytes_in = self.bytes_out = 0  # what crossed (or, on a CPU, was copied as if crossing) the bus
        self.fetched_late = 0  # fetches the update had to wait for from the start (not prefetched)

    # --- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - the class's docstring
        if closure is not None:
            raise ValueError("StreamedAdam.step does not take a closure")
        self._new_step()
        for p in self.ordered:
            if p.grad is not None:
                self._update(p)
        self._new_step()
        return None

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict) -> None:
        """Update one parameter (the optimizer in backward); `group` is its own, found by index."""
        if p.grad is not None:
            i = self._index[id(p)]
            if i in self._seen:  # the first parameter of a new step
                self._new_step()
            self._update(p)

    def _new_step(self) -> None:
        """Remember this step's order for the next step's prefetch; drop fetches it did not use."""
        if self._seen:
            rest = [i for i in self._order if i not in set(self._seen)]
            self._order = self._seen + rest
        self._seen = []
        self._fetched.clear()

    def _update(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self._seen.append(i)
        dev = self._take(i)
        self._prefetch_after(i)
        group = self._group[id(p)]
        weights = dev["master"] if "master" in dev else local_tensor(p)
        grad = local_tensor(p.grad)
        if grad.dtype != weights.dtype:
            grad = grad.to(weights.dtype)
        m, v = dev["exp_avg"], dev["exp_avg_sq"]
        work_m, work_v = (m.to(weights.dtype), v.to(weights.dtype)) if m.dtype != weights.dtype else (m, v)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            found_inf = found_inf.to(device=weights.device, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        adam_update([weights], [grad], [work_m], [work_v], [], [dev["step"]], foreach=False, capturable=False,
                    differentiable=False, fused=True, grad_scale=None, found_inf=found_inf, has_complex=False,
                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False)
        if work_m is not m:
            m.copy_(work_m)
            v.copy_(work_v)
        if "master" in dev:
            local_tensor(p).copy_(weights)  # rounded into the 16-bit weights on the device
        self._write_back(p, dev)

    # --- the copies ---------------------------------------------------------------------------------

    def _host_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The host tensors of p's state (local parts), with its master where there is one; a parameter
        not stepped yet gets its zero state first."""
        if not self.state[p]:
            self._init_state(p)
        st = self.state[p]
        out = {k: local_tensor(st[k]) for k in STREAMED_STATE}
        master = self.masters.master_of(p) if self.masters is not None else None
        if master is not None:
            out["master"] = local_tensor(master)
        return out

    def _fetch(self, i: int) -> tuple[dict[str, torch.Tensor], Any]:
        """Queue the copy of parameter i's state to the device on the side stream."""
        host = self._host_state(self.ordered[i])
        with self.lane.stream:
            dev = {k: t.to(self.device, non_blocking=self.pin, copy=True) for k, t in host.items()}
            ready = self.lane.mark()
        self.bytes_in += sum(t.numel() * t.element_size() for t in host.values())
        return dev, ready

    def _take(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter i's state on the device, ready for the compute stream (fetched now if not ahead)."""
        fetched = self._fetched.pop(i, None)
        if fetched is None:
            self.fetched_late += 1
            fetched = self._fetch(i)
        dev, ready = fetched
        compute = self.lane.compute_stream()
        self.lane.wait(compute, ready)
        self.lane.used_on(list(dev.values()), compute)
        return dev

    def _prefetch_after(self, i: int) -> None:
        """Start fetching the next `prefetch` parameters in last step's order that have a gradient coming."""
        try:
            at = self._order.index(i)
        except ValueError:
            return
        for j in self._order[at + 1:at + 1 + self.prefetch]:
            if j not in self._fetched and j not in self._seen and self.ordered[j].requires_grad:
                self._fetched[j] = self._fetch(j)

    def _write_back(self, p: torch.Tensor, dev: dict[str, torch.Tensor]) -> None:
        """Queue the updated state's copy to host memory on the side stream, after the update."""
        host = self._host_state(p)
        done = self.lane.mark(self.lane.compute_stream())
        with self.lane.stream:
            self.lane.wait(self.lane.stream, done)
            for k, t in host.items():
                t.copy_(dev[k], non_blocking=self.pin)
        self.bytes_out += sum(t.numel() * t.element_size() for t in host.values())

    # --- state --------------------------------------------------------------------------------------

    def _init_state(self, p: torch.Tensor) -> None:
        """Zero moments and step for p, in host memory (the masters' dtype, or `state_dtype`)."""
        local = local_tensor(p)
        master = self.masters.master_of(p) if self.masters is not None else None
        work = torch.float32 if master is not None else local.dtype
        dtype = self.state_dtype or work
        st = self.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = _like(p, torch.zeros(local.shape, dtype=dtype, device="cpu", pin_memory=self.pin))
        st["step"] = torch.zeros((), dtype=torch.float32, device="cpu", pin_memory=self.pin)

    def settle(self) -> None:
        """Wait on the host for the state copies in flight: before anything on the host reads or writes
        the state or the masters (a checkpoint's save or load). Never during a step."""
        self.lane.synchronize()
        self._fetched.clear()

    def state_dict(self) -> dict[str, Any]:
        """torch's, once every copy to host memory has landed."""
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load for the groups' settings; the state itself goes to host memory as saved (torch's
        own load would cast the fp32 moments of an O2 run to the 16-bit weights' dtype)."""
        self.settle()
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for pid, p in zip(saved_ids, self.ordered):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            master = self.masters.master_of(p) if self.masters is not None else None
            dtype = self.state_dtype or (torch.float32 if master is not None else local_tensor(p).dtype)
            st = self.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = _like(p, _host_copy(local_tensor(saved[k]), dtype, self.pin))
            st["step"] = _host_copy(torch.as_tensor(saved["step"]).reshape(()), torch.float32, self.pin)

    def host_bytes(self) -> int:
        """Bytes of host memory the state and the masters hold."""
        tensors = [local_tensor(t) for st in self.state.values() for k, t in st.items() if k in STREAMED_STATE]
        if self.masters is not None:
            tensors += [local_tensor(m) for m in self.masters.masters]
        return sum(t.numel() * t.element_size() for t in tensors)
