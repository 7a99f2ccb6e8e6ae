"""Tensor parallelism (Megatron-style) with optional sequence parallelism, on DTensor.

`apply_tensor_parallel(model, tp_mesh)` rewrites a `shardwise.models.Transformer` in place, from
outside and without touching model code (torchtitan's recipe), so that each rank of `tp_mesh` holds
1/tp of every projection:

- q/k/v, w1, w3 are column-parallel (each rank computes its own heads / MLP columns), wo and w2 are
  row-parallel (partial sums reduced across the TP group). The attention reshapes with
  `view(B, T, -1, head_dim)`, so a rank sees num_heads/tp query heads and num_kv_heads/tp kv heads;
  its query heads use exactly its kv heads (GQA groups never straddle ranks when tp divides both).
- The token (and learned position) embeddings are row-parallel over the vocabulary; the output
  projection is column-parallel over the vocabulary, and with `loss_parallel` its logits stay
  sharded on the vocabulary dimension (a DTensor): the loss never gathers [B, T, vocab].
- With sequence parallelism the activations between blocks are sharded on the sequence dimension
  (dimension 1), norms and dropouts run on 1/tp of the tokens, and attention / feed-forward gather
  the sequence on entry (all-gather) and reduce-scatter it on exit. Without it the activations are
  replicated and the norms compute on the full sequence.

Every parameter becomes a DTensor (norm weights as Replicate ones even without sequence
parallelism), so foreach optimizers and `clip_grad_norm_(..., foreach=True)` see one kind of tensor.

Trainer integration (see `shardwise.loss.token_loss_sum`, `loss_context`, `full_value`):
    apply_tensor_parallel(model, meshes["tp"])            # after the pipeline split, before recompute
    loss = token_loss_sum(logits, labels) / n_tokens      # plain scalar; backward anywhere
    grad_norm = full_value(clip_grad_norm_(params, max_norm, foreach=True))

On a materialized model, TP rank 0's values are what every rank ends up with (sharded weights are
scattered from it, replicated ones broadcast), so the ranks need not agree beforehand. On a meta-device
model only the structure is sharded: allocate each rank's shards afterwards (`to_empty`) and fill
them (loading pretrained weights slice by slice). LoRA adapters (`shardwise.peft.lora.LoRALinear`)
are sharded with their base projection: column-parallel bases shard lora_B's rows and replicate
lora_A; row-parallel bases shard lora_A's columns and replicate lora_B. Tied embeddings (GPT-2) stay
tied: the embedding (row-parallel) and the output projection (column-parallel) both shard the
[vocab, hidden] matrix on dim 0, so one DTensor serves both, and its gradient collects both uses.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..errors import ConfigError
from ..models.latent_attention import LatentAttention
from ..models.moe import MoE
from .dtensors import full_value

__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "full_value",
    "full_grads",
    "loss_context",
]


# --- validation ----------------------------------------------------------------------------------


def check_tensor_parallel(cfg: Any, tp: int) -> None:
    """Refuse a model config that `tp` ranks cannot split: tp must divide the query heads, the kv
    heads (a GQA group must live on one rank) and the MLP width. The vocabulary may be uneven."""
    if tp <= 1:
        return
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    if heads % tp or kv_heads % tp:
        valid = [t for t in range(1, kv_heads + 1) if heads % t == 0 and kv_heads % t == 0]
        raise ConfigError(
            f"tensor_parallel {tp} must divide both num_heads ({heads}) and num_kv_heads ({kv_heads}); "
            f"degrees that fit this model: {', '.join(map(str, valid))}"
        )
    width = cfg.intermediate_size
    if width is not None and width % tp:
        # The column-parallel MLP output is handed on as a local tensor, which DTensor can only
        # re-wrap correctly when every rank holds the same number of columns.
        raise ConfigError(
            f"tensor_parallel {tp} must divide the MLP width intermediate_size ({width}); "
            f"use an intermediate_size that is a multiple of {tp}"
        )


# --- parallel styles this file adds ---------------------------------------------------------------


def _broadcast_replicate(_name: str, module: nn.Module, mesh: Any) -> None:
    """Make every direct parameter of `module` a Replicate DTensor, broadcast from TP rank 0."""
    for p_name, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=0)
        module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))


class _SequenceParallelNorm(SequenceParallel):
    """torch's SequenceParallel, but the replicated weights are broadcast from rank 0 instead of
    assumed equal (torch assumes ones-init; we may run after a checkpoint load or custom init)."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:  # noqa: D102
        _broadcast_replicate(name, module, device_mesh)


