"""Weight initialisation shared by the dense blocks (`models.transformer`, `models.latent_attention`) and the
experts (`models.moe`)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn


@torch.no_grad()
def init_normal(weight: torch.Tensor, std: float) -> None:
    """Fill `weight` from N(0, std) drawn in fp32 from the global RNG, then rounded to its dtype, so that
    one seed gives the same weights whether they are stored in 16 bits (the one-device O2 path) or in fp32
    (FSDP2's masters). torch 2.13 draws a bf16 tensor that way itself; 2.11 draws other numbers for it."""
    if weight.dtype == torch.float32:
        nn.init.normal_(weight, mean=0.0, std=std)
    else:
        weight.copy_(torch.empty_like(weight, dtype=torch.float32).normal_(mean=0.0, std=std))


@torch.no_grad()
def init_linears(linears: Iterable[tuple[Optional[nn.Linear], float]]) -> None:
    """Each (linear, std): normal weight (`init_normal`), zero bias; a None linear (absent in this config) is
    skipped."""
    for lin, std in linears:
        if lin is None:
            continue
        init_normal(lin.weight, std)
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)
