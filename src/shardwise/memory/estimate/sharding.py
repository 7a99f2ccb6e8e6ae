"""What data parallelism's wrappers hold unsharded on a rank, in the compute dtype: FSDP2 under ZeRO 2/3
(`Fsdp`: the gathered blocks and root, the all-gather buffers, the unsharded gradients before their
reduce-scatter), the reduction of the root's gradients at the end of the last backward
(`root_reduction`), and `replicate`'s unsharded copy under ZeRO 0/1 (`replicate_buffers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...parallel.float8 import converts
from .layout import Layout, Precision
from .parameters import Param, fsdp_shard, numel


@dataclass(frozen=True)
class Fsdp:
    """What FSDP2 (ZeRO 2/3) holds unsharded, in the compute dtype, on one rank."""

    keep_all: bool  # blocks stay gathered from their forward to their backward (ZeRO-2, zero-bubble PP)
    root: int  # embeddings / final norm / output projection, gathered from forward to the end of backward
    blocks: dict[int, int]  # per block: its gathered parameters
    padded: dict[int, int]  # per block: the flat all-gather buffer (dim 0 padded to the shard count)
    root_grad: int  # unsharded gradients of the root's trainable parameters (reduced at the very end)
    block_grad: dict[int, int]  # per block: its unsharded gradients before their reduce-scatter
    # Gradients accumulated unsharded (reduced once per step) in the dtype autograd makes them: a later
    # micro-batch's gradients are added into them in place, one tensor at a time, not held as a block.
    in_place: bool = False

    def forward(self) -> int:
        """Gathered at the end of forward (the loss)."""
        return self.root + (sum(self.blocks.values()) if self.keep_all else 0)

    def backward_at(self, layer: int, order: list[int], grad_share: float, accumulated: bool = False) -> int:
        """Gathered while `layer` runs its backward (`grad_share` of its gradients computed so far;
        `accumulated`: earlier micro-batches' unsharded gradients exist, counted by the caller)."""
        if accumulated and self.in_place:
            grad_share, root_grad = 0.0, 0
        else:
            root_grad = self.root_grad
        if self.keep_all:
            gathered = sum(self.blocks[j] for j in order[order.index(layer):])
        else:  # this block, and the next one's all-gather buffer (backward prefetch)
            nxt = order[order.index(layer) + 1] if order.index(layer) + 1 < len(order) else None
            gathered = self.blocks[layer] + (self.padded[nxt] if nxt is not None else 0)
        return self.root + root_grad + gathered + int(self.block_grad[layer] * grad_share)

    def head_backward(self, order: list[int], loss_in_root: bool) -> int:
        """Gathered above `forward()` while the head's backward runs: with the loss inside the root's
        forward (the chunked loss), the root's pre-backward has already prefetched the last block's
        all-gather buffer (ZeRO-3; ZeRO-2 kept every block gathered). The plain path's cross-entropy
        backward runs before the gradient reaches the root."""
        return self.padded[order[0]] if order and loss_in_root and not self.keep_all else 0

    def head_forward(self, layers: list[int], loss_in_root: bool) -> int:
        """Above `forward()` while a loss inside the root's forward runs: the last block's all-gather
        buffer, which FSDP2 frees only at the root's post-forward."""
        return self.padded[layers[-1]] if layers and loss_in_root else 0


def fsdp_buffers(lay: Layout, prec: Precision, held: list[Param], local: dict[str, tuple[int, ...]],
          layers: dict[int, int], float8: bool = False,
          shard_of: Optional[dict[str, tuple[int, int]]] = None) -> Optional[Fsdp]:
    """FSDP2's gathering buffers; `shard_of`: (ranks, dimension) of the parameters sharded otherwise than over
    the data-parallel ranks along dimension 0 (expert parallelism's experts, over their replicas along 1)."""
    if lay.zero < 2:
        return None
    c, n = prec.compute, lay.dp_shard
    shard_of = shard_of or {}

    def gathered(p: Param) -> int:  # optimize.float8: the converted linears' weights are gathered in 1 byte
        return 1 if float8 and p.layer is not None and converts(local[p.name], p.trainable) else c

    def padded_size(p: Param) -> int:  # the whole tensor as gathered: each rank's padded shard, n of them
        ranks, dim = shard_of.get(p.name, (n, 0))
        return fsdp_shard(local[p.name], ranks, dim) * ranks

    blocks = {i: sum(numel(local[p.name]) * gathered(p) for p in held if p.layer == i) for i in layers}
    padded = {i: sum(padded_size(p) * gathered(p) for p in held if p.layer == i) for i in layers}
    grads = {i: sum(numel(local[p.name]) for p in held if p.layer == i and p.trainable) * c for i in layers}
    root = sum(numel(local[p.name]) for p in held if p.layer is None) * c
    # The embedding's gradient comes last, after every block's backward.
    root_grad = sum(numel(local[p.name]) for p in held
                    if p.layer is None and p.trainable and p.where != "embedding") * c
    keep_all = lay.zero == 2 or (lay.schedule == "zero_bubble" and lay.pp > 1)
    in_place = not lay.reduce_every and lay.pp == 1 and c == prec.grad
    return Fsdp(keep_all, root, blocks, padded, root_grad, grads, in_place)


def root_reduction(lay: Layout, prec: Precision, trainable: list[Param], stored: dict[str, int],
                    local: dict[str, tuple[int, ...]]) -> int:
    """Above the static bytes at the end of the last backward, when FSDP2 (or `replicate`) reduces the
    root's gradients (embeddings, final norm, output projection), after every block's: the blocks'
    reduced gradients, and the root's own copied into one flat buffer in the reduce dtype (then
    freed) and reduced into an output buffer (1/dp_shard of it; `replicate`'s world-1 "reduce-
    scatter" copies the input divided by the divide factor, one more temporary of the whole group).
    Reduced every micro-batch, the root's earlier gradients exist already and the output is added to
    them. The block activations are gone by then; the root's gathered parameters are resharded."""
    root = [p for p in trainable if p.layer is None]
    if not root:
        return 0
    n = lay.dp_shard if lay.zero >= 2 else 1
    g = prec.grad
    unsharded = sum(numel(local[p.name]) for p in root) * g
    flat = sum(fsdp_shard(local[p.name], n) * n for p in root) * g  # padded to whole shards
    out = flat // n
    div = flat if n == 1 else 0
    blocks = sum(stored[p.name] for p in trainable if p.layer is not None) * g  # reduced (sharded) by now
    earlier = sum(stored[p.name] for p in root) * g if (lay.reduce_every and lay.zero >= 2
                                                         and lay.accumulation > 1) else 0
    return blocks + earlier + max(unsharded + flat, flat + out + div)


def replicate_buffers(lay: Layout, prec: Precision, held: list[Param], local: dict[str, tuple[int, ...]]) -> int:
    """ZeRO 0/1 (FSDP2's `replicate`): an unsharded copy of every parameter it manages, in the compute
    dtype, from the first forward to the end of backward. Frozen parameters already stored in 16 bits
    it does not manage (they compute as they are)."""
    if lay.zero >= 2 or lay.dp == 1:
        return 0
    return sum(numel(local[p.name]) for p in held if p.trainable or (prec.frozen == 4 and not p.quant)) \
        * prec.compute
