"""Optimizers with weight-decay groups, the kernel that steps them, their memory levers, and
learning-rate schedules (warmup, then a decay).

`build_optimizer` makes the optimizer `train.optimizer` names over the decayed / not decayed groups,
stepped by the implementation `train.optimizer_impl` resolves to (`TrainConfig.optimizer_kernel`):

- fused: torch's fused AdamW / Adam kernel (CUDA, CPU): one pass per tensor, no temporaries. On this
  project's CPU it is ~6x faster than foreach on the bench model and agrees with it to ~5e-9 per
  tensor in fp32 (not bitwise: it rounds differently in the last bit of ~0.3% of the elements);
  with bf16 weights it computes in fp32, so it is closer to exact than foreach's bf16 arithmetic.
- foreach: torch's foreach kernels over a whole group at once; AdamW allocates the square root of
  the second moment for the whole group (the size of the decayed weights) during the step.
- chunked: torch's own foreach update (its functional `adam` / `sgd`) applied over chunks of each
  group of at most CHUNK_ELEMENTS elements (at least one tensor): the same arithmetic as foreach,
  bitwise, with a temporary of one chunk.

`train.optimizer_state_dtype: bf16` keeps the moments in bf16 (2 bytes each instead of 4): the step
reads a chunk's moments into fp32, runs the fp32 update and rounds them back stochastically
(`memory.precision.round_into`), so that they keep decaying at beta2 = 0.999 (`ChunkedAdamW` and
friends). `train.optimizer: adamw_8bit` is torchao's block-wise 8-bit AdamW (the `lowbit` extra);
`paged_adamw_8bit` / `paged_adamw` are bitsandbytes' paged AdamW (`paged_optimizer.py`, CUDA).
`OptimizerInBackward` steps each parameter from a post-accumulate-grad hook as soon as its gradient
is final and frees that gradient, so no full set of gradients ever exists; a non-finite gradient stops
the updates through a flag on the device, with every kernel of ours. (`optimize.offload_optimizer:
stream` steps with `memory.streamed_optimizer.StreamedAdam` instead.)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update

from ..config.schema import OPTIMIZER_CHUNK_ELEMENTS
from ..errors import ConfigError
from ..memory.precision import round_into
from ..parallel.collectives import all_reduce
from ..parallel.dtensors import local_tensor
from .paged_optimizer import PAGED_OPTIMIZERS, paged_adamw, paged_problem

CHUNK_ELEMENTS = OPTIMIZER_CHUNK_ELEMENTS  # elements per chunk of the chunked step (64 MiB of fp32)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOWBIT_EXTRA = "pip install 'shardwise[lowbit]'"


def decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Split trainable parameters into decayed (matrices) and not decayed (biases, norms)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: Iterable[tuple[str, torch.Tensor]], name: str, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float, *, kernel: str = "foreach",
                    state_dtype: Optional[torch.dtype] = None, chunk_elements: Optional[int] = None,
                    in_backward: bool = False) -> torch.optim.Optimizer:
    """The optimizer named in `train.optimizer`, over weight-decay groups, stepped by `kernel`
    ("fused", "foreach", "chunked"; `TrainConfig.optimizer_kernel` resolves `train.optimizer_impl`).

    `state_dtype`: the moments' dtype where it differs from the parameters' (bf16 moments of fp32
    weights); None keeps torch's own (the parameters' dtype). `chunk_elements`: the chunked update's
    chunk (default CHUNK_ELEMENTS). `in_backward`: stepped one parameter at a time by
    `OptimizerInBackward` (our classes' `step_param`, which runs no optimizer-step hooks per tensor).
    """
    chunk_elements = chunk_elements or CHUNK_ELEMENTS
    groups = decay_groups(named_params, weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters; check the freeze / LoRA settings")
    if name == "adamw_8bit":
        return _adamw_8bit(groups, lr, betas, eps)
    if name in PAGED_OPTIMIZERS:
        return paged_adamw(groups, name, lr, betas, eps)
    if name not in ("adamw", "adam", "sgd"):
        raise ConfigError(f"train.optimizer {name!r} is not known; use adamw, adam, sgd, adamw_8bit, "
                          "paged_adamw_8bit or paged_adamw")
    if kernel not in ("fused", "foreach", "chunked"):
        raise ConfigError(f"optimizer kernel {kernel!r} is not known; use fused, foreach or chunked")
    if name == "adam":
        for g in groups:
            g["weight_decay"] = 0.0
    dtypes = {p.dtype for g in groups for p in g["params"]}
    if state_dtype is not None and dtypes == {state_dtype}:
        state_dtype = None  # already the parameters' own dtype (bf16 weights at O3)
    fused = kernel == "fused"
    if kernel != "chunked" and state_dtype is None and not in_backward:
        # torch's own classes: foreach batches each group's update into a few big ops; fused runs one
        # kernel per tensor without temporaries.
        if name == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=betas[0], foreach=not fused, fused=fused)
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(groups, lr=lr, betas=betas, eps=eps, foreach=not fused, fused=fused)
    if name == "sgd":
        return ChunkedSGD(groups, lr=lr, momentum=betas[0], fused=fused, chunk_elements=chunk_elements,
                          state_dtype=state_dtype)
    cls = ChunkedAdamW if name == "adamw" else ChunkedAdam
    return cls(groups, lr=lr, betas=betas, eps=eps, fused=fused, chunk_elements=chunk_elements,
               state_dtype=state_dtype)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Step `optimizer` unless `skip` (a 0-dim bool tensor, on the device) is set, without reading it where
    the kernel can skip by itself: torch's fused Adam / AdamW / SGD kernels (ours among them; ZeRO-1's
    local optimizer) take it as their `found_inf` and leave weights, moments and step counts as they
    were. Other kernels (foreach, torchao's 8-bit AdamW) read the flag first: one host sync."""
    kernel = getattr(optimizer, "local", optimizer)  # ZeRO-1 steps its local optimizer over this rank's parts
    if _skips_on_device(kernel):
        device = local_tensor(kernel.param_groups[0]["params"][0]).device
        kernel.found_inf = skip.to(device=device, dtype=torch.float32)
        try:
            optimizer.step()
        finally:
            del kernel.found_inf
    elif not bool(skip):
        optimizer.step()


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s step honours a `found_inf` attribute (torch's fused kernels)."""
    fused = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)) and \
        bool(optimizer.defaults.get("fused"))
    return fused and bool(optimizer.param_groups) and bool(optimizer.param_groups[0]["params"])


