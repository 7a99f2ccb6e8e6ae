"""Changes that make a run fit its device: the search behind the out-of-memory help.

From a run's config, each lever of `LEVERS` offers settings that lower memory (a smaller micro-batch
with more accumulation, recompute, a higher ZeRO stage, offload, 16-bit or 8-bit optimizer state,
...). Combinations of up to `MAX_CHANGES` levers are built breadth-first, like the planner's layouts
(`shardwise.plan.search`), as the `--set` strings a user would type, applied the way the command
line applies them; the trainer's own checks drop those a run would refuse. Every candidate is timed
with the step-time model (`shardwise.step_time.predict_step`, cheap) and, fastest first, its memory
is estimated (`estimate_all_ranks`, the busiest rank) until enough fit the device; a candidate that
moves the levers of a cheaper one that fits (and perhaps more) is not another way, and is skipped.
The speed cost is the predicted step time over the current config's.

Adding a lever is one entry in `LEVERS`: a name and a function from (config, processes, device kind)
to the settings it offers, each a list of `key=value` strings in `--set`'s spelling.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..config import RunConfig, apply_overrides, validate
from ..errors import ConfigError
from ..hardware import CATALOGUE, Hardware, table_peak_tflops
from ..memory.estimate import estimate_all_ranks
from ..parallel.data_parallel import check_offload
from ..parallel.dims import layout_for
from ..peft.qlora import check_quantize_base
from ..step_time import predict_step, work_of
from ..units import GIB, size_text
from .optim import check_optimizer, lowbit_available

MAX_CHANGES = 4  # levers changed together at most
MAX_ESTIMATES = 300  # memory estimates per search at most (a few ms each on an 8B config)
MARGIN = 0.10  # of the device's memory left free, as the planner leaves it

Options = Callable[[RunConfig, int, str], list[list[str]]]


@dataclass(frozen=True)
class Lever:
    """One way to lower memory: its name, the settings it offers a config (each a list of `--set`
    strings, `key=value`) given the processes and the device kind, and what it changes of the training
    itself (empty when the maths stays the same)."""

    name: str
    options: Options
    changes_training: str = ""


def setting(key: str, value: Any) -> str:
    """`key=value` as `--set` takes it (the value in YAML: true, null, 4, bf16)."""
    if value is None or isinstance(value, bool):
        return f"{key}={'null' if value is None else str(value).lower()}"
    return f"{key}={value}"


# --- the levers -----------------------------------------------------------------------------------


def _micro_batch(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """A smaller micro-batch, halved once or more (down to 1), with the accumulation that keeps the
    global batch."""
    mbs = cfg.train.micro_batch_size
    sizes = sorted({mbs // 2**k for k in range(1, mbs.bit_length()) if mbs % 2**k == 0} | ({1} if mbs > 1 else set()),
                   reverse=True)
    ga = cfg.gradient_accumulation(world)
    out = []
    for size in sizes:
        sets = [setting("train.micro_batch_size", size)]
        if cfg.train.global_batch_size is None or cfg.optimize.gradient_accumulation_steps is not None:
            sets.append(setting("optimize.gradient_accumulation_steps", ga * mbs // size))
        out.append(sets)
    return out


def _recompute(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """More recompute: selective, then full (every block). (`auto`'s per-layer plan is chosen for a given
    device at launch; a plan that recomputes less than full is raised to full.)"""
    o = cfg.optimize
    full = [setting("optimize.recompute", "full")] + ([setting("optimize.recompute_every", 1)]
                                                       if o.recompute_every != 1 else [])
    if o.recompute == "none":
        return [[setting("optimize.recompute", "selective")], full]
    if o.recompute == "selective":
        return [full]
    if o.recompute == "auto":
        plan = o.recompute_layers or []
        return [] if plan and all(m == "full" for m in plan) else [full + [setting("optimize.recompute_layers", None)]]
    return [[setting("optimize.recompute_every", 1)]] if o.recompute_every > 1 else []


def _zero(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """A higher ZeRO stage (under data parallelism)."""
    p = cfg.parallel
    if p.dp_degree(world) < 2:
        return []
    return [[setting("parallel.zero_stage", s)] for s in range(p.zero_stage + 1, 4)]


def _offload(key: str) -> Options:
    def options(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
        """CPU offload (not on a CPU, where everything already lives in CPU memory)."""
        if kind == "cpu" or getattr(cfg.optimize, key):
            return []
        return [[setting(f"optimize.{key}", True)]]
    return options


def _stream_optimizer(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """The optimizer state (and O2's masters) in host memory, updated on the device (offload_optimizer
    stream): Adam, AdamW and the 8-bit AdamW, not on a CPU (where everything already lives in CPU memory)."""
    if kind == "cpu" or cfg.optimize.offload_optimizer or cfg.train.optimizer not in ("adamw", "adam", "adamw_8bit"):
        return []
    return [[setting("optimize.offload_optimizer", "stream")]]


def _quantized_base(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """LoRA's frozen base weights stored in 8 or 4 bits (QLoRA)."""
    if cfg.lora is None or getattr(cfg.lora, "quantize_base", "none") != "none":
        return []
    return [[setting("lora.quantize_base", q)] for q in ("int8", "nf4")]


