"""Layer freezing for fine-tuning (seed 003, 4.3): keep the embeddings and/or the bottom N blocks fixed.

Frozen parameters keep `requires_grad=False`, so autograd computes no gradient for them, the
optimizer (built from the trainable parameters only) holds no state for them, and data-parallel
wrappers reduce nothing for them. Freezing happens on the whole model, before it is split or sharded.
"""

from __future__ import annotations

from torch import nn


def freeze_parameters(model: nn.Module, embeddings: bool = False, layers: int = 0) -> list[str]:
    """Freeze the token/position embeddings (a tied output projection with them) and the bottom
    `layers` blocks of a shardwise Transformer; returns the frozen parameter names."""
    if layers > len(model.layers):
        raise ValueError(f"cannot freeze {layers} layers of a {len(model.layers)}-layer model")
    prefixes = [f"layers.{key}." for key in list(model.layers.keys())[:layers]]
    if embeddings:
        prefixes += ["tok_embeddings.", "pos_embeddings."]
    frozen = []
    for name, param in model.named_parameters():
        if any(name.startswith(p) for p in prefixes):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