def state_dtype_of(setting: str) -> Optional[torch.dtype]:
    """`train.optimizer_state_dtype` as a dtype; None (auto) keeps the parameters' own."""
    return STATE_DTYPES.get(setting)


def check_optimizer(cfg: Any, dims: Any, world_size: int, device: torch.device) -> None:
    """What the schema cannot check of the optimizer settings: the accumulation derived from the device
    count, the data-parallel degree, the 8-bit optimizer's library and devices."""
    t = cfg.train
    dp = dims.dp
    if t.optimizer in PAGED_OPTIMIZERS:
        o = cfg.optimize
        problem = paged_problem(t.optimizer, device.type, dp, cfg.parallel.zero_stage,
                                bool(o.offload_optimizer or o.offload_params))
        if problem:
            raise ConfigError(problem)
    if t.optimizer_in_backward:
        accumulation = cfg.gradient_accumulation(world_size)
        if accumulation > 1:
            raise ConfigError(
                f"train.optimizer_in_backward with {accumulation} micro-batches per step (train.global_batch_size "
                f"{cfg.global_batch_size(world_size)}): each micro-batch's backward would update the weights; use "
                "one micro-batch per step (global_batch_size = micro_batch_size x data_parallel), or "
                "optimizer_in_backward: false")
        if dims.pp > 1 or (dp > 1 and cfg.parallel.zero_stage == 1):
            raise ConfigError("train.optimizer_in_backward needs a layout without pipeline parallelism and without "
                              "ZeRO-1; use zero_stage 0, 2 or 3")
    if t.optimizer != "adamw_8bit":
        return
    if dp > 1 and cfg.parallel.zero_stage == 1:
        raise ConfigError(
            "train.optimizer adamw_8bit with zero_stage 1: ZeRO-1 gathers and broadcasts each owner's state as plain "
            "tensors, and the 8-bit moments are torchao tensor subclasses; use zero_stage 0, 2 or 3 (ZeRO 2/3 shard "
            "the 8-bit state like the parameters)")
    if not lowbit_available():
        raise ConfigError(f"train.optimizer adamw_8bit needs torchao: {LOWBIT_EXTRA} (pip install torchao; it must "
                          f"match torch {torch.__version__}), or use train.optimizer adamw with "
                          "train.optimizer_state_dtype bf16")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"train.optimizer adamw_8bit runs torchao's kernels on CPU and CUDA, not {device.type}; use "
                          "train.optimizer adamw with train.optimizer_state_dtype bf16")


