"""What a run would do, resolved from its config alone: no device, no data touched."""

from __future__ import annotations

from ..builder import build_run_model, describe_finetuning, trainable_summary
from ..config import RunConfig, tokens_per_step
from ..memory.estimate import run_flops
from ..models import count_parameters
from ..units import human


def describe_run(cfg: RunConfig, devices: int | None = None) -> str:
    """A short report: model size, layout, batch, tokens and FLOPs per step."""
    m, p, o, t = cfg.model, cfg.parallel, cfg.optimize, cfg.train
    world = p.world_size(devices)
    dp = p.dp_degree(devices)
    params = count_parameters(m)
    tokens = tokens_per_step(cfg, devices)
    flops_tok = run_flops(cfg).total
    dp_note = " (data_parallel -1: what the devices leave; pass --nproc to resolve it)" if (
        p.data_parallel == -1 and devices is None) else ""
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs:g} epochs (steps follow from the data)"
    lines = [
        f"model        {m.preset or m.model_type}: {params:,} parameters ({human(params)}), "
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / {m.num_kv_heads} kv heads, "
        f"FFN {m.intermediate_size}, vocab {m.vocab_size}, {m.position} positions, {m.norm}",
        f"layout       {world} device(s) = data {dp} x tensor {p.tensor_parallel} x pipeline "
        f"{p.pipeline_parallel}" + (f" x context {p.context_parallel}" if p.context_parallel > 1 else "")
        + f"{dp_note}; ZeRO stage {p.zero_stage}"
        + (f"; {p.schedule} schedule, {p.micro_batch_num} micro-batches" if p.pipeline_parallel > 1 else ""),
        f"device       {cfg.run.device}; {_compiled(cfg)}",
        f"precision    {o.mixed_precision} level {o.level()}; recompute {o.recompute}"
        + (f" every {o.recompute_every} layer(s)" if o.recompute == "full" and o.recompute_every > 1 else ""),
        f"batch        micro-batch {t.micro_batch_size} x accumulation {cfg.gradient_accumulation(devices)} x "
        f"data parallel {dp} = {cfg.global_batch_size(devices)} "
        + ("pairs (chosen and rejected: two rows each)" if cfg.data.kind == "preference" else "samples")
        + f" of {cfg.data.seq_length} tokens",
        f"per step     {tokens:,} tokens, {flops_tok * tokens:.3e} FLOPs "
        f"({flops_tok:.3e} FLOPs per token: forward, and backward where gradients are needed)",
        f"length       {length}; lr {t.lr:g} -> {t.min_lr:g} ({t.decay_style}, {t.warmup_steps} warmup), "
        f"{t.optimizer}",
        f"output       {t.output_dir}",
    ]
    finetune = _finetune_line(cfg)
    if finetune:
        lines.insert(1, finetune)
    return "\n".join(lines)


def _finetune_line(cfg: RunConfig) -> str | None:
    """Where the weights start, and what trains (LoRA / frozen layers), counted on a meta-device model."""
    if cfg.model.init_from is None and cfg.lora is None and not cfg.freeze.active():
        return None
    model = build_run_model(cfg, "meta")
    how = describe_finetuning(model, cfg.lora, cfg.freeze) or "all weights train"
    start = f"from {cfg.model.init_from}" if cfg.model.init_from else "from random weights"
    return f"fine-tune    {start}; {how}: {trainable_summary(model)}"


def _compiled(cfg: RunConfig) -> str:
    """How the blocks run: compiled, eager, or (auto) by the device found at start."""
    if cfg.run.compile == "auto":
        return "compiled (torch.compile) on CUDA / NPU, eager on a CPU (run.compile auto)"
    return "compiled (torch.compile)" if cfg.run.compile else "eager"
