"""The run directory and what must hold before a run may use it: it holds no other run (unless
resuming or overwriting), and the machine has the memory the run needs (on the CPU)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..memory.estimate import estimate_memory
from ..models.flops import count_parameters
from ..parallel.launch import DistContext
from ..units import gib
from .fit_search import describe_fits, find_fits, hardware_for, usable_bytes

log = logging.getLogger(__name__)

RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.yaml", "tokenizer", "trackers.json", "wandb",
             "mlruns", "profile", "report")


# What a run writes into, as directories: never through a symbolic link (it would write, and remove old
# checkpoints, in the directory the link points to). tokenizer/ is written only when absent, else only read.
WRITTEN_DIRS = ("checkpoints", "tensorboard", "wandb", "mlruns", "profile")
# What a run writes into, as files (appends to metrics.jsonl; config.yaml and trackers.json replaced whole).
WRITTEN_FILES = ("metrics.jsonl", "config.yaml", "trackers.json")


def _describe(run_dir: Path, names: list[str]) -> str:
    """The paths `--overwrite` deletes, for the user: each entry, links said as links."""
    out = []
    for name in names:
        path = run_dir / name
        if path.is_symlink():
            out.append(f"{path} (a symbolic link: only the link)")
        elif path.is_dir():
            inside = sorted(p.name for p in path.iterdir())
            shown = ", ".join(inside[:5]) + (f", ... ({len(inside)} entries)" if len(inside) > 5 else "")
            out.append(f"{path}/ (with {shown or 'nothing'})")
        else:
            out.append(str(path))
    return "; ".join(out)


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> list[str]:
    """Refuse to write into a directory that holds another run, unless resuming or overwriting; return
    what of a previous run `--overwrite` would replace."""
    existing = [name for name in RUN_FILES if os.path.lexists(run_dir / name)]
    if not existing or resume is not None:
        return []
    if not overwrite:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(existing)}); continue it with --resume auto "
            "(Python: trainer.train(resume='auto')), choose another train.output_dir, or delete that run with "
            f"--overwrite (Python: TrainingArguments(overwrite_output_dir=True)), which deletes "
            f"{_describe(run_dir, existing)}"
        )
    return existing


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Make the run directory, replacing a previous run's files when overwriting (see `check_run_dir`);
    then make sure nothing the run writes there is a symbolic link (`unlink_written_paths`)."""
    existing = check_run_dir(run_dir, resume, overwrite)
    if existing:
        removed = _describe(run_dir, existing)
        for name in existing:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()  # a file, or a link: only the link goes, never what it points to
        log.warning("--overwrite: deleted the previous run in %s: %s", run_dir, removed)
    run_dir.mkdir(parents=True, exist_ok=True)
    unlink_written_paths(run_dir)


def unlink_written_paths(run_dir: Path) -> None:
    """Nothing the run writes is written through a symbolic link into a file or directory of the user's:
    a linked file (config.yaml, metrics.jsonl, trackers.json) is replaced, in one rename, by a copy of what
    it points to (the run goes on from there; the user's file is left as it is), a dangling one removed;
    a linked directory the run writes into (checkpoints/, ...) is refused."""
    for name in WRITTEN_DIRS:
        path = run_dir / name
        if path.is_symlink():
            raise ConfigError(
                f"{path} is a symbolic link (to {os.readlink(path)}): a run writes into {name}/"
                f"{' and removes old checkpoints from it' if name == 'checkpoints' else ''}, which would change "
                "the directory the link points to. To keep it on another disk, set train.output_dir to a directory "
                f"there; else replace the link by a directory of its own (e.g. mv {path} {path}.link, then copy "
                "what it points to in its place)")
    for name in WRITTEN_FILES:
        path = run_dir / name
        if not path.is_symlink():
            continue
        target = os.readlink(path)
        if path.is_file():
            fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{name}.", suffix=".tmp")
            os.close(fd)
            try:
                shutil.copyfile(path, tmp)
                os.replace(tmp, path)  # replaces the link itself, not the file it points to
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            log.warning("%s was a symbolic link to %s; the run writes to it, so it is now a copy of that file "
                        "(the file the link pointed to is left unchanged)", path, target)
        else:
            path.unlink()
            log.warning("%s was a symbolic link to %s, which does not exist (or is no file); the link was removed "
                        "and the run writes a file of its own there", path, target)


def available_host_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(cfg: RunConfig, ctx: DistContext) -> None:
    """On the CPU, refuse a run whose estimated peak (for all of this machine's ranks) exceeds the memory
    the machine has free: it would only be killed later, often a forgotten `model.preset` (7B)."""
    available = available_host_memory()
    if ctx.device.type != "cpu" or available is None:
        return
    need = estimate_memory(cfg, ctx.world_size, "cpu").peak * ctx.local_world_size
    if need <= available:
        return
    m = cfg.model
    hw = hardware_for("cpu")
    found = find_fits(cfg, ctx.world_size, "cpu", hw, usable_bytes(available, hw, ctx.local_world_size))
    raise ConfigError(
        f"this run needs about {gib(need, 1)} of memory (estimate: {ctx.local_world_size} process(es) on this "
        f"machine, a {count_parameters(m):,}-parameter model: {m.preset or 'no model.preset'}, hidden_size "
        f"{m.hidden_size}, {m.num_layers} layers, vocab {m.vocab_size}) but the machine has {gib(available, 1)} "
        "free. Choose a smaller model (model.preset), lower train.micro_batch_size or data.seq_length, or turn on "
        "optimize.recompute; `shardwise estimate CONFIG` shows where the memory goes. Per process:\n"
        + "\n".join(describe_fits(found))
    )
