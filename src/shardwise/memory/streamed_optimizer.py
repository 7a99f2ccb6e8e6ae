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

from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
from torch.optim.adam import adam as adam_update

from ..config.schema import OPTIMIZER_CHUNK_ELEMENTS
from ..errors import ConfigError
from ..parallel.dtensors import local_tensor
from .lane import Lane
from .offload import can_pin, like_param
from .precision import round_into

BLOCK = 256  # elements per fp32 scale of the 8-bit moments (torchao's AdamW8bit block size)


def _host_copy(local: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host copy of `local` in `dtype`, page-locked where there is an accelerator to copy from."""
    host = torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=pin)
    host.copy_(local)
    return host


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
            self.masters = [like_param(p, _host_copy(local_tensor(p).detach(), torch.float32, pin))
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
    device as its turn comes (see the module docstring).

    `params`: the device parameters (or groups of them), which hold the gradients and get the update.
    `decoupled`: AdamW's weight decay. `state_dtype`: the moments' dtype in host memory (None: fp32 for
    fp32 or O2 weights, the weights' own 16-bit dtype at O3). `eight_bit`: torchao's block-wise 8-bit
    moments instead (a byte per element and an fp32 scale per block of 256; tensors under 4096 elements, or
    not a whole number of blocks, keep `state_dtype` moments), updated by torchao's own `single_param_adam`
    (torch.compile'd on an accelerator). `masters`: the O2 masters, or None. The state streams in units of
    at most `chunk_elements` elements of one tensor (so a vocabulary-sized matrix never holds the device's
    room), `prefetch` units ahead of the one being updated.

    A step honours `found_inf` (set by `train.optim.step_unless` or the optimizer in backward) on the
    device: a non-finite step leaves weights, moments, masters and step counts as they were.
    """

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 decoupled: bool, device: torch.device, state_dtype: Optional[torch.dtype] = None,
                 masters: Optional[StreamMasters] = None, eight_bit: bool = False,
                 chunk_elements: int = OPTIMIZER_CHUNK_ELEMENTS, prefetch: int = 1) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True,
                         decoupled_weight_decay=decoupled)
        if chunk_elements % BLOCK:
            raise ValueError(f"chunk_elements must be a multiple of {BLOCK}, got {chunk_elements}")
        self.fused = True  # the optimizer in backward passes its running non-finite flag as `found_inf`
        self.device, self.state_dtype, self.masters, self.prefetch = device, state_dtype, masters, prefetch
        self.eight_bit, self.chunk_elements = eight_bit, chunk_elements
        self.lane = Lane(device)
        if masters is not None:
            masters.lane = self.lane
        self.pin = can_pin(device)
        self.ordered = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self.ordered)}
        self._group = {id(p): g for g in self.param_groups for p in g["params"]}
        # The order the parameters were updated in last step (the optimizer in backward: the order their
        # gradients became final), which the next step's prefetch follows; until a step has run, the
        # reverse of the parameters' order (the backward's, roughly).
        self._order = list(reversed(range(len(self.ordered))))
        self._seen: list[int] = []
        self._fetched: dict[tuple[int, int], tuple[dict[str, torch.Tensor], Any]] = {}
        self._qmaps: dict[bool, torch.Tensor] = {}  # the 8-bit code maps on the device, signed and not
        self.bytes_in = self.bytes_out = 0  # what crossed (or, on a CPU, was copied as if crossing) the bus
        self.fetched_late = 0  # units the update had to fetch from the start (not prefetched)

    # --- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - the class's docstring
        if closure is not None:
            raise ValueError("StreamedAdam.step does not take a closure")
        self._new_step()
        self._order = [i for i, p in enumerate(self.ordered) if p.grad is not None]  # this step's order, known
        for p in self.ordered:
            if p.grad is not None:
                self._update(p)
        self._new_step()
        return None

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict) -> None:
        """Update one parameter (the optimizer in backward); `group` is its own, found by index."""
        if p.grad is not None:
            if self._index[id(p)] in self._seen:  # the first parameter of a new step
                self._new_step()
            self._update(p)

    def _new_step(self) -> None:
        """Remember this step's order for the next step's prefetch; drop fetches it did not use."""
        if self._seen:
            seen = set(self._seen)
            self._order = self._seen + [i for i in self._order if i not in seen]
        self._seen = []
        self._fetched.clear()

    def _units(self, i: int) -> list[tuple[int, int]]:
        """The (start, end) element ranges parameter i's state streams in."""
        n = local_tensor(self.ordered[i]).numel()
        return [(a, min(a + self.chunk_elements, n)) for a in range(0, n, self.chunk_elements)] or [(0, 0)]

    def _update(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self._seen.append(i)
        if not self.state[p]:
            self._init_state(p)
        group = self._group[id(p)]
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            found_inf = found_inf.to(device=self.device, dtype=torch.float32)
        step = stepped = None  # the step count as the update found it, and as it leaves it
        for c, (a, b) in enumerate(self._units(i)):
            dev = self._take((i, c))
            self._prefetch_after(i, c)
            if c == 0:
                step = dev.pop("step")  # comes with the first unit; every unit updates from the same count
            weights = dev["master"] if "master" in dev else _flat(p)[a:b]
            grad = _flat(p.grad)[a:b]
            if self.eight_bit:
                stepped = self._update_torchao(weights, grad, dev, step, group, found_inf)
            else:
                stepped = self._update_plain(weights, grad, dev, step, group, found_inf)
            if "master" in dev:
                _flat(p)[a:b].copy_(weights)  # rounded into the 16-bit weights on the device
            self._write_back(p, (a, b), dev)
        self._write_back(p, (0, 0), {"step": stepped})

    def _update_plain(self, weights: torch.Tensor, grad: torch.Tensor, dev: dict[str, torch.Tensor],
                      step: torch.Tensor, group: dict, found_inf: Optional[torch.Tensor]) -> torch.Tensor:
        """torch's fused Adam kernel on one unit (16-bit moments widened to the weights' dtype and back);
        returns the step count after it (the kernel counts it up, and back down on a non-finite step)."""
        if grad.dtype != weights.dtype:
            grad = grad.to(weights.dtype)
        m, v = dev["exp_avg"], dev["exp_avg_sq"]
        work_m, work_v = (m.to(weights.dtype), v.to(weights.dtype)) if m.dtype != weights.dtype else (m, v)
        counted = step.clone()
        beta1, beta2 = group["betas"]
        adam_update([weights], [grad], [work_m], [work_v], [], [counted], foreach=False, capturable=False,
                    differentiable=False, fused=True, grad_scale=None, found_inf=found_inf, has_complex=False,
                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False)
        if work_m is not m:  # bf16 moments: rounded stochastically, so that they keep decaying
            round_into(m, work_m, counted)
            round_into(v, work_v, counted)
        return counted

    def _update_torchao(self, weights: torch.Tensor, grad: torch.Tensor, dev: dict[str, torch.Tensor],
                        step: torch.Tensor, group: dict, found_inf: Optional[torch.Tensor]) -> torch.Tensor:
        """torchao's Adam update (adamw_8bit) on one unit, with its 8-bit moments (plain ones for a tensor too
        small to quantise, as torchao keeps them); a non-finite step puts back what it changed. Returns the
        step count after it."""
        lowbit = _torchao()
        moments, parts = [], {}
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if f"{k}.codes" in dev:
                parts.update({f"{k}.codes": dev[f"{k}.codes"], f"{k}.scale": dev[f"{k}.scale"]})
                moments.append(lowbit.OptimState8bit(dev[f"{k}.codes"], dev[f"{k}.scale"], self._qmap(signed), signed))
            else:
                parts[k] = dev[k]
                moments.append(dev[k])
        kept = {k: t.clone() for k, t in {**parts, "weights": weights}.items()} if found_inf is not None else {}
        counted = step + 1
        beta1, beta2 = group["betas"]
        lr = torch.tensor(group["lr"], dtype=torch.float32)
        # As torchao's AdamW8bit (the plain path's adamw_8bit): round-to-nearest into bf16 weights. Each chunk
        # size compiles once; the cache limit is lifted as torchao lifts it for its per-parameter graphs.
        with torch._dynamo.utils.disable_cache_limit():
            _adam_8bit_kernel(self.lane.accelerated)(weights, grad, counted, moments[0], moments[1], None, lr, beta1,
                                                     beta2, group["weight_decay"], group["eps"],
                                                     group["decoupled_weight_decay"], False)
        if found_inf is None:
            return counted
        bad = found_inf > 0
        for k, before in kept.items():
            now = weights if k == "weights" else parts[k]
            now.copy_(torch.where(bad, before, now))
        return counted - found_inf

    def _qmap(self, signed: bool) -> torch.Tensor:
        if signed not in self._qmaps:
            lowbit = _torchao()
            values = lowbit.get_qmap_signed() if signed else lowbit.get_qmap_unsigned()
            self._qmaps[signed] = torch.tensor(values, dtype=torch.float32, device=self.device)
        return self._qmaps[signed]

    # --- the copies ---------------------------------------------------------------------------------

    def _host_state(self, p: torch.Tensor, a: int, b: int) -> dict[str, torch.Tensor]:
        """The host tensors of elements [a, b) of p's state (flat views), with its master where there is one
        and, for the unit that starts at 0, the step count; a parameter not stepped yet gets its zero state
        first."""
        if not self.state[p]:
            self._init_state(p)
        st = self.state[p]
        out = {"step": st["step"]} if a == 0 else {}
        for k in ("exp_avg", "exp_avg_sq"):
            moment = local_tensor(st[k])
            if _is_8bit(moment):
                out[f"{k}.codes"] = moment.codes.view(-1)[a:b]
                out[f"{k}.scale"] = moment.scale[a // moment.block_size:b // moment.block_size]
            else:
                out[k] = moment.view(-1)[a:b]
        master = self.masters.master_of(p) if self.masters is not None else None
        if master is not None:
            out["master"] = local_tensor(master).view(-1)[a:b]
        return out

    def _fetch(self, unit: tuple[int, int]) -> tuple[dict[str, torch.Tensor], Any]:
        """Queue the copy of one unit of a parameter's state to the device on the side stream."""
        i, c = unit
        host = self._host_state(self.ordered[i], *self._units(i)[c])
        with self.lane.stream:
            dev = {k: t.to(self.device, non_blocking=self.pin, copy=True) for k, t in host.items()}
            ready = self.lane.mark()
        self.bytes_in += sum(t.numel() * t.element_size() for t in host.values())
        return dev, ready

    def _take(self, unit: tuple[int, int]) -> dict[str, torch.Tensor]:
        """One unit of state on the device, ready for the compute stream (fetched now if not ahead)."""
        fetched = self._fetched.pop(unit, None)
        if fetched is None:
            self.fetched_late += 1
            fetched = self._fetch(unit)
        dev, ready = fetched
        compute = self.lane.compute_stream()
        self.lane.wait(compute, ready)
        self.lane.used_on(list(dev.values()), compute)
        return dev

    def _prefetch_after(self, i: int, c: int) -> None:
        """Start fetching the next `prefetch` units: the rest of this parameter's, then those of the
        parameters that follow it in last step's order."""
        upcoming = [(i, k) for k in range(c + 1, len(self._units(i)))]
        try:
            at = self._order.index(i)
        except ValueError:
            at = len(self._order)
        for j in self._order[at + 1:]:
            if len(upcoming) >= self.prefetch:
                break
            if j not in self._seen:
                upcoming += [(j, k) for k in range(len(self._units(j)))]
        for unit in upcoming[:self.prefetch]:
            if unit not in self._fetched:
                self._fetched[unit] = self._fetch(unit)

    def _write_back(self, p: torch.Tensor, span: tuple[int, int], dev: dict[str, torch.Tensor]) -> None:
        """Queue the copy of what `dev` holds of elements `span` of p's state (the step count: span (0, 0))
        to host memory on the side stream, after the update."""
        host = {k: t for k, t in self._host_state(p, *span).items() if k in dev}
        done = self.lane.mark(self.lane.compute_stream())
        with self.lane.stream:
            self.lane.wait(self.lane.stream, done)
            for k, t in host.items():
                t.copy_(dev[k], non_blocking=self.pin)
        self.bytes_out += sum(t.numel() * t.element_size() for t in host.values())

    # --- state --------------------------------------------------------------------------------------

    def _init_state(self, p: torch.Tensor) -> None:
        """Zero moments and step for p, in host memory: 8-bit where asked and the tensor is large enough
        (torchao's rule), else in `state_dtype` (or the dtype the update runs in)."""
        local = local_tensor(p)
        master = self.masters.master_of(p) if self.masters is not None else None
        dtype = self.state_dtype or (torch.float32 if master is not None else local.dtype)
        eight = self.eight_bit and local.numel() >= 4096 and local.numel() % BLOCK == 0
        st = self.state[p]
        for k, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if eight:
                state8 = _torchao().OptimState8bit
                moment = state8.zeros(local.shape, signed, BLOCK, device="cpu")
                if self.pin:
                    moment = state8(moment.codes.pin_memory(), moment.scale.pin_memory(), moment.qmap, signed)
            else:
                moment = torch.zeros(local.shape, dtype=dtype, device="cpu", pin_memory=self.pin)
            st[k] = like_param(p, moment)
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
        """Not supported: torch's load would cast the state to the device parameters' dtype and device. The
        checkpointer loads the host state in place instead."""
        raise NotImplementedError("StreamedAdam's state is loaded in place by the checkpointer (host memory, "
                                  "its own dtypes); torch's load_state_dict would move it to the device")

    def host_bytes(self) -> int:
        """Bytes of host memory the state and the masters hold."""
        tensors = []
        for st in self.state.values():
            for k, t in st.items():
                t = local_tensor(t)
                tensors += [t.codes, t.scale] if _is_8bit(t) else [t]
        if self.masters is not None:
            tensors += [local_tensor(m) for m in self.masters.masters]
        return sum(t.numel() * t.element_size() for t in tensors)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of `t`, flat (a view: parameters and gradients are contiguous)."""
    return local_tensor(t).view(-1)


def _is_8bit(t: torch.Tensor) -> bool:
    """Whether a moment is torchao's 8-bit state (codes, block scales, code map)."""
    return hasattr(t, "codes") and hasattr(t, "scale")


def _torchao() -> SimpleNamespace:
    """torchao's 8-bit optimizer pieces (the `lowbit` extra), imported when 8-bit state is streamed."""
    try:
        from torchao.optim.adam import single_param_adam
        from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned
    except Exception as e:  # noqa: BLE001 - missing, or built for another torch
        raise ConfigError(f"train.optimizer adamw_8bit with optimize.offload_optimizer stream needs torchao "
                          f"(pip install 'shardwise[lowbit]'); it could not be imported ({type(e).__name__}: {e})"
                          ) from None
    return SimpleNamespace(single_param_adam=single_param_adam, OptimState8bit=OptimState8bit,
                           get_qmap_signed=get_qmap_signed, get_qmap_unsigned=get_qmap_unsigned)


def _adam_8bit_kernel(compiled: bool) -> Any:
    """torchao's single-parameter Adam update: torch.compile'd on an accelerator as torchao's own 8-bit
    AdamW runs it (fused dequantise, update, requantise), eager on a CPU (the same arithmetic, op by op)."""
    update = _torchao().single_param_adam
    if not compiled:
        return update
    return torch.compile(update, fullgraph=True, dynamic=False)
