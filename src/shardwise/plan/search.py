"""The layout search: every DP x TP x PP split, ZeRO stage, recompute, micro-batch and schedule of a
workload, ranked by predicted step time among those whose estimated memory fits. Context parallelism
(each sequence split over CP devices) joins the search for sequences of CP_MIN_SEQ tokens or more, when
pinned (--cp), or when nothing fits without it.

Layouts are timed first (cheap) and their memory is estimated (`shardwise.memory.estimate`) in order
of speed until enough fit, so the ones shown are the fastest that fit, and the faster ones that do
not fit are known. Memory must stay under the device memory less a safety margin and what the
runtime reserves. `plan()` returns a `PlanResult`; `report.format_plan` turns it into what
`shardwise plan` prints (this module computes, that one formats).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

from ..config import ParallelConfig, RunConfig, validate
from ..config.schema import PAGED_OPTIMIZERS
from ..errors import ConfigError
from ..hardware import CATALOGUE, Hardware
from ..memory.auto_recompute import choose_recompute_layers, with_recompute_layers
from ..memory.estimate import estimate_memory
from ..models import get_preset, preset_names
from ..parallel.float8 import float8_layout_problem, float8_on
from ..parallel.pipeline import check_pipeline
from ..peft.qlora import quantized_layout_problem
from ..step_time import StepTime, physical_limit, predict_step, work_of
from ..units import GIB, gib

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "gpipe")

RECOMPUTE = ("none", "selective", "full")
AUTO = ("auto",)  # recompute per layer, the least that fits (the estimator's plan): searched when pinned
# Schedules tried for pipelines of each depth: (schedule, virtual stages). GPipe is left out: it has
# 1F1B's bubble and keeps every micro-batch's activations.
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 1),
                      ("zero_bubble", 2))
MAX_MICRO_BATCH = 32
# Sequences from this many tokens on are long enough for context parallelism to be tried by default: below,
# the activations of a sequence rarely outgrow a device that holds the model, and the all-to-alls cost more
# than the memory they save (it is still tried when nothing fits without it).
CP_MIN_SEQ = 16384


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    dp: int
    tp: int
    pp: int
    zero: int = 0
    recompute: str = "none"
    micro_batch: int = 1
    accumulation: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    offload: Union[bool, str] = False  # optimize.offload_optimizer: False, "cpu" or "stream"
    reduce_gradients: str = "auto"  # parallel.reduce_gradients; searched for ZeRO 2/3 with accumulation
    offload_activations: bool = False  # tried with offload_optimizer where no pipeline runs
    loss_chunk: Optional[int] = None  # optimize.loss_chunk_tokens when the planner lowered it to fit (else as set)
    offload_params: bool = False  # one device: FSDP2's CPU offload (parameters, gradients, state on the host)
    offload_blocks: Optional[int] = None  # with offload_params: only the first this many blocks (None: all)
    cp: int = 1  # parallel.context_parallel: devices each sequence is split over
    ep: int = 1  # parallel.expert_parallel: data-parallel ranks each MoE block's experts are spread over

    def short(self) -> str:
        """'DP4 TP2 PP1' style degrees (and 'CP2' under context parallelism, 'EP8' under expert parallelism)."""
        return f"DP{self.dp} TP{self.tp} PP{self.pp}" + (f" CP{self.cp}" if self.cp > 1 else "") + \
            (f" EP{self.ep}" if self.ep > 1 else "")

    def describe(self) -> str:
        """All settings in one line."""
        offload = {"cpu": "+offload", "stream": "+streamed optimizer state"}.get(self.offload, "") + (
            " and activations" if self.offload_activations else "")
        zero = f"ZeRO-{self.zero}" + offload
        if self.offload_params:  # optimize.offload_params on one device
            which = f" of the first {self.offload_blocks} blocks" if self.offload_blocks else ""
            zero = f"FSDP2 CPU offload{which} of parameters, gradients and optimizer" + (
                " and activations" if self.offload_activations else "")
        parts = [self.short(), zero,
                 f"recompute {self.recompute}", f"micro-batch {self.micro_batch} x {self.accumulation}"]
        if self.reduce_gradients != "auto":
            parts.append("gradients reduced " + self.reduce_gradients.replace("_", " ").replace("micro batch",
                                                                                                 "micro-batch"))
        if self.pp > 1:
            parts.append(self.schedule_name())
        if self.loss_chunk:
            parts.append(f"loss chunks of {self.loss_chunk} tokens")
        return ", ".join(parts)

    def schedule_name(self) -> str:
        """The pipeline schedule with its virtual stages."""
        if self.pp == 1:
            return "-"
        return self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")


@dataclass
class Candidate:
    """A layout, its run config, predicted step and (once estimated) memory."""

    layout: Layout
    cfg: RunConfig
    step: StepTime
    memory: Any = None  # MemoryEstimate once estimated
    usable: int = 0  # bytes a device may use
    lower_bound: int = 0  # bytes the weights, gradients and optimizer state need at least

    @property
    def peak(self) -> int:
        """Estimated peak bytes per device (the lower bound when not estimated)."""
        return self.memory.peak if self.memory is not None else self.lower_bound

    @property
    def fits(self) -> bool:
        """Whether the estimated peak is within the usable memory."""
        return self.memory is not None and self.memory.peak <= self.usable


@dataclass
class PlanRequest:
    """What to plan for: a workload (model, sequence, batch, precision, fine-tuning) on some hardware."""

    cfg: RunConfig
    devices: int
    hardware: Hardware
    nodes: Optional[int] = None
    memory_margin: float = 0.10
    top: int = 10
    pins: dict[str, list[Any]] = field(default_factory=dict)  # tp, pp, dp, zero, recompute, micro_batch, schedule
    offload: bool = True
    target_tokens_per_s: Optional[float] = None  # per device
    expert_imbalance: float = 1.0  # MoE: the busiest expert-parallel rank's routed copies over the even share


@dataclass
class PlanResult:
    """Ranked layouts and what the report says about them."""

    request: PlanRequest
    ranked: list[Candidate]  # fitting, fastest first (at most `top`)
    evaluated: int  # layouts timed
    estimated: int  # layouts whose memory was estimated
    faster_not_fitting: list[Candidate]  # faster than the winner but over the memory
    best_data_parallel: Optional[Candidate]  # the fastest fitting pure-DP layout, when there is one
    limit: dict[str, float]
    smallest: Optional[Candidate] = None  # when nothing fits: the layout needing the least memory
    advice: list[str] = field(default_factory=list)

    @property
    def best(self) -> Optional[Candidate]:
        """The winner."""
        return self.ranked[0] if self.ranked else None


# --- the workload ---------------------------------------------------------------------------------


def workload_config(model: Optional[str] = None, config: Optional[RunConfig] = None, seq_length: Optional[int] = None,
                    global_batch: Optional[int] = None, devices: int = 1, precision: Optional[str] = None,
                    precision_level: Optional[str] = None, lora_rank: Optional[int] = None,
                    freeze_layers: Optional[int] = None, hardware: Optional[Hardware] = None) -> RunConfig:
    """The run config to plan: a preset (or a given config) with the sequence, batch and precision asked for."""
    if config is None and model is None:
        raise ConfigError("give a model preset (--model NAME) or a run config to plan for")
    if config is not None:
        raw = config.model_dump(mode="json")
        raw["model"].pop("init_from", None)  # the architecture is resolved already; weights are not needed
    else:
        if model not in preset_names():
            raise ConfigError(f"model preset {model!r} is not known. Known presets: {', '.join(preset_names())}")
        raw = {"model": {"preset": model}, "train": {"max_steps": 1}}
    raw.setdefault("data", {})
    if seq_length is not None:
        if seq_length < 2:
            raise ConfigError(f"--seq-length {seq_length}: give at least 2 tokens")
        raw["data"]["seq_length"] = seq_length
    if config is None:
        preset = get_preset(model)
        seq = raw["data"].get("seq_length") or preset["max_position_embeddings"]
        if seq > preset["max_position_embeddings"]:
            if preset.get("position") == "learned":
                raise ConfigError(f"--seq-length {seq} exceeds {model}'s {preset['max_position_embeddings']} learned "
                                  "positions")
            raw["model"]["max_position_embeddings"] = seq  # RoPE: longer sequences change no sizes
    if global_batch is not None:
        if global_batch < 1:
            raise ConfigError(f"--global-batch {global_batch}: give at least 1 sample")
        raw["train"]["global_batch_size"] = global_batch
    elif raw["train"].get("global_batch_size") is None:
        raw["train"]["global_batch_size"] = 4 * devices
    raw["train"].update(micro_batch_size=1, max_steps=raw["train"].get("max_steps") or 1)
    opt = raw.setdefault("optimize", {})
    opt["gradient_accumulation_steps"] = None
    if precision is not None:
        opt["mixed_precision"] = precision
        opt["precision_level"] = precision_level
    elif config is None:
        opt["mixed_precision"] = "fp32" if hardware is not None and hardware.kind == "cpu" else "bf16"
    if lora_rank is not None:
        raw["lora"] = {"r": lora_rank, "alpha": 2.0 * lora_rank}
    if raw.get("lora"):
        raw["lora"]["dropout"] = 0.0  # dropout is refused with TP; it does not change sizes or time
    if freeze_layers is not None:
        raw.setdefault("freeze", {})["layers"] = freeze_layers
    raw["parallel"] = {"sequence_parallel": raw.get("parallel", {}).get("sequence_parallel", True)}
    return validate(raw)


# --- enumeration ----------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(pins: dict[str, list[Any]], key: str, values: Iterable[Any]) -> list[Any]:
    return [v for v in values if key not in pins or v in pins[key]]


def check_request(req: PlanRequest) -> None:
    """Refuse impossible device counts, nodes and pinned degrees with what would work."""
    n = req.devices
    if n < 1:
        raise ConfigError(f"--devices {n}: give at least 1 device")
    if req.nodes is not None and (req.nodes < 1 or n % req.nodes):
        raise ConfigError(f"--nodes {req.nodes} must divide --devices {n} (the same number of devices on every node)")
    if not 0 <= req.memory_margin < 1:
        raise ConfigError(f"--memory-margin {req.memory_margin}: give a fraction in [0, 1), e.g. 0.1")
    m = req.cfg.model
    for key, values in req.pins.items():
        for v in values:
            if key in ("tp", "pp", "dp", "cp", "ep", "micro_batch") and v < 1:
                raise ConfigError(f"--{key.replace('_', '-')} {v}: degrees and sizes are at least 1")
            if key in ("tp", "pp", "dp", "cp") and n % v:
                raise ConfigError(f"--{key} {v} does not divide {n} devices; degrees that do: "
                                  f"{', '.join(map(str, divisors(n)))}")
    for tp in req.pins.get("tp", []):
        bad = [f"{name} {size}" for name, size in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads),
                                                   ("intermediate_size", m.intermediate_size)) if size % tp]
        if bad:
            ok = [t for t in divisors(n) if not (m.num_heads % t or m.num_kv_heads % t or m.intermediate_size % t)]
            raise ConfigError(f"--tp {tp} must divide the model's {', '.join(bad)}; tensor-parallel degrees that "
                              f"suit this model on {n} devices: {', '.join(map(str, ok))}")
    for pp in req.pins.get("pp", []):
        if pp > m.num_layers:
            raise ConfigError(f"--pp {pp} exceeds the model's {m.num_layers} layers: every stage needs a layer")
    for z in req.pins.get("zero", []):
        if z not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {z}: ZeRO stages are 0, 1, 2, 3")
    for sched in req.pins.get("schedule", []):
        if sched not in SCHEDULES:
            raise ConfigError(f"--schedule {sched!r}: use one of {', '.join(SCHEDULES)}")
    for r in req.pins.get("recompute", []):
        if r not in RECOMPUTE + AUTO:
            raise ConfigError(f"--recompute {r!r}: use one of {', '.join(RECOMPUTE + AUTO)}")
    check_float8_request(req)
    gbs = req.cfg.train.global_batch_size
    if gbs is not None and not any(gbs % dp == 0 for dp in _allowed(req.pins, "dp", divisors(n))):
        raise ConfigError(f"--global-batch {gbs} cannot be split over any data-parallel degree allowed on {n} devices")


def check_float8_request(req: PlanRequest) -> None:
    """optimize.float8 on hardware without float8 tensor cores, or with a precision or LoRA it cannot run
    with: a ConfigError, as the trainer would give (layouts with tensor parallelism are skipped instead)."""
    if not float8_on(req.cfg):
        return
    hw = req.hardware
    if not hw.tflops_8:
        raise ConfigError(f"optimize.float8 needs float8 tensor cores, which {hw.name} has not (no tflops_8 in its "
                          "hardware entry; H100, H200, H800, L40S and RTX 4090 have them): plan without "
                          "optimize.float8, or give tflops_8 in a --hardware-file")
    problem = float8_layout_problem(req.cfg, Layout(dp=1, tp=1, pp=1))  # the reasons no layout changes
    if problem:
        raise ConfigError(f"optimize.float8 {problem}")


def context_parallel_degrees(req: PlanRequest, tp: int, pp: int, wanted: bool) -> list[int]:
    """The context-parallel degrees to try with `tp` x `pp`: 1, and (when `wanted` or pinned) every degree
    that divides the devices left, the sequence and the query heads per tensor-parallel rank, without a
    pipeline, with the chunked loss and without dropout (`parallel.context.check_context_parallel`'s
    conditions)."""
    cfg, pins = req.cfg, req.pins
    if not (wanted or "cp" in pins):
        return [1]
    seq, heads = cfg.data.seq_length, cfg.model.num_heads // tp
    sp = cfg.parallel.sequence_parallel and tp > 1
    dropout = bool(cfg.model.dropout or (cfg.lora is not None and cfg.lora.dropout))  # refused under CP
    ok = [c for c in divisors(req.devices // (tp * pp))
          if c == 1 or (pp == 1 and cfg.optimize.chunked_loss and seq % c == 0 and heads % c == 0
                        and not (sp and (seq // c) % tp) and not dropout)]
    return _allowed(pins, "cp", ok)


def enumerate_layouts(req: PlanRequest, context_parallel: Optional[bool] = None) -> list[tuple[Layout, RunConfig]]:
    """Every layout of the request that the trainer can run (validity only; memory comes later).
    `context_parallel`: whether to try CP > 1 (default: for sequences of CP_MIN_SEQ tokens or more)."""
    cfg, n, pins = req.cfg, req.devices, req.pins
    if context_parallel is None:
        context_parallel = cfg.data.seq_length >= CP_MIN_SEQ
    m = cfg.model
    seq = cfg.data.seq_length
    gbs = cfg.train.global_batch_size
    sp = cfg.parallel.sequence_parallel
    nodes = req.nodes or req.hardware.nodes_for(n)
    per_node = n // nodes
    out = []
    # What the model's kind runs with (RunConfig refuses the rest): latent attention no context parallelism,
    # mixture-of-experts models context parallelism with data parallelism alone, ALiBi no tensor or context
    # parallelism.
    for tp in _allowed(pins, "tp", divisors(n)):
        if m.num_heads % tp or m.num_kv_heads % tp or m.intermediate_size % tp or (sp and tp > 1 and seq % tp):
            continue
        if tp > 1 and m.position == "alibi":
            continue
        if tp > per_node and "tp" not in pins:
            continue  # tensor parallelism across nodes: every layer would wait on the slow link
        for pp, cp in [(pp, cp) for pp in _allowed(pins, "pp", divisors(n // tp))
                       for cp in context_parallel_degrees(req, tp, pp, context_parallel)]:
            if pp > m.num_layers or (cp > 1 and (m.latent_attention or (m.num_experts and tp > 1)
                                                 or m.position == "alibi" or m.sliding_window)):
                continue
            dp = n // (tp * pp * cp)
            if "dp" in pins and dp not in pins["dp"]:
                continue
            if gbs % dp:
                continue
            per_rank = gbs // dp
            mbs_options = [b for b in divisors(per_rank)
                           if b <= MAX_MICRO_BATCH and (b & (b - 1) == 0 or b == per_rank)]
            for mbs in _allowed(pins, "micro_batch", mbs_options):
                ga = per_rank // mbs
                schedules = (PIPELINE_SCHEDULES + (("gpipe", 1),) if "gpipe" in pins.get("schedule", []) else
                             PIPELINE_SCHEDULES) if pp > 1 else (("1f1b", 1),)
                for schedule, v in schedules:
                    if "schedule" in pins and schedule not in pins["schedule"]:
                        continue
                    if "virtual_stages" in pins and v not in pins["virtual_stages"]:
                        continue
                    if pp > 1:
                        try:
                            check_pipeline(m.num_layers, pp, v, schedule, None, ga)
                        except ConfigError:
                            continue
                    for zero, ep in [(z, e) for z in _allowed(pins, "zero", (0, 1, 2, 3) if dp * cp > 1 else (0,))
                                     for e in _allowed(pins, "ep", expert_parallel_degrees(m, dp))
                                     if (tp == 1 or e in (1, dp)) and (cp == 1 or e == 1)]:
                        # with TP, the experts over all data ranks; with CP, not spread
                        # offload_optimizer (memory/offload.py): ZeRO 2/3 under data parallelism, or one device.
                        can_offload = req.offload and req.hardware.kind != "cpu" and ep == 1 and (
                            zero >= 2 or (dp == 1 and tp == 1 and pp == 1 and cp == 1)) and \
                            cfg.train.optimizer not in PAGED_OPTIMIZERS  # their state pages to the host itself:
                        # no offload lever beside bitsandbytes' paged optimizers
                        offloads = (False, *optimizer_offloads(cfg, tp, pp)) if can_offload else (False,)
                        # ZeRO 2/3 accumulating without a pipeline: reduce-scatter every micro-batch
                        # (sharded gradients) or once per step (full-size ones, fewer collectives).
                        reductions = (("every_micro_batch", "once_per_step") if zero >= 2 and pp == 1 and ga > 1
                                      else ("auto",))
                        # The saved activations may go to the host too (not under a pipeline), with the
                        # optimizer offloaded or not.
                        offloads = [(o, acts) for o in offloads for acts in ((False, True) if pp == 1 and
                                                                             req.offload and req.hardware.kind
                                                                             != "cpu" else (False,))]
                        # On one device, offload_params too: FSDP2's CPU offload alone (the parameters as
                        # well, each block copied in for its forward and backward; LoRA's base leaves), of
                        # everything or of the first quarter, half or three quarters of the blocks (fewer
                        # weights cross the host link; the rest stay on the device).
                        if can_offload and dp * tp * pp * cp == 1:
                            offloads += [(("params", blocks), acts) for blocks in offload_block_counts(m.num_layers)
                                         for acts in (False, True)]
                        for offload, acts in offloads:
                            params, blocks = offload if isinstance(offload, tuple) else (False, None)
                            for recompute in _allowed(pins, "recompute", RECOMPUTE + AUTO * ("auto" in pins.get(
                                    "recompute", []))):
                                for reduce in reductions:
                                    layout = Layout(dp, tp, pp, zero, recompute, mbs, ga, schedule, v,
                                                    offload if offload in ("cpu", "stream") else False, reduce,
                                                    acts, offload_params=bool(params), offload_blocks=blocks, cp=cp,
                                                    ep=ep)
                                    out.append((layout, layout_config(cfg, layout)))
    return out


def expert_parallel_degrees(m: Any, dp: int) -> list[int]:
    """The parallel.expert_parallel degrees to try: 1, and for a mixture-of-experts model every degree above
    it that divides both the data-parallel ranks and the experts."""
    if not m.num_experts:
        return [1]
    return [e for e in divisors(dp) if m.num_experts % e == 0]


def offload_block_counts(layers: int) -> list[Optional[int]]:
    """The optimize.offload_params_blocks the planner tries: None (everything offloaded) and the first
    quarter, half and three quarters of the blocks."""
    return [None, *sorted({n for n in (layers // 4, layers // 2, 3 * layers // 4) if 0 < n < layers})]


def optimizer_offloads(cfg: RunConfig, tp: int, pp: int) -> tuple[str, ...]:
    """The optimize.offload_optimizer engines the run's optimizer settings allow: cpu (ZeRO-Offload: the
    update on the host, not in backward, not torchao's or bitsandbytes' optimizers) and stream (the state
    in host memory, the update on the device: Adam, AdamW, torchao's 8-bit AdamW; without tensor or
    pipeline parallelism)."""
    t = cfg.train
    out = []
    if not t.optimizer_in_backward and t.optimizer in ("adamw", "adam", "sgd"):
        out.append("cpu")
    if t.optimizer in ("adamw", "adam", "adamw_8bit") and tp == 1 and pp == 1:
        out.append("stream")
    return tuple(out)


# A layout that does not fit with the configured loss chunk is tried once more with chunks of this many tokens:
# their [chunk, vocabulary] fp32 logits (128 MiB at a 128k vocabulary) cost no FLOPs, and each chunk's
# matmul is still large enough to run at full speed on a GPU.
SMALL_LOSS_CHUNK = 256


def _lowers_loss_chunk(cfg: RunConfig) -> bool:
    chunk = cfg.optimize.loss_chunk()
    return chunk is not None and chunk > SMALL_LOSS_CHUNK


def with_loss_chunk(cfg: RunConfig, tokens: int) -> RunConfig:
    """`cfg` with the chunked loss computed `tokens` tokens at a time."""
    return cfg.model_copy(update={"optimize": cfg.optimize.model_copy(update={"loss_chunk_tokens": tokens})})


def layout_config(base: RunConfig, layout: Layout) -> RunConfig:
    """`base` with the layout's parallel, batch and memory settings (checked by `enumerate_layouts`)."""
    parallel = ParallelConfig(data_parallel=layout.dp, tensor_parallel=layout.tp, pipeline_parallel=layout.pp,
                              zero_stage=layout.zero, micro_batch_num=layout.accumulation if layout.pp > 1 else 1,
                              schedule=layout.schedule, virtual_stages=layout.virtual_stages,
                              sequence_parallel=base.parallel.sequence_parallel,
                              reduce_gradients=layout.reduce_gradients, context_parallel=layout.cp,
                              expert_parallel=layout.ep)
    optimize = base.optimize.model_copy(update={"recompute": layout.recompute, "recompute_every": 1,
                                               "recompute_layers": None,
                                               "gradient_accumulation_steps": None,
                                               "offload_optimizer": layout.offload,
                                               "offload_params": layout.offload_params,
                                               "offload_params_blocks": layout.offload_blocks,
                                               "offload_activations": layout.offload_activations})
    train = base.train.model_copy(update={"micro_batch_size": layout.micro_batch,
                                          "global_batch_size": layout.dp * layout.micro_batch * layout.accumulation})
    return base.model_copy(update={"parallel": parallel, "optimize": optimize, "train": train})