class _ReplicateParallel(ParallelStyle):
    """Replicated parameters and computation on plain tensors that are replicated across the TP group
    (the norms without sequence parallelism): inputs become Replicate DTensors, outputs local tensors.
    Only so that the weights are DTensors like every other parameter (foreach ops refuse a mix)."""

    @staticmethod
    def _input_fn(_mod: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
            for x in inputs
        )

    @staticmethod
    def _output_fn(_mod: nn.Module, out: Any, _mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh, _broadcast_replicate, self._input_fn, self._output_fn)


class _HeadNorm(_ReplicateParallel):
    """A norm over each head's dims (Qwen3's and Gemma 3's q/k norms): its input holds this rank's heads
    (dim 2 of [B, T, heads, head_dim]), so it enters as Shard(2) and the replicated weight's gradient, a sum
    over every head, arrives Partial and is all-reduced (`_reduce_partial_grads`)."""

    @staticmethod
    def _input_fn(_mod: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [Shard(2)], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
            for x in inputs
        )


class _SumTailGrad(torch.autograd.Function):
    """Identity forward; backward sums the last `tail` columns of the gradient over the tensor-parallel group
    and leaves the rest. Latent attention's key/value down projection (replicated) gives the latent, whose
    gradient comes back whole through the column-parallel up projection, and the one rotary key all heads
    share, whose gradient each rank has only for its own heads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tail: int, group: Any) -> torch.Tensor:  # noqa: D102
        ctx.tail, ctx.group = tail, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        grad = grad.clone()
        tail = grad[..., -ctx.tail:].contiguous()
        torch.distributed.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.tail:] = tail
        return grad, None, None


class _SharedKeyProjection(_ReplicateParallel):
    """Latent attention's `wkv_a`, computed whole on every rank: the latent and the shared rotary key; the
    rotary key's gradient (the last `rope_dim` columns) summed over the group (`_SumTailGrad`)."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, tail = device_mesh.get_group(), self.rope_dim

        def output_fn(_mod: nn.Module, out: Any, _mesh: Any) -> Any:
            return _SumTailGrad.apply(out.to_local() if isinstance(out, DTensor) else out, tail, group)

        return distribute_module(module, device_mesh, _broadcast_replicate, self._input_fn, output_fn)


def _latent_attention_plan(attn: nn.Module) -> dict[str, ParallelStyle]:
    """Multi-head latent attention (DeepSeek-V3) under tensor parallelism, as torchtitan splits it: the
    query and key/value down projections and their norms replicated (small, computed whole on every rank),
    the up projections column-parallel by head, the output row-parallel."""
    plan: dict[str, ParallelStyle] = {"attention.wkv_a": _SharedKeyProjection(attn.rope_dim),
                                      "attention.kv_norm": _ReplicateParallel(),
                                      "attention.wkv_b": _colwise(attn.wkv_b)}
    if attn.wq is not None:
        plan["attention.wq"] = _colwise(attn.wq)
    else:
        plan.update({"attention.wq_a": _ReplicateParallel(), "attention.q_norm": _ReplicateParallel(),
                     "attention.wq_b": _colwise(attn.wq_b)})
    return plan


def _place_direct_params(module: nn.Module, mesh: Any, placements: dict[str, Any]) -> None:
    """Distribute `module`'s direct parameters by name (from TP rank 0), keeping requires_grad; a
    parameter that is already a DTensor (a LoRA A shared by GPT-2's q, k and v) is left as it is."""
    for p_name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor) or p_name not in placements:
            continue
        dt = distribute_tensor(param.data, mesh, [placements[p_name]], src_data_rank=0)
        module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))


