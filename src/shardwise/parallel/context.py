"""Context parallelism: each sequence split over `parallel.context_parallel` ranks (DeepSpeed-Ulysses).

The N context-parallel ("cp") ranks of a data-parallel replica read the same batch; each keeps its
contiguous 1/N of every sequence: tokens, labels and position ids (`ContextParallel.shard_inputs`,
a forward pre-hook on the model). Labels are the data's, already shifted (label t is token t + 1 of
the unsplit sample), so a chunk's last label is the next chunk's first token: cutting after the
shift keeps every boundary right. Embeddings, norms, MLPs and the loss act on each token alone, so
they run on the chunk. Attention needs the whole sequence: before it one all-to-all trades the
sequence split for a head split (`SequenceExchange.to_heads`: each rank then holds the whole
sequence of H/N query heads and their key/value heads), attention runs as on one device, with the
causal mask or the full document mask / attention mask of the batch, and RoPE already applied at
each token's true position (the chunk's own position ids); a second all-to-all trades back
(`to_sequence`). Every attention backend works unchanged (SDPA, flex attention's block masks): it
sees ordinary full-length sequences. Causal attention needs no load balancing this way: every rank
attends over the same whole sequence, for its share of the heads.

The loss: each rank's token-loss sum over its chunk. The model's forward returns that sum with the
value summed over the cp group (`ContextParallel.total_loss`, a forward hook) but the gradient of
the local sum alone, so the trainer's loss, divided by the step's target tokens counted over the
data-parallel ranks exactly as without CP, is the replica's loss on every cp rank, and each rank's
backward gives its chunk's share of the gradient. The gradient reduction then sums over data
parallel x context parallel (ZeRO / FSDP2 on the "dp_shard_cp" and "dp_cp" meshes, torchtitan's
layout, `Meshes.gradient_mesh`): one device's gradient.

Cost, per layer and micro-batch: forward four all-to-alls (q, k, v, the output), backward four
more, each moving (N-1)/N of a [B, T/N, heads x head_dim] tensor per rank (key/value heads as many
as there are, or repeated up to the query heads when fewer than N per rank). Activations per rank
are 1/N of one device's for everything but the attention kernel's own workspace over the whole
sequence of H/N heads (and a full [B, 1, T, T] document mask on the explicit-mask path).

A mixture-of-experts block routes each rank's tokens as they come; its balance losses are per whole
sequence, so the per-sequence sums behind them are summed over the cp ranks (`ContextParallel.
sequence_sum`), and its expert load is counted over data parallel x context parallel.

Refused (`check_context_parallel`, before any process starts): pipeline parallelism, the full-logits
loss (optimize.chunked_loss: false: the logits would be one chunk's), a sequence (or the dynamic
instruction batches' width multiple) not divisible by N, a chunk that sequence parallelism cannot split
over the tensor-parallel ranks, query heads per tensor-parallel rank not divisible by N, ZeRO-1 with
the optimizer in backward or the 8-bit AdamW, a quantised LoRA base, and dropout (model.dropout or
lora.dropout above 0): the cp ranks share one random stream, so their chunks would get the same masks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
from torch import nn

from ..errors import ConfigError
from ..models.moe import MoE
from .collectives import all_reduce


def check_context_parallel(cfg: Any) -> None:
    """Refuse, naming the setting and the fix, what context parallelism does not run with."""
    p = cfg.parallel
    n = p.context_parallel
    if n == 1:
        return
    if p.pipeline_parallel > 1:
        raise ConfigError(
            f"parallel.context_parallel {n} with pipeline_parallel {p.pipeline_parallel}: the pipeline's stages "
            "pass whole-sequence activations, which context parallelism splits; use context_parallel with data "
            "and tensor parallelism (set pipeline_parallel: 1), or context_parallel: 1")
    if not cfg.optimize.chunked_loss:
        raise ConfigError(
            f"parallel.context_parallel {n} needs optimize.chunked_loss: true: each rank computes the loss of its "
            "own chunk of the sequence inside the model's forward, and full logits would cover one chunk only")
    seq = cfg.data.seq_length or cfg.model.max_position_embeddings
    if seq % n:
        raise ConfigError(
            f"parallel.context_parallel {n} splits each sequence into {n} equal chunks, but data.seq_length is "
            f"{seq}; set data.seq_length to a multiple of {n} (e.g. {seq - seq % n or n})")
    if cfg.data.kind == "instruction" and cfg.data.packing == "dynamic" and cfg.data.pad_to_multiple_of % n:
        raise ConfigError(
            f"parallel.context_parallel {n}: dynamic instruction batches are {cfg.data.pad_to_multiple_of}-token "
            f"multiples wide (data.pad_to_multiple_of), which {n} ranks cannot split evenly; set "
            f"data.pad_to_multiple_of to a multiple of {n}")
    tp = p.tensor_parallel
    heads = cfg.model.num_heads
    if heads % (tp * n):
        raise ConfigError(
            f"parallel.context_parallel {n}: each rank attends over the whole sequence for 1/{n} of the "
            f"{heads // tp if heads % tp == 0 else heads} attention heads it holds (model.num_heads {heads} / "
            f"tensor_parallel {tp}), which must then divide by {n}; choose context_parallel (x tensor_parallel) "
            f"dividing model.num_heads {heads}")
    if p.sequence_parallel and tp > 1 and (seq // n) % tp:
        raise ConfigError(
            f"parallel.context_parallel {n} with sequence parallelism over tensor_parallel {tp}: each rank's chunk of "
            f"{seq // n} tokens is split again over the {tp} tensor-parallel ranks; set data.seq_length to a multiple "
            f"of {n * tp}, or parallel.sequence_parallel: false")
    t = cfg.train
    if p.zero_stage == 1 and (t.optimizer_in_backward or t.optimizer == "adamw_8bit"):
        what = "train.optimizer_in_backward" if t.optimizer_in_backward else "train.optimizer adamw_8bit"
        raise ConfigError(
            f"parallel.context_parallel {n} with zero_stage 1 and {what}: ZeRO-1 shards the optimizer over the "
            "data x context-parallel ranks, which that does not run with; use zero_stage 0, 2 or 3")
    lora = getattr(cfg, "lora", None)
    if lora is not None and getattr(lora, "quantize_base", "none") not in (None, "none"):
        raise ConfigError(
            f"parallel.context_parallel {n} with lora.quantize_base {lora.quantize_base}: the quantised base's layout "
            "checks are written for data parallelism; use context_parallel: 1, or a 16-bit base "
            "(lora.quantize_base: none)")
    dropouts = [f"{key} {value:g}" for key, value in (("model.dropout", cfg.model.dropout),
                                                      ("lora.dropout", getattr(lora, "dropout", 0.0))) if value]
    if dropouts:
        raise ConfigError(
            f"parallel.context_parallel {n} with {' and '.join(dropouts)}: the context-parallel ranks draw dropout "
            "masks from the same random stream, so the chunks of a sequence (and the ranks' shares of the attention "
            "heads) would get the same masks; set " + " and ".join(d.split()[0] + ": 0" for d in dropouts)
            + ", or context_parallel: 1")


def _all_to_all(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """`x` cut into `size` parts along `scatter_dim`, part j sent to rank j of `group`; the parts received
    joined along `gather_dim` in rank order. Differentiable (its backward is the opposite exchange) and
    traceable by torch.compile (functional collectives)."""
    parts = torch.stack(x.chunk(size, dim=scatter_dim))  # [size, ...]: one contiguous block per rank
    out = funcol.wait_tensor(funcol.all_to_all_single_autograd(parts, None, None, group=group))
    return torch.cat(out.unbind(0), dim=gather_dim)


class SequenceExchange:
    """The two all-to-alls around attention (installed on each `Attention` as `sequence_exchange`): q, k, v
    [B, heads, T/N, D] -> [B, heads/N, T, D] before the kernel, its output back after."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole sequence of this rank's share of the heads. Query head h uses key/value head
        h // (H / H_kv), so a contiguous 1/N of each keeps them paired; with fewer key/value heads than
        ranks they are repeated up to the query heads first."""
        if k.shape[1] % self.size:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return tuple(_all_to_all(t, self.group, self.size, 1, 2) for t in (q, k, v))  # type: ignore[return-value]

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, heads/N, T, D] back to this rank's chunk of the sequence, all heads."""
        return _all_to_all(out, self.group, self.size, 2, 1)


