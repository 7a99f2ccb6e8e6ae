"""The step-time model: how long one optimizer step of a run config takes on given hardware.

A step is the busiest pipeline rank's work, summed from parts (seconds per optimizer step):

- compute: the rank's matmul FLOPs over all its micro-batches at `compute_efficiency` x peak. FLOPs
  per layer and head come from `memory.estimate.run_flops` (`models.flops.training_flops`, the count
  the trainer's MFU uses): 6 per trainable weight per token, 4 per frozen weight (LoRA, freeze) whose
  input needs a gradient, 2 per frozen weight with nothing trainable below it, plus the attention
  scores; split over tensor-parallel ranks and counted per pipeline stage (the last stage also runs
  the output projection, so stages are rarely equal). With `optimize.float8` on hardware with float8
  tensor cores (`tflops_8`), the block linears it converts (`parallel.float8.converts`) run at the
  float8 peak instead, and their casts (inputs, output gradients, weights) cost FLOAT8_CAST_BYTES per
  element at the memory bandwidth (fused under run.compile, several passes eager); under ZeRO 2/3 their
  weights are all-gathered in 1 byte.
- recompute: full recompute runs the forward of each recomputed layer again; selective recompute
  (`parallel.recompute`) runs again the block linears whose outputs it does not keep and that its
  recompute reaches (k, o and the up projection of a gated MLP; LoRA's low-rank matmuls) plus the
  element-wise work, taken as `SELECTIVE_COST` of a layer's forward; per layer as
  `optimize.layer_recompute` says (recompute auto: its plan). The chunked loss computes its logits
  again in backward under a pipeline, tensor parallelism or fp16 (2 FLOPs per output weight per
  token); elsewhere it makes its gradients in forward and repeats nothing.
- tp_comm: per layer and micro-batch, forward and backward, two all-reduces of the [b, s, h]
  activations (or the same volume as all-gather + reduce-scatter with sequence parallelism), plus
  the vocabulary-parallel embedding and output; recompute repeats the forward's. Not overlapped.
  It also holds `tp_layer_overhead_us` of host work per layer and micro-batch (DTensor's dispatch:
  hidden behind the kernels of a GPU, paid in full by a CPU).
- dp_comm: gradients reduced (all-reduce for ZeRO 0/1, once per step; reduce-scatter for 2/3, once
  per micro-batch or, with `parallel.reduce_gradients: once_per_step`, once per step, and under a
  pipeline once per pipeline step; in the reduce dtype), ZeRO 1's all-gather of updated parameters,
  the all-gathers of ZeRO 2 (once per micro-batch, FSDP2 reshards after each backward) and ZeRO 3
  (forward and backward of every micro-batch). The part that `overlap` of the concurrent compute can hide is hidden.
- cp_comm: context parallelism (`parallel.context`, DeepSpeed-Ulysses): per layer and micro-batch four
  all-to-alls forward (q, k, v, attention's output) and four backward, each of the rank's chunk of
  [b, s / cp, heads x head_dim / tp] (key/value heads repeated up to the query heads when fewer than cp
  per rank); recompute repeats the forward's. Not overlapped (attention waits for them). Compute,
  activations and tensor-parallel traffic are per rank for s / cp tokens, and the gradients are reduced
  over dp x cp ranks (dp_comm).
- ep_comm: expert parallelism (`parallel.expert`): per MoE block and micro-batch two all-to-alls forward (the
  routed copies to their experts' ranks and the results back) and two backward (their gradients), each of
  the rank's [tokens x num_experts_per_tok, hidden] copies over the `expert_parallel` ranks; a fully
  recomputed block exchanges its forward's again. Not overlapped (the experts wait for their tokens). The
  load is taken as even unless the plan is given an imbalance (`Work.expert_imbalance`, `shardwise plan
  --expert-imbalance`): the busiest rank then receives and computes that many times its even share of the
  copies, and every rank waits for it (the step records' `expert_load` shows how far from even a run is).
  Each rank holds num_experts / expert_parallel of every block's experts, computes and updates only those,
  and sums their gradients over the
  data-parallel replicas that hold the same experts (when expert_parallel is below data_parallel: after the
  backward under ZeRO 0/1; under ZeRO 2/3 FSDP2 shards the experts over those replicas, reduce-scattering
  their gradients and gathering them like the other weights); the other weights are reduced over every
  data-parallel rank as usual.
- pp_comm: a point-to-point send of the stage's activations (forward) and their gradients (backward)
  per micro-batch and model chunk.
- bubble: idle pipeline time, one micro-batch time of each rank other than the busiest (the fill and
  drain pass through them; (pp - 1) micro-batch times for equal stages), divided by the virtual
  stages (interleaving) and by 3 for the zero-bubble schedules, whose weight-gradient work fills
  most of it (the zero-bubble paper's ZB-H1 estimate).
- optimizer: AdamW streams the weights it steps, gradients and both moments as stored (4, 2 or 1 bytes;
  torchao's 8-bit update also writes and reads its fp32 moments) through memory once per step: bytes /
  memory bandwidth (`_bytes`). With the update on the host it runs at host speed (HOST_ADAM_GBPS).
- offload: what crosses the host link (`host_bandwidth_gbps`) and no compute hides.
  `offload_optimizer: stream` (memory.streamed_optimizer): each parameter's moments (and O2 master) come
  in and go back every step, hidden behind the backward with the optimizer in backward, else behind the
  other parameters' updates. bitsandbytes' paged optimizers: the part of their state that does not fit
  beside the run's peak is paged out and back in every step, not hidden (`_paged_traffic`).
  `offload_optimizer: cpu` (memory.offload.HostMasters): each micro-batch's gradients go to the host as
  backward makes them (hidden behind that backward's compute up to `comm_overlap`), the host steps
  AdamW, then the 16-bit weights come back before the next forward (not hidden: it waits for them).
  `offload_params` (FSDP2's CPU offload): the shards are copied to the device before every all-gather
  (forward and backward; counted with dp_comm, which hides it like the gathers), the sharded gradients
  go back and the updated shards come back with the step. On one accelerator the same, without the
  collectives: every block's weights cross the host link for its forward and again for its backward
  (counted with the host link's other copies, below).
  `offload_activations` (memory.offload.SavedCopies): the saved tensors go to the host in the forward and
  come back a block ahead in the backward, on a side stream; on a CPU not hidden.
  The host link per pass (`_host_link`): what each forward and each backward moves in each direction
  (weights in under one-device offload_params, activations out or in, the streamed state in and out
  with the optimizer in backward), the two directions at once, hidden behind that pass's compute up to
  `comm_overlap` but never below one block's share.

Collectives use ring costs: all-reduce 2 (n-1)/n x bytes / bandwidth + 2 (n-1) latencies, all-gather
and reduce-scatter half that; a group that spans nodes uses the inter-node link. On a CPU, a device
is one process: when more processes are busy computing (on average over the step) than the cores
give, they share them, and are slower at computing and at moving bytes alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .config import RunConfig
from .errors import ConfigError
from .hardware import Hardware
from .memory.estimate import estimate_memory, head_recomputes_logits, offloaded_share, run_flops, trainable_shapes
from .models.config import ModelConfig
from .models.flops import TrainingFlops, count_parameters_by_kind, feed_forward_weights, flops_per_token
from .parallel.data_parallel import ONE_PROCESS_ZERO_STAGE
from .parallel.float8 import converts, float8_all_gather, float8_on
from .parallel.pipeline import schedule_style, stage_layer_counts
from .parallel.recompute import BLOCK_MATMULS, down_output_needed, selective_saved_matmuls
from .units import GIB

SELECTIVE_COST = 0.1  # selective recompute: share of a layer's forward time redone in element-wise ops
ZERO_BUBBLE_FACTOR = 3.0  # zero-bubble schedules leave about 1/3 of 1F1B's bubble
ADAM_BYTES = 32  # AdamW per fp32 parameter: read p, g, m, v, write p, m, v, and the clipping norm reads g
MASTER_BYTES = 8  # O2 without FSDP2: read the fp32 master, write the 16-bit copy
HOST_ADAM_GBPS = 10.0  # offloaded optimizer: host memory rate per device for CPU AdamW
# optimize.float8: bytes moved per element of each dynamic float8 cast (torchao, tensorwise): compiled, the
# amax pass reads the bf16 tensor (2) and the fused scale-and-cast reads it again and writes float8 (2 + 1);
# eager, abs, max, the fp32 copy, the scaling, the clamp and the cast each go through memory (33).
FLOAT8_CAST_BYTES = {"compiled": 5, "eager": 33}


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, by part, and what follows from them."""

    compute: float = 0.0
    recompute: float = 0.0
    reference: float = 0.0  # preference tuning's reference model's forward (LoRA's adapters off, a frozen copy)
    tp_comm: float = 0.0
    dp_comm: float = 0.0
    pp_comm: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0
    bubble: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0
    tokens_per_step: int = 0
    devices: int = 1
    model_flops_per_token: float = 0.0
    peak_flops: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    PARTS = ("compute", "recompute", "reference", "tp_comm", "dp_comm", "pp_comm", "cp_comm", "ep_comm", "bubble",
             "optimizer", "offload")

    @property
    def total(self) -> float:
        """The step time."""
        return sum(getattr(self, p) for p in self.PARTS)

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over all devices."""
        return self.tokens_per_step / self.total

    @property
    def tokens_per_s_per_device(self) -> float:
        """Tokens per second per device (seed 003's figure divided by the devices)."""
        return self.tokens_per_s / self.devices

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation as the trainer reports it (flops_per_token x tokens/s per device / peak)."""
        return self.tokens_per_s_per_device * self.model_flops_per_token / self.peak_flops

    def parts(self) -> dict[str, float]:
        """Non-zero parts, seconds."""
        return {p: getattr(self, p) for p in self.PARTS if getattr(self, p) > 0}

    def breakdown(self, top: int = 4) -> str:
        """'compute 81%, tp_comm 12%, ...': the `top` largest parts of at least 0.5%."""
        total = self.total
        items = sorted(self.parts().items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {100 * t / total:.0f}%" for name, t in items[:top] if t >= 0.005 * total)


# --- FLOPs and parameters per pipeline rank -------------------------------------------------------


@dataclass
class RankLoad:
    """What one pipeline rank holds and computes (whole model widths; divide by tp for a device)."""

    layers: int = 0
    chunks: int = 1
    embedding: bool = False
    head: bool = False
    flops_per_token: float = 0.0          # forward + backward, with frozen weights' savings
    routed_flops_per_token: float = 0.0   # ... of those, MoE routers' and routed experts': whole on every TP rank
    latent_down_flops_per_token: float = 0.0  # ... latent attention's down projections: whole on every TP rank
    recompute_flops_per_token: float = 0.0
    reference_flops_per_token: float = 0.0  # preference tuning's reference model: a forward without gradient
    selective_flops_per_token: float = 0.0  # forward FLOPs of the selectively recomputed layers
    recompute_collectives: float = 0.0  # tensor-parallel collective volumes the recomputed forwards repeat
    float8_flops_per_token: float = 0.0  # optimize.float8: the part of flops_per_token in float8 matmuls
    float8_recompute_flops_per_token: float = 0.0  # ... and of recompute_flops_per_token
    float8_cast_elements_per_token: float = 0.0  # elements cast to float8 per token (inputs, output gradients)
    float8_params: int = 0  # converted weights: cast twice per micro-batch, all-gathered in 1 byte under ZeRO 2/3
    params: int = 0
    trainable: int = 0
    moe_layers: int = 0  # mixture-of-experts blocks
    expert_params: int = 0  # their routed experts' weights (all of them: expert parallelism divides them)
    expert_trainable: int = 0  # ... of those, the ones that train


def _layer_params(m: ModelConfig, layer: int) -> int:
    """Parameters of block `layer` (the blocks' mean for a dense model, whose blocks are alike)."""
    kinds = count_parameters_by_kind(m)
    per_norm = kinds["norm"] // (2 * m.num_layers + 1)
    if not m.num_experts:
        return (kinds["attention"] + kinds["mlp"]) // m.num_layers + 2 * per_norm
    dense_bias = (2 * m.intermediate_size + m.hidden_size) if m.mlp_bias and not m.is_moe_layer(layer) else 0
    return (kinds["attention"] + kinds["norm"] - per_norm) // m.num_layers + feed_forward_weights(m, layer) \
        + dense_bias


def _expert_params(m: ModelConfig, layer: int) -> int:
    """Routed experts' weight elements of block `layer` (0 in a dense block)."""
    return 3 * m.num_experts * m.hidden_size * m.moe_intermediate_size if m.is_moe_layer(layer) else 0


def lora_adapter_params(cfg: RunConfig) -> int:
    """Adapter parameters of the first layer (the planner takes all layers alike), from the
    parameter table the memory estimate and the FLOP count use."""
    if cfg.lora is None:
        return 0
    return sum(math.prod(shape) for name, shape in trainable_shapes(cfg).items() if name.startswith("layers.0."))


@dataclass(frozen=True)
class Work:
    """What a step computes whatever the layout: counted once per plan, shared by every layout timed."""

    flops: TrainingFlops  # per token, by layer and head (`memory.estimate.run_flops`)
    adapter_params: int  # LoRA parameters per layer
    float8: tuple["Float8Layer", ...] = ()  # per layer, what optimize.float8 converts (empty when off)
    # Expert parallelism: the busiest rank's routed copies over the even share (>= 1; a run's step records give
    # each block's busiest expert over the mean, `expert_load`): that rank's experts and exchanges gate the step.
    expert_imbalance: float = 1.0


@dataclass(frozen=True)
class Float8Layer:
    """What optimize.float8 converts in one block (`parallel.float8.converts`), per token."""

    flops: float = 0.0  # forward + backward FLOPs of the converted linears (6 per weight)
    forward_flops: float = 0.0
    cast_elements: float = 0.0  # each converted linear casts its input twice and its output gradient twice
    params: int = 0  # converted weight elements
    every_linear: bool = False  # every block linear converted (selective recompute's matmuls are float8)


def float8_layers(cfg: RunConfig) -> tuple[Float8Layer, ...]:
    """Per block, what optimize.float8 converts (empty when it is off)."""
    if not float8_on(cfg):
        return ()
    weights: dict[int, list[tuple[int, ...]]] = {i: [] for i in range(cfg.model.num_layers)}
    for name, shape in trainable_shapes(cfg).items():
        if name.startswith("layers.") and name.endswith(".weight") and len(shape) == 2:
            weights[int(name.split(".")[1])].append(shape)
    out = []
    for i in range(cfg.model.num_layers):
        kept = [s for s in weights[i] if converts(s, True)]
        elems = sum(out_f * in_f for out_f, in_f in kept)
        out.append(Float8Layer(flops=6.0 * elems, forward_flops=2.0 * elems,
                               cast_elements=float(sum(2 * (out_f + in_f) for out_f, in_f in kept)), params=elems,
                               every_linear=bool(kept) and len(kept) == len(weights[i])))
    return tuple(out)


def work_of(cfg: RunConfig, expert_imbalance: float = 1.0) -> Work:
    """The layout-independent work of a run config (`expert_imbalance`: see `Work`)."""
    if not expert_imbalance >= 1.0:
        raise ConfigError(f"expert imbalance {expert_imbalance}: the busiest rank's routed copies over the even "
                          "share, at least 1.0 (an even load)")
    return Work(run_flops(cfg), lora_adapter_params(cfg), float8_layers(cfg), expert_imbalance)


def selective_recompute_flops(cfg: RunConfig, layer: int, shapes: dict[str, tuple[int, ...]]) -> float:
    """Forward FLOPs per token that selective recompute runs again in block `layer`: the block linears
    whose outputs it does not keep, up to the down projection (the recompute stops at the last tensor
    backward needs, its input, unless a dropout or an adapter after it saves one), and LoRA's matmuls
    (`shapes`: the trainable parameters, adapters among them)."""
    m = cfg.model
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    dims = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "w1": (h, f), "w3": (h, f), "w2": (f, h)}
    gated = m.mlp == "gated"
    prefix = f"layers.{layer}."
    adapters = {n: s for n, s in shapes.items() if n.startswith(prefix) and ".lora_" in n}
    w2_reached = down_output_needed(m.dropout, any(".feed_forward.w2." in n for n in adapters))
    kept = selective_saved_matmuls(gated, w2_reached)
    total = 0.0
    for name in BLOCK_MATMULS:
        if name in kept or (name == "w3" and not gated) or (name == "w2" and not w2_reached):
            continue
        total += 2 * dims[name][0] * dims[name][1]
    return total + sum(2 * math.prod(s) for s in adapters.values())


def rank_loads(cfg: RunConfig, work: Work | None = None) -> list[RankLoad]:
    """Per pipeline rank: layers, embedding/head ownership, training FLOPs per token, parameters."""
    m, p = cfg.model, cfg.parallel
    pp, v = p.pipeline_parallel, p.virtual_stages
    stages = stage_layer_counts(m.num_layers, pp * v, p.stage_layers)
    if schedule_style(p.schedule, v) == "v":
        owner = [s if s < pp else 2 * pp - 1 - s for s in range(pp * v)]
    else:
        owner = [s % pp for s in range(pp * v)]
    work = work or work_of(cfg)
    flops, adapters = work.flops, work.adapter_params
    shapes = trainable_shapes(cfg) if cfg.lora is not None else {}  # the adapters selective recompute reruns
    embed = m.vocab_size * m.hidden_size + (m.max_position_embeddings * m.hidden_size if m.position == "learned" else 0)
    head_weights = m.vocab_size * m.hidden_size

    loads = [RankLoad(chunks=v) for _ in range(pp)]
    reference_forward = cfg.reference_mode() in ("adapters_off", "frozen_copy")
    first_layer = 0
    for stage, n_layers in enumerate(stages):
        load = loads[owner[stage]]
        load.layers += n_layers
        here = range(first_layer, first_layer + n_layers)
        load.flops_per_token += sum(flops.layers[i] for i in here)
        load.routed_flops_per_token += sum(flops.routed[i] for i in here if flops.routed)
        load.latent_down_flops_per_token += sum(flops.latent_down[i] for i in here if flops.latent_down)
        for i in here:
            if work.float8:
                f8 = work.float8[i]
                load.float8_flops_per_token += f8.flops
                load.float8_cast_elements_per_token += f8.cast_elements
                load.float8_params += f8.params
            layer_params = _layer_params(m, i)
            trains = cfg.lora is None and i >= cfg.freeze.layers
            load.params += layer_params + adapters
            load.trainable += adapters if cfg.lora is not None else (layer_params if trains else 0)
            if m.is_moe_layer(i):
                load.moe_layers += 1
                load.expert_params += _expert_params(m, i)
                load.expert_trainable += _expert_params(m, i) if trains else 0
        # Per layer of the chunk (full every `recompute_every`-th block of each chunk, from its first).
        for i, mode in zip(here, cfg.optimize.layer_recompute(list(here))):
            if reference_forward:  # preference tuning's reference model: one more forward, no gradient
                load.reference_flops_per_token += flops.layers_forward[i]
            if mode == "full":
                load.recompute_flops_per_token += flops.layers_forward[i]
                load.recompute_collectives += 2
                if work.float8:
                    load.float8_recompute_flops_per_token += work.float8[i].forward_flops
            elif mode == "selective":
                load.recompute_flops_per_token += selective_recompute_flops(cfg, i, shapes)
                if work.float8 and work.float8[i].every_linear:
                    load.float8_recompute_flops_per_token += selective_recompute_flops(cfg, i, shapes)
                load.selective_flops_per_token += flops.layers_forward[i]
                # Sequence parallel: the two all-gathers and o's reduce-scatter of the four; else o's all-reduce.
                load.recompute_collectives += 1.5 if p.sequence_parallel and p.tensor_parallel > 1 else 1
        first_layer += n_layers
        if stage == 0:
            load.embedding = True
            load.params += embed
            load.trainable += 0 if (cfg.lora is not None or cfg.freeze.embeddings) else embed
        if stage == pp * v - 1:
            load.head = True
            load.flops_per_token += flops.head
            if head_recomputes_logits(cfg):
                load.recompute_flops_per_token += 2 * head_weights
            if reference_forward:
                load.reference_flops_per_token += 2 * head_weights
            head_params = m.hidden_size + (0 if (m.tie_embeddings and pp == 1) else head_weights)
            load.params += head_params
            load.trainable += 0 if cfg.lora is not None else head_params
    return loads


def model_flops_per_token(cfg: RunConfig) -> float:
    """The FLOPs per token MFU is measured against: what a step computes, frozen weights' savings
    included (`memory.estimate.run_flops`, the trainer's count)."""
    return run_flops(cfg).total


# --- communication ------------------------------------------------------------------------------


def _link(hw: Hardware, spans_nodes: bool, slowdown: float) -> tuple[float, float]:
    """(bytes/s, latency s) of a link, with the achievable share of its bandwidth."""
    if spans_nodes:
        bw, lat = hw.inter_bandwidth_gbps, hw.inter_latency_us
    else:
        bw, lat = hw.intra_bandwidth_gbps, hw.intra_latency_us
    return bw * 1e9 * hw.comm_efficiency / slowdown, lat * 1e-6 * slowdown


def all_reduce_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """Ring all-reduce of `nbytes` over `n` devices."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def gather_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is `nbytes`, over `n` devices."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def all_to_all_time(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """All-to-all of `nbytes` per device over `n` devices: each keeps 1/n and sends the rest, n - 1 messages."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def p2p_time(nbytes: float, link: tuple[float, float]) -> float:
    """One point-to-point send."""
    bw, lat = link
    return nbytes / bw + lat


# --- the model ----------------------------------------------------------------------------------


def _bytes(cfg: RunConfig) -> dict[str, int]:
    """Bytes per element: activations, parameters as gathered, gradients as reduced, the optimizer step
    (read and write the weights it steps and both moments, read the gradient twice: the update and the
    clipping norm; at O2 also the master's copy into the 16-bit weight), one moment as stored."""
    level = cfg.optimize.level()
    half = cfg.optimize.mixed_precision != "fp32"
    weights = 2 if level == "O3" else 4  # what the update steps: fp32 masters at O2
    moment = _moment_bytes(cfg)
    # torchao's 8-bit AdamW materialises both moments in fp32 to requantise them block by block (written and
    # read back: the estimator's TORCHAO_COMPILED_TEMPORARIES); bitsandbytes' kernel works in registers.
    widened = 2 * 4 * 2 if cfg.train.optimizer == "adamw_8bit" else 0
    return {
        "activation": 2 if half else 4,
        "param": 2 if level in ("O2", "O3") else 4,
        "grad": 2 if level == "O3" else 4,  # FSDP2 reduces O2's gradients in fp32
        "adam": 2 * weights + 2 * weights + 4 * moment + widened + (MASTER_BYTES if level == "O2" else 0),
        "moment": moment,
    }


def _moment_bytes(cfg: RunConfig) -> int:
    """Bytes of one element of one Adam moment as stored: 1 for the 8-bit optimizers (their block scales
    are under 2% more), 2 with bf16 state or at O3, else 4."""
    t = cfg.train
    if t.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 1
    if t.optimizer == "paged_adamw" or t.optimizer_state_dtype == "fp32":
        return 4
    return 2 if t.optimizer_state_dtype == "bf16" or cfg.optimize.level() == "O3" else 4


def predict_step(cfg: RunConfig, devices: int, hw: Hardware, nodes: int | None = None,
                 work: Work | None = None) -> StepTime:
    """Predicted time of one optimizer step of `cfg` on `devices` devices of kind `hw`."""
    world = cfg.parallel.world_size(devices)
    nodes = nodes or hw.nodes_for(world)
    work = work or work_of(cfg)
    step = _predict(cfg, devices, hw, nodes, work, 1.0)
    per_node = max(1, world // nodes)
    if not hw.cores_per_node or per_node <= hw.cores_per_node:
        return step
    # CPU: a device is a process, and more processes than cores share the cores, but only while they
    # compute: a pipeline stage waiting in the bubble or a rank waiting on a message leaves its core
    # to the others. So the slowdown follows the processes busy on average.
    for _ in range(2):
        busy = per_node * step.detail["busy"] / step.total
        step = _predict(cfg, devices, hw, nodes, work, max(1.0, busy / hw.cores_per_node))
    return step


def _predict(cfg: RunConfig, devices: int, hw: Hardware, nodes: int, work: Work,
             slowdown: float) -> StepTime:
    """The step with compute, memory and links all `slowdown` times slower (CPU cores shared)."""
    p = cfg.parallel
    dp, tp, pp, v = p.dp_degree(devices), p.tensor_parallel, p.pipeline_parallel, p.virtual_stages
    cp = p.context_parallel
    world = dp * tp * pp * cp
    per_node = max(1, world // nodes)
    peak = hw.peak_tflops(cfg.optimize.mixed_precision) * 1e12
    rate = peak * hw.compute_efficiency / slowdown
    m = cfg.model
    seq, mbs = cfg.data.seq_length, cfg.train.micro_batch_size
    if cfg.data.kind == "preference":  # a pair is two rows
        mbs *= 2
    ga = cfg.gradient_accumulation(world)
    tokens_mb = mbs * seq // cp  # this rank's tokens of a micro-batch (context parallelism: its chunks)
    b = _bytes(cfg)
    loads = rank_loads(cfg, work)

    tp_link = _link(hw, tp > per_node, slowdown)
    dp_link = _link(hw, dp * cp * tp > per_node, slowdown)
    cp_link = _link(hw, cp * tp > per_node, slowdown)
    # Context parallelism: q and the output of every query head, k and v of the key/value heads (or repeated).
    kv_heads = m.num_kv_heads if (m.num_kv_heads // tp) % cp == 0 else m.num_heads
    exchange = tokens_mb * m.head_dim * b["activation"] / tp * (2 * m.num_heads + 2 * kv_heads)
    pp_link = _link(hw, nodes > 1, slowdown)
    act_bytes = tokens_mb * m.hidden_size * b["activation"]
    # Expert parallelism: each MoE block sends the rank's routed copies out and takes the results back.
    ep = p.expert_parallel if m.num_experts else 1
    ep_link = _link(hw, ep * tp > per_node, slowdown)
    copies = tokens_mb * m.num_experts_per_tok * m.hidden_size * b["activation"]
    # optimize.float8 where the hardware has float8 tensor cores (the planner refuses it elsewhere).
    rate8 = hw.tflops_8 * 1e12 * hw.compute_efficiency / slowdown if work.float8 and hw.tflops_8 else 0.0
    cast_bytes = FLOAT8_CAST_BYTES["compiled" if cfg.compiles(hw.kind) else "eager"]

    def float8_casts(load: RankLoad) -> float:
        """Memory-bound seconds of one micro-batch's float8 casts: activations and gradients per token,
        and each converted weight twice (forward, backward)."""
        elements = (tokens_mb * load.float8_cast_elements_per_token + 2 * load.float8_params) / tp
        return elements * cast_bytes / (hw.memory_bandwidth_gbps * 1e9 / slowdown)

    def rank_times(load: RankLoad) -> dict[str, float]:
        """Per micro-batch times of one pipeline rank."""
        # A MoE block's router and routed experts, and latent attention's down projections, run whole on every
        # tensor-parallel rank (parallel.tensor); under expert parallelism the busiest rank's experts take
        # `expert_imbalance` times the even share.
        routed = load.routed_flops_per_token * (tp - 1 + (work.expert_imbalance if ep > 1 else 1.0))
        whole = routed + load.latent_down_flops_per_token * (tp - 1)
        compute = tokens_mb * (load.flops_per_token - load.routed_flops_per_token + whole) / tp / rate
        recompute = tokens_mb * (load.recompute_flops_per_token
                                 + SELECTIVE_COST * load.selective_flops_per_token) / tp / rate
        reference = tokens_mb * load.reference_flops_per_token / tp / rate
        if rate8:  # optimize.float8: the converted linears at the float8 rate, and their casts
            compute += tokens_mb * load.float8_flops_per_token / tp * (1 / rate8 - 1 / rate) + float8_casts(load)
            recompute += tokens_mb * load.float8_recompute_flops_per_token / tp * (1 / rate8 - 1 / rate)
        # Forward and backward: two all-reduce volumes per layer each; recompute repeats (some of) the forward's.
        ar_per_layer = 4 + load.recompute_collectives / max(1, load.layers)
        volumes = load.layers * ar_per_layer + 2 * (int(load.embedding) + int(load.head))
        tp_comm = volumes * all_reduce_time(act_bytes, tp, tp_link)
        # DTensor's per-op dispatch: host work, so on a CPU it competes with compute (counted as busy).
        tp_host = load.layers * hw.tp_layer_overhead_us * 1e-6 * slowdown * (ar_per_layer / 4) if tp > 1 else 0.0
        # Sequence parallelism sends each TP rank's share of the sequence between stages.
        send = act_bytes / (tp if p.sequence_parallel else 1)
        pp_comm = 2 * load.chunks * p2p_time(send, pp_link) if pp > 1 else 0.0
        # Forward and backward exchange the same volume; a recomputed forward exchanges again (full recompute
        # counts 2 tensor-parallel volumes per layer, selective fewer: as many halves of an exchange).
        cp_comm = load.layers * (2 + load.recompute_collectives / max(1, load.layers) / 2) * \
            all_to_all_time(exchange, cp, cp_link)
        ep_comm = load.moe_layers * (4 + load.recompute_collectives / max(1, load.layers)) * \
            all_to_all_time(copies * work.expert_imbalance, ep, ep_link) if ep > 1 else 0.0
        return {"compute": compute, "recompute": recompute, "reference": reference, "tp_comm": tp_comm + tp_host,
                "pp_comm": pp_comm,
                "cp_comm": cp_comm, "ep_comm": ep_comm, "host": tp_host}

    per_rank = [rank_times(load) for load in loads]
    host_work = [r.pop("host") for r in per_rank]
    busiest = max(range(pp), key=lambda r: sum(per_rank[r].values()))
    t = per_rank[busiest]
    load = loads[busiest]
    micro_time = sum(t.values())  # one micro-batch on the slowest rank (all its chunks)
    step = StepTime(compute=ga * t["compute"], recompute=ga * t["recompute"], reference=ga * t["reference"],
                    tp_comm=ga * t["tp_comm"],
                    pp_comm=ga * t["pp_comm"], cp_comm=ga * t["cp_comm"], ep_comm=ga * t["ep_comm"],
                    tokens_per_step=cfg.global_batch_size(world) * seq, devices=world,
                    model_flops_per_token=work.flops.total, peak_flops=peak)
    if pp > 1:
        # Filling and draining the pipeline passes through the other stages once each: (pp - 1) micro-batch
        # times when the stages are equal, less when only the busiest one is heavy (the output head).
        factor = ZERO_BUBBLE_FACTOR if p.schedule == "zero_bubble" else 1.0
        others = sum(sum(r.values()) for i, r in enumerate(per_rank) if i != busiest)
        step.bubble = others / v / factor

    # Data parallelism, on this rank's share of the parameters; the context-parallel ranks reduce theirs too.
    ranks = dp * cp
    # Expert parallelism: a rank holds 1/ep of the experts, outside FSDP2 and ZeRO; their gradients are summed
    # over the ranks//ep replicas holding the same ones (none when ep covers the data-parallel ranks).
    experts_dev = load.expert_params / tp * (1 - 1 / ep) if ep > 1 else 0.0
    expert_grads = load.expert_trainable / tp / ep if ep > 1 else 0.0
    params_dev = load.params / tp - experts_dev
    trainable_dev = load.trainable / tp - (load.expert_trainable / tp * (1 - 1 / ep) if ep > 1 else 0.0)
    replicas = ranks // ep
    # optimize.offload_params on one accelerator: FSDP2's CPU offload alone, at ZeRO-3 (no collective).
    alone = cfg.optimize.offload_params and world == 1 and hw.kind != "cpu"
    zero = p.zero_stage if ranks > 1 else (ONE_PROCESS_ZERO_STAGE if alone else 0)
    comm = 0.0
    if ranks > 1:
        if replicas > 1 and zero <= 1:  # the replicas' gradients summed after the backward
            comm += all_reduce_time(expert_grads * b["grad"], replicas, dp_link)
        elif replicas > 1:  # FSDP2 over the replicas: reduce-scattered, and gathered like the other weights
            gathers = (1 if zero == 2 else 2) * ga
            comm += ga * gather_time(expert_grads * b["grad"], replicas, dp_link) \
                + gathers * gather_time(load.expert_params / tp / ep * b["param"], replicas, dp_link)
        grads = (trainable_dev - expert_grads) * b["grad"]
        params_bytes = (params_dev - load.expert_params / tp / ep) * b["param"] if ep > 1 else params_dev * b["param"]
        if rate8 and float8_all_gather(cfg, ranks):  # FSDP2 all-gathers the float8 linears' weights in 1 byte
            params_bytes -= load.float8_params / tp * (b["param"] - 1)
        if zero <= 1:
            comm += all_reduce_time(grads, ranks, dp_link)
            if zero == 1:
                comm += gather_time(trainable_dev * b["param"], ranks, dp_link)  # updated parts all-gathered
        else:
            # Reduce-scatter: once per micro-batch (parallel.reduce_gradients, the default for ZeRO 2/3
            # without a pipeline), or once per step (a pipeline's schedule: once per pipeline step).
            if p.reduces_every_micro_batch():
                reductions = ga
            else:
                reductions = ga // p.micro_batch_num if pp > 1 else 1
            comm += reductions * gather_time(grads, ranks, dp_link)
            gathers = (1 if (zero == 2 or pp > 1) else 2) * (1 if (zero == 2 and pp > 1) else ga)
            comm += gathers * gather_time(params_bytes, ranks, dp_link)
            if cfg.optimize.offload_params:
                # FSDP2's CPU offload copies each host shard to the device before every all-gather.
                host_shards = params_bytes * offloaded_share(cfg)[0] / ranks
                comm += gathers * host_shards / (hw.host_bandwidth_gbps * 1e9 / slowdown)
        # Reductions overlap the last backward; gathers are prefetched under each micro-batch's compute.
        window = (t["compute"] + t["recompute"]) * (ga if zero >= 2 else 2 / 3)
        step.dp_comm = comm - min(comm * (1 - 1 / max(load.layers, 1)), hw.comm_overlap * window)
    # The optimizer step on this device's (ZeRO-sharded) trainable parameters; its experts are stepped whole.
    shard = (trainable_dev - expert_grads) / (ranks if zero >= 1 else 1) \
        + expert_grads / (replicas if zero >= 2 and ep > 1 else 1)
    o = cfg.optimize
    host = hw.host_bandwidth_gbps * 1e9 / slowdown
    params_share, trainable_share = offloaded_share(cfg) if o.offload_params and zero >= 2 else (0.0, 0.0)
    if params_share:
        # Gradient shards go to the host, updated parameters come back, and the host runs AdamW; the
        # parameters left on the device (optimize.offload_params_blocks) are updated there.
        on_host = shard * trainable_share
        step.offload = on_host * (b["grad"] + b["param"]) / host
        step.optimizer = on_host * ADAM_BYTES / (HOST_ADAM_GBPS * 1e9) \
            + (shard - on_host) * b["adam"] / (hw.memory_bandwidth_gbps * 1e9 / slowdown)
    elif o.offload_optimizer == "cpu":
        # Gradients (16-bit at O2) stream to the host during each backward; the weights come back once.
        grads_out = ga * shard * b["param"] / host
        backward = (t["compute"] + t["recompute"]) * 2 / 3  # a micro-batch's backward: 2/3 of its compute
        step.offload = max(0.0, grads_out - hw.comm_overlap * ga * backward) + shard * b["param"] / host
        step.optimizer = shard * (ADAM_BYTES + MASTER_BYTES) / (HOST_ADAM_GBPS * 1e9)
    else:
        step.optimizer = shard * b["adam"] / (hw.memory_bandwidth_gbps * 1e9 / slowdown)
        if o.offload_optimizer == "stream" and not cfg.train.optimizer_in_backward:
            # Each parameter's moments (and O2 master) come in and go back over the host link on a side
            # stream, hidden only behind the other parameters' updates (in backward: below, with the backward).
            step.offload = max(0.0, _streamed_state_bytes(cfg, shard, b) / host - hw.comm_overlap * step.optimizer)
        elif cfg.train.optimizer in ("paged_adamw_8bit", "paged_adamw") and hw.kind != "cpu":
            step.offload = _paged_traffic(cfg, devices, hw) / host
    # The host link in each pass of each micro-batch, both ways at once (`_host_link`): on one accelerator
    # with offload_params, each block's weights come in for its forward and again for its backward; the
    # saved activations go out in the forward and come back in the backward; with the optimizer in backward
    # (one micro-batch) the streamed state comes in and goes back during it.
    acts = _offloaded_activation_bytes(cfg, devices, hw) / host if o.offload_activations else 0.0
    state = _streamed_state_bytes(cfg, shard, b) / host \
        if o.offload_optimizer == "stream" and cfg.train.optimizer_in_backward and not o.offload_params else 0.0
    weights = params_dev * params_share * b["param"] / host if alone else 0.0
    if hw.kind == "cpu":  # the copies run on the cores that compute: nothing hides them
        step.offload += 2 * ga * acts + state
    elif acts or state or weights:
        # What one block moves: nothing hides the first block's weights or the last block's activations.
        block = weights / _offloaded_blocks(cfg, load.layers) + (acts + state / 2) / max(load.layers, 1)
        forward_s, backward_s = t["compute"] / 3, t["compute"] * 2 / 3 + t["recompute"]
        step.offload += ga * _host_link(weights, acts, forward_s, block, hw) \
            + (ga - 1) * _host_link(weights + acts, 0.0, backward_s, block, hw) \
            + _host_link(weights + acts + state / 2, state / 2, backward_s, block, hw)
    step.detail = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "virtual_stages": v, "gradient_accumulation": ga,
                   "busiest_rank": busiest, "layers_on_rank": load.layers, "slowdown": slowdown, "nodes": nodes,
                   "tp_spans_nodes": tp > per_node, "dp_spans_nodes": dp * tp > per_node,
                   "dp_comm_total": comm, "micro_batch_time": micro_time, "loads": loads,
                   "float8": bool(rate8), "float8_cast_time": ga * float8_casts(load) if rate8 else 0.0,
                   # seconds a process computes per step, averaged over the pipeline ranks
                   "busy": ga * sum(r["compute"] + r["recompute"] + r["reference"] + h
                                    for r, h in zip(per_rank, host_work)) / pp
                   + step.optimizer + (step.dp_comm + step.tp_comm if hw.kind == "cpu" else 0.0)}
    return step


def _host_link(inward: float, outward: float, compute: float, block: float, hw: Hardware) -> float:
    """Seconds a pass waits for the host link: its copies in each direction (seconds at the link's speed;
    the directions run at once) hidden behind the pass's compute up to comm_overlap, but never less than
    one block's copies (`block`), which have nothing to hide behind."""
    moved = max(inward, outward)
    return min(moved, max(block, moved - hw.comm_overlap * compute))


def _offloaded_blocks(cfg: RunConfig, layers: int) -> int:
    """How many of a rank's `layers` blocks offload_params keeps in host memory (at least 1)."""
    n = cfg.optimize.offload_params_blocks
    return max(1, min(layers, n) if n is not None else layers)


def _streamed_state_bytes(cfg: RunConfig, shard: float, b: dict[str, float]) -> float:
    """Bytes `offload_optimizer: stream` moves per step: each trained element's two moments (and its fp32
    master at O2) in and back out."""
    master = 4 if cfg.optimize.level() == "O2" else 0
    return 2 * shard * (2 * b["moment"] + master)


def _paged_traffic(cfg: RunConfig, devices: int, hw: Hardware) -> float:
    """Bytes bitsandbytes' paged state moves per step: the part of it that the device cannot keep beside
    the run's peak (usable memory less the estimate's peak) is paged out and back in once per step, and the
    update waits for its pages (not hidden: a pessimistic estimate until a GPU measures it)."""
    estimate = estimate_memory(cfg, devices, hw.kind)
    room = hw.memory_gib * GIB - hw.reserved_gib * GIB - estimate.peak
    return 2 * max(0.0, estimate.host_phases.get("optimizer", 0) - max(0.0, room))


def _offloaded_activation_bytes(cfg: RunConfig, devices: int, hw: Hardware) -> int:
    """Bytes of saved activations one micro-batch sends to the host on the busiest rank (the estimator's count)."""
    estimate = estimate_memory(cfg, devices, "cpu" if hw.kind == "cpu" else hw.kind)
    flight = max(estimate.detail.get("in_flight", 1), 1)
    return estimate.detail["host_offload"]["activations"] // flight


def physical_limit(cfg: RunConfig, hw: Hardware) -> dict[str, float]:
    """The best tokens/s per device at 100% MFU: peak / FLOPs per token (what a step computes: frozen
    weights skip their weight gradients), beside the FLOPs per token if every weight trained. With
    optimize.float8 on hardware that has it, also the best with the converted linears at the float8 peak
    (`float8_tokens_per_s_per_device`; MFU stays measured against the 16-bit peak, as torchtitan does)."""
    peak = hw.peak_tflops(cfg.optimize.mixed_precision) * 1e12
    flops = model_flops_per_token(cfg)
    limit = {"peak_flops": peak, "flops_per_token": flops, "tokens_per_s_per_device": peak / flops if peak else 0.0,
             "full_training_flops_per_token": flops_per_token(cfg.model, cfg.data.seq_length)}
    f8 = sum(layer.flops for layer in float8_layers(cfg)) if hw.tflops_8 else 0.0
    if f8 and peak:
        limit["float8_flops_per_token"] = f8
        limit["float8_peak_flops"] = hw.tflops_8 * 1e12
        limit["float8_tokens_per_s_per_device"] = 1 / ((flops - f8) / peak + f8 / (hw.tflops_8 * 1e12))
    return limit
