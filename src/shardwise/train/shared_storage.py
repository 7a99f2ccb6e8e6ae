"""Whether the run directory is one file system for every rank.

Every rank writes its checkpoint shards into train.output_dir and a resume reads all of them back, so
a directory that each node has on its own disk (a local path, a Kubernetes emptyDir or
ReadWriteOnce volume) would hold a different part of every checkpoint on each node. At start, rank 0
writes a token file (random name and content) into the run directory, every rank looks for it, and
one reduction (`texts_of_ranks`) gives every rank each rank's answer and host; where any rank could not read it, every
rank stops with a ConfigError naming those ranks and hosts. The token file goes afterwards.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..parallel.collectives import attempt, broadcast_, distributed, fail_together, texts_of_ranks

SEE_S = 5.0  # how long a rank looks for the token (a shared file system's caches may be behind)
_TOKEN_CHARS = 32
_HOST_CHARS = 64
_PREFIX = ".shardwise-shared-check-"


def check_shared_run_dir(run_dir: Path, rank: int) -> None:
    """Every rank of the job calls it: return when every rank reads the token rank 0 wrote into
    `run_dir`, else raise a ConfigError (the same on every rank) saying which ranks and hosts could not
    and what to change. Nothing to check without a process group of several ranks."""
    if not distributed() or dist.get_world_size() == 1:
        return
    token = secrets.token_hex(_TOKEN_CHARS // 2)
    made, error = attempt(_write_token, run_dir, token) if rank == 0 else (None, None)
    fail_together(error, what=f"writing a check file into train.output_dir {run_dir}", error_class=ConfigError)
    codes = torch.tensor(list(token.encode("ascii")), dtype=torch.int32)
    broadcast_(codes, src=0)
    token = bytes(codes.tolist()).decode("ascii")
    seen = rank == 0 or _sees(run_dir / f"{_PREFIX}{token}", token)
    answers = texts_of_ranks(("seen " if seen else "unseen ") + socket.gethostname(), width=6 + 1 + _HOST_CHARS)
    if rank == 0:
        _remove_token(run_dir, token, made)
    unseen = [r for r, answer in enumerate(answers) if answer.startswith("unseen ")]
    if unseen:
        raise ConfigError(_not_shared(run_dir, unseen, [a.split(" ", 1)[1] or "?" for a in answers]))


def _write_token(run_dir: Path, token: str) -> bool:
    """Write the token file (flushed to the server); True when the run directory had to be made."""
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / f"{_PREFIX}{token}", "w", encoding="ascii") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    return made


def _sees(path: Path, token: str) -> bool:
    """Whether `path` holds `token` here, looking again for up to SEE_S seconds."""
    deadline, delay = time.monotonic() + SEE_S, 0.05
    while True:
        try:
            if path.read_text(encoding="ascii") == token:
                return True
        except (OSError, UnicodeDecodeError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.5)


def _remove_token(run_dir: Path, token: str, made: bool) -> None:
    (run_dir / f"{_PREFIX}{token}").unlink(missing_ok=True)
    if made:
        try:
            run_dir.rmdir()  # made for the check only: the run makes it when it starts writing
        except OSError:
            pass


def _not_shared(run_dir: Path, unseen: list[int], hosts: list[str]) -> str:
    shown = unseen[:16]
    ranks = ", ".join(f"{r} (host {hosts[r]})" for r in shown) + (", ..." if len(unseen) > len(shown) else "")
    return (
        f"train.output_dir {run_dir} is not the same file system on every rank: rank 0 (host {hosts[0]}) wrote a "
        f"file there that {len(unseen)} rank(s) could not read within {SEE_S:g} s: {ranks}. Every rank writes its "
        "checkpoint shards into train.output_dir and a resume reads all of them, so on a disk of each node's own "
        "every checkpoint would miss shards. Put train.output_dir on a file system that every node mounts at the "
        "same path (NFS, Lustre, GPFS, ...; in Kubernetes a ReadWriteMany volume mounted in every pod), or run on "
        "one node"
    )


__all__ = ["SEE_S", "check_shared_run_dir"]
