"""QLoRA's frozen base: the weight of every LoRA-wrapped linear stored quantised (torchao), the
adapters trained on top in the run's precision.

`lora.quantize_base: nf4` stores each such weight as torchao's NF4Tensor (QLoRA's 4-bit NormalFloat:
4-bit codes packed two a byte, an 8-bit absmax scale per block of 64 values, those scales quantised
again with one factor per 256 of them); `int8` as torchao's Int8Tensor (symmetric, one fp32 scale and
int8 zero point per output row). Both keep the dtype the weight had (16 bits at O2/O3, fp32 at O0),
so dequantising gives a weight of that dtype. The forward computes x @ dequant(W)^T + b and keeps
only the quantised weight for backward, which dequantises it again: one weight's dequantised copy
exists at a time. A LoRA layer on such a base is one autograd function (`lora_linear`), so that its
input gradient, through the base and through the adapter, is summed in fp32 and rounded once.

A quantised base is left out of the model's state dict (and so of checkpoints): the base is never
saved quantised; a run rebuilds it from `model.init_from` (or the seed) on every start, so a resumed
run quantises exactly the same weights. The adapters are saved in peft's format as before.

torchao is optional (the `lowbit` extra) and imported here only when a base is quantised.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.errors import ConfigError

KINDS = ("none", "nf4", "int8")
NF4_BLOCK = 64  # values sharing one absmax scale (torchao's and QLoRA's default)
NF4_SCALER_BLOCK = 256  # scales sharing one factor of the double quantisation
LOWBIT_EXTRA = "pip install 'shardwise[lowbit]'"


def torchao_import() -> Any:
    """torchao's quantization package, or a ConfigError with the install line."""
    try:
        import torchao.quantization as tq
    except Exception as exc:  # noqa: BLE001 - missing, or built for another torch: either way not usable
        raise ConfigError(
            f"lora.quantize_base needs torchao: {LOWBIT_EXTRA} (or pip install torchao, built for torch "
            f"{torch.__version__}); it could not be imported ({type(exc).__name__}: {exc}). Or set "
            "lora.quantize_base: none") from None
    return tq


