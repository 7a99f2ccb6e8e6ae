"""The run directory and what must hold before a run may use it: it holds no other run (unless
resuming or overwriting), and the machine has the memory the run needs (on the CPU)."""

from __future__ import annotations

import logging
import shutil
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


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> list[str]:
    """Refuse to write into a directory that holds another run, unless resuming or overwriting; return
    what of a previous run `--overwrite` would replace."""
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not existing or resume is not None:
        return []
    if not overwrite:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(existing)}); continue it with --resume auto "
            "(Python: trainer.train(resume='auto')), replace it with --overwrite (Python: "
            "TrainingArguments(overwrite_output_dir=True)), or choose another train.output_dir"
        )
    return existing


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Make the run directory, replacing a previous run's files when overwriting (see `check_run_dir`)."""
    existing = check_run_dir(run_dir, resume, overwrite)
    if existing:
        for name in existing:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("--overwrite: removed the previous run's %s from %s", ", ".join(existing), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


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
