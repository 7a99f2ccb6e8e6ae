"""The output head of one micro-batch, on the last stage: the final norm, the logits and the
cross-entropy, plain or chunked (the chunked loss computing its logits again in backward, or making its
gradients in forward): what they keep until backward, and the transients above that in forward and
backward (`head_bytes`)."""

from __future__ import annotations

from typing import Any

from .activations import Shape, norm_bytes
from .layout import Precision


def head_bytes(cfg: Any, sh: Shape, prec: Precision, flags: dict[int, dict[str, bool]],
          logits_kept: bool) -> dict[str, int]:
    """The final norm, logits and cross-entropy of one micro-batch: what they keep until backward
    (norm, logits, the fp32 log-softmax) and the transients above that in forward and backward.
    `logits_kept`: the plain path's logits stay referenced until backward (a pipeline's schedule
    keeps the last stage's output; tensor parallelism's DTensor logits), else they are freed once
    the loss is computed."""
    m = cfg.model
    bt = sh.b * sh.t
    autocast = prec.level == "O1"
    s = 2 if autocast else sh.s  # logits and the projection's saved input are 16-bit under autocast
    input_grad = any(any(f.values()) for f in flags.values())  # something before the head trains
    out_trains = cfg.lora is None and not (cfg.freeze.embeddings and m.tie_embeddings)
    saved = norm_bytes(m, sh, input_grad, cfg.lora is None, 4 if autocast else None)
    chunk = cfg.optimize.loss_chunk()
    if chunk is not None:
        hidden_grad = input_grad or cfg.lora is None  # the final norm's weight trains in a full fine-tune
        if not head_recomputes_logits(cfg) and (hidden_grad or out_trains):
            return _head_with_forward_gradients(sh, s, saved, hidden_grad, out_trains, min(chunk, bt), autocast)
        head = _chunked_head(sh, s, saved, out_trains, min(chunk, bt), autocast)
        if cfg.data.kind == "preference":  # each token's upstream gradient (its row's), fp32, in backward
            head["bwd_extra"] += bt * 4
        return head
    if out_trains or autocast:
        saved += bt * sh.h * s  # the norm output (its 16-bit cast under autocast), kept by the output projection
    logits = bt * sh.v * s  # referenced until the backward is done (see logits_kept)
    lsm = bt * sh.v * 4  # fp32 log-softmax (under loss parallel: exp of the shifted local logits)
    cast = bt * sh.v * 4 if s != 4 else 0  # .float() copy of 16-bit logits, during the loss
    loss_parallel = sh.v != m.vocab_size
    fwd_extra = cast + (bt * sh.v * 4 if loss_parallel else 0)  # loss parallel also holds logits - max
    if not logits_kept:  # nothing references them once the loss is computed: a forward transient only
        fwd_extra, logits = fwd_extra + logits, 0
    # Backward of cross-entropy: the gradients of the log-probabilities and of the logits (fp32) at once.
    bwd_extra = 2 * bt * sh.v * 4
    return {"saved": saved, "logits": logits, "lsm": lsm, "fwd_extra": fwd_extra, "bwd_extra": bwd_extra}


