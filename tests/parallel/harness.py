"""Helpers for distributed tests: run a function in N forked gloo processes, and a reference loop.

`run_distributed(fn, world_size, *args)` forks `world_size` workers from the test process (a fork
costs far less than a fresh interpreter: `import torch` is already paid), initialises a gloo
process group over `tcp://127.0.0.1:<free port>` with a timeout so that a hang fails, runs
`fn(rank, world_size, *args)` in each, and returns the per-rank results in rank order. A worker's
exception is re-raised in the parent as `WorkerError` naming the rank and carrying its traceback;
the other workers are then terminated. Run many variants inside one `fn` so the launch is paid once.

`tiny_config`, `make_steps`, `build_tiny_model` and `train_loop` give a reference training loop
that every layout shares: fixed token batches, AdamW from `build_optimizer`, and the trainer's loss
normalisation (the SUM of token losses of a rank's micro-batches divided by the GLOBAL number of
target tokens of the step). With `rank`/`world` given, each data-parallel rank takes its contiguous
slice of every micro-batch's rows, so that the union over ranks is exactly the one-process batch.
"""

from __future__ import annotations

import contextlib
import datetime
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

from shardwise.memory.recompute import canonical_name
from shardwise.models.config import ModelConfig
from shardwise.models.transformer import build_model
from shardwise.train.optim import build_optimizer
from shardwise.train.trainer import IGNORE_INDEX, count_target_tokens, token_loss_sum


class WorkerError(RuntimeError):
    """A distributed test worker raised; the message names the rank and holds its traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, pg_timeout: float, args: tuple,
            out: "mp.Queue") -> None:
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


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
                    pg_timeout: float = 90.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` forked gloo workers; return results by rank.

    `fn` and `args` reach the workers through fork (no pickling); the return value is pickled back,
    so return plain data or CPU tensors (not DTensors). Raises WorkerError with the first failing rank's
    traceback, or when the workers do not finish within `timeout` seconds.
    """
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, pg_timeout, args, out), daemon=True)
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


def assert_records_close(got: LoopRecord, ref: LoopRecord, atol: float = 1e-4, label: str = "") -> None:
    """Loss at every step and every parameter's first-step gradient within `atol` (and the same None-ness)."""
    where = f"{label}: " if label else ""
    assert len(got.losses) == len(ref.losses), f"{where}{len(got.losses)} steps vs {len(ref.losses)}"
    for i, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= atol, f"{where}loss at step {i + 1}: {a} vs one process {b}"
    assert set(got.first_grads) == set(ref.first_grads), \
        f"{where}parameter names differ: {sorted(set(got.first_grads) ^ set(ref.first_grads))}"
    for name, ref_grad in ref.first_grads.items():
        grad = got.first_grads[name]
        if ref_grad is None or grad is None:
            assert grad is None and ref_grad is None, f"{where}gradient of {name}: {grad} vs one process {ref_grad}"
            continue
        diff = float((grad - ref_grad).abs().max())
        assert diff <= atol, f"{where}gradient of {name} differs by {diff} (max abs) from one process"
