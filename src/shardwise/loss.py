"""The training loss: the sum of next-token cross-entropy over the positions that carry a label.

Labels equal to `IGNORE_INDEX` (prompts of instruction data, padding) carry no loss. The sum, not
the mean: the trainer divides by the step's global number of target tokens, so that every layout and
every split into micro-batches computes one device's gradient. Under tensor parallelism the logits are
a DTensor sharded on the vocabulary and the loss is computed shard by shard, never gathering the full
`[tokens, vocab]` logits.

`chunked_token_loss_sum(hidden, weight, labels, chunk_tokens)` is the same sum computed from the final
hidden states and the output projection's weight without ever holding the `[tokens, vocab]` logits
(as Liger's fused linear cross-entropy and Apple's cut cross-entropy do): a custom autograd function
runs `chunk_tokens` tokens at a time; the peak is one `[chunk, vocab]` block in fp32. In training it
makes each chunk's gradients right away, in forward, as Liger does (the hidden states' and the output
weight's, scaled in backward by the upstream gradient), so no logits are computed twice. Under a
pipeline, with fp16 matmuls or under tensor parallelism it keeps the hidden states and each token's
log-sum-exp instead and recomputes each chunk's logits in backward, as cut cross-entropy does. A
vocabulary-sharded DTensor weight (tensor parallelism) computes on its shard, and only per-token
statistics cross the TP ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORE_INDEX = -100  # torch's cross-entropy default: a label that carries no loss
# Tokens per chunk of the chunked loss: one [chunk, vocab] fp32 block at a time (optimize.loss_chunk_tokens).
DEFAULT_LOSS_CHUNK_TOKENS = 1024


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


def _shard_start(vocab: int, mesh: Any) -> int:
    """The first vocabulary row this rank holds: DTensor shards like torch.chunk (the last ranks may hold fewer)."""
    chunk = -(-vocab // mesh.size())
    return min(chunk * mesh.get_local_rank(), vocab)


def _all_reduce(t: torch.Tensor, mesh: Any, op: str) -> torch.Tensor:
    """`t` reduced over the 1-D TP mesh; Partial -> Replicate is differentiable: its backward hands
    every rank the same gradient."""
    return DTensor.from_local(t, mesh, [Partial(op)], run_check=False).full_tensor()


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
    start = _shard_start(vocab, mesh)
    n_local = local.shape[-1]

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        return _all_reduce(t, mesh, op)

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


def row_token_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's sum of next-token cross-entropy over its labelled positions [R], fp32: minus the row's
    log-probability of its labels (preference tuning). `logits` [R, T, V] a plain tensor or a DTensor
    (gathered whole), `labels` [R, T]."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(labels.shape).sum(dim=1)


# --- the loss without the full logits ------------------------------------------------------------


def chunked_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS, compiled: bool = False,
                           gradients_in_forward: bool = True, per_row: bool = False) -> torch.Tensor:
    """`token_loss_sum(hidden @ weight.T, labels)` without materialising the [tokens, vocab] logits
    or their gradient: `chunk_tokens` tokens at a time, in forward (and again in backward where it
    recomputes the logits, see `gradients_in_forward`).

    `per_row`: instead of one sum, each row's sum [R] (labels [R, T]): minus each row's log-probability
    of its labelled tokens, as preference tuning needs. Its backward scales each token's gradient by
    its row's upstream gradient, so it always recomputes the logits (never `gradients_in_forward`).

    `hidden` [..., H] are the final (normed) hidden states, `weight` [V, H] the output projection's
    weight (a tied embedding matrix works alike), `labels` [...] the targets. Each chunk's logits are
    computed in the weight's dtype and upcast to fp32, as the plain path's `.float()` does, so the
    loss is the plain path's; under autocast the hidden states and the weight are cast to the
    autocast dtype first, as a matmul there would be. The weight's gradient accumulates chunk by
    chunk in its own dtype (in fp32 runs exactly the plain sum, reordered).

    Tensor parallelism: a DTensor `weight` sharded on the vocabulary (dim 0) over a 1-D mesh computes
    on its V/tp rows; `hidden` (a DTensor, e.g. sequence-sharded, or a plain tensor every TP rank
    holds alike) is gathered whole, and only per-token log-sum-exps and target logits are reduced
    across ranks. The result is the same plain scalar on every TP rank, differentiable.

    `compiled`: each chunk's work runs through `torch.compile` (run.compile; a new chunk shape compiles
    again), so that inductor may fuse the passes over the [chunk, vocab] block: the matmul, the loss and
    the logits' gradient, in forward with `gradients_in_forward`; otherwise the matmul, the largest logit,
    exp-sum and target logit in forward, and the matmul and the logits' gradient again in backward.

    `gradients_in_forward` (when a gradient is wanted, there is no TP mesh and the matmul is not fp16):
    each chunk's logits give their gradient at once, in forward, and backward only scales the hidden
    states' and the weight's gradients by the upstream one (as Liger's fused linear cross-entropy
    does). That saves recomputing the logits in backward, one [tokens, hidden] x [hidden, vocab] matmul
    of the head's four (2 x hidden x vocab FLOPs per token). Memory: the two gradients, kept from the
    forward on instead of the hidden states, are what the recomputing backward would make first, so
    the step's peak (where the forward ends and the backward begins) holds the same tensors; what moves
    is that the weight's gradient exists from the end of the forward. A pipeline turns it off (a
    GPipe-like schedule would hold one weight gradient per micro-batch in flight); fp16 keeps the
    recomputation, whose gradient is scaled by the loss scale before it is cast to 16 bits.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    mesh, start = None, 0
    if isinstance(weight, DTensor):
        wmesh = weight.device_mesh
        if wmesh.ndim != 1:
            raise NotImplementedError("chunked_token_loss_sum supports a weight on a 1-D TP mesh only")
        hidden = (hidden.redistribute(wmesh, [Replicate()]) if isinstance(hidden, DTensor)
                  else DTensor.from_local(hidden, wmesh, [Replicate()], run_check=False))
        placement = weight.placements[0]
        if isinstance(placement, Shard) and placement.dim == 0:
            mesh, start = wmesh, _shard_start(weight.shape[0], wmesh)
            # Each rank's hidden gradient is its vocabulary shard's part of the sum: Partial.
            hidden = hidden.to_local(grad_placements=[Partial()])
            weight = weight.to_local()
        else:
            hidden = hidden.to_local()
            weight = weight.redistribute(wmesh, [Replicate()]).to_local()
    elif isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    rows = labels.reshape(-1, labels.shape[-1]).shape[0] if per_row else 0
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        if (gradients_in_forward and not per_row and mesh is None and h.dtype != torch.float16
                and torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
            return _GradientsInForward.apply(h, weight, y, int(chunk_tokens), compiled)
        return _ChunkedLinearCrossEntropy.apply(h, weight, y, int(chunk_tokens), mesh, start, compiled, rows)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits [c, V] in fp32: the matmul in the weight's dtype, then the plain path's upcast."""
    logits = torch.mm(h, weight.t())
    return logits if logits.dtype == torch.float32 else logits.float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of logsumexp(h W^T) - (h W^T)[label], chunk by chunk over the tokens, the
    logits computed again in backward.

    Saves the hidden states, the weight, the labels and per token the largest logit and the sum of
    exp(logit - largest) (+inf where the label is ignored, so that backward's softmax is 0 there): backward
    then makes each chunk's softmax exactly as `_GradientsInForward` does, so the two give the same
    gradients bit for bit. Every [c, V] block lives only inside one chunk. Under TP (`mesh`) the weight
    holds vocabulary rows [start, start + V_local); the largest logit, the exp-sum and the target logit of
    each token are reduced across the mesh, so backward's softmax is one device's but for the exp-sum's
    rounding.

    `rows` > 0: the sums of `rows` equal runs of tokens (the rows of a batch) [rows], each token's
    gradient in backward scaled by its row's upstream gradient; 0: one sum."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                mesh: Any, start: int, compiled: bool, rows: int = 0) -> torch.Tensor:  # noqa: D102
        n, n_local = h.shape[0], weight.shape[0]
        top = torch.full((n,), float("-inf"), dtype=torch.float32, device=h.device)  # -inf: no vocabulary here
        total = torch.ones(n, dtype=torch.float32, device=h.device)
        target = torch.zeros(n, dtype=torch.float32, device=h.device)
        chunk_forward = _compiled("forward") if compiled else _chunk_forward
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            if n_local:  # not a TP rank past the end of an uneven vocabulary
                top[s:e], total[s:e], target[s:e] = chunk_forward(h[s:e], weight, labels[s:e], start, n_local)
        if mesh is not None:  # the largest logit of the whole vocabulary, and the exp-sum relative to it
            biggest = _all_reduce(top, mesh, "max")
            both = _all_reduce(torch.stack([total.mul_(top.sub_(biggest).exp_()), target]), mesh, "sum")
            top, total, target = biggest, both[0], both[1]
        lse = total.log().add_(top)
        valid = labels != IGNORE_INDEX
        token_losses = torch.where(valid, lse - target, 0.0)
        loss = token_losses.view(rows, -1).sum(dim=1) if rows else token_losses.sum()
        total.masked_fill_(~valid, float("inf"))
        ctx.save_for_backward(h, weight, labels, top, total)
        ctx.chunk_tokens, ctx.start, ctx.compiled, ctx.rows = chunk_tokens, start, compiled, rows
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # noqa: D102
        h, weight, labels, top, total = ctx.saved_tensors
        n, n_local = h.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = None
        g = grad_loss.float()
        # fp16 scales each chunk's gradient by the loss scale before its cast to 16 bits (no underflow);
        # the others scale the gradients at the end, as `_GradientsInForward` does. Per row: each token's
        # by its row's, in the chunk.
        per_token = g.repeat_interleave(n // ctx.rows).unsqueeze(1) if ctx.rows else None
        scale = g if weight.dtype == torch.float16 and per_token is None else None
        logit_grad = _compiled("backward") if ctx.compiled else _chunk_logit_grad
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, ctx.chunk_tokens):
                e = min(s + ctx.chunk_tokens, n)
                if n_local == 0:
                    if need_h:
                        grad_h[s:e] = 0
                    continue
                chunk_scale = per_token[s:e] if per_token is not None else scale
                p = logit_grad(h[s:e], weight, labels[s:e], top[s:e], total[s:e], chunk_scale, ctx.start, n_local)
                grad_w = _add_chunk_gradients(p, weight, h[s:e], grad_h, s, grad_w, need_w)
                del p
        if need_w and grad_w is None:
            grad_w = torch.zeros_like(weight)
        if scale is None and per_token is None:
            _scale_in_place((grad_h, grad_w), g)
        return grad_h, grad_w, None, None, None, None, None, None


class _GradientsInForward(torch.autograd.Function):
    """The same sum, each chunk's gradients made in forward (`gradients_in_forward`; no TP mesh).

    Keeps the unscaled gradients of the hidden states and of the weight (as attributes of ctx, which
    backward drops: a loss tensor kept alive after backward holds nothing) and no inputs; backward
    multiplies them in place by the upstream gradient (the trainer's 1 / target tokens)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                compiled: bool) -> torch.Tensor:  # noqa: D102
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = h.shape[0]
        token_losses = torch.empty(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = None
        chunk_fn = _compiled("forward_and_gradient") if compiled else _chunk_loss_and_logit_grad
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            token_losses[s:e], p = chunk_fn(h[s:e], weight, labels[s:e])
            grad_w = _add_chunk_gradients(p, weight, h[s:e], grad_h, s, grad_w, need_w)
            del p
        if need_w and grad_w is None:
            grad_w = torch.zeros_like(weight)
        ctx.gradients = (grad_h, grad_w)
        return token_losses.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # noqa: D102
        if ctx.gradients is None:
            raise RuntimeError("the chunked loss made its gradients in forward and hands them over once: a "
                               "second backward through it (retain_graph) needs gradients_in_forward=False")
        grad_h, grad_w = ctx.gradients
        ctx.gradients = None
        _scale_in_place((grad_h, grad_w), grad_loss)
        return grad_h, grad_w, None, None, None


def _scale_in_place(gradients: tuple[Optional[torch.Tensor], ...], by: torch.Tensor) -> None:
    """Multiply each gradient that exists by the upstream gradient `by`, in place."""
    for grad in gradients:
        if grad is not None:
            grad.mul_(by)


def _add_chunk_gradients(p: torch.Tensor, weight: torch.Tensor, h: torch.Tensor, grad_h: Optional[torch.Tensor],
                         start: int, grad_w: Optional[torch.Tensor], need_w: bool) -> Optional[torch.Tensor]:
    """One chunk's share from its d loss / d logits `p`: p @ W written into the rows of `grad_h` from `start`
    on (when given), p^T h added to the weight's gradient so far; returns that gradient (None without
    `need_w`), made by the first chunk."""
    if grad_h is not None:
        torch.mm(p, weight, out=grad_h[start:start + p.shape[0]])
    if not need_w:
        return None
    if grad_w is None:
        return torch.mm(p.t(), h)
    return grad_w.addmm_(p.t(), h)


def _chunk_loss_and_logit_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's loss per token (log-sum-exp minus target logit, 0 where ignored) and d loss / d logits
    = softmax - one_hot(label) (0 on ignored tokens) in the weight's dtype."""
    idx, valid = _local_targets(labels, 0, weight.shape[0])
    logits = _chunk_logits(h, weight)
    target = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
    top = logits.amax(dim=1)
    p = logits.sub_(top.unsqueeze(1)).exp_()
    total = p.sum(dim=1)
    token_losses = torch.where(valid, total.log().add_(top) - target, 0.0)
    # softmax, 0 on ignored rows (a division by +inf); then minus one at each valid row's label.
    p.div_(torch.where(valid, total, float("inf")).unsqueeze(1))
    p.scatter_add_(1, idx.unsqueeze(1), torch.where(valid, -1.0, 0.0).unsqueeze(1))
    return token_losses, (p if p.dtype == weight.dtype else p.to(weight.dtype))


def _chunk_forward(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, start: int, n_local: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's largest logit, sum of exp(logit - largest) and target logit per token (the target 0
    where the label is another rank's)."""
    idx, mine = _local_targets(labels, start, n_local)
    logits = _chunk_logits(h, weight)
    target = torch.where(mine, logits.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
    top = logits.amax(dim=1)
    return top, logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1), target  # in place: one [c, V] buffer


def _chunk_logit_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, top: torch.Tensor,
                      total: torch.Tensor, scale: Optional[torch.Tensor], start: int, n_local: int) -> torch.Tensor:
    """d loss / d logits of one chunk = softmax - one_hot(label), the softmax exp(logits - top) / total as
    `_chunk_loss_and_logit_grad` makes it (0 on ignored tokens: their total is +inf), times `scale` when
    given, in the weight's dtype: the plain path's gradient reaches the matmul in that dtype too."""
    idx, mine = _local_targets(labels, start, n_local)
    p = _chunk_logits(h, weight)
    p.sub_(top.unsqueeze(1)).exp_().div_(total.unsqueeze(1))
    p.scatter_add_(1, idx.unsqueeze(1), torch.where(mine, -1.0, 0.0).unsqueeze(1))
    if scale is not None:
        p.mul_(scale)
    return p if p.dtype == weight.dtype else p.to(weight.dtype)


_COMPILED_CHUNKS: dict[str, Any] = {}


def _compiled(which: str) -> Any:
    """The chunk function `which` ("forward", "backward", "forward_and_gradient") under torch.compile, made
    once per process."""
    if which not in _COMPILED_CHUNKS:
        fn = {"forward": _chunk_forward, "backward": _chunk_logit_grad,
              "forward_and_gradient": _chunk_loss_and_logit_grad}[which]
        _COMPILED_CHUNKS[which] = torch.compile(fn)
    return _COMPILED_CHUNKS[which]


def _local_targets(labels: torch.Tensor, start: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each label in this rank's weight, clamped to 0 elsewhere; whether the row is this rank's)."""
    idx = labels - start
    mine = (labels != IGNORE_INDEX) & (idx >= 0) & (idx < n_local)
    return torch.where(mine, idx, 0), mine