def _chunked_head(sh: Shape, s: int, norm: int, weight_grad: bool, chunk: int, autocast: bool) -> dict[str, int]:
    """The head under the chunked loss (`shardwise.loss.chunked_token_loss_sum`, `chunk` tokens at a
    time): no logits are kept, only one chunk's [chunk, V] block lives at once, in forward and again in
    backward. `s`: bytes of the hidden states and weight the loss computes with; `norm`: what the final
    norm keeps."""
    bt = sh.b * sh.t
    w16 = sh.v * sh.h * 2 if autocast else 0  # under autocast the loss's own 16-bit copy of the weight
    # Kept until backward: the hidden states (their 16-bit cast under autocast), each token's fp32
    # largest logit and exp-sum, the 16-bit weight copy; the labels are the batch's own.
    saved = norm + bt * sh.h * s + bt * 8 + w16
    block = _loss_chunk_bytes(sh, s, chunk)
    fwd_extra = block + bt * 4  # and every token's target logit
    if autocast:
        fwd_extra += bt * sh.h * 4  # the fp32 norm output, referenced until the loss returns
    grad_h, grad_w = bt * sh.h * s, (sh.v * sh.h * s if weight_grad else 0)
    if chunk < bt or s == 4:  # from the second chunk on the weight's gradient accumulates beside the block
        bwd_extra = grad_h + grad_w + block
    else:  # one 16-bit chunk: its fp32 copy is gone (cast back) before the weight's gradient is made
        bwd_extra = grad_h + max(block, chunk * sh.v * s + 9 * chunk + grad_w)
    if autocast:
        # After the loss's backward (its saved tensors released), the casts' backward: the weight's
        # gradient to fp32 beside its 16-bit one, then the hidden states' the same way.
        freed = bt * sh.h * s + bt * 8 + w16
        after = max(grad_h + grad_w + (sh.v * sh.h * 4 if weight_grad else 0), grad_h + bt * sh.h * 4)
        bwd_extra = max(bwd_extra, after - freed)
    return {"saved": saved, "logits": 0, "lsm": 0, "fwd_extra": fwd_extra, "bwd_extra": bwd_extra}


def head_recomputes_logits(cfg: Any) -> bool:
    """Whether the chunked loss (`shardwise.loss.chunked_token_loss_sum`) computes its logits again in
    backward: under a pipeline (`split_model` turns its gradients_in_forward off), tensor parallelism (a
    vocabulary-sharded weight), fp16 matmuls or preference tuning (each row's sum, its gradient scaled
    token by token in backward); elsewhere it makes its gradients in forward."""
    p = cfg.parallel
    if not cfg.optimize.chunked_loss:
        return False
    return (p.pipeline_parallel > 1 or p.tensor_parallel > 1 or cfg.optimize.mixed_precision == "fp16"
            or cfg.data.kind == "preference")


def _loss_chunk_bytes(sh: Shape, s: int, chunk: int) -> int:
    """One chunk of the chunked loss: its fp32 logits (the matmul's own buffer in fp32) and their copy in
    the `s`-byte compute dtype (the 16-bit matmul output, or the gradient cast back), its target rows and masks."""
    return chunk * sh.v * (4 + (s if s != 4 else 0)) + 9 * chunk


def _head_with_forward_gradients(sh: Shape, s: int, norm: int, hidden_grad: bool, weight_grad: bool, chunk: int,
                                 autocast: bool) -> dict[str, int]:
    """The chunked loss making its gradients in forward (`chunked_token_loss_sum`'s gradients_in_forward):
    the hidden states' and the weight's gradients are kept until backward instead of the hidden states,
    which live only while the loss runs, with one [chunk, V] block at a time; backward scales the two
    gradients in place (under autocast their casts back to fp32 follow)."""
    bt = sh.b * sh.t
    grad_h, grad_w = (bt * sh.h * s if hidden_grad else 0), (sh.v * sh.h * s if weight_grad else 0)
    saved = norm + grad_h + grad_w
    block = _loss_chunk_bytes(sh, s, chunk)
    if chunk < bt or s == 4:  # from the second chunk on (fp32: in the first) the weight's gradient is beside it
        chunk_peak = block
    else:  # one 16-bit chunk: its fp32 logits are gone (cast) before the weight's gradient is made
        chunk_peak = max(block - grad_w, chunk * sh.v * s + 9 * chunk)
    fwd_extra = chunk_peak + bt * sh.h * s + bt * 4  # the hidden states (the caller's) and every token's loss
    bwd_extra = 0
    if autocast:
        # The fp32 norm output and the 16-bit weight copy live during the loss; in backward the casts turn
        # the 16-bit gradients into fp32 ones, the weight's first (as `_chunked_head` counts them).
        fwd_extra += bt * sh.h * 4 + sh.v * sh.h * 2
        after = max(grad_h + grad_w + (sh.v * sh.h * 4 if weight_grad else 0), grad_h + bt * sh.h * 4)
        bwd_extra = max(0, after - grad_h - grad_w)
    return {"saved": saved, "logits": 0, "lsm": 0, "fwd_extra": fwd_extra, "bwd_extra": bwd_extra}
