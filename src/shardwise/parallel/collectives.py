"""The collectives shardwise itself issues: sums and maxima of small numbers, broadcasts and
gathers, point-to-point sends (one at a time, or batched both ways: `exchange`), rank 0 first (and
then the others: waits that poll the job's store, so that work done in turn may outlast the group's
timeout), and the replica check. Gradient reduction and DTensor redistribution happen inside FSDP2 / DTensor,
which place their own tensors.

Every tensor handed to a collective goes through `to_group_device` first: a group serves only the
devices its backends support (gloo: CPU; NCCL: CUDA; HCCL: Ascend NPU, with no CPU side), so a CPU
counter sent over an HCCL-only group would fail at the first step. Where a group has a CPU backend
(gloo, or CUDA's "cuda:nccl,cpu:gloo"), small numbers stay on the CPU: reading them back then
costs no device sync. Counts travel as int64, maxima as float32, checksums as the bits of float64
(int64): dtypes every backend reduces.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ShardwiseError
from .dtensors import local_tensor

T = TypeVar("T")
log = logging.getLogger(__name__)


def _group(mesh: Any) -> Optional[dist.ProcessGroup]:
    """A device mesh's process group (a process group, or None for the default one, as it is)."""
    return mesh.get_group() if hasattr(mesh, "get_group") else mesh


def distributed() -> bool:
    """Whether a process group exists (without one every collective here is the identity)."""
    return dist.is_available() and dist.is_initialized()


def group_device_types(group: Any = None) -> tuple[str, ...]:
    """The device kinds `group`'s backends serve, e.g. ("cpu",) for gloo, ("cuda", "cpu") for
    "cuda:nccl,cpu:gloo", ("npu",) for HCCL."""
    pg = _group(group) or dist.group.WORLD
    kinds = tuple(d.type for d in getattr(pg, "_device_types", ()))
    if kinds:
        return kinds
    backend = str(dist.get_backend(pg)).lower()  # older torch: infer from the backend's name
    return tuple(part.split(":")[0] for part in backend.split(",")) if ":" in backend else \
        {"nccl": ("cuda",), "hccl": ("npu",)}.get(backend, ("cpu",))


def _move(t: torch.Tensor, kind: str) -> torch.Tensor:
    """`t` on this process's current device of `kind` (the accelerator it was bound to)."""
    if kind == "cpu":
        return t.cpu()
    return t.to(torch.device(kind, torch.get_device_module(kind).current_device()))


def to_group_device(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """`t` itself when `group` serves its device, else a copy on a device it serves (CPU first)."""
    kinds = group_device_types(group)
    if t.device.type in kinds:
        return t
    return _move(t, "cpu" if "cpu" in kinds else kinds[0])


def all_reduce(t: torch.Tensor, group: Any = None, op: Any = None) -> torch.Tensor:
    """The reduction (SUM unless `op`) of `t` over `group`, on a device the group serves (`t`
    itself, reduced in place, when it already is)."""
    if not distributed():
        return t
    t = to_group_device(t, group)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=_group(group))
    return t


def broadcast_(t: torch.Tensor, src: int, group: Any = None) -> None:
    """`t` := rank `src`'s `t` (`src` a global rank), in place wherever `t` lives."""
    if not distributed():
        return
    moved = to_group_device(t, group)
    dist.broadcast(moved, src=src, group=_group(group))
    if moved is not t:
        t.copy_(moved)


