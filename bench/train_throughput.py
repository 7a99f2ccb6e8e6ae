#!/usr/bin/env python
"""Training throughput: the shardwise Trainer against a hand-written PyTorch loop, in one process.

    python bench/train_throughput.py bench/bench_llama.yaml [--set k=v ...] [--steps N] [--warmup W]
                                     [--rounds R] [--threads T] [--data synthetic|config] [--no-memory]

Both sides train the same model (`builder.build_run_model(cfg)` after `torch.manual_seed(train.seed)`:
the config's `lora:` adapters or `freeze:` settings applied as the Trainer applies them), on the same
batches (a `StatefulLoader` over the same dataset and seed), with the same AdamW
(`build_optimizer`: the kernel and moments the config resolves to, the same weight-decay groups),
the same LR schedule, gradient clipping,
precision, micro-batch and accumulation. Rounds interleave the sides (shardwise, plain, shardwise,
plain, ...); each round starts both from fresh weights and runs W unmeasured warm-up steps, then N
measured steps.

Timing (identical on both sides): a global optimizer step post-hook
(`torch.optim.optimizer.register_optimizer_step_post_hook`) stamps the end of every optimizer step;
step k takes hook(k) - hook(k-1), so a measured step covers everything the loop does between two
updates (LR update, data loading, forward/backward, clipping, the per-step sync, the trainer's
per-step logging) and nothing outside the steady state (model build, the trainer's final checkpoint,
process start). On CUDA the boundary stamps of the measured window synchronize first.

Data loading: `StatefulLoader.next_step` is wrapped (the Trainer's module-level name is patched for
the duration of its run) to time each call.

Memory: on CUDA, `max_memory_allocated` over the round (reset before the first step on both sides).
On CPU (and also on CUDA), a separate untimed probe runs 2 steps of each side under a
TorchDispatchMode that counts the bytes of every live tensor storage (params, grads, optimizer state,
activations, temporaries) and reports the peak over those two steps, split into the storages of the
model's parameters (and buffers), their gradients, the optimizer state, and the rest (activations,
temporaries, batches) live at that peak.

Host malloc: on a CPU the Trainer's `run.keep_host_memory` (freed memory kept for reuse) holds for the whole
process, so from the first Trainer setup on both sides run with it and the ratios compare the two codes under
one allocator; `process_throughput.py` runs each side in its own process, where the plain loop keeps malloc
as it is.

Prints one JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise import builder
from shardwise.config import RunConfig
from shardwise.data.loader import StatefulLoader
from shardwise.data.packing import PackedDataset
from shardwise.data.shards import token_dtype
from shardwise.hardware import device_name, measured_cpu_flops, peak_flops
from shardwise.memory.estimate import run_flops
from shardwise.memory.precision import precision_plan
from shardwise.models import count_parameters
from shardwise.parallel.launch import resolve_device
from shardwise.resolve import load_run_config as load_config
from shardwise.resolve import resolve_config as validate
from shardwise.train import trainer as trainer_mod
from shardwise.train.optim import LRSchedule, build_optimizer, state_dtype_of


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def capture_compile_reports() -> list[str]:
    """The Trainer's "torch.compile: ..." lines (its cold-compile cost), as they are logged."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("torch.compile:"):
                lines.append(record.getMessage())

    logger = logging.getLogger("shardwise")
    logger.addHandler(Keep(logging.INFO))
    logger.setLevel(min(logger.level or logging.INFO, logging.INFO))
    return lines


# --- measuring hooks --------------------------------------------------------------------------------


