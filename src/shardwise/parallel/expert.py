"""Expert parallelism: each MoE block's experts spread over the ranks of an expert-parallel group.

`apply_expert_parallel(model, mesh)` keeps on each rank of `mesh` (one dimension, N ranks) its
num_experts / N consecutive experts of every MoE block: the stacked expert weights become DTensors
sharded along the experts (`Shard(0)`), so checkpoints hold the whole tensors and reshard to any other
expert-parallel degree. It installs a `TokenExchange` on each block's experts (`GroupedExperts.
token_exchange`), which the model calls with its routed copies sorted by expert:

1. dispatch: the number of copies for each expert goes to the expert's rank (a small all-to-all), then
   the copies themselves (an all-to-all with those counts as split sizes: their sum is read on the
   host, the one sync of an exchange); a rank receives its experts' copies grouped by the rank they
   came from, and reorders them by expert;
2. its experts' MLPs run on them (grouped matrix multiplies, as without expert parallelism);
3. combine: the results go back in the opposite all-to-all, each to the rank and place it came from.

Both all-to-alls are differentiable (their backward is the opposite exchange), so the gradients of the
copies come back the same way. The router and everything outside the experts stay as they are on every
rank; each rank routes its own tokens. The model knows nothing of this: the exchange is a hook set
from outside, as context parallelism's `sequence_exchange` is.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ..errors import ConfigError
from ..models.moe import GroupedExperts


def expert_mesh(dp_mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, Optional[DeviceMesh]]:
    """(the expert-parallel mesh, the mesh of each rank's expert replicas or None) for `ep` ranks per group
    over the data-parallel ranks: the whole data-parallel mesh when `ep` is its size; else groups of `ep`
    consecutive ranks, the ranks at the same place in every group holding the same experts (the two are
    dimensions of one mesh, so that FSDP2 can shard the experts over their replicas, `shard_over_replicas`)."""
    dp = dp_mesh.size()
    if ep == dp:
        return dp_mesh, None
    ranks = torch.tensor(dp_mesh.mesh.flatten().tolist()).view(dp // ep, ep)
    mesh = DeviceMesh(dp_mesh.device_type, ranks, mesh_dim_names=("expert_replicate", "expert"))
    return mesh["expert"], mesh["expert_replicate"]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, replicas: Any = None) -> nn.Module:
    """Spread the experts of every MoE block of `model` over `mesh` (see the module docstring); the model,
    changed in place. Its expert weights must be whole (as built or loaded) and the same on every rank.
    `replicas`: the mesh of the ranks that hold the same experts (`expert_mesh`), over which
    `reduce_expert_gradients` sums their gradients (or FSDP2 shards them, `shard_over_replicas`); None when
    each expert lives on one rank."""
    size = mesh.size()
    exchange = TokenExchange(mesh.get_group(), size)
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        if module.num_experts % size:
            raise ConfigError(f"parallel.expert_parallel {size} must divide model.num_experts {module.num_experts} "
                              f"({name}): each rank holds the same number of experts")
        # Every parameter here is stacked by expert along its first dimension: the weights, and LoRA's
        # adapters on them (`peft.lora.LoRAExperts`).
        for name, full in list(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            shard = distribute_tensor(full.detach(), mesh, [Shard(0)])
            setattr(module.get_submodule(owner), leaf, nn.Parameter(shard, requires_grad=full.requires_grad))
        module.token_exchange = exchange
        module.expert_replicas = replicas
    return model


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module) -> None:
    """Sum each expert's gradient over the ranks that hold a replica of it (expert parallelism below the
    data-parallel degree; nothing to do when every expert lives on one rank). Call once per step, after the
    last micro-batch's backward and before clipping."""
    for m in model.modules():
        if not isinstance(m, GroupedExperts) or m.expert_replicas is None:
            continue
        group = m.expert_replicas.get_group()
        grads = [p.grad.to_local() for p in m.parameters() if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))


def shard_over_replicas(model: nn.Module, wrap: Callable[[nn.Module, DeviceMesh], None]) -> None:
    """ZeRO 2/3 with expert parallelism below the data-parallel degree: each MoE block's experts sharded by
    FSDP2 (`wrap(module, mesh)`) over the ranks holding the same experts, so that each rank keeps
    1 / data_parallel of every block's experts, and FSDP2's reduce-scatter sums the replicas' gradients
    (`reduce_expert_gradients` then has nothing to do for them)."""
    for m in model.modules():
        if isinstance(m, GroupedExperts) and m.expert_replicas is not None:
            wrap(m, m.expert_replicas)
            m.expert_replicas = None


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The stacked expert weights `apply_expert_parallel` spread (data parallelism leaves them out: each
    rank already holds its own experts whole, and their gradients are complete, the all-to-all's backward
    having brought every rank's contribution)."""
    return {p for m in model.modules() if isinstance(m, GroupedExperts) and m.token_exchange is not None
            for p in m.parameters()}


class TokenExchange:
    """Dispatch and combine over an expert-parallel group of `size` ranks (`GroupedExperts.token_exchange`)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, held: list[torch.Tensor], counts: torch.Tensor,
                 run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed copies [copies, hidden] sorted by expert (`held`: a list holding them, emptied once
        they are sent, so that they do not outlive their send), `counts` [num_experts] of them each, through
        their experts wherever those live; the results in the order of the copies. Each buffer is dropped
        as soon as the next one exists: at most a send and a receive buffer beside the experts' own tensors."""
        n = self.size
        sent = counts.view(n, -1)  # [rank, its experts]: copies this rank sends to each expert
        received = funcol.wait_tensor(funcol.all_to_all_single(sent.contiguous(), None, None, group=self.group))
        send_splits = sent.sum(dim=1)
        recv_splits = received.sum(dim=1)
        splits = torch.cat([send_splits, recv_splits]).tolist()  # the split sizes, on the host at once
        out_sizes, in_sizes = splits[n:], splits[:n]
        got = funcol.wait_tensor(funcol.all_to_all_single_autograd(held.pop(), out_sizes, in_sizes,
                                                                   group=self.group))
        order = _by_expert(received, sum(out_sizes))
        rows = got[order]
        del got
        done = run_local(rows, received.sum(dim=0))
        del rows
        # In the order the copies arrived: indexing by the inverse permutation keeps only that index for
        # backward (index_copy would keep the results themselves).
        back = done[order.argsort()]
        del done
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(back, in_sizes, out_sizes, group=self.group))


def _by_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """The permutation of the copies a rank received, grouped by source rank then expert ([ranks, experts]
    counts), into expert order (each expert's copies by source rank)."""
    flat = received.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(received)  # where each (rank, expert) block starts as received
    sizes, block_starts = received.t().reshape(-1), starts.t().reshape(-1)  # the blocks in expert order
    block = torch.repeat_interleave(torch.arange(sizes.numel(), device=received.device), sizes, output_size=total)
    position = torch.arange(total, device=received.device) - (sizes.cumsum(0) - sizes)[block]
    return block_starts[block] + position
