"""The one place where processes are started and a device kind becomes a torch device and a backend.

Two halves:

* **Inside a rank** - `init_distributed` reads what the launcher left in the environment (torchrun:
  RANK / WORLD_SIZE / LOCAL_RANK with MASTER_ADDR / MASTER_PORT; mpirun: Open MPI's
  OMPI_COMM_WORLD_*, MPICH / Intel MPI's PMI_RANK / PMI_SIZE / MPI_LOCALRANKID, or PMIx's PMIX_RANK),
  picks this rank's device (`resolve_device`) and backend (`backend_for`: CUDA -> NCCL, Ascend NPU ->
  HCCL, CPU -> gloo) and joins the process group with a timeout, so that no collective waits forever.
  A process started without a launcher is world 1 and joins no group (except the one-process group
  `join_one_process_group` makes for optimize.offload_params on one device, FSDP2's CPU offload).
* **Starting ranks** - `launch_processes` runs the command in N processes per node through torchrun's
  own machinery (`torch.distributed.run`): the elastic agent stops the other ranks when one fails,
  restarts the group up to `max_restarts` times, and the failing rank's error is printed.

mpirun does not tell the ranks where rank 0 listens: export MASTER_ADDR (the host of rank 0) and
MASTER_PORT (a free TCP port there) and pass them to every rank, e.g.
``mpirun -n 8 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 shardwise train cfg.yaml`` (Open MPI) or
``mpiexec -n 8 -genv MASTER_ADDR node0 -genv MASTER_PORT 29500 shardwise train cfg.yaml`` (MPICH,
Intel MPI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import logging
import os
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)

from ..errors import ConfigError, DeviceError
from .collectives import all_reduce, set_group_attempt, texts_of_ranks

log = logging.getLogger(__name__)

_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}

#: `shardwise train` options that concern starting processes; `strip_launch_args` removes them from
#: the command line the ranks get (each takes a value).
LAUNCH_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint",
                "--rdzv-timeout", "--local-addr", "--max-restarts")

#: The signals on which torchrun's agent stops the ranks at once (SIGTERM and SIGUSR1 are passed on to them).
AGENT_STOP_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"

_OWN_GROUP = False  # whether init_distributed created the current process group
_GROUP_RESTARTS = 0  # the restart count its ranks agreed on

MPI_HINT = ("with mpirun, export MASTER_ADDR (the host of rank 0) and MASTER_PORT (a free TCP port on it) "
            "to every rank, e.g. `mpirun -n 2 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 shardwise train "
            "cfg.yaml` (Open MPI) or `mpiexec -n 2 -genv MASTER_ADDR node0 -genv MASTER_PORT 29500 "
            "shardwise train cfg.yaml` (MPICH, Intel MPI); on one machine MASTER_ADDR=127.0.0.1")


def npu_available() -> bool:
    """True when torch_npu is installed and sees an Ascend device (imported only when asked)."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present, else CPU (torch_npu is imported only for run.device: npu)."""
    if kind == "auto":
        if torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "run.device is cuda but no CUDA device is visible (torch.cuda.is_available() is False); "
                "set run.device: cpu (or device_target: CPU), or run where a GPU and a CUDA build of torch are"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "npu":
        if not npu_available():
            raise DeviceError(
                "run.device is npu (device_target: Ascend) but torch_npu is not installed or sees no "
                "Ascend device; install torch_npu on an Ascend machine, or select another device with "
                "run.device: cpu | cuda | auto (seed files: device_target: CPU or GPU), e.g. "
                "--set run.device=cpu"
            )
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective backend for a device: NCCL, HCCL or gloo."""
    return _BACKENDS[device.type]


# --------------------------------------------------------------------------------------------------
# Inside a rank: what the launcher says, and joining the group
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process stands, as its launcher's environment variables say."""

    launcher: str  # "torchrun", "openmpi", "pmi" (MPICH / Intel MPI / Hydra) or "pmix"
    rank: int
    world_size: int
    local_rank: int | None  # None: the launcher did not say
    local_world_size: int | None


def _env_int(name: str, env: dict[str, str]) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; the launcher sets it to "
                          f"this process's number (unset it when starting shardwise without a launcher)") from None