def all_gather(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and dtype on all), in rank order."""
    if not distributed():
        return [t]
    t = to_group_device(t, group)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(_group(group)))]
    dist.all_gather(out, t, group=_group(group))
    return out


def send(t: torch.Tensor, dst: int, group: Any = None) -> None:
    """Send `t` to global rank `dst`."""
    dist.send(to_group_device(t.contiguous(), group), dst=dst, group=_group(group))


def recv_(t: torch.Tensor, src: int, group: Any = None) -> None:
    """Receive into `t` from global rank `src`, in place wherever `t` lives."""
    moved = to_group_device(t, group)
    dist.recv(moved, src=src, group=_group(group))
    if moved is not t:
        t.copy_(moved)


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             group: Any = None) -> None:
    """Point-to-point sends `(tensor, global dst)` and receives into `(tensor, global src)`, posted
    together as non-blocking operations and waited for. One batch for both directions, so that no
    rank's send waits for a receive its peer posts only later (NCCL sends block until matched);
    several messages between the same two ranks are matched in the order given."""
    if not sends and not recvs:
        return
    pg = _group(group)
    ops, moved_back = [], []
    for t, dst in sends:
        ops.append(dist.P2POp(dist.isend, to_group_device(t.contiguous(), group), dst, pg))
    for t, src in recvs:
        moved = to_group_device(t, group)
        ops.append(dist.P2POp(dist.irecv, moved, src, pg))
        if moved is not t:
            moved_back.append((t, moved))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for t, moved in moved_back:
        t.copy_(moved)


def sum_over(values: Sequence[int], mesh: Any = None) -> list[int]:
    """Element-wise sums of integer counts over the ranks of `mesh` (all ranks when None)."""
    return all_reduce(torch.tensor(list(values), dtype=torch.int64), mesh).tolist()


def max_over(value: float, mesh: Any = None) -> float:
    """The largest `value` over the ranks of `mesh` (all ranks when None), to float32 precision."""
    return float(all_reduce(torch.tensor([value], dtype=torch.float32), mesh, dist.ReduceOp.MAX).item())


def texts_of_ranks(text: str, width: int = 64, group: Any = None) -> list[str]:
    """Every rank's `text` (its first `width` UTF-8 bytes), by rank, for every rank of `group`. No pickle: each
    rank fills its row of a table of character codes, and one sum gives every rank the whole table."""
    if not distributed():
        return [text]
    table = torch.zeros(dist.get_world_size(group), width, dtype=torch.int32)
    codes = list(text.encode("utf-8", "replace"))[:width]
    table[dist.get_rank(group), :len(codes)] = torch.tensor(codes, dtype=torch.int32)
    return [bytes(c for c in row if c).decode("utf-8", "replace") for row in all_reduce(table, group).tolist()]


_MESSAGE_CHARS = 2048


def fail_together(error: Exception | None, group: Any = None, what: str = "the work", verbatim: bool = False,
                  error_class: type[ShardwiseError] = ShardwiseError) -> None:
    """Raise on every rank if any rank failed: its own error where it failed, the first failing rank's
    message elsewhere (`verbatim`: the message as it is, else prefixed with the rank and `what`).

    Every rank of `group` calls it at the same point, so that a failure on one rank stops all of them
    there (none waits in a collective until the timeout), and the user, who reads rank 0's log, sees
    the failing rank's message. No pickle: a flag per rank, then the message as character codes."""
    if not distributed():
        if error is not None:
            raise error
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flags = torch.zeros(world, dtype=torch.int32)
    if error is not None:
        flags[rank] = 1
    failed = [r for r, f in enumerate(all_reduce(flags, group).tolist()) if f]
    if not failed:
        return
    first = failed[0]
    text = torch.zeros(_MESSAGE_CHARS, dtype=torch.int32)
    if rank == first:
        message = str(error) if verbatim else f"{type(error).__name__}: {error}"
        codes = list(message.encode("utf-8", "replace"))[:_MESSAGE_CHARS]
        text[: len(codes)] = torch.tensor(codes, dtype=torch.int32)
    text = all_reduce(text, group, dist.ReduceOp.MAX)
    if error is not None:
        raise error
    message = bytes(c for c in text.tolist() if c).decode("utf-8", "replace")
    if verbatim:
        raise error_class(message)
    raise error_class(f"{what} failed on rank {first} (ranks failing: {failed}): {message}")


