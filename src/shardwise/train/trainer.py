"""The training loop: from a validated config to optimizer steps, metrics and checkpoints, on one
device or many (the parallel layout is applied from outside, by `parallelize_parts`).

Read `Trainer.train()` top to bottom: it prepares the run directory, data, model, precision,
optimizer and loader, resumes if asked, then runs steps (micro-batches -> forward/backward ->
unscale -> clip -> step), logging, evaluating and checkpointing on the way.

The model is handled as a list of parts: one part (the whole model) without pipeline parallelism,
else this rank's pipeline chunks. Parameters keep the whole model's names in every layout, so the
optimizer, the checkpoints and resharding between layouts do not depend on the split.

Pipeline parallelism (`parallel.pipeline_parallel > 1`): the micro-batches of an optimizer step are
the pipeline's. One schedule step (`pipeline_step`) runs `parallel.micro_batch_num` of them; the
gradient accumulation (micro-batches per optimizer step) defaults to micro_batch_num and may be a
multiple of it (several schedule steps per optimizer step; the config refuses anything else). Every
rank of a data-parallel replica (all its pipeline and tensor-parallel ranks) reads the same
micro-batches; the loss is normalised by the step's global target-token count as in every layout,
and every pipeline rank gets the step loss. Gradients are clipped with the norm over all stages (a
tied embedding matrix, held by the first and the last stage, counted once); evaluation runs
`pipeline_eval` on every rank.
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
from ..data.build import build_data
from ..data.loader import StatefulLoader, sequential_batches, unwrap_loader
from ..errors import CheckpointError, ConfigError, TrainingError
from ..memory.estimate import estimate_memory, run_flops
from ..memory.precision import LossScaler, MasterWeights, precision_plan
from ..models import Transformer, build_model, count_parameters, materialize
from ..parallel.collectives import all_reduce, rank0_first, replica_mismatch, sum_over
from ..parallel.data_parallel import clip_grad_norm, grad_sync
from ..parallel.dims import ParallelDims, dims_from_config
from ..parallel.launch import DistContext, init_distributed
from ..parallel.parallelize import parallelize_parts
from ..parallel.tensor import RankRNG, rank_rng, token_loss_sum_tp
from . import checkpoint as ckpt
from . import rng
from .metrics import (MetricsWriter, MfuMeter, StepTokens, Window, count_real_tokens, device_peak, format_record,
                      reset_peak_memory)
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
    """Pre-trains or fine-tunes a model as a RunConfig describes, on one device or as one rank of many."""

    def __init__(self, config: RunConfig, model: nn.Module | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, tokenizer: Any = None) -> None:
        self.config = config
        self.model = model
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer
        self.model_parts: list[nn.Module] | None = None  # this rank's parallelised model part(s)
        self.pipeline: Any = None  # pipeline.Pipeline under pipeline parallelism
        self._pretrained_pending = False  # model.init_from weights still to load onto the shards
        self._phase = "forward"  # where a step is, for the out-of-memory message

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
        if cfg.model.init_from is not None and self.model is None:
            from ..models.pretrained import check_pretrained

            check_pretrained(cfg.model, lora=cfg.lora is not None)  # before any data is prepared
        if not ctx.is_main:
            logging.getLogger("shardwise").setLevel(logging.WARNING)  # one rank logs the run
        if ctx.restart_count:
            # Restarted by the launcher after a failure: continue from the newest checkpoint (also when the
            # first attempt resumed from an older one).
            resume = "auto"
            if ctx.is_main:
                log.warning("restart %d of the process group: resuming from the newest checkpoint",
                            ctx.restart_count)
        rank0_first(lambda: check_run_dir(run_dir, resume, overwrite), ctx.rank)  # before any work
        check_host_memory(cfg, ctx)
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        meshes = dims.build_meshes(device.type) if dims.distributed else None

        # Rank 0 prepares the data (and the shared cache) first; the others then find it ready.
        rank0_first(self._prepare_data, ctx.rank)
        if not ctx.is_main:
            self._prepare_data()
        # Only now, with the data read, may --overwrite remove the old run.
        rank0_first(lambda: prepare_run_dir(run_dir, resume, overwrite), ctx.rank)
        if ctx.is_main:
            self._save_tokenizer(run_dir)
        plan = precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
        # Under data parallelism, O2's fp32 master weights are FSDP2's sharded fp32 parameters, cast
        # to 16 bits for compute by its mixed-precision policy.
        fsdp_masters = dims.dp > 1 and plan.master_weights
        parts = self._prepare_model(device, torch.float32 if fsdp_masters else plan.param_dtype, dims, meshes,
                                    plan.param_dtype if fsdp_masters else None)
        names = ckpt.canonical_param_names(parts)  # as checkpoints name them: no wrapper prefixes
        trainable = [(names[id(p)], p) for p in _parameters(parts) if p.requires_grad]
        masters = MasterWeights(trainable) if plan.master_weights and not fsdp_masters else None
        opt_named = list(masters.named_masters()) if masters else trainable
        optimizer = build_optimizer(opt_named, cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay,
                                    (cfg.train.beta1, cfg.train.beta2), cfg.train.eps)
        if dims.dp > 1:
            from ..parallel.data_parallel import shard_optimizer

            optimizer = shard_optimizer(optimizer, parts[0])
        self.pipeline = self._build_pipeline(parts, meshes, device, masters) if dims.pp > 1 else None
        scaler = None
        if plan.needs_loss_scaling:
            dynamic = cfg.optimize.loss_scale == "dynamic"
            scaler = LossScaler(cfg.optimize.initial_loss_scale if dynamic else float(cfg.optimize.loss_scale),
                                dynamic=dynamic)
        grad_accum = cfg.gradient_accumulation(ctx.world_size)
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

        state = _TrainState(parts=parts, optimizer=optimizer, opt_named=opt_named, masters=masters,
                            scaler=scaler, loader=loader, ctx=ctx, dims=dims, meshes=meshes, pipeline=self.pipeline)
        start = self._resume(resume, run_dir, state, overwrite)
        if start == 0 and self._pretrained_pending:
            self._load_pretrained(state)
        if ctx.is_main:
            (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")  # the config in force

        step_tokens = tokens_per_step(cfg, ctx.world_size)
        # MFU counts what a step computes (frozen weights cost less); only rank 0 logs it, so only it
        # measures a CPU's peak (the other ranks would slow that measurement down).
        mfu = MfuMeter(run_flops(cfg).total, device_peak(device, plan.dtype, cfg.train.peak_tflops,
                                                         measure=ctx.is_main))
        writer = MetricsWriter(run_dir, tensorboard=cfg.train.tensorboard, enabled=ctx.is_main, resume_step=start)
        log.info("training %s on %s: %d steps of %d tokens, precision %s %s, recompute %s%s",
                 cfg.model.preset or cfg.model.model_type, device, total_steps, step_tokens,
                 cfg.optimize.mixed_precision, plan.level, cfg.optimize.recompute,
                 f", {ctx.world_size} processes (dp {dims.dp} x tp {dims.tp} x pp {dims.pp}, ZeRO "
                 f"{cfg.parallel.zero_stage}{_pipeline_note(cfg) if dims.pp > 1 else ''})"
                 if dims.distributed else "")

        result = TrainResult(run_dir=run_dir, step=start)
        bar = tqdm(total=total_steps, initial=start, disable=not (cfg.train.progress_bar and ctx.is_main), unit="step",
                   dynamic_ncols=True, desc="train")
        window = Window(time.perf_counter())
        reset_peak_memory(device)
        try:
            for step in range(start, total_steps):
                lr = schedule.apply(optimizer, step)
                micro_batches = loader.next_step()
                loss, grad_norm, skipped, tokens = self._step(state, plan, micro_batches, device, step)
                done = step + 1
                result.step = done
                result.losses[done] = loss
                window.add(loss, tokens.real, tokens.target, skipped)
                bar.update(1)
                if cfg.train.check_replicas_steps and done % cfg.train.check_replicas_steps == 0:
                    check_replicas(state, done, cfg.parallel.zero_stage)
                if done % cfg.train.log_steps == 0 or done == total_steps:
                    record = window.record(done, lr, grad_norm, scaler.scale if scaler else 1.0, mfu, device,
                                           ctx.world_size)
                    writer.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    log.info(format_record(record))
                    window = Window(time.perf_counter())
                # Save first: a failure during evaluation must not cost the step's checkpoint.
                if (cfg.train.save_steps and done % cfg.train.save_steps == 0) or done == total_steps:
                    result.last_checkpoint = self._save(run_dir, done, state)
                    window.start = time.perf_counter()
                if self.eval_dataset is not None and (
                        done == total_steps or (cfg.train.eval_steps and done % cfg.train.eval_steps == 0)):
                    result.eval = self.evaluate(plan=plan, device=device)
                    writer.write({"step": done, **{f"eval_{k}": v for k, v in result.eval.items()}})
                    log.info("step %d eval loss %.4f perplexity %.2f", done, result.eval["loss"],
                             result.eval["perplexity"])
                    window.start = time.perf_counter()
        except Exception as exc:
            from .oom import explain_out_of_memory, is_out_of_memory

            if not is_out_of_memory(exc):
                raise
            pp_rank = meshes["pp"].get_local_rank() if dims.pp > 1 else 0
            raise TrainingError(explain_out_of_memory(cfg, ctx.world_size, ctx.rank, self._phase, device,
                                                      pp_rank)) from exc
        finally:
            loader.close()
            bar.close()
            writer.close()
        return result

    # --- pieces of the run ------------------------------------------------------------------------

    def _prepare_data(self) -> None:
        cfg = self.config
        if self.train_dataset is None:
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

    def _save_tokenizer(self, run_dir: Path) -> None:
        """The run's tokenizer beside its checkpoints (kept when resuming)."""
        tok_dir = run_dir / "tokenizer"
        if self.tokenizer is not None and not tok_dir.exists():
            self.tokenizer.save(str(tok_dir))

    def _prepare_model(self, device: torch.device, dtype: torch.dtype, dims: ParallelDims, meshes: Any,
                       fsdp_param_dtype: torch.dtype | None) -> list[nn.Module]:
        """This rank's model parts: the whole model (built with the run's seed, so the same on every
        rank), split into pipeline chunks when there is a pipeline, each parallelised."""
        cfg = self.config
        self._pretrained_pending = self.model is None and cfg.model.init_from is not None
        if self._pretrained_pending:
            # The weights are read later onto this rank's shards (`_load_pretrained`): build the
            # structure without memory, so no rank ever holds the whole model.
            with torch.device("meta"):
                model = Transformer(cfg.model)
            model.to(dtype=dtype)
        elif self.model is None:
            model = build_model(cfg.model, device=device, dtype=dtype)
        elif any(p.is_meta for p in self.model.parameters()):
            model = materialize(self.model, device, dtype)
        else:
            model = self.model.to(device=device, dtype=dtype)
            model.reset_rope_tables()  # keep RoPE tables in fp32 when the weights became 16-bit
        self._adapt_for_finetuning(model)
        parts = parallelize_parts(model, cfg, dims, meshes, fsdp_param_dtype)
        if self._pretrained_pending:
            for part in parts:
                allocate(part, device)
        # Without a pipeline `model` is the one part; with one, this rank's first chunk (see model_parts).
        self.model, self.model_parts = parts[0], parts
        return parts

    def _adapt_for_finetuning(self, model: nn.Module) -> None:
        """LoRA adapters or frozen layers, on the whole model before it is split or sharded."""
        cfg = self.config
        total = sum(p.numel() for p in model.parameters())
        if cfg.lora is not None:
            from ..peft.lora import apply_lora

            lora = cfg.lora
            wrapped = apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules, seed=cfg.train.seed)
            what = f"LoRA r={lora.r} alpha={lora.alpha:g} on {len(wrapped)} projections"
        elif cfg.freeze.active():
            from ..peft.freeze import freeze_parameters

            frozen = freeze_parameters(model, cfg.freeze.embeddings, cfg.freeze.layers)
            what = f"{len(frozen)} parameter tensors frozen"
        else:
            return
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("%s: %s of %s parameters train (%.2f%%)", what, f"{trainable:,}", f"{total:,}",
                 100 * trainable / max(total, 1))

    @torch.no_grad()
    def _load_pretrained(self, s: "_TrainState") -> None:
        """Fill this rank's shards with the weights of `model.init_from` (a Hugging Face directory or a
        shardwise checkpoint), each rank reading only what it holds; LoRA adapters get their initial
        values (the same in every layout). Into the fp32 masters where there are some (precision O2)."""
        from ..models.pretrained import pretrained_source
        from ..peft.lora import is_lora_name, lora_init

        cfg = self.config
        kind, path = pretrained_source(cfg.model.init_from)
        named = s.by_checkpoint_name(list(s.masters.named_masters()) if s.masters is not None else s.opt_named)
        names = ckpt.canonical_param_names(s.parts)
        for p in _parameters(s.parts):  # frozen weights are not in the optimizer's list
            if s.masters is None or not p.requires_grad:
                named.setdefault(s.checkpoint_name(names[id(p)]), p)
        base = {n: t for n, t in named.items() if not is_lora_name(n)}
        log.info("loading %s weights from %s", "Hugging Face" if kind == "hf" else "checkpoint", path)
        if kind == "hf":
            from ..models.hf import load_hf_into

            load_hf_into(base.items(), path, cfg.model)
        else:
            saved = ckpt.read_trainer_state(path).get("shapes", {}).get("model", {})
            wanted = {**base, **{n: t for n, t in named.items() if n in saved}}
            groups = {"model": wanted}
            masters = ckpt.read_trainer_state(path).get("shapes", {}).get("master", {})
            if masters:  # a precision-O2 run: its fp32 master copies are the exact weights
                groups["master"] = {n: t for n, t in wanted.items() if n in masters}
            ckpt.load_weights(path, groups)
        from ..models.hf import copy_full_into

        for name, t in named.items():
            if is_lora_name(name) and (kind == "hf" or name not in saved):
                copy_full_into(t, lora_init(name, tuple(t.shape), cfg.train.seed))
        s.fill_tied_copies()
        if s.masters is not None:
            s.masters.masters_to_model()

    def _build_pipeline(self, parts: list[nn.Module], meshes: Any, device: torch.device,
                        masters: MasterWeights | None) -> Any:
        """The schedule over this rank's chunks; its loss is the trainer's (tensor-parallel aware), and
        at precision O2 gradients accumulate in the fp32 masters."""
        from ..parallel.pipeline import build_schedule

        p = self.config.parallel
        if masters is None:
            return build_schedule(parts, meshes["pp"], device, p.micro_batch_num, p.schedule, loss_fn=token_loss_sum)
        return build_schedule(parts, meshes["pp"], device, p.micro_batch_num, p.schedule, loss_fn=token_loss_sum,
                              grad_holder=masters.master_of, on_weight_grads=masters.grads_to_masters)

    def _total_steps(self, loader: StatefulLoader) -> int:
        train = self.config.train
        if train.max_steps is not None:
            return train.max_steps
        return loader.steps_for_epochs(train.epochs)

    def _step(self, s: "_TrainState", plan: Any, micro_batches: list[dict[str, torch.Tensor]],
              device: torch.device, step: int) -> tuple[float, float, bool, StepTokens]:
        """One optimizer step; returns (loss, grad norm, skipped, its real and target tokens over all ranks)."""
        cfg = self.config
        optimizer = s.optimizer
        # The loss is the sum of token losses over every rank's micro-batches divided by the step's
        # global target-token count; data-parallel gradient reduction sums, so every layout gives
        # the gradient of one device.
        local = [count_target_tokens(micro_batches), count_real_tokens(micro_batches)]
        n_tokens, n_inputs = sum_over(local, s.meshes["dp"]) if s.dims.dp > 1 else local
        tokens = StepTokens(real=int(n_inputs), target=int(n_tokens))
        if n_tokens == 0:
            raise TrainingError(f"step {step + 1}: the batch has no target tokens (all labels are ignored)")
        if s.pipeline is not None:
            total = self._pipeline_forward_backward(s, plan, micro_batches, device, n_tokens)
        else:
            total = self._forward_backward(s, plan, micro_batches, device, n_tokens)
        if s.dims.dp > 1:
            total = all_reduce(total, s.meshes["dp"])
        self._phase = "optimizer step"  # from here: master copies, unscale, clipping, the update
        if s.masters is not None:
            s.masters.grads_to_masters()
        if s.scaler is not None:
            s.scaler.unscale(s.params)
        # One pass over the gradients gives the norm (over all pipeline stages, a tied matrix counted
        # once); its finiteness is also the fp16 overflow test.
        grad_norm = clip_grad_norm(s.params, cfg.train.max_grad_norm or None, reduce_group=s.pp_group,
                                   exclude=s.norm_exclude)
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
            return loss_value, norm_value, True, tokens
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
            return loss_value, norm_value, True, tokens
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if s.masters is not None:
            s.masters.masters_to_model()
        if s.scaler is not None:
            s.scaler.update(found_inf=False)
        return loss_value, norm_value, False, tokens

    def _forward_backward(self, s: "_TrainState", plan: Any, micro_batches: list[dict[str, torch.Tensor]],
                          device: torch.device, n_tokens: float) -> torch.Tensor:
        """Forward and backward of each micro-batch (gradient sync on the last only); returns this
        rank's part of the step loss."""
        model = s.parts[0]
        scale = s.scaler.scale if s.scaler else 1.0
        total = torch.zeros((), device=device)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ids = mb["input_ids"].to(device, non_blocking=True)
            labels = mb["labels"].to(device, non_blocking=True)
            with grad_sync(model, i == last), plan.autocast(device.type):
                self._phase = "forward"
                logits = model(ids, **_model_extras(mb, device))
                loss = token_loss_sum(logits, labels) / n_tokens
                self._phase = "backward"
                (loss * scale if s.scaler else loss).backward()
            total += loss.detach()
        return total

    def _pipeline_forward_backward(self, s: "_TrainState", plan: Any, micro_batches: list[dict[str, torch.Tensor]],
                                   device: torch.device, n_tokens: float) -> torch.Tensor:
        """The step's micro-batches through the pipeline, micro_batch_num at a time (one schedule
        step each: the schedule splits the concatenated batch back into these micro-batches and
        reduces data-parallel gradients at its end); returns this replica's step loss, on every
        pipeline rank."""
        from ..parallel.pipeline import pipeline_step

        scale = s.scaler.scale if s.scaler else 1.0
        per_step = s.pipeline.micro_batch_num
        rounds = len(micro_batches) // per_step  # pipeline steps in this optimizer step (config: a whole number)
        total = torch.zeros((), device=device)
        self._phase = "pipeline step"
        for r in range(rounds):
            batch = _concat_micro_batches(micro_batches[r * per_step:(r + 1) * per_step])
            with plan.autocast(device.type):
                # The schedule's loss is sum(token losses) / global_tokens: dividing by n_tokens / scale
                # also applies the fp16 loss scale to the backward.
                total += pipeline_step(s.pipeline, batch["input_ids"], batch["labels"], global_tokens=n_tokens / scale,
                                       finish_step=r == rounds - 1, **_model_extras(batch, device))
        return total / scale if s.scaler else total

    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None, plan: Any = None,
                 device: torch.device | None = None) -> dict[str, float]:
        """Token-weighted loss and perplexity over the held-out data.

        Under pipeline parallelism (no `model` given) every rank runs the batches through the
        pipeline (`pipeline_eval`) and gets the same result.
        """
        cfg = self.config
        pipe = self.pipeline if model is None else None
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
                if pipe is not None:
                    from ..parallel.pipeline import pipeline_eval

                    loss_sum += pipeline_eval(pipe, ids, labels, **_model_extras(mb, device)).double()
                else:
                    loss_sum += token_loss_sum(model(ids, **_model_extras(mb, device)), labels).double()
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
        per_part = ckpt.model_state(s.parts)
        tensors = s.checkpoint_tensors(per_part)
        saved_masters = "master" in ckpt.read_trainer_state(path).get("shapes", {})
        if not saved_masters:
            tensors.pop("master", None)
        state = ckpt.load_checkpoint(path, tensors)
        if s.dims.distributed:
            # DCP filled the shards in place; setting them again keeps FSDP2's views consistent.
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            for part, part_state in zip(s.parts, per_part):
                set_model_state_dict(part, part_state)
        s.fill_tied_copies()
        # A change of precision level on resume: the fp32 masters of an O2 run are its exact weights.
        if s.masters is not None and not saved_masters:
            s.masters.model_to_masters()
        elif s.masters is None and saved_masters:
            ckpt.load_checkpoint(path, {"master": s.by_checkpoint_name(s.opt_named)})
        _restore_section(path, "data position", s.loader.load_state_dict, state.get("loader"))
        if s.scaler is not None and state.get("scaler"):
            _restore_section(path, "loss scaler", s.scaler.load_state_dict, state["scaler"])
        step = int(state["step"])
        self._restore_random_state(path, state, s, step)
        rank0_first(lambda: _clear_newer_checkpoints(run_dir, step, overwrite), s.ctx.rank)
        log.info("resumed from %s at step %d", path, step)
        return step

    def _restore_random_state(self, path: Path, state: dict, s: "_TrainState", step: int) -> None:
        """Each rank continues its own random streams where the layout is the one saved; elsewhere
        (another rank count or arrangement) every rank re-seeds from (train.seed, step) alike."""
        device, streams = s.ctx.device, s.rank_streams()
        own = ckpt.read_rank_state(path, s.ctx.rank)
        same = state.get("layout", s.layout()) == s.layout() and ckpt.saved_ranks(path) == s.ctx.world_size
        if s.dims.distributed:  # every rank must take the same branch, or TP peers' streams diverge
            same = sum_over([int(not same or own is None)])[0] == 0
        if same and own is not None:
            missing = rng.restore(own, device, streams)
            if missing and s.ctx.is_main:
                log.warning("%s: no saved state for %s (saved on another kind of device?); it continues from "
                            "its current state", path, ", ".join(missing))
            return
        rng.reseed(self.config.train.seed, step, device, streams)
        if s.ctx.is_main:
            saved = state.get("layout", {"world_size": ckpt.saved_ranks(path)})
            log.warning("%s was saved by %s and this run is %s: the saved random states belong to other ranks, "
                        "so every rank's random generators are re-seeded from train.seed and step %d. Weights, "
                        "optimizer state and data order resume exactly; dropout masks differ from an "
                        "uninterrupted run", path, _describe_layout(saved), _describe_layout(s.layout()), step)

    def _save(self, run_dir: Path, step: int, s: "_TrainState") -> Path:
        self._phase = "checkpoint save"
        extra = {"config.yaml": run_dir / "config.yaml"}
        if (run_dir / "tokenizer").is_dir():
            extra["tokenizer"] = run_dir / "tokenizer"
        trainer_state = {"loader": s.loader.state_dict(),
                         "scaler": s.scaler.state_dict() if s.scaler else None, "layout": s.layout()}
        path = ckpt.save_checkpoint(run_dir, step, s.checkpoint_tensors(), trainer_state, extra,
                                    keep=self.config.train.keep_checkpoints,
                                    rank_state=rng.capture(s.ctx.device, {n: r.state() for n, r in s.rank_streams().items()}))
        if self.config.lora is not None and s.ctx.is_main:
            self._save_adapter(path)
        return path

    def _save_adapter(self, path: Path) -> None:
        """The checkpoint's LoRA adapters on their own, in the format `peft` loads (path/adapter)."""
        from ..peft.lora import is_lora_name, save_adapter

        cfg = self.config
        names = [n for n in ckpt.read_trainer_state(path).get("shapes", {}).get("model", {}) if is_lora_name(n)]
        state = ckpt.read_saved_tensors(path, "model", names)  # read back: any layout, on one rank
        save_adapter(state, cfg.model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules,
                     path / "adapter", base_model_name_or_path=cfg.model.init_from)