def _first(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = _env_int(name, env)
        if value is not None:
            return value
    return None


def launch_env(env: dict[str, str] | None = None) -> LaunchEnv | None:
    """The launcher's view of this process, or None when no launcher started it.

    torchrun's variables win over MPI's (torchrun started inside an MPI job sets its own).
    """
    env = os.environ if env is None else env
    found: LaunchEnv | None = None
    if "RANK" in env and "WORLD_SIZE" in env:
        found = LaunchEnv("torchrun", _env_int("RANK", env), _env_int("WORLD_SIZE", env),
                          _env_int("LOCAL_RANK", env), _env_int("LOCAL_WORLD_SIZE", env))
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        found = LaunchEnv("openmpi", _env_int("OMPI_COMM_WORLD_RANK", env), _env_int("OMPI_COMM_WORLD_SIZE", env),
                          _env_int("OMPI_COMM_WORLD_LOCAL_RANK", env), _env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env))
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        found = LaunchEnv("pmi", _env_int("PMI_RANK", env), _env_int("PMI_SIZE", env),
                          _first(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
                          _first(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"))
    elif "PMIX_RANK" in env:
        # PMIx exports no world size; Slurm's srun --mpi=pmix does (SLURM_NTASKS), else the user.
        size = _first(env, "WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")
        if size is None:
            raise ConfigError("PMIX_RANK is set (a PMIx launcher started this process) but no variable gives the "
                              "number of processes; export WORLD_SIZE=N to every rank (and LOCAL_RANK per rank "
                              "on machines with several accelerators)")
        found = LaunchEnv("pmix", _env_int("PMIX_RANK", env), size,
                          _first(env, "LOCAL_RANK", "SLURM_LOCALID"), _first(env, "LOCAL_WORLD_SIZE"))
    if found is None:
        return None
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise ConfigError(f"{found.launcher} environment gives rank {found.rank} of world size {found.world_size}; "
                          "the rank must lie in [0, world size)")
    return found


def restart_count() -> int:
    """How many times the elastic agent has restarted this group (0 on the first attempt)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", os.environ) or 0


def was_restarted() -> bool:
    """True when torchrun's agent restarted this process after a failure: resume from the newest checkpoint.

    This process's view only; with several nodes use `DistContext.restart_count` (agreed by all ranks).
    """
    return restart_count() > 0


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run: its rank, device and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # the backend of `device`: nccl, hccl or gloo
    local_world_size: int = 1
    launcher: str | None = None  # None: a single process started without a launcher
    restart_count: int = 0  # restarts of the group by torchrun's agent (the same on every rank)

    @property
    def distributed(self) -> bool:
        """Whether a process group spans more than this process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes single-writer files."""
        return self.rank == 0


def _master_address(launcher: str) -> None:
    """Check MASTER_ADDR / MASTER_PORT, which torchrun sets and mpirun users must export."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        by = "mpirun" if launcher in ("openmpi", "pmi", "pmix") else launcher
        raise ConfigError(f"started by {by} ({launcher} environment) but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: the ranks cannot find rank 0; "
                          + (MPI_HINT if by == "mpirun" else "export MASTER_ADDR and MASTER_PORT"))
    port = os.environ["MASTER_PORT"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"MASTER_PORT={port!r} is not a TCP port (1-65535); give a free port on MASTER_ADDR")


def _local_rank(found: LaunchEnv, kind: str) -> int:
    if found.local_rank is not None:
        return found.local_rank
    if found.local_world_size:
        return found.rank % found.local_world_size
    if found.world_size > 1 and kind in ("cuda", "auto") and torch.cuda.is_available():
        guess = found.rank % torch.cuda.device_count()
        log.warning("the launcher gives no local rank; using rank %% device count = %d (export LOCAL_RANK to "
                    "choose)", guess)
        return guess
    return 0 if found.world_size == 1 else found.rank


def init_distributed(device_kind: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the run's process group as the launcher's environment describes and pick this rank's device.

    torchrun (or `launch_processes`) and mpirun are recognised; with mpirun, MASTER_ADDR and
    MASTER_PORT must be exported by the user. Without a launcher, or with a world of 1, no group is
    created. `timeout_s` bounds every wait on other ranks (rendezvous and collectives), so that a
    rank that died or hangs makes the others fail instead of waiting forever. Calling it again when
    the group exists returns the same context.
    """

    global _OWN_GROUP, _GROUP_RESTARTS

    if timeout_s <= 0:
        raise ConfigError(f"distributed timeout {timeout_s} s: give a positive number of seconds")
    found = launch_env()
    restarts = restart_count()
    if dist.is_available() and dist.is_initialized():
        return _context_of_existing_group(device_kind, found, _GROUP_RESTARTS if _OWN_GROUP else restarts)
    if found is None or found.world_size == 1:
        local_rank = 0 if found is None else _local_rank(found, device_kind)
        device = resolve_device(device_kind, local_rank)
        return DistContext(rank=0, world_size=1, local_rank=local_rank, device=device, backend=backend_for(device),
                           launcher=None if found is None else found.launcher, restart_count=restarts)
    local_rank = _local_rank(found, device_kind)
    device = resolve_device(device_kind, local_rank)
    backend = backend_for(device)
    ctx = DistContext(rank=found.rank, world_size=found.world_size, local_rank=local_rank, device=device,
                      backend=backend, local_world_size=found.local_world_size or 1, launcher=found.launcher,
                      restart_count=restarts)
    _master_address(found.launcher)
    # Code below torch (device meshes, DCP, data loaders) reads these; mpirun does not set them.
    for name, value in (("RANK", ctx.rank), ("WORLD_SIZE", ctx.world_size), ("LOCAL_RANK", ctx.local_rank),
                        ("LOCAL_WORLD_SIZE", ctx.local_world_size)):
        os.environ.setdefault(name, str(value))
    kwargs = {}
    pg_backend = backend
    if device.type == "cuda":
        # gloo next to NCCL serves collectives on CPU tensors (metrics, offloaded state, async DCP);
        # device_id binds the NCCL communicator to this rank's GPU at once.
        pg_backend = "cuda:nccl,cpu:gloo"
        kwargs["device_id"] = device
    log.debug("rank %d/%d (%s, local rank %d): joining %s group at %s:%s", ctx.rank, ctx.world_size, ctx.launcher,
              ctx.local_rank, pg_backend, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    try:
        dist.init_process_group(backend=pg_backend, init_method="env://", rank=ctx.rank, world_size=ctx.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError subclass RuntimeError
        raise RuntimeError(f"rank {ctx.rank}/{ctx.world_size}: could not join the {pg_backend} process group at "
                           f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']} within "
                           f"{timeout_s:g} s (are all ranks started, is the address reachable and the port free "
                           f"on rank 0?): {e}") from e
    _OWN_GROUP = True
    if restarts or _env_int("TORCHELASTIC_MAX_RESTARTS", os.environ):
        # Each node's agent counts its own restarts, and an agent whose ranks did not fail restarts
        # them without counting: the group's count is the largest, so that every rank agrees on
        # "this is a restart, resume from the newest checkpoint".
        count = all_reduce(torch.tensor([restarts], dtype=torch.int64), op=dist.ReduceOp.MAX)
        ctx = dataclasses.replace(ctx, restart_count=int(count.item()))
    _GROUP_RESTARTS = ctx.restart_count
    set_group_attempt(ctx.restart_count)
    _record_nodes(ctx)
    return ctx


@dataclass(frozen=True)
class NodeOfRank:
    """Where one rank runs, as it said when the group formed: to name a node that is lost later."""

    node: str  # torchrun's node rank (GROUP_RANK), else the host name
    host: str
    address: str | None  # the address its traffic to rank 0 leaves from


_NODES: list[NodeOfRank] = []  # by rank, filled by init_distributed

# A collective's peer went away: gloo names its address, NCCL and the store say less.
_PEER_GONE = re.compile(r"(?:Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"failed to recv|Connection refused|Timed out waiting|timed out|NCCL communicator was aborted|"
                        r"remote process exited)", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"peer \[?([0-9a-fA-F.:]+?)\]?:\d+")


def _record_nodes(ctx: DistContext) -> None:
    """Every rank tells the others its node, host and address (one small collective when the group forms)."""
    global _NODES

    address = route_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) or ""
    me = "\t".join((os.environ.get("GROUP_RANK") or socket.gethostname(), socket.gethostname(), address))
    _NODES = []
    for row in texts_of_ranks(me, width=192):
        node, host, address = (row.split("\t") + ["", ""])[:3]
        _NODES.append(NodeOfRank(node=node, host=host, address=address or None))


def _rank_span(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def lost_node_message(error: BaseException, rank: int) -> str | None:
    """When `error` says a collective's peer went away, which node that was and what happens next; else None.

    gloo names the peer's address: the node with that address is named (when it is this rank's own
    node, a rank here stopped first, and the launcher reports which). Other backends' errors name no
    peer: the message then says only that a peer was lost."""
    text = str(error)
    if not _NODES or not _PEER_GONE.search(text):
        return None
    me = _NODES[rank]
    found = _PEER_ADDRESS.search(text)
    lost = [r for r, n in enumerate(_NODES) if found and n.address == found.group(1)]
    after = ("without --max-restarts the job stops here; with --max-restarts K the group re-forms when every node "
             "is back and resumes from the newest checkpoint (--resume auto does the same by hand)")
    if lost and _NODES[lost[0]].node != me.node:
        node = _NODES[lost[0]]
        return (f"rank {rank} (node {me.node}, {me.host}) lost contact with node {node.node} (host {node.host}, "
                f"address {node.address}, {_rank_span(lost)}): its processes stopped answering (killed, crashed, "
                f"or the machine or network went down); {after}. ({text.splitlines()[0][:300]})")
    others = sorted({n.node for n in _NODES} - {me.node})
    suspects = f"node(s) {', '.join(others)}" if others else "another rank"
    return (f"rank {rank} (node {me.node}, {me.host}) lost a peer during a collective: a rank of this node or of "
            f"{suspects} stopped answering; {after}. ({text.splitlines()[0][:300]})")


def join_one_process_group(ctx: DistContext, timeout_s: float = 600.0) -> None:
    """Make a process group of this one process (world size 1) on `ctx`'s device, through an in-process
    store: no address, no port, no network. FSDP2 needs a group and a device mesh even alone, and
    `optimize.offload_params` on one device is FSDP2's CPU offload. No-op when a group exists already;
    `shutdown` destroys the one made here."""
    global _OWN_GROUP

    if ctx.world_size != 1:
        raise ValueError(f"a one-process group is for a world of 1, not rank {ctx.rank} of {ctx.world_size}")
    if dist.is_initialized():
        return
    kwargs = {}
    backend = ctx.backend
    if ctx.device.type == "cuda":
        backend, kwargs["device_id"] = "cuda:nccl,cpu:gloo", ctx.device  # as init_distributed's groups
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    _OWN_GROUP = True
    log.debug("one-process %s group on %s (FSDP2 on one device)", backend, ctx.device)


def _context_of_existing_group(device_kind: str, found: LaunchEnv | None, restarts: int) -> DistContext:
    """The context of a group made before (by an earlier call, or by a test harness or caller)."""

    rank, world = dist.get_rank(), dist.get_world_size()
    if found is not None and (found.rank, found.world_size) != (rank, world):
        raise RuntimeError(f"a process group (rank {rank} of {world}) exists that does not match the "
                           f"{found.launcher} environment's rank {found.rank} of {found.world_size}")
    local_rank = _local_rank(found, device_kind) if found is not None else rank
    device = resolve_device(device_kind, local_rank)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device,
                       backend=backend_for(device),
                       local_world_size=(found.local_world_size if found is not None else None) or 1,
                       launcher=None if found is None else found.launcher, restart_count=restarts)


def shutdown(force: bool = False) -> None:
    """Destroy the process group that `init_distributed` created (any group with `force`); no-op without one.

    A group made by someone else (a test harness, a caller's script) is theirs to destroy. No barrier
    first: a failed peer must not make this hang.
    """
    global _OWN_GROUP

    if dist.is_available() and dist.is_initialized() and (_OWN_GROUP or force):
        dist.destroy_process_group()
    _OWN_GROUP = False


def record_failure(exc: BaseException) -> None:
    """Write `exc` to the elastic agent's error file (only under torchrun / `launch_processes`).

    For errors that the entry point catches itself (so `@record` never sees them), e.g. a
    ShardwiseError printed as a one-line message: the launcher then reports that message as the
    rank's error. Call it inside the `except` block.
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return

    try:
        get_error_handler().record_exception(exc)
    except OSError as e:  # reporting must never mask the error itself
        log.debug("could not write the elastic error file: %s", e)


# --------------------------------------------------------------------------------------------------
# Starting ranks
# --------------------------------------------------------------------------------------------------


def strip_launch_args(argv: list[str], flags: tuple[str, ...] = LAUNCH_FLAGS) -> list[str]:
    """`argv` without the launch options (`--nproc 2`, `--nproc=2`, ... each with its value)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--":
            out.append(arg)
            continue
        if arg in flags:
            skip = True
            continue
        if arg.startswith("--") and "=" in arg and arg.split("=", 1)[0] in flags:
            continue
        out.append(arg)
    return out


def check_local_devices(device_kind: str, nproc: int) -> None:
    """Refuse more processes per node than accelerators (for CUDA / NPU) before anything starts."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give a device count of at least 1")
    kind = device_kind
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        count = torch.cuda.device_count()
        name = "CUDA GPUs"
    elif kind == "npu":
        if not npu_available():
            resolve_device("npu")  # raises the torch_npu message
        count = torch.npu.device_count()
        name = "Ascend NPUs"
    else:
        return
    if nproc > count:
        raise DeviceError(f"--nproc {nproc} but this machine has {count} {name}; give --nproc {count} or fewer "
                          f"(one process per device)" + (", or run on CPU with --set run.device=cpu" if count == 0
                                                          else ""))


def default_omp_threads(nproc: int) -> int:
    """Threads per rank that do not oversubscribe this machine's cores: cores // processes (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nproc))


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else (code or 1)


def _failure_text(failure) -> str:  # noqa: ANN001 - ProcessFailure
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message") or message.get("extraInfo", {}).get("py_callstack", "")
    if not message or message.startswith("To enable traceback"):
        message = "no error message recorded (see the rank's output above)"
    return str(message).strip()


def _root_cause(failures: dict) -> int:  # noqa: ANN001 - {rank: ProcessFailure}
    """The rank that failed first. torch orders by whole-second timestamps (ties go to the lowest rank).
    Here ranks ended by SIGTERM, which the agent sends to the survivors of another rank's failure, are
    passed over. Within one second, a rank that recorded a Python error comes before a rank that a signal
    ended with no error file (one that aborted when its peer vanished, say; torch knows only the second in
    which the agent saw it), then the earlier error file, then the lower rank."""

    def order(rank: int) -> tuple:
        failure = failures[rank]
        try:
            recorded = os.path.getmtime(failure.error_file)
        except OSError:  # no error file (killed, or exited without @record / record_failure)
            return int(failure.timestamp), 1, float(failure.timestamp), rank
        return int(recorded), 0, recorded, rank

    candidates = [r for r, f in failures.items() if f.exitcode != -signal.SIGTERM] or list(failures)
    return min(candidates, key=order)


def _child_pids() -> list[int]:
    """This process's direct children (the agent's ranks), from /proc; none where there is no /proc."""
    me, children = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[1]) == me:
            children.append(int(name))
    return children


@contextlib.contextmanager
def _forward_stop_signals():  # noqa: ANN202 - a context manager
    """While torchrun's agent runs in this process: SIGTERM and SIGUSR1 are passed on to the ranks, which
    finish their step, save a checkpoint together and exit 0 (train.stop_signals); the agent goes on
    monitoring them and returns success. (Left to torch, SIGTERM would stop the ranks without a checkpoint,
    and SIGUSR1 would end the agent and leave the ranks running: launch_processes gives torchrun
    --signals-to-handle without SIGTERM.) With no rank running (rendezvous) the agent stops as torch's handler
    would. Each rank leads its own session, so it gets the signal only from here (or the scheduler)."""

    def forward(signum: int, frame: object) -> None:
        ranks = _child_pids()
        if not ranks:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        log.warning("%s: passed on to the ranks (pids %s); they stop after the current step with a checkpoint",
                    signal.Signals(signum).name, " ".join(map(str, ranks)))
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # Python installs signal handlers from the main thread only
        return
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _nnodes_range(nnodes: int | str) -> tuple[int, int]:
    text = str(nnodes)
    try:
        low, _, high = text.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        lo = hi = 0
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes {text}: give a node count N (at least 1), or MIN:MAX with --rdzv-endpoint")
    return lo, hi


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT of --rdzv-endpoint as (host, port), or a ConfigError saying how to write it."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")  # [::1]:29400
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT, the address of the first node and a free "
                          "TCP port on it, e.g. node0:29400")
    return host, int(port)


def can_listen_on(host: str, port: int) -> bool:
    """Whether this machine could listen on host:port now: `host` is one of its addresses and the port is free.

    Decides which node hosts the c10d rendezvous store: torch matches host names, which fails where a
    node's name does not resolve to the endpoint's address (containers, network namespaces)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
                return True
            except OSError:
                continue
    return False


def route_address(host: str, port: int) -> str | None:
    """The address of this machine that traffic to host:port leaves from (a UDP `connect` sends nothing),
    or None when there is no route. Other nodes reach this node by it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def _rendezvous_failure(e: RendezvousError, where: str, nnodes: int | str, timeout_s: int | None) -> str:
    """What went wrong when the nodes could not (re)form the group, and what to do."""
    if isinstance(e, RendezvousTimeoutError):
        waited = f"{timeout_s} s" if timeout_s is not None else "600 s (torch's default)"
        return (f"not all of the {nnodes} node(s) joined the rendezvous at {where} within {waited}: start "
                f"`shardwise train ... --nnodes {nnodes} --rdzv-endpoint {where}` on every node; a node that "
                f"comes back later than that finds the job gone (raise --rdzv-timeout to wait longer)"
                + (f" ({e})" if str(e) else ""))
    if isinstance(e, RendezvousConnectionError):
        return (f"cannot reach the rendezvous at {where}: the node with that address has not started "
                f"`shardwise train` yet, or it has stopped (it gave up waiting, or the job ended); check the "
                f"address and port, and start that node first ({e.__cause__ or e})")
    if isinstance(e, RendezvousClosedError):
        return (f"the rendezvous at {where} is closed: the job it belonged to ended or gave up; start every node "
                f"again to begin a new job (--resume auto continues from the newest checkpoint)")
    return f"the nodes could not form a group at {where}: {type(e).__name__}: {e}"


def launch_processes(
    argv: list[str],
    nproc: int,
    nnodes: int | str = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    *,
    module: str = "shardwise.cli",
    run_id: str = "shardwise",
    monitor_interval_s: float = 0.1,
    join_timeout_s: int | None = None,
    stop_timeout_s: int | None = None,
    omp_threads: int | None = None,
    local_addr: str | None = None,
) -> int:
    """Run `python -m MODULE *argv` in `nproc` processes on this node through torchrun; return the exit code.

    `argv` must not hold the launch options (see `strip_launch_args`), or each rank would launch again.
    One node: a free port on this machine is found by itself (unless `master_port` is given).
    Several nodes: run the same command on each node with its `node_rank`, and either
    `master_addr`/`master_port` (rank 0's node; static rendezvous) or `rdzv_endpoint` HOST:PORT (c10d
    rendezvous; `nnodes` may then be "MIN:MAX" and node ranks are assigned by the rendezvous).
    When a rank fails, the agent stops the others (SIGTERM, SIGKILL after `stop_timeout_s`, default
    30 s), prints the failing rank's error and - while restarts are left (`max_restarts`) - starts
    the whole group again; a restarted rank sees TORCHELASTIC_RESTART_COUNT > 0 (`was_restarted`).
    `join_timeout_s` bounds the wait for the other nodes (torch's default 600 s). OMP_NUM_THREADS,
    when unset, becomes cores // nproc for each rank (`omp_threads` overrides). `local_addr`: the
    address other nodes reach this node by, when its host name does not resolve to it (torchrun's
    --local-addr; used for rank 0's store when restarts are on).
    Returns 0, or the failing rank's exit code (128 + signal when it was killed).
    """

    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give a process count of at least 1")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: give 0 or more")
    if node_rank < 0:
        raise ConfigError(f"--node-rank {node_rank}: give 0 or more")
    min_nodes, max_nodes = _nnodes_range(nnodes)
    multi_node = max_nodes > 1
    if min_nodes != max_nodes and not rdzv_endpoint:
        raise ConfigError(f"--nnodes {nnodes}: an elastic node range needs --rdzv-endpoint HOST:PORT")
    if multi_node and not rdzv_endpoint and master_port is None:
        master_port = 29500
    if master_port is not None and not 0 < int(master_port) < 65536:
        raise ConfigError(f"--master-port {master_port} is not a TCP port (1-65535)")
    leftover = [a for a in argv if a in LAUNCH_FLAGS or a.split("=", 1)[0] in LAUNCH_FLAGS]
    if leftover:
        raise ValueError(f"launch_processes: argv still holds launch options {leftover}; pass strip_launch_args(argv)")

    args = ["--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--max-restarts", str(max_restarts),
            "--monitor-interval", str(monitor_interval_s), "--rdzv-id", run_id]
    if rdzv_endpoint or master_port is None:
        # c10d rendezvous: at the endpoint, or (one node) on a free port of this machine
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint or "localhost:0"]
        conf = []
        if join_timeout_s is not None:
            # read_timeout bounds each try to reach the store: a node that comes back after the others gave
            # up learns so within the rendezvous timeout, not torch's 60 s (tried more than once).
            conf += [f"join_timeout={int(join_timeout_s)}", f"read_timeout={max(1, min(60, int(join_timeout_s)))}"]
        if rdzv_endpoint:
            host, port = split_endpoint(rdzv_endpoint)
            if can_listen_on(host, port):
                conf.append("is_host=1")  # the endpoint is this node's: it hosts the rendezvous store
            # The address other nodes reach this node by (rank 0's store when restarts are on), rather
            # than what this node's host name resolves to, which may be 127.0.0.1.
            local_addr = local_addr or route_address(host, port)
        if conf:
            args += ["--rdzv-conf", ",".join(conf)]
    else:
        # static rendezvous: rank 0's node listens on master_addr:master_port
        args += ["--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", str(master_port)]
        if join_timeout_s is not None:
            args += ["--rdzv-conf", f"timeout={int(join_timeout_s)}"]
    if local_addr:
        args += ["--local-addr", local_addr]
    if stop_timeout_s is not None:
        args += ["--shutdown-timeout", str(int(stop_timeout_s))]
    args += ["--signals-to-handle", AGENT_STOP_SIGNALS]  # not SIGTERM: _forward_stop_signals passes it on
    args += ["--module", module, *argv]

    env: dict[str, str] = {}
    if omp_threads is not None or "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(omp_threads or default_omp_threads(nproc))
    if max_restarts and "--rdzv-backend" in args and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # torch 2.13: with the c10d rendezvous the ranks share the agent's TCP store across restarts,
        # and the restarted ranks read the previous attempt's gloo/NCCL addresses from it and never
        # connect (pytorch/pytorch#135712). A store per attempt (hosted by rank 0) avoids it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_STOP_SIGNALS  # torch sets it from the flag; restored after
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    log.info("starting %d process(es) on %s (nodes: %s): python -m %s %s", nproc,
             "this node" if rdzv_endpoint else f"node {node_rank}", nnodes, module, " ".join(argv))
    try:
        with _forward_stop_signals():
            torchrun.run(torchrun.parse_args(args))
        return 0
    except ChildFailedError as e:
        root_rank = _root_cause(e.failures)
        root = e.failures[root_rank]
        print(f"shardwise: rank {root_rank} (local rank {root.local_rank}) failed with exit code {root.exitcode}"
              f": {_failure_text(root)}", file=sys.stderr)
        for rank, failure in sorted(e.failures.items()):
            if rank != root_rank:
                print(f"shardwise: rank {rank} also failed (exit code {failure.exitcode}): {_failure_text(failure)}",
                      file=sys.stderr)
        if max_restarts:
            print(f"shardwise: gave up after {max_restarts} restart(s)", file=sys.stderr)
        sys.stderr.flush()
        return _exit_code(root.exitcode)
    except RendezvousError as e:
        where = rdzv_endpoint or f"{master_addr}:{master_port}"
        node = "this node" if rdzv_endpoint else f"node {node_rank}"  # c10d numbers the nodes as they join
        print(f"shardwise: {node}: {_rendezvous_failure(e, where, nnodes, join_timeout_s)}", file=sys.stderr)
        return 1
    except SignalException as e:  # the launcher itself was told to stop; the agent stopped the ranks
        print(f"shardwise: stopped by signal {e.sigval.name}; the ranks were stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
