"""A run's state and its steps: from a resolved config to optimizer steps, on one device or many.

`Trainer.train()` builds the run's state once (`setup`: processes and layout, run directory, data,
model parts, optimizer, schedule, loss scaler, loader, checkpointer) and hands it to the loop
(loop.py), which runs the steps and logs, checkpoints, stops and evaluates between them. `train_step`
runs one optimizer step (`forward_backward` over its micro-batches, then unscale, clip and update)
without waiting for the device; `settle` reads a step's figures and acts on them. The trainer knows no
more of the parallelism than what `parallel` hands it: model parts (the whole model, or this rank's
pipeline chunks), an optimizer to step and, with pipeline parallelism, a schedule. A step's loss is the
sum of token losses over every rank's micro-batches divided by the step's global target-token count,
and data-parallel reduction sums, so every layout computes one device's gradient. Tools follow a step
through `add_phase_hook(fn)`: `fn(phase)` is called as the trainer enters each of PHASES.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..builder import adapt_for_finetuning, build_run_model, describe_finetuning, prepare_given_model, trainable_summary
from ..checkpoint.checkpointer import TIED_COPY, Checkpointer, canonical_param_names, parameters
from ..checkpoint.weights import check_pretrained
from ..config import RunConfig, to_yaml, tokens_per_step
from ..config.schema import CPU_COMPILE_PAYS_AFTER_S
from ..data.build import run_data
from ..data.loader import StatefulLoader, batches_to_device
from ..errors import TrainingError
from ..files import write_text_atomic
from ..hardware import device_peak
from ..loss import count_target_tokens, token_loss_sum
from ..memory.auto_recompute import describe_plan, resolve_auto_recompute
from ..memory.estimate import run_flops
from ..memory.offload import ActivationOffload, HostMasters, master_dtype_for
from ..memory.precision import LossScaler, MasterWeights, PrecisionPlan, loss_scaler_for, precision_plan
from ..memory.streamed_optimizer import StreamedAdam, StreamMasters
from ..models.moe import set_aux_loss_scale, take_expert_load, update_expert_bias
from ..parallel.collectives import all_reduce, max_over, rank0_first, rank0_then_others, replicas_problem
from ..parallel.data_parallel import check_offload, clip_grad_norm, fsdp_on_one_process, grad_sync
from ..parallel.dims import describe_layout, layout_for
from ..parallel.expert import reduce_expert_gradients
from ..parallel.float8 import after_optimizer_step, check_float8
from ..parallel.launch import init_distributed, join_one_process_group
from ..parallel.parallelize import (
    allocate,
    build_pipeline,
    distribute_optimizer,
    fsdp_holds_masters,
    parallelize_parts,
    weight_dtypes,
)
from ..parallel.pipeline import concat_micro_batches, pipeline_step
from ..parallel.tensor import rank_rng
from ..peft.qlora import check_quantize_base, quantize_base, quantizes_base
from .evaluation import evaluate_held_out, evaluate_sources, model_inputs
from .host_allocator import keep_freed_host_memory, keeps_host_memory
from .loop import TrainingLoop, TrainResult
from .metrics import StepTokens, count_real_tokens
from .oom import device_memory_bytes
from .optim import (
    LRSchedule,
    OptimizerInBackward,
    build_optimizer,
    check_optimizer,
    decay_groups,
    state_dtype_of,
    step_unless,
)
from .preference_step import REFERENCE_FILE, PreferenceTuning, load_reference, save_reference
from .run_dir import available_host_memory, check_host_memory, check_run_dir, prepare_run_dir
from .shared_storage import check_shared_run_dir
from .step_result import StepResult

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "pipeline step", "optimizer step", "checkpoint save", "evaluation")


@dataclass
class TrainState:
    """Everything `setup` builds, once, for the loop."""

    ctx: Any  # parallel.launch.DistContext
    dims: Any  # parallel.dims.ParallelDims
    meshes: Any  # parallel.dims.Meshes, or None in one process
    plan: PrecisionPlan
    parts: list[nn.Module]
    pipeline: Any  # parallel.pipeline.Pipeline, or None
    masters: MasterWeights | HostMasters | StreamMasters | None  # the last two: optimize.offload_optimizer
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


def _resolve_compile(cfg: RunConfig, ctx: Any, samples: int) -> RunConfig:
    """run.compile: auto -> true or false for this device (RunConfig.compiles). On a CPU that depends on how long
    the run is predicted to train: its FLOPs at half of this CPU's measured matmul peak (about what training
    reaches here), rank 0's prediction for every rank."""
    seconds = None
    if ctx.device.type == "cpu":
        steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * samples / cfg.global_batch_size(ctx.world_size))
        peak = device_peak(ctx.device, torch.float32, cfg.train.peak_tflops, measure=ctx.is_main).flops
        flops = run_flops(cfg).total * tokens_per_step(cfg, ctx.world_size) * steps / ctx.world_size
        seconds = flops / (0.5 * peak) if ctx.is_main and peak > 0 else 0.0
        if ctx.world_size > 1:
            seconds = max_over(seconds)
    compiled = cfg.compiles(ctx.device.type, seconds)
    if ctx.is_main and seconds is not None:
        log.info("run.compile auto: %s (training predicted to take %.0f s on this CPU; compiling pays from %.0f s)",
                 "compiled" if compiled else "eager", seconds, CPU_COMPILE_PAYS_AFTER_S)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"compile": compiled})})


