"""Apply a run's parallelism and memory settings to a built model, in one fixed order, and make the
parallel decisions that follow from the layout.

pipeline split -> float8 -> tensor parallel -> context parallel -> recompute -> compile -> data parallel
(ZeRO / FSDP2, over the context-parallel ranks too), as
torchtitan does: the split makes this rank's model parts (pipeline chunks; the whole model when
there is no pipeline), and each later step wraps what the previous one made, part by part; FSDP2
must come last so that it shards the final module tree. The model itself knows nothing of any of it.
The trainer asks here for the dtypes to build in (`weight_dtypes`), the parts (`parallelize_parts`,
then `allocate` for a model built on meta), the optimizer to step (`distribute_optimizer`) and the
pipeline schedule (`build_pipeline`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..models.moe import reset_moe_buffers
from .context import apply_context_parallel
from .data_parallel import apply_data_parallel, one_process_fsdp_settings, shard_optimizer
from .dims import Meshes, ParallelDims
from .expert import apply_expert_parallel, expert_mesh
from .float8 import apply_float8
from .pipeline import Pipeline, build_schedule, split_model
from .recompute import apply_recompute
from .tensor import apply_tensor_parallel

log = logging.getLogger(__name__)


def parallelize_parts(
    model: nn.Module,
    cfg: Any,  # RunConfig
    dims: ParallelDims,
    meshes: Optional[Meshes],
    fsdp_param_dtype: Optional[torch.dtype] = None,
) -> list[nn.Module]:
    """This rank's model parts, each parallelised: `[model]` without a pipeline, else its chunks.

    Under pipeline parallelism `model` (built whole, with the same seed on every rank) is split by
    `split_model` into the stages this pipeline rank owns (`virtual_stages` of them); `model` must
    not be used afterwards. Every chunk then gets tensor parallel, recompute, compile and data
    parallel as `parallelize_model` applies them. Parameter names stay the whole model's.
    """
    if dims.pp == 1:
        return [parallelize_model(model, cfg, dims, meshes, fsdp_param_dtype)]
    p = cfg.parallel
    chunks = split_model(model, meshes["pp"].get_local_rank(), dims.pp, p.virtual_stages, p.stage_layers,
                         p.schedule)
    # Zero-bubble schedules give wrong gradients when FSDP2 reshards after forward (pipeline.py).
    reshard = False if p.schedule == "zero_bubble" else None
    return [parallelize_model(chunk, cfg, dims, meshes, fsdp_param_dtype, reshard_after_forward=reshard)
            for chunk in chunks]


def parallelize_model(
    model: nn.Module,
    cfg: Any,  # RunConfig
    dims: ParallelDims,
    meshes: Optional[Meshes],
    fsdp_param_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: Optional[bool] = None,
) -> nn.Module:
    """Apply tensor parallel, recompute, compile and data parallel as the config says; returns the model
    (or one pipeline chunk of it).

    `fsdp_param_dtype`: the 16-bit dtype FSDP2 casts parameters to for compute (precision O2 under
    data parallelism; the sharded fp32 parameters are then the master weights).
    `reshard_after_forward`: overrides ZeRO-3's resharding after forward (None: as the stage says).
    """
    apply_float8(model, cfg, dims)  # first: recompute, compile and FSDP2 wrap the float8 linears
    if cfg.parallel.expert_parallel > 1:  # the experts over the data-parallel ranks, before TP and FSDP2 wrap the rest
        apply_expert_parallel(model, *expert_mesh(meshes["dp"], cfg.parallel.expert_parallel))
    if dims.tp > 1:
        apply_tensor_parallel(model, meshes["tp"], sequence_parallel=cfg.parallel.sequence_parallel)
    if dims.cp > 1:  # before recompute and compile wrap the blocks, before FSDP2 hooks the root
        apply_context_parallel(model, meshes["cp"])
    apply_recompute(model, cfg.optimize.layer_recompute([int(name) for name in model.layers]))
    if cfg.run.compile is True:  # the trainer resolves auto for its device first (RunConfig.compiles)
        compile_blocks(model)
    offload = cfg.optimize.offload_params  # FSDP2's CPU offload; offload_optimizer alone is memory.offload's
    stage, every = cfg.parallel.zero_stage, cfg.parallel.reduces_every_micro_batch()
    if dims.one_process_fsdp:  # offload_params on one device: FSDP2 on a one-process group
        stage, every = one_process_fsdp_settings(cfg)
    if dims.dp_cp > 1 or (offload and meshes is not None):
        model = apply_data_parallel(model, meshes, dims, stage, param_dtype=fsdp_param_dtype,
                                    offload=offload, offload_blocks=cfg.optimize.offload_params_blocks,
                                    reshard_after_forward=reshard_after_forward,
                                    reduce_every_micro_batch=every)
    return model


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each transformer block in place (one graph per block, reused by every block of the
    same shapes) and the chunked loss's per-chunk work. A graph whose compilation fails runs eagerly:
    torch logs the failure as a warning (dynamo's suppress_errors, set for the process) and the run
    goes on at eager speed."""
    torch._dynamo.config.suppress_errors = True
    for block in model.layers.values():
        block.compile()
    model.compile_loss_head = True