def lowbit_available() -> bool:
    """Whether torchao's 8-bit optimizers can be imported (the `lowbit` extra)."""
    try:
        import torchao.optim  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another torch: either way not usable
        return False
    return True


def _adamw_8bit(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """torchao's AdamW8bit: both moments block-wise quantised to 8 bits (256 elements a block share an
    fp32 scale); tensors under 4096 elements, or not a whole number of blocks, keep fp32 moments."""
    try:
        from torchao.optim import AdamW8bit
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"train.optimizer adamw_8bit needs torchao ({LOWBIT_EXTRA}); it could not be imported "
                          f"({type(e).__name__}: {e}). Install it, or use train.optimizer adamw with "
                          "train.optimizer_state_dtype bf16") from None

    class ShardwiseAdamW8bit(AdamW8bit):
        """torchao's AdamW8bit; its per-tensor update is torch.compile'd, which cannot trace through a
        TorchDispatchMode, so under one (memory.measure's exact counting) it runs eagerly."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # noqa: D102
            # torchao's update mixes a parameter with a gradient of other placements wrongly (tensor
            # parallelism's embedding: Shard(0) weight, Replicate gradient; its update was ~100% off):
            # give every gradient its parameter's placements first (a local slice from Replicate).
            for group in self.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                        p.grad = g.redistribute(p.device_mesh, p.placements)
            if torch._C._len_torch_dispatch_stack() == 0:
                return super().step(closure)
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

        def initial_state(self, p: torch.Tensor, group: dict) -> None:
            """The state torchao's step makes for `p` before its first update (the optimizer in backward
            copies it before that update, to put it back if the update must not count)."""
            state = self.state[p]
            state["step"] = torch.tensor(0.0)  # as torchao keeps it: in host memory
            state["exp_avg"] = self._new_buffer(p, True)
            state["exp_avg_sq"] = self._new_buffer(p, False)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = self._new_buffer(p, False)

    return ShardwiseAdamW8bit(groups, lr=lr, betas=betas, eps=eps)


# --- the chunked step ---------------------------------------------------------------------------------


def chunks(params: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `params` of at most `limit` (local) elements each; a larger tensor alone."""
    run: list[torch.Tensor] = []
    size = 0
    for p in params:
        n = local_tensor(p).numel()
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(p)
        size += n
    if run:
        yield run


