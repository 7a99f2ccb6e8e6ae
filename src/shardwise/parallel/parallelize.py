"""Apply a run's parallelism and memory settings to a built model, in one fixed order.

tensor parallel -> recompute -> compile -> data parallel (ZeRO / FSDP2), as torchtitan does: each
step wraps what the previous one made, and FSDP2 must come last so that it shards the final module
tree. The model itself knows nothing of any of it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from ..memory.recompute import apply_recompute
from .dims import Meshes, ParallelDims

log = logging.getLogger(__name__)


def parallelize_model(
    model: nn.Module,
    cfg: Any,  # RunConfig
    dims: ParallelDims,
    meshes: Optional[Meshes],
    fsdp_param_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """Apply tensor parallel, recompute, compile and data parallel as the config says; returns the model.

    `fsdp_param_dtype`: the 16-bit dtype FSDP2 casts parameters to for compute (precision O2 under
    data parallelism; the sharded fp32 parameters are then the master weights).
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
                                    offload=offload)
    return model
