"""Launch: torchrun through `launch_processes` (real processes), mpirun-style environments, and the
environment parsing that decides rank, world and device. Rank programs: tests/parallel/launch_entry.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from shardwise.errors import ConfigError, DeviceError
from shardwise.parallel import launch
from shardwise.parallel.launch import (
    LAUNCH_FLAGS,
    check_local_devices,
    default_omp_threads,
    init_distributed,
    launch_env,
    launch_processes,
    record_failure,
    restart_count,
    shutdown,
    strip_launch_args,
    was_restarted,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = "tests.parallel.launch_entry"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
               "PMIX_RANK", "SLURM_NTASKS", "SLURM_LOCALID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
               "TORCHELASTIC_ERROR_FILE")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables from the outside; the rank programs importable from the repository root."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return monkeypatch


def results(out) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("rank_*.json")}


# ------------------------------------------------------------------ torchrun through launch_processes


@pytest.mark.timeout(300)
def test_launch_two_processes_all_reduce(clean_env, tmp_path):
    """Static rendezvous on a given port; OMP_NUM_THREADS = cores // nproc, and the caller's env is left alone."""
    clean_env.delenv("OMP_NUM_THREADS", raising=False)
    rc = launch_processes([str(tmp_path), "ok"], 2, master_port=free_port(), module=ENTRY)
    assert rc == 0
    got = results(tmp_path)
    assert sorted(got) == [0, 1]
    for rank, r in got.items():
        assert r["sum"] == 3.0 and r["world_size"] == 2 and r["local_rank"] == rank
        assert r["launcher"] == "torchrun" and r["backend"] == "gloo" and r["restart_count"] == 0
        assert r["group_restart_count"] == 0
        assert r["omp"] == str(default_omp_threads(2))
        assert r["argv"] == [str(tmp_path), "ok"]
    assert "OMP_NUM_THREADS" not in os.environ


@pytest.mark.timeout(300)
def test_launch_failing_rank_stops_the_group_and_shows_its_error(clean_env, tmp_path, capfd):
    clean_env.setenv("LAUNCH_TEST_TIMEOUT", "60")
    for attempt in range(3):
        start = time.monotonic()
        rc = launch_processes([str(tmp_path), "fail"], 2, module=ENTRY)
        elapsed = time.monotonic() - start
        err = capfd.readouterr().err
        # 134: the failing rank was ended by SIGABRT in torch's teardown after its error, not by the error;
        # seen in two CI runs and one local suite on a loaded machine (twice in a row there; cause unknown,
        # never alone), so that outcome gets two more tries. The launcher's handling of a failed rank is
        # what this test holds. (Destroying the group in the failing rank before exit avoids nothing
        # measurable and makes rank 0 fail first, so the launcher would name the wrong rank.)
        if rc != 134:
            break
    assert rc == 1
    assert elapsed < 60, f"the group took {elapsed:.0f} s to stop"  # the agent stops rank 0, no timeout needed
    assert "RuntimeError: rank 1 failed on purpose (launch test)" in err  # the rank's own traceback
    assert "shardwise: rank 1 (local rank 1) failed with exit code 1: RuntimeError: rank 1 failed on purpose" in err
    assert not list(tmp_path.glob("rank_*.json"))


@pytest.mark.timeout(300)
def test_launch_restarts_after_a_failure(clean_env, tmp_path):
    """max_restarts=1: rank 1 fails on the first attempt only; the whole group runs again and succeeds."""
    rc = launch_processes([str(tmp_path), "fail_once"], 2, max_restarts=1, module=ENTRY)
    assert rc == 0
    assert (tmp_path / "marker").exists()
    got = results(tmp_path)
    assert sorted(got) == [0, 1]
    assert all(r["sum"] == 3.0 and r["restart_count"] == 1 and r["group_restart_count"] == 1 for r in got.values())
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