class ContextParallel:
    """The model-level hooks: inputs cut to this rank's chunk before forward, the loss summed after."""

    def __init__(self, mesh: Any) -> None:
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/N of `t` along the sequence (dimension 1)."""
        width = t.shape[1] // self.size
        return t[:, self.rank * width:(self.rank + 1) * width]

    def shard_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook: tokens, labels and position ids (0..T-1 when the batch has none) cut to this
        rank's chunk; document ids and attention masks stay whole (attention sees the whole sequence)."""
        if len(args) > 1:
            raise TypeError("under context parallelism pass the model's inputs other than the tokens by name")
        kwargs = dict(kwargs)
        tokens = args[0] if args else kwargs.pop("tokens")
        if kwargs.get("kv_cache") is not None:
            raise ValueError("a KV cache (generation) does not run under context parallelism; generate with "
                             "the model in one process")
        seq = tokens.shape[1]
        if seq % self.size:
            raise ValueError(
                f"parallel.context_parallel {self.size}: a batch {seq} tokens wide does not split into {self.size} "
                f"equal chunks; make data.seq_length (and data.pad_to_multiple_of) a multiple of {self.size}")
        limit = getattr(getattr(module, "cfg", None), "max_position_embeddings", None)
        positions = kwargs.get("position_ids")
        if positions is None:
            if limit is not None and seq > limit:
                raise ValueError(f"{seq} positions exceed max_position_embeddings={limit}; use shorter sequences "
                                 "or a larger model config")
            positions = torch.arange(seq, device=tokens.device).unsqueeze(0)
        kwargs["position_ids"] = self.chunk(positions)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = self.chunk(kwargs["labels"])
        return (self.chunk(tokens),), kwargs

    def sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the cp ranks, differentiable (the backward sums the gradients likewise): a MoE
        block's per-sequence sums behind its balance loss, each rank having its chunk's."""
        return dist_nn.all_reduce(t, group=self.group)

    def total_loss(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        """Forward hook: with labels (the token-loss sum of this chunk) the value summed over the cp ranks,
        the gradient this chunk's own; without (hidden states or logits) this chunk's, as they are."""
        if kwargs.get("labels") is None:
            return output
        local = output.detach()
        total = all_reduce(local.clone(), self.group).to(local.device)
        return output + (total - local)


def apply_context_parallel(model: nn.Module, mesh: Any) -> Optional[ContextParallel]:
    """Split `model`'s sequences over the 1-D "cp" `mesh` (size 1: nothing): the input and loss hooks on the
    model, the all-to-alls on every block's attention. Apply before recompute, compile and data parallel."""
    if mesh.size() == 1:
        return None
    cp = ContextParallel(mesh)
    exchange = SequenceExchange(cp.group, cp.size)
    for block in model.layers.values():
        block.attention.sequence_exchange = exchange
        if isinstance(block.feed_forward, MoE):  # its balance losses are per whole sequence
            block.feed_forward.sequence_parts, block.feed_forward.sequence_sum = cp.size, cp.sequence_sum
    model.register_forward_pre_hook(cp.shard_inputs, with_kwargs=True)
    model.register_forward_hook(cp.total_loss, with_kwargs=True)
    return cp
