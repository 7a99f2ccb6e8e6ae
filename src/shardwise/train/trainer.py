"""The training loop: from a validated config to optimizer steps, metrics and checkpoints, on one
device or many (the parallel layout is applied from outside, by `parallelize_model`).

Read `Trainer.train()` top to bottom: it prepares the run directory, data, model, precision,
optimizer and loader, resumes if asked, then runs steps (micro-batches -> forward/backward ->
unscale -> clip -> step), logging, evaluating and checkpointing on the way.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from ..config import RunConfig, to_yaml, tokens_per_step
from ..data.loader import StatefulLoader, sequential_batches, unwrap_loader
from ..errors import ConfigError, TrainingError
from ..memory.precision import LossScaler, MasterWeights, precision_plan
from ..models import build_model, flops_per_token, materialize
from ..parallel.collectives import max_over, rank0_first, replica_mismatch, sum_over
from ..parallel.data_parallel import clip_grad_norm, grad_sync
from ..parallel.dims import ParallelDims, dims_from_config
from ..parallel.launch import DistContext, init_distributed
from ..parallel.parallelize import parallelize_model
from . import checkpoint as ckpt
from .metrics import MetricsWriter, peak_flops, peak_memory_gb, reset_peak_memory
from .optim import LRSchedule, build_optimizer

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
_RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.yaml", "tokenizer")


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports back."""

    run_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    eval: dict[str, float] | None = None
    last_checkpoint: Path | None = None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the real (not ignored) label positions.

    Under tensor parallelism the logits are a DTensor sharded on the vocabulary; the loss is then
    computed shard-wise (`token_loss_sum_tp`), never gathering the full logits.
    """
    if isinstance(logits, DTensor):
        from ..parallel.tensor import token_loss_sum_tp

        return token_loss_sum_tp(logits, labels)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _model_extras(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Document-aware position ids and masks, when the data provides them."""
    keys = ("position_ids", "document_ids", "attention_mask")
    return {k: mb[k].to(device, non_blocking=True) for k in keys if k in mb}


def count_target_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    """Label positions that carry a loss, over all micro-batches of one step."""
    return int(sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches))