class _ChunkedStep:
    """The step of `ChunkedAdamW`, `ChunkedAdam` and `ChunkedSGD`: torch's functional update (the same
    arithmetic as the class's own step) over chunks of each group, with moments kept in `state_dtype`
    and read into fp32 one chunk at a time."""

    chunk_elements: int
    state_dtype: Optional[torch.dtype]
    fused: bool

    def _setup(self, fused: bool, chunk_elements: int, state_dtype: Optional[torch.dtype]) -> None:
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        self.fused, self.chunk_elements, self.state_dtype = fused, chunk_elements, state_dtype
        # In the defaults, so that ZeRO-1's ZeroOneOptimizer rebuilds the same kind of optimizer.
        self.defaults.update(fused=fused, chunk_elements=chunk_elements, state_dtype=state_dtype)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - the class's docstring
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step does not take a closure")
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            for chunk in chunks(with_grad, self.chunk_elements):
                self._update(group, chunk)
        return None

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict) -> None:
        """Update one parameter of `group` (the optimizer in backward)."""
        if p.grad is not None:
            self._update(group, [p])

    def _moment(self, p: torch.Tensor) -> torch.Tensor:
        """A new zero moment for `p`, in the state dtype."""
        return torch.zeros_like(p, dtype=self.state_dtype or p.dtype, memory_format=torch.preserve_format)

    def _work(self, moments: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The moments the update runs on: fp32 copies of 16-bit ones (one chunk's worth)."""
        if self.state_dtype is None:
            return moments
        return [m.to(p.dtype) for m, p in zip(moments, params)]

    def _keep(self, stored: list[torch.Tensor], work: list[torch.Tensor], steps: list[Any]) -> None:
        """Round the updated fp32 moments back into their 16-bit storage, stochastically (`round_into`, a
        different draw at each of the parameters' `steps`); the fp32 copies are spent."""
        if self.state_dtype is not None:
            for s, w, step in zip(stored, work, steps):
                round_into(s, w, step)

    def _found_inf(self) -> Optional[torch.Tensor]:
        """The flag `step_unless` sets for a fused step to skip on the device (None otherwise)."""
        return getattr(self, "found_inf", None) if self.fused else None

    def _step_tensor(self, p: torch.Tensor) -> torch.Tensor:
        # As torch's Adam: the fused kernel reads the step on the parameter's device, foreach on the CPU.
        if self.fused:
            return torch.zeros((), dtype=torch.float32, device=p.device)
        return torch.tensor(0.0, dtype=torch.float32)


class _ChunkedAdamStep(_ChunkedStep):
    def initial_state(self, p: torch.Tensor, group: dict) -> None:
        """`p`'s state before its first update: step 0, zero moments."""
        state = self.state[p]
        state["step"] = self._step_tensor(p)
        state["exp_avg"] = self._moment(p)
        state["exp_avg_sq"] = self._moment(p)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._moment(p)

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        amsgrad = group["amsgrad"]
        for p in params:
            if not self.state[p]:
                self.initial_state(p, group)
        states = [self.state[p] for p in params]
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        stored = {k: [s[k] for s in states] for k in keys}
        work = {k: self._work(v, params) for k, v in stored.items()}
        beta1, beta2 = group["betas"]
        adam_update(
            params, [p.grad for p in params], work["exp_avg"], work["exp_avg_sq"], work.get("max_exp_avg_sq", []),
            [s["step"] for s in states], foreach=not self.fused, capturable=group.get("capturable", False),
            differentiable=False, fused=self.fused, grad_scale=None, found_inf=self._found_inf(),
            has_complex=False,
            decoupled_weight_decay=group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)),
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"])
        for k in stored:
            self._keep(stored[k], work[k], [s["step"] for s in states])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state to the parameter's dtype; 16-bit moments go back."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if self.state_dtype is not None:
            for st in self.state.values():
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if torch.is_tensor(st.get(k)):
                        st[k] = st[k].to(self.state_dtype)


class ChunkedAdamW(_ChunkedAdamStep, torch.optim.AdamW):
    """AdamW stepped chunk by chunk (temporaries of one chunk), moments optionally 16-bit."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.01,
                 fused: bool = False, chunk_elements: int = CHUNK_ELEMENTS,
                 state_dtype: Optional[torch.dtype] = None) -> None:
        torch.optim.AdamW.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                   foreach=not fused, fused=fused)
        self._setup(fused, chunk_elements, state_dtype)


class ChunkedAdam(_ChunkedAdamStep, torch.optim.Adam):
    """Adam stepped chunk by chunk (temporaries of one chunk), moments optionally 16-bit."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 fused: bool = False, chunk_elements: int = CHUNK_ELEMENTS,
                 state_dtype: Optional[torch.dtype] = None) -> None:
        torch.optim.Adam.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  foreach=not fused, fused=fused)
        self._setup(fused, chunk_elements, state_dtype)


