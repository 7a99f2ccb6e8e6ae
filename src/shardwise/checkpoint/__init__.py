"""Checkpoints and weights: `format.py` (the on-disk format, read back without trusting it),
`storage.py` (checkpoint directories: atomic saves by every rank, loads in any layout, finding them),
`rng.py` (each rank's random generators), `weights.py` (weights from a Hugging Face directory or a
checkpoint: init_from, generation, export) and `checkpointer.py` (a run's whole state, saved and
loaded in any layout)."""

from .checkpointer import Checkpointer
from .storage import find_checkpoint, list_checkpoints, read_trainer_state
from .weights import load_model

__all__ = ["Checkpointer", "find_checkpoint", "list_checkpoints", "read_trainer_state", "load_model"]
