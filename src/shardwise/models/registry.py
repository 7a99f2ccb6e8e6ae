"""Named model presets: a name maps to a dict of `ModelConfig` fields, and names are unique.

The built-in table is data in `shardwise/models/presets.py`; this module registers it on import, so
importing the registry always sees the built-in names.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import linecache
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import ValidationError

import shardwise.models.presets as presets
from shardwise.errors import ConfigError
from shardwise.models.config import ModelConfig


@dataclass
class _Preset:
    fields: dict[str, Any]
    origin: Optional[str]  # "file:line" of the register_preset call (None: a built-in, found in presets.py)

    def where(self, name: str) -> str:
        """The "file:line" where the preset `name` was registered (shown when the name is taken again)."""
        return self.origin or _builtin_origin(name)


_PRESETS: dict[str, _Preset] = {}

# Filled in by ModelConfig's validator from other sizes; pydantic marks them as "set" even when the
# user never wrote them, so they need care when a ModelConfig instance is overlaid on a preset.
_DERIVED_FIELDS = ("num_kv_heads", "head_dim", "intermediate_size")


def format_validation_error(err: ValidationError, what: str) -> str:
    """Turn a pydantic error into one readable message, suggesting the nearest field for unknown keys."""
    known = list(ModelConfig.model_fields)
    lines = []
    for item in err.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "(model)"
        if item["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(item["loc"][-1]), known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid fields: {', '.join(known)}"
            lines.append(f"  {loc}: unknown field{hint}")
        elif item["loc"]:
            lines.append(f"  {loc}: {item['msg']} (got {item.get('input')!r})")
        else:
            lines.append(f"  {item['msg']}")  # a whole-config check; its message names the fields
    return f"invalid {what}:\n" + "\n".join(lines)


def _caller_location() -> str:
    # Two frames up: past this helper and past register_preset, to the line that called it.
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame and frame.f_back else None
        if caller is None:
            return "<unknown>"
        return f"{caller.f_code.co_filename}:{caller.f_lineno}"
    finally:
        del frame  # break the reference cycle a frame object makes


def _builtin_origin(name: str) -> str:
    """presets.py:LINE of a built-in entry, its line found in the source when asked (data has no line)."""
    path = presets.__file__
    for number, line in enumerate(linecache.getlines(path), 1):
        if line.lstrip().startswith(f'"{name}":'):
            return f"{path}:{number}"
    return path


def register_preset(name: str, **fields: Any) -> None:
    """Register a named preset; the fields are validated now so a bad preset fails where it is written."""
    _register(name, fields, _caller_location())


def _register(name: str, fields: dict[str, Any], origin: Optional[str]) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a preset name must be a non-empty string, got {name!r}")
    if name in _PRESETS:
        raise ConfigError(
            f"model preset '{name}' is already registered (first registered at {_PRESETS[name].where(name)}); "
            f"pick another name, or call shardwise.models.unregister_preset('{name}') first to replace it"
        )
    if "preset" in fields:
        raise ConfigError(f"preset '{name}' must not set 'preset' itself; list the fields directly")
    try:
        ModelConfig(**fields)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, f"model preset '{name}'")) from None
    _PRESETS[name] = _Preset(fields=copy.deepcopy(fields), origin=origin)


def unregister_preset(name: str) -> None:
    """Remove a preset so its name can be registered again."""
    if name not in _PRESETS:
        raise ConfigError(_unknown_message(name))
    del _PRESETS[name]


def preset_names() -> list[str]:
    """All registered preset names, sorted."""
    return sorted(_PRESETS)


def get_preset(name: str) -> dict[str, Any]:
    """The fields of a preset (a copy, safe to change)."""
    if name not in _PRESETS:
        raise ConfigError(_unknown_message(name))
    return copy.deepcopy(_PRESETS[name].fields)


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(str(name), list(_PRESETS), n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return (
        f"unknown model preset '{name}'.{hint} Known presets: {', '.join(preset_names())}. "
        "Register your own with shardwise.models.register_preset(name, **fields)."
    )


def _explicit_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of `cfg` that were really given, leaving out the ones its validator derived."""
    given = set(cfg.model_fields_set) - {"preset"}
    plain = cfg.model_dump(include=given - set(_DERIVED_FIELDS))
    # A derived field counts as given only if it differs from what derivation alone produces;
    # a user who wrote exactly the derived value gets the preset's value instead (documented).
    try:
        rebuilt: ModelConfig | None = ModelConfig(**plain)
    except ValidationError:
        rebuilt = None  # the sizes only validate with the derived fields, so they were given
    for key in _DERIVED_FIELDS:
        if key in given and (rebuilt is None or getattr(cfg, key) != getattr(rebuilt, key)):
            plain[key] = getattr(cfg, key)
    return plain


def resolve_model_config(raw: dict[str, Any] | ModelConfig | None) -> ModelConfig:
    """Build a validated ModelConfig; with `preset`, the preset's fields are overlaid by the other keys."""
    if raw is None:
        return ModelConfig()
    if isinstance(raw, ModelConfig):
        if raw.preset is None:
            return raw
        overrides = _explicit_fields(raw)
        name = raw.preset
    elif isinstance(raw, dict):
        overrides = {k: v for k, v in raw.items() if k != "preset"}
        name = raw.get("preset")
    else:
        raise ConfigError(
            f"a model config must be a mapping or a ModelConfig, got {type(raw).__name__}; "
            "write the model section as key: value pairs"
        )
    fields = get_preset(name) if name is not None else {}
    fields.update(overrides)
    if name is not None:
        fields["preset"] = name
    try:
        return ModelConfig(**fields)
    except ValidationError as err:
        what = f"model config (preset '{name}' plus your overrides)" if name else "model config"
        raise ConfigError(format_validation_error(err, what)) from None


def _register_builtins() -> None:
    for name, fields in presets.PRESETS.items():
        _register(name, fields, origin=None)


_register_builtins()
