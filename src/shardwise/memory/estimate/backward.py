"""One micro-batch's backward through a stage (`backward_walk`): the head's cross-entropy transients
first, then block by block its saved activations shrinking, its gradients growing, a recomputed block
coming back whole, the MLP's or attention's gradients, FSDP2's gathering and the optimizer in backward's
updates; the peak of it above everything else on the rank."""

from __future__ import annotations

from typing import Any, Optional

from .activations import Shape, layer_transient, mlp_bytes, weight_grad_inputs
from .layout import Precision
from .parameters import Param, numel
from .pipeline import Stage
from .sharding import Fsdp


def backward_walk(cfg: Any, sh: Shape, st: Stage, saved: dict[int, int], full: dict[int, int],
                   flags: dict[int, dict[str, bool]], held: list[Param], stored: dict[str, int], prec: Precision,
                   head: Optional[dict[str, int]], fsdp: Optional["Fsdp"], grads_exist: bool,
                   input_only: bool, updates: Optional[dict[Any, int]] = None, dequant: int = 0,
                   cast: int = 0, grads_leave: frozenset = frozenset()) -> int:
    """Peak of one micro-batch's backward through stage st, above everything else on the rank: the
    head's cross-entropy transients first, then block by block (its saved activations shrink, its
    gradients grow, a recomputed block comes back whole, the MLP's or attention's gradients join).
    `updates` (the optimizer in backward; no gradients accumulate): per block, "head" and
    "embedding", what updating its largest tensor holds while that part's activations are alive.
    `dequant` (QLoRA): one base weight's dequantisation, inside each block's backward. `cast`
    (optimize.float8): the largest linear's casts to float8, during the MLP's backward. `grads_leave`
    (FSDP2's CPU offload on an accelerator): the blocks whose sharded gradients go to host memory as they
    are reduced, so they do not grow on the device (their unsharded ones are in `fsdp`)."""
    remaining = st.act
    grads_now = st.grads if grads_exist else 0
    peak = remaining + grads_now
    if st.last and head is not None:
        prefetch = fsdp.head_backward(list(reversed(st.layers)), cfg.optimize.chunked_loss) if fsdp else 0
        peak = max(peak, remaining + head["bwd_extra"] + grads_now + prefetch)
        remaining -= head["lsm"] + head["saved"]  # released once the head's backward has run; the logits stay
        if not grads_exist and not input_only and fsdp is None:  # FSDP2 reduces the root's at the very end
            grads_now += sum(stored[p.name] for p in held if p.trainable and p.where == "head") * prec.grad
        if updates:
            peak = max(peak, remaining + grads_now + updates.get("head", 0))
    order = list(reversed(st.layers))
    for i in order:
        # A recomputed block's activations come back for its backward.
        back = full[i] - saved[i]
        mlp_t, attn_t = layer_transient(cfg, sh, flags[i])
        share_mlp, share_attn = _grad_shares(held, i)
        layer_grad = sum(stored[p.name] for p in held if p.layer == i and p.trainable) * prec.grad
        growing = 0 if (grads_exist or input_only or i in grads_leave) else layer_grad
        mlp_part = mlp_bytes(cfg, sh, flags[i]) if full[i] else 0
        # FSDP2's gathering above what it holds at the end of forward (already counted by the caller).
        f_mlp = fsdp.backward_at(i, order, share_mlp, grads_exist) - fsdp.forward() if fsdp else 0
        f_attn = fsdp.backward_at(i, order, share_attn, grads_exist) - fsdp.forward() if fsdp else 0
        base = remaining + back + grads_now
        if input_only:  # zero-bubble's input-gradient pass keeps the graph for the weight pass
            mlp_part = 0
        peak = max(peak, base + mlp_t + cast + int(growing * share_mlp) + f_mlp,
                   base - mlp_part + attn_t + int(growing * share_attn) + f_attn)
        if updates:
            peak = max(peak, base + updates.get(i, 0))
        if dequant:
            peak = max(peak, base + dequant)
        if input_only:
            remaining += weight_grad_inputs(cfg, sh)  # the output gradients the weight pass will need
        else:
            remaining -= saved[i]
        grads_now += growing
    if updates and st.first:
        peak = max(peak, remaining + grads_now + updates.get("embedding", 0))
    return peak


def _grad_shares(held: list[Param], layer: int) -> tuple[float, float]:
    """Fractions of a block's trainable elements whose gradients exist at its MLP's backward (the down
    projection's; none in a MoE block, whose peak comes before its experts' gradients) and at its attention's
    backward (all but q, k, v and the first norm)."""
    mine = [p for p in held if p.layer == layer and p.trainable]
    total = sum(numel(p.shape) for p in mine) or 1
    mlp = sum(numel(p.shape) for p in mine if ".feed_forward.w2." in p.name)
    late = sum(numel(p.shape) for p in mine
               if any(k in p.name for k in (".attention.wq.", ".attention.wk.", ".attention.wv.", "attention_norm")))
    return mlp / total, 1 - late / total
