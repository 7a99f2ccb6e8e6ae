"""The training loss: the sum of next-token cross-entropy over the positions that carry a label.

Labels equal to `IGNORE_INDEX` (prompts of instruction data, padding) carry no loss. The sum, not
the mean: the trainer divides by the step's global number of target tokens, so that every layout and
every split into micro-batches computes one device's gradient. Under tensor parallelism the logits are
a DTensor sharded on the vocabulary and the loss is computed shard by shard, never gathering the full
`[tokens, vocab]` logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

IGNORE_INDEX = -100  # torch's cross-entropy default: a label that carries no loss


def count_target_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    """Label positions that carry a loss, over the micro-batches of a step."""
    return int(sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches))


def _vocab_shard_dim(logits: DTensor) -> Optional[int]:
    """The mesh dimension that shards the last (vocabulary) dimension, or None."""
    last = logits.ndim - 1
    for i, p in enumerate(logits.placements):
        if isinstance(p, Shard) and p.dim in (-1, last):
            return i
    return None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the positions whose label is not IGNORE_INDEX, in fp32.

    `logits` [B, T, V] may be a plain tensor, a replicated DTensor, or a DTensor sharded on the
    vocabulary over a 1-D TP mesh (loss parallel): then each rank computes on its V/tp columns and
    only [B*T] statistics cross ranks. The result is the same value on every TP rank, differentiable,
    and needs no context manager: call `backward()` wherever the trainer does.
    """
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    vdim = _vocab_shard_dim(logits)
    if vdim is None:
        return token_loss_sum(logits.full_tensor(), labels)
    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError("token_loss_sum supports logits on a 1-D TP mesh only")
    vocab = logits.shape[-1]
    local = logits.to_local().flatten(0, -2).float()  # [N, V_local]
    # This rank's vocabulary range: DTensor shards like torch.chunk (the last ranks may hold fewer).
    chunk = -(-vocab // mesh.size())
    start = min(chunk * mesh.get_local_rank(), vocab)
    n_local = local.shape[-1]

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        # Partial -> Replicate is differentiable: its backward hands every rank the same gradient.
        return DTensor.from_local(t, mesh, [Partial(op)], run_check=False).full_tensor()

    target = labels.flatten().to(local.device)
    valid = target != IGNORE_INDEX
    with torch.no_grad():
        gmax = all_reduce(local.max(dim=-1).values if n_local else
                          torch.full(local.shape[:1], float("-inf"), device=local.device), "max")
    sum_exp = all_reduce(torch.exp(local - gmax.unsqueeze(-1)).sum(dim=-1), "sum")
    mine = valid & (target >= start) & (target < start + n_local)
    idx = torch.where(mine, target - start, 0).clamp(0, max(n_local - 1, 0)).unsqueeze(-1)
    picked = local.gather(-1, idx).squeeze(-1) if n_local else torch.zeros_like(sum_exp)
    target_logit = all_reduce(torch.where(mine, picked, 0.0), "sum")
    per_token = torch.log(sum_exp) + gmax - target_logit
    return torch.where(valid, per_token, 0.0).sum()
