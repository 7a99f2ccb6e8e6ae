"""Data parallelism with ZeRO stages 0-3, applied to a model from outside (torchtitan style).

Apply it last, after pipeline split, tensor parallel, recompute and compile:

    model = apply_data_parallel(model, meshes, dims, zero_stage, param_dtype=..., offload=...)
    optimizer = shard_optimizer(build_optimizer(model.named_parameters(), ...), model, zero_stage, meshes)
    for i, mb in enumerate(micro_batches):
        with grad_sync(model, i == len(micro_batches) - 1):
            (token_loss_sum(model(mb), labels) / global_tokens).backward()
    norm = clip_grad_norm(params, max_norm)          # the global norm, a plain tensor
    optimizer.step(); optimizer.zero_grad()

Every stage is built on FSDP2's machinery (`fully_shard`, and `replicate`, its replicated twin), so
parameters become DTensors on the data-parallel mesh, parameter names do not change, tensor
parallel composes (parameters that are already DTensors on the "tp" mesh gain the data-parallel
dimension), and DCP's `get_state_dict` / `set_state_dict` handle model and optimizer.

What each stage keeps where, per data-parallel rank (N = data-parallel degree, P = parameter bytes):

- zero 0 (`replicate`, DDP semantics): full parameters, full gradients (all-reduced), full optimizer
  state. Memory P + P + optimizer(P) on every rank.
- zero 1 (`replicate` + `ZeroOneOptimizer`): full parameters and full gradients (all-reduced, as in
  DDP), optimizer state only for the parameters this rank owns: whole tensors assigned greedily by
  size, so about 1/N of the state (as torch's ZeroRedundancyOptimizer). After the step each owner
  broadcasts its updated parameters. Memory P + P + optimizer(P)/N.
- zero 2 (`fully_shard(reshard_after_forward=False)`): gradients reduce-scattered, so each rank
  keeps 1/N of the gradients and 1/N of the optimizer state. FSDP2 has no "full replica, sharded
  gradients" mode: parameters are *sharded at rest* (1/N between steps and during the optimizer
  step). Each block's full parameters are gathered in forward and kept until its backward (no
  second all-gather), so the peak during forward/backward is about the full parameters, as in
  ZeRO-2, but at rest it saves more than ZeRO-2 does.
- zero 3 (`fully_shard(reshard_after_forward=True)`): parameters, gradients and optimizer state all
  sharded 1/N; each block's parameters are gathered for its forward, freed, and gathered again for
  its backward. Peak: the shards plus about one or two blocks' full parameters.

FSDP2 is applied to each transformer block (its own all-gather / reduce-scatter group) and then to
the root (embeddings, final norm, output). With `dims.dp_replicate > 1` zero 2/3 run as HSDP on the
2-D mesh ("dp_replicate", "dp_shard"): sharded within a replica group, replicated (gradients
all-reduced) across groups; zero 0/1 replicate over the flattened "dp" mesh.

Gradient reduction is a SUM over data-parallel ranks, not a mean: the trainer divides each rank's
token-loss sum by the global token count of the step, so the summed gradient is the one-process
gradient. (FSDP2 divides by N by default; we set the divide factor to 1 and force SUM collectives,
since gloo does not support the PREMUL_SUM FSDP2 would otherwise use.)

Mixed precision: with a 16-bit `param_dtype`, FSDP2's `MixedPrecisionPolicy(param_dtype,
reduce_dtype)`: sharded parameters, gradients and optimizer state stay fp32 (they are the master
weights); forward and backward compute in `param_dtype`; gradients are reduced in `reduce_dtype`.
Do not also keep separate fp32 master copies or autocast.

CPU offload (`offload=True`, zero 2/3 only): FSDP2's `CPUOffloadPolicy`: the sharded parameters,
the sharded gradients and the optimizer state live in CPU memory and the optimizer step runs on the
CPU; parameters are copied to the device for each all-gather. Zero 0/1 keep full replicas on the
device by definition, so offload is refused there with a ConfigError (use zero 3).

Frozen parameters (requires_grad=False) are sharded like the others but get no gradient, take no
part in the reduction, and (since `build_optimizer` leaves them out) have no optimizer state.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from .collectives import all_reduce, broadcast_
from .dims import ParallelDims
from .dtensors import local_tensor

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)
_HALF = (torch.bfloat16, torch.float16)


# --- applying data parallelism to the model --------------------------------------------------------

def apply_data_parallel(
    model: nn.Module,
    meshes: Any,
    dims: ParallelDims,
    zero_stage: int,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: torch.dtype = torch.float32,
    offload: bool = False,
    per_block: bool = True,
    reshard_after_forward: Optional[bool] = None,
) -> nn.Module:
    """Make `model` data parallel over `meshes` at ZeRO `zero_stage` (0-3); returns the same module.

    meshes: `ParallelDims.build_meshes(...)`'s Meshes ("dp", "dp_shard", ("dp_replicate", "dp_shard")).
    param_dtype: bf16/fp16 turns on FSDP2 mixed precision (compute dtype; fp32 master shards);
        None or fp32 leaves compute in the parameters' dtype.
    reduce_dtype: dtype of gradient reduction when mixed precision is on.
    offload: keep sharded parameters, gradients and optimizer state on the CPU (zero 2/3 only).
    per_block: wrap each of `model.layers` separately before the root (the default, and the
        memory-saving choice); False wraps the root only (pipeline stages with zero-bubble schedules
        need that, see TORCH_NOTES.md).
    reshard_after_forward: zero 2/3 only; None follows the stage (True for zero 3, False for zero 2).
        Pipeline stages under a zero-bubble schedule need False (see `parallel/pipeline.py`); the
        schedule still reshards at the end of each step, so parameters rest sharded as with ZeRO-3.

    With a data-parallel degree of 1 and no offload the model is returned untouched (single-process
    precision levels then apply as usual). Gradient reduction is a SUM over data-parallel ranks.
    Build the optimizer afterwards (parameters become DTensors) and pass it through `shard_optimizer`.
    """
    if zero_stage not in ZERO_STAGES:
        raise ConfigError(f"parallel.zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    if offload and zero_stage < 2:
        raise ConfigError(
            f"CPU offload needs zero_stage 2 or 3 (FSDP), got zero_stage {zero_stage}: ZeRO 0 and 1 keep a full "
            "replica of the parameters and gradients on every device, so there is nothing sharded to offload; "
            "set parallel.zero_stage: 3 (or 2) to offload parameters, gradients and optimizer state to the CPU"
        )
    if param_dtype is not None and param_dtype not in (torch.float32, *_HALF):
        raise ConfigError(f"param_dtype must be fp32, bf16 or fp16, got {param_dtype}")
    if dims.dp == 1 and not offload:
        return model

    kwargs: dict[str, Any] = {}
    if param_dtype in _HALF:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if zero_stage >= 2:
        mesh = meshes["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else meshes["dp_shard"]
        device_type = mesh.device_type
        # Pinned host memory needs an accelerator; on a CPU-only run there is nothing to pin for.
        kwargs["offload_policy"] = (CPUOffloadPolicy(pin_memory=device_type != "cpu") if offload
                                    else OffloadPolicy())

        reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward

        def wrap(module: nn.Module) -> None:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    else:

        mesh = meshes["dp"]

        def wrap(module: nn.Module) -> None:
            replicate(module, mesh=mesh, **kwargs)

    layers = getattr(model, "layers", None)
    if per_block and layers is not None:
        for block in layers.values():
            wrap(block)
    wrap(model)
    for module in model.modules():
        if _is_fsdp(module):
            # SUM reduction (the trainer normalises by the global token count). The divide factor
            # alone would use PREMUL_SUM(1.0), which gloo rejects; forcing SUM collectives with a
            # factor of 1 reduces with plain SUM and no division at all.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    model._shardwise_zero_stage = zero_stage  # read by shard_optimizer, with the mesh of ZeRO-1's group
    model._shardwise_dp_mesh = meshes["dp"]
    return model


def _is_fsdp(module: nn.Module) -> bool:

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run forward and backward of one micro-batch with gradient sync on or off.

    Use `enabled=False` for all but the last micro-batch of a step: gradients then accumulate
    locally (FSDP2 keeps them unsharded, i.e. full size, until the synced backward) and the last
    backward reduces the accumulated sum once. Works for FSDP2/replicate modules, DDP (`no_sync`)
    and plain modules (a no-op). Sync is switched back on when the block ends.
    """
    if enabled:
        yield
        return
    if _is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    yield


