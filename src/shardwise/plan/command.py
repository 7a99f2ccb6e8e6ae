"""`shardwise plan`: its options and what it does with them (cli.py adds the parser and calls `run_plan`)."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from ..config import RunConfig, validate
from ..errors import ConfigError
from ..hardware import CATALOGUE, Hardware, custom_hardware, get_hardware, known_names, load_hardware_file
from ..resolve import load_run_config
from .budget import BATCH_RULE, VOCAB_SIZE, BudgetPlan, default_global_batch, plan_budget
from .charts import write_plan_report
from .profile import profile_plan
from .report import format_budget, format_plan
from .search import PlanRequest, PlanResult, plan, workload_config

DESCRIPTION = """\
Rank parallel layouts of a model on some hardware: every DP x TP x PP split, ZeRO stage, recompute
mode, micro-batch size and pipeline schedule is timed by a cost model (compute at an achievable
share of peak, TP/DP/PP communication over the node's and the network's links, pipeline bubbles,
recompute, the optimizer step); those whose estimated memory does not fit (with a safety margin)
are dropped; the fastest 10 are printed with memory, tokens/s per device and MFU, and why the first
wins. The physical limit (tokens/s per device at 100% MFU) is always shown. With --profile N the top
layouts run N real steps on the devices present, the model is calibrated, and the plan is ranked again.
With --budget-hours, --budget-flops or --tokens it first sizes the model and its tokens for the budget
(Hoffmann et al. 2022's fit, an extrapolation) and plans that model; --report DIR draws the charts."""

EPILOG = """\
examples:
  shardwise plan --model llama_7b --devices 8 --hardware H100 --seq-length 2048 --global-batch 64
  shardwise plan --model llm_100b --devices 32 --hardware Ascend910B3 --seq-length 4096 --global-batch 512 \\
      --target-tokens-per-s 15000
  shardwise plan --model llama_7b --devices 8 --hardware 910B --lora --seq-length 2048 --global-batch 128
  shardwise plan --model llama_13b --devices 16 --memory-gb 48 --tflops 362 --bandwidth-gbps 32
  shardwise plan configs/demo.yaml --devices 2 --hardware cpu --profile 3
  shardwise plan --budget-hours 720 --devices 64 --hardware H100 --price-per-device-hour 2.5 --report plan_out
  shardwise plan --budget-flops 1e22 --tokens 5e10 --devices 8 --hardware A100-80GB
  shardwise plan --list-hardware"""


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `shardwise plan`."""
    p.add_argument("config", nargs="?", help="a run config to plan for (its model, sequence, batch, precision, "
                                             "LoRA/freeze); or give --model")
    p.add_argument("--model", metavar="PRESET", help="a model preset, e.g. llama_7b, qwen2_7b, llm_100b")
    p.add_argument("--devices", type=int, metavar="N", help="devices to plan for (all nodes together)")
    p.add_argument("--nodes", type=int, metavar="K", help="nodes they sit in (default: from --devices-per-node)")
    p.add_argument("--devices-per-node", type=int, metavar="N", help="devices in one node (default: the hardware's)")
    hw = p.add_argument_group("hardware (a catalogue entry, a YAML file's, or your own numbers)")
    hw.add_argument("--hardware", metavar="NAME", help="catalogue name: H100, H100-PCIe, H200, A100-40GB, A100-80GB, "
                                                       "Ascend910B1..B4, cpu (see --list-hardware)")
    hw.add_argument("--hardware-file", metavar="YAML", help="more devices, one mapping per name (see --list-hardware)")
    hw.add_argument("--memory-gb", type=float, metavar="GIB", help="memory per device (custom hardware or override)")
    hw.add_argument("--tflops", type=float, metavar="T", help="dense bf16 peak TFLOP/s per device")
    hw.add_argument("--bandwidth-gbps", type=float, metavar="GB/S", help="link bandwidth per device inside a node")
    hw.add_argument("--inter-bandwidth-gbps", type=float, metavar="GB/S", help="per device between nodes")
    hw.add_argument("--list-hardware", action="store_true", help="print the catalogue and exit")
    w = p.add_argument_group("workload")
    w.add_argument("--seq-length", type=int, metavar="T", help="tokens per sample (default: the model's maximum)")
    w.add_argument("--global-batch", type=int, metavar="B",
                   help="samples per optimizer step (default 4 x devices; with a budget, DeepSeek LLM's B_opt for it)")
    w.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="training dtype (default bf16; fp32 on cpu)")
    w.add_argument("--precision-level", choices=["O1", "O2", "O3"], help="16-bit level (default O2)")
    w.add_argument("--lora", action="store_true", help="LoRA fine-tuning (r=8 on q/k/v/o) instead of full training")
    w.add_argument("--lora-rank", type=int, metavar="R", help="LoRA rank (implies --lora)")
    w.add_argument("--freeze-layers", type=int, metavar="K", help="freeze the bottom K layers")
    s = p.add_argument_group("search (comma lists pin a dimension, e.g. --tp 1,2 --zero 1)")
    for flag, what in (("--dp", "data-parallel degrees"), ("--tp", "tensor-parallel degrees"),
                       ("--pp", "pipeline stages"), ("--zero", "ZeRO stages"), ("--micro-batch", "micro-batch sizes"),
                       ("--cp", "context-parallel degrees (each sequence split over that many devices; tried by "
                                "default from 16k tokens, or when nothing fits without)"),
                       ("--ep", "expert-parallel degrees (mixture-of-experts models: each block's experts spread "
                                "over that many data-parallel ranks; every degree that divides both is tried)")):
        s.add_argument(flag, metavar="LIST", help=what)
    s.add_argument("--recompute", metavar="LIST", help="none, selective, full, auto (per layer, the least that fits)")
    s.add_argument("--schedule", metavar="LIST", help="1f1b, interleaved_1f1b, zero_bubble, gpipe")
    s.add_argument("--no-offload", action="store_true", help="leave CPU offload out of the search")
    s.add_argument("--memory-margin", type=float, default=0.10, metavar="F",
                   help="share of device memory kept free (default 0.1)")
    s.add_argument("--top", type=int, default=10, metavar="K", help="layouts to print (default 10)")
    s.add_argument("--expert-imbalance", type=float, default=1.0, metavar="F",
                   help="mixture-of-experts models: the busiest expert-parallel rank's routed copies over the even "
                        "share (default 1.0, even; a run's step records give each block's busiest expert over the "
                        "mean as expert_load)")
    s.add_argument("--target-tokens-per-s", type=float, metavar="X",
                   help="tokens/s per device you hope for: checked against the physical limit")
    pr = p.add_argument_group("profiling")
    pr.add_argument("--profile", type=int, metavar="N", help="run N real steps of the top layouts here, calibrate, "
                                                             "and rank again")
    pr.add_argument("--profile-top", type=int, default=3, metavar="K", help="layouts to profile (default 3)")
    b = p.add_argument_group("budget (compute-optimal size from Hoffmann et al. 2022's fit: an extrapolation)")
    b.add_argument("--budget-hours", type=float, metavar="H", help="wall hours on the devices: the model size and "
                                                                   "tokens they buy at the planner's throughput")
    b.add_argument("--budget-flops", type=float, metavar="F", help="training FLOPs (6 x parameters x tokens)")
    b.add_argument("--tokens", type=float, metavar="T", help="distinct training tokens available: caps the data "
                                                             "(repeats discounted); alone, sizes the model for them")
    b.add_argument("--price-per-device-hour", type=float, metavar="P", help="price of one device for an hour: "
                                                                            "prints the cost")
    b.add_argument("--vocab-size", type=int, metavar="V", help=f"your tokenizer's vocabulary, for the model sized "
                                                               f"without --model or a config (default {VOCAB_SIZE})")
    p.add_argument("--report", metavar="DIR", help="write charts (PNG) and a self-contained index.html to DIR "
                                                    "(needs matplotlib: pip install 'shardwise[report]')")


def _ints(text: Optional[str], flag: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 1,2,4") from None


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    """The hardware the options describe."""
    extra = load_hardware_file(args.hardware_file) if args.hardware_file else {}
    custom = (args.memory_gb, args.tflops, args.bandwidth_gbps)
    if args.hardware is not None:
        hw = get_hardware(args.hardware, extra)
        if any(v is not None for v in custom):
            hw = custom_hardware(*custom, base=hw, name=f"{hw.name} (modified)")
    elif all(v is not None for v in custom):
        hw = custom_hardware(*custom)
    else:
        given = [f for f, v in zip(("--memory-gb", "--tflops", "--bandwidth-gbps"), custom) if v is not None]
        missing = [f for f, v in zip(("--memory-gb", "--tflops", "--bandwidth-gbps"), custom) if v is None]
        raise ConfigError("say what to plan on: --hardware NAME (" + ", ".join(known_names(extra)) + ")"
                          + (f", or add {', '.join(missing)} to {', '.join(given)} for custom hardware" if given
                             else ", or --memory-gb, --tflops and --bandwidth-gbps for your own"))
    changes: dict[str, Any] = {}
    if args.inter_bandwidth_gbps is not None:
        changes["inter_bandwidth_gbps"] = args.inter_bandwidth_gbps
    if args.devices_per_node is not None:
        if args.devices_per_node < 1:
            raise ConfigError(f"--devices-per-node {args.devices_per_node}: give at least 1")
        changes["devices_per_node"] = args.devices_per_node
    return hw.with_changes(**changes) if changes else hw


def list_hardware(extra_file: Optional[str] = None) -> str:
    """The catalogue as a table."""
    table = {**CATALOGUE, **(load_hardware_file(extra_file) if extra_file else {})}
    rows = [("name", "memory GiB", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "in node GB/s", "between GB/s",
             "per node", "compute eff", "source")]
    for h in table.values():
        rows.append((h.name, f"{h.memory_gib:g}", f"{h.tflops_16:g}", f"{h.tflops_32:g}",
                     f"{h.memory_bandwidth_gbps:g}", f"{h.intra_bandwidth_gbps:g}", f"{h.inter_bandwidth_gbps:g}",
                     str(h.devices_per_node), f"{h.compute_efficiency:g}", h.source))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run_plan(args: argparse.Namespace) -> int:
    """Plan (and profile) as the options say; print the report (with a budget: the sizing first)."""
    if args.list_hardware:
        print(list_hardware(args.hardware_file))
        return 0
    if args.devices is None:
        raise ConfigError("--devices N is required: how many devices to plan for")
    if args.devices < 1:
        raise ConfigError(f"--devices {args.devices}: give at least 1 device")
    budgeted = any(getattr(args, k, None) is not None for k in ("budget_hours", "budget_flops", "tokens"))
    if args.config is None and args.model is None and not budgeted:
        raise ConfigError("give a model preset (--model NAME, e.g. llama_7b) or a run config file to plan for "
                          "(or a budget: --budget-hours, --budget-flops or --tokens)")
    if args.config is not None and args.model is not None:
        raise ConfigError("give either a run config or --model, not both")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: give at least 1")
    if args.price_per_device_hour is not None and not budgeted:
        raise ConfigError("--price-per-device-hour prices a budget: give --budget-hours, --budget-flops or --tokens")
    if getattr(args, "vocab_size", None) is not None and not budgeted:
        raise ConfigError("--vocab-size shapes the model a budget sizes: give --budget-hours, --budget-flops or "
                          "--tokens (a model you plan directly has its own vocabulary)")
    if args.profile is not None and args.profile < 1:
        raise ConfigError(f"--profile {args.profile}: give at least 1 step")
    hw = hardware_from_args(args)
    base = load_run_config(args.config) if args.config else None  # init_from: the weights' architecture
    lora_rank = args.lora_rank if args.lora_rank is not None else (8 if args.lora else None)
    if lora_rank is not None and lora_rank < 1:
        raise ConfigError(f"--lora-rank {lora_rank}: give at least 1")
    pins = _pins(args)
    if args.nodes is not None and args.nodes > 1 and args.devices_per_node is None:
        hw = hw.with_changes(devices_per_node=max(1, args.devices // args.nodes))

    def workload(config: Optional[RunConfig], model: Optional[str], global_batch: Optional[int] = None) -> RunConfig:
        return workload_config(model=model, config=config, seq_length=args.seq_length,
                               global_batch=global_batch or args.global_batch, devices=args.devices,
                               precision=args.precision, precision_level=args.precision_level, lora_rank=lora_rank,
                               freeze_layers=args.freeze_layers, hardware=hw)

    def plan_cfg(cfg: RunConfig) -> PlanResult:
        return plan(PlanRequest(cfg=cfg, devices=args.devices, hardware=hw, nodes=args.nodes,
                                memory_margin=args.memory_margin, top=args.top, pins=pins,
                                offload=not args.no_offload, target_tokens_per_s=args.target_tokens_per_s,
                                expert_imbalance=args.expert_imbalance))

    budget: Optional[BudgetPlan] = None
    if budgeted:
        budget = run_budget(args, hw, base, workload, plan_cfg)
        result = budget.result
        print(format_budget(budget))
        print()
    else:
        result = plan_cfg(workload(base, args.model))
    print(format_plan(result))
    profiled = None
    if args.profile is not None:
        profiled = profile_plan(result, args.profile, top=max(1, args.profile_top))
        print(profiled.report())
    if args.report:
        print(f"\nreport: {write_plan_report(result, args.report, profiled, budget)}")
    return 0


def _pins(args: argparse.Namespace) -> dict[str, list[Any]]:
    """The search dimensions the options pin."""
    pins: dict[str, list[Any]] = {}
    for key, flag in (("dp", "--dp"), ("tp", "--tp"), ("pp", "--pp"), ("zero", "--zero"),
                      ("micro_batch", "--micro-batch"), ("cp", "--cp"), ("ep", "--ep")):
        values = _ints(getattr(args, key), flag)
        if values is not None:
            pins[key] = values
    for key in ("recompute", "schedule"):
        text = getattr(args, key)
        if text is not None:
            pins[key] = [x.strip() for x in text.split(",") if x.strip()]
    return pins


def run_budget(args: argparse.Namespace, hw: Hardware, base: Optional[RunConfig],
               workload: Callable[[Optional[RunConfig], Optional[str], Optional[int]], RunConfig],
               plan_cfg: Callable[[RunConfig], PlanResult]) -> BudgetPlan:
    """Size the budget the options give; the model is the one given (--model or the config) or, without
    one, a LLaMA-like shape near the compute-optimal size (`budget.family_model`) with --vocab-size tokens.
    Each model is planned at --global-batch, the config's train.global_batch_size, or else the budget's
    default (`budget.default_global_batch`: DeepSeek LLM's B_opt in tokens)."""
    refuse_fine_tuning(args, base)
    if args.vocab_size is not None and (base is not None or args.model is not None):
        raise ConfigError("--vocab-size shapes the model sized for the budget: with --model or a config the "
                          "model (and its vocabulary) is given; drop --vocab-size")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise ConfigError(f"--vocab-size {args.vocab_size}: give your tokenizer's vocabulary, e.g. 128256")
    fixed = workload(base, args.model, 1).model.model_dump(mode="json") \
        if base is not None or args.model is not None else None
    given_batch = args.global_batch or (base.train.global_batch_size if base is not None else None)
    precision = args.precision or ("fp32" if hw.kind == "cpu" else "bf16")

    def plan_model(fields: dict[str, Any], flops: float) -> PlanResult:
        config, model = (base, args.model) if fields == fixed else (
            validate({"model": fields, "train": {"max_steps": 1}, "optimize": {"mixed_precision": precision}}), None)
        seq_length = workload(config, model, 1).data.seq_length
        return plan_cfg(workload(config, model, given_batch or default_global_batch(flops, seq_length, args.devices)))

    peak = hw.peak_tflops(precision) * 1e12 * args.devices * hw.compute_efficiency
    bp = plan_budget(plan_model, peak, hours=args.budget_hours, flops=args.budget_flops, unique_tokens=args.tokens,
                     model=fixed, price_per_device_hour=args.price_per_device_hour,
                     max_positions=max(2048, args.seq_length or 0), vocab_size=args.vocab_size or VOCAB_SIZE)
    bp.batch_source = ("--global-batch" if args.global_batch else "the config's train.global_batch_size"
                       if given_batch else f"the budget's default, {BATCH_RULE}; --global-batch to choose")
    return bp


def refuse_fine_tuning(args: argparse.Namespace, base: Optional[RunConfig]) -> None:
    """A budget sizes a model trained from scratch (C = 6ND over every weight): refuse LoRA, frozen layers
    and fine-tunes, naming the option or config field."""
    found = [flag for flag, on in (("--lora", args.lora), ("--lora-rank", args.lora_rank is not None),
                                   ("--freeze-layers", args.freeze_layers is not None)) if on]
    if base is not None:
        found += [field for field, on in (("lora", base.lora is not None),
                                          ("freeze.layers", base.freeze.layers > 0),
                                          ("freeze.embeddings", base.freeze.embeddings),
                                          ("model.init_from", base.model.init_from is not None),
                                          ("data.kind: instruction", base.data.kind == "instruction")) if on]
    if found:
        raise ConfigError(f"a budget (--budget-hours/--budget-flops/--tokens) sizes a model pre-trained from "
                          f"scratch, and {', '.join(found)} makes this a fine-tune: remove {', '.join(found)} "
                          "to size a pre-training run, or plan the fine-tune without a budget")
