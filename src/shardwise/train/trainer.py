"""The training loop: from a resolved config to optimizer steps, metrics and checkpoints, on one
device or many.

`Trainer.train()` builds the run's state once (`setup`: processes and layout, run directory, data,
model parts, optimizer, schedule, loss scaler, loader, checkpointer), then loops: `train_step` runs
one optimizer step (`forward_backward` over its micro-batches, then unscale, clip and update) and the
loop logs, checkpoints and evaluates. The trainer knows no more of the parallelism than what
`parallel` hands it: model parts (the whole model, or this rank's pipeline chunks), an optimizer to
step and, with pipeline parallelism, a schedule. A step's loss is the sum of token losses over every
rank's micro-batches divided by the step's global target-token count, and data-parallel reduction
sums, so every layout computes one device's gradient. Tools follow a step through
`add_phase_hook(fn)`: `fn(phase)` is called as the trainer enters each of PHASES.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm

from ..builder import adapt_for_finetuning, build_run_model, describe_finetuning, prepare_given_model, trainable_summary
from ..checkpoint.checkpointer import TIED_COPY, Checkpointer, canonical_param_names, parameters
from ..checkpoint.weights import check_pretrained
from ..config import RunConfig, to_yaml, tokens_per_step
from ..data.build import run_data
from ..data.loader import StatefulLoader, sequential_batches
from ..errors import TrainingError
from ..hardware import device_peak
from ..loss import IGNORE_INDEX, count_target_tokens, token_loss_sum
from ..memory.auto_recompute import describe_plan, resolve_auto_recompute
from ..memory.estimate import run_flops
from ..memory.offload import ActivationOffload, HostMasters, master_dtype_for
from ..memory.precision import LossScaler, MasterWeights, PrecisionPlan, loss_scaler_for, precision_plan
from ..parallel.collectives import all_reduce, max_over, rank0_first, replicas_problem, sum_over
from ..parallel.data_parallel import check_offload, clip_grad_norm, grad_sync
from ..parallel.dims import describe_layout, layout_for
from ..parallel.launch import init_distributed
from ..parallel.parallelize import (
    allocate,
    build_pipeline,
    distribute_optimizer,
    fsdp_holds_masters,
    parallelize_parts,
    weight_dtypes,
)
from ..parallel.pipeline import concat_micro_batches, pipeline_eval, pipeline_step
from ..parallel.tensor import rank_rng
from ..peft.qlora import check_quantize_base, quantize_base, quantizes_base
from .metrics import MetricsWriter, MfuMeter, StepTokens, Window, count_real_tokens, format_record, reset_peak_memory
from .oom import device_memory_bytes, explain_out_of_memory, is_out_of_memory
from .optim import LRSchedule, OptimizerInBackward, build_optimizer, check_optimizer, state_dtype_of
from .run_dir import available_host_memory, check_host_memory, check_run_dir, prepare_run_dir

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "pipeline step", "optimizer step", "checkpoint save", "evaluation")


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports back."""

    run_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    eval: dict[str, float] | None = None
    last_checkpoint: Path | None = None


@dataclass
class StepResult:
    """One optimizer step: its loss and gradient norm, whether it was skipped, and its tokens."""

    loss: float
    grad_norm: float
    skipped: bool
    tokens: StepTokens


@dataclass
class TrainState:
    """Everything `setup` builds, once, for the loop."""

    ctx: Any  # parallel.launch.DistContext
    dims: Any  # parallel.dims.ParallelDims
    meshes: Any  # parallel.dims.Meshes, or None in one process
    plan: PrecisionPlan
    parts: list[nn.Module]
    pipeline: Any  # parallel.pipeline.Pipeline, or None
    masters: MasterWeights | HostMasters | None  # HostMasters: optimize.offload_optimizer
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | None
    loader: StatefulLoader
    schedule: LRSchedule
    total_steps: int
    checkpointer: Checkpointer
    params: list[torch.Tensor]  # what the optimizer steps (fp32 masters at O2)
    norm_exclude: list[torch.Tensor]  # stepped but not counted in the gradient norm (a tied copy)
    start: int = 0
    in_backward: OptimizerInBackward | None = None  # train.optimizer_in_backward: the update runs in backward

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.ctx.device