def usable_bytes(hw: Hardware, margin: float, devices_on_node: int) -> int:
    """Memory one device may fill: its memory less the margin and the runtime's reserve (a CPU's RAM is
    shared by the processes on the node)."""
    if hw.kind == "cpu":
        return int(hw.memory_gib * (1 - margin) / max(1, devices_on_node) * GIB)
    return int((hw.memory_gib * (1 - margin) - hw.reserved_gib) * GIB)


# --- the search -----------------------------------------------------------------------------------


MemoryFn = Callable[[RunConfig, int, str], Any]


def plan(req: PlanRequest, memory_fn: Optional[MemoryFn] = None, advise: bool = True,
         context_parallel: Optional[bool] = None) -> PlanResult:
    """Time every layout, estimate memory in order of speed, and rank the fastest that fit (when none
    does and `advise`, say what would help). `context_parallel`: try CP > 1 (default: for long sequences;
    when nothing fits without it, the search runs again with it)."""
    memory_fn = memory_fn or estimate_memory
    check_request(req)
    if context_parallel is None and req.cfg.data.seq_length < CP_MIN_SEQ and "cp" not in req.pins:
        result = plan(req, memory_fn, advise=False, context_parallel=False)
        if result.ranked:  # advice is only for when nothing fits
            return result
        return plan(req, memory_fn, advise, context_parallel=True)
    hw, n = req.hardware, req.devices
    nodes = req.nodes or hw.nodes_for(n)
    usable = usable_bytes(hw, req.memory_margin, n // nodes)
    work = work_of(req.cfg, req.expert_imbalance)  # the same FLOPs and adapters in every layout
    candidates = []
    for layout, cfg in enumerate_layouts(req, context_parallel):
        if quantized_layout_problem(cfg, layout):  # QLoRA's base cannot be split, sharded or offloaded
            continue
        if float8_layout_problem(cfg, layout):  # float8 under tensor parallelism is not wired
            continue
        if layout.recompute == "auto":  # the least recompute per layer that fits this layout in `usable`
            try:
                cfg = with_recompute_layers(cfg, choose_recompute_layers(cfg, n, hw.kind, usable))
            except ConfigError:  # even full recompute does not fit: the full-recompute layout says so
                continue
        step = predict_step(cfg, n, hw, nodes, work=work)
        candidates.append(Candidate(layout, cfg, step, usable=usable, lower_bound=state_lower_bound(cfg, layout, step)))
    if not candidates:
        raise ConfigError(_no_layout_message(req))
    # Ties go to less parallelism and, at equal time, to reducing every micro-batch (less memory).
    candidates.sort(key=lambda c: (c.step.total, c.layout.tp, c.layout.pp, c.layout.zero,
                                   c.layout.reduce_gradients == "once_per_step"))
    device = hw.kind
    estimated = 0

    def estimate(c: Candidate) -> Candidate:
        nonlocal estimated
        if c.memory is None and (c.lower_bound <= usable or not quick):
            c.memory = memory_fn(c.cfg, n, device)
            estimated += 1
            if not c.fits and _lowers_loss_chunk(c.cfg):
                smaller = with_loss_chunk(c.cfg, SMALL_LOSS_CHUNK)
                memory = memory_fn(smaller, n, device)
                estimated += 1
                if memory.peak <= usable:
                    c.cfg, c.memory = smaller, memory
                    c.layout = dataclasses.replace(c.layout, loss_chunk=SMALL_LOSS_CHUNK)
        return c

    quick = True  # skip estimates whose lower bound is already over the memory
    ranked, faster_not_fitting = [], []
    for c in candidates:
        if estimate(c).fits:
            ranked.append(c)
            if len(ranked) >= req.top:
                break
        elif not ranked:
            faster_not_fitting.append(c)
    best_dp = next((c for c in candidates if c.layout.tp == 1 and c.layout.pp == 1 and c.layout.cp == 1
                    and estimate(c).fits), None)
    result = PlanResult(request=req, ranked=ranked, evaluated=len(candidates), estimated=estimated,
                        faster_not_fitting=faster_not_fitting, best_data_parallel=best_dp,
                        limit=physical_limit(req.cfg, hw))
    if not ranked and advise:
        quick = False
        for c in candidates:
            estimate(c)
        result.estimated = estimated
        result.smallest = min(candidates, key=lambda c: c.peak)
        result.advice = fit_advice(req, result.smallest, memory_fn)
    return result


def state_lower_bound(cfg: RunConfig, layout: Layout, step: StepTime) -> int:
    """Bytes per device that parameters, gradients and optimizer state need at the least (16-bit copies,
    two moments, ZeRO sharding, nothing for offloaded shards): a cheap test before the full estimate."""
    m = cfg.model
    half = cfg.optimize.mixed_precision != "fp32"
    elem = 2 if half else 4
    state = 4 if cfg.optimize.level() == "O3" else 8
    dp, tp, pp = layout.dp * layout.cp, layout.tp, layout.pp  # ZeRO shards over dp x cp
    tokens = layout.micro_batch * cfg.data.seq_length // layout.cp
    if layout.recompute in ("full", "auto"):  # each block keeps its input (auto: at least that)
        per_layer = tokens * m.hidden_size * elem / tp
    else:  # at least selective's: the input, q, v, the attention output and the gate (or the MLP's input)
        widths = m.hidden_size + (2 * m.num_heads + m.num_kv_heads) * m.head_dim + m.intermediate_size
        per_layer = tokens * widths * elem / tp
    if layout.offload_activations:  # what the blocks save is in host memory
        per_layer = 0
    # A quantised LoRA base (QLoRA) stores its frozen weights in half a byte (NF4) or one (int8).
    quantized = cfg.lora.quantize_base if cfg.lora is not None else "none"
    frozen_elem = {"nf4": 0.5, "int8": 1.0}.get(quantized, elem)
    bound = 0.0
    for rank, load in enumerate(step.detail["loads"]):
        params, trainable = load.params / tp, load.trainable / tp
        stored = trainable * elem + (params - trainable) * frozen_elem
        if layout.offload_params:  # FSDP2's CPU offload on one device: the offloaded blocks in host memory
            kept = 1 - layout.offload_blocks / m.num_layers if layout.offload_blocks else 0.0
            need = stored * kept  # at least the blocks kept on the device (the root stays too)
        elif layout.offload:
            need = stored * (0 if layout.zero == 3 else 1) / dp
        else:
            need = (stored / (dp if layout.zero == 3 else 1) + trainable * elem / (dp if layout.zero >= 2 else 1)
                    + trainable * state / (dp if layout.zero >= 1 else 1))
        # 1F1B keeps pp - rank micro-batches in flight on pipeline rank `rank`; other schedules as many or more.
        in_flight = min(layout.accumulation, pp - rank) if pp > 1 else 1
        bound = max(bound, need + load.layers * in_flight * per_layer)
    return int(bound)


def _no_layout_message(req: PlanRequest) -> str:
    m, n = req.cfg.model, req.devices
    pins = ", ".join(f"--{k.replace('_', '-')} {','.join(map(str, v))}" for k, v in req.pins.items())
    return (f"no layout of {n} devices suits this workload{f' with {pins}' if pins else ''}: tensor parallelism "
            f"must divide num_heads {m.num_heads}, num_kv_heads {m.num_kv_heads} and intermediate_size "
            f"{m.intermediate_size} (and seq_length {req.cfg.data.seq_length} under sequence parallelism), pipelines "
            f"need at most {m.num_layers} stages and enough micro-batches, the global batch "
            f"{req.cfg.train.global_batch_size} must split over the data-parallel ranks, and ZeRO stages 1-3 "
            "need more than one data-parallel rank")


def fit_advice(req: PlanRequest, smallest: Candidate, memory_fn: MemoryFn) -> list[str]:
    """What would make the workload fit: more devices, LoRA, a device with more memory."""
    hw, n = req.hardware, req.devices
    advice = []
    need, usable = smallest.peak, smallest.usable
    # More devices of the same kind: the fully sharded layout on 2x, 4x, ... as many.
    for factor in (2, 4, 8, 16, 32):
        more = dataclasses.replace(req, devices=n * factor, top=1, pins={}, nodes=None,
                                   cfg=_with_batch(req.cfg, n * factor))
        try:
            found = _quick_fit(more, memory_fn)
        except ConfigError:
            continue
        if found is not None:
            advice.append(f"{n * factor} devices of this kind fit it ({found.layout.describe()}: "
                          f"{gib(found.peak, 1)} per device)")
            break
    if req.cfg.lora is None and not req.cfg.freeze.active():
        lora_cfg = validate({**smallest.cfg.model_dump(mode="json"), "lora": {"r": 8, "alpha": 16}})
        peak = memory_fn(lora_cfg, n, hw.kind).peak
        if peak <= usable:
            advice.append(f"LoRA fine-tuning (r=8) instead of full training fits: {gib(peak, 1)} per device")
    bigger = [h for h in CATALOGUE.values() if h.kind != "cpu" and usable_bytes(h, req.memory_margin, 1) >= need]
    if bigger:
        advice.append("devices with more memory: " + ", ".join(f"{h.name} ({h.memory_gib:g} GiB)" for h in bigger))
    return advice


def _with_batch(cfg: RunConfig, devices: int) -> RunConfig:
    """`cfg` with its global batch raised to a multiple of `devices` when smaller."""
    gbs = cfg.train.global_batch_size or devices
    if gbs % devices == 0:
        return cfg
    gbs = math.lcm(gbs, devices)
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"global_batch_size": gbs})})


def _quick_fit(req: PlanRequest, memory_fn: MemoryFn) -> Optional[Candidate]:
    """The fastest of the most memory-frugal layouts (ZeRO-3, full recompute, micro-batch 1), if any fits."""
    req = dataclasses.replace(req, pins={"zero": [3], "recompute": ["full"], "micro_batch": [1]}, offload=False)
    if req.devices == 1:
        return None
    return plan(req, memory_fn, advise=False).best
