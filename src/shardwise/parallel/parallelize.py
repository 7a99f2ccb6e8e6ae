"""Apply a run's parallelism and memory settings to a built model, in one fixed order.

pipeline split -> tensor parallel -> recompute -> compile -> data parallel (ZeRO / FSDP2), as
torchtitan does: the split makes this rank's model parts (pipeline chunks; the whole model when
there is no pipeline), and each later step wraps what the previous one made, part by part; FSDP2
must come last so that it shards the final module tree. The model itself knows nothing of any of it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from ..memory.recompute import apply_recompute
from .dims import Meshes, ParallelDims

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
    from .pipeline import split_model

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
    if dims.tp > 1:
        from .tensor import apply_tensor_parallel

        apply_tensor_parallel(model, meshes["tp"], sequence_parallel=cfg.parallel.sequence_parallel)
    apply_recompute(model, cfg.optimize.recompute, cfg.optimize.recompute_every)
    if cfg.run.compile:
        for block in model.layers.values():
            block.compile()
    offload = cfg.optimize.offload_params or cfg.optimize.offload_optimizer
    if dims.dp > 1 or (offload and meshes is not None):
        from .data_parallel import apply_data_parallel

        model = apply_data_parallel(model, meshes, dims, cfg.parallel.zero_stage, param_dtype=fsdp_param_dtype,
                                    offload=offload, reshard_after_forward=reshard_after_forward)
    return model
