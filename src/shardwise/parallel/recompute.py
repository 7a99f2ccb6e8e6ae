"""Activation recomputation applied to a model's blocks from outside: per layer none, selective or full.

`full` recomputes a whole block in backward: the block keeps only its input. `selective` is
torchtitan's op-level policy, written for our blocks: a block keeps its input, the outputs of
attention (the fused kernel's output and log-sum-exp) and of every other matmul in call order (the
1st, 3rd, ... of q, k, v, o, gate, up, down: q, v and gate; the down projection's only where the
recompute reaches it, `selective_saved_matmuls`), and recomputes the rest (k, o, up,
the norms, RoPE, activations, element-wise ops). LoRA's low-rank matmuls are always recomputed (a
rank-r matmul is cheap, its B output as large as the base one's) and do not count in the alternation,
so LoRA saves what the plain block saves (and, on the down projection, that projection's output,
which its recompute then reaches). `selective_saved_matmuls` says which block linears a
selective block keeps the outputs of; the estimator and the step-time model read it.

`apply_recompute(model, modes)` takes one mode per block of `model.layers` (a pipeline chunk's blocks in
order): `optimize.recompute` gives them through `OptimizeConfig.layer_recompute`, with
`recompute: auto` a per-layer plan chosen by the memory estimator before the model is built.

Torch's selective checkpoint keeps the outputs its policy saves in a cache of its own, which
saved-tensor hooks never see: under activation offload (`memory.offload.ActivationOffload`) they would
stay on the device. Within `selective_outputs_through(pack, unpack)` (which that offload enters) each
selective block's kept outputs go through `pack` when its forward ends and come back through `unpack`
when its recompute starts, so they move as the tensors autograd saves do.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")
# Block linears in forward call order (models/transformer.py: attention, then the MLP: w1, act, w3, w2).
BLOCK_MATMULS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")

# The matmul ops a linear becomes under dispatch (aten.linear itself where a backend keeps it whole).
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default}
# Attention: the fused kernels' outputs; the math path's batched matmuls (dropout on CPU) likewise.
_ATTENTION = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten.bmm.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_fused_attention_overrideable"):  # the NPU's SDPA entry
    _ATTENTION.add(torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default)


def selective_saved_matmuls(gated: bool, down_reached: bool = False) -> tuple[str, ...]:
    """The block linears whose outputs a selective block keeps: the odd-numbered ones in call order,
    but the down projection's (the 7th of a gated block) only where the recompute reaches it
    (`down_output_needed`): otherwise backward never needs it, and keeping it would hold one
    [tokens, hidden] per block (under tensor parallelism the unreduced partial sum, all of the hidden
    width) for nothing."""
    order = BLOCK_MATMULS if gated else tuple(n for n in BLOCK_MATMULS if n != "w3")
    kept = order[::2]
    return kept if down_reached else tuple(n for n in kept if n != "w2")


def down_output_needed(dropout: float, lora_on_down: bool) -> bool:
    """Whether a selective block's recompute runs past the down projection: torch's checkpoint stops
    at the last tensor backward needs, which is the down projection's input unless a dropout after
    it (its mask) or a LoRA adapter on it (its low-rank matmuls) keeps something later."""
    return dropout > 0 or lora_on_down


def _rhs_shape(op: object, args: tuple) -> tuple[int, ...]:
    """(in, out) of a matmul's weight operand: mm(x, W^T), addmm(b, x, W^T), linear(x, W)."""
    if op == torch.ops.aten.linear.default:
        out_f, in_f = args[1].shape
        return (in_f, out_f)
    return tuple(args[2 if op == torch.ops.aten.addmm.default else 1].shape)


def _lora_shapes(block: nn.Module) -> set[tuple[int, ...]]:
    """(in, out) shapes of the block's LoRA matrices (global and local under tensor parallelism)."""
    shapes = set()
    for name, p in block.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            local = p.to_local() if hasattr(p, "to_local") else p
            shapes |= {(p.shape[1], p.shape[0]), (local.shape[1], local.shape[0])}
    return shapes


