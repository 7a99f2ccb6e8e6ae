"""Tensors that may be DTensors (sharded by FSDP2 or tensor parallelism): this rank's local shard of
one, or its full value. Plain tensors pass through unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (a view that writes through), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_value(t: Any) -> Any:
    """A DTensor's full value as a plain tensor (a collective: every rank of its mesh must call it);
    anything else unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t
