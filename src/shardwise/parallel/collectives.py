"""The few collectives the trainer itself needs: sums and maxima of small numbers, rank 0 first, and
the replica check. Everything else (gradient reduction, all-gathers) happens inside FSDP2 / DTensor.

Small numbers travel as CPU float64 tensors: gloo serves them on every device kind (CUDA runs use a
"cuda:nccl,cpu:gloo" group), and reading them back costs no device sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ShardwiseError

T = TypeVar("T")


def _group(mesh: Any) -> Optional[dist.ProcessGroup]:
    return None if mesh is None else mesh.get_group()


def sum_over(values: Sequence[float], mesh: Any = None) -> list[float]:
    """Element-wise sums of `values` over the ranks of `mesh` (all ranks when None)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, group=_group(mesh))
    return t.tolist()


def max_over(value: float, mesh: Any = None) -> float:
    """The largest `value` over the ranks of `mesh` (all ranks when None)."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group(mesh))
    return float(t.item())


def rank0_first(fn: Callable[[], T], rank: int) -> Optional[T]:
    """Run `fn` on rank 0 while the others wait; if it fails there, fail on every rank with its message.

    For work that must happen once (clearing a run directory, preparing data into a shared cache)
    before the other ranks go on; without it a failure on rank 0 would leave the others waiting for
    the whole distributed timeout.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except BaseException as e:  # every rank must learn of it, then rank 0 re-raises its own
            error = e
    message = [f"{type(error).__name__}: {error}" if error is not None else None]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise ShardwiseError(f"rank 0 failed, so this rank stops too: {message[0]}")
    return result


def parameter_checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and float64 (sum, sum of squares) of every parameter's local data on this rank."""
    names, sums = [], []
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            x = local.detach().double()
            names.append(name)
            sums.append(torch.stack([x.sum(), (x * x).sum()]).cpu())
    return names, torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)


def replica_mismatch(model: nn.Module, mesh: Any) -> Optional[str]:
    """None when every rank of `mesh` (ranks that hold copies of the same parameters) agrees bit for
    bit; else a message naming the first parameter that differs and the ranks' checksums."""
    if mesh is None or mesh.size() == 1:
        return None
    names, local = parameter_checksums(model)
    gathered = [torch.empty_like(local) for _ in range(mesh.size())]
    dist.all_gather(gathered, local, group=mesh.get_group())
    for i, name in enumerate(names):
        values = [g[i].tolist() for g in gathered]
        if any(v != values[0] for v in values[1:]):
            detail = "; ".join(f"rank {r}: sum {v[0]:.9g}, sum of squares {v[1]:.9g}" for r, v in enumerate(values))
            return f"parameter {name} differs between data-parallel replicas ({detail})"
    return None