class Trainer:
    """Pre-trains or fine-tunes a model as a RunConfig describes, on one device or as one rank of many."""

    def __init__(self, config: RunConfig, model: nn.Module | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, tokenizer: Any = None, fsdp_offload_on_cpu: bool = False) -> None:
        """`fsdp_offload_on_cpu`: on a one-process CPU run, take optimize.offload_params through FSDP2's CPU
        offload on a one-process group anyway, the path one accelerator takes (on the CPU it only adds
        copies, since everything already lives in host memory; tests of that path use it)."""
        self.config = config
        self.fsdp_offload_on_cpu = fsdp_offload_on_cpu
        self.model = model  # after setup: this rank's first model part
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer
        self.model_parts: list[nn.Module] | None = None  # this rank's parallelised model part(s)
        self.pipeline: Any = None  # parallel.pipeline.Pipeline under pipeline parallelism
        self.state: TrainState | None = None
        self.phase = "setup"
        self._previous: StepResult | None = None  # the last step, until its figures are acted on
        self._phase_hooks: list[Callable[[str], None]] = []
        # data.kind preference: the pair losses, the reference model and the step's reward figures (setup)
        self.preference: PreferenceTuning | None = None

    def add_phase_hook(self, hook: Callable[[str], None]) -> None:
        """Call `hook(phase)` whenever a step enters one of PHASES."""
        self._phase_hooks.append(hook)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        for hook in self._phase_hooks:
            hook(phase)

    # --- the run ----------------------------------------------------------------------------------

    def train(self, resume: str | None = None, overwrite: bool = False) -> TrainResult:
        """Run training to `max_steps` (or the epochs' worth), resuming when asked. SIGTERM or SIGUSR1 stops it
        after a step that every rank agrees on, with that step's checkpoint (`stop_signals`; `stopped_by`).
        `setup` builds the state once; the loop (loop.py) runs the steps and what comes between them."""
        self.state = self.setup(resume, overwrite)
        return TrainingLoop(self, self.state).run()

    def setup(self, resume: str | None = None, overwrite: bool = False) -> TrainState:
        """Build the run's state: processes and layout, run directory, data, model parts, optimizer,
        schedule, scaler, loader and checkpointer; resume or load init_from's weights."""
        cfg = self.config
        run_dir = Path(cfg.train.output_dir)
        self.preference = PreferenceTuning(cfg) if cfg.data.kind == "preference" else None
        # Everything that can fail on the config alone fails before --overwrite removes anything.
        ctx = init_distributed(cfg.run.device, cfg.run.timeout_s)
        dims = layout_for(cfg, ctx.world_size)
        if fsdp_on_one_process(cfg, ctx.device, dims, on_cpu=self.fsdp_offload_on_cpu):
            dims = dataclasses.replace(dims, one_process_fsdp=True)  # offload_params on one device: FSDP2's
        check_offload(cfg, ctx.device, dims)
        check_float8(cfg, ctx.device, dims)
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
        rank0_first(lambda: check_run_dir(run_dir, resume, overwrite), ctx.rank, "checking the run directory")
        check_shared_run_dir(run_dir, ctx.rank)  # one file system for every rank's checkpoint shards
        if cfg.optimize.recompute == "auto" and cfg.optimize.recompute_layers is None:
            cfg = self.config = _resolve_recompute(cfg, ctx)  # before the model is built; config.yaml records it
        check_host_memory(cfg, ctx)
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        if keeps_host_memory(cfg.run.keep_host_memory, ctx.device.type):
            keep_freed_host_memory()  # for the whole process: tensors freed each step are reused, not faulted in
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        if dims.one_process_fsdp:
            join_one_process_group(ctx, cfg.run.timeout_s)  # FSDP2 needs a group and meshes, even alone
        meshes = dims.build_meshes(ctx.device.type) if dims.needs_meshes else None
        # Rank 0 prepares the data (and the shared cache) first; the others then find it ready (or, with a cache
        # of each node's own, the first rank of each node prepares it). They wait by polling the store, with no
        # collective in flight, so that tokenising a big corpus may take longer than run.timeout_s.
        rank0_then_others(self._prepare_data, ctx.rank, "data preparation")
        if cfg.run.compile == "auto":  # before the model is built; config.yaml records what it became
            cfg = self.config = _resolve_compile(cfg, ctx, len(self.train_dataset))
        # Only now, with the data read, may --overwrite remove the old run.
        rank0_first(lambda: prepare_run_dir(run_dir, resume, overwrite), ctx.rank, "preparing the run directory")
        if ctx.is_main:
            self._save_tokenizer(run_dir)

        plan = precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
        parts = self._model_parts(ctx.device, plan, dims, meshes, meta=pretrained)
        names = canonical_param_names(parts)  # as checkpoints name them: no wrapper prefixes
        trainable = [(names[id(p)], p) for p in parameters(parts) if p.requires_grad]
        masters = self._masters(trainable, plan, dims, ctx.device)
        t = cfg.train
        streamed = cfg.optimize.streams_optimizer() and not cfg.optimize.offload_params
        # What the optimizer steps: the fp32 masters at O2, else the trainable parameters. The streamed
        # optimizer steps the device parameters (their gradients stay there) and keeps the masters itself.
        opt_named = list(masters.named_masters()) if masters and not streamed else trainable
        if streamed:
            decoupled = t.optimizer in ("adamw", "adamw_8bit")
            decay = t.weight_decay if decoupled else 0.0  # as build_optimizer: adam has none
            optimizer = StreamedAdam(decay_groups(trainable, decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                     weight_decay=decay, decoupled=decoupled, device=ctx.device,
                                     state_dtype=state_dtype_of(t.optimizer_state_dtype), masters=masters,
                                     eight_bit=t.optimizer == "adamw_8bit")
        else:
            # offload_optimizer cpu, and FSDP2's CPU offload (offload_params): the optimizer steps host tensors
            # (with offload_params_blocks some host and some device tensors: the device's kernel, grouped by device)
            on_host = isinstance(masters, HostMasters) or (cfg.optimize.offload_params and dims.uses_fsdp
                                                           and cfg.optimize.params_on_host(None))
            step_on = "cpu" if on_host else ctx.device.type
            optimizer = distribute_optimizer(build_optimizer(opt_named, t.optimizer, t.lr, t.weight_decay,
                                                             (t.beta1, t.beta2), t.eps,
                                                             kernel=t.optimizer_kernel(step_on),
                                                             state_dtype=state_dtype_of(t.optimizer_state_dtype),
                                                             in_backward=t.optimizer_in_backward), parts)
        # The optimizer in backward steps each weight (its fp32 master at O2) from a hook that runs after the
        # masters' own, which has moved the gradient into the master by then; the streamed optimizer steps the
        # device parameter, rounding its master into it itself.
        steps_masters = masters is not None and not streamed
        in_backward = None if not cfg.train.optimizer_in_backward else OptimizerInBackward(
            optimizer, [p for _, p in trainable], target=masters.master_of if steps_masters else (lambda p: p),
            after=(lambda p: p.copy_(masters.master_of(p))) if steps_masters else None)
        holder = {} if not steps_masters else {"grad_holder": masters.master_of,
                                               "on_weight_grads": masters.grads_to_masters}
        self.pipeline = build_pipeline(parts, cfg, dims, meshes, ctx.device, token_loss_sum, **holder)
        scaler = loss_scaler_for(plan, cfg.optimize.loss_scale, cfg.optimize.initial_loss_scale, ctx.device)
        loader = StatefulLoader.for_run(self.train_dataset, cfg, meshes["dp"].get_local_rank() if meshes else 0,
                                        dims.dp, ctx.world_size, ctx.device.type, ctx.local_world_size)
        total_steps = cfg.train.max_steps if cfg.train.max_steps is not None else \
            loader.steps_for_epochs(cfg.train.epochs)
        schedule = LRSchedule(cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, total_steps,
                              cfg.train.decay_style, cfg.train.wsd_decay_ratio)
        # A pipeline's last-stage copy of a tied embedding matrix: stepped, but counted in the norm once.
        excluded = {names[id(p)] for p in self.pipeline.norm_exclusions()} if self.pipeline is not None else set()
        layout = {"world_size": ctx.world_size, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp,
                  **({"cp": dims.cp} if dims.cp > 1 else {})}  # without cp as before: older checkpoints match
        checkpointer = Checkpointer(run_dir, parts, optimizer, masters=masters, scaler=scaler, loader=loader,
                                    tied_copy=TIED_COPY in excluded, layout=layout, device=ctx.device, rank=ctx.rank,
                                    keep=cfg.train.keep_checkpoints, seed=cfg.train.seed, lora=cfg.lora,
                                    model_cfg=cfg.model, base=cfg.model.init_from, async_save=cfg.train.async_save,
                                    verify=cfg.train.verify_checkpoints)
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
        frozen_reference = self.preference is not None and self.preference.mode == "frozen_copy"
        if frozen_reference:  # the reference is the starting weights: copied before a resume's checkpoint loads
            if pretrained:
                checkpointer.load_pretrained(cfg.model.init_from, cfg.model)
            self.preference.copy_starting_weights(parts)
        state.start = checkpointer.load(resume, overwrite) if resume is not None else 0
        if state.start == 0 and pretrained and not quantized and not frozen_reference:
            checkpointer.load_pretrained(cfg.model.init_from, cfg.model)
        if self.preference is not None:
            self._precomputed_reference(state, run_dir)
        if ctx.is_main:
            # The config in force, in one rename: never written through a link to a file of the user's.
            write_text_atomic(run_dir / "config.yaml", to_yaml(cfg))
        log.info("training %s on %s: %d steps of %d tokens, precision %s %s, recompute %s%s",
                 cfg.model.preset or cfg.model.model_type, ctx.device, total_steps,
                 tokens_per_step(cfg, ctx.world_size), cfg.optimize.mixed_precision, plan.level,
                 cfg.optimize.recompute, describe_layout(cfg, dims))
        return state

    # --- one step ---------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        """One optimizer step over this rank's micro-batches of 0-based step `step`.

        Nothing in it waits for the device: the figures come back as a `StepResult` whose copy to the
        host runs behind the step. A step whose loss or gradients are not finite never touches the
        weights: the update is skipped on the device (fused kernels take the flag as `found_inf`;
        others read it), with fp16 the loss scale is lowered there too, and the trainer acts on it
        (`settle`: a warning, or a stop under train.nan_policy: stop) when it reads the figures,
        at the latest before the next step's update.
        """
        s, cfg = self.state, self.config
        tokens = self._step_tokens(micro_batches, step)  # StepTokens, or [target, real] on the device
        micro_batches = batches_to_device(micro_batches, s.device)  # after counting on the host: queued, not awaited
        n_tokens = tokens.target if isinstance(tokens, StepTokens) else tokens[0]
        if self.preference is not None:  # the loss is a mean over the step's pairs, not its tokens
            n_tokens = self.preference.pairs(micro_batches, s.dims.dp)
        if s.in_backward is not None:
            s.in_backward.begin()
        total = self.forward_backward(micro_batches, n_tokens)
        rewards = self.preference.take_figures(s.pipeline) if self.preference is not None else None
        if s.dims.dp > 1:
            if rewards is None:
                total = all_reduce(total, s.meshes["dp"])
            else:  # the reward figures travel with the loss: one collective
                both = all_reduce(torch.cat([total.double().reshape(1), rewards]), s.meshes["dp"])
                total, rewards = both[0].to(total.dtype), both[1:]
        if 1 < cfg.parallel.expert_parallel < s.dims.dp:
            for part in s.parts:  # expert parallelism below the data-parallel degree: the replicas' gradients summed
                reduce_expert_gradients(part)
        load = self._expert_load()
        self._enter("optimizer step")  # from here: master copies, unscale, clipping, the update
        if s.in_backward is not None:
            return self._stepped_in_backward(step, total, tokens, load)
        if s.masters is not None:
            s.masters.grads_to_masters()
        if s.scaler is not None:
            s.scaler.unscale(s.params)
        # One pass over the gradients gives the norm (over all pipeline stages, a tied matrix counted
        # once); its finiteness is also the fp16 overflow test.
        grad_norm = clip_grad_norm(s.params, cfg.train.max_grad_norm or None,
                                   reduce_group=s.pipeline.group if s.pipeline is not None else None,
                                   exclude=s.norm_exclude).to(total)
        finite_loss = torch.isfinite(total)
        skip = ~(finite_loss & torch.isfinite(grad_norm))
        self._settle_previous()  # its figures are ready by now; a step that must stop the run stops it here
        step_unless(s.optimizer, skip)
        self._balance_experts(load, skip)
        s.optimizer.zero_grad(set_to_none=True)
        if s.masters is not None and not isinstance(s.masters, StreamMasters):  # streamed: rounded in the update
            s.masters.masters_to_model()
        after_optimizer_step(s.parts)  # float8 all-gather: the next step's weight scales (unchanged if skipped)
        overflowed = finite_loss & skip  # fp16: gradients overflowed, the loss did not
        if s.scaler is not None:
            s.scaler.update(overflowed)
        scale = s.scaler.scale_tensor if s.scaler is not None else torch.ones((), device=total.device)
        known = isinstance(tokens, StepTokens)
        figures = [total, grad_norm, skip, overflowed, scale] + ([] if known else list(tokens))
        # float64: exact for the token counts (float32 is not above 2^24), and one copy to the host
        stacked = torch.stack([f.to(total.device, torch.float64) for f in figures])
        self._previous = StepResult(step, stacked, tokens if known else None, load, rewards)
        return self._previous

    def _expert_load(self) -> tuple[list[str], torch.Tensor] | None:
        """The MoE blocks' routed copies per expert over this step's micro-batches, summed over the
        data-parallel (and context-parallel) ranks ([blocks, experts], on the device); None for a dense model."""
        s = self.state
        if not self.config.model.num_experts:
            return None
        counts = {name: c for part in s.parts for name, c in take_expert_load(part).items()}
        if not counts:
            return None
        load = torch.stack(list(counts.values()))
        if s.dims.dp * s.dims.cp > 1:  # every rank's tokens: the context-parallel ranks hold parts of each sequence
            load = all_reduce(load, s.meshes.gradient_mesh("dp"))
        return list(counts), load

    def _balance_experts(self, load: tuple[list[str], torch.Tensor] | None, skip: torch.Tensor) -> None:
        """model.moe_bias_update_rate: move each router's expert bias towards an even load (the same on
        every rank: the counts are summed over them); a skipped step leaves the biases alone."""
        rate = self.config.model.moe_bias_update_rate
        if load is None or not rate:
            return
        by_name = dict(zip(load[0], load[1]))
        for part in self.state.parts:
            update_expert_bias(part, by_name, rate * (~skip).to(load[1].dtype))

    def _step_tokens(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepTokens | torch.Tensor:
        """The step's target and real tokens over all ranks (the loss is divided by the target count):
        host numbers in one data-parallel replica; under data parallelism [target, real] summed by a
        collective on the device, which nothing waits for (the figures carry them to the host)."""
        s = self.state
        target, real = count_target_tokens(micro_batches), count_real_tokens(micro_batches)
        if s.dims.dp == 1:
            if target == 0:
                raise TrainingError(_no_targets(step))
            return StepTokens(real=real, target=target)
        return all_reduce(torch.tensor([target, real], dtype=torch.int64).to(s.device, non_blocking=True),
                          s.meshes["dp"])

    def _settle_previous(self) -> None:
        """Act on the last step's figures, if not done yet (see `settle`)."""
        previous, self._previous = self._previous, None
        if previous is not None:
            self.settle(previous)

    def settle(self, result: StepResult) -> None:
        """Read a step's figures and act on them, once: stop on a batch without targets, and on a skipped
        step lower nothing more (the device has done it) but warn, or stop (fp16 at the smallest loss scale,
        train.nan_policy: stop, a non-finite gradient under train.optimizer_in_backward)."""
        if result.settled:
            return
        result.settled = True
        if result.tokens.target == 0:
            raise TrainingError(_no_targets(result.step))
        if result.skipped:
            self._not_finite(result)

    def _stepped_in_backward(self, step: int, total: torch.Tensor, tokens: StepTokens | torch.Tensor,
                             load: tuple[list[str], torch.Tensor] | None = None) -> StepResult:
        """The end of a step whose updates ran in backward (train.optimizer_in_backward): its figures, read
        later as a plain step's are (`settle` stops the run on a non-finite one). Nothing is read here: from
        the first non-finite gradient on, the device's flag stopped every update, and it stays set until the
        host reads it, so a step that runs before the stop is read updates nothing either."""
        s = self.state
        grad_norm = s.in_backward.finish()
        after_optimizer_step(s.parts)  # float8 all-gather: the next step's weight scales
        flag = s.in_backward.not_finite
        skip = ~(torch.isfinite(total) & torch.isfinite(grad_norm))
        if flag is not None:
            skip = skip | flag.to(total.device)
        self._settle_previous()  # its figures are ready by now; a step that must stop the run stops it here
        self._balance_experts(load, skip)
        zero = torch.zeros((), device=total.device)
        known = isinstance(tokens, StepTokens)
        figures = [total, grad_norm, skip, zero, zero + 1] + ([] if known else list(tokens))  # not overflowed, scale 1
        stacked = torch.stack([f.to(total.device, torch.float64) for f in figures])
        self._previous = StepResult(step, stacked, tokens if known else None, load)
        return self._previous

    def _not_finite(self, result: StepResult) -> None:
        """A skipped step (the device lowered the fp16 loss scale already): say so, or stop (fp16 at the
        smallest scale, nan_policy stop, a non-finite gradient under train.optimizer_in_backward), saying why."""
        scaler, step, loss, norm = self.state.scaler, result.step, result.loss, result.grad_norm
        if self.state.in_backward is not None:
            self.state.in_backward.read_finite()  # the run stops: host-side step counters of undone updates go back
            touched = ("no weight was touched (a non-finite loss makes the first gradient non-finite)"
                       if not math.isfinite(loss) else "the parameters whose gradients came before it (nearest the "
                       "output) were updated, the others not")
            raise TrainingError(
                f"step {step + 1}: loss is {loss} and gradient norm {norm}. With train.optimizer_in_backward each "
                f"parameter is updated as its gradient arrives and the updates stopped at the first non-finite "
                f"gradient: {touched}; no later update was made. Training stopped; the last checkpoint is as it was. "
                "Lower train.lr or raise warmup, and resume from that checkpoint"
            )
        if scaler is not None and result.overflowed:
            if result.scale <= scaler.min_scale:
                raise TrainingError(
                    f"step {step + 1}: fp16 gradients still overflow at the smallest loss scale "
                    f"{scaler.min_scale:g}: the run has diverged. Lower train.lr, raise warmup or use bf16"
                )
            log.warning("step %d: fp16 gradients overflowed; step skipped, loss scale lowered to %g",
                        step + 1, result.scale)
            return
        if self.config.train.nan_policy == "stop":
            raise TrainingError(
                f"step {step + 1}: loss is {loss} and gradient norm {norm}; training stopped before the "
                "weights were touched. Lower train.lr, raise warmup, use bf16 instead of fp16, or set "
                "train.nan_policy: skip to skip such steps"
            )
        log.warning("step %d: loss %s / gradient norm %s is not finite; step skipped (nan_policy: skip)",
                    step + 1, loss, norm)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], n_tokens: Any) -> torch.Tensor:
        """Forward and backward of the step's micro-batches, each loss divided by the step's global
        target-token count `n_tokens` (an int, or a 0-dim tensor on the device); returns this rank's part
        of the step loss (the whole replica's loss, on every pipeline rank, under pipeline parallelism)."""
        s = self.state
        scale = s.scaler.scale_tensor if s.scaler else 1.0  # a device tensor: reading it would wait
        total = torch.zeros((), device=s.device)
        chunk = self.config.optimize.loss_chunk()  # None: the full logits, then token_loss_sum
        if s.pipeline is not None:
            # micro_batch_num micro-batches per schedule step: the schedule splits the concatenated batch
            # back into them and reduces data-parallel gradients at its end.
            self._enter("pipeline step")
            per_step = s.pipeline.micro_batch_num
            rounds = len(micro_batches) // per_step  # the config makes it a whole number
            for r in range(rounds):
                batch = concat_micro_batches(micro_batches[r * per_step:(r + 1) * per_step],
                                             pad_to=self.preference.width if self.preference is not None else None)
                with s.plan.autocast(s.device.type):
                    # The schedule's loss is sum(token losses) / global_tokens: dividing by n_tokens /
                    # scale also applies the fp16 loss scale to the backward.
                    if self.preference is not None:  # the sum of the pairs' losses
                        total += self.preference.pipeline_step(s.pipeline, batch, n_tokens / scale,
                                                               r == rounds - 1, s.device)
                        continue
                    total += pipeline_step(s.pipeline, batch["input_ids"], batch["labels"],
                                           global_tokens=n_tokens / scale, finish_step=r == rounds - 1,
                                           loss_chunk_tokens=chunk, **model_inputs(batch, s.device))
            return total / scale if s.scaler else total
        model, last = s.parts[0], len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ids = mb["input_ids"].to(s.device, non_blocking=True)
            labels = mb["labels"].to(s.device, non_blocking=True)
            with grad_sync(model, i == last), s.plan.autocast(s.device.type):  # gradient sync on the last only
                self._enter("forward")
                with self._saved_activations():
                    if self.preference is not None:  # the sum of the pairs' losses
                        loss = self.preference.micro_loss(model, mb, ids, labels, s.device) / n_tokens
                    elif chunk is not None:  # the model's forward returns the token-loss sum
                        loss = model(ids, labels=labels, loss_chunk_tokens=chunk,
                                     **model_inputs(mb, s.device)) / n_tokens
                    else:
                        loss = token_loss_sum(model(ids, **model_inputs(mb, s.device)), labels) / n_tokens
                self._enter("backward")
                (loss * scale if s.scaler else loss).backward()
            total += loss.detach()
        return total

    def _saved_activations(self) -> Any:
        """Where the forward's saved activations go: host memory (optimize.offload_activations), or nowhere new."""
        if self.config.optimize.offload_activations:
            return ActivationOffload(self.state.device, blocks=list(self.state.parts[0].layers.values()))
        return contextlib.nullcontext()

    def save(self, step: int) -> Path:
        """Checkpoint the run at `step` (every rank calls it). With train.async_save it returns once the state
        is in host memory; the directory returned appears when the write is published (at the next save, or
        `state.checkpointer.wait()`)."""
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

    def evaluate(self, model: nn.Module | None = None, plan: PrecisionPlan | None = None,
                 device: torch.device | None = None) -> dict[str, float]:
        """Token-weighted loss and perplexity over the held-out data (`evaluation.evaluate_held_out`).

        Without `model`: the trainer's own model in its layout, every rank of which calls this and gets
        the same result (the batches shared over the data-parallel ranks, through the pipeline under
        pipeline parallelism). With `model`: that model, in this process alone, over every batch.
        """
        cfg, s = self.config, self.state
        self._enter("evaluation")
        in_layout = model is None and s is not None
        model = model or self.model
        device = device or (s.device if in_layout else next(model.parameters()).device)
        plan = plan or (s.plan if s is not None else precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level()))
        how = dict(batch_size=cfg.train.micro_batch_size, limit=cfg.train.eval_batches, device=device, plan=plan,
                   dp_mesh=s.meshes["dp"] if in_layout and s.dims.dp > 1 else None)
        if self.preference is not None:
            return self.preference.evaluate(model, self.eval_dataset, pipeline=self.pipeline if in_layout else None,
                                            **how)
        how.update(loss_chunk=cfg.optimize.loss_chunk(), pipeline=self.pipeline if in_layout else None)
        if isinstance(self.eval_dataset, Mapping):  # a mixture's held-out data by source
            return evaluate_sources(model, self.eval_dataset, **how)
        return evaluate_held_out(model, self.eval_dataset, **how)

    # --- pieces of setup --------------------------------------------------------------------------

    def _precomputed_reference(self, state: TrainState, run_dir: Path) -> None:
        """Preference tuning's precomputed reference (train/preference_step.py): the pairs' log-probabilities
        computed now from the starting weights and kept in the run directory (read back on a resume). A frozen
        copy took the starting weights in `setup`, before any checkpoint loaded."""
        pref, cfg = self.preference, self.config
        if pref.mode != "precompute":
            return
        datasets = {"train": self.train_dataset, **({"eval": self.eval_dataset} if self.eval_dataset else {})}
        if state.start:
            logps = load_reference(run_dir)
        else:
            dp_mesh = state.meshes["dp"] if state.dims.dp > 1 else None
            logps = {name: pref.precompute_reference(state.parts[0], d, batch_size=cfg.train.micro_batch_size,
                                                     device=state.device, plan=state.plan, dp_mesh=dp_mesh,
                                                     pipeline=state.pipeline)
                     for name, d in datasets.items()}
            if state.ctx.is_main:
                save_reference(run_dir, logps["train"], logps.get("eval"))
            log.info("preference: the reference log-probabilities of %d pairs computed from the starting weights",
                     sum(len(d) for d in datasets.values()))
        for name, d in datasets.items():
            if name not in logps:
                raise TrainingError(f"{run_dir / REFERENCE_FILE} holds no {name} pairs; start the run afresh")
            d.set_reference(logps[name])

    def _prepare_data(self) -> None:
        self.tokenizer, self.train_dataset, self.eval_dataset = run_data(
            self.config, self.train_dataset, self.eval_dataset, self.tokenizer)

    def _save_tokenizer(self, run_dir: Path) -> None:
        """The run's tokenizer beside its checkpoints (kept when resuming)."""
        tok_dir = run_dir / "tokenizer"
        if self.tokenizer is not None and not os.path.lexists(tok_dir):  # a link (even dangling) is not written
            self.tokenizer.save(str(tok_dir))

    def _model_parts(self, device: torch.device, plan: PrecisionPlan, dims: Any, meshes: Any,
                     meta: bool) -> list[nn.Module]:
        """This rank's model parts: the whole model (built with the run's seed, so the same on every
        rank), split into pipeline chunks when there is a pipeline, each parallelised. `meta`: the
        weights are read later onto this rank's shards (init_from), so no rank holds the whole model."""
        cfg = self.config
        dtype, fsdp_dtype = weight_dtypes(plan.param_dtype, plan.master_weights, dims,
                                          host_masters=self._offloads_optimizer())
        # FSDP2's CPU offload (offload_params): built in host memory, where its shards will live; fully_shard
        # moves one block at a time through the device, so the whole model never has to fit there.
        offloaded = cfg.optimize.offload_params and dims.uses_fsdp
        if self.model is None:
            model = build_run_model(cfg, "meta" if meta else ("cpu" if offloaded else device), dtype)
        else:
            model = prepare_given_model(self.model, device, dtype)
            adapt_for_finetuning(model, cfg.lora, cfg.freeze, seed=cfg.train.seed)
        what = describe_finetuning(model, cfg.lora, cfg.freeze)
        if what:
            log.info("%s: %s", what, trainable_summary(model))
        # Preference tuning's frozen reference: a second model in the same layout (weights copied in setup).
        frozen = copy.deepcopy(model) if self.preference is not None and self.preference.mode == "frozen_copy" else None
        parts = parallelize_parts(model, cfg, dims, meshes, fsdp_dtype)
        if frozen is not None:
            self.preference.keep_frozen_parts(parallelize_parts(frozen, cfg, dims, meshes, fsdp_dtype))
        if meta:
            for part in parts + (self.preference.frozen if frozen is not None else []):
                allocate(part, device, on_host=cfg.optimize.params_on_host if offloaded else lambda _: False)
        # Without a pipeline the model is the one part; with one, this rank's first chunk.
        # MoE balance losses: a mean over the step's sequences, whatever the layout (a preference pair is two)
        sequences = cfg.global_batch_size(dims.world_size) * (2 if cfg.data.kind == "preference" else 1)
        for part in parts:
            set_aux_loss_scale(part, sequences)
        self.model, self.model_parts = parts[0], parts
        return parts

    def _offloads_optimizer(self) -> bool:
        """optimize.offload_optimizer's own engines, cpu and stream, which keep the masters in host memory
        (with offload_params FSDP2's CPU offload steps on the host instead)."""
        o = self.config.optimize
        return bool(o.offload_optimizer) and not o.offload_params

    def _masters(self, trainable: list[tuple[str, nn.Parameter]], plan: PrecisionPlan, dims: Any,
                 device: torch.device) -> MasterWeights | HostMasters | None:
        """What the optimizer steps instead of the model's parameters: host masters (offload_optimizer),
        fp32 masters on the device (O2, unless FSDP2's fp32 shards are the masters), or nothing."""
        if self._offloads_optimizer() and self.config.optimize.streams_optimizer():
            return StreamMasters(trainable, device) if plan.master_weights else None
        if self._offloads_optimizer():
            return HostMasters(trainable, master_dtype_for(plan.param_dtype, plan.master_weights), device)
        if plan.master_weights and not fsdp_holds_masters(dims):
            return MasterWeights(trainable)
        return None


def _no_targets(step: int) -> str:
    return f"step {step + 1}: the batch has no target tokens (all labels are ignored)"