# --- optimizer -------------------------------------------------------------------------------------

def shard_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, zero_stage: Optional[int] = None,
                    meshes: Any = None) -> torch.optim.Optimizer:
    """The optimizer to step for `zero_stage`: a ZeroOneOptimizer for zero 1, else `optimizer` itself.

    Build `optimizer` over the data-parallel model's parameters first (e.g. `build_optimizer(
    model.named_parameters(), ...)`, whose weight-decay groups are kept). Zero 2/3 need nothing more:
    the parameters are DTensor shards, so the optimizer's state is created sharded. Zero 0 keeps
    the full state. `zero_stage` defaults to the one `apply_data_parallel` recorded on the model;
    ZeRO-1 shards over `meshes["dp"]` (by default the data-parallel mesh recorded there too).
    """
    applied = getattr(model, "_shardwise_zero_stage", None)  # None: data-parallel degree 1, left as is
    if zero_stage is None:
        zero_stage = applied
    if zero_stage != 1 or applied is None:
        return optimizer
    mesh = meshes["dp"] if meshes is not None else model._shardwise_dp_mesh
    return ZeroOneOptimizer(optimizer, group=mesh.get_group())


def _ctor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW records some it does not take)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class ZeroOneOptimizer(torch.optim.Optimizer):
    """ZeRO-1: every rank keeps the optimizer state of the parameters it owns and steps only those.

    Parameters (whole tensors) are assigned to ranks greedily, largest first, to the rank with the
    fewest elements so far (ZeroRedundancyOptimizer's rule), so each rank holds about 1/N of the
    state. After the local step each owner broadcasts its updated parameters over `group`. Unlike
    torch's ZeroRedundancyOptimizer this works on DTensor parameters (replicate, or replicate x
    tensor parallel: the rank-local tensor is broadcast), keeps the wrapped optimizer's param
    groups, and its `state_dict()` / `load_state_dict()` use the ordinary full format of the wrapped
    optimizer (gathered from / scattered to the owners; collective), so DCP's `get_state_dict` /
    `set_state_dict` and resharding treat it like any other optimizer. `param_groups` lists every
    parameter (LR schedules and `zero_grad` act on them); `state` holds this rank's part only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
        if optimizer.state:
            raise ValueError("ZeroOneOptimizer must wrap a fresh optimizer (it already has state)")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.optimizer_class = type(optimizer)
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        params = [p for g in self.param_groups for p in g["params"]]
        sizes = [0] * self.world
        self.owner: dict[torch.Tensor, int] = {}
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):  # stable: same on every rank
            r = min(range(self.world), key=sizes.__getitem__)
            self.owner[p] = r
            sizes[r] += p.numel()
        self._order = params
        local_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [p for p in g["params"] if self.owner[p] == self.rank]}
                        for g in self.param_groups]
        self.local = self.optimizer_class(local_groups, **_ctor_kwargs(optimizer))
        self.state = self.local.state

    def _sync_groups(self) -> None:
        for g, lg in zip(self.param_groups, self.local.param_groups):
            for k, v in g.items():
                if k != "params":
                    lg[k] = v

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - see class docstring
        if closure is not None:
            raise ValueError("ZeroOneOptimizer.step does not take a closure")
        self._sync_groups()
        self.local.step()
        self._broadcast_params()
        return None

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Each owner sends its updated parameters (one flat buffer per owner and dtype)."""

        for r in range(self.world):
            src = dist.get_global_rank(self.group, r)
            owned = [local_tensor(p) for p in self._order if self.owner[p] == r]
            for dtype in sorted({t.dtype for t in owned}, key=str):
                tensors = [t for t in owned if t.dtype == dtype]
                if r == self.rank:
                    flat = _flatten_dense_tensors(tensors)
                else:
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
                broadcast_(flat, src, self.group)
                if r != self.rank:
                    for t, u in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                        t.copy_(u)

    def _gather_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Every parameter's optimizer state, on every rank (collective; transiently the full state)."""

        index = {p: i for i, p in enumerate(self._order)}
        meta = {index[p]: {k: (("tensor", isinstance(v, DTensor), tuple(local_tensor(v).shape), local_tensor(v).dtype)
                               if torch.is_tensor(v) else ("value", v)) for k, v in st.items()}
                for p, st in self.local.state.items()}
        metas: list[Any] = [None] * self.world
        dist.all_gather_object(metas, meta, group=self.group)
        full: dict[torch.Tensor, dict[str, Any]] = {}
        for r, rank_meta in enumerate(metas):
            src = dist.get_global_rank(self.group, r)
            for i in sorted(rank_meta):
                p = self._order[i]
                state: dict[str, Any] = {}
                for key in sorted(rank_meta[i]):
                    info = rank_meta[i][key]
                    if info[0] == "value":
                        state[key] = info[1]
                        continue
                    _, is_dt, shape, dtype = info
                    if r == self.rank:
                        value = self.local.state[p][key]
                        state[key] = value
                        buf = local_tensor(value).contiguous()
                    else:
                        buf = torch.empty(shape, dtype=dtype, device=local_tensor(p).device)
                    broadcast_(buf, src, self.group)
                    if r != self.rank:
                        state[key] = (DTensor.from_local(buf, p.device_mesh, p.placements, run_check=False,
                                                         shape=p.shape, stride=p.stride())
                                      if is_dt else buf)
                full[p] = state
        return full

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's full state dict (every parameter's state; collective over the group)."""
        self._sync_groups()
        local_state = self.state
        self.state = self._gather_state()
        try:
            return super().state_dict()
        finally:
            self.state = local_state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (as `state_dict()` gives); each rank keeps its own parameters' part."""
        super().load_state_dict(state_dict)
        full = self.state
        self.local.state.clear()
        for p, st in full.items():
            if self.owner.get(p) == self.rank:
                self.local.state[p] = st
        self.state = self.local.state
        self._sync_groups()


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state held by this rank (tensor states of at least one dimension)."""
    inner = optimizer.local if isinstance(optimizer, ZeroOneOptimizer) else optimizer
    return sum(local_tensor(v).numel() for st in inner.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


# --- gradient norm ---------------------------------------------------------------------------------

@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: Optional[float], norm_type: float = 2.0, *,
                   reduce_group: Any = None, foreach: Optional[bool] = None,
                   exclude: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The global gradient norm as a plain tensor; gradients are scaled to `max_norm` when it is set.

    Works for every stage: DTensor gradients (FSDP shards, replicate, tensor parallel) are reduced
    over their meshes by `full_tensor()`; gradients on different meshes or mixed with plain tensors
    (which foreach kernels reject together) are grouped and combined. `reduce_group`: a process group
    over which ranks hold *different* parameters whose norms must be combined too (pipeline stages).
    `exclude`: parameters left out of the norm but still clipped (a pipeline's second copy of a tied
    embedding matrix, whose gradient the first copy already counts). `max_norm` None or 0 only measures.
    """

    skip = {id(t) for t in exclude}
    groups: dict[Any, list[torch.Tensor]] = {}  # parameters by (mesh, placements) of their gradient
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():
        counted = [p.grad for p in group if id(p) not in skip]
        if not counted:
            continue
        n = torch.nn.utils.get_total_norm(counted, norm_type, foreach=foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:  # a rank with nothing to count still joins the reduction, on its gradients' device
        grads = [local_tensor(p.grad) for group in groups.values() for p in group]
        total = torch.zeros((), device=grads[0].device if grads else None)
    elif math.isinf(norm_type):
        total = torch.stack([n.float() for n in norms]).max()
    else:
        total = torch.stack([n.float() ** norm_type for n in norms]).sum()
    if reduce_group is not None:
        total = all_reduce(total, reduce_group, dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if max_norm:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(local_tensor(group[0].grad).device),
                                                 foreach=foreach)
    return total


def check_offload(cfg: Any, device: torch.device, dims: ParallelDims) -> None:
    """CPU offload is FSDP2's (the multi-device engine); on one CPU everything already lives in CPU memory."""
    asked = [name for name in ("offload_optimizer", "offload_params") if getattr(cfg.optimize, name)]
    if not asked or dims.dp > 1:
        return
    if device.type == "cpu":
        log.info("optimize.%s: the run is on the CPU, so everything already lives in CPU memory",
                 " and optimize.".join(asked))
        return
    raise ConfigError(
        f"optimize.{asked[0]} needs the sharded (FSDP2) engine, which runs under data parallelism: "
        "use several processes (--nproc N) with parallel.zero_stage 2 or 3; on one device lower memory "
        "with optimize.recompute, optimize.mixed_precision or a smaller train.micro_batch_size with more "
        "gradient accumulation"
    )