class ChunkedSGD(_ChunkedStep, torch.optim.SGD):
    """SGD stepped chunk by chunk, its momentum optionally 16-bit."""

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 fused: bool = False, chunk_elements: int = CHUNK_ELEMENTS,
                 state_dtype: Optional[torch.dtype] = None) -> None:
        torch.optim.SGD.__init__(self, params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                 foreach=not fused, fused=fused)
        self._setup(fused, chunk_elements, state_dtype)
        self._roundings: dict[int, int] = {}  # per tensor: bf16 momentum roundings so far (their salt)

    def initial_state(self, p: torch.Tensor, group: dict) -> None:
        """`p`'s state before its first update, for the optimizer in backward: a zero momentum buffer,
        which the first update fills with the gradient as torch's first step does (with dampening 0,
        all `build_optimizer` makes). A plain step makes the buffer at the first update instead."""
        if group["momentum"] != 0:
            self.state[p]["momentum_buffer"] = self._moment(p)

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        stored = [self.state[p].get("momentum_buffer") for p in params]
        work = [None if b is None else b.to(p.dtype) if self.state_dtype is not None else b
                for b, p in zip(stored, params)]
        sgd_update(params, [p.grad for p in params], work, has_sparse_grad=False, foreach=not self.fused,
                            fused=self.fused, grad_scale=None, found_inf=self._found_inf(),
                            weight_decay=group["weight_decay"],
                            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                            nesterov=group["nesterov"], maximize=group["maximize"])
        if group["momentum"] == 0:
            return
        for p, s, w in zip(params, stored, work):
            if s is None:  # the first step made the buffer (a copy of the gradient)
                s = self.state[p]["momentum_buffer"] = w if self.state_dtype is None else self._moment(p)
            if self.state_dtype is not None:  # SGD keeps no step count: one of the rounding's own, per tensor
                self._roundings[id(p)] = self._roundings.get(id(p), 0) + 1
                round_into(s, w, self._roundings[id(p)])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state to the parameter's dtype; a 16-bit momentum goes back."""
        super().load_state_dict(state_dict)
        if self.state_dtype is not None:
            for st in self.state.values():
                if torch.is_tensor(st.get("momentum_buffer")):
                    st["momentum_buffer"] = st["momentum_buffer"].to(self.state_dtype)


# --- the optimizer in backward ----------------------------------------------------------------------


