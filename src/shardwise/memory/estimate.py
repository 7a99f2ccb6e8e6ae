"""Per-device memory of a training run, predicted from its config before anything is allocated.

`estimate_memory(cfg, devices, device)` splits the memory of the busiest device into parameters,
gradients, optimizer state (fp32 master copies included), activations (saved for backward over the
micro-batches in flight), buffers (communication buffers, logits and loss temporaries, transients of
the op at the peak) and allocator overhead, and gives the total of each phase of a step: forward,
backward, optimizer step (unscale, clipping, master copies, the update) and checkpoint save.
`estimate_all_ranks` gives one estimate per pipeline stage (the ranks of a stage are alike).

The counts follow what shardwise itself allocates, not a paper's formula:
- activations: what autograd saves in our Transformer block (RMSNorm upcasts to fp32 and saves that
  copy, SwiGLU saves both branches, SDPA's fused kernel saves q, k, v, the output and the log-sum-exp,
  GQA saves the repeated k and v, an explicit document mask becomes a float [B, 1, T, T] per layer),
  per micro-batch and layer, scaled by the tensor-parallel split (heads, MLP width, vocabulary) and
  the sequence split of sequence parallelism (norms, residuals) and of context parallelism (every
  per-token tensor holds T / cp tokens; attention's q, k, v and output as many bytes, head-split over
  the whole sequence; an explicit document mask stays [B, 1, T, T]); recompute (per layer, as
  `optimize.layer_recompute` says) keeps each wrapped block's input (full) or its input plus the
  outputs of attention and of q, v and gate (selective, `parallel.recompute`; the down projection's
  too where a dropout or adapter after it takes the recompute that far), and adds one block's
  activations back during its backward;
- the head: logits [B, T, V] stay referenced through backward, cross-entropy saves an fp32
  log-softmax, and its backward holds two more fp32 [B, T, V] buffers at once (the largest transient
  of small models and of large vocabularies);
- ZeRO (FSDP2 for stages 2/3): sharded parameters, gradients and state (padded to even shards),
  the all-gathered blocks a stage keeps (ZeRO-2: all of them until their backward; ZeRO-3: about two
  at a time), reduce-scatter buffers, full-size unsharded gradients under accumulation only when they
  are reduced once per step (`parallel.reduce_gradients`); ZeRO-1's state for 1/dp of every tensor
  and its bucketed all-gather, as its optimizer splits them;
  CPU offload moves shards, gradients and state to host memory (`host`);
- float8 (`optimize.float8`): what autograd saves is unchanged (torchao saves the bf16 inputs); ZeRO 2/3
  gather the converted linears' weights in 1 byte; the casts add a transient (`_float8_transient`);
- context parallelism (`parallel.context`): gradients reduced and ZeRO sharded over dp x cp ranks, and
  each layer's all-to-all buffers around attention (`_exchange_bytes`), held in forward and backward;
- pipelines: the schedule's own order of forwards and backwards (torch's pipeline_order) gives the
  micro-batches in flight on each rank (zero-bubble keeps a micro-batch until its weight gradient).

What is counted is the same quantity `memory.measure.MemoryTracker` measures: bytes of tensor
storages. On CPU that is the whole estimate (overhead 0). On CUDA/NPU `overhead` adds
`ALLOCATOR_OVERHEAD` of the tensor peak for the caching allocator's rounding and fragmentation
(`max_memory_reserved` above `max_memory_allocated`); the CUDA context itself (about 0.5 GiB, outside
the allocator) is not included.

`run_flops(cfg)` gives the run's training FLOPs per token from the same parameter table (what trains
under LoRA / freezing decides what the backward computes): the trainer's MFU and the planner's step
time both count with it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable, Optional

from ..builder import build_adapted_model
from ..config import FreezeConfig, LoraConfig
from ..config.schema import OPTIMIZER_CHUNK_ELEMENTS, PAGED_OPTIMIZERS
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.flops import TrainingFlops, training_flops
from ..parallel.context import check_context_parallel
from ..parallel.data_parallel import NORM_PIECE, one_process_fsdp_settings, zero1_buckets, zero1_split
from ..parallel.float8 import converts, float8_all_gather, float8_on
from ..parallel.pipeline import check_pipeline, schedule_class, schedule_style, stage_indices, stage_rank
from ..parallel.recompute import down_output_needed, selective_saved_matmuls
from ..parallel.tensor import check_tensor_parallel
from ..peft.quantize import dequantized_transient, quantized_bytes
from ..units import gib
from .precision import ROUND_PIECE

PHASES = ("forward", "backward", "optimizer", "checkpoint")
# torchao's 8-bit AdamW on CUDA/NPU, compiled: fp32 temporaries of the tensor updated (estimated; see _update_temp)
TORCHAO_COMPILED_TEMPORARIES = 2
# Caching-allocator reserve above the tensor bytes on CUDA/NPU (block rounding, fragmentation): a
# documented allowance, as a fraction of the tensor peak. 0 on CPU, where tensors are counted exactly.
ALLOCATOR_OVERHEAD = 0.10
_MASK_BYTES = {"cpu": 4, "cuda": 1, "npu": 1}  # a dropout mask: same dtype as the input on CPU, bool elsewhere


@dataclass
class MemoryEstimate:
    """Bytes for one device (the busiest of its kind); phases are totals of the device at their peak."""

    params: int
    grads: int
    optimizer: int  # includes fp32 master copies
    activations: int  # at the peak: saved for backward over the in-flight micro-batches
    buffers: int  # at the peak: communication buffers, logits/loss temporaries, transients
    overhead: int  # allocator rounding/fragmentation (CUDA/NPU); 0 on CPU
    peak: int  # the largest phase total
    phases: dict[str, int]  # "forward", "backward", "optimizer", "checkpoint" -> total bytes
    detail: dict[str, Any] = field(default_factory=dict)
    host: int = 0  # bytes kept in host memory by CPU offload at most (not on an accelerator's figures)
    host_phases: dict[str, int] = field(default_factory=dict)  # host bytes by phase (the CPU's own: see below)

    @property
    def peak_phase(self) -> str:
        """The phase with the largest total."""
        return max(self.phases, key=self.phases.get)

    def table(self) -> str:
        """A human-readable breakdown in GiB."""
        d = self.detail
        rows = [
            ("parameters", self.params), ("gradients", self.grads),
            ("optimizer state (+ fp32 masters)", self.optimizer),
            (f"activations ({d.get('in_flight', 1)} micro-batch(es) in flight)", self.activations),
            ("buffers (comm, logits/loss, transients)", self.buffers), ("allocator overhead", self.overhead),
        ]
        width = max(len(r[0]) for r in rows) + 2
        where = d.get("rank_role", "")
        lines = [f"memory per device{f' ({where})' if where else ''}, at the {self.peak_phase} peak:"]
        lines += [f"  {name:<{width}}{gib(n, 3):>10}" for name, n in rows]
        lines.append(f"  {'peak':<{width}}{gib(self.peak, 3):>10}")
        lines.append("  by phase: " + ", ".join(f"{p} {gib(self.phases[p], 3)}" for p in PHASES))
        per_layer = d.get("layer_activation_bytes")
        if per_layer:
            lines.append(f"  activations per layer and micro-batch: {gib(per_layer, 3)} "
                         f"(no recompute: {gib(d['layer_activation_bytes_no_recompute'], 3)}, "
                         f"full recompute: {gib(d['layer_activation_bytes_full_recompute'], 3)}); "
                         f"{d.get('layers_on_rank')} layers on this device")
        cp = d.get("layout", {}).get("cp", 1)
        if cp > 1:
            lines.append(f"  context parallel {cp}: {d['layout']['seq'] // cp} of every {d['layout']['seq']} tokens on "
                         f"this device; all-to-all buffers around attention "
                         f"{gib(d.get('context_parallel_exchange_bytes', 0), 3)}")
        if d.get("approximate"):
            lines.append(f"  approximate: {d['approximate']}")
        if self.host:
            by = ", ".join(f"{p} {gib(self.host_phases[p], 3)}" for p in PHASES if p in self.host_phases)
            staged = d.get("async_save_host_bytes", 0)
            what = "CPU offload" + (f" and the async save's copy, {gib(staged, 3)}" if staged else "")
            lines.append(f"  in host memory ({what}): {gib(self.host, 3)}" + (f" (by phase: {by})" if by else ""))
            if d.get("device") == "cpu":
                lines.append("  (a CPU run: host memory is the device's, so the figures above include it)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "overhead": self.overhead,
                "peak": self.peak, "peak_phase": self.peak_phase, "phases": dict(self.phases), "host": self.host,
                "host_phases": dict(self.host_phases),
                "detail": self.detail}


# --- the layout --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    # dp and dp_shard count the ranks gradients are reduced and ZeRO shards over: with context parallelism
    # data parallel x cp (`cp` of them hold the chunks of the same samples; `seq` is the whole sequence).
    """Degrees and batch shape of a run, resolved against a device count."""

    dp: int
    dp_shard: int
    tp: int
    pp: int
    virtual_stages: int
    zero: int
    sequence_parallel: bool
    micro_batch: int  # samples per micro-batch
    seq: int
    accumulation: int  # micro-batches per optimizer step on a data-parallel rank
    micro_batch_num: int  # pipeline micro-batches per schedule step
    schedule: str
    stage_counts: tuple[int, ...]  # layers per pipeline stage
    offload: bool
    reduce_every: bool  # ZeRO 2/3: gradients reduce-scattered every micro-batch (parallel.reduce_gradients)
    one_process_fsdp: bool = False  # offload_params on one accelerator: FSDP2 (ZeRO-3) on a one-process group
    cp: int = 1  # context parallel: each sequence split over this many ranks


def _layout(cfg: Any, devices: Optional[int], device: str = "cuda") -> _Layout:
    """Resolve and check the parallel layout the way the trainer will on devices of kind `device`."""
    p, m = cfg.parallel, cfg.model
    world = p.world_size(devices)
    if devices is not None and world != devices:
        raise ConfigError(
            f"the layout needs data_parallel {p.dp_degree(devices)} x tensor_parallel {p.tensor_parallel} x "
            f"pipeline_parallel {p.pipeline_parallel} x context_parallel {p.context_parallel} = {world} devices, "
            f"not {devices}; set "
            "parallel.data_parallel: -1 to use every device, or change the degrees")
    dp = p.dp_degree(devices)
    if dp % p.data_parallel_replicate:
        raise ConfigError(f"parallel.data_parallel_replicate {p.data_parallel_replicate} must divide the "
                          f"data-parallel degree {dp}")
    check_tensor_parallel(m, p.tensor_parallel)
    seq = cfg.data.seq_length or m.max_position_embeddings
    if seq > m.max_position_embeddings:
        raise ConfigError(f"data.seq_length {seq} exceeds model.max_position_embeddings {m.max_position_embeddings}")
    sp = p.sequence_parallel and p.tensor_parallel > 1
    if sp and seq % p.tensor_parallel:
        raise ConfigError(f"sequence parallel splits data.seq_length {seq} over tensor_parallel "
                          f"{p.tensor_parallel}: use a multiple of {p.tensor_parallel} or sequence_parallel: false")
    check_context_parallel(cfg)
    cp = p.context_parallel
    if sp and (seq // cp) % p.tensor_parallel:
        raise ConfigError(f"sequence parallel splits each context-parallel chunk of {seq // cp} tokens over "
                          f"tensor_parallel {p.tensor_parallel}: make data.seq_length a multiple of "
                          f"{cp * p.tensor_parallel} or set sequence_parallel: false")
    if p.pipeline_parallel > 1:
        counts = check_pipeline(m.num_layers, p.pipeline_parallel, p.virtual_stages, p.schedule, p.stage_layers,
                                p.micro_batch_num)
    else:
        counts = [m.num_layers]
    offload = cfg.optimize.offload_params  # FSDP2's CPU offload; offload_optimizer alone: `_offloads_optimizer`
    if (offload or cfg.optimize.offload_optimizer) and dp > 1 and p.zero_stage < 2:
        raise ConfigError(f"CPU offload needs zero_stage 2 or 3, got {p.zero_stage}: ZeRO 0 and 1 keep full "
                          "replicas on every device; set parallel.zero_stage: 3 to offload")
    zero, reduce_every = (p.zero_stage if dp * cp > 1 else 0), p.reduces_every_micro_batch()
    # On one accelerator offload_params is FSDP2's CPU offload on a one-process group, at ZeRO-3
    # (`parallel.data_parallel.fsdp_on_one_process`); on one CPU it changes nothing.
    alone = offload and world == 1 and device != "cpu"
    if alone:
        zero, reduce_every = one_process_fsdp_settings(cfg)
    return _Layout(dp=dp * cp, dp_shard=dp // p.data_parallel_replicate * cp, tp=p.tensor_parallel,
                   pp=p.pipeline_parallel,
                   virtual_stages=p.virtual_stages if p.pipeline_parallel > 1 else 1,
                   zero=zero,
                   sequence_parallel=sp, micro_batch=cfg.train.micro_batch_size, seq=seq,
                   accumulation=cfg.gradient_accumulation(world), micro_batch_num=p.micro_batch_num,
                   schedule=p.schedule, stage_counts=tuple(counts), offload=offload and (dp > 1 or alone),
                   reduce_every=reduce_every, one_process_fsdp=alone, cp=cp)


@dataclass(frozen=True)
class _Precision:
    """Bytes per element of each kind of tensor under a precision level and layout."""

    level: str
    param: int  # stored model parameters that train
    compute: int  # activations and the parameters the forward uses
    grad: int  # gradients as the optimizer sees them
    state: int  # optimizer state
    masters: bool  # separate fp32 master copies (O2 in one process)
    # Stored frozen parameters: the compute dtype at O2/O3 in every layout (no master, no fp32 shard;
    # `parallel.data_parallel.store_frozen_in`), where ZeRO 0/1 also leave them out of replicate's copy.
    frozen: int = 4


def _precision(cfg: Any, lay: _Layout) -> _Precision:
    level = cfg.optimize.level()
    half = cfg.optimize.mixed_precision != "fp32"
    if level in ("O0", "O1") or not half:
        return _Precision(level, 4, 4, 4, 4, False)
    if level == "O3":
        return _Precision(level, 2, 2, 2, 2, False, frozen=2)
    if (lay.dp > 1 or lay.one_process_fsdp) and not _host_masters(cfg):  # O2 under FSDP2: its fp32 parameters
        return _Precision(level, 4, 2, 4, 4, False, frozen=2)  # are the masters of what trains
    if _streams_optimizer(cfg):  # the streamed update reads the 16-bit gradients where they are
        return _Precision(level, 2, 2, 2, 4, True, frozen=2)
    # O2 in one process (or TP/PP only): 16-bit weights, gradients accumulated in the fp32 masters.
    return _Precision(level, 2, 2, 4, 4, True, frozen=2)


def _param_bytes(params: Iterable[Any], elems: dict[str, int], prec: _Precision) -> int:
    """Bytes of `params` stored with `elems[name]` elements each, trainable and frozen in their own dtypes
    (a quantised base weight, which is never sharded: torchao's inner tensors, `peft.quantize`)."""
    return sum(quantized_bytes(p.quant, p.shape, prec.frozen) if p.quant else
               elems[p.name] * (prec.param if p.trainable else prec.frozen) for p in params)


def _dequantized_transient(held: list[_Param], prec: _Precision, backward: bool = False, tokens: int = 0,
                           device: str = "cuda") -> int:
    """QLoRA: the largest dequantisation of one quantised base weight in forward (its 16-bit copy and
    temporaries) or backward (with the fp32 sums of the input gradient over a micro-batch's `tokens` rows,
    at most `peft.quantize.GRAD_ROWS` at a time; on a CPU the matmuls' widened operands); one weight at a time."""
    return max((dequantized_transient(p.quant, p.shape, prec.frozen, backward, tokens=tokens, widens=device == "cpu")
                for p in held if p.quant), default=0)


# --- parameters --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    """One parameter tensor of the whole model."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    layer: Optional[int]  # block index, None for embeddings / head
    where: str  # "embedding", "layer", "head"
    tp_dim: Optional[int]  # dimension tensor parallel splits, None = replicated
    quant: Optional[str] = None  # lora.quantize_base of a LoRA base weight stored quantised (QLoRA)


def _tp_dim(name: str) -> Optional[int]:
    """The dimension tensor parallel shards (shardwise/parallel/tensor.py's plan), None if replicated."""
    if name.startswith(("tok_embeddings.", "pos_embeddings.", "output.")):
        return 0
    leaf = name.split(".")
    module = ".".join(leaf[2:4]) if name.startswith("layers.") else ""
    column = module in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
    row = module in ("attention.wo", "feed_forward.w2")
    if ".lora_A." in name:
        return 1 if row else None
    if ".lora_B." in name:
        return 0 if column else None
    if column:
        return 0
    if row:
        return 1 if name.endswith(".weight") else None
    return None


@functools.lru_cache(maxsize=16)
def _param_table(key: str) -> tuple[_Param, ...]:
    """Every parameter of the model with LoRA / freezing applied (built on the meta device, cached)."""
    spec = json.loads(key)
    lora = LoraConfig(**spec["lora"]) if spec["lora"] is not None else None
    model = build_adapted_model(ModelConfig(**spec["model"]), lora, FreezeConfig(**spec["freeze"]), "meta")
    quantized = {f"{n.split('.lora_A.')[0]}.weight" for n, _ in model.named_parameters() if ".lora_A." in n} \
        if lora is not None and lora.quantize_base != "none" else set()
    out = []
    for name, p in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        where = "layer" if layer is not None else ("head" if name.startswith(("norm.", "output.")) else "embedding")
        out.append(_Param(name, tuple(p.shape), p.requires_grad, layer, where, _tp_dim(name),
                          lora.quantize_base if name in quantized else None))
    return tuple(out)


def _params_of(cfg: Any) -> tuple[_Param, ...]:
    freeze = cfg.freeze.model_dump()
    key = json.dumps({"model": cfg.model.model_dump(mode="json"),
                      "lora": cfg.lora.model_dump(mode="json") if cfg.lora is not None else None,
                      "freeze": freeze}, sort_keys=True)
    return _param_table(key)


def trainable_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter that trains under the run config's LoRA / freezing."""
    return {p.name: p.shape for p in _params_of(cfg) if p.trainable}


def offloaded_share(cfg: Any) -> tuple[float, float]:
    """(share of all parameter elements, share of the trainable ones) that optimize.offload_params keeps in
    host memory: everything, or with offload_params_blocks the first blocks' (0 without offload_params)."""
    params = _params_of(cfg)
    on_host = [p for p in params if cfg.optimize.params_on_host(p.layer)]

    def share(subset: list[_Param], of: list[_Param]) -> float:
        return sum(_numel(p.shape) for p in subset) / max(1, sum(_numel(p.shape) for p in of))

    trainable = [p for p in params if p.trainable]
    return share(on_host, params), share([p for p in on_host if p.trainable], trainable)


def run_flops(cfg: Any) -> TrainingFlops:
    """Training FLOPs per token of a run config, per layer and head (`models.flops.training_flops` on
    the parameters that train): what MFU counts and what the planner times."""
    return training_flops(cfg.model, cfg.data.seq_length, trainable_shapes(cfg))


def _chunk(size: int, parts: int) -> int:
    """The largest piece of `size` split torch.chunk-style into `parts` (what rank 0 holds)."""
    return -(-size // parts)


def _tp_shape(p: _Param, tp: int) -> tuple[int, ...]:
    if p.tp_dim is None or tp == 1:
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = _chunk(shape[p.tp_dim], tp)
    return tuple(shape)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def _fsdp_shard(shape: tuple[int, ...], n: int) -> int:
    """Elements of one FSDP2 shard of a tensor: dim 0 padded to a multiple of n, split n ways."""
    if not shape:
        return 1
    return _chunk(shape[0], n) * _numel(shape[1:])


def _zero1_part(p: _Param, shape: tuple[int, ...], lay: "_Layout") -> tuple[int, int]:
    """(indices, elements per index) of the part of `p` (local `shape`) that ZeroOneOptimizer keeps on
    rank 0, the rank with the most: split along the first dimension tensor parallelism leaves free;
    a tensor with none left is kept whole (one index of all its elements)."""
    taken = [p.tp_dim] if lay.tp > 1 and p.tp_dim is not None else []
    dim, chunk = zero1_split(shape, taken, lay.dp)
    if dim is None:
        return 1, _numel(shape)
    return chunk, (_numel(shape) // shape[dim] if shape[dim] else 0)


def _zero1_gather_elements(trainable: list[_Param], local: dict[str, tuple[int, ...]], lay: "_Layout") -> int:
    """Elements of the largest bucket one rank sends in ZeRO-1's all-gather of updated parameters
    (`zero1_buckets` over the split tensors in the optimizer's order: matrices, then vectors)."""
    ordered = [p for p in trainable if len(p.shape) >= 2] + [p for p in trainable if len(p.shape) < 2]
    taken = {p.name: [p.tp_dim] if lay.tp > 1 and p.tp_dim is not None else [] for p in ordered}
    shards = [_zero1_part(p, local[p.name], lay) for p in ordered
              if zero1_split(local[p.name], taken[p.name], lay.dp)[0] is not None]
    buckets = zero1_buckets(shards, lay.dp)
    return max((sum((end - start) * shards[i][1] for i, start, end in b) for b in buckets), default=0)


# --- activations ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """Per-rank tensor sizes of one micro-batch."""

    b: int  # samples
    t: int  # tokens attention and the MLP see
    tn: int  # tokens norms and residuals see (t / tp under sequence parallelism)
    h: int
    q: int  # local query width: heads x head_dim / tp
    kv: int  # local key/value width
    heads: int  # local query heads
    f: int  # local MLP width
    v: int  # local vocabulary (logits columns)
    s: int  # bytes of an activation element
    mask: bool  # explicit document mask [B, 1, T, T]
    cp: int = 1  # context parallel: t is a chunk of cp x t tokens, over which attention runs (heads / cp)


def _norm_bytes(m: Any, sh: _Shape, input_grad: bool, weight_grad: bool, s: Optional[int] = None) -> int:
    """What one norm saves, input included (its output is counted by the layers that save it); `s`:
    bytes of the norm's elements (fp32 under autocast, else the activation dtype)."""
    s = s or sh.s
    bt = sh.b * sh.tn
    if m.norm == "rmsnorm":
        # models/lean_ops.rms_norm: the input in its own dtype and the rsqrt (fp32, one per token).
        return bt * sh.h * s + bt * 4 if (input_grad or weight_grad) else 0
    # native_layer_norm saves its input, mean and rstd (fp32 on CUDA, the input dtype on CPU).
    return bt * sh.h * s + 2 * bt * 4 if (input_grad or weight_grad) else 0


def _layer_bytes(cfg: Any, sh: _Shape, flags: dict[str, bool], device: str, level: str) -> int:
    """Bytes one block saves for backward for one micro-batch, without recompute.

    flags: input_grad (the block's input requires grad), norm (norm weights train), and for each
    linear ("wq", ... "w2") whether its weight trains or it has a LoRA adapter ("lora_wq", ...).
    """
    m = cfg.model
    if not any(flags.values()):
        return 0  # nothing in or before it trains: autograd records nothing
    bt, s = sh.b * sh.t, sh.s
    lora = cfg.lora
    drop = m.dropout > 0
    # Which tensors need a gradient: the block's input, then (once attention's weights train) the residual.
    attn_grad = flags["input_grad"] or flags["norm"] or any(_saves_input(flags, n) for n in ("wq", "wk", "wv"))
    mid_grad = attn_grad or _saves_input(flags, "wo")
    norms_s = 4 if level == "O1" else None
    total = _norm_bytes(m, sh, flags["input_grad"], flags["norm"], norms_s) + \
        _norm_bytes(m, sh, mid_grad, flags["norm"], norms_s)
    if level == "O1":
        # Autocast: norms and the residual stream stay fp32; each linear casts its input to 16 bits
        # per use and keeps that cast.
        total += _linear_inputs(flags, ("wq", "wk", "wv"), bt * sh.h * 2)
        total += _linear_inputs(flags, ("w1", "w3") if m.mlp == "gated" else ("w1",), bt * sh.h * 2)
        s = 2
    else:
        # The norm output is saved once (q/k/v or w1/w3 share it); under SP it is the all-gathered copy.
        if any(_saves_input(flags, n) for n in ("wq", "wk", "wv")):
            total += bt * sh.h * s
        if any(_saves_input(flags, n) for n in (("w1", "w3") if m.mlp == "gated" else ("w1",))):
            total += bt * sh.h * s
    # Attention: q (after RoPE), k and v (repeated for GQA), output and log-sum-exp (fp32).
    if attn_grad:
        total += 4 * bt * sh.q * s + sh.b * sh.heads * sh.t * 4
        if sh.mask:
            total += sh.b * (sh.t * sh.cp) ** 2 * s  # SDPA turns the boolean mask into a float one, per layer
    if drop:
        # Attention dropout runs the math kernel: it keeps the probabilities, the mask and the result.
        total += 3 * sh.b * sh.heads * sh.t * sh.t * sh.cp * s + bt * sh.q * s  # heads / cp over cp x t tokens
        total += 2 * sh.b * sh.tn * sh.h * _MASK_BYTES.get(device, 1)  # residual dropouts
    # MLP.
    if m.mlp == "gated":
        total += bt * sh.f * s * 2  # models/lean_ops.gated_activation: the gate and up projections
    else:
        total += bt * sh.f * s * (1 if m.activation != "relu" else 0)
    if _saves_input(flags, "w2"):
        total += bt * sh.f * s
    # LoRA: each adapter saves the rank-r activation between A and B (and its dropout's input and mask).
    if lora is not None:
        for name, width in (("wq", sh.h), ("wk", sh.h), ("wv", sh.h), ("wo", sh.q), ("w1", sh.h), ("w3", sh.h),
                            ("w2", sh.f)):
            if flags.get(f"lora_{name}"):
                total += bt * lora.r * s
                if lora.dropout > 0:
                    total += bt * width * (s + _MASK_BYTES.get(device, 1))
    return total


def _saves_input(flags: dict[str, bool], name: str) -> bool:
    """Whether a linear keeps its input for backward: its weight trains, or an adapter reads it."""
    return flags.get(name, False) or flags.get(f"lora_{name}", False)


def _linear_inputs(flags: dict[str, bool], names: tuple[str, ...], each: int) -> int:
    return sum(each for n in names if _saves_input(flags, n))


def _recompute_bytes(cfg: Any, sh: _Shape, mode: str, full: int, flags: Optional[dict[str, bool]] = None) -> int:
    """Bytes a recomputed block keeps between its forward and backward (full: what it would keep without;
    `flags`: the block's, for whether selective recompute reaches the down projection)."""
    bt, s = sh.b * sh.t, sh.s
    inputs = sh.b * sh.tn * sh.h * s  # the block's input, kept to run it again
    if mode == "full":
        return inputs
    # Selective (parallel/recompute.py): the outputs of attention and of every other block linear in
    # call order (q, v, gate; down only where the recompute reaches it); LoRA's matmuls are recomputed.
    width = {"wq": sh.q, "wk": sh.kv, "wv": sh.kv, "wo": sh.h, "w1": sh.f, "w3": sh.f, "w2": sh.h}
    reached = down_output_needed(cfg.model.dropout, bool((flags or {}).get("lora_w2")))
    mm = sum(width[n] for n in selective_saved_matmuls(cfg.model.mlp == "gated", reached)) * bt
    if cfg.model.dropout > 0:  # attention's math path: both batched matmuls (scores and output)
        attention = (sh.b * sh.heads * sh.t * sh.t + bt * sh.q) * s
    else:  # the fused kernel's output and log-sum-exp
        attention = bt * sh.q * s + sh.b * sh.heads * sh.t * 4
    return min(full, inputs + mm * s + attention) if full else inputs


# --- the schedule: what runs in which order on a rank ---------------------------------------------------


def _rank_ops(lay: _Layout, pp_rank: int, stages: list[int]) -> list[tuple[int, str, int]]:
    """(stage, kind, micro-batch) of one optimizer step on `pp_rank`, in execution order.

    kind: "F" forward, "B" full backward, "I" input-gradient backward and "W" weight-gradient step
    (zero-bubble keeps a micro-batch's activations until its "W"). Without a pipeline: forward and
    backward of each accumulated micro-batch. With one: torch's own per-rank action order
    (`_calculate_single_rank_operations` of the multi-stage schedules; GPipe all forwards then all
    backwards; 1F1B min(M, P - rank) warm-up forwards then one backward, one forward), once per
    pipeline step of the optimizer step.
    """
    if lay.pp == 1:
        return [op for mb in range(lay.accumulation) for op in ((stages[0], "F", mb), (stages[0], "B", mb))]
    m, p = lay.micro_batch_num, lay.pp
    if lay.schedule == "gpipe":
        one = [(stages[0], "F", i) for i in range(m)] + [(stages[0], "B", i) for i in range(m)]
    elif lay.schedule == "1f1b":
        warm = min(m, p - pp_rank)
        one = [(stages[0], "F", i) for i in range(warm)]
        for i in range(m):
            one.append((stages[0], "B", i))
            if warm + i < m:
                one.append((stages[0], "F", warm + i))
    else:
        one = [op for op in _torch_rank_ops(lay, pp_rank) if op[2] < m]
    return one * max(1, lay.accumulation // m)


def _torch_rank_ops(lay: _Layout, pp_rank: int) -> list[tuple[int, str, int]]:
    """The multi-stage schedules' action order, from torch itself (its pipeline_order of one rank)."""
    cls = schedule_class(lay.schedule, lay.virtual_stages)
    rounds = max(1, lay.micro_batch_num // lay.pp)
    fake = SimpleNamespace(pp_group_size=lay.pp, n_local_stages=lay.virtual_stages, _n_microbatches=lay.micro_batch_num,
                           microbatches_per_round=lay.micro_batch_num // rounds, number_of_rounds=rounds,
                           num_stages=lay.pp * lay.virtual_stages, rank=pp_rank)
    try:
        actions = cls._calculate_single_rank_operations(fake, pp_rank)
    except Exception:  # noqa: BLE001 - a torch without this internal: a 1F1B-like order over the chunks
        stages = _rank_stages(lay, pp_rank)
        return [(st, k, i) for i in range(lay.micro_batch_num) for k in ("F", "B") for st in
                (stages if k == "F" else stages[::-1])]
    out = []
    for a in actions:
        if a is None:
            continue
        kind = str(getattr(a.computation_type, "value", a.computation_type))
        if kind in ("F", "B", "I", "W"):
            out.append((a.stage_index, kind, a.microbatch_index or 0))
    return out


# --- one rank --------------------------------------------------------------------------------------------


def estimate_memory(cfg: Any, devices: Optional[int] = None, device: str = "cuda") -> MemoryEstimate:
    """Memory of the busiest device of the run `cfg` on `devices` devices of kind `device` ("cuda", "npu", "cpu")."""
    return max(estimate_all_ranks(cfg, devices, device), key=lambda e: e.peak)


def estimate_all_ranks(cfg: Any, devices: Optional[int] = None, device: str = "cuda") -> list[MemoryEstimate]:
    """One estimate per distinct rank role: each pipeline rank (its data/tensor-parallel peers are alike)."""
    if device not in ("cuda", "npu", "cpu"):
        raise ConfigError(f"device {device!r} is not known; use cuda, npu or cpu")
    lay = _layout(cfg, devices, device)
    prec = _precision(cfg, lay)
    params = _params_of(cfg)
    return [_estimate_rank(cfg, lay, prec, params, r, device) for r in range(lay.pp)]


def _rank_stages(lay: _Layout, pp_rank: int) -> list[int]:
    if lay.pp == 1:
        return [0]
    return stage_indices(pp_rank, lay.pp, lay.virtual_stages, schedule_style(lay.schedule, lay.virtual_stages))


def _stage_layers(lay: _Layout, stage: int) -> list[int]:
    start = sum(lay.stage_counts[:stage])
    return list(range(start, start + lay.stage_counts[stage]))


def _stage_owner(lay: _Layout, stage: int) -> int:
    return stage_rank(stage, lay.pp, lay.pp * lay.virtual_stages, schedule_style(lay.schedule, lay.virtual_stages))


@dataclass
class _Stage:
    """One model part on a rank: its layers and what one micro-batch of it keeps and needs."""

    index: int
    layers: list[int]
    first: bool  # holds the embeddings
    last: bool  # holds the final norm, output projection and loss
    act: int = 0  # bytes one micro-batch keeps from its forward to its backward
    grads: int = 0  # bytes of its gradients once they exist


def _estimate_rank(cfg: Any, lay: _Layout, prec: _Precision, params: tuple[_Param, ...], pp_rank: int,
                   device: str) -> MemoryEstimate:
    m = cfg.model
    stage_ids = _rank_stages(lay, pp_rank)
    num_stages = lay.pp * lay.virtual_stages
    stages = {st: _Stage(st, _stage_layers(lay, st), st == 0, st == num_stages - 1) for st in stage_ids}
    layers = {i: st for st in stage_ids for i in stages[st].layers}
    first, last = 0 in stages, (num_stages - 1) in stages

    # --- parameters, gradients, optimizer state on this rank
    held: list[_Param] = [p for p in params if (p.where == "layer" and p.layer in layers)
                          or (p.where == "embedding" and first) or (p.where == "head" and last)]
    if m.tie_embeddings and num_stages > 1 and last:  # the last stage keeps its own copy of the tied matrix
        emb = next(p for p in params if p.name == "tok_embeddings.weight")
        held.append(_Param("output.weight", emb.shape, emb.trainable, None, "head", 0))
    sharded = lay.zero >= 2
    local = {p.name: _tp_shape(p, lay.tp) for p in held}
    # parallel.expert_parallel: each rank holds its 1/ep of every MoE block's experts, outside FSDP2.
    ep = cfg.parallel.expert_parallel
    experts = {p.name for p in held if ".feed_forward.experts." in p.name} if ep > 1 else set()
    for name in experts:
        local[name] = (local[name][0] // ep, *local[name][1:])
    # FSDP2 keeps each shard padded to even rows; the optimizer state sees the unpadded local rows.
    stored = {p.name: (_fsdp_shard(local[p.name], lay.dp_shard) if sharded and p.name not in experts
                       else _numel(local[p.name])) for p in held}
    trainable = [p for p in held if p.trainable]
    rope = 2 * m.max_position_embeddings * m.head_dim * 4 if m.position == "rope" else 0  # fp32 tables per rank
    param_bytes = _param_bytes(held, stored, prec) + rope
    full_elems = [_numel(local[p.name]) for p in trainable]
    if lay.zero == 1:  # 1/dp of every tensor (its first free dimension split torch.chunk style)
        state_elems = sum(math.prod(_zero1_part(p, local[p.name], lay)) for p in trainable)
    elif sharded:
        state_elems = sum(stored[p.name] for p in trainable)
    else:
        state_elems = sum(full_elems)
    name = cfg.train.optimizer
    states = 1 if name == "sgd" else 2
    counters = 0 if name == "sgd" else 4 * len(trainable)  # ZeRO-1: a step per part
    optimizer_bytes = states * state_elems * _state_bytes(cfg, prec) + counters  # Adam: a scalar step per tensor
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        opt_elems = [stored[p.name] if sharded else _numel(local[p.name]) for p in trainable]
        one = _8bit_state_bytes if name == "adamw_8bit" else _paged_8bit_state_bytes
        optimizer_bytes = states * sum(one(n, 4 if prec.masters else prec.param) for n in opt_elems) + counters
    elif name == "paged_adamw":
        optimizer_bytes = states * state_elems * 4 + counters
    # optimize.offload_params (FSDP2's CPU offload): the parameters it keeps in host memory (all of this
    # rank's, or with offload_params_blocks those of the first blocks), their gradients and state with them.
    on_host = {p.name for p in held if cfg.optimize.params_on_host(p.layer)} if lay.offload else set()
    host_layers = frozenset(p.layer for p in held if p.name in on_host and p.layer is not None)
    host_trainable = [p for p in trainable if p.name in on_host]
    # The optimizer state of the offloaded parameters: their share of the elements (the 8-bit blocks and
    # step counters per tensor make it a share of the bytes to within a few bytes a tensor).
    host_share = sum(stored[p.name] for p in host_trainable) / max(1, sum(stored[p.name] for p in trainable))
    master_bytes = sum(full_elems) * 4 if prec.masters else 0
    grad_bytes = sum(stored[p.name] for p in trainable) * prec.grad
    # What a checkpoint saves of this rank (train.async_save stages a host copy of it): the parameters as
    # held, the optimizer state, the fp32 masters of O2.
    saved_bytes = _param_bytes(held, stored, prec) + optimizer_bytes + (state_elems * 4 if prec.masters else 0)
    # optimize.offload_optimizer (memory.offload.HostMasters): this rank's masters, their pinned buffers in
    # the weights' dtype, the masters' gradients and the state are host memory. On an accelerator they
    # leave the device figure; on the CPU (one memory) it keeps them and `host_phases` says which they are.
    host_opt = _offloads_optimizer(cfg)
    stream = _streams_optimizer(cfg)
    dev_view = device != "cpu"
    if host_opt:
        master_bytes = state_elems * ((4 if prec.masters else prec.param) + prec.param)
    if stream:  # the masters of this rank's shards, pinned (they cross the bus with the state)
        master_bytes = state_elems * 4 if prec.masters else 0
    host_static = master_bytes + optimizer_bytes if host_opt or stream else 0
    host_grads = grad_bytes if host_opt else 0
    if host_opt and dev_view:
        master_bytes = optimizer_bytes = grad_bytes = 0
    if stream and dev_view:  # masters and state in host memory; the gradients stay on the device
        master_bytes = optimizer_bytes = 0
    # bitsandbytes' paged state: CUDA unified memory outside torch's allocator, paged out to host memory
    # when the device is short of room: counted in host memory (step_time charges the paging).
    paged = name in PAGED_OPTIMIZERS and dev_view
    if paged:
        host_static, optimizer_bytes = optimizer_bytes, 0
    host = 0
    offload = lay.offload and device != "cpu"  # on a CPU run host memory is the device's memory
    host_grad_bytes = sum(stored[p.name] for p in host_trainable) * prec.grad
    host_optimizer_bytes = int(optimizer_bytes * host_share)
    if lay.offload:
        host = _param_bytes([p for p in held if p.name in on_host], stored, prec) + host_grad_bytes \
            + host_optimizer_bytes
    if offload:  # FSDP2's CPUOffloadPolicy: shards, sharded gradients and the state live in host memory
        param_bytes -= _param_bytes([p for p in held if p.name in on_host], stored, prec)
        grad_bytes -= host_grad_bytes
        optimizer_bytes -= host_optimizer_bytes

    # --- activations of one micro-batch, per stage
    tp = lay.tp
    chunk = lay.seq // lay.cp  # the tokens of a sequence this rank holds (context parallelism)
    sh = _Shape(b=lay.micro_batch, t=chunk, tn=chunk // tp if lay.sequence_parallel else chunk, h=m.hidden_size,
                q=m.num_heads * m.head_dim // tp, kv=m.num_kv_heads * m.head_dim // tp, heads=m.num_heads // tp,
                f=m.intermediate_size // tp, v=_chunk(m.vocab_size, tp), s=prec.compute,
                mask=_document_mask(cfg, device), cp=lay.cp)
    flags = _layer_flags(cfg, params)
    hidden = sh.b * sh.tn * sh.h * sh.s  # one micro-batch of hidden states between blocks / stages
    full: dict[int, int] = {}
    saved: dict[int, int] = {}
    for st in stages.values():  # each model part's blocks get their modes in order (full every k-th: per part)
        for i, mode in zip(st.layers, cfg.optimize.layer_recompute(st.layers)):
            full[i] = _layer_bytes(cfg, sh, flags[i], device, prec.level)
            saved[i] = _recompute_bytes(cfg, sh, mode, full[i], flags[i]) if mode != "none" else full[i]
    # optimize.offload_activations: what the blocks save goes to host memory in the forward; each block's
    # saved tensors come back whole for its backward (as a recomputed block's do).
    act_host = sum(saved.values()) * max(_in_flight(lay, pp_rank, stage_ids).values()) \
        if cfg.optimize.offload_activations else 0
    # The block running its forward holds the tensors it saves on the device while their copies go to the
    # host: at most its MLP's (the widest), until the MLP is done.
    act_live = max((_mlp_bytes(cfg, sh, flags[i]) for i in full), default=0) if act_host else 0
    # On an accelerator the copies run on a side stream (memory.offload.SavedCopies): in the forward one
    # block's copies may still be on their way out beside the running block's, and in the backward the
    # next block's come back while one runs: one more block's saved tensors in each.
    ahead = max(saved.values(), default=0) if act_host and dev_view else 0
    act_live += ahead
    if act_host and dev_view:
        saved = {i: 0 for i in saved}
    head = _head(cfg, sh, prec, flags, logits_kept=lay.pp > 1 or lay.tp > 1) if last else None
    for st in stages.values():
        st.act = sum(saved[i] for i in st.layers) + _stage_bytes(cfg, sh, st.first, device)
        first_recomputed = bool(st.layers) and saved[st.layers[0]] != full[st.layers[0]]
        if not st.first and st.layers and _input_aliased(m, sh, first_recomputed):
            st.act -= hidden  # the first block keeps the received hidden states, already a receive buffer
        if st.last:
            st.act += head["saved"] + head["logits"] + head["lsm"]
        else:
            st.act += hidden  # the stage output, kept by the schedule for its backward
        st.grads = sum(stored[p.name] for p in trainable if _param_stage(p, st, num_stages)
                       and not (offload and p.name in on_host)) * prec.grad
        if host_opt and dev_view:
            st.grads = 0

    # --- what the layout adds
    batch = _batch_bytes(cfg, lay, device)
    pipe_buffers = _pipeline_buffers(lay, stage_ids, hidden)
    f8_gather = float8_all_gather(cfg, lay.dp)
    fsdp = _fsdp(lay, prec, [p for p in held if p.name not in experts], local, layers, f8_gather)
    gathered = _replicate_buffers(lay, prec, held, local) + (fsdp.forward() if fsdp else 0)
    exchange = _exchange_bytes(m, sh)
    dequant = _dequantized_transient(held, prec)  # QLoRA: inside a block's forward and backward, not the head's
    dequant_back = _dequantized_transient(held, prec, backward=True, tokens=sh.b * sh.t, device=device)
    cast, cast_back = _float8_transient(sh, held, local, gathered=f8_gather, compiled=cfg.compiles(device)) \
        if float8_on(cfg) else (0, 0)
    if prec.level == "O1":
        # Autocast caches the 16-bit copy of every trainable weight a matmul uses until the
        # micro-batch's forward and backward are done.
        # The chunked loss casts the output weight itself (counted with the head, released after it).
        chunked = cfg.optimize.loss_chunk() is not None
        gathered += sum(_numel(local[p.name]) * 2 for p in trainable
                        if len(p.shape) == 2 and (p.name != "tok_embeddings.weight" or m.tie_embeddings)
                        and not p.name.startswith("pos_")
                        and not (chunked and p.name in ("output.weight", "tok_embeddings.weight")))
    if sharded and not lay.reduce_every and len([op for op in _rank_ops(lay, pp_rank, stage_ids)
                                                 if op[1] in "BW"]) > 1 and not offload:
        # Without gradient sync FSDP2 accumulates unsharded gradients (in the reduce dtype) between
        # micro-batches: with accumulation and reduce_gradients once_per_step (or under a pipeline,
        # whose schedule reduces once per pipeline step) ZeRO 2/3 hold full-size gradients. Reduced
        # every micro-batch, they stay sharded (HSDP: the partial shards wait for the replica all-reduce).
        for st in stages.values():
            st.grads = sum(_numel(local[p.name]) for p in trainable if _param_stage(p, st, num_stages)) * prec.grad
    in_backward = cfg.train.optimizer_in_backward
    updates = _in_backward_updates(cfg, lay, prec, trainable, stored, local, device) if in_backward else None
    if stream and in_backward:  # each update holds its gradient and the state streamed around it
        updates = _streamed_updates(cfg, lay, prec, trainable, stored, local, device, in_backward=True)
    if host_opt and dev_view:  # each gradient leaves the device once it is final: one tensor at a time
        in_backward, updates = True, _gradients_in_transit(lay, prec, trainable, stored, local)
    if in_backward:  # each gradient is used and freed as it arrives (`updates`: the one being applied)
        for st in stages.values():
            st.grads = 0
    pipe_buffers += _zero_bubble_leftovers(lay, stage_ids, hidden)
    static = param_bytes + optimizer_bytes + master_bytes + batch + pipe_buffers
    gathered += exchange  # held around each attention, forward and backward (not in the optimizer step)

    # --- replay the step: forwards keep a micro-batch's activations, backwards release them
    held_mb = {st: 0 for st in stages}
    has_grads = {st: False for st in stages}
    pending_w = {st: 0 for st in stages}  # zero-bubble: input gradients done, weight gradients not yet
    inter = {st: sum(_weight_grad_inputs(cfg, sh) for _ in stages[st].layers) for st in stages}
    # Interleaved 1F1B waits for its sends at the end of the step: each input gradient sent back stays.
    sent = {st: 0 for st in stages}
    keeps_sends = lay.pp > 1 and lay.schedule == "interleaved_1f1b"
    walks: dict[tuple[int, bool, bool], int] = {}  # one micro-batch's backward peak depends only on these
    forward = backward = 0
    for st_id, kind, _mb in _rank_ops(lay, pp_rank, stage_ids):
        st = stages[st_id]
        others = sum(stages[s].act * held_mb[s] + inter[s] * pending_w[s] + sent[s] * hidden for s in stages) \
            + sum(stages[s].grads for s in stages if has_grads[s])
        if kind == "F":
            fwd_extra = head["fwd_extra"] if st.last else 0
            if st.last and fsdp is not None:
                fwd_extra += fsdp.head_forward(st.layers, cfg.optimize.chunked_loss)
            forward = max(forward, static + gathered + others + st.act + fwd_extra)
            if dequant:  # the last block's largest matmul, before the head's tensors exist
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part + dequant)
            if cast:  # optimize.float8: the last block's largest cast, before the head's tensors exist
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part + cast)
            if act_live:  # the last block's MLP, before the head's tensors exist
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part + act_live)
            held_mb[st_id] += 1
        elif kind in ("B", "I"):
            rest = others - st.act - (st.grads if has_grads[st_id] else 0)
            key = (st_id, has_grads[st_id], kind == "I")
            if key not in walks:
                walks[key] = _backward_walk(cfg, sh, st, saved, full, flags, held, stored, prec, head, fsdp,
                                            has_grads[st_id] or in_backward, kind == "I", updates,
                                            dequant=dequant_back, cast=cast_back,
                                            grads_leave=host_layers if offload else frozenset())
            walk = walks[key]
            backward = max(backward, static + gathered + rest + walk + ahead)
            if keeps_sends and not st.first:
                sent[st_id] = min(sent[st_id] + 1, lay.micro_batch_num)
            if kind == "B":
                held_mb[st_id] -= 1
                # offload_optimizer: a micro-batch's gradients wait in the host buffers, the masters'
                # gradients are made during the next backward (or after the last).
                has_grads[st_id] = not host_opt
            else:
                pending_w[st_id] += 1
        elif kind == "W":
            held_mb[st_id] -= 1
            pending_w[st_id] -= 1
            has_grads[st_id] = True
    if in_backward:
        pass  # the updates are counted in the walk (`updates`); no set of gradients is left to reduce
    elif lay.dp > 1 and lay.pp == 1 and not offload:
        backward = max(backward, static + _root_reduction(lay, prec, trainable, stored, local))
    if stream and not in_backward:  # the gradients, and the state streamed through one tensor at a time
        window = _streamed_updates(cfg, lay, prec, trainable, stored, local, device, in_backward=False)
        sizes = [stored[p.name] if lay.zero >= 2 else _numel(local[p.name]) for p in trainable]
        optimizer_phase = static + grad_bytes + max(max(window.values(), default=0), _norm_temp(sizes))
    else:
        on_device = [p for p in trainable if not (offload and p.name in on_host)]
        optimizer_phase = _optimizer_phase(cfg, lay, prec, static, grad_bytes, state_elems, on_device, stored,
                                           local, (host_opt and dev_view) or (offload and not on_device),
                                           "cpu" if host_opt else device)
    checkpoint = static

    # --- the estimate
    phases = {"forward": forward, "backward": backward, "optimizer": optimizer_phase, "checkpoint": checkpoint}
    if cfg.train.async_save and not dev_view:  # a CPU run: the async save's host copy is in the one memory
        phases = {k: v + saved_bytes for k, v in phases.items()}
    tensor_peak = max(phases.values())
    frac = ALLOCATOR_OVERHEAD if device in ("cuda", "npu") else 0.0
    phases = {k: int(v * (1 + frac)) for k, v in phases.items()}
    host_phases = {"forward": host_static + act_host,
                   "backward": host_static + host_grads + act_host, "optimizer": host_static + host_grads,
                   "checkpoint": host_static}
    staged = saved_bytes if cfg.train.async_save else 0
    if staged:  # from the first save on, one host copy of everything saved, kept for the run
        host_phases = {k: v + staged for k, v in host_phases.items()}
    if lay.offload:  # FSDP2's CPU offload: shards and state all along, gradients from backward to the step
        host_phases = {k: v + host - (host_grad_bytes if k in ("forward", "checkpoint") else 0)
                       for k, v in host_phases.items()}
    host = max(host_phases.values())
    # On the CPU (one memory) `phases` hold it all; on an accelerator they are the device's alone.
    device_phases = {k: max(0, v - host_phases[k]) for k, v in phases.items()} if not dev_view else dict(phases)
    peak_phase = max(phases, key=phases.get)
    flight = _in_flight(lay, pp_rank, stage_ids)
    block_acts = sum((sum(saved[i] for i in stages[s].layers)) * flight[s] for s in stages)
    activations = block_acts if peak_phase in ("forward", "backward") else 0
    # The gradients that exist at the peak: none with the optimizer in backward (the one being applied is a
    # transient, among the buffers), none after the step; in a forward only those of earlier micro-batches.
    accumulating = peak_phase == "forward" and lay.accumulation > 1 and not host_opt
    grads_at_peak = 0 if in_backward else grad_bytes if peak_phase in ("backward", "optimizer") or accumulating else 0
    buffers = max(0, tensor_peak - (param_bytes + grads_at_peak + optimizer_bytes + master_bytes + activations))
    one = next(iter(layers), None)
    if lay.pp > 1:
        role = f"pipeline rank {pp_rank}, stage{'s' if len(stage_ids) > 1 else ''} {', '.join(map(str, stage_ids))}"
    else:
        role = "one device" if lay.dp * lay.tp == 1 else "every rank"
    detail = {
        "rank_role": role,
        "pp_rank": pp_rank,
        "stages": stage_ids,
        "layers_on_rank": len(layers),
        "layers_with_activations": [i for i in sorted(full) if full[i]],  # what recompute: auto may wrap
        "in_flight": max(flight.values()),
        "in_flight_per_stage": flight,
        "layer_activation_bytes": saved.get(one, 0),
        "layer_activation_bytes_no_recompute": full.get(one, 0),
        "layer_activation_bytes_full_recompute": _recompute_bytes(cfg, sh, "full", full[one]) if one is not None else 0,
        "stage_micro_batch_bytes": {s: stages[s].act for s in stages},
        "head": head,
        "masters_bytes": master_bytes,
        "batch_bytes": batch,
        "pipeline_buffer_bytes": pipe_buffers,
        "gathered_parameter_bytes": gathered - exchange,
        "context_parallel_exchange_bytes": exchange,
        "bytes_per_element": {"param": prec.param, "frozen_param": prec.frozen, "compute": prec.compute,
                              "grad": prec.grad, "state": prec.state},
        "precision_level": prec.level,
        "layout": {"dp": lay.dp // lay.cp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "zero": lay.zero,
                   "sequence_parallel": lay.sequence_parallel,
                   "micro_batch": lay.micro_batch, "seq": lay.seq, "accumulation": lay.accumulation,
                   "schedule": lay.schedule if lay.pp > 1 else None, "virtual_stages": lay.virtual_stages},
        "device": device,
        "tensor_peak": tensor_peak,
        "device_phases": device_phases,  # without what is in host memory (on an accelerator: `phases`)
        "host_offload": {"optimizer": host_static + host_grads, "activations": act_host},
        "async_save_host_bytes": staged,  # train.async_save: the staged copy of what a checkpoint saves
    }
    if m.num_experts:
        detail["approximate"] = (
            "mixture-of-experts blocks: the experts' parameters, gradients and optimizer state are counted "
            "exactly, their activations and routing buffers as a dense block's; not yet checked against a "
            "count of live tensors")
    return MemoryEstimate(params=param_bytes, grads=grads_at_peak, optimizer=optimizer_bytes + master_bytes,
                          activations=activations, buffers=buffers, overhead=int(tensor_peak * frac),
                          peak=max(phases.values()), phases=phases, detail=detail, host=host,
                          host_phases=host_phases)


def _in_flight(lay: _Layout, pp_rank: int, stage_ids: list[int]) -> dict[int, int]:
    """Most micro-batches each stage of the rank holds at once (forward done, backward not)."""
    held = {s: 0 for s in stage_ids}
    peak = dict(held)
    for st, kind, _mb in _rank_ops(lay, pp_rank, stage_ids):
        held[st] += 1 if kind == "F" else (-1 if kind in ("B", "W") else 0)
        peak = {s: max(peak[s], held[s]) for s in held}
    return peak


def _param_stage(p: _Param, st: _Stage, num_stages: int) -> bool:
    """Whether parameter p lives in stage st."""
    if p.where == "layer":
        return p.layer in st.layers
    return st.first if p.where == "embedding" else st.last


def _input_aliased(m: Any, sh: _Shape, recomputed: bool) -> bool:
    """Whether a block keeps its input tensor itself (not a copy): LayerNorm, fp32 RMSNorm, recompute."""
    return recomputed or m.norm != "rmsnorm" or sh.s == 4


def _pipeline_buffers(lay: _Layout, stage_ids: list[int], hidden: int) -> int:
    """PipelineStage's receive buffers, one per micro-batch: activations from the previous stage and
    gradients from the next, where that stage is on another rank."""
    if lay.pp == 1:
        return 0
    n = lay.pp * lay.virtual_stages
    count = 0
    for st in stage_ids:
        if st > 0 and _stage_owner(lay, st - 1) != _stage_owner(lay, st):
            count += lay.micro_batch_num
        if st < n - 1 and _stage_owner(lay, st + 1) != _stage_owner(lay, st):
            count += lay.micro_batch_num
    return count * hidden


def _zero_bubble_leftovers(lay: _Layout, stage_ids: list[int], hidden: int) -> int:
    """Tensors torch's zero-bubble stages keep from one step to the next: each non-first stage's input
    gradients, and the activations passed between two stages of the same rank (the V's turn)."""
    if lay.pp == 1 or lay.schedule != "zero_bubble":
        return 0
    count = sum(lay.micro_batch_num for st in stage_ids if st > 0)
    count += sum(lay.micro_batch_num for st in stage_ids
                 if st > 0 and _stage_owner(lay, st - 1) == _stage_owner(lay, st))
    return count * hidden


def _backward_walk(cfg: Any, sh: _Shape, st: _Stage, saved: dict[int, int], full: dict[int, int],
                   flags: dict[int, dict[str, bool]], held: list[_Param], stored: dict[str, int], prec: _Precision,
                   head: Optional[dict[str, int]], fsdp: Optional["_Fsdp"], grads_exist: bool,
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
        mlp_t, attn_t = _layer_transient(cfg, sh, flags[i])
        share_mlp, share_attn = _grad_shares(held, i)
        layer_grad = sum(stored[p.name] for p in held if p.layer == i and p.trainable) * prec.grad
        growing = 0 if (grads_exist or input_only or i in grads_leave) else layer_grad
        mlp_part = _mlp_bytes(cfg, sh, flags[i]) if full[i] else 0
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
            remaining += _weight_grad_inputs(cfg, sh)  # the output gradients the weight pass will need
        else:
            remaining -= saved[i]
        grads_now += growing
    if updates and st.first:
        peak = max(peak, remaining + grads_now + updates.get("embedding", 0))
    return peak


def _weight_grad_inputs(cfg: Any, sh: _Shape) -> int:
    """What zero-bubble keeps per block between its input- and weight-gradient passes: the gradient
    at the output of every weight (q, k, v, o, the MLP's projections, the two norms)."""
    bt = sh.b * sh.t
    widths = sh.q + 2 * sh.kv + sh.h + (2 if cfg.model.mlp == "gated" else 1) * sh.f + sh.h
    return bt * widths * sh.s + 2 * sh.b * sh.tn * sh.h * sh.s


def _grad_shares(held: list[_Param], layer: int) -> tuple[float, float]:
    """Fractions of a block's trainable elements whose gradients exist at its MLP's backward (the
    down projection's) and at its attention's backward (all but q, k, v and the first norm)."""
    mine = [p for p in held if p.layer == layer and p.trainable]
    total = sum(_numel(p.shape) for p in mine) or 1
    mlp = sum(_numel(p.shape) for p in mine if ".feed_forward.w2." in p.name)
    late = sum(_numel(p.shape) for p in mine
               if any(k in p.name for k in (".attention.wq.", ".attention.wk.", ".attention.wv.", "attention_norm")))
    return mlp / total, 1 - late / total


def _document_mask(cfg: Any, device: str) -> bool:
    """Whether attention gets an explicit [B, 1, T, T] mask (packed documents without flex attention)."""
    if cfg.data.kind != "pretrain" and cfg.data.packing == "pad":
        return False
    documents = cfg.data.reset_attention_mask and bool(cfg.data.train_files)
    if not documents:
        return False
    flex = device == "cuda" and cfg.model.use_flash_attention and not cfg.model.dropout
    return not flex


def _layer_flags(cfg: Any, params: tuple[_Param, ...]) -> dict[int, dict[str, bool]]:
    """Per block: whether its input needs a gradient, and which of its weights train (or carry LoRA)."""
    return _layer_flags_of(cfg.model.num_layers, params)


@functools.lru_cache(maxsize=16)
def _layer_flags_of(num_layers: int, params: tuple[_Param, ...]) -> dict[int, dict[str, bool]]:
    by_layer: dict[Optional[int], list[_Param]] = {}
    for p in params:
        by_layer.setdefault(p.layer, []).append(p)
    out = {}
    upstream = any(p.trainable for p in params if p.where == "embedding")
    for i in range(num_layers):
        mine = by_layer.get(i, [])
        flags = {"input_grad": upstream, "norm": any(p.trainable for p in mine if "norm" in p.name)}
        for lin, module in (("wq", "attention.wq"), ("wk", "attention.wk"), ("wv", "attention.wv"),
                            ("wo", "attention.wo"), ("w1", "feed_forward.w1"), ("w3", "feed_forward.w3"),
                            ("w2", "feed_forward.w2")):
            prefix = f"layers.{i}.{module}."
            flags[lin] = any(p.trainable for p in mine if p.name.startswith(prefix) and ".lora_" not in p.name)
            flags[f"lora_{lin}"] = any(p.trainable for p in mine if p.name.startswith(prefix) and ".lora_" in p.name)
        out[i] = flags
        upstream = upstream or any(p.trainable for p in mine)
    return out


def _stage_bytes(cfg: Any, sh: _Shape, first: bool, device: str) -> int:
    """What a model part keeps besides its blocks: RoPE cos/sin for the micro-batch (every part builds
    them, in the compute dtype) and the embedding dropout's mask."""
    m = cfg.model
    rows = sh.b if _document_positions(cfg) else 1
    total = 2 * rows * sh.t * m.head_dim * sh.s if m.position == "rope" else 0
    if first and m.dropout > 0:
        total += sh.b * sh.tn * sh.h * _MASK_BYTES.get(device, 1)
    return total


def _document_positions(cfg: Any) -> bool:
    return cfg.data.reset_position_ids and bool(cfg.data.train_files)


def _head(cfg: Any, sh: _Shape, prec: _Precision, flags: dict[int, dict[str, bool]],
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
    saved = _norm_bytes(m, sh, input_grad, cfg.lora is None, 4 if autocast else None)
    chunk = cfg.optimize.loss_chunk()
    if chunk is not None:
        hidden_grad = input_grad or cfg.lora is None  # the final norm's weight trains in a full fine-tune
        if not head_recomputes_logits(cfg) and (hidden_grad or out_trains):
            return _head_with_forward_gradients(sh, s, saved, hidden_grad, out_trains, min(chunk, bt), autocast)
        return _chunked_head(sh, s, saved, out_trains, min(chunk, bt), autocast)
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


def _chunked_head(sh: _Shape, s: int, norm: int, weight_grad: bool, chunk: int, autocast: bool) -> dict[str, int]:
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
    vocabulary-sharded weight) or fp16 matmuls; elsewhere it makes its gradients in forward."""
    p = cfg.parallel
    return cfg.optimize.chunked_loss and (p.pipeline_parallel > 1 or p.tensor_parallel > 1
                                          or cfg.optimize.mixed_precision == "fp16")


def _loss_chunk_bytes(sh: _Shape, s: int, chunk: int) -> int:
    """One chunk of the chunked loss: its fp32 logits (the matmul's own buffer in fp32) and their copy in
    the `s`-byte compute dtype (the 16-bit matmul output, or the gradient cast back), its target rows and masks."""
    return chunk * sh.v * (4 + (s if s != 4 else 0)) + 9 * chunk


def _head_with_forward_gradients(sh: _Shape, s: int, norm: int, hidden_grad: bool, weight_grad: bool, chunk: int,
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


def _layer_transient(cfg: Any, sh: _Shape, flags: dict[str, bool]) -> tuple[int, int]:
    """What a block's backward holds above its saved activations: (in the MLP, in attention).

    Gated MLP: the down projection's input is released as its gradient appears, then the gate's
    two gradients join (+2 x [B, T, F]); plain MLP +1; a frozen down projection kept no input, so its
    input gradient adds one more. The MLP's also holds the block's output gradient. Attention: the
    gradients of q, k, v and of the output (+4 x [B, T, H*D]), the block's output gradient and its
    residual sum.
    """
    bt = sh.b * sh.t
    mlp = ((2 if cfg.model.mlp == "gated" else 1) + (0 if _saves_input(flags, "w2") else 1)) * bt * sh.f * sh.s
    attention = 4 * bt * sh.q * sh.s
    residual = sh.b * sh.tn * sh.h * sh.s
    return mlp + residual, attention + 2 * residual


def _float8_transient(sh: _Shape, held: list[_Param], local: dict[str, tuple[int, ...]], gathered: bool,
                      compiled: bool) -> tuple[int, int]:
    """optimize.float8: what one block linear's casts to float8 hold at once above the block's own tensors,
    at the largest (forward, backward). What autograd saves does not change (torchao saves the bf16 input).
    Eager, casting n bf16 elements holds 9n bytes at its peak (torchao 0.18's `_ToFloat8ConstrFunc`: an fp32
    copy scaled, clamped by `to_fp8_saturated`, and the 1-byte result); compiled, the fused cast leaves only
    the result. Forward casts the input x, then the weight w; backward the output gradient g, the weight,
    g again (for the weight gradient) and x again. Under FSDP2's float8 all-gather (`gathered`) the weight
    arrives cast already. Counted from torchao's code, not measured: float8 does not run on a CPU."""
    bt = sh.b * sh.t
    fwd = back = 0
    for p in held:
        shape = local[p.name]
        if p.layer is None or not converts(shape, p.trainable):
            continue
        g, x, w = bt * shape[0], bt * shape[1], 0 if gathered else _numel(shape)
        if compiled:
            fwd, back = max(fwd, x + w), max(back, 2 * g + x + w)
        else:
            fwd = max(fwd, 9 * x, x + 9 * w)
            back = max(back, 9 * g, g + 9 * w, 10 * g + w, 2 * g + w + 9 * x)
    return fwd, back


def _exchange_bytes(m: Any, sh: _Shape) -> int:
    """Context parallelism: what one attention's all-to-alls hold at once above the saved activations (0
    without): q, k, v of the chunk as projected, and for the tensor being exchanged its send and receive
    blocks (`parallel.context._all_to_all`); key/value heads repeated up to the query heads when fewer
    than cp per rank. The backward's exchange of the three gradients holds as much."""
    if sh.cp == 1:
        return 0
    bt = sh.b * sh.t
    kv = sh.kv if (m.num_kv_heads * sh.heads // m.num_heads) % sh.cp == 0 else sh.q
    return bt * sh.s * (sh.q + 2 * kv) + 2 * bt * sh.s * sh.q


def _mlp_bytes(cfg: Any, sh: _Shape, flags: dict[str, bool]) -> int:
    """The part of a block's saved activations that its MLP keeps (freed before attention's backward)."""
    bt = sh.b * sh.t
    s = sh.s
    if cfg.model.mlp == "gated":
        mlp = bt * sh.f * s * 2
    else:
        mlp = bt * sh.f * s * (1 if cfg.model.activation != "relu" else 0)
    if _saves_input(flags, "w2"):
        mlp += bt * sh.f * s
    return mlp


def _batch_bytes(cfg: Any, lay: _Layout, device: str) -> int:
    """The step's token batches (int64): input ids and labels, document and position ids when present;
    under a pipeline also each pipeline step's concatenation of its micro-batches."""
    keys = 4 if _document_positions(cfg) or _document_mask(cfg, "cpu") else 2
    rows = lay.micro_batch
    if device == "cpu":
        total = lay.accumulation * rows * (lay.seq + 1) * 8  # the loader hands over the whole step at once
        total += lay.accumulation * rows * lay.seq * 8 * (keys - 2)
    else:
        total = rows * lay.seq * 8 * keys  # one micro-batch copied to the device
    if lay.pp > 1:
        total += lay.micro_batch_num * rows * lay.seq * 8 * keys
    return total


@dataclass(frozen=True)
class _Fsdp:
    """What FSDP2 (ZeRO 2/3) holds unsharded, in the compute dtype, on one rank."""

    keep_all: bool  # blocks stay gathered from their forward to their backward (ZeRO-2, zero-bubble PP)
    root: int  # embeddings / final norm / output projection, gathered from forward to the end of backward
    blocks: dict[int, int]  # per block: its gathered parameters
    padded: dict[int, int]  # per block: the flat all-gather buffer (dim 0 padded to the shard count)
    root_grad: int  # unsharded gradients of the root's trainable parameters (reduced at the very end)
    block_grad: dict[int, int]  # per block: its unsharded gradients before their reduce-scatter
    # Gradients accumulated unsharded (reduced once per step) in the dtype autograd makes them: a later
    # micro-batch's gradients are added into them in place, one tensor at a time, not held as a block.
    in_place: bool = False

    def forward(self) -> int:
        """Gathered at the end of forward (the loss)."""
        return self.root + (sum(self.blocks.values()) if self.keep_all else 0)

    def backward_at(self, layer: int, order: list[int], grad_share: float, accumulated: bool = False) -> int:
        """Gathered while `layer` runs its backward (`grad_share` of its gradients computed so far;
        `accumulated`: earlier micro-batches' unsharded gradients exist, counted by the caller)."""
        if accumulated and self.in_place:
            grad_share, root_grad = 0.0, 0
        else:
            root_grad = self.root_grad
        if self.keep_all:
            gathered = sum(self.blocks[j] for j in order[order.index(layer):])
        else:  # this block, and the next one's all-gather buffer (backward prefetch)
            nxt = order[order.index(layer) + 1] if order.index(layer) + 1 < len(order) else None
            gathered = self.blocks[layer] + (self.padded[nxt] if nxt is not None else 0)
        return self.root + root_grad + gathered + int(self.block_grad[layer] * grad_share)

    def head_backward(self, order: list[int], loss_in_root: bool) -> int:
        """Gathered above `forward()` while the head's backward runs: with the loss inside the root's
        forward (the chunked loss), the root's pre-backward has already prefetched the last block's
        all-gather buffer (ZeRO-3; ZeRO-2 kept every block gathered). The plain path's cross-entropy
        backward runs before the gradient reaches the root."""
        return self.padded[order[0]] if order and loss_in_root and not self.keep_all else 0

    def head_forward(self, layers: list[int], loss_in_root: bool) -> int:
        """Above `forward()` while a loss inside the root's forward runs: the last block's all-gather
        buffer, which FSDP2 frees only at the root's post-forward."""
        return self.padded[layers[-1]] if layers and loss_in_root else 0


def _fsdp(lay: _Layout, prec: _Precision, held: list[_Param], local: dict[str, tuple[int, ...]],
          layers: dict[int, int], float8: bool = False) -> Optional[_Fsdp]:
    if lay.zero < 2:
        return None
    c, n = prec.compute, lay.dp_shard

    def gathered(p: _Param) -> int:  # optimize.float8: the converted linears' weights are gathered in 1 byte
        return 1 if float8 and p.layer is not None and converts(local[p.name], p.trainable) else c

    blocks = {i: sum(_numel(local[p.name]) * gathered(p) for p in held if p.layer == i) for i in layers}
    padded = {i: sum(_fsdp_shard(local[p.name], n) * n * gathered(p) for p in held if p.layer == i) for i in layers}
    grads = {i: sum(_numel(local[p.name]) for p in held if p.layer == i and p.trainable) * c for i in layers}
    root = sum(_numel(local[p.name]) for p in held if p.layer is None) * c
    # The embedding's gradient comes last, after every block's backward.
    root_grad = sum(_numel(local[p.name]) for p in held
                    if p.layer is None and p.trainable and p.where != "embedding") * c
    keep_all = lay.zero == 2 or (lay.schedule == "zero_bubble" and lay.pp > 1)
    in_place = not lay.reduce_every and lay.pp == 1 and c == prec.grad
    return _Fsdp(keep_all, root, blocks, padded, root_grad, grads, in_place)


def _root_reduction(lay: _Layout, prec: _Precision, trainable: list[_Param], stored: dict[str, int],
                    local: dict[str, tuple[int, ...]]) -> int:
    """Above the static bytes at the end of the last backward, when FSDP2 (or `replicate`) reduces the
    root's gradients (embeddings, final norm, output projection), after every block's: the blocks'
    reduced gradients, and the root's own copied into one flat buffer in the reduce dtype (then
    freed) and reduced into an output buffer (1/dp_shard of it; `replicate`'s world-1 "reduce-
    scatter" copies the input divided by the divide factor, one more temporary of the whole group).
    Reduced every micro-batch, the root's earlier gradients exist already and the output is added to
    them. The block activations are gone by then; the root's gathered parameters are resharded."""
    root = [p for p in trainable if p.layer is None]
    if not root:
        return 0
    n = lay.dp_shard if lay.zero >= 2 else 1
    g = prec.grad
    unsharded = sum(_numel(local[p.name]) for p in root) * g
    flat = sum(_fsdp_shard(local[p.name], n) * n for p in root) * g  # padded to whole shards
    out = flat // n
    div = flat if n == 1 else 0
    blocks = sum(stored[p.name] for p in trainable if p.layer is not None) * g  # reduced (sharded) by now
    earlier = sum(stored[p.name] for p in root) * g if (lay.reduce_every and lay.zero >= 2
                                                         and lay.accumulation > 1) else 0
    return blocks + earlier + max(unsharded + flat, flat + out + div)


def _replicate_buffers(lay: _Layout, prec: _Precision, held: list[_Param], local: dict[str, tuple[int, ...]]) -> int:
    """ZeRO 0/1 (FSDP2's `replicate`): an unsharded copy of every parameter it manages, in the compute
    dtype, from the first forward to the end of backward. Frozen parameters already stored in 16 bits
    it does not manage (they compute as they are)."""
    if lay.zero >= 2 or lay.dp == 1:
        return 0
    return sum(_numel(local[p.name]) for p in held if p.trainable or (prec.frozen == 4 and not p.quant)) \
        * prec.compute


def _state_bytes(cfg: Any, prec: _Precision) -> int:
    """Bytes of one element of an optimizer moment: train.optimizer_state_dtype bf16 makes them 2."""
    return 2 if cfg.train.optimizer_state_dtype == "bf16" else prec.state


def _paged_8bit_state_bytes(n: int, fallback: int) -> int:
    """One bitsandbytes 8-bit moment of a tensor of n elements: a byte per element, an fp32 absmax per block
    of 256 and its 256-entry fp32 code map; under 4096 elements (its min_8bit_size) an fp32 moment."""
    if n >= 4096:
        return n + -(-n // 256) * 4 + 256 * 4
    return n * 4


def _8bit_state_bytes(n: int, fallback: int) -> int:
    """One torchao 8-bit moment of a tensor of n (local) elements: a byte per element, an fp32 scale
    per block of 256 and its 256-entry fp32 code map; under 4096 elements, or not a whole number of
    blocks, a plain moment of the parameter's dtype (`fallback` bytes)."""
    if n >= 4096 and n % 256 == 0:
        return n + n // 256 * 4 + 256 * 4
    return n * fallback


def _update_temp(cfg: Any, prec: _Precision, groups: list[list[int]], device: str) -> int:
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


def _norm_temp(sizes: Iterable[int]) -> int:
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


def _in_backward_updates(cfg: Any, lay: _Layout, prec: _Precision, trainable: list[_Param], stored: dict[str, int],
                         local: dict[str, tuple[int, ...]], device: str) -> dict[Any, int]:
    """The optimizer in backward, per block (and "head", "embedding"): the largest of its tensors'
    gradient being applied (with its 16-bit copy on the way into an fp32 master at O2) and that
    update's temporaries; a tied embedding matrix's gradient is held from the output projection's
    backward to the embedding's."""
    size = {p.name: stored[p.name] if lay.zero >= 2 else _numel(local[p.name]) for p in trainable}
    tied = size.get("tok_embeddings.weight", 0) * prec.grad if cfg.model.tie_embeddings else 0
    out: dict[Any, int] = {}
    for p in trainable:
        where = p.layer if p.layer is not None else p.where
        n = size[p.name]
        one = n * (prec.grad + (prec.compute if prec.masters else 0)) + _update_temp(cfg, prec, [[n]], device) \
            + _undo_copies(cfg, prec, n, device)
        out[where] = max(out.get(where, 0), one + (tied if where != "head" else 0))
    return out


def _undo_copies(cfg: Any, prec: _Precision, n: int, device: str) -> int:
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
    return n * (work + moments * _state_bytes(cfg, prec)) + (0 if t.optimizer == "sgd" else 4)


def _optimizer_phase(cfg: Any, lay: _Layout, prec: _Precision, static: int, grad_bytes: int, state_elems: int,
                     trainable: list[_Param], stored: dict[str, int], local: dict[str, tuple[int, ...]],
                     offload: bool, device: str = "cuda") -> int:
    """Total during clipping and the update: parameters, gradients, state and the update's temporaries
    (`_update_temp`: what the kernel train.optimizer_impl resolves to on `device` allocates)."""
    if offload:
        return static  # the update runs on the host
    if cfg.train.optimizer_in_backward:
        return static  # the updates ran in the backward: no gradient is left
    size = {p.name: stored[p.name] if lay.zero >= 2 else _numel(local[p.name]) for p in trainable}
    if lay.zero == 1:  # the groups of ZeRO-1's wrapped optimizer hold this rank's parts
        size = {p.name: math.prod(_zero1_part(p, local[p.name], lay)) for p in trainable}
    groups = [[size[p.name] for p in trainable if len(p.shape) >= 2],  # the weight-decay group
              [size[p.name] for p in trainable if len(p.shape) < 2]]
    total = static + grad_bytes + max(_update_temp(cfg, prec, groups, device), _norm_temp(size.values()))
    if lay.zero == 1:
        # The all-gather of the updated parts, one bucket at a time: this rank's part of it and every
        # rank's as received.
        gathered = (lay.dp + 1) * _zero1_gather_elements(trainable, local, lay) * prec.param
        total = max(total, static + grad_bytes + gathered)
    return total


def _offloads_optimizer(cfg: Any) -> bool:
    """optimize.offload_optimizer cpu (`memory.offload.HostMasters`); with offload_params on as well, FSDP2's
    CPU offload steps the optimizer on the host instead."""
    return cfg.optimize.offload_optimizer == "cpu" and not cfg.optimize.offload_params


def _streams_optimizer(cfg: Any) -> bool:
    """optimize.offload_optimizer stream (`memory.streamed_optimizer.StreamedAdam`)."""
    return cfg.optimize.offload_optimizer == "stream" and not cfg.optimize.offload_params


def _host_masters(cfg: Any) -> bool:
    """Whether the fp32 masters of O2 live in host memory (either offload_optimizer engine), so that FSDP2
    keeps 16-bit shards under data parallelism."""
    return _offloads_optimizer(cfg) or _streams_optimizer(cfg)


def _streamed_updates(cfg: Any, lay: _Layout, prec: _Precision, trainable: list[_Param], stored: dict[str, int],
                      local: dict[str, tuple[int, ...]], device: str, in_backward: bool) -> dict[Any, int]:
    """optimize.offload_optimizer stream, per block (and "head", "embedding"): the most the update of one of
    its tensors holds on the device beyond the weights: its state copied in (moments, step, fp32 master at
    O2), the next tensor's (fetched ahead), on an accelerator the one before's (its copy back may still be in
    flight), its fp32 work copies (the 16-bit gradient at O2, 16-bit moments widened); with the optimizer in
    backward also its gradient. The order is the optimizer's (matrices, then vectors, each in the model's
    order) for a step after the backward; in backward the reverse of it on the first step and the order the
    gradients arrive in (about the reverse of the model's) after it."""
    size = {p.name: min(stored[p.name] if lay.zero >= 2 else _numel(local[p.name]), OPTIMIZER_CHUNK_ELEMENTS)
            for p in trainable}  # the state streams in units of at most this many elements
    state_bytes = _state_bytes(cfg, prec)
    work = 4 if prec.masters or prec.param == 4 else prec.param  # the dtype the update runs in
    torchao = cfg.train.optimizer == "adamw_8bit"
    weights = 4 if prec.masters else prec.param

    def copied(n: int) -> int:  # what one unit of a tensor's state takes on the device
        moments = 2 * _8bit_state_bytes(n, state_bytes) - (2 * 256 * 4 if n >= 4096 and n % 256 == 0 else 0) \
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


def _gradients_in_transit(lay: _Layout, prec: _Precision, trainable: list[_Param], stored: dict[str, int],
                          local: dict[str, tuple[int, ...]]) -> dict[Any, int]:
    """optimize.offload_optimizer on an accelerator, per block (and "head", "embedding"): its largest
    gradient, in the weights' dtype, which stays on the device until it is copied to the host."""
    out: dict[Any, int] = {}
    for p in trainable:
        where = p.layer if p.layer is not None else p.where
        n = stored[p.name] if lay.zero >= 2 else _numel(local[p.name])
        out[where] = max(out.get(where, 0), n * prec.param)
    return out
