"""The attention kernel call and the masks that keep packed documents apart.

A packed sample holds several documents; `document_ids` [B, T] numbers them. A token may attend
only to earlier tokens of its own document (seed 003, 2.1: a mask that leaks across documents
silently ruins training). Two ways to compute that, with the same result:
- an explicit boolean mask [B, 1, T, T] given to `scaled_dot_product_attention` (any device; the
  only way on CPU, where flex attention has no backward);
- flex attention with a block mask (CUDA), which skips the blocks that are fully masked and never
  materialises a T x T mask.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # an older or reduced torch build: the explicit mask path still works
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = flex_attention = None  # type: ignore[assignment]

AttentionMask = Union[torch.Tensor, "BlockMask"]

_compiled_flex = None


def flex_available() -> bool:
    """Whether this torch build has flex attention."""
    return flex_attention is not None


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask, True where query i may attend key j: j <= i and same document."""
    seqlen = document_ids.shape[1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor) -> "BlockMask":
    """The same mask as `document_mask`, as a flex-attention block mask."""
    if not flex_available():
        raise RuntimeError("this torch build has no flex attention; use the explicit mask path")
    bsz, seqlen = document_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex's mask_mod signature
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    return create_block_mask(same_document_causal, bsz, None, seqlen, seqlen, device=document_ids.device)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: "BlockMask") -> torch.Tensor:
    global _compiled_flex
    enable_gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        # Compiling flex for CPU costs seconds per shape; eager is only used to check results there.
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if _compiled_flex is None:
        # Uncompiled flex attention materialises the scores; compiled it is a fused kernel.
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[AttentionMask],
    is_causal: bool,
    dropout_p: float,
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, S, D] with `mask` (bool tensor or block mask)."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        if dropout_p:
            raise ValueError("flex attention has no dropout; use the explicit document mask when training "
                             "with dropout")
        return _flex(q, k, v, mask)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        # Repeating kv heads keeps every SDPA backend available (enable_gqa narrows the choice).
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