class OptimizerInBackward:
    """Steps each parameter as soon as autograd (or FSDP2, after its reduce-scatter) has its whole
    gradient, from a post-accumulate-grad hook, then frees that gradient: no full set of gradients
    ever exists, and there is no separate optimizer step.

    `params`: the tensors autograd accumulates into (the model's parameters), with `target(p)` the
    tensor the optimizer steps for each (its fp32 master at level O2, else p itself: the masters'
    own hook has moved the gradient there by then) and `after(p)` what to do once it is updated
    (copy the master back). The optimizer is the run's own one (its state, checkpoints and learning
    rate as usual); each update runs over that one parameter of its group.

    Non-finite gradients, without a host sync: a flag on the device records whether a gradient was not
    finite, and from the first such gradient no update counts, in this step or a later one, until the
    host has read the flag (`read_finite`). A fused kernel (`on_device`) takes the flag as its
    `found_inf` and skips itself. Shardwise's other kernels (foreach, chunked, torchao's 8-bit AdamW:
    `undoes`) update, then put the parameter and its state back where the flag is set, from copies
    taken just before (the stepped tensor and its state: one parameter's worth, alive during its
    update). Step counters such a kernel keeps in host memory (torch's foreach and torchao keep them
    there on an accelerator) cannot be put back without reading the flag: they are noted, and put back
    when the host reads it. Any other optimizer (bitsandbytes' paged AdamW) reads the flag on the host
    before each update: a sync per tensor.

    A non-finite loss makes every gradient non-finite, so the first one already stops the step and no
    weight is touched; a gradient that overflows in the middle of the backward leaves the parameters
    updated before it updated (those whose gradients came first, nearest the output). The trainer
    reads the flag with the step's other figures, one step later or at once at a log, save or
    evaluation step, and stops the run; the step in between updated nothing. The gradient norm of the
    step is gathered as the gradients go, its squares in float64 (`finish`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 target: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
                 after: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self.optimizer, self.target, self.after = optimizer, target, after
        self.group_of = {id(q): g for g in optimizer.param_groups for q in g["params"]}
        self.on_device = bool(getattr(optimizer, "fused", False)) and hasattr(optimizer, "step_param")
        self.undoes = not self.on_device and hasattr(optimizer, "initial_state")
        self._finite = True  # what the host has read of the flag since `begin`
        self._bad: Optional[torch.Tensor] = None  # on the device: a gradient since the last read was not finite
        # Per step (this one and the one before): (step counter in host memory, its value before an update,
        # the flag as that update saw it), to put back if the flag turns out set.
        self._host_counts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[]]
        self._squares: dict[tuple, list[torch.Tensor]] = {}
        self._meshes: dict[tuple, Any] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    @property
    def finite(self) -> bool:
        """Whether every gradient since `begin` was finite (`read_finite`: a host sync)."""
        return self.read_finite()

    @property
    def not_finite(self) -> Optional[torch.Tensor]:
        """The device's flag, not read: whether a gradient since the host last read it was not finite
        (None before the first gradient)."""
        return self._bad

    def read_finite(self) -> bool:
        """Whether every gradient since `begin` was finite. Reads the device's flag (a host sync: the trainer
        does so only to stop the run); when it is set, the step counters in host memory that counted
        undone updates go back, and from now on updates count again."""
        if self._bad is not None:
            bad, self._bad = self._bad, None
            if bool(bad):
                self._finite = False
                self._put_back_host_counts()
            self._host_counts = [[]]
        return self._finite

    def begin(self) -> None:
        """Start a step: forget the last step's norm. The flag stays until the host reads it (the trainer
        reads a step's figures by the end of the next step), and so do the notes of the last step's host
        counters; older ones go."""
        self._finite = True
        self._squares, self._meshes = {}, {}
        self._host_counts = self._host_counts[-1:] + [[]]

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        q = self.target(p)
        grad = q.grad
        if grad is None:
            return
        key, mesh = _norm_key(grad)
        if key is None:  # a partial sum (tensor parallelism's replicated norms): reduced, then its norm
            key, mesh = ("reduced", ()), None
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32).full_tensor()
        else:  # this rank's part; the parts' squares add up over the mesh dimensions it is split over
            norm = torch.linalg.vector_norm(local_tensor(grad), dtype=torch.float32)
        square = norm.double() ** 2  # summed in float64, so that every layout's sum agrees (`finish`)
        self._squares.setdefault(key, []).append(square)
        self._meshes[key] = mesh
        bad = ~torch.isfinite(norm)
        self._bad = bad if self._bad is None else self._bad | bad
        if self.on_device:
            self._step_skipping(q)
        elif self.undoes:
            self._step_then_undo(q)
        else:
            self._step_after_reading(q)
        if self.after is not None:
            self.after(p)
        q.grad = None

    def _step_skipping(self, q: torch.Tensor) -> None:
        """Update `q` with a kernel that skips by itself where the flag is set (its `found_inf`)."""
        self.optimizer.found_inf = self._bad.to(torch.float32)
        try:
            self.optimizer.step_param(q, self.group_of[id(q)])
        finally:
            del self.optimizer.found_inf

    def _step_then_undo(self, q: torch.Tensor) -> None:
        """Update `q`, then put it and its state back where the flag is set, from copies taken before (the
        optimizer updates its state tensors in place)."""
        group = self.group_of[id(q)]
        state = self.optimizer.state[q]
        if not state:  # its first update: the state it starts from, to have something to put back
            self.optimizer.initial_state(q, group)
        kept = [(t, t.clone()) for t in _value_tensors([q, *state.values()])]
        self._step(q, group)
        bad = self._bad
        for now, before in kept:
            if _apart_from_flag(now, bad):  # a step counter in host memory: put back if the host reads the flag set
                self._host_counts[-1].append((now, before, bad))
            else:
                torch.where(bad, before, now, out=now)

    def _step_after_reading(self, q: torch.Tensor) -> None:
        """Update `q` unless the flag is set, read on the host (a sync per tensor): for an optimizer that is
        not shardwise's (bitsandbytes' paged AdamW replaces its step counts in each step)."""
        if not bool(self._bad):
            self._step(q, self.group_of[id(q)])

    def _step(self, q: torch.Tensor, group: dict) -> None:
        """One update of `q` (our optimizers' `step_param`, else the optimizer's step over `q` alone)."""
        step_param = getattr(self.optimizer, "step_param", None)
        if step_param is not None:
            step_param(q, group)
        else:
            _step_one(self.optimizer, q, group)

    def _put_back_host_counts(self) -> None:
        """Give the host counters noted since the last read the value they had before their first update
        under a set flag (one more read: the flags those updates saw)."""
        noted = [n for step in self._host_counts for n in step]
        if not noted:
            return
        seen = torch.stack([flag.reshape(()) for _, _, flag in noted]).tolist()
        for (counter, before, _), was_bad in reversed(list(zip(noted, seen))):  # the earliest undone update last
            if was_bad:
                counter.copy_(before)

    def finish(self) -> torch.Tensor:
        """The step's global gradient norm (a collective over the meshes of sharded gradients), on the device:
        the squares summed in float64 (the order of a sum differs between layouts; float64 keeps that out of
        the figures), its square root given back in float32."""
        total: Optional[torch.Tensor] = None
        for key in sorted(self._squares, key=repr):
            part = torch.stack(self._squares[key]).sum()
            mesh, dims = self._meshes[key], key[1]
            for d in dims:  # sharded (or partial) over these mesh dimensions: sum over their groups
                part = all_reduce(part, mesh.get_group(d), dist.ReduceOp.SUM)
            total = part if total is None else total + part.to(total.device)
        return (total if total is not None else torch.zeros((), dtype=torch.float64)).sqrt().float()

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _apart_from_flag(t: torch.Tensor, flag: torch.Tensor) -> bool:
    """Whether `t` lives where the device's flag is not (a step counter in host memory on an accelerator):
    putting it back by the flag would need the flag on the host."""
    return t.device != flag.device


def _value_tensors(tensors: Iterable[Any]) -> list[torch.Tensor]:
    """The plain tensors that hold the values of `tensors` (others skipped): a DTensor's local part, a
    tensor subclass's inner tensors (torchao's 8-bit moments: codes, scales and their quantisation map)."""
    out: list[torch.Tensor] = []
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        t = local_tensor(t)
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            out += _value_tensors(getattr(t, n) for n in names)
        else:
            out.append(t.detach())
    return out


def _norm_key(grad: torch.Tensor) -> tuple[Optional[tuple], Any]:
    """Gradients whose squared norms add up alike: plain ones, or DTensors by mesh and the mesh
    dimensions they are sharded over; (None, None) for a partial sum, whose parts' norms do not add."""
    if not isinstance(grad, DTensor):
        return ("plain", ()), None
    if any(pl.is_partial() for pl in grad.placements):
        return None, None
    mesh = grad.device_mesh
    dims = tuple(i for i, pl in enumerate(grad.placements) if pl.is_shard())
    return (tuple(mesh.mesh_dim_names or ()), dims), mesh


