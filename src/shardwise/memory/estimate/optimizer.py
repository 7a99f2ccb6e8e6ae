"""The optimizer on a rank: the bytes of its state (fp32 or bf16 moments, torchao's and bitsandbytes'
8-bit ones), what the update allocates beyond weights, gradients and state (per kernel, and the gradient
norm's temporary), ZeRO-1's all-gather of the updated parts, the optimizer phase's total; the optimizer
in backward (per block: the update being applied and its undo copies) and the offload_optimizer engines
(stream: the state streamed through the device; cpu: each gradient on its way to the host)."""

from __future__ import annotations

import math
from typing import Any, Iterable

from ...config.schema import OPTIMIZER_CHUNK_ELEMENTS
from ...parallel.data_parallel import NORM_PIECE, zero1_buckets, zero1_split
from ..precision import ROUND_PIECE
from .layout import Layout, Precision
from .parameters import Param, numel, zero1_part

# torchao's 8-bit AdamW on CUDA/NPU, compiled: fp32 temporaries of the tensor updated (estimated; see _update_temp)
TORCHAO_COMPILED_TEMPORARIES = 2


def _zero1_gather_elements(trainable: list[Param], local: dict[str, tuple[int, ...]], lay: "Layout") -> int:
    """Elements of the largest bucket one rank sends in ZeRO-1's all-gather of updated parameters
    (`zero1_buckets` over the split tensors in the optimizer's order: matrices, then vectors)."""
    ordered = [p for p in trainable if len(p.shape) >= 2] + [p for p in trainable if len(p.shape) < 2]
    taken = {p.name: [p.tp_dim] if lay.tp > 1 and p.tp_dim is not None else [] for p in ordered}
    shards = [zero1_part(p, local[p.name], lay) for p in ordered
              if zero1_split(local[p.name], taken[p.name], lay.dp)[0] is not None]
    buckets = zero1_buckets(shards, lay.dp)
    return max((sum((end - start) * shards[i][1] for i, start, end in b) for b in buckets), default=0)


def state_element_bytes(cfg: Any, prec: Precision) -> int:
    """Bytes of one element of an optimizer moment: train.optimizer_state_dtype bf16 makes them 2."""
    return 2 if cfg.train.optimizer_state_dtype == "bf16" else prec.state


