"""Running a hostile input under a memory and a time cap, so that a regression fails the test instead
of taking the machine down.

`run_capped(fn, *args)` runs the module-level function `fn(*args)` in a worker forked from
multiprocessing's fork server (a clean process that has imported torch and shardwise once: a call
costs a fork, not an import). The worker may map at most `memory_mib` MiB more than it maps at the
start (RLIMIT_AS: an allocation past it raises MemoryError there), and is killed after `seconds`.
The result comes back pickled; an exception in the worker, or the time running out, fails the test
with `CappedError` saying which.

`cli_capped(argv)` runs `shardwise.cli.main(argv)` that way and returns (exit status, everything it
printed), for tests that hold "exit 2 and a message naming the file"; `assert_refused` and
`assert_each_refused` (many commands in one worker) hold exactly that.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import resource
import sys
import traceback
from collections.abc import Callable
from typing import Any

MEMORY_MIB = 1536
SECONDS = 60.0


class CappedError(AssertionError):
    """The capped function raised, ran out of memory or of time; the message says which."""


def _context():  # noqa: ANN202 - multiprocessing context
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardwise.cli", "shardwise.train.trainer", "tests.capped"])
    return ctx


def _mapped_bytes() -> int:
    """What this process maps now (VmSize), the base the address-space cap is added to."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(fn: Callable, args: tuple, memory: int, environ: dict[str, str], cwd: str, out: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch
    torch.set_num_threads(1)
    limit = _mapped_bytes() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = fn(*args)
        out.put(("ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        kind = "memory" if isinstance(e, MemoryError) else "raised"
        out.put((kind, traceback.format_exc()))


def run_capped(fn: Callable[..., Any], *args: Any, memory_mib: int = MEMORY_MIB, seconds: float = SECONDS) -> Any:
    """`fn(*args)` in a capped worker; its result, or CappedError."""
    ctx = _context()
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(fn, args, memory_mib << 20, dict(os.environ), os.getcwd(), out),
                       daemon=True)
    proc.start()
    try:
        kind, payload = out.get(timeout=seconds)
    except queue_mod.Empty:
        proc.kill()
        proc.join(10)
        raise CappedError(f"{fn.__name__} took more than {seconds:g} s (killed): a hang or a blow-up") from None
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if kind == "ok":
        return pickle.loads(payload)
    if kind == "memory":
        raise CappedError(f"{fn.__name__} tried to map more than {memory_mib} MiB:\n{payload}")
    raise CappedError(f"{fn.__name__} raised:\n{payload}")


def _cli(argv: list[str]) -> tuple[int, str]:
    from shardwise.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except MemoryError:
            raise
        except BaseException:  # noqa: BLE001 - a traceback is the failure the caller looks for
            traceback.print_exc(file=buffer)
            code = 99
    sys.stdout.flush()
    return int(code or 0), buffer.getvalue()


def _cli_each(argvs: list[list[str]]) -> list[tuple[int, str]]:
    return [_cli(argv) for argv in argvs]


def cli_capped(argv: list[str], *, memory_mib: int = MEMORY_MIB, seconds: float = SECONDS) -> tuple[int, str]:
    """`shardwise ARGV` in a capped worker: (exit status, what it printed); 99 for an uncaught exception."""
    return run_capped(_cli, [str(a) for a in argv], memory_mib=memory_mib, seconds=seconds)


def assert_refused(argv: list[str], *names: str, memory_mib: int = MEMORY_MIB, seconds: float = SECONDS) -> str:
    """`shardwise ARGV` must exit 2 with an error message (no traceback) that contains each of `names`
    (the file, the field); returns what it printed."""
    code, text = cli_capped(argv, memory_mib=memory_mib, seconds=seconds)
    assert code == 2, f"exit {code}, not 2:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    for name in names:
        assert str(name) in text, f"{name!r} not in:\n{text[-3000:]}"
    return text


def assert_each_refused(cases: list[tuple[list, tuple]], memory_mib: int = 1024, seconds: float = 30) -> None:
    """Each (argv, names) of `cases`: `shardwise ARGV` exits 2, without a traceback, naming each of `names`;
    all in one capped worker (a fork, not an import, per batch)."""
    results = run_capped(_cli_each, [[str(a) for a in argv] for argv, _ in cases], memory_mib=memory_mib,
                         seconds=seconds)
    for (argv, names), (code, text) in zip(cases, results):
        assert code == 2, f"{argv}: exit {code}, not 2:\n{text[-3000:]}"
        assert "Traceback" not in text, text[-3000:]
        for name in names:
            assert str(name) in text, f"{argv}: {name!r} not in:\n{text[-3000:]}"