def _pure_16_bit(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """Precision level O3 (16-bit weights, gradients and optimizer state) where the run is 16-bit."""
    if cfg.optimize.mixed_precision == "fp32" or cfg.optimize.level() == "O3":
        return []
    return [[setting("optimize.precision_level", "O3")]]


def _chunked_loss(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """The chunked loss (no [tokens, vocab] logits)."""
    return [] if cfg.optimize.chunked_loss else [[setting("optimize.chunked_loss", True)]]


def _optimizer_state(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """Smaller Adam moments: bf16, or torchao's 8-bit AdamW where it can be imported."""
    t = cfg.train
    out = []
    if t.optimizer in ("adam", "adamw") and t.optimizer_state_dtype != "bf16" and cfg.optimize.level() != "O3":
        out.append([setting("train.optimizer_state_dtype", "bf16")])
    if t.optimizer == "adamw" and lowbit_available():
        out.append([setting("train.optimizer", "adamw_8bit")]
                   + ([setting("train.optimizer_state_dtype", "auto")] if t.optimizer_state_dtype != "auto" else []))
    return out


def _optimizer_in_backward(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """The update in backward (no full set of gradients), which clips no gradients (the trainer's checks
    refuse the layouts it does not suit: accumulation, a pipeline, ZeRO-1, fp16)."""
    t = cfg.train
    if t.optimizer_in_backward:
        return []
    return [[setting("train.optimizer_in_backward", True)]
            + ([setting("train.max_grad_norm", None)] if t.max_grad_norm is not None else [])]


def _reduce_every_micro_batch(cfg: RunConfig, world: int, kind: str) -> list[list[str]]:
    """ZeRO 2/3 gradients reduce-scattered after every micro-batch (sharded) instead of once per step."""
    p = cfg.parallel
    if p.dp_degree(world) < 2 or p.zero_stage < 2 or p.reduces_every_micro_batch():
        return []
    return [[setting("parallel.reduce_gradients", "every_micro_batch")]]


LEVERS: tuple[Lever, ...] = (
    Lever("chunked loss", _chunked_loss),
    Lever("optimizer state", _optimizer_state, "smaller Adam moments (bf16 or 8-bit)"),
    Lever("optimizer in backward", _optimizer_in_backward, "no gradient clipping"),
    Lever("precision O3", _pure_16_bit, "16-bit weights, gradients and optimizer state (no fp32 masters)"),
    Lever("reduce every micro-batch", _reduce_every_micro_batch),
    Lever("micro-batch", _micro_batch),
    Lever("recompute", _recompute),
    Lever("ZeRO stage", _zero),
    Lever("stream optimizer state", _stream_optimizer, "optimizer state in host memory, crossing the bus each step"),
    Lever("offload optimizer", _offload("offload_optimizer")),
    Lever("offload parameters", _offload("offload_params")),
    Lever("offload activations", _offload("offload_activations")),
    Lever("quantised base", _quantized_base, "LoRA's frozen base weights quantised (QLoRA)"),
)


# --- the search -----------------------------------------------------------------------------------


@dataclass
class Suggestion:
    """A set of changes, the config they give, its estimated peak (busiest rank) and step time."""

    sets: tuple[str, ...]  # `key=value`, as `--set` takes them
    levers: tuple[Lever, ...]
    cfg: RunConfig
    step_s: float
    peak: Optional[int] = None  # bytes; None until estimated
    cost: float = 1.0  # step time over the current config's

    def command_line(self) -> str:
        """The `--set` options to add to the run's command."""
        return " ".join(f"--set {s}" for s in self.sets)

    def training_changes(self) -> list[str]:
        """What the changes alter of the training itself (the others keep its maths)."""
        return [lever.changes_training for lever in self.levers if lever.changes_training]


@dataclass
class FitSearch:
    """What the search found: the cheapest fitting changes, and what it looked at."""

    usable: int  # bytes a device may fill
    current_peak: int
    target: int  # what a fit must stay under: `usable`, or when the current config fits by the estimate, 10% less
    current_step_s: float
    fits: list[Suggestion] = field(default_factory=list)  # cheapest first
    smallest: Optional[Suggestion] = None  # the least memory among those estimated (when none fits)
    candidates: int = 0  # valid combinations timed
    estimated: int = 0


def usable_bytes(capacity: int, hw: Hardware, processes_here: int = 1, margin: float = MARGIN) -> int:
    """Memory one device may fill: its memory less the margin and the runtime's reserve (the planner's
    rule); a CPU's memory is shared by the processes on the machine."""
    if hw.kind == "cpu":
        return int(capacity * (1 - margin) / max(1, processes_here))
    return int(capacity * (1 - margin) - hw.reserved_gib * GIB)


def hardware_for(kind: str, name: str = "", memory_bytes: Optional[int] = None) -> Hardware:
    """The catalogue entry of a running device: the measured `cpu` entry on a CPU; else the entry of
    the device's family (its name, as `PEAK_TFLOPS` knows it) nearest in memory, or H100's figures."""
    if kind == "cpu":
        return CATALOGUE["cpu"]
    found = table_peak_tflops(name, fp32=False)
    family = found[0].replace(" ", "") if found else None
    same = [h for h in CATALOGUE.values() if h.kind == kind and family and h.name.startswith(family)]
    if not same:
        same = [CATALOGUE["H100"]]
    if memory_bytes:
        return min(same, key=lambda h: abs(h.memory_gib * GIB - memory_bytes))
    return same[0]


def _peak(cfg: RunConfig, world: int, kind: str) -> int:
    return max(e.peak for e in estimate_all_ranks(cfg, world, kind))


def _runnable(raw: dict, sets: list[str], world: int, kind: str) -> Optional[RunConfig]:
    """The config `sets` give, if the schema and the trainer's start-up checks accept it."""
    try:
        cfg = validate(apply_overrides(raw, sets))
        dims = layout_for(cfg, world)
        device = torch.device(kind)
        check_offload(cfg, device, dims)
        check_optimizer(cfg, dims, world, device)
        check_quantize_base(cfg, dims)
    except (ConfigError, ValueError):  # a combination the run would refuse is not offered (a bug still raises)
        return None
    return cfg


def combinations(cfg: RunConfig, world: int, kind: str, levers: tuple[Lever, ...] = LEVERS,
                 max_changes: int = MAX_CHANGES) -> list[tuple[tuple[Lever, ...], tuple[str, ...]]]:
    """Every combination of up to `max_changes` levers (one setting each), fewest levers first: the
    levers and their `--set` strings."""
    offered = [(lever, opts) for lever in levers if (opts := lever.options(cfg, world, kind))]
    out = []
    for n in range(1, max_changes + 1):
        for chosen in itertools.combinations(offered, n):
            for picks in itertools.product(*(opts for _, opts in chosen)):
                out.append((tuple(lever for lever, _ in chosen), tuple(s for pick in picks for s in pick)))
    return out


def rank_key(c: Suggestion) -> tuple:
    """Cheapest first: by predicted step time (to 1% of the current config's, so that a saving the model
    barely sees does not outrank keeping the training's maths), then fewer levers that change the
    training, fewer levers, and the larger micro-batch (which the step-time model does not reward)."""
    return (round(c.cost, 2), len(c.training_changes()), len(c.levers), -c.cfg.train.micro_batch_size, c.step_s)


def find_fits(cfg: RunConfig, world: int, kind: str, hw: Hardware, usable: int, top: int = 2,
              levers: tuple[Lever, ...] = LEVERS, max_changes: int = MAX_CHANGES,
              max_estimates: int = MAX_ESTIMATES) -> FitSearch:
    """The `top` cheapest (`rank_key`) combinations of lever settings whose estimated peak on every rank
    fits in `usable` bytes (when the current config does already, by the estimate: 10% under its peak)."""
    work = work_of(cfg)  # the same FLOPs whatever the levers
    current = predict_step(cfg, world, hw, work=work).total
    peak = _peak(cfg, world, kind)
    target = usable if peak > usable else int(peak * (1 - MARGIN))
    result = FitSearch(usable=usable, current_peak=peak, target=target, current_step_s=current)
    raw = cfg.model_dump()
    raw["model"].pop("init_from", None)  # the architecture is resolved already; the weights do not matter
    candidates = []
    for used, sets in combinations(cfg, world, kind, levers, max_changes):
        variant = _runnable(raw, list(sets), world, kind)
        if variant is None:
            continue
        try:
            step = predict_step(variant, world, hw, work=work).total
        except ConfigError:  # a layout the models refuse (e.g. the estimator's offload rules)
            continue
        candidates.append(Suggestion(sets, used, variant, step, cost=step / current if current > 0 else math.nan))
    result.candidates = len(candidates)
    candidates.sort(key=rank_key)
    for c in candidates:
        if result.estimated >= max_estimates or len(result.fits) >= top:
            break
        if any(set(f.levers) <= set(c.levers) for f in result.fits):
            continue  # the levers of a cheaper fit, set differently or with more besides: not another way
        try:
            c.peak = _peak(c.cfg, world, kind)
        except ConfigError:  # no estimate, no suggestion
            continue
        result.estimated += 1
        if c.peak <= target:
            result.fits.append(c)
        elif result.smallest is None or c.peak < result.smallest.peak:
            result.smallest = c
    return result


def describe_fits(found: FitSearch) -> list[str]:
    """The search's findings as lines: each fitting combination with its estimated peak and speed cost,
    then the `--set` options to add to the command."""
    room = f"{size_text(found.usable)} usable, the device less a {MARGIN:.0%} margin"
    lines = []
    if found.current_peak <= found.usable:
        lines.append(f"By the estimate ({size_text(found.current_peak)}) the run fits ({room}): other memory users "
                     f"or fragmentation may be taking the rest; these changes lower the estimate to "
                     f"{size_text(found.target)} or less.")
        room = f"under {size_text(found.target)}"
    if not found.fits:
        lines.append(f"No combination of up to {MAX_CHANGES} changes fits ({room}); `shardwise plan` searches "
                     "parallel layouts, or use more devices.")
        if found.smallest is not None:
            lines += [f"The least memory found: {size_text(found.smallest.peak)} with",
                      f"  {found.smallest.command_line()}"]
        return lines
    lines.append(f"Changes the estimator says fit ({room}), cheapest first by the step-time model:")
    for i, fit in enumerate(found.fits, 1):
        notes = "; changes the training: " + ", ".join(fit.training_changes()) if fit.training_changes() else ""
        lines += [f"  {i}. estimated peak {size_text(fit.peak)}, step time x{fit.cost:.2f}{notes}",
                  f"     {fit.command_line()}"]
    return lines
