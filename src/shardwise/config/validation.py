"""Validating a config dict into a RunConfig, with one clear message for everything wrong in it:
each key named as the user wrote it, what it takes, and for an unknown key the closest one in the
spelling of the shape the file is written in (a seed 000 file gets `learning_rate`, not `train.lr`).
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from .schema import RunConfig
from .seed_keys import HINTS, SEED_KEYS, SEED_SPELLINGS, Spelling


def validate(raw: dict, spelling: Spelling | None = None) -> RunConfig:
    """Validate a canonical dict into a RunConfig, turning pydantic's errors into one clear message
    that names each key as the user wrote it (`spelling`, from `read_config`)."""
    spelling = spelling or Spelling({}, frozenset())
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(spelling.in_user_terms(_explain(e, spelling))) from None
    except ConfigError as e:
        raise ConfigError(spelling.in_user_terms(str(e))) from None


# --- Explaining validation errors --------------------------------------------------------------------


def _explain(err: ValidationError, spelling: Spelling) -> str:
    """One line per key at fault (a value failing every member of a union is one error, not several)."""
    grouped: dict[str, tuple[list[Any], Any, list[dict]]] = {}
    for item in err.errors():
        path, field_info = _schema_path(item["loc"])
        entry = grouped.setdefault(_dotted(path), (path, field_info, []))
        entry[2].append(item)
    lines: list[str] = []
    for path, field_info, items in grouped.values():
        line = _explain_key(path, field_info, items, spelling)
        if line not in lines:
            lines.append(line)
    return "invalid config: " + "; ".join(lines)


def _explain_key(path: list[Any], field_info: Any, items: list[dict], spelling: Spelling) -> str:
    """The message for one key: unknown (with the closest key), missing, or a value that is not allowed."""
    written = spelling.written(_dotted(path)) or "(top level)"
    kinds = {item["type"] for item in items}
    value = _shown(items[0].get("input"))
    if "extra_forbidden" in kinds:
        return f"unknown key {written}{_suggest([str(p) for p in path], spelling)}"
    if "invalid_key" in kinds:
        where = _dotted(path[:-1]) or "the top level"
        return f"key {path[-1]!r} in {where} is not text; keys are names such as lr or max_steps"
    if "missing" in kinds:
        return f"{written} is required" + (" (give at least train.max_steps or train.epochs)"
                                          if written == "train" else "")
    custom = [i["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
              for i in items if i["type"] in ("value_error", "assertion_error")]
    if custom:
        # Our validators' own words; those of a section already name its keys.
        section = field_info is None or _model_in(field_info.annotation) is not None
        return "; ".join(custom) if section else f"{written} = {value}: {'; '.join(custom)}"
    allowed = _allowed(field_info, of_item=bool(path) and isinstance(path[-1], int)) if field_info else ""
    if field_info is not None and _model_in(field_info.annotation) is not None:
        return f"{written} = {value} is not a section; expected {allowed}"
    if kinds == {"literal_error"} or len(items) > 1:
        return f"{written} = {value} is not allowed; expected {allowed or items[0]['msg']}"
    msg = items[0]["msg"]
    why = msg[:1].lower() + msg[1:]
    return f"{written} = {value}: {why}" + (f"; expected {allowed}" if allowed else "")


def _dotted(path: list[Any]) -> str:
    """["data", "train_files", 1] -> "data.train_files[1]"."""
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def _shown(value: Any) -> str:
    """A value as the message shows it: its repr, cut to fit on a line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section class an annotation holds (Section, or Optional[Section]), else None."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _schema_path(loc: tuple) -> tuple[list[Any], Any]:
    """The keys (and list indexes) of an error's location, without pydantic's union-member tags, and
    the schema field the path ends in (None for an unknown key or a whole section)."""
    cls: Any = RunConfig
    field_info: Any = None
    path: list[Any] = []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
        elif cls is not None:
            path.append(part)
            field_info = cls.model_fields.get(part)
            cls = _model_in(field_info.annotation) if field_info is not None else None
            if field_info is None:
                break  # an unknown key; nothing deeper is a key of ours
        # else: a tag such as "literal['dynamic']" or "float" naming the member of a union that failed
    return path, field_info


def _allowed(field_info: Any, of_item: bool = False) -> str:
    """What a key (or, `of_item`, each item of its list) takes, in words: type, bounds and meaning
    (`a number > 0 (peak learning rate)`)."""
    annotation = field_info.annotation
    if of_item:
        lists = [a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is list]
        annotation = typing.get_args(lists[0])[0] if lists and typing.get_args(lists[0]) else Any
    kind = _kind(annotation, _bounds(field_info))
    return f"{kind} ({field_info.description})" if field_info.description else kind