class _LoraColwise(ColwiseParallel):
    """A column-parallel projection with a LoRA adapter (shardwise.peft.lora.LoRALinear): the base
    weight and lora_B are sharded on their output rows, lora_A is replicated. Its input is replicated,
    so every rank computes the whole low-rank x A^T and its own columns of (x A^T) B^T."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:  # noqa: D102
        if name == "":
            _place_direct_params(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        elif name == "lora_A":
            _place_direct_params(module, device_mesh, {"weight": Replicate()})
        elif name == "lora_B":
            _place_direct_params(module, device_mesh, {"weight": Shard(0)})


class _LoraRowwise(RowwiseParallel):
    """A row-parallel projection with a LoRA adapter: the base weight and lora_A are sharded on their
    input columns (each rank's x A^T is a partial sum, reduced with the base output), lora_B is
    replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:  # noqa: D102
        if name == "":
            _place_direct_params(module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
        elif name == "lora_A":
            _place_direct_params(module, device_mesh, {"weight": Shard(1)})
        elif name == "lora_B":
            _place_direct_params(module, device_mesh, {"weight": Replicate()})


def _has_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _colwise(module: nn.Module) -> ParallelStyle:
    return _LoraColwise() if _has_lora(module) else ColwiseParallel()


def _rowwise(module: nn.Module, output_layouts: Any) -> ParallelStyle:
    return _LoraRowwise(output_layouts=output_layouts) if _has_lora(module) else RowwiseParallel(
        output_layouts=output_layouts)


# --- the plan ----------------------------------------------------------------------------------


def _positional_arity(module: nn.Module) -> int:
    """How many positional arguments `module.forward` takes (PrepareModuleInput wants one layout each)."""
    return len(inspect.signature(module.forward).parameters)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: Any, sequence_parallel: bool = True, loss_parallel: bool = True
) -> None:
    """Shard `model` (a shardwise Transformer, possibly one pipeline stage of it) over `tp_mesh`, in place.

    `sequence_parallel`: activations between blocks sharded on the sequence (needs the sequence
    length divisible by tp; checked on every forward). `loss_parallel`: the logits are returned as a
    DTensor sharded on the vocabulary; compute the loss with `shardwise.loss.token_loss_sum` (or the plain
    cross-entropy inside `loss_context(True)`, backward included). Without it the logits are a plain
    replicated tensor. Tied embeddings stay tied (both use the same vocabulary-sharded DTensor).
    Dropout: with sequence parallelism every dropout acts on sharded activations, and each TP rank
    draws its masks from its own RNG stream (the shared stream is untouched outside the forward).
    """
    if getattr(model, "_shardwise_tp", None) is not None:
        raise ValueError("tensor parallel is already applied to this model")
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D TP mesh (meshes['tp']), got a {tp_mesh.ndim}-D mesh")
    tp = tp_mesh.size()
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        check_tensor_parallel(cfg, tp)
    if tp == 1:
        return
    sp = sequence_parallel
    tok = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    tied = tok is not None and output is not None and output.weight is tok.weight

    # Activations leave the embeddings sequence-sharded (SP) or replicated; the final norm hands
    # them to the output projection, which gathers the sequence and shards the vocabulary.
    act = Shard(1) if sp else Replicate()
    norm_style = (lambda: _SequenceParallelNorm()) if sp else (lambda: _ReplicateParallel())
    root_plan: dict[str, ParallelStyle] = {}
    if tok is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if getattr(model, "pos_embeddings", None) is not None:
        # position_ids [1 or B, T] arrive whole; the output is sharded like the token embeddings.
        root_plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if getattr(model, "norm", None) is not None:
        root_plan["norm"] = norm_style()
    if output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if tied:
        # parallelize_module gave each module its own DTensor copy; share the embedding's again
        # (both are sharded on dim 0 = vocabulary, so one tensor serves both uses).
        output.weight = tok.weight

    for block in model.layers.values():
        # Applied after recompute by mistake? Plan the wrapped block (its hooks work either way).
        block = getattr(block, "_checkpoint_wrapped_module", block)
        attn, ffn = block.attention, block.feed_forward
        plan: dict[str, ParallelStyle] = {"attention_norm": norm_style(), "ffn_norm": norm_style(),
                                          "attention.wo": _rowwise(attn.wo, act)}
        if isinstance(attn, LatentAttention):
            plan.update(_latent_attention_plan(attn))
        else:
            plan.update({"attention.wq": _colwise(attn.wq), "attention.wk": _colwise(attn.wk),
                         "attention.wv": _colwise(attn.wv)})
        moe = isinstance(ffn, MoE)
        if moe:
            plan.update(_moe_plan(ffn, tp_mesh))
        else:
            plan.update({"feed_forward.w1": _colwise(ffn.w1), "feed_forward.w2": _rowwise(ffn.w2, act)})
            if ffn.w3 is not None:
                plan["feed_forward.w3"] = _colwise(ffn.w3)
        if attn.q_norm is not None and not isinstance(attn, LatentAttention):
            plan.update({"attention.q_norm": _HeadNorm(), "attention.k_norm": _HeadNorm()})
        if block.attention_post_norm is not None:  # GLM-4's and Gemma 3's norms on the outputs, before the adds
            # (their outputs join the residual stream, which is a local tensor between blocks)
            post = (lambda: _SequenceParallelNorm(use_local_output=True)) if sp else norm_style
            plan.update({"attention_post_norm": post(), "ffn_post_norm": post()})
        if sp:
            # Attention.forward(x, rope, mask, is_causal, kv_cache): only x is sequence-sharded; the
            # root builds rope (from position_ids) and the mask (from document_ids) unsharded, and
            # they pass untouched (layout None), matching q/k/v, which hold the whole sequence.
            rest = (None,) * (_positional_arity(block.attention) - 1)
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1),) + rest, desired_input_layouts=(Replicate(),) + rest
            )
            if moe:  # the whole sequence in (as local tensors), this rank's part of it out
                plan["feed_forward"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
            else:
                plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)

    leftover = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if leftover:
        raise RuntimeError(
            f"tensor parallel left these parameters as plain tensors: {', '.join(leftover[:8])}; "
            "the TP plan in shardwise/parallel/tensor.py does not know their module"
        )

    model.register_forward_pre_hook(_reduce_partial_grads)
    if sp and tok is not None:
        model.register_forward_pre_hook(_sequence_check(tp), with_kwargs=True)
    elif sp:
        # A later pipeline stage receives hidden states already split on the sequence, so the
        # model's default positions (0..T_local-1) would be wrong: supply the full sequence's.
        model.register_forward_pre_hook(_full_positions(tp), with_kwargs=True)
    if sp and _has_dropout(model):
        _install_rank_rng(model, tp_mesh)
    model._shardwise_tp = {"tp": tp, "sequence_parallel": sp, "loss_parallel": loss_parallel}