def attempt(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, Exception | None]:
    """(fn(...), None), or (None, the exception it raised): for `fail_together`."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - handed to `fail_together`, which raises it again
        return None, e


# --- work done in turn: waits that poll the job's store -------------------------------------------------
#
# Rank 0 may take longer than the process group's timeout (run.timeout_s) for work done once (tokenising a
# big corpus into the shared cache, removing a previous run): the other ranks then wait by polling the
# c10d store (`store.check`, `store.add(key, 0)`: neither blocks), with no collective in flight for the
# timeout to end. Each call gets its own keys: every rank makes these calls in the same order, so the
# n-th call has the same number everywhere; the group's restart count (agreed by its ranks) keeps a
# restarted group off the keys of the attempt before it where a launcher's store outlives the attempt.

_POLL_FIRST_S = 0.005
_POLL_MAX_S = 1.0
PROGRESS_S = 30.0  # a waiting rank logs a line this often
_FAILURE_SEEN_S = 10.0  # how long a failed rank that may host the store waits for the others to read why
_OK = "ok"
_turns = itertools.count()


@dataclass
class _Turn:
    """The store keys of one call: a status per rank ("ok" or "error:<message>"), and counters of the
    ranks done, failed, and having read a failure."""

    store: Any
    base: str
    world: int

    def status_key(self, rank: int) -> str:
        return f"{self.base}/status/{rank}"

    def count(self, name: str, add: int = 0) -> int:
        return int(self.store.add(f"{self.base}/{name}", add))

    def publish(self, rank: int, error: BaseException | None) -> None:
        """This rank's outcome; the status first, so that a rank counted as done has one."""
        self.store.set(self.status_key(rank), _OK if error is None else "error:" + _describe(error))
        if error is not None:
            self.count("failed", 1)
        self.count("done", 1)

    def has_status(self, rank: int) -> bool:
        return bool(self.store.check([self.status_key(rank)]))

    def failure(self, rank: int) -> str | None:
        """Rank `rank`'s error message, or None when it succeeded (its status must be there)."""
        status = self.store.get(self.status_key(rank)).decode("utf-8", "replace")
        return None if status == _OK else status[len("error:"):]

    def first_failure(self) -> tuple[int, str] | None:
        for r in range(self.world):
            message = self.failure(r) if self.has_status(r) else None
            if message is not None:
                return r, message
        return None

    def read_failure(self, counter: str) -> None:
        """Say (on `counter`) that this rank has read a failure and is about to stop."""
        with contextlib.suppress(RuntimeError):
            self.count(counter, 1)

    def let_others_read_the_failure(self, counter: str) -> None:
        """Before rank 0 raises: it may host the store (mpirun, the tests' groups), which goes with its
        process, so it waits (bounded) until the other ranks have read the failure (on `counter`)."""
        deadline = time.monotonic() + _FAILURE_SEEN_S
        with contextlib.suppress(RuntimeError):
            while self.count(counter) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:_MESSAGE_CHARS]


_group_attempt = 0  # the group's restart count, as its ranks agreed (set_group_attempt)


def set_group_attempt(restarts: int) -> None:
    """The restart count that every rank of the group agreed on (`launch.init_distributed`). Not each
    process's own TORCHELASTIC_RESTART_COUNT: a node that was lost and started again counts 0 where the
    others count 1, and the turns' keys must be the same on every rank."""
    global _group_attempt

    _group_attempt = restarts


def _new_turn() -> _Turn:
    store = dist.distributed_c10d._get_default_store()
    return _Turn(store, f"shardwise/turn/{_group_attempt}/{next(_turns)}", dist.get_world_size())


def _wait_until(ready: Callable[[], bool], waiting_for: Callable[[], str], rank: int) -> None:
    """Poll `ready()` until it is true, logging `waiting_for()` every PROGRESS_S seconds. The store going
    away (the rank or agent that hosts it stopped) is a ShardwiseError, not a wait that never ends."""
    start = last = time.monotonic()
    delay = _POLL_FIRST_S
    while True:
        try:
            if ready():
                return
        except RuntimeError as e:  # DistStoreError, or the connection to the store lost
            raise ShardwiseError(
                f"rank {rank} lost the job's store while waiting for {waiting_for()} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}): the process that hosts it (rank 0, or the "
                "launcher's agent) has stopped; rank 0's log says why") from e
        now = time.monotonic()
        if now - last >= PROGRESS_S:
            log.info("rank %d still waiting for %s (%.0f s so far)", rank, waiting_for(), now - start)
            last = now
        time.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)


def _run_catching(fn: Callable[[], T]) -> tuple[Optional[T], BaseException | None]:
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - every rank must learn of it, then this rank raises it again
        return None, e


def _wait_for_rank0(turn: _Turn, rank: int, what: str) -> None:
    """On a rank other than 0: wait for rank 0's outcome; raise, having said so, when it failed."""
    _wait_until(lambda: turn.has_status(0), lambda: f"rank 0 to finish {what}", rank)
    message = turn.failure(0)
    if message is not None:
        turn.read_failure("seen")
        raise ShardwiseError(f"rank 0 failed {what}, so this rank stops too: {message}")


