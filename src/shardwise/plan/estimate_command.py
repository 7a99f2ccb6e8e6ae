"""`shardwise estimate`: memory per device for a config file, or for a preset and layout flags."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..config import RunConfig, apply_overrides
from ..errors import ConfigError
from ..memory.auto_recompute import describe_plan, resolve_auto_recompute
from ..memory.estimate import estimate_all_ranks
from ..models import get_preset
from ..resolve import load_run_config, resolve_config
from ..train.dry_run import describe_run
from ..train.oom import device_memory_bytes
from ..train.run_dir import available_host_memory
from ..units import GIB
from .charts import write_estimate_report


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `shardwise estimate`."""
    p.add_argument("config", nargs="?", help="YAML run config (or give --model and the layout flags)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="devices (default: what the layout needs; needed with data_parallel -1)")
    p.add_argument("--device", choices=["cuda", "npu", "cpu"], default=None,
                   help="device kind (default: the config's run.device, cuda for auto); cpu counts tensors only")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="recompute auto: memory of one device to plan for (default: this machine's device)")
    p.add_argument("--report", metavar="DIR", help="write a memory chart (PNG, against --memory-gib or this "
                                                    "machine's device) and index.html to DIR (pip install "
                                                    "'shardwise[report]')")
    flags = p.add_argument_group("without a config file")
    flags.add_argument("--model", metavar="PRESET", help="model preset, e.g. llama_7b")
    flags.add_argument("--seq-length", type=int, default=2048)
    flags.add_argument("--micro-batch", type=int, default=1, help="samples per device per micro-batch")
    flags.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    flags.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    flags.add_argument("--pp", type=int, default=1, help="pipeline stages")
    flags.add_argument("--cp", type=int, default=1, help="context-parallel degree (each sequence split over it)")
    flags.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a MoE model's experts spread over "
                                                         "that many data-parallel ranks)")
    flags.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    flags.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    flags.add_argument("--level", choices=["O0", "O1", "O2", "O3"], default=None, help="precision level")
    flags.add_argument("--recompute", choices=["none", "selective", "full", "auto"], default="none")
    flags.add_argument("--offload", action="store_true",
                       help="optimize.offload_optimizer: masters and optimizer state on the host, the step on the CPU")
    flags.add_argument("--offload-params", action="store_true", help="optimize.offload_params: FSDP2's CPU offload")
    flags.add_argument("--offload-activations", action="store_true",
                       help="optimize.offload_activations: saved activations in host memory")
    flags.add_argument("--lora-r", type=int, default=None, metavar="R", help="LoRA rank (attention projections)")
    flags.add_argument("--freeze-layers", type=int, default=0, metavar="N", help="freeze the bottom N blocks")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config to estimate: the file with its overrides, or one built from the flags."""
    if args.config and args.model:
        raise ConfigError("give a config file or --model, not both (override the file's model with "
                          "--set model.preset=NAME)")
    if args.config:
        return load_run_config(args.config, args.set)
    if not args.model:
        raise ConfigError("give a config file, or --model PRESET with the layout flags (--dp, --tp, --pp, --zero, ...)")
    raw: dict[str, Any] = {
        "model": {"preset": args.model},
        "data": {"seq_length": args.seq_length},
        "train": {"max_steps": 1, "micro_batch_size": args.micro_batch},
        "parallel": {"data_parallel": args.dp, "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                     "zero_stage": args.zero, "context_parallel": args.cp,
                     "expert_parallel": args.ep,
                     **({"micro_batch_num": max(2, args.pp)} if args.pp > 1 else {})},
        "optimize": {"mixed_precision": args.precision, "recompute": args.recompute,
                     "offload_optimizer": args.offload, "offload_params": args.offload_params,
                     "offload_activations": args.offload_activations,
                     **({"precision_level": args.level} if args.level else {})},
    }
    model = raw["model"]
    if args.seq_length > get_preset(args.model).get("max_position_embeddings", args.seq_length):
        model["max_position_embeddings"] = args.seq_length
    if args.lora_r:
        raw["lora"] = {"r": args.lora_r, "alpha": 2 * args.lora_r}
    if args.freeze_layers:
        raw["freeze"] = {"layers": args.freeze_layers}
    return resolve_config(apply_overrides(raw, args.set))


def device_kind(cfg: RunConfig, given: str | None) -> str:
    """The device kind to estimate for: the flag, the config's run.device, or cuda for auto."""
    if given:
        return given
    return cfg.run.device if cfg.run.device in ("cuda", "npu", "cpu") else "cuda"


def local_capacity(device: str) -> int | None:
    """Memory of one device of kind `device` on this machine (a CPU: its free memory), None if it has none."""
    if device == "cpu":
        return available_host_memory()
    module = getattr(torch, device, None)
    if module is None or not module.is_available():
        return None
    return device_memory_bytes(torch.device(device, 0))


def resolve_recompute(cfg: RunConfig, devices: int | None, device: str, memory_gib: float | None = None) -> RunConfig:
    """recompute auto: `cfg` with its per-layer plan for devices of `memory_gib` GiB (default: this machine's)."""
    if cfg.optimize.recompute != "auto" or cfg.optimize.recompute_layers is not None:
        return cfg
    capacity = int(memory_gib * GIB) if memory_gib else local_capacity(device)
    if capacity is None:
        raise ConfigError(f"optimize.recompute auto plans for a device's memory: this machine has no {device} "
                          "device, so give --memory-gib (one device's memory in GiB)")
    return resolve_auto_recompute(cfg, devices, device, capacity)


def describe_memory(cfg: RunConfig, devices: int | None, device: str, memory_gib: float | None = None) -> str:
    """The estimate as text: one table per pipeline stage (one table without a pipeline)."""
    note = ""
    try:
        if cfg.optimize.recompute == "auto" and cfg.optimize.recompute_layers is None:
            cfg = resolve_recompute(cfg, devices, device, memory_gib)
            note = f"recompute auto: {describe_plan(cfg.optimize.recompute_layers)}\n"
        estimates = estimate_all_ranks(cfg, devices, device)
    except ConfigError as exc:  # e.g. a seed file's pipeline layout that the run itself would refuse
        return f"memory estimate: none, the layout cannot run as given: {exc}"
    blocks = [e.table() for e in estimates]
    if len(estimates) > 1:
        worst = max(range(len(estimates)), key=lambda i: estimates[i].peak)
        blocks.append(f"the busiest device is pipeline rank {worst}")
    return f"{note}memory estimate for {device}:\n" + "\n".join(blocks)


def run_estimate(args: argparse.Namespace) -> int:
    """`shardwise estimate`: print the estimate (a layout that cannot run fails with its reason)."""
    cfg = config_from_args(args)
    device = device_kind(cfg, args.device)
    devices = args.nproc or cfg.parallel.world_size()
    planned = resolve_recompute(cfg, devices, device, args.memory_gib)
    estimates = estimate_all_ranks(planned, devices, device)  # raises the ConfigError that says why
    if args.json:
        print(json.dumps([e.as_dict() for e in estimates], indent=1))
    else:
        print(describe_run(cfg, devices))
        print(describe_memory(cfg, devices, device, args.memory_gib))
    if getattr(args, "report", None):
        capacity = int(args.memory_gib * GIB) if args.memory_gib else local_capacity(device)
        index = write_estimate_report(estimates, args.report, capacity)
        if not args.json:
            print(f"report: {index}")
    return 0
