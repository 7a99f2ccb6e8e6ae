"""The RMSNorm, the gated MLP's activation and RoPE as autograd functions that save less for backward
or run fewer passes.

Written op by op, autograd keeps more than backward needs:
- RMSNorm `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)` keeps the fp32 copy of
  its input (4 bytes an element, also when the input is 16-bit), the rsqrt and the normalised input
  (for the weight's gradient). `rms_norm` keeps the input in its own dtype and the rsqrt (one fp32
  number per token) and recomputes the normalised input in backward (one element-wise product).
- The gated activation `act(g) * u` keeps g (for act's backward), act(g) and u (for the product's).
  `gated_activation` keeps g and u and recomputes act(g) in backward.
Per block of a LLaMA-shaped model in fp32 that is 2 x [tokens, hidden] + [tokens, ffn] fewer floats
(in bf16 3 x [tokens, hidden] x 2 bytes + [tokens, ffn] x 2 bytes fewer), about a fifth of what a
block saves, for two element-wise recomputations in backward (Liger's fused RMSNorm and SwiGLU
kernels save the same way). The forward is the op-by-op one, bit for bit (Hugging Face logits still
match exactly); the gated activation's backward is too (the same aten backward ops), the norm's
agrees to rounding (its formula is autograd's chain, reassociated).

RoPE `x * cos + rotate_half(x) * sin` (Hugging Face's convention) builds rotate_half with a negation
and a concatenation, each a pass over [tokens, heads, head_dim], and autograd runs their backwards too.
`rotary` writes the same sums into one output, half by half (five passes forward, five backward, four
of them over half the elements), bit for bit the forward of the op-by-op form: x1 * c1 - x2 * s1 is
x1 * c1 + (-x2) * s1 exactly. It saves cos and sin only, as the op-by-op form does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)`, saving x and the rsqrt only."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: D102
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # noqa: D102
        x, weight, rstd = ctx.saved_tensors
        # x meets the fp32 rstd (and fp32 gradients) by type promotion, exactly as x.float() would,
        # without an fp32 copy of a 16-bit x.
        grad_w = grad_x = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - weight.dim()))
            grad_w = (grad * (x * rstd).to(x.dtype)).sum(dims).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # The chain autograd would run: through the product with the weight, the cast, x * rstd,
            # rsqrt (d rsqrt(m) / dm = -rstd^3 / 2), the mean and the square; in place, so that at
            # most two [tokens, hidden] temporaries exist at once.
            g = (grad * weight).to(x.dtype).float()
            grad_rstd = (g * x).sum(-1, keepdim=True)
            grad_sq = grad_rstd * (-0.5 * rstd.pow(3)) / x.shape[-1]
            grad_x = g.mul_(rstd).addcmul_(x, grad_sq * 2).to(x.dtype)
        return grad_x, grad_w, None


def gated_activation(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(g) * u` (SwiGLU and its kin), saving g and u only; `activation`: silu, gelu, gelu_tanh, relu."""
    return _GatedActivation.apply(g, u, activation)


def _activate(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g)
    if activation == "relu":
        return torch.relu(g)
    return torch.nn.functional.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def _activation_backward(grad: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient through act at g: the aten backward op autograd itself runs."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    if activation == "relu":  # relu(g) <= 0 exactly where g <= 0: the mask autograd takes from the output
        return torch.ops.aten.threshold_backward(grad, g, 0)
    return torch.ops.aten.gelu_backward(grad, g, approximate="tanh" if activation == "gelu_tanh" else "none")


class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(g, u)
        ctx.activation = activation
        return _activate(g, activation) * u

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # noqa: D102
        g, u = ctx.saved_tensors
        grad_g = grad_u = None
        # One [tokens, ffn] temporary at a time, as autograd's own product and activation backward hold.
        if ctx.needs_input_grad[0]:
            grad_g = _activation_backward(grad * u, g, ctx.activation)
        if ctx.needs_input_grad[1]:
            grad_u = _activate(g, ctx.activation).mul_(grad)
        return grad_g, grad_u, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE `x * cos + rotate_half(x) * sin`, rotate_half(x) = cat(-x2, x1): x [..., head_dim], cos and sin
    broadcast to it (no gradient flows to them)."""
    return _Rotary.apply(x, cos, sin)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: D102
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].sub_(x[..., half:] * sin[..., :half])
        out[..., half:].add_(x[..., :half] * sin[..., half:])
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # noqa: D102
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        # out1 = x1 c1 - x2 s1 and out2 = x2 c2 + x1 s2, so d/dx1 = g1 c1 + g2 s2 and d/dx2 = g2 c2 - g1 s1.
        grad_x = grad * cos
        grad_x[..., :half].add_(grad[..., half:] * sin[..., half:])
        grad_x[..., half:].sub_(grad[..., :half] * sin[..., :half])
        return grad_x.to(ctx.x_dtype), None, None
