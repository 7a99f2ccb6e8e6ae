"""Helpers for distributed tests: run a function in N gloo processes, and a reference loop.

`run_distributed(fn, world_size, *args)` starts `world_size` workers through multiprocessing's fork
server: a clean single-threaded process that has imported torch and shardwise once, so that each worker
is a cheap fork of it, never of the test process (whose threads, from tokenizers, OpenMP, checkpoint
writers and earlier tests, a fork would copy mid-work: the likely cause of the heap corruption, "free():
invalid size", that killed a worker in one CI run and never reproduced). `fn` must be a module-level
function and `args` picklable; each worker gets the test's environment variables of the moment, but not
its monkeypatches (patch inside `fn`). It initialises a gloo process group over `tcp://127.0.0.1:<free
port>` with a timeout so that a hang fails, runs `fn(rank, world_size, *args)` in each, and returns the
per-rank results in rank order. A worker's exception is re-raised in the parent as `WorkerError` naming
the rank and carrying its traceback; the other workers are then terminated. Run many variants inside one
`fn` so the launch is paid once.

`tiny_config`, `make_steps`, `build_tiny_model` and `train_loop` give a reference training loop
that every layout shares: fixed token batches, AdamW from `build_optimizer`, and the trainer's loss
normalisation (the SUM of token losses of a rank's micro-batches divided by the GLOBAL number of
target tokens of the step). With `rank`/`world` given, each data-parallel rank takes its contiguous
slice of every micro-batch's rows, so that the union over ranks is exactly the one-process batch.

The strict comparison of a layout with one process (issue 11) is below ("strict parity checks"):
per-tensor relative errors of first-step gradients (`assert_tensors_close`) and of parameters
after plain-SGD steps (`assert_params_close`), relative errors of per-step losses and gradient norms
(`assert_values_close`), and all of them for a `LoopRecord` (`assert_records_close`). Every layout
test uses them; tests/parallel/test_parity_faults.py shows that they fail on realistic faults.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from shardwise.loss import IGNORE_INDEX, count_target_tokens, token_loss_sum
from shardwise.models.config import ModelConfig
from shardwise.models.transformer import build_model
from shardwise.parallel.recompute import canonical_name
from shardwise.train.optim import build_optimizer


class WorkerError(RuntimeError):
    """A distributed test worker raised; the message names the rank and holds its traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, pg_timeout: float, args: tuple,
            out: "mp.Queue", environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test's environment now, not the fork server's at its start
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size),
                       ("LOCAL_WORLD_SIZE", world_size), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
        os.environ[key] = str(value)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        # Plain pickle, not the queue's: torch registers fd-sharing reducers for tensors with
        # multiprocessing, and those fail once the worker has exited ("Connection reset by peer").
        out.put(("ok", rank, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put(("error", rank, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def _workers_context():  # noqa: ANN202 - multiprocessing context
    """The fork server's context; what it preloads is imported once for every worker of the session."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardwise.train.trainer", "tests.parallel.harness"])
    return ctx


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
                    pg_timeout: float = 90.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo workers; return results by rank.

    `fn` (module-level) and `args` are pickled to the workers, and the return value is pickled back,
    so return plain data or CPU tensors (not DTensors). Raises WorkerError with the first failing rank's
    traceback, or when the workers do not finish within `timeout` seconds.
    """
    ctx = _workers_context()
    out = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, pg_timeout, args, out, environ), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"distributed test timed out after {timeout:.0f} s; ranks finished: "
                                  f"{sorted(results)} of {world_size}")
            try:
                status, rank, payload = out.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise WorkerError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                      "before reporting (killed, or crashed in native code)") from None
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        out.close()
    return [results[r] for r in range(world_size)]


# --- the reference training loop ---------------------------------------------------------------------

def tiny_config(**overrides: Any) -> ModelConfig:
    """A model small enough for many distributed variants per second on one CPU core."""
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                max_position_embeddings=64)
    base.update(overrides)
    return ModelConfig(**base)


def build_tiny_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """The model with weights drawn from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    return build_model(cfg)


def make_steps(num_steps: int = 5, micro_batches: int = 1, batch: int = 4, seq: int = 16, vocab: int = 64,
               seed: int = 1234, ignore_fraction: float = 0.2) -> list[list[dict[str, torch.Tensor]]]:
    """Fixed batches: for each step a list of micro-batches {"input_ids", "labels"} of [batch, seq].

    Some labels are IGNORE_INDEX (unevenly over rows) so that per-rank token counts differ and the
    global-token normalisation is really exercised.
    """
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        mbs = []
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            labels = tokens[:, 1:].clone()
            drop = torch.rand(batch, seq, generator=g) < ignore_fraction * torch.linspace(0, 2, batch)[:, None]
            labels[drop] = IGNORE_INDEX
            mbs.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
        steps.append(mbs)
    return steps


def local_rows(mb: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Data-parallel rank `rank`'s contiguous share of a micro-batch's rows."""
    rows = mb["input_ids"].shape[0]
    if rows % world:
        raise ValueError(f"batch of {rows} rows does not split over {world} data-parallel ranks")
    n = rows // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in mb.items()}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain, detached CPU copy of `t` (DTensors gathered with full_tensor())."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def clean_name(name: str) -> str:
    """A parameter name without wrapper prefixes (DDP's `module.`, recompute's wrapper)."""
    name = canonical_name(name)
    return name[len("module."):] if name.startswith("module.") else name