def test_launch_refuses_bad_arguments(clean_env):
    with pytest.raises(ValueError, match="strip_launch_args"):
        launch_processes(["train", "cfg.yaml", "--nproc", "2"], 2)
    with pytest.raises(ValueError, match="strip_launch_args"):
        launch_processes(["train", "cfg.yaml", "--max-restarts=1"], 2)
    with pytest.raises(ConfigError, match="at least 1"):
        launch_processes(["train", "cfg.yaml"], 0)
    with pytest.raises(ConfigError, match="--max-restarts -1"):
        launch_processes(["train", "cfg.yaml"], 2, max_restarts=-1)
    with pytest.raises(ConfigError, match="--master-port 70000"):
        launch_processes(["train", "cfg.yaml"], 2, master_port=70000)
    with pytest.raises(ConfigError, match="--nnodes 0"):
        launch_processes(["train", "cfg.yaml"], 2, nnodes=0)
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint"):
        launch_processes(["train", "cfg.yaml"], 2, nnodes="1:2")


def test_root_cause_passes_over_ranks_the_agent_stopped(tmp_path):
    from types import SimpleNamespace

    first, later = tmp_path / "first.json", tmp_path / "later.json"
    first.write_text("{}")
    later.write_text("{}")
    os.utime(first, (100.2, 100.2))
    os.utime(later, (100.7, 100.7))
    failures = {0: SimpleNamespace(exitcode=1, error_file=str(later), timestamp=100),
                1: SimpleNamespace(exitcode=1, error_file=str(first), timestamp=100)}
    assert launch._root_cause(failures) == 1  # same second: the earlier error file
    failures[1] = SimpleNamespace(exitcode=-15, error_file=str(first), timestamp=100)
    assert launch._root_cause(failures) == 0  # SIGTERM: stopped by the agent, not the cause
    failures[0] = SimpleNamespace(exitcode=-9, error_file="<N/A>", timestamp=100)  # killed (OOM), no file
    assert launch._root_cause(failures) == 0
    # A rank ended by a signal in the second of another rank's Python error (gloo aborts a rank whose peer
    # died): torch truncates the signalled rank's time to 100 s, before the error's 100.7 s; the error wins.
    failures = {0: SimpleNamespace(exitcode=-6, error_file="<N/A>", timestamp=100),
                1: SimpleNamespace(exitcode=1, error_file=str(later), timestamp=100)}
    assert launch._root_cause(failures) == 1
    failures[0] = SimpleNamespace(exitcode=-6, error_file="<N/A>", timestamp=99)  # a second before: the cause
    assert launch._root_cause(failures) == 0


# ------------------------------------------------------------------ mpirun-style environments