# A tied embedding matrix is one parameter in one process, named by its first use (the embedding);
# a pipeline's last stage holds a copy of it under the output projection's name.
_TIED_NAME, _TIED_COPY = "tok_embeddings.weight", "output.weight"


@dataclass
class _TrainState:
    """Everything a checkpoint must capture, in one place."""

    parts: list[nn.Module]  # this rank's model parts: the whole model, or its pipeline chunks
    optimizer: torch.optim.Optimizer
    opt_named: list[tuple[str, torch.Tensor]]
    masters: MasterWeights | None
    scaler: LossScaler | None
    loader: StatefulLoader
    ctx: DistContext
    dims: ParallelDims
    meshes: Any  # Meshes, or None in a single process
    pipeline: Any = None  # pipeline.Pipeline, under pipeline parallelism
    params: list[torch.Tensor] = field(init=False)  # what the optimizer steps (fp32 masters at O2)
    norm_exclude: list[torch.Tensor] = field(init=False)  # stepped but not counted in the gradient norm
    pp_group: Any = field(init=False)  # the pipeline's process group (the norm sums over its stages)
    tied_copy: bool = field(init=False)  # this rank holds a pipeline's last-stage copy of a tied matrix

    def __post_init__(self) -> None:
        self.params = [p for _, p in self.opt_named]
        self.pp_group = self.meshes["pp"].get_group() if self.pipeline is not None else None
        excluded: set[str] = set()
        if self.pipeline is not None:
            names = ckpt.canonical_param_names(self.parts)
            excluded = {names[id(p)] for p in self.pipeline.norm_exclusions()}
        self.norm_exclude = [p for n, p in self.opt_named if n in excluded]
        self.tied_copy = _TIED_COPY in excluded

    def layout(self) -> dict[str, int]:
        """The parallel layout, as a checkpoint records it (random states are per rank of a layout)."""
        return {"world_size": self.ctx.world_size, "dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp}

    def rank_streams(self) -> dict[str, RankRNG]:
        """This rank's tensor-parallel random streams, by model part."""
        return {f"tensor_parallel.{i}": r for i, r in enumerate(map(rank_rng, self.parts)) if r is not None}

    def checkpoint_name(self, name: str) -> str:
        """The name one process gives this rank's parameter `name` (see `checkpoint_named`)."""
        return _TIED_NAME if self.tied_copy and name == _TIED_COPY else name

    def checkpoint_named(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`named` under the names one process uses: a pipeline's last-stage copy of a tied matrix
        is stored as the tied matrix (both copies are equal). Where a rank holds both copies (V
        schedules) a name then comes twice: the first copy stands for both (`fill_tied_copies`)."""
        return [(self.checkpoint_name(n), t) for n, t in named]

    def by_checkpoint_name(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`checkpoint_named(named)` as a dict (the first tensor of a name wins)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.checkpoint_named(named):
            out.setdefault(name, t)
        return out

    def checkpoint_tensors(self, per_part: list[dict[str, torch.Tensor]] | None = None
                           ) -> dict[str, dict[str, torch.Tensor]]:
        """Flat name -> tensor groups for DCP (optimizer state keyed by parameter name); sharded
        parameters and optimizer state stay DTensors, so every rank saves and loads its own shards.
        `per_part`: the parts' state dicts, when the caller needs them too (`ckpt.model_state`)."""
        model_state = {}
        for part in per_part if per_part is not None else ckpt.model_state(self.parts):
            model_state.update(part)
        groups = {"model": model_state,
                  "optim": optimizer_state_by_name(self.optimizer, self.checkpoint_named(self.opt_named))}
        if self.masters is not None:
            groups["master"] = self.by_checkpoint_name(list(self.masters.named_masters()))
        return groups

    @torch.no_grad()
    def fill_tied_copies(self) -> None:
        """After a load: where this rank holds both copies of a tied matrix (a V schedule), the
        checkpoint filled the first one; give the second its values and optimizer state."""
        named = dict(self.opt_named)
        first, last = named.get(_TIED_NAME), named.get(_TIED_COPY)
        if not self.tied_copy or first is None or last is None:
            return
        last.copy_(first)
        src, dst = self.optimizer.state.get(first, {}), self.optimizer.state.get(last, {})
        for key, value in src.items():
            if torch.is_tensor(value) and torch.is_tensor(dst.get(key)):
                dst[key].copy_(value)


def allocate(part: nn.Module, device: torch.device) -> None:
    """Give a meta-device model part (whole or a pipeline chunk, sharded or not) memory on `device`
    for the shards this rank holds; the values are undefined until loaded. A tied output projection is
    tied again (allocation gives each module a fresh parameter) and the RoPE tables are rebuilt."""
    part.to_empty(device=device)
    part.tie_weights()
    part.reset_rope_tables()


def _parameters(parts: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of all model parts, each once."""
    seen: dict[int, nn.Parameter] = {}
    for part in parts:
        for p in part.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _concat_micro_batches(micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The step's micro-batches as one batch (the pipeline schedule splits it into them again)."""
    shapes = sorted({tuple(mb["input_ids"].shape) for mb in micro_batches})
    if len(shapes) > 1:
        raise ConfigError(
            f"pipeline parallelism runs the micro-batches of a step as one batch of one shape, but this step's "
            f"micro-batches have shapes {shapes}; use data of fixed-size samples (data.packing pack or pad)"
        )
    return {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}


def _pipeline_note(cfg: RunConfig) -> str:
    p = cfg.parallel
    stages = f" x {p.virtual_stages} virtual stages" if p.virtual_stages > 1 else ""
    return f", pipeline schedule {p.schedule}{stages}, {p.micro_batch_num} micro-batches per step"


def optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                            named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as `param_name.key` -> tensor (no pickled objects); a
    name given twice keeps its first parameter's state (see `_TrainState.by_checkpoint_name`)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named:
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                out.setdefault(f"{name}.{key}", value)
    return out


def _restore_section(path: Path, what: str, restore: Any, saved: Any) -> None:
    """`restore(saved)`, where `saved` comes from a checkpoint's trainer state: one that is missing or
    does not fit is a damaged or altered checkpoint, said as such, not a traceback."""
    try:
        if saved is None:
            raise KeyError("missing")
        restore(saved)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded: {ckpt.STATE_FILE} holds no usable {what} ({type(e).__name__}: {e}); "
            "shardwise never writes that, so the checkpoint is damaged or was altered: copy it again from the run "
            "that saved it") from None


def _describe_layout(layout: dict[str, int]) -> str:
    ranks = f"{layout.get('world_size', '?')} rank(s)"
    if "dp" not in layout:
        return ranks
    return f"{ranks} (dp {layout['dp']} x tp {layout['tp']} x pp {layout['pp']})"


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
    """The run's parallel layout for `world_size` processes."""
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
        from ..parallel.pipeline import check_pipeline

        # The config checked the layout; the micro-batch count must also suit the schedule to run.
        check_pipeline(cfg.model.num_layers, dims.pp, p.virtual_stages, p.schedule, p.stage_layers, p.micro_batch_num)
        cfg.gradient_accumulation(world_size)  # a whole number of pipeline steps per optimizer step
    return dims


def check_replicas(s: "_TrainState", step: int, zero_stage: int) -> None:
    """Stop when ranks that should hold identical parameters do not (seed 003, 5.3: losses drifting
    apart between cards): the replicated copies of ZeRO 0/1, or the HSDP replicas of ZeRO 2/3."""
    if s.dims.dp == 1:
        return
    mesh = s.meshes["dp"] if zero_stage <= 1 else s.meshes["dp_replicate"]
    problem = next(filter(None, (replica_mismatch(part, mesh) for part in s.parts)), None)
    if problem:
        raise TrainingError(
            f"step {step}: {problem}. Replicas that diverge train different models; look for "
            "non-deterministic kernels, a rank with different data or config, or faulty hardware"
        )


def available_host_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(cfg: RunConfig, ctx: DistContext) -> None:
    """On the CPU, refuse a run whose estimated peak (for all of this machine's ranks) exceeds the memory
    the machine has free: it would only be killed later, often a forgotten `model.preset` (7B)."""
    available = available_host_memory()
    if ctx.device.type != "cpu" or available is None:
        return
    need = estimate_memory(cfg, ctx.world_size, "cpu").peak * ctx.local_world_size
    if need <= available:
        return
    m = cfg.model
    raise ConfigError(
        f"this run needs about {need / 2**30:.1f} GiB of memory (estimate: {ctx.local_world_size} process(es) on this "
        f"machine, a {count_parameters(m):,}-parameter model: {m.preset or 'no model.preset'}, hidden_size "
        f"{m.hidden_size}, {m.num_layers} layers, vocab {m.vocab_size}) but the machine has {available / 2**30:.1f} GiB "
        "free. Choose a smaller model (model.preset), lower train.micro_batch_size or data.seq_length, or turn on "
        "optimize.recompute; `shardwise estimate CONFIG` shows where the memory goes"
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


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> list[str]:
    """Refuse to write into a directory that holds another run, unless resuming or overwriting; return
    what of a previous run `--overwrite` would replace."""
    existing = [name for name in _RUN_FILES if (run_dir / name).exists()]
    if not existing or resume is not None:
        return []
    if not overwrite:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(existing)}); continue it with --resume auto "
            "(Python: trainer.train(resume='auto')), replace it with --overwrite (Python: "
            "TrainingArguments(overwrite_output_dir=True)), or choose another train.output_dir"
        )
    return existing


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Make the run directory, replacing a previous run's files when overwriting (see `check_run_dir`)."""
    existing = check_run_dir(run_dir, resume, overwrite)
    if existing:
        for name in existing:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("--overwrite: removed the previous run's %s from %s", ", ".join(existing), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