def rank0_first(fn: Callable[[], T], rank: int, what: str = "its part") -> Optional[T]:
    """Run `fn` on rank 0 while the others wait; if it fails there, fail on every rank with its message.

    For work that must happen once (clearing a run directory, preparing data into a shared cache)
    before the other ranks go on; without it a failure on rank 0 would leave the others waiting for
    the whole distributed timeout. The others wait by polling the job's store, not in a collective, so
    the work may take longer than the process group's timeout. Returns `fn()` on rank 0, None elsewhere.
    """
    if not distributed() or dist.get_world_size() == 1:
        return fn()
    turn = _new_turn()
    if rank != 0:
        _wait_for_rank0(turn, rank, what)
        return None
    result, error = _run_catching(fn)
    turn.publish(0, error)
    if error is not None:
        turn.let_others_read_the_failure("seen")
        raise error
    return result


def rank0_then_others(fn: Callable[[], T], rank: int, what: str) -> T:
    """`fn()` on every rank: rank 0 first (it fills a shared cache), then the others (which find it ready,
    or fill their own node's); every rank returns once all have finished, or raises when any failed (the
    failing rank its own error, the others a ShardwiseError naming that rank and its message).

    Every wait polls the job's store with no collective in flight, so `fn` may take longer than the
    process group's timeout (run.timeout_s); rank 0 logs every PROGRESS_S seconds whom it waits for.
    A rank that dies instead of failing is the launcher's to stop the others (torchrun does)."""
    if not distributed() or dist.get_world_size() == 1:
        return fn()
    turn = _new_turn()
    if rank != 0:
        _wait_for_rank0(turn, rank, what)
    result, error = _run_catching(fn)
    turn.publish(rank, error)
    if rank == 0 and error is not None:
        turn.let_others_read_the_failure("seen")
        raise error

    def waiting_for() -> str:
        if rank != 0:
            return f"the other ranks to finish {what} ({turn.count('done')} of {turn.world} done)"
        pending = [r for r in range(turn.world) if not turn.has_status(r)]
        shown = ", ".join(map(str, pending[:8])) + (", ..." if len(pending) > 8 else "")
        return f"rank(s) {shown} to finish {what} ({turn.world - len(pending)} of {turn.world} done)"
    _wait_until(lambda: turn.count("done") >= turn.world or turn.count("failed") > 0, waiting_for, rank)
    failed = turn.first_failure()
    if failed is None:
        return result  # type: ignore[return-value]
    if rank == 0:
        turn.let_others_read_the_failure("seen_all")
    else:
        turn.read_failure("seen_all")
    if error is not None:
        raise error
    raise ShardwiseError(f"{what} failed on rank {failed[0]}, so this rank stops too: {failed[1]}")


def parameter_checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and float64 (sum, sum of squares) of every parameter's local data on this rank."""
    names, sums = [], []
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = local_tensor(p).detach().double()
            names.append(name)
            sums.append(torch.stack([x.sum(), (x * x).sum()]))
    return names, torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)


def replica_mismatch(model: nn.Module, mesh: Any) -> Optional[str]:
    """None when every rank of `mesh` (ranks that hold copies of the same parameters) agrees bit for
    bit; else a message naming the first parameter that differs and the ranks' checksums."""
    if mesh is None or mesh.size() == 1:
        return None
    names, local = parameter_checksums(model)
    # The float64 checksums travel as their bits: exact, and a dtype every backend gathers.
    gathered = [g.cpu().view(torch.float64) for g in all_gather(local.view(torch.int64), mesh)]
    for i, name in enumerate(names):
        values = [g[i].tolist() for g in gathered]
        if any(v != values[0] for v in values[1:]):
            detail = "; ".join(f"rank {r}: sum {v[0]:.9g}, sum of squares {v[1]:.9g}" for r, v in enumerate(values))
            return f"parameter {name} differs between data-parallel replicas ({detail})"
    return None


def replicas_problem(parts: list[nn.Module], meshes: Any, dims: Any, zero_stage: int) -> Optional[str]:
    """None when the ranks that should hold identical parameters do (the replicated copies of ZeRO 0/1,
    or the HSDP replicas of ZeRO 2/3), else a message naming the first parameter that differs."""
    if dims.dp == 1:
        return None
    mesh = meshes["dp"] if zero_stage <= 1 else meshes["dp_replicate"]
    return next(filter(None, (replica_mismatch(part, mesh) for part in parts)), None)
