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
  DDP), optimizer state for 1/N of every tensor (each split along a dimension into N parts, so the
  largest tensor is spread like the others); each rank steps its parts and the updated parts are
  all-gathered in flat buckets. Memory P + P + optimizer(P)/N (+ one bucket during the all-gather).
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
device by definition, so offload is refused there with a ConfigError (use zero 3). On one device
(`fsdp_on_one_process`) the same engine runs on a one-process group with size-1 meshes, ZeRO-3
semantics (`one_process_fsdp_settings`): each block's "shards" are its whole parameters in host
memory, copied to the device for its forward and again for its backward.

Frozen parameters (requires_grad=False) get no gradient, take no part in the reduction, and (since
`build_optimizer` leaves them out) have no optimizer state. With a 16-bit `param_dtype` they are
stored in it (no fp32 copy of a weight that never trains: LoRA bases, frozen layers): zero 2/3 shard
them like the others (FSDP2 all-gathers them, uncast, with the trainable parameters it casts to the
same dtype), zero 0/1 leave 16-bit frozen parameters out of `replicate` (plain tensors, the same on
every rank), whose unsharded compute copy would otherwise double them. LoRA at DP N then holds per
device what one device holds, plus the adapters' fp32 parameters and gradients.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ..errors import ConfigError
from .collectives import all_gather, all_reduce
from .dims import ParallelDims
from .dtensors import local_tensor
from .expert import expert_parameters, shard_over_replicas

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
    offload_blocks: Optional[int] = None,
    per_block: bool = True,
    reshard_after_forward: Optional[bool] = None,
    reduce_every_micro_batch: bool = False,
) -> nn.Module:
    """Make `model` data parallel over `meshes` at ZeRO `zero_stage` (0-3); returns the same module.

    meshes: `ParallelDims.build_meshes(...)`'s Meshes ("dp", "dp_shard", ("dp_replicate", "dp_shard")).
    param_dtype: bf16/fp16 turns on FSDP2 mixed precision (compute dtype; fp32 master shards of the
        trainable parameters; frozen ones are stored in param_dtype, `store_frozen_in`);
        None or fp32 leaves compute in the parameters' dtype.
    reduce_dtype: dtype of gradient reduction when mixed precision is on.
    offload: keep sharded parameters, gradients and optimizer state on the CPU (zero 2/3 only).
    offload_blocks: with offload, only the blocks numbered below it (optimize.offload_params_blocks); the
        other blocks and the root's own parameters (embeddings, final norm, head) stay on the device.
    per_block: wrap each of `model.layers` separately before the root (the default, and the
        memory-saving choice); False wraps the root only (pipeline stages with zero-bubble schedules
        need that, see TORCH_NOTES.md).
    reshard_after_forward: zero 2/3 only; None follows the stage (True for zero 3, False for zero 2).
        Pipeline stages under a zero-bubble schedule need False (see `parallel/pipeline.py`); the
        schedule still reshards at the end of each step, so parameters rest sharded as with ZeRO-3.
    reduce_every_micro_batch: zero 2/3 only (`grad_sync` reads it): under gradient accumulation,
        reduce-scatter every micro-batch's gradients into the sharded fp32 gradients (HSDP: defer only
        the all-reduce across replicas) instead of accumulating full-size unsharded gradients until the
        last micro-batch. `ParallelConfig.reduces_every_micro_batch()` resolves the run's setting.

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
    if reduce_every_micro_batch and zero_stage < 2:
        raise ConfigError(
            f"reducing gradients every micro-batch needs zero_stage 2 or 3, got {zero_stage}: ZeRO 0 and 1 keep "
            "full gradients on every rank (set parallel.reduce_gradients: auto)")
    if param_dtype is not None and param_dtype not in (torch.float32, *_HALF):
        raise ConfigError(f"param_dtype must be fp32, bf16 or fp16, got {param_dtype}")
    if dims.dp_cp == 1 and not offload:
        return model

    kwargs: dict[str, Any] = {}
    if param_dtype in _HALF:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        store_frozen_in(model, param_dtype)  # the policy then leaves them as they are
    if zero_stage >= 2:  # expert parallelism below data parallelism: experts sharded over their replicas
        reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward
        # Along dim 1 (an expert's width), not the experts: a rank may hold fewer experts than there are replicas.
        shard_over_replicas(model, lambda module, mesh: fully_shard(
            module, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=lambda _: Shard(1), **kwargs))
    experts = expert_parameters(model) - _fsdp_managed(model)  # each rank holds its experts whole, outside FSDP2
    apart = (frozen_16_bit(model) | experts) or None
    if zero_stage >= 2:
        # Context parallel ranks hold other tokens of the same samples: their gradients are summed too.
        mesh = meshes.hsdp_mesh() if dims.dp_replicate > 1 else meshes.gradient_mesh("dp_shard")
        device_type = mesh.device_type

        def wrap(module: nn.Module, on_host: bool) -> None:
            # Pinned host memory needs an accelerator; on a CPU-only run there is nothing to pin for.
            policy = CPUOffloadPolicy(pin_memory=device_type != "cpu") if on_host else OffloadPolicy()
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy,
                        ignored_params=experts or None, **kwargs)
    else:

        mesh = meshes.gradient_mesh("dp")

        def wrap(module: nn.Module, on_host: bool) -> None:
            # 16-bit frozen weights stay plain replicated tensors: nothing to reduce, and replicate's
            # unsharded compute copy would double them.
            replicate(module, mesh=mesh, ignored_params=apart, **kwargs)

    layers = getattr(model, "layers", None)
    if per_block and layers is not None:
        for name, block in layers.items():
            wrap(block, offload and (offload_blocks is None or int(name) < offload_blocks))
    wrap(model, offload and offload_blocks is None)
    for module in model.modules():
        if _is_fsdp(module):
            # SUM reduction (the trainer normalises by the global token count). The divide factor
            # alone would use PREMUL_SUM(1.0), which gloo rejects; forcing SUM collectives with a
            # factor of 1 reduces with plain SUM and no division at all.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    model._shardwise_zero_stage = zero_stage  # read by shard_optimizer, with the mesh of ZeRO-1's group
    model._shardwise_reduce_every_micro_batch = reduce_every_micro_batch  # read by grad_sync
    model._shardwise_hsdp = zero_stage >= 2 and dims.dp_replicate > 1
    model._shardwise_dp_mesh = meshes.gradient_mesh("dp")  # ZeRO-1's group: with context parallelism dp x cp
    return model


def _fsdp_managed(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of the FSDP2 units already inside `model` (experts sharded over their replicas)."""
    return {p for m in model.modules() if _is_fsdp(m) for p in m.parameters()}