def _moe_plan(moe: nn.Module, tp_mesh: Any) -> dict[str, ParallelStyle]:
    """A mixture-of-experts block under tensor parallelism: every rank of the group routes the same tokens
    and runs the same experts (the router and, without expert parallelism, the experts replicated over the
    group; expert parallelism's experts are spread over the data-parallel ranks already); the shared experts
    are split as a dense MLP, their output summed over the group."""
    plan: dict[str, ParallelStyle] = {"feed_forward.router.gate": _ReplicateParallel()}
    if not any(isinstance(w, DTensor) for w in moe.experts.parameters()):  # no expert parallelism
        for name, _ in list(moe.experts.named_parameters()):  # the weights and any LoRA adapters on them
            owner, _, leaf = name.rpartition(".")
            _broadcast_replicate_param(moe.experts.get_submodule(owner), leaf, tp_mesh)
    if moe.shared is not None:
        plan.update({"feed_forward.shared.w1": _colwise(moe.shared.w1), "feed_forward.shared.w3":
                     _colwise(moe.shared.w3), "feed_forward.shared.w2": _rowwise(moe.shared.w2, Replicate())})
    return plan


def _broadcast_replicate_param(module: nn.Module, name: str, mesh: Any) -> None:
    """`module.name` as a Replicate DTensor over `mesh`, broadcast from rank 0 (its forward is not hooked:
    GroupedExperts multiplies with the local tensor, and each rank computes the same gradient)."""
    param = getattr(module, name)
    dt = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=0)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _replicate_partial_grad(grad: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's gradient, all-reduced when autograd leaves it a Partial sum."""
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def _reduce_partial_grads(model: nn.Module, _args: tuple) -> None:
    """Forward pre-hook: each replicated parameter's gradient is all-reduced in backward when it arrives
    as a Partial sum (`_replicate_partial_grad`).

    Under sequence parallelism a replicated weight applied to sequence-sharded activations (the norms'
    weights and biases) gets a Partial(sum) gradient. torch 2.11 silently drops in-place foreach ops on
    such a tensor: `torch._foreach_mul_` (gradient clipping, fp16 unscaling) is registered there as
    non-linear (`_ops/_pointwise_ops.py`, `for_each_ops`), so the dispatcher scales an all-reduced
    temporary and writes nothing back, and those gradients went unclipped. A Replicate gradient is scaled
    in place on every version, and costs fewer collectives than a Partial one, which torch all-reduces
    again in each foreach op of the norm, the clipping and the optimizer. The hooks are registered at
    forward because allocating a meta model (`to_empty`) replaces the parameters; each parameter looked
    at is marked, so a later forward passes over it. FSDP2's parameters (2-D placements) reduce their
    gradients themselves."""
    for p in model.parameters():
        if getattr(p, "_shardwise_reduces_partial_grad", False):  # after the first forward: every parameter
            continue
        if p.requires_grad and isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements):
            p.register_hook(_replicate_partial_grad)
        p._shardwise_reduces_partial_grad = True  # looked at: nothing to do for it again


