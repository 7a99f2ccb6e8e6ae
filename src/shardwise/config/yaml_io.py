"""Configs as files: reading YAML (one clear message for a missing, binary or malformed file, or a key
given twice), `--set a.b=value` overrides, writing the config in force, and the reference table.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import yaml
from pydantic import BaseModel

from .. import untrusted
from ..errors import ConfigError
from .schema import RunConfig
from .seed_keys import SEED_KEYS, Spelling, deep_copy, seed_value, seeds_used, set_key, translate_with_origins
from .validation import validate

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 16 << 20  # a config is a few kilobytes; one of 16 MiB is no config


def read_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                raw: dict | None = None) -> tuple[dict, Spelling]:
    """Read YAML (or take a dict), translate seed keys, apply overrides; warn about keys that change
    nothing. Returns the canonical dict and how the user spelt its keys (for `validate`)."""
    if raw is None:
        if path is None:
            raise ConfigError("give a config file")
        raw = read_yaml(path)
    canonical, warnings, origins = translate_with_origins(raw)
    canonical = apply_overrides(canonical, overrides or [], origins)
    for w in warnings:
        log.warning(w)
    return canonical, Spelling(origins, seeds_used(raw))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                raw: dict | None = None) -> RunConfig:
    """`read_config`, then `validate`: the schema alone. A config that points at weights, data or a
    layout to check goes through `shardwise.resolve.load_run_config` instead."""
    return validate(*read_config(path, overrides, raw))


def apply_overrides(raw: dict, overrides: list[str], origins: dict[str, str] | None = None) -> dict:
    """Apply `a.b=value` strings (value parsed as YAML) to a canonical raw dict.

    `origins` (from `translate_with_origins`), when given, is updated to the key each override was
    written as: an error about an overridden value then names the key of the `--set`."""
    raw = deep_copy(raw)
    for item in overrides:
        written, value = _parse_override(item)
        key = written
        if key in SEED_KEYS:
            our_key, fn = SEED_KEYS[key]
            key, value = our_key, seed_value(written, value, fn)
        set_key(raw, key, value)
        if origins is not None:
            for ours in [k for k in origins if k == key or k.startswith(key + ".")]:
                del origins[ours]  # the file's spelling of this key no longer holds its value
            if written != key:
                origins[key] = written
    return raw


def _parse_override(item: str) -> tuple[str, Any]:
    """(dotted key, value) of one `--set key=value`."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. train.lr=1e-4")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or "" in key.split("."):
        raise ConfigError(f"--set {item!r} has no key before '='; write section.key=value, e.g. train.lr=1e-4")
    value = untrusted.parse_yaml(text, f"--set {item!r}", ConfigError) if text.strip() else None
    return key, value


def read_yaml(path: str | os.PathLike) -> dict:
    """Load a YAML mapping from a file, with clear messages for a missing, binary, oversized or malformed
    file, a key given twice (which YAML itself would let the second silently replace), and aliases
    (a kilobyte of nested aliases expands to gigabytes: configs write their values out). The same
    reader serves the user's config and the `config.yaml` of a run or checkpoint from elsewhere."""
    if os.path.isdir(path):
        raise ConfigError(f"config path {path} is a directory; give the YAML file in it")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist; check the path")
    text = untrusted.read_text(path, ConfigError, limit=MAX_CONFIG_BYTES,
                               advice="give a UTF-8 YAML config of a few kilobytes")
    raw = untrusted.parse_yaml(text, path, ConfigError)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, train:, ...), not a {type(raw).__name__}")
    return raw


class _NoAliasDumper(yaml.SafeDumper):
    """yaml.SafeDumper that writes a value seen twice out again instead of as an alias (which
    `read_yaml` refuses)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(cfg: RunConfig) -> str:
    """The full resolved config as YAML (saved in the run directory)."""
    return yaml.dump(cfg.model_dump(mode="json"), Dumper=_NoAliasDumper, sort_keys=False)


def config_reference() -> str:
    """A Markdown table of every key, its default and what it means (docs/config-reference.md)."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section, field in RunConfig.model_fields.items():
        cls = field.annotation
        # An optional section (lora) is Optional[Section]: list the section's own keys.
        cls = next((a for a in getattr(cls, "__args__", (cls,)) if isinstance(a, type) and issubclass(a, BaseModel)))
        for name, f in cls.model_fields.items():
            default = f.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = default.model_dump()
            text = (f.description or "").replace("|", "/")
            rows.append(f"| `{section}.{name}` | `{default!r}` | {text} |")
    return "\n".join(rows)
