"""Activation recomputation applied to a model's blocks from outside (full, every k-th, selective)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Selective recompute keeps the outputs of the expensive ops and recomputes the cheap ones
# (norms, activations, element-wise): most of the memory saving at a fraction of the extra FLOPs.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def canonical_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes, so checkpoints do not depend on recompute."""
    return name.replace("_checkpoint_wrapped_module.", "")


def apply_recompute(model: nn.Module, mode: str, every: int = 1) -> list[str]:
    """Wrap blocks of `model.layers` for recomputation; return the names of the wrapped layers.

    mode "full" recomputes whole blocks (every `every`-th one, starting with the first);
    "selective" recomputes each block but keeps its matmul and attention outputs.
    """
    if mode == "none":
        return []
    wrapped = []
    for i, name in enumerate(list(model.layers.keys())):
        if mode == "full" and i % every:
            continue
        block = model.layers[name]
        if isinstance(block, CheckpointWrapper):  # a model trained before keeps its wrappers
            continue
        if mode == "selective":
            ctx = partial(create_selective_checkpoint_contexts, _keep_matmuls)
            model.layers[name] = checkpoint_wrapper(block, context_fn=ctx, preserve_rng_state=True)
        else:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)
        wrapped.append(name)
    return wrapped