def full_grads(model: torch.nn.Module) -> dict[str, Optional[torch.Tensor]]:
    """Every parameter's full gradient (None where it has none), by clean name."""
    return {clean_name(n): (None if p.grad is None else full_tensor(p.grad)) for n, p in model.named_parameters()}


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, by clean name."""
    return {clean_name(n): full_tensor(p) for n, p in model.named_parameters()}


def make_optimizer(model: torch.nn.Module, lr: float = 1e-2, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW over the trainer's weight-decay groups (frozen parameters are left out)."""
    return build_optimizer(model.named_parameters(), "adamw", lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                           eps=1e-8)


@dataclass
class LoopRecord:
    """What a reference or distributed loop reports: global loss per step, first-step gradients, norms."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    first_grads: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)


def train_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: list[list[dict[str, torch.Tensor]]],
               *, rank: int = 0, world: int = 1, group: Any = None,
               sync: Optional[Callable[[bool], contextlib.AbstractContextManager]] = None,
               clip: Optional[Callable[[Iterable[torch.Tensor]], torch.Tensor]] = None,
               after_backward: Optional[Callable[[int], None]] = None) -> LoopRecord:
    """Train over `steps` as the trainer does; return the global losses and first-step gradients.

    rank/world: this process's data-parallel position (rows of each micro-batch are split);
    group: the data-parallel process group the reported loss is summed over;
    sync(enabled): a context for each micro-batch (enabled only on the last), e.g. grad_sync;
    clip(params): called after backward, returns the gradient norm (default: norm computed, no clip);
    after_backward(step): a hook after the first backward of the loop, e.g. to inspect state.
    """
    record = LoopRecord()
    params = [p for p in model.parameters() if p.requires_grad]
    for step, mbs in enumerate(steps):
        n_tokens = count_target_tokens(mbs)
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            local = local_rows(mb, rank, world)
            ctx = sync(i == len(mbs) - 1) if sync is not None else contextlib.nullcontext()
            with ctx:
                logits = model(local["input_ids"])
                loss = token_loss_sum(logits, local["labels"]) / n_tokens
                loss.backward()
            total += loss.detach()
        if world > 1:
            dist.all_reduce(total, group=group)
        record.losses.append(float(total))
        if step == 0:
            record.first_grads = full_grads(model)
            if after_backward is not None:
                after_backward(step)
        if clip is not None:
            norm = clip(params)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        record.grad_norms.append(float(full_tensor(norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record



# --- strict parity checks ----------------------------------------------------------------------------
#
# Every layout is compared with one process per tensor by the RELATIVE error (float64 norms of the
# whole tensor)
#     ||x - x_ref|| / max(||x_ref||, floor),   floor = FLOOR_FRACTION * sqrt(sum over tensors ||x_ref||^2)
# An absolute tolerance does not work on the test models: many tensors' largest gradient is about 1e-4
# (attention q/k, the norms), so `abs <= 1e-4` lets a gradient half its true size pass.
# The floor is for gradients that are zero in exact arithmetic: GPT-2's key bias (softmax ignores a
# shift shared by all keys; no RoPE rotates it) has a float64 gradient of 1e-19 but an fp32 one of
# ~4e-11 of pure round-off, which differs between layouts by ~100% of itself. FLOOR_FRACTION 3e-5
# of the model's gradient norm (3e-5 x ~3 there) lets that round-off through ~20x over (the
# allowance is rtol x floor ~ 1e-9), while it stays below every real per-tensor gradient norm of the
# test models (the smallest is ~8e-5 of the total: GPT-2's query bias), so no real comparison
# loosens. A reference that is exactly zero (a LoRA A before B moves) must be exactly zero.
#
# Tolerances (fp32), with the worst errors measured over every layout of the parity matrix (issue 11):
#   GRAD_RTOL   first-step gradients, per tensor: DP adds partial sums in another order than one
#               process, TP splits the matmul reductions: measured <= 8.7e-7 (TP, qwen2 k bias),
#               <= 1.8e-7 without TP; 1e-5 leaves >= 10x.
#   PARAM_RTOL  parameters after N plain-SGD steps, per tensor, relative to the reference's UPDATE
#               ||p - p_ref|| / ||p_ref - p_0|| (relative to ||p_ref|| a fault in a small update would
#               vanish: the norm weights move by 3e-5 of themselves in 3 steps), plus the fp32 rounding
#               of p itself, one ulp per element and step (`param_slack`): with gradients equal to the
#               last bits the updated weights may still round apart by an ulp, which is up to 3e-4 of a
#               norm weight's 3-step update (measured 2.7e-4, TP). Measured <= 10% of the allowance.
#   SCALAR_RTOL losses and gradient norms per step (SGD, or AdamW's first step): measured <= 4.6e-7
#               (a gradient norm under TP2 with frozen layers); 5e-6 leaves ~10x. The faults move the
#               loss or norm by >= 2e-4 relative where they show there at all.
# A fault the parity tests must catch changes some tensor by >= ~1e-2 relative (a halved gradient
# by 0.5); the tolerances sit three or more orders of magnitude below that.

GRAD_RTOL = 1e-5
PARAM_RTOL = 1e-5
SCALAR_RTOL = 5e-6
FLOOR_FRACTION = 3e-5
NORM_FLOOR = 1e-30  # the floor's floor: a model whose every gradient is zero
_FP32_EPS = float(torch.finfo(torch.float32).eps)


class ParityError(AssertionError):
    """A layout differs from one process by more than the strict tolerance (message: what, where, how much)."""


def _log_measurement(label: str, what: str, worst: float, where: str, used: float) -> None:
    """Append the worst error of a comparison, and the largest fraction of its tolerance used, to
    $SHARDWISE_PARITY_LOG (JSON lines) when it is set: how the tolerances were measured, and how to
    measure them again (SHARDWISE_PARITY_LOG=/tmp/parity.jsonl pytest tests/parallel/...)."""
    path = os.environ.get("SHARDWISE_PARITY_LOG")
    if path:
        import json

        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"label": label, "what": what, "worst": worst, "where": where, "used": used}) + "\n")


def _norm(t: torch.Tensor) -> float:
    return float(full_tensor(t).double().norm())


def relative_error(got: torch.Tensor, ref: torch.Tensor, floor: float = NORM_FLOOR,
                   scale: Optional[float] = None) -> float:
    """||got - ref|| / max(scale or ||ref||, floor), in float64 (DTensors gathered first)."""
    a, b = full_tensor(got).double(), full_tensor(ref).double()
    if a.shape != b.shape:
        raise ParityError(f"shape {tuple(a.shape)} vs one process {tuple(b.shape)}")
    denom = float(b.norm()) if scale is None else scale
    return float((a - b).norm()) / max(denom, floor)


def assert_tensors_close(got: dict[str, Optional[torch.Tensor]], ref: dict[str, Optional[torch.Tensor]], *,
                         rtol: float = GRAD_RTOL, what: str = "gradient", label: str = "",
                         scales: Optional[dict[str, float]] = None, slack: Optional[dict[str, float]] = None,
                         floor_fraction: float = FLOOR_FRACTION, total: Optional[float] = None) -> float:
    """Every tensor of `ref` within `rtol` relative error of `got`'s (same names, shapes and None-ness;
    an all-zero reference must be all zero).

    scales: per-name denominators instead of ||ref|| (e.g. the norm of the reference's update);
    slack: per-name absolute allowance added to rtol * denominator (e.g. fp32 rounding of a parameter);
    total: the norm the floor is a fraction of (default: over `ref`'s tensors, or the scales; give the
    whole model's when `ref` is a part of it).
    Returns the worst relative error; raises ParityError naming every tensor over the tolerance.
    """
    where = f"{label}: " if label else ""
    if set(got) != set(ref):
        raise ParityError(f"{where}{what} names differ from one process: missing {sorted(set(ref) - set(got))}, "
                          f"extra {sorted(set(got) - set(ref))}")
    denoms = {n: (_norm(r) if scales is None else scales[n]) for n, r in ref.items() if r is not None}
    if total is None:
        total = math.sqrt(sum(d * d for d in denoms.values()))
    floor = max(floor_fraction * total, NORM_FLOOR)
    worst, worst_name, used, bad = 0.0, "", 0.0, []
    for name, r in ref.items():
        g = got[name]
        if r is None or g is None:
            if not (r is None and g is None):
                bad.append(f"{name}: {'no' if g is None else 'a'} {what} vs one process's "
                           f"{'none' if r is None else 'tensor'}")
            continue
        if scales is None and not bool(full_tensor(r).any()):
            if bool(full_tensor(g).any()):
                bad.append(f"{name}: {what} is zero in one process but not here (norm {_norm(g):.3g})")
            continue
        err = relative_error(g, r, floor, denoms[name])
        allowed = rtol + (slack or {}).get(name, 0.0) / max(denoms[name], floor)
        if err > worst:
            worst, worst_name = err, name
        used = max(used, err / allowed)
        if not err <= allowed:  # `not <=`: a NaN fails
            bad.append(f"{name}: relative error {err:.3g} > {allowed:.3g} (||ref|| {_norm(r):.3g})")
    _log_measurement(label, what, worst, worst_name, used)
    if bad:
        raise ParityError(f"{where}{len(bad)} {what} tensor(s) differ from one process:\n  " + "\n  ".join(bad))
    return worst


def assert_values_close(got: list[float], ref: list[float], *, rtol: float = SCALAR_RTOL, what: str = "loss",
                        label: str = "") -> float:
    """Per-step scalars (loss, gradient norm) within `rtol` relative error; returns the worst."""
    where = f"{label}: " if label else ""
    if len(got) != len(ref):
        raise ParityError(f"{where}{len(got)} {what} values vs one process's {len(ref)}")
    errs = [abs(a - b) / max(abs(b), NORM_FLOOR) for a, b in zip(got, ref)]
    worst = max(errs, default=0.0)
    _log_measurement(label, what, worst, f"step {errs.index(worst) + 1}" if errs else "", worst / rtol)
    bad = [f"step {i + 1}: {a!r} vs {b!r} (relative {e:.3g})" for i, (a, b, e) in enumerate(zip(got, ref, errs))
           if not e <= rtol]  # `not <=`: a NaN fails
    if bad:
        raise ParityError(f"{where}{what} differs from one process beyond {rtol:g}: " + "; ".join(bad))
    return worst


def param_slack(ref: dict[str, torch.Tensor], steps: int) -> dict[str, float]:
    """The fp32 rounding a parameter may pick up per optimizer step (one ulp of each element, as a
    norm: <= eps * ||p||) when two layouts' gradients differ in the last bits: `steps` of them."""
    return {n: steps * _FP32_EPS * float(p.double().norm()) for n, p in ref.items() if p is not None}


def assert_params_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                        steps: int, *, rtol: float = PARAM_RTOL, label: str = "",
                        total: Optional[float] = None) -> float:
    """Parameters after `steps` optimizer steps: per tensor ||p - p_ref|| within rtol of the
    reference's update ||p_ref - p_initial|| plus `steps` fp32 roundings of p (`param_slack`): the
    update itself must match, not just the (much larger) weights. A tensor the reference did not
    move (frozen) must be bitwise unchanged. total: the whole model's update norm (for the floor),
    when `ref` holds part of the model. Returns the worst relative error of the updates."""
    where = f"{label}: " if label else ""
    if set(got) != set(ref):
        raise ParityError(f"{where}parameter names differ from one process: missing {sorted(set(ref) - set(got))}, "
                          f"extra {sorted(set(got) - set(ref))}")
    scales = {n: float((ref[n].double() - initial[n].double()).norm()) for n in ref}
    moved = [n for n in ref if not torch.equal(full_tensor(got[n]), ref[n])]
    frozen_moved = [n for n in moved if scales[n] == 0.0]
    if frozen_moved:
        raise ParityError(f"{where}{frozen_moved} did not move in one process (frozen) but changed here")
    moving = {n: ref[n] for n in ref if scales[n] > 0.0}
    return assert_tensors_close({n: got[n] for n in moving}, moving, rtol=rtol, what="parameter update",
                                label=label, scales=scales, slack=param_slack(moving, steps), total=total)


def update_norm(params: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    """The norm of the whole update params - initial (over every tensor)."""
    return math.sqrt(sum(float((p.double() - initial[n].double()).norm()) ** 2 for n, p in params.items()))


def grad_norm_of(grads: dict[str, Optional[torch.Tensor]]) -> float:
    """The norm over every gradient of `grads` (None skipped)."""
    return math.sqrt(sum(_norm(g) ** 2 for g in grads.values() if g is not None))


def assert_records_close(got: LoopRecord, ref: LoopRecord, label: str = "", *, grad_rtol: float = GRAD_RTOL,
                         loss_rtol: float = SCALAR_RTOL, norm_rtol: Optional[float] = SCALAR_RTOL) -> dict[str, float]:
    """Loss and gradient norm at every step and every parameter's first-step gradient, strictly
    (relative errors, see the tolerances above). norm_rtol None skips the norms. Returns the worst errors."""
    out = {"loss": assert_values_close(got.losses, ref.losses, rtol=loss_rtol, what="loss", label=label),
           "grad": assert_tensors_close(got.first_grads, ref.first_grads, rtol=grad_rtol, label=label)}
    if norm_rtol is not None:
        out["grad_norm"] = assert_values_close(got.grad_norms, ref.grad_norms, rtol=norm_rtol, what="grad norm",
                                               label=label)
    return out