def _resolve_recompute(cfg: RunConfig, ctx: Any) -> RunConfig:
    """recompute: auto -> a per-layer plan for this device's memory (a GPU/NPU's total, a CPU's free memory
    shared by this machine's ranks), the least over the ranks so that every rank builds the same model."""
    if ctx.device.type == "cpu":
        free = available_host_memory()
        capacity = free // ctx.local_world_size if free else 0
    else:
        capacity = device_memory_bytes(ctx.device) or 0
    if ctx.world_size > 1:
        capacity = int(-max_over(-float(capacity)))
    resolved = resolve_auto_recompute(cfg, ctx.world_size, ctx.device.type, capacity)
    if ctx.is_main:
        log.info("recompute auto: %s (for %.1f GiB a device)", describe_plan(resolved.optimize.recompute_layers),
                 capacity / 2**30)
    return resolved


class Trainer:
    """Pre-trains or fine-tunes a model as a RunConfig describes, on one device or as one rank of many."""

    def __init__(self, config: RunConfig, model: nn.Module | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, tokenizer: Any = None) -> None:
        self.config = config
        self.model = model  # after setup: this rank's first model part
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer
        self.model_parts: list[nn.Module] | None = None  # this rank's parallelised model part(s)
        self.pipeline: Any = None  # parallel.pipeline.Pipeline under pipeline parallelism
        self.state: TrainState | None = None
        self.phase = "setup"
        self._phase_hooks: list[Callable[[str], None]] = []

    def add_phase_hook(self, hook: Callable[[str], None]) -> None:
        """Call `hook(phase)` whenever a step enters one of PHASES."""
        self._phase_hooks.append(hook)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        for hook in self._phase_hooks:
            hook(phase)

    # --- the run ----------------------------------------------------------------------------------

    def train(self, resume: str | None = None, overwrite: bool = False) -> TrainResult:
        """Run training to `max_steps` (or the epochs' worth), resuming when asked."""
        s = self.state = self.setup(resume, overwrite)
        cfg, run_dir = self.config, Path(self.config.train.output_dir)
        mfu = MfuMeter(run_flops(cfg).total, device_peak(s.device, s.plan.dtype, cfg.train.peak_tflops,
                                                         measure=s.ctx.is_main))  # only rank 0 logs MFU
        writer = MetricsWriter(run_dir, tensorboard=cfg.train.tensorboard, enabled=s.ctx.is_main,
                               resume_step=s.start)
        result = TrainResult(run_dir=run_dir, step=s.start)
        bar = tqdm(total=s.total_steps, initial=s.start, disable=not (cfg.train.progress_bar and s.ctx.is_main),
                   unit="step", dynamic_ncols=True, desc="train")
        window = Window(time.perf_counter())
        reset_peak_memory(s.device)
        try:
            for step in range(s.start, s.total_steps):
                lr = s.schedule.apply(s.optimizer, step)
                out = self.train_step(s.loader.next_step(), step)
                done = result.step = step + 1
                result.losses[done] = out.loss
                window.add(out.loss, out.tokens.real, out.tokens.target, out.skipped)
                bar.update(1)
                if cfg.train.check_replicas_steps and done % cfg.train.check_replicas_steps == 0:
                    self.check_replicas(done)
                if done % cfg.train.log_steps == 0 or done == s.total_steps:
                    record = window.record(done, lr, out.grad_norm, s.scaler.scale if s.scaler else 1.0, mfu,
                                           s.device, s.ctx.world_size)
                    writer.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    log.info(format_record(record))
                    window = Window(time.perf_counter())
                # Save first: a failure during evaluation must not cost the step's checkpoint.
                if (cfg.train.save_steps and done % cfg.train.save_steps == 0) or done == s.total_steps:
                    result.last_checkpoint = self.save(done)
                    window.start = time.perf_counter()
                if self.eval_dataset is not None and (
                        done == s.total_steps or (cfg.train.eval_steps and done % cfg.train.eval_steps == 0)):
                    result.eval = self.evaluate()
                    writer.write({"step": done, **{f"eval_{k}": v for k, v in result.eval.items()}})
                    log.info("step %d eval loss %.4f perplexity %.2f", done, result.eval["loss"],
                             result.eval["perplexity"])
                    window.start = time.perf_counter()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            pp_rank = s.meshes["pp"].get_local_rank() if s.dims.pp > 1 else 0
            raise TrainingError(explain_out_of_memory(cfg, s.ctx.world_size, s.ctx.rank, self.phase, s.device,
                                                      pp_rank, s.ctx.local_world_size)) from exc
        finally:
            s.loader.close()
            bar.close()
            writer.close()
        return result

    def setup(self, resume: str | None = None, overwrite: bool = False) -> TrainState:
        """Build the run's state: processes and layout, run directory, data, model parts, optimizer,
        schedule, scaler, loader and checkpointer; resume or load init_from's weights."""
        cfg = self.config
        run_dir = Path(cfg.train.output_dir)
        # Everything that can fail on the config alone fails before --overwrite removes anything.
        ctx = init_distributed(cfg.run.device, cfg.run.timeout_s)
        dims = layout_for(cfg, ctx.world_size)
        check_offload(cfg, ctx.device, dims)
        check_optimizer(cfg, dims, ctx.world_size, ctx.device)
        check_quantize_base(cfg, dims)
        pretrained = cfg.model.init_from is not None and self.model is None
        if pretrained:
            check_pretrained(cfg.model, lora=cfg.lora is not None)  # before any data is prepared
        if not ctx.is_main:
            logging.getLogger("shardwise").setLevel(logging.WARNING)  # one rank logs the run
        if ctx.restart_count:
            # Restarted by the launcher after a failure: continue from the newest checkpoint (also when the
            # first attempt resumed from an older one).
            resume = "auto"
            if ctx.is_main:
                log.warning("restart %d of the process group: resuming from the newest checkpoint", ctx.restart_count)
        rank0_first(lambda: check_run_dir(run_dir, resume, overwrite), ctx.rank)
        if cfg.optimize.recompute == "auto" and cfg.optimize.recompute_layers is None:
            cfg = self.config = _resolve_recompute(cfg, ctx)  # before the model is built; config.yaml records it
        check_host_memory(cfg, ctx)
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        meshes = dims.build_meshes(ctx.device.type) if dims.distributed else None
        # Rank 0 prepares the data (and the shared cache) first; the others then find it ready.
        rank0_first(self._prepare_data, ctx.rank)
        if not ctx.is_main:
            self._prepare_data()
        # Only now, with the data read, may --overwrite remove the old run.
        rank0_first(lambda: prepare_run_dir(run_dir, resume, overwrite), ctx.rank)
        if ctx.is_main:
            self._save_tokenizer(run_dir)

        plan = precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
        parts = self._model_parts(ctx.device, plan, dims, meshes, meta=pretrained)
        names = canonical_param_names(parts)  # as checkpoints name them: no wrapper prefixes
        trainable = [(names[id(p)], p) for p in parameters(parts) if p.requires_grad]
        masters = self._masters(trainable, plan, dims, ctx.device)
        opt_named = list(masters.named_masters()) if masters else trainable
        t = cfg.train
        step_on = "cpu" if isinstance(masters, HostMasters) else ctx.device.type  # offload_optimizer: the host
        optimizer = distribute_optimizer(build_optimizer(opt_named, t.optimizer, t.lr, t.weight_decay,
                                                         (t.beta1, t.beta2), t.eps,
                                                         kernel=t.optimizer_kernel(step_on),
                                                         state_dtype=state_dtype_of(t.optimizer_state_dtype),
                                                         in_backward=t.optimizer_in_backward), parts)
        # The optimizer in backward steps each weight (its fp32 master at O2) from a hook that runs after the
        # masters' own, which has moved the gradient into the master by then.
        in_backward = None if not cfg.train.optimizer_in_backward else OptimizerInBackward(
            optimizer, [p for _, p in trainable], target=masters.master_of if masters else (lambda p: p),
            after=(lambda p: p.copy_(masters.master_of(p))) if masters else None)
        holder = {} if masters is None else {"grad_holder": masters.master_of,
                                             "on_weight_grads": masters.grads_to_masters}
        self.pipeline = build_pipeline(parts, cfg, dims, meshes, ctx.device, token_loss_sum, **holder)
        scaler = loss_scaler_for(plan, cfg.optimize.loss_scale, cfg.optimize.initial_loss_scale)
        loader = StatefulLoader.for_run(self.train_dataset, cfg, meshes["dp"].get_local_rank() if meshes else 0,
                                        dims.dp, ctx.world_size)
        total_steps = cfg.train.max_steps if cfg.train.max_steps is not None else \
            loader.steps_for_epochs(cfg.train.epochs)
        schedule = LRSchedule(cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, total_steps,
                              cfg.train.decay_style, cfg.train.wsd_decay_ratio)
        # A pipeline's last-stage copy of a tied embedding matrix: stepped, but counted in the norm once.
        excluded = {names[id(p)] for p in self.pipeline.norm_exclusions()} if self.pipeline is not None else set()
        layout = {"world_size": ctx.world_size, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp}
        checkpointer = Checkpointer(run_dir, parts, optimizer, masters=masters, scaler=scaler, loader=loader,
                                    tied_copy=TIED_COPY in excluded, layout=layout, device=ctx.device, rank=ctx.rank,
                                    keep=cfg.train.keep_checkpoints, seed=cfg.train.seed, lora=cfg.lora,
                                    model_cfg=cfg.model, base=cfg.model.init_from)
        checkpointer.rank_streams = {f"tensor_parallel.{i}": r for i, r in enumerate(map(rank_rng, parts))
                                     if r is not None}
        state = TrainState(ctx=ctx, dims=dims, meshes=meshes, plan=plan, parts=parts, pipeline=self.pipeline,
                           masters=masters, optimizer=optimizer, scaler=scaler, loader=loader, schedule=schedule,
                           total_steps=total_steps, checkpointer=checkpointer, params=[p for _, p in opt_named],
                           norm_exclude=[p for n, p in opt_named if n in excluded], in_backward=in_backward)
        quantized = quantizes_base(cfg.lora)
        if quantized:  # QLoRA: a quantised base is in no checkpoint; it is loaded and quantised on every start
            if pretrained:
                checkpointer.load_pretrained(cfg.model.init_from, cfg.model)
            for part in parts:
                quantize_base(part, cfg.lora.quantize_base)
        state.start = checkpointer.load(resume, overwrite) if resume is not None else 0
        if state.start == 0 and pretrained and not quantized:
            checkpointer.load_pretrained(cfg.model.init_from, cfg.model)
        if ctx.is_main:
            (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")  # the config in force
        log.info("training %s on %s: %d steps of %d tokens, precision %s %s, recompute %s%s",
                 cfg.model.preset or cfg.model.model_type, ctx.device, total_steps,
                 tokens_per_step(cfg, ctx.world_size), cfg.optimize.mixed_precision, plan.level,
                 cfg.optimize.recompute, describe_layout(cfg, dims))
        return state

    # --- one step ---------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        """One optimizer step over this rank's micro-batches of 0-based step `step`. A step whose loss
        or gradients are not finite never touches the weights: with fp16 it is skipped and the loss
        scale lowered; otherwise it stops the run (or is skipped under train.nan_policy: skip)."""
        s, cfg = self.state, self.config
        local = [count_target_tokens(micro_batches), count_real_tokens(micro_batches)]
        n_tokens, n_real = sum_over(local, s.meshes["dp"]) if s.dims.dp > 1 else local
        tokens = StepTokens(real=int(n_real), target=int(n_tokens))
        if n_tokens == 0:
            raise TrainingError(f"step {step + 1}: the batch has no target tokens (all labels are ignored)")
        if s.in_backward is not None:
            s.in_backward.begin()
        total = self.forward_backward(micro_batches, n_tokens)
        if s.dims.dp > 1:
            total = all_reduce(total, s.meshes["dp"])
        self._enter("optimizer step")  # from here: master copies, unscale, clipping, the update
        if s.in_backward is not None:
            return self._stepped_in_backward(step, total, tokens)
        if s.masters is not None:
            s.masters.grads_to_masters()
        if s.scaler is not None:
            s.scaler.unscale(s.params)
        # One pass over the gradients gives the norm (over all pipeline stages, a tied matrix counted
        # once); its finiteness is also the fp16 overflow test.
        grad_norm = clip_grad_norm(s.params, cfg.train.max_grad_norm or None,
                                   reduce_group=s.pipeline.group if s.pipeline is not None else None,
                                   exclude=s.norm_exclude)
        loss, norm = (float(v) for v in torch.stack([total, grad_norm.to(total)]).tolist())
        if not (math.isfinite(loss) and math.isfinite(norm)):
            s.optimizer.zero_grad(set_to_none=True)
            self._not_finite(step, loss, norm)
            return StepResult(loss, norm, True, tokens)
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if s.masters is not None:
            s.masters.masters_to_model()
        if s.scaler is not None:
            s.scaler.update(found_inf=False)
        return StepResult(loss, norm, False, tokens)

    def _stepped_in_backward(self, step: int, total: torch.Tensor, tokens: StepTokens) -> StepResult:
        """The end of a step whose updates ran in backward (train.optimizer_in_backward): its gradient norm,
        and a stop if a gradient was not finite (the updates stopped at the first such gradient)."""
        hooks = self.state.in_backward
        loss, norm = float(total), float(hooks.finish())
        if hooks.finite and math.isfinite(loss) and math.isfinite(norm):
            return StepResult(loss, norm, False, tokens)
        touched = ("no weight was touched (a non-finite loss makes the first gradient non-finite)"
                   if not math.isfinite(loss) else "the parameters whose gradients came before it (nearest the "
                   "output) were updated, the others not")
        raise TrainingError(
            f"step {step + 1}: loss is {loss} and gradient norm {norm}. With train.optimizer_in_backward each "
            f"parameter is updated as its gradient arrives and the updates stopped at the first non-finite gradient: "
            f"{touched}. Training stopped; the last checkpoint is as it was. Lower train.lr or raise warmup, and "
            "resume from that checkpoint"
        )

    def _not_finite(self, step: int, loss: float, norm: float) -> None:
        """A skipped step: lower the fp16 loss scale, or stop (nan_policy stop), saying why."""
        scaler = self.state.scaler
        if scaler is not None and math.isfinite(loss):
            scaler.update(found_inf=True)
            if scaler.scale <= scaler.min_scale:
                raise TrainingError(
                    f"step {step + 1}: fp16 gradients still overflow at the smallest loss scale "
                    f"{scaler.min_scale:g}: the run has diverged. Lower train.lr, raise warmup or use bf16"
                )
            log.warning("step %d: fp16 gradients overflowed; step skipped, loss scale lowered to %g",
                        step + 1, scaler.scale)
            return
        if self.config.train.nan_policy == "stop":
            raise TrainingError(
                f"step {step + 1}: loss is {loss} and gradient norm {norm}; training stopped before the "
                "weights were touched. Lower train.lr, raise warmup, use bf16 instead of fp16, or set "
                "train.nan_policy: skip to skip such steps"
            )
        log.warning("step %d: loss %s / gradient norm %s is not finite; step skipped (nan_policy: skip)",
                    step + 1, loss, norm)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], n_tokens: float) -> torch.Tensor:
        """Forward and backward of the step's micro-batches, each loss divided by the step's global
        target-token count `n_tokens`; returns this rank's part of the step loss (the whole replica's
        loss, on every pipeline rank, under pipeline parallelism)."""
        s = self.state
        scale = s.scaler.scale if s.scaler else 1.0
        total = torch.zeros((), device=s.device)
        chunk = self.config.optimize.loss_chunk()  # None: the full logits, then token_loss_sum
        if s.pipeline is not None:
            # micro_batch_num micro-batches per schedule step: the schedule splits the concatenated batch
            # back into them and reduces data-parallel gradients at its end.
            self._enter("pipeline step")
            per_step = s.pipeline.micro_batch_num
            rounds = len(micro_batches) // per_step  # the config makes it a whole number
            for r in range(rounds):
                batch = concat_micro_batches(micro_batches[r * per_step:(r + 1) * per_step])
                with s.plan.autocast(s.device.type):
                    # The schedule's loss is sum(token losses) / global_tokens: dividing by n_tokens /
                    # scale also applies the fp16 loss scale to the backward.
                    total += pipeline_step(s.pipeline, batch["input_ids"], batch["labels"],
                                           global_tokens=n_tokens / scale, finish_step=r == rounds - 1,
                                           loss_chunk_tokens=chunk, **_model_extras(batch, s.device))
            return total / scale if s.scaler else total
        model, last = s.parts[0], len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ids = mb["input_ids"].to(s.device, non_blocking=True)
            labels = mb["labels"].to(s.device, non_blocking=True)
            with grad_sync(model, i == last), s.plan.autocast(s.device.type):  # gradient sync on the last only
                self._enter("forward")
                with self._saved_activations():
                    if chunk is not None:  # the model's forward returns the token-loss sum
                        loss = model(ids, labels=labels, loss_chunk_tokens=chunk,
                                     **_model_extras(mb, s.device)) / n_tokens
                    else:
                        loss = token_loss_sum(model(ids, **_model_extras(mb, s.device)), labels) / n_tokens
                self._enter("backward")
                (loss * scale if s.scaler else loss).backward()
            total += loss.detach()
        return total

    def _saved_activations(self) -> Any:
        """Where the forward's saved activations go: host memory (optimize.offload_activations), or nowhere new."""
        if self.config.optimize.offload_activations:
            return ActivationOffload(self.state.device)
        return contextlib.nullcontext()

    def save(self, step: int) -> Path:
        """Checkpoint the run at `step` (every rank calls it)."""
        self._enter("checkpoint save")
        return self.state.checkpointer.save(step)

    def check_replicas(self, step: int) -> None:
        """Stop when ranks that should hold identical parameters do not (seed 003, 5.3: losses drifting
        apart between cards): the replicated copies of ZeRO 0/1, or the HSDP replicas of ZeRO 2/3."""
        s = self.state
        problem = replicas_problem(s.parts, s.meshes, s.dims, self.config.parallel.zero_stage)
        if problem:
            raise TrainingError(
                f"step {step}: {problem}. Replicas that diverge train different models; look for "
                "non-deterministic kernels, a rank with different data or config, or faulty hardware"
            )

    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None, plan: PrecisionPlan | None = None,
                 device: torch.device | None = None) -> dict[str, float]:
        """Token-weighted loss and perplexity over the held-out data.

        Under pipeline parallelism (no `model` given) every rank runs the batches through the
        pipeline (`pipeline_eval`) and gets the same result.
        """
        cfg = self.config
        self._enter("evaluation")
        pipe = self.pipeline if model is None else None
        model = model or self.model
        device = device or next(model.parameters()).device
        plan = plan or (self.state.plan if self.state is not None else
                        precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level()))
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = 0
        chunk = cfg.optimize.loss_chunk()  # the loss sum is all evaluation needs: no logits either
        for mb in sequential_batches(self.eval_dataset, cfg.train.micro_batch_size, cfg.train.eval_batches):
            ids, labels = mb["input_ids"].to(device), mb["labels"].to(device)
            with plan.autocast(device.type):
                if pipe is not None:
                    loss_sum += pipeline_eval(pipe, ids, labels, loss_chunk_tokens=chunk,
                                              **_model_extras(mb, device)).double()
                elif chunk is not None:
                    loss_sum += model(ids, labels=labels, loss_chunk_tokens=chunk, **_model_extras(mb, device)).double()
                else:
                    loss_sum += token_loss_sum(model(ids, **_model_extras(mb, device)), labels).double()
            tokens += int((mb["labels"] != IGNORE_INDEX).sum())
        model.train(was_training)
        loss = float(loss_sum) / max(tokens, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}

    # --- pieces of setup --------------------------------------------------------------------------

    def _prepare_data(self) -> None:
        self.tokenizer, self.train_dataset, self.eval_dataset = run_data(
            self.config, self.train_dataset, self.eval_dataset, self.tokenizer)

    def _save_tokenizer(self, run_dir: Path) -> None:
        """The run's tokenizer beside its checkpoints (kept when resuming)."""
        tok_dir = run_dir / "tokenizer"
        if self.tokenizer is not None and not tok_dir.exists():
            self.tokenizer.save(str(tok_dir))

    def _model_parts(self, device: torch.device, plan: PrecisionPlan, dims: Any, meshes: Any,
                     meta: bool) -> list[nn.Module]:
        """This rank's model parts: the whole model (built with the run's seed, so the same on every
        rank), split into pipeline chunks when there is a pipeline, each parallelised. `meta`: the
        weights are read later onto this rank's shards (init_from), so no rank holds the whole model."""
        cfg = self.config
        dtype, fsdp_dtype = weight_dtypes(plan.param_dtype, plan.master_weights, dims,
                                          host_masters=self._offloads_optimizer())
        if self.model is None:
            model = build_run_model(cfg, "meta" if meta else device, dtype)
        else:
            model = prepare_given_model(self.model, device, dtype)
            adapt_for_finetuning(model, cfg.lora, cfg.freeze, seed=cfg.train.seed)
        what = describe_finetuning(model, cfg.lora, cfg.freeze)
        if what:
            log.info("%s: %s", what, trainable_summary(model))
        parts = parallelize_parts(model, cfg, dims, meshes, fsdp_dtype)
        if meta:
            for part in parts:
                allocate(part, device)
        # Without a pipeline the model is the one part; with one, this rank's first chunk.
        self.model, self.model_parts = parts[0], parts
        return parts

    def _offloads_optimizer(self) -> bool:
        """optimize.offload_optimizer's own engine (with offload_params FSDP2's CPU offload steps on the host)."""
        o = self.config.optimize
        return o.offload_optimizer and not o.offload_params

    def _masters(self, trainable: list[tuple[str, nn.Parameter]], plan: PrecisionPlan, dims: Any,
                 device: torch.device) -> MasterWeights | HostMasters | None:
        """What the optimizer steps instead of the model's parameters: host masters (offload_optimizer),
        fp32 masters on the device (O2, unless FSDP2's fp32 shards are the masters), or nothing."""
        if self._offloads_optimizer():
            return HostMasters(trainable, master_dtype_for(plan.param_dtype, plan.master_weights), device)
        if plan.master_weights and not fsdp_holds_masters(dims):
            return MasterWeights(trainable)
        return None


def _model_extras(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Document-aware position ids and masks, when the data provides them."""
    keys = ("position_ids", "document_ids", "attention_mask")
    return {k: mb[k].to(device, non_blocking=True) for k in keys if k in mb}


