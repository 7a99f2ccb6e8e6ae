"""The attention kernel call and the masks that keep packed documents apart.

A packed sample holds several documents; `document_ids` [B, T] numbers them. A token may attend
only to earlier tokens of its own document (seed 003, 2.1: a mask that leaks across documents
silently ruins training). Two ways to compute that, with the same result:
- an explicit boolean mask [B, 1, T, T] given to `scaled_dot_product_attention` (any device; the
  only way on CPU, where flex attention has no backward);
- flex attention with a block mask (CUDA), which skips the blocks that are fully masked and never
  materialises a T x T mask.

Off the CPU both the block mask and flex attention run compiled (`flex_kernels`), with torch's
automatic dynamic shapes: the first batch shape compiles static, and a dimension that then changes
(the rows and width of dynamic SFT batches, the last evaluation batch) compiles once more as dynamic
and serves every later value; traced without specialising sizes of 1 (one row, one flex block:
`flex_shapes`), the dynamic kernel serves those too. So a run compiles each a few times, not once
per shape (at most 3 over ten SFT-like shapes on torch 2.13, tests/models/test_flex_shapes.py; as
many again for evaluation, which runs without gradients), also when the blocks are compiled with
flex inside them, and stays under torch's recompile limit (8), past which flex would fall back to
its unfused path that builds the T x T scores (and a compiled block to eager). Uncompiled,
`create_block_mask` evaluates the mask over the whole [B, T, T] grid every forward.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx.experimental import _config as fx_config

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # an older or reduced torch build: the explicit mask path still works
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = flex_attention = None  # type: ignore[assignment]

AttentionMask = Union[torch.Tensor, "BlockMask"]


def flex_available() -> bool:
    """Whether this torch build has flex attention."""
    return flex_attention is not None


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask, True where query i may attend key j: j <= i and same document."""
    seqlen = document_ids.shape[1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor, window: int = 0) -> "BlockMask":
    """The same mask as `document_mask`, as a flex-attention block mask (built compiled off the CPU); with
    `window`, keys fewer than `window` positions back only (a sliding-window block's mask)."""
    if not flex_available():
        raise RuntimeError("this torch build has no flex attention; use the explicit mask path")
    if document_ids.device.type == "cpu":  # compiling costs seconds a shape; the CPU only checks results
        return eager_document_block_mask(document_ids, window)
    build, _ = flex_kernels()
    return build(document_ids, window)


def eager_document_block_mask(document_ids: torch.Tensor, window: int = 0) -> "BlockMask":
    """`document_block_mask` without compiling: the mask is evaluated over the whole [B, T, T] grid."""
    bsz, seqlen = document_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex's mask_mod signature
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    def same_document_window(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return same_document_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    mask_mod = same_document_window if window else same_document_causal
    return create_block_mask(mask_mod, bsz, None, seqlen, seqlen, device=document_ids.device)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's slope of each head (Press et al. 2022, as Baichuan-13B computes them): a geometric sequence
    from 2^(-8/n) for a power-of-two n; otherwise that of the nearest power below, then every other slope
    of the next power's sequence."""
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(power_of_two(num_heads))
    below = 2 ** math.floor(math.log2(num_heads))
    return torch.cat([torch.tensor(power_of_two(below)), alibi_slopes(2 * below)[0::2][:num_heads - below]])


def alibi_mask(allowed: torch.Tensor, slopes: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, heads, T, S] for SDPA: slope x (key position - query position), -inf where
    `allowed` [B or 1, 1, T, S] (True = may attend) is False. Each row differs from Baichuan's
    slope x key position by a constant, which the softmax ignores, and stays small at long context."""
    seqlen, keys = allowed.shape[-2], allowed.shape[-1]
    distance = (torch.arange(keys, device=allowed.device)[None, :]
                - torch.arange(past, past + seqlen, device=allowed.device)[:, None])
    bias = slopes.to(allowed.device)[:, None, None] * distance
    return bias.to(dtype).masked_fill(~allowed, float("-inf"))


@functools.cache
def flex_kernels(backend: Union[str, Callable[..., Any]] = "inductor") -> tuple[Callable, Callable]:
    """(document block-mask builder, flex attention), each compiled once per process with `backend`.

    dynamic=None is torch's automatic dynamic shapes (see the module docstring): a fixed-shape run
    (pre-training) keeps the static kernel, a changing one compiles a dynamic kernel once (torch 2.11:
    the mask builder up to five graphs, tests/models/test_flex_shapes.py says why). Uncompiled flex
    attention materialises the scores; compiled it is one fused kernel.
    """
    return (_under_flex_shapes(torch.compile(eager_document_block_mask, dynamic=None, backend=backend)),
            _under_flex_shapes(torch.compile(flex_attention, dynamic=None, backend=backend)))


def flex_shapes(mask: Optional[AttentionMask]) -> contextlib.AbstractContextManager:
    """Around the (compiled) blocks when `mask` is a flex block mask: traced without specialising sizes
    of 1, so that one dynamic graph also serves a batch of one row or a width of one flex block, a
    compile less each. Nothing for another mask, or inside an enclosing compile (which traces it under
    its own settings)."""
    if BlockMask is None or not isinstance(mask, BlockMask) or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _sizes_oblivious()


def _sizes_oblivious() -> contextlib.AbstractContextManager:
    return fx_config.patch(backed_size_oblivious=True)


def _under_flex_shapes(compiled: Callable) -> Callable:
    """`compiled`, traced as `flex_shapes` says (inlined as it is inside an enclosing compile)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        with _sizes_oblivious():
            return compiled(*args, **kwargs)
    return run


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: "BlockMask",
          scale: Optional[float]) -> torch.Tensor:
    enable_gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        # Compiling flex for CPU costs seconds per shape; eager is only used to check results there.
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)
    _, flex = flex_kernels()
    return flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[AttentionMask],
    is_causal: bool,
    dropout_p: float,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k [B, H_kv, S, D] and v [B, H_kv, S, D_v] with `mask` (bool tensor or
    block mask); the scores are scaled by `scale` (default 1/sqrt(D))."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        if dropout_p:
            raise ValueError("flex attention has no dropout; use the explicit document mask when training "
                             "with dropout")
        return _flex(q, k, v, mask, scale)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        # Repeating kv heads keeps every SDPA backend available (enable_gqa narrows the choice).
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)