def _is_fsdp(module: nn.Module) -> bool:

    return isinstance(module, FSDPModule)


@torch.no_grad()
def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Store `model`'s frozen (requires_grad False) floating-point parameters in `dtype`, in place:
    the Parameter objects stay, so tied weights stay tied. Cast once here, a frozen weight holds the
    same 16-bit values that FSDP2's mixed-precision policy would otherwise cast it to every forward."""
    for p in model.parameters():  # each parameter once, a tied one too
        if p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
            continue
        if isinstance(p, DTensor):  # `.data =` would change a DTensor's dtype but not its local tensor's
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=False))
        else:
            p.data = p.data.to(dtype)


def frozen_16_bit(model: nn.Module) -> set[nn.Parameter]:
    """The frozen parameters stored in 16 bits, which ZeRO 0/1 leave out of `replicate` (see
    `apply_data_parallel`)."""
    return {p for p in model.parameters() if not p.requires_grad and p.dtype in _HALF}


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run forward and backward of one micro-batch with gradient sync on or off.

    Use `enabled=False` for all but the last micro-batch of a step. What is deferred to the last
    follows `apply_data_parallel(reduce_every_micro_batch=...)`:
    - False (ZeRO 0/1, or `parallel.reduce_gradients: once_per_step`): the whole reduction; gradients
      accumulate locally (FSDP2 keeps them unsharded, full size in the reduce dtype, until the synced
      backward) and the last backward reduces the accumulated sum once.
    - True (ZeRO 2/3 by default): nothing under plain FSDP, which reduce-scatters each micro-batch's
      gradients and adds them to the sharded fp32 gradients (no full-size buffer); under HSDP only the
      all-reduce across replicas (`set_requires_all_reduce(False)`): each micro-batch is
      reduce-scattered within its shard group and the partial shards are all-reduced once, at the last.
    Works for FSDP2/replicate modules, DDP (`no_sync`) and plain modules (a no-op). Sync is switched
    back on when the block ends.
    """
    if enabled:
        yield
        return
    if _is_fsdp(model) and getattr(model, "_shardwise_reduce_every_micro_batch", False):
        if not getattr(model, "_shardwise_hsdp", False):
            yield
            return
        model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)
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
    mesh = meshes.gradient_mesh("dp") if meshes is not None else model._shardwise_dp_mesh
    return ZeroOneOptimizer(optimizer, group=mesh.get_group())


def _ctor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW records some it does not take)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


# ZeRO-1's all-gather of updated parameters runs in buckets of at most this many elements (gathered, over
# all ranks; a larger tensor is split): the transient is one bucket plus this rank's share of it.
BUCKET_ELEMENTS = 2**25


def zero1_split(shape: tuple[int, ...], taken: Iterable[int], world: int) -> tuple[Optional[int], int]:
    """(the dimension ZeRO-1 splits, the indices each rank owns along it, torch.chunk style) for a
    parameter of local `shape` whose dimensions `taken` are sharded already (tensor parallel); (None,
    0) where none is left (a 0-d tensor, a 1-d tensor-parallel bias): every rank then steps it whole."""
    taken = set(taken)
    for dim, size in enumerate(shape):
        if dim not in taken:
            return dim, -(-size // world)
    return None, 0


def zero1_buckets(shards: list[tuple[int, int]], world: int, bucket_elements: int = BUCKET_ELEMENTS
                  ) -> list[list[tuple[int, int, int]]]:
    """The all-gather buckets of ZeRO-1 over `shards`, each (indices a rank owns, elements per index):
    per bucket its units (shard number, first index, end index) within every rank's part; a bucket
    holds at most `bucket_elements` over all ranks (at least one index), so every bucket but the last
    is full to within one index."""
    room_per_rank = max(1, bucket_elements // world)
    buckets: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = room_per_rank
    for i, (chunk, row) in enumerate(shards):
        start = 0
        while start < chunk:
            take = min(chunk - start, max(room, 0) // row) if row else chunk - start
            if take == 0:
                if current:
                    buckets.append(current)
                    current, room = [], room_per_rank
                    continue
                take = 1  # one index larger than a bucket: alone
            current.append((i, start, start + take))
            room -= take * row
            start += take
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Shard:
    """What ZeRO-1 steps of one parameter on this rank: `view`, this rank's part of the parameter's
    local tensor (`dim` split into `chunk`-long parts, torch.chunk style; `dim` None: the whole tensor),
    and the placements its optimizer state has on the parameter's mesh."""

    param: torch.Tensor
    dim: Optional[int]
    chunk: int
    rank: int
    world: int
    view: torch.Tensor
    placements: tuple[Any, ...]

    def extent(self, rank: int) -> tuple[int, int]:
        """(first index, length) of `rank`'s part along `dim`."""
        size = local_tensor(self.param).shape[self.dim]
        start = min(rank * self.chunk, size)
        return start, max(0, min(self.chunk, size - start))

    def part(self, t: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """`rank`'s (default: this rank's) part of `t`, a local tensor shaped like the parameter's."""
        if self.dim is None:
            return t
        start, length = self.extent(self.rank if rank is None else rank)
        return t.narrow(self.dim, start, length)

    @property
    def row(self) -> int:
        """Elements per index of `dim`."""
        local = local_tensor(self.param)
        return local.numel() // local.shape[self.dim] if local.shape[self.dim] else 0


class ZeroOneOptimizer(torch.optim.Optimizer):
    """ZeRO-1 with evenly sharded state: every rank owns 1/N of every parameter and steps only that.

    Each parameter's local tensor (a replica under `replicate`; a tensor-parallel shard under DP x TP)
    is split along its first dimension that tensor parallelism does not shard already, torch.chunk
    style, into N parts (N = the data-parallel degree); rank r keeps optimizer state for part r only
    and steps it in place (the wrapped optimizer's own kind and settings, over views of the
    parameters, so the arithmetic is the one-process optimizer's, element for element). The updated
    parts are then all-gathered in flat buckets (`zero1_buckets`: at most BUCKET_ELEMENTS gathered
    elements each, a larger tensor split), so every replica holds the same parameters again. About
    1/N of every tensor's state on each rank: the largest tensor (a large vocabulary's embedding)
    is spread like the others, unlike whole-tensor assignment (ZeroRedundancyOptimizer's).

    Gradients stay as `replicate` leaves them: all-reduced, full on every rank (the trainer clips and
    checks them whole); the step reads this rank's part of each. A parameter with no dimension left
    to split (0-d, or a 1-d tensor-parallel bias) is stepped whole on every rank.

    `state` holds, per parameter, its optimizer state as DTensors sharded like that (`Shard(dim)` on
    the data-parallel mesh dimension, with the parameter's tensor-parallel placements), views of what
    the wrapped optimizer keeps: the ordinary per-parameter format, so `state_dict()` / DCP's
    `get_state_dict` / the checkpointer save each rank's part, and loading (in place, or through
    `load_state_dict` from any placement or a full tensor) fills it, in any layout. `param_groups`
    lists every parameter (LR schedules and `zero_grad` act on them); `local` is the wrapped kind of
    optimizer over this rank's parts.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any = None,
                 bucket_elements: int = BUCKET_ELEMENTS) -> None:
        if optimizer.state:
            raise ValueError("ZeroOneOptimizer must wrap a fresh optimizer (it already has state)")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.optimizer_class = type(optimizer)
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self._shards = {p: self._plan(p) for g in self.param_groups for p in g["params"]}
        local_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [self._shards[p].view for p in g["params"]]} for g in self.param_groups]
        self.local = self.optimizer_class(local_groups, **_ctor_kwargs(optimizer))
        self._exposed: dict[torch.Tensor, tuple[Any, dict[str, Any]]] = {}  # `state`'s DTensor views, cached
        split = [sh for sh in self._shards.values() if sh.dim is not None]
        self._buckets: list[list[tuple[_Shard, int, int]]] = []
        for key in sorted({(local_tensor(sh.param).dtype, local_tensor(sh.param).device) for sh in split}, key=str):
            same = [sh for sh in split if (local_tensor(sh.param).dtype, local_tensor(sh.param).device) == key]
            for bucket in zero1_buckets([(sh.chunk, sh.row) for sh in same], self.world, bucket_elements):
                self._buckets.append([(same[i], start, end) for i, start, end in bucket])

    def _plan(self, p: torch.Tensor) -> _Shard:
        """How `p` is split: along its first dimension no other mesh dimension shards."""
        if not isinstance(p, DTensor):
            raise ValueError("ZeroOneOptimizer steps the DTensor parameters of a data-parallel model "
                             "(apply_data_parallel first)")
        mesh, placements = p.device_mesh, list(p.placements)
        names = mesh.mesh_dim_names or ()
        dp_dim = names.index("dp") if "dp" in names else 0
        if isinstance(placements[dp_dim], Shard):
            # Split over its own group already (expert parallelism's experts: each rank holds its own, the
            # same as its replicas'): this rank steps its part whole, and there is nothing to gather.
            local = local_tensor(p)
            shard = _Shard(p, None, 0, mesh.get_local_rank(dp_dim), self.world, local.detach(), tuple(placements))
            shard.view = shard.part(local.detach())
            return shard
        if mesh.size(dp_dim) != self.world or not placements[dp_dim].is_replicate():
            raise ValueError(f"ZeroOneOptimizer: a parameter on mesh {mesh} with placements {p.placements} is "
                             f"not replicated over the data-parallel group of {self.world} ranks")
        rank = mesh.get_local_rank(dp_dim)
        if rank != self.rank:
            raise ValueError(f"ZeroOneOptimizer: rank {self.rank} of the group is {rank} on the parameters' mesh")
        local = local_tensor(p)
        taken = [pl.dim for pl in placements if isinstance(pl, Shard)]
        dim, chunk = zero1_split(tuple(local.shape), taken, self.world)
        if dim is not None:
            placements[dp_dim] = Shard(dim)
        shard = _Shard(p, dim, chunk, rank, self.world, local.detach(), tuple(placements))
        shard.view = shard.part(local.detach())
        return shard

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
        for sh in self._shards.values():
            # The parts as they are now (FSDP2 may have re-made a parameter's local tensor since).
            sh.view.data = sh.part(local_tensor(sh.param).detach())
            sh.view.grad = None if sh.param.grad is None else sh.part(local_tensor(sh.param.grad))
        try:
            self.local.step()
        finally:
            for sh in self._shards.values():
                sh.view.grad = None
        self._all_gather_params()
        self._expose_state()
        return None

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """Every rank's updated parts to every rank, one flat buffer per bucket."""
        for bucket in self._buckets:
            first = local_tensor(bucket[0][0].param)
            sizes = [(end - start) * sh.row for sh, start, end in bucket]
            send = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
            for (sh, start, end), segment in zip(bucket, send.split(sizes)):
                self._slot(sh, start, end, segment, self.rank).copy_(self._slice(sh, start, end, self.rank))
            for r, received in enumerate(all_gather(send, self.group)):
                if r == self.rank:
                    continue
                for (sh, start, end), segment in zip(bucket, received.split(sizes)):
                    self._slice(sh, start, end, r).copy_(self._slot(sh, start, end, segment, r))

    @staticmethod
    def _slice(sh: _Shard, start: int, end: int, rank: int) -> torch.Tensor:
        """Indices [start, end) of `rank`'s part of the parameter (as far as the part reaches)."""
        part = sh.part(local_tensor(sh.param).detach(), rank)
        begin = min(start, part.shape[sh.dim])
        return part.narrow(sh.dim, begin, max(0, min(end, part.shape[sh.dim]) - begin))

    @staticmethod
    def _slot(sh: _Shard, start: int, end: int, segment: torch.Tensor, rank: int) -> torch.Tensor:
        """Where `_slice(sh, start, end, rank)` travels in a bucket's flat buffer (`segment`: its place)."""
        shape = list(local_tensor(sh.param).shape)
        shape[sh.dim] = end - start
        length = ZeroOneOptimizer._slice(sh, start, end, rank).shape[sh.dim]
        return segment.view(shape).narrow(sh.dim, 0, length)

    def _global(self, sh: _Shard, value: Any) -> Any:
        """A state tensor of this rank's part as the DTensor of the whole parameter's state."""
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape != sh.view.shape:
            return value
        p = sh.param
        return DTensor.from_local(value, p.device_mesh, sh.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def _expose_state(self) -> None:
        """`state`: every parameter's state, as DTensor views of the parts the wrapped optimizer keeps."""
        state: dict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for p, sh in self._shards.items():
            inner = self.local.state.get(sh.view)
            if not inner:
                continue
            key = tuple((k, id(v)) for k, v in inner.items())  # the same tensors: the same views
            cached = self._exposed.get(p)
            if cached is None or cached[0] != key:
                cached = self._exposed[p] = (key, {k: self._global(sh, v) for k, v in inner.items()})
            state[p] = dict(cached[1])
        self.state = state

    def _part_of(self, sh: _Shard, value: Any) -> Any:
        """This rank's part of a loaded state value (a DTensor of any placement, or a full tensor)."""
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        p = sh.param
        if isinstance(value, DTensor):
            if value.device_mesh == p.device_mesh:
                return value.redistribute(p.device_mesh, sh.placements).to_local()
            value = value.full_tensor()
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"optimizer state of shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}")
        return distribute_tensor(value.to(local_tensor(p).device), p.device_mesh, sh.placements,
                                 src_data_rank=None).to_local()

    def state_dict(self) -> dict[str, Any]:
        """The per-parameter state dict of the wrapped kind of optimizer, each tensor this rank's DTensor part."""
        self._sync_groups()
        self._expose_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a per-parameter state dict (DTensors of any placement or full tensors); each rank keeps its part."""
        super().load_state_dict(state_dict)
        loaded = self.state
        for p, sh in self._shards.items():
            saved = loaded.get(p)
            if not saved:
                continue
            inner = self.local.state[sh.view]
            for key, value in saved.items():
                part = self._part_of(sh, value)
                old = inner.get(key)
                same = torch.is_tensor(old) and torch.is_tensor(part) and (old.shape, old.dtype) == (part.shape,
                                                                                               part.dtype)
                if same:
                    old.copy_(part)
                else:
                    inner[key] = part.clone() if torch.is_tensor(part) else part
        self._sync_groups()
        self._expose_state()


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
    """The global gradient norm as a plain fp32 tensor; gradients are scaled to `max_norm` when it is set.

    Works for every stage: DTensor gradients (FSDP shards, replicate, tensor parallel) are summed over
    the mesh dimensions that shard them; gradients on different meshes or mixed with plain tensors are
    grouped and combined. The powers (squares) of the elements and every sum of them, collectives
    included, are float64, so that layouts that split the same gradients differently (whole tensors,
    shards, stages) agree to float64's rounding, not fp32's; the norm is rounded to fp32 once, at the
    end. `reduce_group`: a process group over which ranks hold *different* parameters whose norms must
    be combined too (pipeline stages). `exclude`: parameters left out of the norm but still clipped (a
    pipeline's second copy of a tied embedding matrix, whose gradient the first copy already counts).
    `max_norm` None or 0 only measures.
    """

    skip = {id(t) for t in exclude}
    # parameters by (mesh, placements) of their gradient and where its local part lives (FSDP2's CPU offload
    # of some blocks only, optimize.offload_params_blocks, leaves gradients of one mesh on two devices)
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (id(g.device_mesh), tuple(g.placements), local_tensor(g).device) if isinstance(g, DTensor) \
            else ("plain", g.device)
        groups.setdefault(key, []).append(p)
    inf = math.isinf(norm_type)
    sums = []
    for group in groups.values():
        counted = [p.grad for p in group if id(p) not in skip]
        if counted:
            sums.append(_group_power_sum(counted, norm_type))
    if not sums:  # a rank with nothing to count still joins the reduction, on its gradients' device
        grads = [local_tensor(p.grad) for group in groups.values() for p in group]
        total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    else:
        sums = [t.to(sums[0].device) for t in sums]
        total = torch.stack(sums).max() if inf else torch.stack(sums).sum()
    if reduce_group is not None:
        total = all_reduce(total, reduce_group, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    if not inf:
        total = total ** (1.0 / norm_type)
    total = total.float()
    if max_norm:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(local_tensor(group[0].grad).device),
                                                 foreach=foreach)
    return total


NORM_PIECE = 1 << 22  # elements of a gradient widened to float64 at a time for its norm (32 MiB)


def _local_power_sum(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """sum |g|^p over the elements of plain tensors `grads` (max |g| for the inf-norm), a float64
    scalar. An fp32 or 16-bit element's square is exact in float64, and so is each sum to float64's
    rounding, whatever the order. Each gradient is widened NORM_PIECE elements at a time, so that no
    float64 copy of a whole large gradient exists."""
    parts = []
    for g in grads:
        for piece in g.reshape(-1).split(NORM_PIECE):
            if piece.numel() == 0:
                continue
            if math.isinf(norm_type):
                parts.append(piece.abs().max().double())
                continue
            wide = piece.double()
            parts.append(torch.dot(wide, wide) if norm_type == 2 else wide.abs_().pow_(norm_type).sum())
            del wide
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=grads[0].device)
    return torch.stack(parts).max() if math.isinf(norm_type) else torch.stack(parts).sum()


def _group_power_sum(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """`_local_power_sum` of gradients that share one mesh and placements (or are plain), summed (for
    the inf-norm: the maximum) in float64 over the mesh dimensions that shard them (Shard, and FSDP's
    _StridedShard under tensor parallelism); a replicated dimension holds the same values on every
    rank and counts once. A partial gradient (an unreduced sum) is reduced first, as any norm of it
    would need."""
    first = grads[0]
    if not isinstance(first, DTensor):
        return _local_power_sum(grads, norm_type)
    if any(p.is_partial() for p in first.placements):
        grads = [g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
                 for g in grads]
        first = grads[0]
    local = _local_power_sum([g.to_local() for g in grads], norm_type)
    combine = Partial("max" if math.isinf(norm_type) else "sum")
    placements = [Replicate() if p.is_replicate() else combine for p in first.placements]  # Shard, _StridedShard
    return DTensor.from_local(local, first.device_mesh, placements, run_check=False).full_tensor()


#: The ZeRO stage of optimize.offload_params on one process: each block's parameters are copied to the
#: device for its forward and again for its backward, so only the blocks in flight are on the device.
ONE_PROCESS_ZERO_STAGE = 3


def fsdp_on_one_process(cfg: Any, device: torch.device, dims: ParallelDims, on_cpu: bool = False) -> bool:
    """Whether optimize.offload_params runs FSDP2's CPU offload on a one-process group (one process, no
    parallelism): on an accelerator always; on the CPU, where everything already lives in host memory,
    only when asked (`on_cpu`: the tests' way to run the very path an accelerator runs)."""
    return bool(cfg.optimize.offload_params) and dims.world_size == 1 and (device.type != "cpu" or on_cpu)


def one_process_fsdp_settings(cfg: Any) -> tuple[int, bool]:
    """(ZeRO stage, reduce every micro-batch) of FSDP2 on one process: ZeRO-3 whatever parallel.zero_stage
    says (nothing to replicate to), and each micro-batch's gradients moved to the host shards unless
    parallel.reduce_gradients is once_per_step (then they accumulate full-size on the device)."""
    return ONE_PROCESS_ZERO_STAGE, cfg.parallel.reduce_gradients != "once_per_step"


def check_offload(cfg: Any, device: torch.device, dims: ParallelDims) -> None:
    """What the layout allows of the offload levers (before anything is built).

    optimize.offload_params is FSDP2's CPU offload (sharded parameters, gradients and the optimizer on the
    host), which runs under data parallelism with ZeRO 2/3, and on one device on a one-process group
    (`fsdp_on_one_process`); on one CPU everything already lives in CPU memory. optimize.offload_optimizer
    on its own is the ZeRO-Offload optimizer (`memory.offload.HostMasters`): one device, or ZeRO 2/3,
    without tensor or pipeline parallelism. optimize.offload_activations: anything but a pipeline (whose
    schedule runs forwards and backwards of several micro-batches interleaved)."""
    o = cfg.optimize
    if getattr(o, "offload_activations", False) and dims.pp > 1:
        raise ConfigError("optimize.offload_activations does not run under pipeline parallelism (the schedule "
                          "interleaves the micro-batches' forwards and backwards); use optimize.recompute there")
    if getattr(o, "offload_params_blocks", None) is not None and dims.pp > 1:
        raise ConfigError("optimize.offload_params_blocks counts the model's blocks from the first, which a "
                          "pipeline splits over its stages; leave it null (offload everything) under pipeline "
                          "parallelism")
    problem = _offload_optimizer_problem(cfg, dims)
    if problem:
        raise ConfigError(f"optimize.offload_optimizer cannot run here: {problem}")
    if not o.offload_params or dims.dp_cp > 1:
        return
    if device.type == "cpu" and not dims.one_process_fsdp:
        log.info("optimize.offload_params: the run is on the CPU, so everything already lives in CPU memory")
        return
    # On one device FSDP2's host step combines with train.optimizer_in_backward (FSDP2 copies a gradient
    # that a hook reads synchronously) and with the 8-bit AdamW (stepped on the host shards), as under data
    # parallelism; QLoRA's quantised base is refused in `peft.qlora.quantized_layout_problem`.
    if dims.tp > 1 or dims.pp > 1:
        raise ConfigError(
            "optimize.offload_params is FSDP2's CPU offload, which shards over data parallelism, and this layout "
            f"has data_parallel 1 (tensor_parallel {dims.tp}, pipeline_parallel {dims.pp}): set "
            "parallel.data_parallel >= 2 with zero_stage 2 or 3, or use optimize.offload_optimizer on one device")


def _offload_optimizer_problem(cfg: Any, dims: ParallelDims) -> Optional[str]:
    """Why optimize.offload_optimizer (cpu or stream) cannot run in this layout (None: it can, or it is off).
    With offload_params on as well, FSDP2's CPU offload already steps the optimizer on the host."""
    o, t = cfg.optimize, cfg.train
    if not o.offload_optimizer or o.offload_params:
        return None
    stream = o.offload_optimizer == "stream"
    if dims.tp > 1 or dims.pp > 1:
        how = ("the streamed update reads each gradient as a local tensor, which tensor parallelism's partial "
               "gradients and a pipeline's stages are not tested with" if stream else
               "each gradient goes to its host master from a post-accumulate-grad hook, which tensor "
               "parallelism's partial gradients and a pipeline's hand-written weight gradients bypass")
        return (f"{how}; use data parallelism with parallel.zero_stage 2 or 3, or optimize.offload_params "
                "(FSDP2's CPU offload)")
    if dims.dp_cp > 1 and cfg.parallel.zero_stage < 2:
        return (f"parallel.zero_stage {cfg.parallel.zero_stage} keeps full gradients and the whole optimizer on "
                "every rank, so each rank would hold every master and all the state in host memory (one copy per "
                "device of the machine); use parallel.zero_stage 2 or 3, whose ranks offload their own shards")
    if t.optimizer_in_backward and not stream:
        return ("the update runs on the host after the backward; set train.optimizer_in_backward: false, or "
                "optimize.offload_optimizer: stream (the update on the device, as each gradient is ready)")
    if t.optimizer == "adamw_8bit" and not stream:
        return ("torchao's 8-bit AdamW is not stepped on the host; use optimize.offload_optimizer: stream (its 8-bit "
                "state in host memory, the update on the device), or train.optimizer adamw")
    if stream and t.optimizer not in ("adamw", "adam", "adamw_8bit"):
        return (f"the streamed update is Adam's (fused, or torchao's 8-bit); train.optimizer {t.optimizer} is not "
                "streamed: use adamw or adamw_8bit")
    return None