def torchao_available() -> bool:
    """Whether torchao's quantised tensors can be imported (the `lowbit` extra)."""
    try:
        torchao_import()
    except ConfigError:
        return False
    return True


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` (or a Parameter holding it) is a quantised base weight."""
    inner = t.data if isinstance(t, torch.nn.Parameter) else t
    return type(inner) is not torch.Tensor and hasattr(inner, "__tensor_flatten__") and \
        type(inner).__name__ in ("NF4Tensor", "Int8Tensor")


def quantizable(kind: str, shape: tuple[int, ...]) -> str | None:
    """Why a weight of `shape` cannot be quantised as `kind` (None when it can)."""
    if len(shape) != 2:
        return f"a {len(shape)}-d tensor (only matrices are quantised)"
    if kind == "nf4" and math.prod(shape) % NF4_BLOCK:
        return f"{math.prod(shape):,} elements, not a whole number of NF4's blocks of {NF4_BLOCK}"
    return None


def nf4_scaler_block(shape: tuple[int, ...]) -> int:
    """Scales sharing one factor of NF4's double quantisation: 256 (QLoRA's), or the largest power of
    two below it that divides the number of blocks (SmolLM2-135M's 576 x 576 projections have 5,184
    blocks: 64), as torchao needs a whole number of scaler blocks."""
    blocks = math.prod(shape) // NF4_BLOCK
    size = NF4_SCALER_BLOCK
    while blocks % size:
        size //= 2
    return size


@torch.no_grad()
def quantize_tensor(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` (a plain matrix) quantised as `kind`, keeping its dtype and device."""
    why = quantizable(kind, tuple(weight.shape))
    if why is not None:
        raise ConfigError(f"lora.quantize_base {kind} cannot quantise {why}; target other modules "
                          "(lora.target_modules) or use lora.quantize_base int8 / none")
    tq = torchao_import()
    weight = weight.detach().contiguous()
    if kind == "nf4":
        return tq.to_nf4(weight, NF4_BLOCK, nf4_scaler_block(tuple(weight.shape)))
    if kind == "int8":
        return tq.Int8Tensor.from_hp(weight, tq.PerRow())
    raise ValueError(f"unknown quantisation {kind!r}; expected one of {KINDS[1:]}")


DEQUANT_CHUNKS = 16  # at most: a weight is dequantised this many row blocks at a time
GRAD_ROWS = 1024  # token rows of the input gradient summed in fp32 at a time (QLoRA's backward)


def dequant_chunks(kind: str, shape: tuple[int, ...]) -> int:
    """Row blocks a weight is dequantised in: the largest power of two up to DEQUANT_CHUNKS that splits
    its rows (and for NF4 its double-quantisation blocks) evenly, so that torchao's temporaries (14
    bytes an element in bf16 for NF4) exist for one block at a time, not for the whole weight."""
    units = shape[0]
    if kind == "nf4":
        blocks = math.prod(shape) // NF4_BLOCK
        units = math.gcd(units, blocks // nf4_scaler_block(shape))
    chunks = DEQUANT_CHUNKS
    while units % chunks:
        chunks //= 2
    return chunks


def _kind(t: torch.Tensor) -> str:
    return "nf4" if type(t).__name__ == "NF4Tensor" else "int8"


def _dequantize_whole(inner: torch.Tensor) -> torch.Tensor:
    return inner.get_original_weight() if _kind(inner) == "nf4" else inner.dequantize()


def _row_blocks(inner: torch.Tensor) -> list[torch.Tensor]:
    """The quantised weight as `dequant_chunks` row blocks, each still quantised (views of its parts):
    NF4 splits as torchao's FSDP sharding does, Int8Tensor slices."""
    chunks = dequant_chunks(_kind(inner), tuple(inner.shape))
    rows = inner.shape[0] // chunks
    if _kind(inner) == "nf4":
        return list(torch.split(inner, rows)) if chunks > 1 else [inner]
    return [inner[i * rows:(i + 1) * rows] for i in range(chunks)]


def _inner(weight: torch.Tensor) -> torch.Tensor:
    return weight.data if isinstance(weight, torch.nn.Parameter) else weight


