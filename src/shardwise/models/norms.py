"""The norms of the families: RMSNorm as LLaMA computes it (fp32 statistics, scaled in the input's dtype),
Gemma's RMSNorm (1 + weight, all in fp32), and LayerNorm (GPT-2)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from shardwise.models.config import ModelConfig
from shardwise.models.lean_ops import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 as in Hugging Face LLaMA so logits match (saving only
    its input and the rsqrt for backward: `lean_ops.rms_norm`). With `unit_offset` (Gemma) the weight is
    an offset from one and the product is taken in fp32 before the cast back, as Gemma's code does."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        if self.unit_offset:
            xf = x.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """A scale of one (a zero offset with `unit_offset`)."""
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)


def build_norm(cfg: ModelConfig, dim: Optional[int] = None) -> nn.Module:
    """The norm layer the config asks for, over `dim` features (default hidden_size)."""
    dim = dim or cfg.hidden_size
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_unit_offset)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.norm_bias)
