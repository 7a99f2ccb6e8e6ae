"""Configs as files: reading YAML (one clear message for a missing, binary or malformed file, or a key
given twice), `--set a.b=value` overrides, writing the config in force, and the reference table.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import yaml
from pydantic import BaseModel

from ..errors import ConfigError
from .schema import RunConfig
from .seed_keys import SEED_KEYS, Spelling, deep_copy, seed_value, seeds_used, set_key, translate_with_origins
from .validation import validate

log = logging.getLogger(__name__)


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
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None
    return key, value


def read_yaml(path: str | os.PathLike) -> dict:
    """Load a YAML mapping from a file, with clear messages for a missing, binary or malformed file
    (and for a key given twice, which YAML itself would let the second silently replace)."""
    if os.path.isdir(path):
        raise ConfigError(f"config path {path} is a directory; give the YAML file in it")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist; check the path")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not a YAML text file: byte {e.start} is not UTF-8 (a binary file, or "
                          "another encoding); give a UTF-8 YAML config") from None
    stream = io.StringIO(text)
    stream.name = str(path)  # YAML's messages then say which file (with line and column)
    try:
        raw = yaml.load(stream, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, train:, ...), not a {type(raw).__name__}")
    return raw


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line, where it is first: 'line 5, column 1: found key ...'. PyYAML's own text
    spreads over several lines with the file name on each."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    mark = e.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
    return f"{where}: {e.problem}{context}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one,
    so a repeated section (two `train:` blocks) would silently drop every key of the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping of `node`; a ConstructorError naming both lines for a repeated key."""
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` may be overridden by the keys beside it: that is its purpose
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = key in first
            except TypeError:
                continue  # an unhashable key: SafeLoader's own check reports it
            if seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found key {key!r} a second time (first on line {first[key].line + 1}); keep one of them",
                    key_node.start_mark)
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def to_yaml(cfg: RunConfig) -> str:
    """The full resolved config as YAML (saved in the run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


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
                default = "{...}"
            text = (f.description or "").replace("|", "/")
            rows.append(f"| `{section}.{name}` | `{default!r}` | {text} |")
    return "\n".join(rows)