def dequantize(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full-precision value of a quantised weight, in its own dtype (or `dtype`), computed
    `dequant_chunks` row blocks at a time into one tensor."""
    inner = _inner(weight)
    blocks = _row_blocks(inner)
    if len(blocks) == 1:
        full = _dequantize_whole(inner)
    else:
        rows = blocks[0].shape[0]
        full = torch.empty(tuple(inner.shape), dtype=inner.dtype, device=inner.device)
        for i, block in enumerate(blocks):
            full[i * rows:(i + 1) * rows] = _dequantize_whole(block)
    return full if dtype is None or full.dtype == dtype else full.to(dtype)


def quantized_bytes(kind: str, shape: tuple[int, ...], element_size: int) -> int:
    """Bytes a weight of `shape` and dtype size `element_size` takes quantised as `kind`: the sum of
    torchao's inner tensors (the estimator's count; tests hold it against `__tensor_flatten__`)."""
    n = math.prod(shape)
    if kind == "nf4":
        blocks = n // NF4_BLOCK
        # codes two a byte + int8 block scales + one factor per scaler block + their mean + the 16-value table
        return n // 2 + blocks + (blocks // nf4_scaler_block(shape)) * element_size + element_size + 16 * element_size
    if kind == "int8":
        return n + shape[0] * (4 + 1)  # int8 codes + an fp32 scale and an int8 zero point per row
    raise ValueError(f"unknown quantisation {kind!r}")


def dequantized_transient(kind: str, shape: tuple[int, ...], element_size: int, backward: bool = False,
                          tokens: int = GRAD_ROWS, widens: bool = False) -> int:
    """Bytes alive at once, beyond the quantised weight, while one weight is dequantised for its matmul.
    Forward: the dequantised weight (n x element size), which lives until the matmul is done, and the
    temporaries of dequantising one row block (`dequant_chunks`). Backward: the same, then the
    dequantised weight with the fp32 sums of the LoRA layer's input gradient for min(`tokens`, GRAD_ROWS)
    token rows (the part through W and the adapter's, `_input_grad`). `widens`: a CPU, whose 16-bit
    matmuls cannot write fp32 (`_mm_fp32`), so the fp32 copies of the weight and of the output gradient's
    rows come on top. Counted from torchao's code and held against measurement (tests/peft/test_qlora.py,
    bench/memory_check.py)."""
    n = math.prod(shape)
    chunks = dequant_chunks(kind, shape)
    c = n // chunks  # elements of one row block
    out = n * element_size if chunks > 1 else 0  # the whole result, filled block by block
    if kind == "nf4":
        # get_original_weight of a block: the high and low codes as int64 indices (4c bytes each), their
        # table values (c/2 each), scaled by the block scales (c/2 each, the scales c/64), stacked (c).
        whole = out + 8 * c + 3 * c * element_size + (c // NF4_BLOCK) * element_size
    else:  # int8: torchao's dequantize_affine casts a block's codes and scales them in fp32, then to the dtype.
        rows = shape[0] // chunks
        whole = out + (8 * c + 4 * rows if element_size == 4 else 4 * c + c * element_size)
    if not backward:
        return whole
    rows = min(tokens, GRAD_ROWS)
    widened = n * 4 + rows * shape[0] * 4 if widens and element_size != 4 else 0
    return max(whole, n * element_size + 2 * rows * shape[1] * 4 + widened)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32, whatever the 16-bit dtype of a and b: the products summed in fp32 and the result
    not rounded to 16 bits. CUDA's matmul writes fp32 itself (out_dtype); elsewhere the operands are
    widened first."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _QuantizedLoRALinear(torch.autograd.Function):
    """A LoRA layer on a frozen quantised W: x @ dequant(W)^T + b + scaling * B(A(dropout(x))). Only W
    itself is kept for backward (as torchtune's and torchao's linear_nf4 do), so no 16-bit copy of the
    base outlives its matmul. The layer is one function so that backward sums the input gradient's two
    parts, through W and through the adapter, in fp32 and rounds them to x's dtype once (autograd would
    round each part to 16 bits and add them in 16 bits). The adapter's ops and saved tensors are those
    nn.Linear and nn.Dropout would have: the dropped-out input, the dropout mask and A's output. Under
    autocast (precision level O1) the matmuls run in its dtype, the inputs cast here as autocast would
    cast them, so that backward knows the dtype they ran in."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # noqa: D102
                lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dropout: float) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):
            cast = x.to(dtype)
            out = F.linear(cast, dequantize(weight, dtype), None if bias is None else bias.to(dtype))
            dropped, mask = torch.native_dropout(x, dropout, True) if dropout > 0 else (x, None)
            dropped, lora_a, lora_b = (cast if mask is None else dropped.to(dtype)), lora_a.to(dtype), lora_b.to(dtype)
            hidden = F.linear(dropped, lora_a)
            out = out + F.linear(hidden, lora_b) * scaling
        ctx.scaling, ctx.dropout, ctx.has_bias, ctx.x_dtype = scaling, dropout, bias is not None, x.dtype
        ctx.save_for_backward(weight, lora_a, lora_b, dropped, mask, hidden)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        weight, lora_a, lora_b, dropped, mask, hidden = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grads: list[Any] = [None] * 7
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grads[2] = flat.sum(0)
        scaled = flat * ctx.scaling  # as autograd would: dL/d(hidden) = scaling * dL/dy @ B, then A's and B's
        d_hidden = scaled @ lora_b
        if ctx.needs_input_grad[3]:
            grads[3] = d_hidden.t() @ dropped.reshape(-1, dropped.shape[-1])
        if ctx.needs_input_grad[4]:
            grads[4] = scaled.t() @ hidden.reshape(-1, hidden.shape[-1])
        del scaled
        if ctx.needs_input_grad[0]:
            keep = None if mask is None else (mask.reshape(-1, mask.shape[-1]), 1.0 / (1.0 - ctx.dropout))
            grads[0] = _input_grad(flat, weight, d_hidden, lora_a, keep, ctx.x_dtype).view(
                *grad.shape[:-1], weight.shape[1])
        return tuple(grads)


