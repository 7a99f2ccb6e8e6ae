"""Writing so that a crash never leaves half a file or half a directory behind.

A file is written to a temporary name in its directory, flushed to disk and renamed over the target
(`write_bytes_atomic`, `write_json_atomic`): a reader sees the old file or the new one, never a mix.
A directory is built under a temporary name and published whole (`publish_dir`): what was at the
target stays until the new one is in place, and is put back if the move fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any


def plain_file_name(name: Any) -> bool:
    """Whether `name` can only mean a file directly inside a directory (no path, no `..`, no NUL)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not os.path.isabs(name)
            and not any(c in name for c in "/\\\0"))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file below `path`, then `path` itself, to disk."""
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` in one rename (the temporary file is unique: writers may race)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """`write_bytes_atomic` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_dir(staging: Path, out: Path) -> None:
    """Move the finished directory `staging` to `out` in one rename.

    An existing `out` is moved aside first and removed only once the new one is in place; if the move
    fails it is put back. An empty `out` is filled entry by entry instead (it may be the current
    directory, or carry permissions the user set up). The caller decides beforehand whether `out`
    may be replaced at all.
    """
    staging, out = Path(staging), Path(out)
    if out.is_dir() and not any(out.iterdir()):
        for entry in staging.iterdir():
            entry.rename(out / entry.name)
        staging.rmdir()
        return
    old = None
    if os.path.lexists(out):
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:12]}")
        out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)  # put the user's directory back rather than leave nothing
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