def weight_dtypes(param_dtype: torch.dtype, master_weights: bool, dims: ParallelDims, host_masters: bool = False
                  ) -> tuple[torch.dtype, Optional[torch.dtype]]:
    """(the dtype to build the model in, the dtype FSDP2 casts it to for compute or None).

    Under data parallelism a precision level with fp32 master weights (O2) keeps them as FSDP2's
    sharded fp32 parameters, cast to 16 bits for compute by its mixed-precision policy (frozen
    parameters, which need no master, `apply_data_parallel` stores in the 16-bit dtype); in one
    process (or tensor- or pipeline-parallel only) the model itself is 16-bit and the fp32 masters
    are separate copies (`memory.precision.MasterWeights`) of the trainable weights only. `host_masters`
    (optimize.offload_optimizer): the masters live in host memory (`memory.offload.HostMasters`), so under
    data parallelism FSDP2 keeps 16-bit shards and only reduces in fp32."""
    if host_masters:
        return param_dtype, (param_dtype if dims.dp_cp > 1 and param_dtype != torch.float32 else None)
    if master_weights and fsdp_holds_masters(dims):  # on one device too, with offload_params
        return torch.float32, param_dtype
    return param_dtype, None


def fsdp_holds_masters(dims: ParallelDims) -> bool:
    """Whether FSDP2's fp32 parameters are the master weights of a level that has them (see `weight_dtypes`):
    under data parallelism, and for optimize.offload_params on one device (its host shards)."""
    return dims.uses_fsdp


def allocate(part: nn.Module, device: torch.device, on_host: Callable[[Optional[int]], bool] = lambda _: False
             ) -> None:
    """Give a meta-device model part (whole or a pipeline chunk, sharded or not) memory on `device`
    for the shards this rank holds; the values are undefined until loaded. A tied output projection is
    tied again (allocation gives each module a fresh parameter) and the RoPE tables are rebuilt.
    `on_host(block)` (FSDP2's CPU offload, `OptimizeConfig.params_on_host`): whether the parameters of
    transformer block `block` (None: the rest of the part) are in host memory, where FSDP2 wants them;
    buffers are always on `device`."""
    blocks = {id(m): int(name) for name, block in getattr(part, "layers", {}).items() for m in block.modules()}
    for module in part.modules():
        module.to_empty(device="cpu" if on_host(blocks.get(id(module))) else device, recurse=False)
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != device:
                module._buffers[name] = buf.to(device)
    part.tie_weights()
    part.reset_rope_tables()
    reset_moe_buffers(part)  # the weights are loaded next; the buffers a checkpoint or HF directory holds too


def distribute_optimizer(optimizer: torch.optim.Optimizer, parts: list[nn.Module]) -> torch.optim.Optimizer:
    """The optimizer to step: ZeRO-1's state-sharding wrapper where the layout asks for it, else
    `optimizer` itself (ZeRO 2/3 shard the state through the sharded parameters)."""
    return shard_optimizer(optimizer, parts[0])


def build_pipeline(parts: list[nn.Module], cfg: Any, dims: ParallelDims, meshes: Optional[Meshes],
                   device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   grad_holder: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   on_weight_grads: Optional[Callable[[], None]] = None) -> Optional[Pipeline]:
    """The pipeline schedule over this rank's chunks (None without pipeline parallelism); `loss_fn` is
    the trainer's token-loss sum. `grad_holder` / `on_weight_grads`: where gradients accumulate and
    what moves them there (the fp32 masters at precision O2, see `pipeline.build_schedule`)."""
    if dims.pp == 1:
        return None
    p = cfg.parallel
    extra = {} if grad_holder is None else {"grad_holder": grad_holder, "on_weight_grads": on_weight_grads}
    return build_schedule(parts, meshes["pp"], device, p.micro_batch_num, p.schedule, loss_fn=loss_fn, **extra)