class Trainer:
    """Pre-trains (or continues training) a model on one device as a RunConfig describes."""

    def __init__(self, config: RunConfig, model: nn.Module | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, tokenizer: Any = None) -> None:
        self.config = config
        self.model = model
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer

    # --- the run, top to bottom -------------------------------------------------------------------

    def train(self, resume: str | None = None, overwrite: bool = False) -> TrainResult:
        """Run training to `max_steps` (or the epochs' worth), resuming when asked."""
        cfg = self.config
        run_dir = Path(cfg.train.output_dir)
        # Everything that can fail on the config alone fails before --overwrite removes anything.
        ctx = init_distributed(cfg.run.device, cfg.run.timeout_s)
        dims = layout_for(cfg, ctx.world_size)
        device = ctx.device
        check_offload(cfg, device, dims)
        if not ctx.is_main:
            logging.getLogger("shardwise").setLevel(logging.WARNING)  # one rank logs the run
        if ctx.restart_count:
            # Restarted by the launcher after a failure: continue from the newest checkpoint (also when the
            # first attempt resumed from an older one).
            resume = "auto"
            if ctx.is_main:
                log.warning("restart %d of the process group: resuming from the newest checkpoint",
                            ctx.restart_count)
        rank0_first(lambda: prepare_run_dir(run_dir, resume, overwrite), ctx.rank)
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        meshes = dims.build_meshes(device.type) if dims.distributed else None

        # Rank 0 prepares the data (and the shared cache) first; the others then find it ready.
        rank0_first(lambda: self._prepare_data(run_dir, save_tokenizer=True), ctx.rank)
        if not ctx.is_main:
            self._prepare_data(run_dir, save_tokenizer=False)
        plan = precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
        # Under data parallelism, O2's fp32 master weights are FSDP2's sharded fp32 parameters, cast
        # to 16 bits for compute by its mixed-precision policy.
        fsdp_masters = dims.dp > 1 and plan.master_weights
        model = self._prepare_model(device, torch.float32 if fsdp_masters else plan.param_dtype, dims, meshes,
                                    plan.param_dtype if fsdp_masters else None)
        names = ckpt.canonical_param_names(model)  # as checkpoints name them: no wrapper prefixes
        trainable = [(names[id(p)], p) for p in model.parameters() if p.requires_grad]
        masters = MasterWeights(trainable) if plan.master_weights and not fsdp_masters else None
        opt_named = list(masters.named_masters()) if masters else trainable
        optimizer = build_optimizer(opt_named, cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay,
                                    (cfg.train.beta1, cfg.train.beta2), cfg.train.eps)
        if dims.dp > 1:
            from ..parallel.data_parallel import shard_optimizer

            optimizer = shard_optimizer(optimizer, model)
        scaler = None
        if plan.needs_loss_scaling:
            dynamic = cfg.optimize.loss_scale == "dynamic"
            scaler = LossScaler(cfg.optimize.initial_loss_scale if dynamic else float(cfg.optimize.loss_scale),
                                dynamic=dynamic)
        grad_accum = cfg.gradient_accumulation()
        # Dynamically batched data holds whole micro-batches per item (sized by micro_batch_size rows).
        items_per_micro_batch = 1 if getattr(self.train_dataset, "items_are_batches", False) else \
            cfg.train.micro_batch_size
        loader = StatefulLoader(self.train_dataset, items_per_micro_batch, grad_accum, cfg.train.seed,
                                dp_rank=meshes["dp"].get_local_rank() if meshes else 0, dp_size=dims.dp,
                                shuffle=getattr(self.train_dataset, "shuffle", True),
                                num_workers=cfg.data.num_workers)
        total_steps = self._total_steps(loader)
        schedule = LRSchedule(cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, total_steps,
                              cfg.train.decay_style, cfg.train.wsd_decay_ratio)

        state = _TrainState(model=model, optimizer=optimizer, opt_named=opt_named, masters=masters,
                            scaler=scaler, loader=loader, ctx=ctx, dims=dims, meshes=meshes)
        start = self._resume(resume, run_dir, state, overwrite)
        if ctx.is_main:
            (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")  # the config in force

        step_tokens = tokens_per_step(cfg)
        flops_tok = flops_per_token(cfg.model, cfg.data.seq_length)
        peak = peak_flops(device, plan.dtype, cfg.train.peak_tflops)
        writer = MetricsWriter(run_dir, tensorboard=cfg.train.tensorboard, enabled=ctx.is_main)
        log.info("training %s on %s: %d steps of %d tokens, precision %s %s, recompute %s%s",
                 cfg.model.preset or cfg.model.model_type, device, total_steps, step_tokens,
                 cfg.optimize.mixed_precision, plan.level, cfg.optimize.recompute,
                 f", {ctx.world_size} processes (dp {dims.dp} x tp {dims.tp} x pp {dims.pp}, ZeRO "
                 f"{cfg.parallel.zero_stage})" if dims.distributed else "")

        result = TrainResult(run_dir=run_dir, step=start)
        bar = tqdm(total=total_steps, initial=start, disable=not (cfg.train.progress_bar and ctx.is_main), unit="step",
                   dynamic_ncols=True, desc="train")
        window = _Window(time.perf_counter())
        reset_peak_memory(device)
        try:
            for step in range(start, total_steps):
                lr = schedule.apply(optimizer, step)
                micro_batches = loader.next_step()
                loss, grad_norm, skipped, tokens = self._step(state, plan, micro_batches, device, step)
                done = step + 1
                result.step = done
                result.losses[done] = loss
                window.add(loss, tokens, skipped)
                bar.update(1)
                if cfg.train.check_replicas_steps and done % cfg.train.check_replicas_steps == 0:
                    check_replicas(state, done, cfg.parallel.zero_stage)
                if done % cfg.train.log_steps == 0 or done == total_steps:
                    record = window.record(done, lr, grad_norm, scaler, flops_tok, peak, device, ctx.world_size)
                    writer.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    log.info(_format_record(record))
                    window = _Window(time.perf_counter())
                # Save first: a failure during evaluation must not cost the step's checkpoint.
                if (cfg.train.save_steps and done % cfg.train.save_steps == 0) or done == total_steps:
                    result.last_checkpoint = self._save(run_dir, done, state)
                    window.start = time.perf_counter()
                if self.eval_dataset is not None and (
                        done == total_steps or (cfg.train.eval_steps and done % cfg.train.eval_steps == 0)):
                    result.eval = self.evaluate(model, plan, device)
                    writer.write({"step": done, **{f"eval_{k}": v for k, v in result.eval.items()}})
                    log.info("step %d eval loss %.4f perplexity %.2f", done, result.eval["loss"],
                             result.eval["perplexity"])
                    window.start = time.perf_counter()
        finally:
            loader.close()
            bar.close()
            writer.close()
        return result

    # --- pieces of the run ------------------------------------------------------------------------

    def _prepare_data(self, run_dir: Path, save_tokenizer: bool = True) -> None:
        cfg = self.config
        if self.train_dataset is None:
            from ..data.build import build_data

            self.tokenizer, self.train_dataset, eval_ds = build_data(
                cfg.data, cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.train.seed)
            if self.eval_dataset is None:
                self.eval_dataset = eval_ds
        self.train_dataset = unwrap_loader(self.train_dataset)
        if cfg.train.eval_steps and self.eval_dataset is None:
            raise ConfigError(
                "train.eval_steps is set but there is no held-out data; set data.eval_fraction or "
                "data.eval_files (or pass eval_dataset=), or remove train.eval_steps"
            )
        if self.tokenizer is not None:
            if self.tokenizer.vocab_size > cfg.model.vocab_size:
                raise ConfigError(
                    f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is "
                    f"{cfg.model.vocab_size}; raise model.vocab_size to at least {self.tokenizer.vocab_size}"
                )
            tok_dir = run_dir / "tokenizer"
            if save_tokenizer and not tok_dir.exists():
                self.tokenizer.save(str(tok_dir))

    def _prepare_model(self, device: torch.device, dtype: torch.dtype, dims: ParallelDims, meshes: Any,
                       fsdp_param_dtype: torch.dtype | None) -> nn.Module:
        cfg = self.config
        if self.model is None:
            model = build_model(cfg.model, device=device, dtype=dtype)
        elif any(p.is_meta for p in self.model.parameters()):
            model = materialize(self.model, device, dtype)
        else:
            model = self.model.to(device=device, dtype=dtype)
            model.reset_rope_tables()  # keep RoPE tables in fp32 when the weights became 16-bit
        model = parallelize_model(model, cfg, dims, meshes, fsdp_param_dtype)
        self.model = model
        return model

    def _total_steps(self, loader: StatefulLoader) -> int:
        train = self.config.train
        if train.max_steps is not None:
            return train.max_steps
        return loader.steps_for_epochs(train.epochs)

    def _step(self, s: "_TrainState", plan: Any, micro_batches: list[dict[str, torch.Tensor]],
              device: torch.device, step: int) -> tuple[float, float, bool, int]:
        """One optimizer step; returns (loss, grad norm, skipped, input tokens over all ranks)."""
        cfg = self.config
        model, optimizer = s.model, s.optimizer
        # The loss is the sum of token losses over every rank's micro-batches divided by the step's
        # global target-token count; data-parallel gradient reduction sums, so every layout gives
        # the gradient of one device.
        local = [count_target_tokens(micro_batches), sum(mb["input_ids"].numel() for mb in micro_batches)]
        n_tokens, n_inputs = sum_over(local, s.meshes["dp"]) if s.dims.dp > 1 else local
        if n_tokens == 0:
            raise TrainingError(f"step {step + 1}: the batch has no target tokens (all labels are ignored)")
        scale = s.scaler.scale if s.scaler else 1.0
        total = torch.zeros((), device=device)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ids = mb["input_ids"].to(device, non_blocking=True)
            labels = mb["labels"].to(device, non_blocking=True)
            with grad_sync(model, i == last), plan.autocast(device.type):
                logits = model(ids, **_model_extras(mb, device))
                loss = token_loss_sum(logits, labels) / n_tokens
                (loss * scale if s.scaler else loss).backward()
            total += loss.detach()
        if s.dims.dp > 1:
            torch.distributed.all_reduce(total, group=s.meshes["dp"].get_group())
        if s.masters is not None:
            s.masters.grads_to_masters()
        if s.scaler is not None:
            s.scaler.unscale(s.params)
        # One pass over the gradients gives the norm; its finiteness is also the fp16 overflow test.
        grad_norm = clip_grad_norm(s.params, cfg.train.max_grad_norm or None)
        loss_value, norm_value = (float(v) for v in torch.stack([total, grad_norm.to(total)]).tolist())
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if not finite and s.scaler is not None and math.isfinite(loss_value):
            optimizer.zero_grad(set_to_none=True)
            s.scaler.update(found_inf=True)
            if s.scaler.scale <= s.scaler.min_scale:
                raise TrainingError(
                    f"step {step + 1}: fp16 gradients still overflow at the smallest loss scale "
                    f"{s.scaler.min_scale:g}: the run has diverged. Lower train.lr, raise warmup or use bf16"
                )
            log.warning("step %d: fp16 gradients overflowed; step skipped, loss scale lowered to %g",
                        step + 1, s.scaler.scale)
            return loss_value, norm_value, True, int(n_inputs)
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            if cfg.train.nan_policy == "stop":
                raise TrainingError(
                    f"step {step + 1}: loss is {loss_value} and gradient norm {norm_value}; training "
                    "stopped before the weights were touched. Lower train.lr, raise warmup, use bf16 "
                    "instead of fp16, or set train.nan_policy: skip to skip such steps"
                )
            log.warning("step %d: loss %s / gradient norm %s is not finite; step skipped (nan_policy: skip)",
                        step + 1, loss_value, norm_value)
            return loss_value, norm_value, True, int(n_inputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if s.masters is not None:
            s.masters.masters_to_model()
        if s.scaler is not None:
            s.scaler.update(found_inf=False)
        return loss_value, norm_value, False, int(n_inputs)

    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None, plan: Any = None,
                 device: torch.device | None = None) -> dict[str, float]:
        """Token-weighted loss and perplexity over the held-out data."""
        cfg = self.config
        model = model or self.model
        device = device or next(model.parameters()).device
        plan = plan or precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = 0
        for mb in sequential_batches(self.eval_dataset, cfg.train.micro_batch_size, cfg.train.eval_batches):
            ids, labels = mb["input_ids"].to(device), mb["labels"].to(device)
            with plan.autocast(device.type):
                logits = model(ids, **_model_extras(mb, device))
            loss_sum += token_loss_sum(logits, labels).double()
            tokens += int((mb["labels"] != IGNORE_INDEX).sum())
        model.train(was_training)
        loss = float(loss_sum) / max(tokens, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}

    def _resume(self, resume: str | None, run_dir: Path, s: "_TrainState", overwrite: bool) -> int:
        if resume is None:
            return 0
        path = ckpt.resolve_resume(resume, run_dir)
        if path is None:
            log.info("--resume auto: no checkpoint in %s yet, starting from step 0", run_dir)
            return 0
        ckpt.ensure_optimizer_state(s.optimizer)
        tensors = s.checkpoint_tensors()
        saved_masters = "master" in ckpt.read_trainer_state(path).get("shapes", {})
        if not saved_masters:
            tensors.pop("master", None)
        state = ckpt.load_checkpoint(path, tensors)
        if s.dims.distributed:
            # DCP filled the shards in place; setting them again keeps FSDP2's views consistent.
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(s.model, tensors["model"])
        # A change of precision level on resume: the fp32 masters of an O2 run are its exact weights.
        if s.masters is not None and not saved_masters:
            s.masters.model_to_masters()
        elif s.masters is None and saved_masters:
            ckpt.load_checkpoint(path, {"master": dict(s.opt_named)})
        s.loader.load_state_dict(state["loader"])
        if s.scaler is not None and state.get("scaler"):
            s.scaler.load_state_dict(state["scaler"])
        step = int(state["step"])
        rank0_first(lambda: _clear_newer_checkpoints(run_dir, step, overwrite), s.ctx.rank)
        log.info("resumed from %s at step %d", path, step)
        return step

    def _save(self, run_dir: Path, step: int, s: "_TrainState") -> Path:
        extra = {"config.yaml": run_dir / "config.yaml"}
        if (run_dir / "tokenizer").is_dir():
            extra["tokenizer"] = run_dir / "tokenizer"
        trainer_state = {"loader": s.loader.state_dict(),
                         "scaler": s.scaler.state_dict() if s.scaler else None}
        return ckpt.save_checkpoint(run_dir, step, s.checkpoint_tensors(), trainer_state, extra,
                                    keep=self.config.train.keep_checkpoints)


@dataclass
class _TrainState:
    """Everything a checkpoint must capture, in one place."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    opt_named: list[tuple[str, torch.Tensor]]
    masters: MasterWeights | None
    scaler: LossScaler | None
    loader: StatefulLoader
    ctx: DistContext
    dims: ParallelDims
    meshes: Any  # Meshes, or None in a single process
    params: list[torch.Tensor] = field(init=False)  # what the optimizer steps (fp32 masters at O2)

    def __post_init__(self) -> None:
        self.params = [p for _, p in self.opt_named]

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Flat name -> tensor groups for DCP (optimizer state keyed by parameter name); sharded
        parameters and optimizer state stay DTensors, so every rank saves and loads its own shards."""
        model_state = {}
        for part in ckpt.model_state(self.model):
            model_state.update(part)
        groups = {"model": model_state, "optim": optimizer_state_by_name(self.optimizer, self.opt_named)}
        if self.masters is not None:
            groups["master"] = dict(self.masters.named_masters())
        return groups


def optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                            named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as `param_name.key` -> tensor (no pickled objects)."""
    out = {}
    for name, p in named:
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"{name}.{key}"] = value
    return out


class _Window:
    """Accumulates the steps between two log lines."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.losses: list[float] = []
        self.tokens = 0
        self.skipped = 0

    def add(self, loss: float, tokens: int, skipped: bool) -> None:
        """Count one step."""
        if not skipped:
            self.losses.append(loss)
        self.skipped += int(skipped)
        self.tokens += tokens

    def record(self, step: int, lr: float, grad_norm: float, scaler: LossScaler | None, flops_tok: float,
               peak: float, device: torch.device, world_size: int = 1) -> dict[str, Any]:
        """The metrics of this window as one JSON-ready record (tokens over all ranks; peak memory
        the largest of any rank; MFU per device)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tps = self.tokens / elapsed
        per_device = tps / world_size
        loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        memory = max_over(peak_memory_gb(device)) if world_size > 1 else peak_memory_gb(device)
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "loss_scale": scaler.scale if scaler else 1.0, "tokens_per_s": tps,
                "tokens_per_s_per_device": per_device,
                "mfu": per_device * flops_tok / peak if peak else float("nan"),
                "peak_memory_gb": memory, "skipped_steps": self.skipped}


def _format_record(r: dict[str, Any]) -> str:
    return (f"step {r['step']} loss {r['loss']:.4f} lr {r['lr']:.3g} grad_norm {r['grad_norm']:.3f} "
            f"loss_scale {r['loss_scale']:g} tokens/s {r['tokens_per_s']:.0f} mfu {r['mfu'] * 100:.1f}% "
            f"peak_mem {r['peak_memory_gb']:.2f}GiB")


def _clear_newer_checkpoints(run_dir: Path, step: int, overwrite: bool) -> None:
    """Resuming from an older checkpoint forks the run: its newer checkpoints go only when asked."""
    newer = [p for p in ckpt.list_checkpoints(run_dir) if ckpt.step_of(p) > step]
    if not newer:
        return
    if not overwrite:
        raise ConfigError(
            f"{run_dir} holds checkpoints newer than step {step} ({', '.join(p.name for p in newer)}); "
            f"continuing from step {step} would replace them. Pass --overwrite (Python: "
            "train(resume=..., overwrite=True)) to replace them, or set another train.output_dir"
        )
    for p in newer:
        shutil.rmtree(p)
    log.warning("--overwrite: removed checkpoints newer than step %d: %s", step, ", ".join(p.name for p in newer))


def layout_for(cfg: RunConfig, world_size: int) -> ParallelDims:
    """The run's parallel layout for `world_size` processes; what the trainer cannot run yet fails here."""
    p = cfg.parallel
    if world_size == 1 and p.world_size() != 1:
        need = p.world_size()
        raise ConfigError(
            f"this config needs {need} processes (data_parallel {p.dp_degree()} x tensor_parallel "
            f"{p.tensor_parallel} x pipeline_parallel {p.pipeline_parallel}) but runs as one; start it with "
            f"`shardwise train CONFIG --nproc {need}` (or torchrun --nproc-per-node {need} -m shardwise.cli "
            f"train CONFIG), or set those degrees to 1"
        )
    dims = dims_from_config(p, world_size)
    if dims.pp > 1:
        raise ConfigError(
            "parallel.pipeline_parallel > 1: pipeline schedules are not wired into the trainer yet; use "
            "data_parallel (ZeRO 0-3) and tensor_parallel for now"
        )
    return dims


def check_replicas(s: "_TrainState", step: int, zero_stage: int) -> None:
    """Stop when ranks that should hold identical parameters do not (seed 003, 5.3: losses drifting
    apart between cards): the replicated copies of ZeRO 0/1, or the HSDP replicas of ZeRO 2/3."""
    if s.dims.dp == 1:
        return
    mesh = s.meshes["dp"] if zero_stage <= 1 else s.meshes["dp_replicate"]
    problem = replica_mismatch(s.model, mesh)
    if problem:
        raise TrainingError(
            f"step {step}: {problem}. Replicas that diverge train different models; look for "
            "non-deterministic kernels, a rank with different data or config, or faulty hardware"
        )


def check_offload(cfg: RunConfig, device: torch.device, dims: ParallelDims) -> None:
    """CPU offload is FSDP2's (the multi-device engine); on one CPU everything already lives in CPU memory."""
    asked = [name for name in ("offload_optimizer", "offload_params") if getattr(cfg.optimize, name)]
    if not asked or dims.dp > 1:
        return
    if device.type == "cpu":
        log.info("optimize.%s: the run is on the CPU, so everything already lives in CPU memory",
                 " and optimize.".join(asked))
        return
    raise ConfigError(
        f"optimize.{asked[0]} needs the sharded (FSDP2) engine, which runs under data parallelism: "
        "use several processes (--nproc N) with parallel.zero_stage 2 or 3; on one device lower memory "
        "with optimize.recompute, optimize.mixed_precision or a smaller train.micro_batch_size with more "
        "gradient accumulation"
    )


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse to write into a directory that holds another run, unless resuming or overwriting."""
    existing = [name for name in _RUN_FILES if (run_dir / name).exists()]
    if existing and resume is None:
        if not overwrite:
            raise ConfigError(
                f"{run_dir} already holds a run ({', '.join(existing)}); continue it with --resume auto "
                "(Python: trainer.train(resume='auto')), replace it with --overwrite (Python: "
                "TrainingArguments(overwrite_output_dir=True)), or choose another train.output_dir"
            )
        for name in existing:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("--overwrite: removed the previous run's %s from %s", ", ".join(existing), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
