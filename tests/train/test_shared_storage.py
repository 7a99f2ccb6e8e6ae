"""Storage that is not shared: at start every rank must read a token file rank 0 wrote into the run
directory, and a run whose ranks see different directories stops before training, on every rank.

The real case runs two ranks as processes, rank 1 in a mount namespace of its own with a tmpfs over the
run directory's parent: the same path, another file system (as a node-local disk on a second node). It
skips where unshare or mount is not permitted. The shared case runs in forked gloo workers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.checkpoint.storage import step_dir
from shardwise.train.shared_storage import SEE_S, check_shared_run_dir

from ..parallel.harness import free_port, run_distributed

REPO = Path(__file__).resolve().parents[2]
ENTRY = "tests.train.shared_storage_entry"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")
PRIVATE_TMPFS = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"']


def _private_mounts_or_skip(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed: cannot give one rank a file system of its own")
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run([*PRIVATE_TMPFS, str(probe), "true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"a private mount namespace with a tmpfs is not permitted here: {done.stderr.strip()}")


def _spawn(root: Path, rank: int, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", ENTRY, str(root)]
    if rank == 1:  # the same path, another file system
        command = [*PRIVATE_TMPFS, str(root / "shared"), *command]
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(300)
def test_a_run_directory_not_shared_stops_every_rank_before_training(tmp_path: Path) -> None:
    _private_mounts_or_skip(tmp_path)
    (tmp_path / "shared").mkdir()
    (tmp_path / "out").mkdir()
    port = free_port()
    procs = [_spawn(tmp_path, rank, port) for rank in (0, 1)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=200)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output
    seen = {r: json.loads((tmp_path / "out" / f"rank_{r}.json").read_text()) for r in (0, 1)}
    run_dir = tmp_path / "shared" / "run"
    for rank, s in seen.items():
        msg = s["train"]
        assert msg.startswith("ConfigError: train.output_dir"), msg
        assert f"{run_dir} is not the same file system on every rank" in msg
        assert "1 rank(s) could not read" in msg and "1 (host " in msg and "rank 0 (host " in msg
        assert "NFS, Lustre, GPFS" in msg and "ReadWriteMany" in msg
        # before training, before data preparation, and within a bounded time
        assert not s["set_up"] and not s["prepared_data"]
        assert s["train_s"] < SEE_S + 60
        # the checkpoint whose rank-1 files went to rank 1's own disk is not published
        assert s["save"].startswith("CheckpointError") and "step_00000001 was not published" in s["save"], s["save"]
        assert "__1_0.distcp" in s["save"] and "rng_rank1.json" in s["save"]
    # rank 0's file system: no trace of the run, the token gone, and no checkpoint
    assert not run_dir.exists()
    assert not step_dir(tmp_path / "shared" / "saves", 1).exists()


def _check(rank: int, world: int, run_dir: Path) -> None:
    check_shared_run_dir(run_dir, rank)


def test_a_shared_run_directory_passes_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "existing").mkdir()
    run_distributed(_check, 2, tmp_path / "existing", timeout=120)
    assert [p.name for p in tmp_path.rglob("*")] == ["existing"]  # the directory stays, the token file went
    run_distributed(_check, 2, tmp_path / "new" / "run", timeout=120)
    assert not (tmp_path / "new" / "run").exists()  # made for the check only, removed again