def _sequence_check(tp: int):  # noqa: ANN202 - a forward pre-hook
    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        if tokens is not None and tokens.dim() >= 2 and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence parallel splits the sequence over {tp} ranks, but it has {tokens.shape[1]} tokens; "
                f"use a sequence length divisible by {tp} (data.seq_len) or turn sequence_parallel off"
            )

    return hook


def _full_positions(tp: int):  # noqa: ANN202 - a forward pre-hook
    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        h = args[0] if args else kwargs.get("tokens")
        if h is None or kwargs.get("position_ids") is not None or kwargs.get("kv_cache") is not None or len(args) > 1:
            return None
        positions = torch.arange(h.shape[1] * tp, device=h.device).unsqueeze(0)
        return args, {**kwargs, "position_ids": positions}

    return hook


def _has_dropout(model: nn.Module) -> bool:
    cfg_p = getattr(getattr(model, "cfg", None), "dropout", 0.0) or 0.0
    return cfg_p > 0 or any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


class RankRNG:
    """The random stream of one tensor-parallel rank, for the model's training forward: sharded
    activations (sequence parallel) get independent dropout masks; with the shared stream rank r's
    shard would get rank 0's mask. Every rank derives its stream from a base both draw alike, offset
    by its TP coordinate. Backward needs nothing: dropout saves its mask, and recompute restores the
    RNG state it saved. `state()` / `set_state()` / `reseed()` let checkpoints carry it."""

    def __init__(self, device_type: str, tp_rank: int, base: int) -> None:
        self.device_type, self.tp_rank = device_type, tp_rank
        self._device = torch.get_device_module(device_type) if device_type != "cpu" else None
        self._shared: Optional[torch.Tensor] = None
        self.reseed(base)

    def reseed(self, base: int) -> None:
        """Start this rank's stream from `base` (the same on every rank of the group)."""
        self._own = torch.Generator(device=self.device_type).manual_seed(base + 7919 * (self.tp_rank + 1)).get_state()

    def state(self) -> torch.Tensor:
        """The stream's state (a uint8 tensor)."""
        return self._own.clone()

    def set_state(self, state: torch.Tensor) -> None:
        """Continue the stream from a saved `state()`."""
        self._own = state.clone()

    def _get(self) -> torch.Tensor:
        return self._device.get_rng_state() if self._device is not None else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self._device is not None:
            self._device.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def enter(self, mod: nn.Module, _args: tuple) -> None:
        """Forward pre-hook: switch the global generator to this rank's stream while training."""
        if mod.training:
            self._shared = self._get()
            self._set(self._own)

    def leave(self, mod: nn.Module, _args: tuple, _out: Any) -> None:
        """Forward hook: keep where this rank's stream got to and give the shared stream back."""
        if mod.training and self._shared is not None:
            self._own = self._get()
            self._set(self._shared)
            self._shared = None


def _install_rank_rng(model: nn.Module, tp_mesh: Any) -> None:
    """Run the training forward on `RankRNG` of this TP rank (see `rank_rng`)."""
    base = int(torch.randint(0, 2**62, (1,)).item())  # the same draw on every rank keeps the shared streams in step
    rng = RankRNG(tp_mesh.device_type, tp_mesh.get_local_rank(), base)
    model.register_forward_pre_hook(rng.enter)
    model.register_forward_hook(rng.leave)
    model._shardwise_rank_rng = rng


def rank_rng(model: nn.Module) -> Optional[RankRNG]:
    """The tensor-parallel random stream installed on a model part (sequence parallel with dropout)."""
    return getattr(model, "_shardwise_rank_rng", None)


# --- loss ------------------------------------------------------------------------------------------


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """torch's `loss_parallel()` when the logits are vocabulary-sharded, else a no-op. Inside it the
    trainer's plain `F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
    ignore_index=-100, reduction="sum")` works on the sharded logits; the `backward()` of that loss
    must run inside the same context, and the loss is a (replicated) DTensor: `full_value(loss)`
    before mixing it with plain tensors. `shardwise.loss.token_loss_sum` needs none of that."""
    return loss_parallel() if enabled else contextlib.nullcontext()


# --- helpers for the trainer and tests -------------------------------------------------------------


def full_grads(model: nn.Module) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """(name, full gradient) for every parameter, gathering DTensor gradients (collective, in
    parameter order on every rank)."""
    for name, p in model.named_parameters():
        yield name, None if p.grad is None else full_value(p.grad)