def _input_grad(flat: torch.Tensor, weight: torch.Tensor, d_hidden: torch.Tensor, lora_a: torch.Tensor,
                keep: tuple[torch.Tensor, float] | None, dtype: torch.dtype) -> torch.Tensor:
    """dL/dx = dL/dy @ dequant(W) + (dL/d(hidden) @ A) * mask / (1 - p), summed in fp32 and rounded to x's
    `dtype` once, GRAD_ROWS token rows at a time so that the fp32 sums stay small. `keep`: the dropout mask
    and its scale, or None without dropout. The weight is dequantised whole, as in forward."""
    w = dequantize(weight, flat.dtype)
    grad_x = torch.empty(flat.shape[0], weight.shape[1], dtype=dtype, device=flat.device)
    for start in range(0, flat.shape[0], GRAD_ROWS):
        rows = slice(start, start + GRAD_ROWS)
        total = _mm_fp32(flat[rows], w)
        part = _mm_fp32(d_hidden[rows], lora_a)
        if keep is not None:  # nn.Dropout's backward: the kept values scaled by 1 / (1 - p)
            part.mul_(keep[0][rows]).mul_(keep[1])
        total += part
        del part
        grad_x[rows] = total
        del total
    return grad_x


class _QuantizedExperts(torch.autograd.Function):
    """Rows sorted by expert through each expert's frozen quantised weight: the stack [experts x out, in]
    stored as one quantised matrix, dequantised whole for the grouped matmul and again in backward, which
    needs only the rows' gradient (the base is frozen), so no 16-bit copy of the experts outlives its matmul.
    `group_mm(x, w, offsets, groups)` is the model's grouped matrix multiply (`models.moe.grouped_mm`)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, experts: int, offsets: torch.Tensor,  # noqa: D102
                groups: torch.Tensor, group_mm: Any) -> torch.Tensor:
        w = dequantize(weight, rows.dtype)
        ctx.experts, ctx.group_mm = experts, group_mm
        ctx.save_for_backward(weight, offsets, groups)
        return group_mm(rows, w.view(experts, -1, w.shape[-1]).transpose(1, 2), offsets, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        weight, offsets, groups = ctx.saved_tensors
        w = dequantize(weight, grad.dtype)
        return ctx.group_mm(grad.contiguous(), w.view(ctx.experts, -1, w.shape[-1]), offsets, groups), \
            None, None, None, None, None


def quantized_experts(rows: torch.Tensor, weight: torch.Tensor, experts: int, offsets: torch.Tensor,
                      groups: torch.Tensor, group_mm: Any) -> torch.Tensor:
    """Rows sorted by expert times each expert's frozen quantised weight (`weight`: the experts' stack
    [experts, out, in] quantised as one [experts x out, in] matrix): [rows, out]."""
    return _QuantizedExperts.apply(rows, weight, experts, offsets, groups, group_mm)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float, dropout: float) -> torch.Tensor:
    """A LoRA layer on a quantised base weight (the Parameter itself: saved for backward as a weight, not
    an activation): x @ dequant(W)^T + bias + scaling * (dropout(x) @ A^T) @ B^T, `dropout` the
    probability in force (0 in eval mode). Its input gradient is summed in fp32 and rounded once."""
    return _QuantizedLoRALinear.apply(x, weight, bias, lora_a, lora_b, scaling, dropout)
