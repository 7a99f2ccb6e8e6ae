"""The step after validation: what a config points at, read and checked, before any expensive work.

`config.validate` checks values and how they fit together without reading a file. A run also needs:
the architecture of `model.init_from`'s weights (read from their config.json or the checkpoint's
config.yaml, and checked against the model keys the config sets), their tokenizer as the default
`data.tokenizer`, LoRA targets that exist in the model, and a parallel layout whose pipeline stages
and schedule fit the model. `load_run_config` does all of it for a YAML file; `resolve_config` for a
dict (the Python API, tests).
"""

from __future__ import annotations

import os
from typing import Any

from .builder import build_run_model
from .checkpoint.weights import architecture_with_overrides, pretrained_tokenizer
from .config import RunConfig, Spelling, read_config, validate
from .parallel.dims import check_layout


def load_run_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                    raw: dict | None = None) -> RunConfig:
    """Read a config (YAML file or dict), translate seed keys, apply overrides, validate and resolve."""
    return resolve_config(*read_config(path, overrides, raw))


def resolve_config(raw: dict, spelling: Spelling | None = None) -> RunConfig:
    """Validate a canonical config dict and resolve what it points at (see the module docstring)."""
    cfg = validate(with_weights_architecture(raw), spelling)
    if cfg.model.init_from is not None and cfg.data.tokenizer is None:
        # Data read from files is tokenised with the weights' own tokenizer (a dataset handed to the
        # Python API brings its own).
        cfg.data.tokenizer = pretrained_tokenizer(cfg.model.init_from,
                                                  required=bool(cfg.data.train_files or cfg.data.sources))
    if cfg.lora is not None:
        build_run_model(cfg, "meta")  # the structure only: a target that matches nothing fails now
    check_layout(cfg)
    return cfg


def with_weights_architecture(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with a model section that has `init_from` replaced by the weights' architecture plus the
    keys a config may change (a key that contradicts the weights fails, naming both values)."""
    model = raw.get("model")
    if not (isinstance(model, dict) and isinstance(model.get("init_from"), str) and model["init_from"]):
        return raw
    return {**raw, "model": architecture_with_overrides(model)}