def _bounds(field_info: Any) -> str:
    """A field's numeric bounds in words: '>= 0 and < 1'."""
    marks = []
    for m in field_info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                marks.append(f"{sign} {getattr(m, attr)}")
    return " and ".join(marks)


def _kind(annotation: Any, bounds: str = "") -> str:
    """`annotation` in words; numbers get `bounds` (e.g. '>= 1')."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        members = [_kind(a, bounds) for a in args if a is not type(None)]
        return " or ".join(members) + (", or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list (each {_kind(args[0]) if args else 'any value'})"
    if origin is dict or annotation is dict:
        return "a mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        keys = list(annotation.model_fields)
        return f"a mapping of keys such as {', '.join(keys[:5])}" + (", ..." if len(keys) > 5 else "")
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}
    name = names.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return f"{name} {bounds}" if bounds and annotation in (int, float) else name


def _section_class(parents: list[str]) -> type[BaseModel] | None:
    """The section class at the dotted path `parents` ([] = the whole config), else None."""
    cls: Any = RunConfig
    for part in parents:
        field_info = cls.model_fields.get(part)
        cls = _model_in(field_info.annotation) if field_info is not None else None
        if cls is None:
            return None
    return cls


def _candidates(parents: list[str], seeds: frozenset[str]) -> dict[str, str]:
    """Keys that may be meant at `parents`: name as typed there -> the key to suggest (dotted).

    A seed spelling is suggested as written in the seed shapes the file uses (a seed 000 file gets
    `learning_rate`), and as our key otherwise (`train.lr`)."""
    out: dict[str, str] = {}
    cls = _section_class(parents)
    if cls is not None:
        out.update({name: ".".join([*parents, name]) for name in cls.model_fields})
    for seed_key, shape in SEED_SPELLINGS.items():
        *seed_parents, last = seed_key.split(".")
        if seed_parents != parents:
            continue
        if shape in seeds:
            out[last] = seed_key
        elif seed_key in SEED_KEYS:
            out.setdefault(last, SEED_KEYS[seed_key][0])
    return out


def _elsewhere(seeds: frozenset[str]) -> dict[str, str]:
    """Every key of every section (`lr` -> `train.lr`) and every seed spelling (as `_candidates`
    shows it), by its last part: a key put in the wrong section is found too."""
    out: dict[str, str] = {section: section for section in RunConfig.model_fields}  # a section put inside another
    for section, section_field in RunConfig.model_fields.items():
        cls = _model_in(section_field.annotation)
        for name in cls.model_fields if cls is not None else ():
            out.setdefault(name, f"{section}.{name}")
    for seed_key, shape in SEED_SPELLINGS.items():
        if shape in seeds:
            out.setdefault(seed_key.split(".")[-1], seed_key)
        elif seed_key in SEED_KEYS:
            out.setdefault(seed_key.split(".")[-1], SEED_KEYS[seed_key][0])
    return out


# A key where the unknown one stands wins over an equally close key of another section, which must be
# closer to be suggested at all: a key put in the wrong section is usually spelt right.
_HERE_CUTOFF, _ELSEWHERE_CUTOFF, _HERE_BONUS = 0.6, 0.8, 0.05


def _closest(name: str, here: dict[str, str], elsewhere: dict[str, str]) -> str | None:
    """The suggestion whose typed name is closest to `name` (case ignored), if close enough."""
    best: tuple[float, str] | None = None
    for candidates, cutoff, bonus in ((here, _HERE_CUTOFF, _HERE_BONUS), (elsewhere, _ELSEWHERE_CUTOFF, 0.0)):
        for typed, suggestion in candidates.items():
            ratio = difflib.SequenceMatcher(None, name.lower(), typed.lower()).ratio()
            if ratio >= cutoff and (best is None or ratio + bonus > best[0]):
                best = (ratio + bonus, suggestion)
    return best[1] if best else None


def _suggest(loc: list[str], spelling: Spelling) -> str:
    """'; did you mean KEY?' for an unknown key, or the keys valid where it stands."""
    name, parents = loc[-1], loc[:-1]
    here = _candidates(parents, spelling.seeds)
    hint = HINTS.get(name)
    if hint is not None and ("." in hint or hint in here):
        return f"; did you mean {spelling.written(here.get(hint, hint))}?"
    close = _closest(name, here, _elsewhere(spelling.seeds))
    if close is not None:
        return f"; did you mean {spelling.written(close)}?"
    valid = [typed for typed, key in here.items() if key == ".".join([*parents, typed])]
    return f"; valid keys here: {', '.join(valid)}" if valid else ""
