"""A run's memory, measured exactly: the Trainer for a few steps under a `memory.measure.MemoryTracker`
that follows the trainer's phases through its phase hook (how `bench/memory_check.py` holds the
estimator against measurement, and how `shardwise plan --profile` measures peaks)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import RunConfig, validate
from ..memory.measure import Measurement, MemoryTracker
from .trainer import Trainer, TrainState

# The trainer's phases as the tracker counts them; autograd's backward and optimizer.step it sees itself.
_TRACKER_PHASE = {"forward": "forward", "pipeline step": "forward", "optimizer step": "optimizer",
                  "checkpoint save": "checkpoint", "evaluation": "forward"}


class _ProbedTrainer(Trainer):
    """The Trainer with its final checkpoint save left out when asked (`save=False`)."""

    def __init__(self, cfg: RunConfig, train_dataset: Any, save: bool) -> None:
        super().__init__(cfg, train_dataset=train_dataset)
        self.save_checkpoints = save

    def save(self, step: int) -> Optional[Path]:  # noqa: D102 - see Trainer.save
        return super().save(step) if self.save_checkpoints else None


def measure_training(cfg: RunConfig, train_dataset: Any, steps: int = 2, save: bool = True,
                     tracker: Optional[MemoryTracker] = None) -> Measurement:
    """Run `Trainer(cfg, train_dataset).train()` for `steps` optimizer steps (and the final checkpoint
    save when `save`) under a MemoryTracker; return this rank's peaks from the first step on.

    The window starts at the first optimizer step (model building and initialisation are left out)
    and the steady state is reached in step 2, when the optimizer state exists during forward and
    backward. Call it on every rank of a distributed run (e.g. in `run_distributed` workers).
    """
    raw = cfg.model_dump(mode="json")
    raw["train"].update(max_steps=steps, save_steps=None, eval_steps=None, log_steps=steps, progress_bar=False,
                        tensorboard=False, loggers=[], profile=None, save_minutes=None)
    trainer = _ProbedTrainer(validate(raw), train_dataset, save)
    tracker = tracker or MemoryTracker()

    def follow(phase: str) -> None:
        if not tracker.recording:
            tracker.start_recording()  # the first forward of the first step
        tracker.mark(_TRACKER_PHASE.get(phase, tracker.current_phase()))

    trainer.add_phase_hook(follow)
    gc.collect()
    with tracker:
        trainer.train(overwrite=True)
        state = trainer.state
        result = tracker.measurement(_groups(state), state.ctx.rank)
    del trainer, state
    gc.collect()
    return result


def _groups(state: TrainState) -> dict[str, list[torch.Tensor]]:
    """The trainer state's tensors by kind, for the split of the peak."""
    params, grads = [], []
    for part in state.parts:
        params += [*part.parameters(), *part.buffers()]
        grads += [p.grad for p in part.parameters() if p.grad is not None]
    inner = getattr(state.optimizer, "local", state.optimizer)  # ZeRO-1's wrapper holds a local optimizer
    opt_state = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    groups = {"params": params, "grads": grads, "optimizer": opt_state}
    if state.masters is not None:
        groups["masters"] = list(state.masters.masters)
    return groups