def _step_one(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> None:
    """Step one parameter with an optimizer that steps whole groups (torch's, torchao's): its step
    runs over a one-parameter copy of the group (state and learning rate shared)."""
    groups = optimizer.param_groups
    optimizer.param_groups = [{**group, "params": [p]}]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


# --- the learning rate ------------------------------------------------------------------------------


class LRSchedule:
    """Linear warmup to `lr`, then cosine, linear, constant or WSD decay to `min_lr` at `total_steps`.

    `lr_at(step)` is the rate for the update made at 0-based optimizer step `step`.
    """

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
                 decay_style: str, wsd_decay_ratio: float = 0.1) -> None:
        self.lr, self.min_lr = lr, min_lr
        self.warmup_steps, self.total_steps = warmup_steps, max(total_steps, 1)
        self.decay_style, self.wsd_decay_ratio = decay_style, wsd_decay_ratio

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based step `step`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if self.decay_style == "wsd":
            decay_start = max(self.warmup_steps, int(self.total_steps * (1 - self.wsd_decay_ratio)))
            if step < decay_start:
                return self.lr
            span = max(self.total_steps - decay_start, 1)
            return self.lr - (self.lr - self.min_lr) * min((step - decay_start + 1) / span, 1.0)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps + 1) / span, 1.0)
        if self.decay_style == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the rate of every param group for `step`; return it (a tensor rate, as torchao's
        optimizers keep, is filled in place)."""
        lr = self.lr_at(step)
        for g in optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        return lr