def _spawn_mpi_like(out, port: int, flavour: str) -> list[subprocess.Popen]:
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", LAUNCH_TEST_TIMEOUT="60")
        if flavour == "openmpi":
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                       OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2")
            # as after a multi-node restart in which only rank 1's agent counted: the group agrees on 1
            env.update(TORCHELASTIC_MAX_RESTARTS="1", TORCHELASTIC_RESTART_COUNT=str(rank))
        else:  # MPICH / Intel MPI (Hydra)
            env.update(PMI_RANK=str(rank), PMI_SIZE="2", MPI_LOCALRANKID=str(rank), MPI_LOCALNRANKS="2")
        procs.append(subprocess.Popen([sys.executable, "-m", ENTRY, str(out), "ok"], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.timeout(300)
def test_init_distributed_from_mpi_variables(clean_env, tmp_path):
    """Two Open MPI-style and two MPICH/PMI-style ranks (two groups at once) form groups and all-reduce."""
    groups = {}
    for flavour in ("openmpi", "pmi"):
        (tmp_path / flavour).mkdir()
        groups[flavour] = _spawn_mpi_like(tmp_path / flavour, free_port(), flavour)
    for flavour, procs in groups.items():
        for p in procs:
            try:
                output, _ = p.communicate(timeout=200)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            assert p.returncode == 0, f"{flavour}: {output}"
        got = results(tmp_path / flavour)
        assert sorted(got) == [0, 1]
        for rank, r in got.items():
            assert r["sum"] == 3.0 and r["world_size"] == 2 and r["local_rank"] == rank
            assert r["launcher"] == flavour
            assert r["restart_count"] == (rank if flavour == "openmpi" else 0)
            assert r["group_restart_count"] == (1 if flavour == "openmpi" else 0)


@pytest.mark.parametrize("variables", [{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
                                       {"PMI_RANK": "1", "PMI_SIZE": "2"}])
def test_mpi_without_master_address_is_a_clear_error(clean_env, variables):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        init_distributed("cpu", timeout_s=5)
    msg = str(e.value)
    assert "mpirun" in msg and "MASTER_ADDR and MASTER_PORT are not set" in msg and "-x MASTER_ADDR" in msg
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="MASTER_PORT is not set"):
        init_distributed("cpu", timeout_s=5)
    clean_env.setenv("MASTER_PORT", "http")
    with pytest.raises(ConfigError, match="MASTER_PORT='http' is not a TCP port"):
        init_distributed("cpu", timeout_s=5)
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------ environment parsing (no processes)


def test_launch_env_flavours():
    assert launch_env({}) is None
    assert launch_env({"MASTER_ADDR": "x", "MASTER_PORT": "1"}) is None
    tr = launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                     "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (tr.launcher, tr.rank, tr.world_size, tr.local_rank, tr.local_world_size) == ("torchrun", 3, 4, 1, 2)
    om = launch_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (om.launcher, om.rank, om.world_size, om.local_rank, om.local_world_size) == ("openmpi", 5, 8, 1, 4)
    pm = launch_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"})
    assert (pm.launcher, pm.rank, pm.world_size, pm.local_rank, pm.local_world_size) == ("pmi", 2, 4, 0, None)
    px = launch_env({"PMIX_RANK": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"})
    assert (px.launcher, px.rank, px.world_size, px.local_rank) == ("pmix", 1, 2, 1)
    with pytest.raises(ConfigError, match="export WORLD_SIZE"):
        launch_env({"PMIX_RANK": "0"})
    with pytest.raises(ConfigError, match="rank 4 of world size 4"):
        launch_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="PMI_SIZE='two' is not an integer"):
        launch_env({"PMI_RANK": "0", "PMI_SIZE": "two"})


def test_single_process_has_no_group(clean_env):
    ctx = init_distributed("cpu", timeout_s=5)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.launcher) == (0, 1, 0, None)
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo" and ctx.is_main and not ctx.distributed
    assert not torch.distributed.is_initialized()
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "0")  # mpirun -n 1: world 1, no MASTER_ADDR needed
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "1")
    ctx = init_distributed("cpu", timeout_s=5)
    assert ctx.world_size == 1 and ctx.launcher == "openmpi" and not torch.distributed.is_initialized()
    shutdown()  # no group: nothing to do
    with pytest.raises(ConfigError, match="positive"):
        init_distributed("cpu", timeout_s=0)