def paged_8bit_state_bytes(n: int, fallback: int) -> int:
    """One bitsandbytes 8-bit moment of a tensor of n elements: a byte per element, an fp32 absmax per block
    of 256 and its 256-entry fp32 code map; under 4096 elements (its min_8bit_size) an fp32 moment."""
    if n >= 4096:
        return n + -(-n // 256) * 4 + 256 * 4
    return n * 4


def torchao_8bit_state_bytes(n: int, fallback: int) -> int:
    """One torchao 8-bit moment of a tensor of n (local) elements: a byte per element, an fp32 scale
    per block of 256 and its 256-entry fp32 code map; under 4096 elements, or not a whole number of
    blocks, a plain moment of the parameter's dtype (`fallback` bytes)."""
    if n >= 4096 and n % 256 == 0:
        return n + n // 256 * 4 + 256 * 4
    return n * fallback


def _update_temp(cfg: Any, prec: Precision, groups: list[list[int]], device: str) -> int:
    """Bytes the update allocates beyond parameters, gradients and state, for parameter groups of
    the given (local) tensor sizes in the optimizer's order.

    foreach: AdamW's square root of the second moment for a whole group; chunked (and every kernel
    with 16-bit moments, which `build_optimizer` steps chunk by chunk): that for one chunk of at most
    OPTIMIZER_CHUNK_ELEMENTS, plus the chunk's moments read into fp32 when they are 16-bit; fused: no
    temporary of its own (measured), only those fp32 moments; torchao's 8-bit AdamW, per device kind:
    on a CPU its eager per-tensor update (what the exact CPU count sees, measured) holds six fp32
    temporaries of the tensor it updates, the largest one at the peak; on CUDA/NPU its torch.compile'd
    update fuses the element-wise work but materialises the two fp32 moments it requantises block by
    block (TORCHAO_COMPILED_TEMPORARIES: an estimate until bench/gpu_checks.sh measures it on a GPU);
    bitsandbytes' paged optimizers: none (one fused kernel, in place).
    """
    kernel = cfg.train.optimizer_kernel(device)
    work = prec.param if prec.level == "O3" else 4  # the dtype the update computes in (the stepped weights')
    if kernel == "torchao":
        largest = max((n for g in groups for n in g), default=0)
        return (6 if device == "cpu" else TORCHAO_COMPILED_TEMPORARIES) * largest * 4
    if kernel == "bitsandbytes":
        return 0  # one fused CUDA kernel updates weights and 8-bit (or fp32) moments in place
    state16 = cfg.train.optimizer_state_dtype == "bf16" and prec.level != "O3"
    if kernel == "foreach" and not state16:
        largest = max((sum(g) for g in groups), default=0)
    else:
        largest = max((_largest_chunk(g, OPTIMIZER_CHUNK_ELEMENTS) for g in groups), default=0)
    moments = 1 if cfg.train.optimizer == "sgd" else 2
    upcast = moments * largest * work if state16 else 0
    # After the update, one moment of one tensor at a time:
    rounding = _rounding_temp(max((n for g in groups for n in g), default=0)) if state16 else 0
    if cfg.train.optimizer == "sgd" or kernel == "fused":
        return upcast + rounding
    return largest * (work if state16 else prec.state) + upcast


def _rounding_temp(n: int) -> int:
    """`memory.precision.round_into` rounding n elements into bf16: three int32 temporaries of a piece."""
    return 3 * min(n, ROUND_PIECE) * 4


def norm_temp(sizes: Iterable[int]) -> int:
    """The gradient norm's temporary (`parallel.data_parallel.clip_grad_norm`): one float64 copy of a piece
    of at most NORM_PIECE elements of a gradient, the largest one."""
    return min(max(sizes, default=0), NORM_PIECE) * 8


def _largest_chunk(sizes: list[int], limit: int) -> int:
    """The largest run of consecutive sizes `train.optim.chunks` makes (at most `limit`, or one tensor)."""
    best = run = 0
    for n in sizes:
        if run and run + n > limit:
            best, run = max(best, run), 0
        run += n
    return max(best, run)


def in_backward_updates(cfg: Any, lay: Layout, prec: Precision, trainable: list[Param], stored: dict[str, int],
                         local: dict[str, tuple[int, ...]], device: str) -> dict[Any, int]:
    """The optimizer in backward, per block (and "head", "embedding"): the largest of its tensors'
    gradient being applied (with its 16-bit copy on the way into an fp32 master at O2) and that
    update's temporaries; a tied embedding matrix's gradient is held from the output projection's
    backward to the embedding's."""
    size = {p.name: stored[p.name] if lay.zero >= 2 else numel(local[p.name]) for p in trainable}
    tied = size.get("tok_embeddings.weight", 0) * prec.grad if cfg.model.tie_embeddings else 0
    out: dict[Any, int] = {}
    for p in trainable:
        where = p.layer if p.layer is not None else p.where
        n = size[p.name]
        one = n * (prec.grad + (prec.compute if prec.masters else 0)) + _update_temp(cfg, prec, [[n]], device) \
            + _undo_copies(cfg, prec, n, device)
        out[where] = max(out.get(where, 0), one + (tied if where != "head" else 0))
    return out


def _undo_copies(cfg: Any, prec: Precision, n: int, device: str) -> int:
    """The optimizer in backward with a kernel that cannot skip on the device (foreach, chunked, torchao's
    8-bit AdamW): copies of the tensor it updates and of its state, taken before the update so that a
    non-finite flag can put them back (`train.optim.OptimizerInBackward`); fused kernels skip by themselves."""
    kernel = cfg.train.optimizer_kernel(device)
    if kernel not in ("foreach", "chunked", "torchao"):
        return 0
    work = prec.param if prec.level == "O3" else 4  # the dtype of the weights the update steps
    if kernel == "torchao":
        moment = n + 4 * (n // 256) + 1024 if n >= 4096 and n % 256 == 0 else 4 * n
        return n * work + 2 * moment + 4
    t = cfg.train
    moments = 2 if t.optimizer in ("adamw", "adam") else (1 if t.beta1 else 0)
    return n * (work + moments * state_element_bytes(cfg, prec)) + (0 if t.optimizer == "sgd" else 4)


def optimizer_phase_total(cfg: Any, lay: Layout, prec: Precision, static: int, grad_bytes: int, state_elems: int,
                     trainable: list[Param], stored: dict[str, int], local: dict[str, tuple[int, ...]],
                     offload: bool, device: str = "cuda") -> int:
    """Total during clipping and the update: parameters, gradients, state and the update's temporaries
    (`_update_temp`: what the kernel train.optimizer_impl resolves to on `device` allocates)."""
    if offload:
        return static  # the update runs on the host
    if cfg.train.optimizer_in_backward:
        return static  # the updates ran in the backward: no gradient is left
    size = {p.name: stored[p.name] if lay.zero >= 2 else numel(local[p.name]) for p in trainable}
    if lay.zero == 1:  # the groups of ZeRO-1's wrapped optimizer hold this rank's parts
        size = {p.name: math.prod(zero1_part(p, local[p.name], lay)) for p in trainable}
    groups = [[size[p.name] for p in trainable if len(p.shape) >= 2],  # the weight-decay group
              [size[p.name] for p in trainable if len(p.shape) < 2]]
    total = static + grad_bytes + max(_update_temp(cfg, prec, groups, device), norm_temp(size.values()))
    if lay.zero == 1:
        # The all-gather of the updated parts, one bucket at a time: this rank's part of it and every
        # rank's as received.
        gathered = (lay.dp + 1) * _zero1_gather_elements(trainable, local, lay) * prec.param
        total = max(total, static + grad_bytes + gathered)
    return total


def streamed_updates(cfg: Any, lay: Layout, prec: Precision, trainable: list[Param], stored: dict[str, int],
                      local: dict[str, tuple[int, ...]], device: str, in_backward: bool) -> dict[Any, int]:
    """optimize.offload_optimizer stream, per block (and "head", "embedding"): the most the update of one of
    its tensors holds on the device beyond the weights: its state copied in (moments, step, fp32 master at
    O2), the next tensor's (fetched ahead), on an accelerator the one before's (its copy back may still be in
    flight), its fp32 work copies (the 16-bit gradient at O2, 16-bit moments widened); with the optimizer in
    backward also its gradient. The order is the optimizer's (matrices, then vectors, each in the model's
    order) for a step after the backward; in backward the reverse of it on the first step and the order the
    gradients arrive in (about the reverse of the model's) after it."""
    size = {p.name: min(stored[p.name] if lay.zero >= 2 else numel(local[p.name]), OPTIMIZER_CHUNK_ELEMENTS)
            for p in trainable}  # the state streams in units of at most this many elements
    state_bytes = state_element_bytes(cfg, prec)
    work = 4 if prec.masters or prec.param == 4 else prec.param  # the dtype the update runs in
    torchao = cfg.train.optimizer == "adamw_8bit"
    weights = 4 if prec.masters else prec.param

    def copied(n: int) -> int:  # what one unit of a tensor's state takes on the device
        moments = 2 * torchao_8bit_state_bytes(n, state_bytes) - (2 * 256 * 4 if n >= 4096 and n % 256 == 0 else 0) \
            if torchao else 2 * n * state_bytes  # (the code maps are on the device once, not per unit)
        return moments + 4 + (4 * n if prec.masters else 0)

    def widened(n: int) -> int:  # the fp32 copies the update makes of 16-bit gradient and moments
        if torchao:  # its fp32 work copies, and what a non-finite step would put back (weights, moments)
            # eager on a CPU: six fp32 temporaries at its peak, a seventh widening 16-bit weights (measured)
            temps = ((6 + (weights == 2)) if device == "cpu" else TORCHAO_COMPILED_TEMPORARIES) * n * 4
            return temps + n * weights + copied(n) - 4 - (4 * n if prec.masters else 0)
        # bf16 moments: widened to fp32 for the update, then rounded back with an int32 draw each
        return (n * work if prec.grad != work else 0) + (2 * n * work + _rounding_temp(n) if state_bytes != work
                                                          else 0)

    optimizer_order = [p for p in trainable if len(p.shape) >= 2] + [p for p in trainable if len(p.shape) < 2]
    orders = [optimizer_order[::-1], trainable[::-1]] if in_backward else [optimizer_order]
    out: dict[Any, int] = {}
    for order in orders:
        for k, p in enumerate(order):
            n = size[p.name]
            around = order[k + 1:k + 2] + (order[k - 1:k] if device != "cpu" and k > 0 else [])
            held = copied(n) + sum(copied(size[q.name]) for q in around) + widened(n)
            if in_backward:
                held += n * prec.grad
            where = p.layer if p.layer is not None else p.where
            out[where] = max(out.get(where, 0), held)
    return out


def gradients_in_transit(lay: Layout, prec: Precision, trainable: list[Param], stored: dict[str, int],
                          local: dict[str, tuple[int, ...]]) -> dict[Any, int]:
    """optimize.offload_optimizer on an accelerator, per block (and "head", "embedding"): its largest
    gradient, in the weights' dtype, which stays on the device until it is copied to the host."""
    out: dict[Any, int] = {}
    for p in trainable:
        where = p.layer if p.layer is not None else p.where
        n = stored[p.name] if lay.zero >= 2 else numel(local[p.name])
        out[where] = max(out.get(where, 0), n * prec.param)
    return out