def every_other_matmul(lora_shapes: set[tuple[int, ...]], keep_down: bool = False) -> Callable[..., CheckpointPolicy]:
    """A fresh selective policy for one block call: save attention and the 1st, 3rd, ... matmul.

    The forward and the recompute count their matmuls separately, so both make the same choice;
    LoRA's matmuls (weights of `lora_shapes`) are recomputed and not counted.
    """
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op not in _MATMULS or _rhs_shape(op, args) in lora_shapes:
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = "recompute" if ctx.is_recompute else "forward"
        count[key] += 1
        if count[key] == len(BLOCK_MATMULS) and not keep_down:  # a gated block's down projection
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if count[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def keeps_down_output(block: nn.Module) -> bool:
    """`down_output_needed` for a block: the MLP's dropout (after the down projection), or LoRA on it."""
    ffn_dropout = getattr(getattr(block, "feed_forward", None), "dropout", None)
    dropout = ffn_dropout.p if isinstance(ffn_dropout, nn.Dropout) else 0.0
    lora_down = any(".w2.lora_" in n for n, _ in block.named_parameters())
    return down_output_needed(dropout, lora_down)


Pack = Callable[[torch.Tensor], Any]  # a tensor -> what stands for it while it is away (the tensor itself: it stays)
Unpack = Callable[[Any], torch.Tensor]

# The (pack, unpack) pairs selective blocks send their kept outputs through, the innermost last.
_output_moves: list[tuple[Pack, Unpack]] = []


@contextlib.contextmanager
def selective_outputs_through(pack: Pack, unpack: Unpack) -> Iterator[None]:
    """Within it, the outputs a selective block keeps go through `pack` when the block's forward ends (a
    pack that returns the tensor itself leaves it where it is) and come back through `unpack` when its
    recompute starts: the saved-tensor hooks' pair of steps, for what torch's cache keeps from them."""
    _output_moves.append((pack, unpack))
    try:
        yield
    finally:
        _output_moves.pop()


def _cached_tensors(storage: dict) -> list[torch.Tensor]:
    """The tensors in torch's selective-checkpoint cache of one block call: {op: {call number: outputs}}
    (a list of outputs per op in earlier torch releases), each output tensor wrapped with its version as `val`."""
    found: dict[int, torch.Tensor] = {}
    for calls in storage.values():
        for entry in calls.values() if isinstance(calls, dict) else calls:
            for leaf in pytree.tree_leaves(entry):
                val = getattr(leaf, "val", None)
                if isinstance(val, torch.Tensor):
                    found[id(val)] = val
    return list(found.values())


class _MovedOutputs:
    """One selective block call's kept outputs, sent through (pack, unpack) between its forward and its
    recompute. A cached tensor keeps its identity (the cache checks its version counter, which `.data`
    assignments leave alone): while it is away it holds no memory, and its data comes back whole when
    the recompute starts (the recompute reads all of them, as a recomputed block reads its input)."""

    def __init__(self, caching: Any, cached: Any, pack: Pack, unpack: Unpack) -> None:
        self.caching, self.cached = caching, cached
        self.pack, self.unpack = pack, unpack
        self.away: list[tuple[torch.Tensor, Any]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The block's forward under torch's caching mode; then what the cache kept goes through `pack`."""
        with self.caching:
            yield
        for t in _cached_tensors(self.caching.storage):
            packed = self.pack(t)
            if packed is not t:
                self.away.append((t, packed))
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """The kept outputs back through `unpack`, then the recompute under torch's cached mode."""
        for t, packed in self.away:
            t.data = self.unpack(packed)
        self.away = []
        with self.cached:
            yield


def _selective_contexts(lora_shapes: set[tuple[int, ...]], keep_down: bool) -> tuple[Any, Any]:
    """The checkpoint's context_fn for one call of a selective block: torch's caching and cached modes
    with `every_other_matmul`, their kept outputs moved as `selective_outputs_through` says. Not while
    torch.compile traces the block: then what the policy keeps are saved tensors of the compiled graph,
    which the saved-tensor hooks see."""
    caching, cached = create_selective_checkpoint_contexts(every_other_matmul(lora_shapes, keep_down))
    if not _output_moves or torch.compiler.is_compiling():
        return caching, cached
    moved = _MovedOutputs(caching, cached, *_output_moves[-1])
    return moved.forward(), moved.recompute()


def canonical_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes, so checkpoints do not depend on recompute."""
    return name.replace("_checkpoint_wrapped_module.", "")


def layer_modes(mode: str, count: int, every: int = 1) -> list[str]:
    """Per-block modes of one model part for a single `mode` (full: every `every`-th block, from the first)."""
    if mode == "full":
        return ["full" if k % every == 0 else "none" for k in range(count)]
    return [mode] * count


def apply_recompute(model: nn.Module, modes: str | Sequence[str], every: int = 1) -> list[str]:
    """Wrap blocks of `model.layers` for recomputation; return the names of the wrapped layers.

    `modes`: one of MODES per block in order ("none", "selective", "full"), or one mode for all
    (`every`: full recompute of every `every`-th block, starting with the first).
    """
    names = list(model.layers.keys())
    modes = layer_modes(modes, len(names), every) if isinstance(modes, str) else list(modes)
    if len(modes) != len(names):
        raise ValueError(f"{len(modes)} recompute modes for {len(names)} blocks")
    wrapped = []
    for name, mode in zip(names, modes):
        if mode not in MODES:
            raise ValueError(f"recompute mode {mode!r}: use one of {', '.join(MODES)}")
        block = model.layers[name]
        if mode == "none" or isinstance(block, CheckpointWrapper):  # a model trained before keeps its wrappers
            continue
        if mode == "selective":
            shapes, keep = _lora_shapes(block), keeps_down_output(block)
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True,
                                                    context_fn=lambda s=shapes, k=keep: _selective_contexts(s, k))
        else:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)
        wrapped.append(name)
    return wrapped