def test_existing_group_is_used_and_left_to_its_maker(clean_env):
    """A group made by someone else (a test harness): its rank and size count, and shutdown() leaves it."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1)
    try:
        ctx = init_distributed("cpu", timeout_s=5)
        assert (ctx.rank, ctx.world_size, ctx.launcher) == (0, 1, None)
        shutdown()
        assert torch.distributed.is_initialized()
        clean_env.setenv("RANK", "1")
        clean_env.setenv("WORLD_SIZE", "2")
        with pytest.raises(RuntimeError, match="does not match"):
            init_distributed("cpu", timeout_s=5)
    finally:
        shutdown(force=True)
    assert not torch.distributed.is_initialized()


def test_restart_count(clean_env):
    assert restart_count() == 0 and not was_restarted()
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not was_restarted()
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2 and was_restarted()


def test_strip_launch_args():
    argv = ["train", "cfg.yaml", "--nproc", "2", "--set", "train.lr=1e-4", "--nnodes=2", "--node-rank", "1",
            "--master-addr", "node0", "--master-port=29500", "--rdzv-endpoint", "node0:29400", "--max-restarts",
            "3", "--resume", "auto"]
    assert strip_launch_args(argv) == ["train", "cfg.yaml", "--set", "train.lr=1e-4", "--resume", "auto"]
    assert set(LAUNCH_FLAGS) == {"--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                                 "--rdzv-endpoint", "--rdzv-timeout", "--local-addr", "--max-restarts"}


def test_check_local_devices(monkeypatch):
    check_local_devices("cpu", 4)  # CPU ranks are processes, not devices
    with pytest.raises(ConfigError):
        check_local_devices("cpu", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_local_devices("auto", 2)
    with pytest.raises(DeviceError, match="--nproc 3 but this machine has 2 CUDA GPUs"):
        check_local_devices("cuda", 3)
    monkeypatch.setattr(launch, "npu_available", lambda: False)
    with pytest.raises(DeviceError, match="torch_npu"):
        check_local_devices("npu", 1)


def test_record_failure_writes_the_agents_error_file(clean_env, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    record_failure(ConfigError("ignored without an agent"))  # no error file: nothing happens
    path = tmp_path / "error.json"
    clean_env.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ConfigError("data.train_files matched no file")
    except ConfigError as e:
        record_failure(e)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert launch._failure_text(failure) == "ConfigError: data.train_files matched no file"
    killed = ProcessFailure(local_rank=1, pid=2, exitcode=-9, error_file=str(tmp_path / "missing.json"))
    assert "SIGKILL" in launch._failure_text(killed) and launch._exit_code(-9) == 137


# ------------------------------------------------------------------ several nodes: endpoint, addresses, lost nodes


def test_split_endpoint():
    assert launch.split_endpoint("node0:29400") == ("node0", 29400)
    assert launch.split_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("node0", ":29400", "node0:port", "node0:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            launch.split_endpoint(bad)


def test_which_node_hosts_the_rendezvous_and_by_which_address_it_is_reached():
    """The endpoint's node is the one that can listen on it: an address of this machine with a free port.
    Neither check sends anything (a bind, and a UDP connect)."""
    port = free_port()
    assert launch.can_listen_on("127.0.0.1", port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        assert not launch.can_listen_on("127.0.0.1", port)  # another node's store on this machine already
    assert not launch.can_listen_on("192.0.2.1", port)  # TEST-NET-1: not an address of this machine
    assert not launch.can_listen_on("no-such-host.invalid", port)
    assert launch.route_address("127.0.0.1", port) == "127.0.0.1"


def test_lost_node_message_names_the_node_with_the_peer_address(monkeypatch):
    nodes = [launch.NodeOfRank("0", "hostA", "10.0.0.1"), launch.NodeOfRank("0", "hostA", "10.0.0.1"),
             launch.NodeOfRank("1", "hostB", "10.0.0.2"), launch.NodeOfRank("1", "hostB", "10.0.0.2")]
    monkeypatch.setattr(launch, "_NODES", nodes)
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:22153. This is "
                        "typically caused by a remote worker crashing.")
    message = launch.lost_node_message(gloo, rank=1)
    assert "rank 1 (node 0, hostA) lost contact with node 1 (host hostB, address 10.0.0.2, ranks 2, 3)" in message
    assert "--max-restarts" in message
    # The peer is on this rank's own node (a local rank that stopped first): no node is blamed.
    local = RuntimeError("Connection closed by peer [10.0.0.1]:3298.")
    assert "lost a peer during a collective: a rank of this node or of node(s) 1" in launch.lost_node_message(
        local, rank=0)
    assert launch.lost_node_message(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), rank=0) is None
    monkeypatch.setattr(launch, "_NODES", [])  # one process, or a group made by someone else
    assert launch.lost_node_message(gloo, rank=0) is None