class StepClock:
    """Stamps the end of every optimizer step (a global post-hook), except for ignored optimizers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []
        self.sync_at: set[int] = set()  # step indices whose stamp synchronizes the device first
        self.cuda_peak_at: int | None = None  # step index at which to read max_memory_allocated
        self.cuda_peak: float | None = None
        self.on_step: Any = None  # optional callback(step_index, optimizer) (memory probe window)
        self.ignore: set[int] = set()  # id() of optimizers not to stamp (the plain side in lockstep)
        self._handle = None

    def start(self, sync_at: set[int], cuda_peak_at: int | None = None, on_step: Any = None) -> None:
        self.stamps, self.sync_at, self.cuda_peak_at, self.cuda_peak = [], sync_at, cuda_peak_at, None
        self.on_step = on_step
        self._handle = register_optimizer_step_post_hook(self._hook)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.on_step = None
        self.ignore = set()

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self.ignore:
            return
        k = len(self.stamps)
        if k in self.sync_at and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        if k == self.cuda_peak_at and self.device.type == "cuda":
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device)
        if self.on_step is not None:
            self.on_step(k, optimizer)

    def step_times(self) -> list[float]:
        """Seconds of each step from the previous step's end (step 0: nan)."""
        return [math.nan] + [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class TimedLoader(StatefulLoader):
    """StatefulLoader that times each next_step() call (same batches, same order).

    `TimedLoader.hooks_for_next` (on_first: called before the first call; before_each: called before
    every call, outside the timed part) is handed to the next instance created, then cleared.
    """

    last: "TimedLoader | None" = None
    hooks_for_next: dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_s: list[float] = []
        self.on_first = TimedLoader.hooks_for_next.get("on_first")
        self.before_each = TimedLoader.hooks_for_next.get("before_each")
        TimedLoader.hooks_for_next = {}
        TimedLoader.last = self

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        if not self.load_s and self.on_first is not None:
            self.on_first()
        if self.before_each is not None:
            self.before_each()
        t0 = time.perf_counter()
        out = super().next_step()
        self.load_s.append(time.perf_counter() - t0)
        return out


@contextlib.contextmanager
def patched_trainer_loader():
    """Make the Trainer build a TimedLoader instead of a StatefulLoader, for the duration."""
    original = trainer_mod.StatefulLoader
    trainer_mod.StatefulLoader = TimedLoader
    try:
        yield
    finally:
        trainer_mod.StatefulLoader = original


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created by any op; the peak while `recording`.

    At each new peak it keeps the sizes of the storages then live (by creation number: a storage's
    key is its address, which a later storage may reuse), so that `classify` can later tell which of
    them were parameters, gradients or optimizer state.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.recording = False
        self.step = 0  # the optimizer step in progress (set by the caller)
        self.peak_step = -1  # the step in which the peak was reached
        self.at_peak: dict[int, int] = {}  # creation number -> bytes, of each storage live at the peak
        self._sizes: dict[int, int] = {}
        self._serials: dict[int, int] = {}
        self._created = 0

    def start_recording(self) -> None:
        """Open the window: the peak starts at what is live now."""
        self.recording = True
        if self.live > self.peak:
            self._new_peak()

    def _new_peak(self) -> None:
        self.peak = self.live
        self.peak_step = self.step
        self.at_peak = {self._serials[k]: n for k, n in self._sizes.items()}

    def classify(self, groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
        """Bytes of the storages live at the peak that back each group's (still live) tensors; the rest as "rest"."""
        left = dict(self.at_peak)
        out = {}
        for name, tensors in groups.items():
            out[name] = sum(left.pop(self._serials.get(t.untyped_storage()._cdata), 0) for t in tensors)
        out["rest"] = sum(left.values())
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._serials.pop(key, None)

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.is_sparse or getattr(t, "is_nested", False):
            return
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - tensors without a storage
            return
        key = st._cdata
        size = st.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = size
            self._serials[key] = self._created
            self._created += 1
            self.live += size
            weakref.finalize(st, self._free, key)
        elif size != old:  # resized in place
            self._sizes[key] = size
            self.live += size - old
        if self.recording and self.live > self.peak:
            self._new_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


# --- the two sides ----------------------------------------------------------------------------------


def round_config(base: RunConfig, output_dir: str, max_steps: int) -> RunConfig:
    """The config for one shardwise run: fresh run dir, exact length, no eval/periodic saves/bars."""
    raw = base.model_dump(mode="json")
    raw["train"].update(output_dir=output_dir, max_steps=max_steps, save_steps=None, eval_steps=None,
                        log_steps=1, progress_bar=False, tensorboard=False)
    return validate(raw)


def trainable_parameters(cfg: RunConfig) -> int:
    """Parameters that train under the config's LoRA / freezing (counted on a meta-device model)."""
    return sum(p.numel() for p in builder.build_run_model(cfg, "meta").parameters() if p.requires_grad)


def run_shardwise(base: RunConfig, ds: Any, n_steps: int, clock: StepClock, sync_at: set[int],
                  cuda_peak_at: int | None, on_step: Any = None, loader_hooks: dict[str, Any] | None = None,
                  ignore: set[int] | None = None) -> dict[str, Any]:
    """Trainer(cfg, train_dataset=ds).train() for n_steps; returns step times, loader times, losses."""
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        cfg = round_config(base, tmp, n_steps)
        trainer = trainer_mod.Trainer(cfg, train_dataset=ds)
        TimedLoader.hooks_for_next = dict(loader_hooks or {})
        clock.start(sync_at, cuda_peak_at, on_step)
        clock.ignore = set(ignore or ())
        try:
            with patched_trainer_loader():
                result = trainer.train(overwrite=True)
        finally:
            clock.stop()
            TimedLoader.hooks_for_next = {}
        metrics = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        loader = TimedLoader.last
    out = {"step_s": clock.step_times(), "load_s": list(loader.load_s), "cuda_peak": clock.cuda_peak,
           "losses": [result.losses[s] for s in range(1, n_steps + 1)],
           "metrics_tps": {m["step"]: m["tokens_per_s"] for m in metrics if "tokens_per_s" in m}}
    del trainer, result, loader
    return out


def plain_loop(cfg: RunConfig, ds: Any, n_steps: int, device: torch.device, compiled: bool = False):  # noqa: ANN201
    """The loop an engineer writes by hand, doing the same work as the Trainer; `compiled`: the whole model
    under `torch.compile(model)`, as a hand-written loop compiles it.

    A generator: yields (optimizer, loader) once set up, then each step's loss after the step.
    """
    t = cfg.train
    plan = precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
    if plan.needs_loss_scaling:
        raise SystemExit("the plain loop has no fp16 loss scaling: bench with fp32 or bf16")
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    torch.manual_seed(t.seed)
    model = builder.build_run_model(cfg, device, plan.param_dtype)  # the Trainer's model, LoRA / freezing included
    model.train()
    if cfg.optimize.float8:  # torchao's float8 linears, converted by hand as a torchtitan-style loop does
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for block in model.layers.values():  # the blocks only: the output head stays bf16
            convert_to_float8_training(block, config=Float8LinearConfig(), module_filter_fn=lambda m, fqn:
                                       m.weight.requires_grad and all(d % 16 == 0 for d in m.weight.shape))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if compiled:
        torch._dynamo.config.suppress_errors = True  # as the Trainer's compile: a failing graph runs eagerly
        model = torch.compile(model)
    params = [p for _, p in named]
    masters = None
    if plan.master_weights:  # O2: 16-bit model, fp32 copies stepped by the optimizer
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        named = [(n, m) for (n, _), m in zip(named, masters)]
    # The Trainer's kernel and moments (train.optimizer_impl, optimizer_state_dtype); its update in backward
    # (optimizer_in_backward) is the Trainer's own lever: the plain loop steps after the backward.
    opt = build_optimizer(named, t.optimizer, t.lr, t.weight_decay, (t.beta1, t.beta2), t.eps,
                          kernel=t.optimizer_kernel(device.type), state_dtype=state_dtype_of(t.optimizer_state_dtype))
    opt_params = [p for _, p in named]
    grad_accum = cfg.gradient_accumulation()
    sched = LRSchedule(t.lr, t.min_lr, t.warmup_steps, n_steps, t.decay_style, t.wsd_decay_ratio)
    loader = TimedLoader(ds, t.micro_batch_size, grad_accum, t.seed, shuffle=getattr(ds, "shuffle", True))
    yield opt, loader
    for step in range(n_steps):
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(step)
        total = torch.zeros((), device=device)
        for mb in loader.next_step():
            x = mb["input_ids"].to(device, non_blocking=True)
            y = mb["labels"].to(device, non_blocking=True)
            extras = {k: mb[k].to(device, non_blocking=True)
                      for k in ("position_ids", "document_ids", "attention_mask") if k in mb}
            with plan.autocast(device.type):
                logits = model(x, **extras)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / grad_accum
            loss.backward()
            total += loss.detach()
        if masters is not None:
            for p, m in zip(params, masters):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        if t.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(opt_params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not None:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        value = total.item()  # one host sync per step, as the Trainer does
        del x, y, logits, loss, total, mb, extras  # free the step's tensors before yielding
        yield value


def run_plain(cfg: RunConfig, ds: Any, n_steps: int, clock: StepClock, sync_at: set[int],
              cuda_peak_at: int | None, device: torch.device, on_step: Any = None,
              compiled: bool = False) -> dict[str, Any]:
    """The plain loop for n_steps, timed by the same optimizer post-hook as the Trainer."""
    gen = plain_loop(cfg, ds, n_steps, device, compiled)
    opt, loader = next(gen)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock.start(sync_at, cuda_peak_at, on_step)
    try:
        losses = list(gen)
    finally:
        clock.stop()
    out = {"step_s": clock.step_times(), "load_s": list(loader.load_s), "cuda_peak": clock.cuda_peak,
           "losses": losses}
    del gen, opt, loader
    return out


def run_lockstep(cfg: RunConfig, ds: Any, n_steps: int, clock: StepClock, sync_at: set[int],
                 device: torch.device, compiled: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sides alternating step by step: the Trainer runs, and its loader runs one plain step first.

    A plain step is timed from resuming the generator to its yield (after its loss sync); a Trainer
    step is its optimizer-hook interval minus the plain step run inside it. Both models live at once.
    """
    gen = plain_loop(cfg, ds, n_steps, device, compiled)
    plain_opt, plain_loader = next(gen)
    plain_s: list[float] = []
    plain_losses: list[float] = []

    def plain_step() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        plain_losses.append(next(gen))
        plain_s.append(time.perf_counter() - t0)

    sw = run_shardwise(cfg, ds, n_steps, clock, sync_at, None, loader_hooks={"before_each": plain_step},
                       ignore={id(plain_opt)})
    # Trainer step k (k >= 1) spans its hook(k-1) .. hook(k), which includes plain step k.
    sw["step_s"] = [math.nan] + [s - p for s, p in zip(sw["step_s"][1:], plain_s[1:])]
    plain = {"step_s": plain_s, "load_s": list(plain_loader.load_s), "cuda_peak": None, "losses": plain_losses}
    gen = plain_opt = plain_loader = None  # release the plain side's model and state
    return sw, plain


def summarize(run: dict[str, Any], warmup: int, steps: int, tokens_per_step: int) -> dict[str, Any]:
    """Tokens/s and data-loading share over the measured steps warmup .. warmup+steps-1."""
    step_s = run["step_s"][warmup:warmup + steps]
    elapsed = sum(step_s)
    load = sum(run["load_s"][warmup:warmup + steps])
    return {"tokens_per_s": steps * tokens_per_step / elapsed, "step_s_median": statistics.median(step_s),
            "step_s": [round(s, 4) for s in step_s], "data_load_share": load / elapsed}


# --- memory probe -----------------------------------------------------------------------------------


def probe_memory(base: RunConfig, ds: Any, device: torch.device, clock: StepClock) -> dict[str, dict[str, int]]:
    """Peak live tensor bytes over the first 2 steps of each side (untimed, under a dispatch mode), and its split.

    The counter runs from before the model is built (so parameters, gradients and optimizer state
    count on both sides); the peak is taken from the first next_step() call to the end of step 2,
    which excludes model initialisation temporaries and the Trainer's final checkpoint. The storages
    live at the peak are sorted at the end of the step that reached it (after `optimizer.step()`,
    before `zero_grad`): the parameters and buffers of the model (the first module to run forward),
    their `.grad`s, the optimizer's state, and the rest.
    """
    peaks = {}
    for side in ("shardwise", "plain"):
        gc.collect()
        mode = LiveTensorBytes()
        models: list[torch.nn.Module] = []
        split: dict[str, int] = {}
        hook = None

        def first_forward(module: torch.nn.Module, args: Any) -> None:
            if not models:
                models.append(module)

        def open_window() -> None:
            nonlocal hook
            mode.start_recording()
            hook = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)

        def close_after(k: int, optimizer: torch.optim.Optimizer) -> None:
            if mode.peak_step == k:
                model = models[0]
                state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
                split.clear()
                split.update(mode.classify({
                    "params": [*model.parameters(), *model.buffers()],
                    "grads": [p.grad for p in model.parameters() if p.grad is not None],
                    "optimizer": state,
                }))
            mode.step = k + 1
            if k == 1:
                mode.recording = False

        try:
            with mode:
                if side == "shardwise":
                    run_shardwise(base, ds, 2, clock, set(), None, close_after, {"on_first": open_window})
                else:
                    TimedLoader.hooks_for_next = {"on_first": open_window}
                    run_plain(base, ds, 2, clock, set(), None, device, close_after)
        finally:
            TimedLoader.hooks_for_next = {}
            if hook is not None:
                hook.remove()
        peaks[side] = {"peak": mode.peak, **split}
        models.clear()  # release the model before the next side
        mode = None  # release the counter's references
        gc.collect()
    return peaks


# --- main -------------------------------------------------------------------------------------------


def synthetic_dataset(cfg: RunConfig, samples: int) -> PackedDataset:
    """Random tokens in [0, vocab) cut into `samples` packed samples of data.seq_length."""
    seq = cfg.data.seq_length
    rng = np.random.default_rng(cfg.train.seed)
    dtype = token_dtype(cfg.model.vocab_size)
    tokens = rng.integers(0, cfg.model.vocab_size, size=samples * seq + 1, dtype=np.int64).astype(dtype)
    return PackedDataset(tokens, seq)


def config_dataset(cfg: RunConfig) -> Any:
    """The config's training data through the trainer's own path (prepared shards, cached)."""
    from shardwise.data.build import build_data

    _, ds, _ = build_data(cfg.data, cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.train.seed)
    return ds


def bench_peak_flops(device: torch.device, dtype: torch.dtype, configured: float | None) -> tuple[float, dict]:
    """The MFU denominator: configured, the device table, or on CPU `measured_cpu_flops`.

    On CPU the Trainer reads a value cached on disk by whichever process measured first, possibly
    while the CPU was busy; the bench also measures afresh (2 s, in a throw-away cache) and uses the
    larger of the two, since a peak can only be underestimated by a busy machine.
    """
    if configured or device.type != "cpu":
        return peak_flops(device, dtype, configured), {"source": "configured" if configured else "table"}
    cached = measured_cpu_flops(dtype)
    saved = os.environ.get("SHARDWISE_CACHE")
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-peak-") as tmp:
        os.environ["SHARDWISE_CACHE"] = tmp
        try:
            fresh = measured_cpu_flops(dtype, seconds=2.0)
        finally:
            if saved is None:
                os.environ.pop("SHARDWISE_CACHE", None)
            else:
                os.environ["SHARDWISE_CACHE"] = saved
    return max(cached, fresh), {"source": "measured_cpu_flops", "cached": cached, "fresh": fresh}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per round and side (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (>= 1, default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: run.num_threads)")
    ap.add_argument("--data", choices=["synthetic", "config"], default="synthetic",
                    help="random tokens (default) or the config's data.train_files")
    ap.add_argument("--interleave", choices=["round", "step"], default="round",
                    help="round: each round runs N steps of shardwise, then N of plain (default); step: "
                    "both sides alternate step by step within a round (paired, robust to a shared CPU)")
    ap.add_argument("--no-memory", action="store_true", help="skip the (untimed) memory probe")
    ap.add_argument("--plain-compile", choices=["auto", "on", "off"], default="auto",
                    help="the plain loop under torch.compile(model): on, off, or auto (when shardwise compiles, "
                    "i.e. run.compile resolves to true on this device)")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--warmup, --steps and --rounds must be at least 1 (the first step's end starts the clock)")

    overrides = list(args.overrides)
    if args.threads:
        overrides.append(f"run.num_threads={args.threads}")
    cfg = load_config(args.config, overrides)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    device = resolve_device(cfg.run.device)
    plain_compiled = cfg.compiles(device.type) if args.plain_compile == "auto" else args.plain_compile == "on"
    compile_lines = capture_compile_reports()
    plan = precision_plan(cfg.optimize.mixed_precision, cfg.optimize.level())
    n_steps = args.warmup + args.steps
    tokens_per_step = cfg.global_batch_size() * cfg.data.seq_length
    if args.data == "synthetic":
        ds = synthetic_dataset(cfg, max(cfg.global_batch_size() * (n_steps + 1), 64))
    else:
        ds = config_dataset(cfg)
    peak, peak_note = bench_peak_flops(device, plan.dtype, cfg.train.peak_tflops)
    flops_tok = run_flops(cfg).total  # the trainer's count (frozen weights cost less)
    threads = torch.get_num_threads()
    log(f"{args.config}: {count_parameters(cfg.model) / 1e6:.1f}M params "
        f"({trainable_parameters(cfg) / 1e6:.2f}M trainable), {tokens_per_step} tokens/step, "
        f"{device} ({device_name(device)}), {threads} threads, peak {peak / 1e9:.1f} GFLOP/s, "
        f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} measured) steps per side")

    clock = StepClock(device)
    sync_at = {args.warmup - 1, n_steps - 1}
    rounds: dict[str, list[dict[str, Any]]] = {"shardwise": [], "plain": []}
    cuda_peaks: dict[str, list[float]] = {"shardwise": [], "plain": []}
    metrics_tps: list[float] = []
    loss_diff = 0.0
    t_start = time.perf_counter()
    paired: list[float] = []  # step mode: plain step time / shardwise step time, step by step
    for r in range(args.rounds):
        gc.collect()
        if args.interleave == "step":
            sw_run, plain_run = run_lockstep(cfg, ds, n_steps, clock, sync_at, device, plain_compiled)
            runs = {"shardwise": sw_run, "plain": plain_run}
            paired += [p / w for p, w in zip(plain_run["step_s"][args.warmup:], sw_run["step_s"][args.warmup:])]
        else:
            runs = {}
            for side in ("shardwise", "plain"):
                gc.collect()
                if side == "shardwise":
                    runs[side] = run_shardwise(cfg, ds, n_steps, clock, sync_at, n_steps - 1)
                else:
                    runs[side] = run_plain(cfg, ds, n_steps, clock, sync_at, n_steps - 1, device,
                                           compiled=plain_compiled)
        if args.interleave == "round":  # in step mode the Trainer's own window includes the plain steps
            metrics_tps += [runs["shardwise"]["metrics_tps"][k] for k in range(args.warmup + 1, n_steps + 1)
                            if k in runs["shardwise"]["metrics_tps"]]
        if r == 0:
            plain_first_step = runs["plain"]["step_s"][0]  # the first plain step: with compile, its compile
        for side, run in runs.items():
            s = summarize(run, args.warmup, args.steps, tokens_per_step)
            s["mfu"] = s["tokens_per_s"] * flops_tok / peak if peak and math.isfinite(peak) else None
            rounds[side].append(s)
            if run["cuda_peak"] is not None:
                cuda_peaks[side].append(run["cuda_peak"])
            mfu_text = f"{s['mfu'] * 100:5.1f}%" if s["mfu"] is not None else "  n/a"
            log(f"round {r + 1} {side:9s}: {s['tokens_per_s']:8.1f} tok/s  mfu {mfu_text}  "
                f"step {s['step_s_median']:.3f}s  data {s['data_load_share'] * 100:.2f}%  "
                f"loss {run['losses'][-1]:.4f}")
        loss_diff = max(loss_diff, max(abs(a - b) for a, b in zip(runs["shardwise"]["losses"],
                                                                   runs["plain"]["losses"])))
        del runs
    timed_s = time.perf_counter() - t_start

    mem_peaks = None
    if not args.no_memory:
        log("memory probe: 2 untimed steps per side under a live-tensor counter")
        mem_peaks = probe_memory(cfg, ds, device, clock)

    def side_summary(side: str) -> dict[str, Any]:
        rs = rounds[side]
        tps = [x["tokens_per_s"] for x in rs]
        best_step = min(t for x in rs for t in x["step_s"])
        out: dict[str, Any] = {
            "tokens_per_s_median": round(statistics.median(tps), 2),
            # Contention only ever slows a step down: the fastest step estimates the undisturbed speed.
            "tokens_per_s_best_step": round(tokens_per_step / best_step, 2),
            "round_spread": round(max(tps) / min(tps), 3),
            "mfu_median": round(statistics.median(x["mfu"] for x in rs), 4) if rs[0]["mfu"] is not None else None,
            "step_s_median": round(statistics.median(x["step_s_median"] for x in rs), 4),
            "data_load_share_median": round(statistics.median(x["data_load_share"] for x in rs), 5),
            "peak_tensor_mem_gb": round(mem_peaks[side]["peak"] / 2**30, 3) if mem_peaks else None,
            # the storages live at that peak: parameters (and buffers), gradients, optimizer state, rest
            "peak_split_mib": {k: round(v / 2**20, 1) for k, v in mem_peaks[side].items() if k != "peak"}
            if mem_peaks else None,
            "rounds": [{"tokens_per_s": round(x["tokens_per_s"], 2),
                        "mfu": round(x["mfu"], 4) if x["mfu"] is not None else None,
                        "step_s": x["step_s"], "data_load_share": round(x["data_load_share"], 5)} for x in rs],
        }
        if cuda_peaks[side]:
            out["cuda_max_memory_allocated_gb"] = round(max(cuda_peaks[side]) / 2**30, 3)
        return out

    result = {
        "bench": "train_throughput",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": os.path.basename(args.config),
        "overrides": overrides,
        "model": cfg.model.preset or cfg.model.model_type,
        "params": count_parameters(cfg.model),
        "trainable_params": trainable_parameters(cfg),
        "lora": cfg.lora.model_dump(mode="json") if cfg.lora is not None else None,
        "freeze": cfg.freeze.model_dump(mode="json"),
        "seq_length": cfg.data.seq_length,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": cfg.gradient_accumulation(),
        "tokens_per_step": tokens_per_step,
        "precision": f"{cfg.optimize.mixed_precision}/{plan.level}",
        "data": args.data,
        "device": str(device),
        "device_name": device_name(device),
        "nproc": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "flops_per_token": flops_tok,
        "peak_flops": peak if math.isfinite(peak) else None,
        "peak_flops_source": peak_note,
        "interleave": args.interleave,
        "shardwise_compiled": cfg.compiles(device.type),
        "plain_compiled": plain_compiled,
        # the cold-compile cost: shardwise's own report (first step against the second), the plain loop's
        # first step of the first round (its compile) against its median step
        "shardwise_compile_report": compile_lines,
        "plain_first_step_s": round(plain_first_step, 3) if math.isfinite(plain_first_step) else None,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "shardwise": side_summary("shardwise"),
        "plain": side_summary("plain"),
        "shardwise_metrics_jsonl_tokens_per_s_median": round(statistics.median(metrics_tps), 2)
        if metrics_tps else None,
        "max_abs_loss_diff": loss_diff,
        "timed_phase_s": round(timed_s, 1),
    }
    sw, pl = result["shardwise"], result["plain"]
    result["ratio"] = round(sw["tokens_per_s_median"] / pl["tokens_per_s_median"], 4)
    result["ratio_best_step"] = round(sw["tokens_per_s_best_step"] / pl["tokens_per_s_best_step"], 4)
    if paired:
        result["ratio_paired_step_median"] = round(statistics.median(paired), 4)
    # Rounds of one side that differ by more than 15% mean the CPU was shared while measuring.
    result["disturbed"] = max(sw["round_spread"], pl["round_spread"]) > 1.15
    print(json.dumps(result), flush=True)
    log(f"ratio shardwise/plain = {result['ratio']:.3f} (best step {result['ratio_best_step']:.3f})"
        + ("; rounds disagree by >15%: the CPU was probably shared, re-run" if result["disturbed"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
