"""Reading what shardwise did not write in this run: bounded, checked, and one clear error per failure.

Every reader of a file from elsewhere (a checkpoint's side files, a Hugging Face directory, an
adapter, a tokenizer, a run directory, a line of data, a config) goes through these functions, so
that a damaged or hostile file ends as the caller's `ShardwiseError` naming the file (exit 2), never
as a traceback, a hang or a blow-up:

- sizes are checked before reading (`read_bytes`: a side file larger than its kind ever is is refused
  unread; a file that grows while being read is cut at the bound);
- JSON (`parse_json`) is refused past `MAX_DEPTH` levels of nesting, with integers of more than
  `MAX_INT_DIGITS` digits, or with NaN / Infinity where the caller does not allow them;
- YAML (`parse_yaml`) is read with PyYAML's safe loader, without aliases (a kilobyte of nested
  aliases expands to gigabytes), within the same nesting and integer bounds, refusing a key given
  twice in one mapping;
- fields are taken with their type and range checked (`field`, `int_field`, `number_field`, ...);
- regular expressions from files run with a time bound (`bounded_fullmatch`, the `regex` package).

The caller passes the error class to raise (CheckpointError, DataError, ConfigError) and a few words
of advice; the message always starts with the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import regex
import yaml

from .errors import ShardwiseError

MiB = 1 << 20
MAX_SIDE_FILE = 64 * MiB      # a config.json, trainer_state.json, adapter_config.json, manifest, RNG state
MAX_DEPTH = 100               # nesting of JSON and YAML: no file shardwise reads nests half as deep
MAX_INT_DIGITS = 40           # integers in side files: anything longer is no size or count (2**128 ~ 39 digits)
REGEX_SECONDS = 1.0           # one regular expression from a file against one name

ErrorType = type[ShardwiseError]


def fail(error: ErrorType, source: str | os.PathLike, problem: str, advice: str = "") -> NoReturn:
    """Raise `error` with one paragraph: the file, what is wrong with it, and what to do."""
    raise error(f"{source}: {problem}" + (f"; {advice}" if advice else ""))


# --- bytes and text ------------------------------------------------------------------------------------


def read_bytes(path: str | os.PathLike, error: ErrorType, *, limit: int = MAX_SIDE_FILE, advice: str = "") -> bytes:
    """The bytes of a regular file of at most `limit` bytes: a larger one, a directory, a device or a
    FIFO (which could block forever) is refused unread."""
    try:
        st = os.stat(path)
    except OSError as e:
        fail(error, path, f"cannot be read ({e.strerror or e})", advice)
    if not stat.S_ISREG(st.st_mode):
        fail(error, path, "is not a regular file", advice)
    if st.st_size > limit:
        fail(error, path, f"is {st.st_size:,} bytes, more than the {limit:,} such a file can be", advice)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        fail(error, path, f"cannot be read ({e.strerror or e})", advice)
    if len(data) > limit:
        fail(error, path, f"grew past {limit:,} bytes while being read", advice)
    return data


def decode_text(data: bytes, source: str | os.PathLike, error: ErrorType, advice: str = "") -> str:
    """`data` as UTF-8 (a BOM is dropped); a byte that is not UTF-8 fails naming its offset."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        fail(error, source, f"is not a UTF-8 text file: byte {e.start:,} is not UTF-8 (0x{data[e.start]:02x}: "
             "a binary file, or another encoding)", advice)


def read_text(path: str | os.PathLike, error: ErrorType, *, limit: int = MAX_SIDE_FILE, advice: str = "") -> str:
    """`read_bytes` decoded as UTF-8."""
    return decode_text(read_bytes(path, error, limit=limit, advice=advice), path, error, advice)


# --- JSON ----------------------------------------------------------------------------------------------


def parse_json(text: str | bytes, source: str | os.PathLike, error: ErrorType, *, allow_nonfinite: bool = False,
               advice: str = "") -> Any:
    """One JSON document, within `MAX_DEPTH` and `MAX_INT_DIGITS`; NaN and Infinity only when
    `allow_nonfinite` (shardwise writes them in metrics for a diverged loss, nowhere else)."""
    if isinstance(text, bytes):
        text = decode_text(text, source, error, advice)
    # The exact scan only where it can find too deep a nest: fewer brackets than MAX_DEPTH cannot.
    depth = nesting_depth(text) if text.count("[") + text.count("{") > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        fail(error, source, f"nests {depth} levels deep, more than the {MAX_DEPTH} allowed", advice)
    try:
        return json.loads(text, parse_int=_bounded_int, parse_constant=_constant(allow_nonfinite))
    except _TooLong as e:
        fail(error, source, f"holds an integer of {e.args[0]:,} digits", advice)
    except _NonFinite as e:
        fail(error, source, f"holds {e.args[0]}, which is not a number this file can hold", advice)
    except (ValueError, RecursionError) as e:  # not JSON (json.JSONDecodeError is a ValueError)
        fail(error, source, f"is not valid JSON ({e})", advice)


def read_json(path: str | os.PathLike, error: ErrorType, *, limit: int = MAX_SIDE_FILE, allow_nonfinite: bool = False,
              advice: str = "") -> Any:
    """A whole JSON file of at most `limit` bytes."""
    return parse_json(read_bytes(path, error, limit=limit, advice=advice), path, error,
                      allow_nonfinite=allow_nonfinite, advice=advice)


def read_json_object(path: str | os.PathLike, error: ErrorType, *, limit: int = MAX_SIDE_FILE,
                     advice: str = "") -> dict:
    """`read_json` of a file that must hold a JSON object."""
    doc = read_json(path, error, limit=limit, advice=advice)
    if not isinstance(doc, dict):
        fail(error, path, f"holds {kind_of(doc)}, not a JSON object", advice)
    return doc


def nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, outside strings (a scan, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in _brackets_and_quotes(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _brackets_and_quotes(text: str) -> str:
    """The characters of `text` that can change nesting: cheap to scan even for a long line. A text
    without brackets is returned empty; one without backslashes or quotes keeps only brackets."""
    if "[" not in text and "{" not in text:
        return ""
    if '"' not in text:
        return "".join(c for c in text if c in "[]{}")
    return "".join(c for c in text if c in '[]{}"\\')


class _TooLong(ValueError):
    pass


class _NonFinite(ValueError):
    pass


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooLong(len(digits.lstrip("-")))
    return int(digits)


def _constant(allow: bool) -> Callable[[str], float]:
    def parse(name: str) -> float:
        if not allow:
            raise _NonFinite(name)
        return float(name)
    return parse


# --- YAML ----------------------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader without aliases, within `MAX_DEPTH`, integers within `MAX_INT_DIGITS`, and no
    key given twice in one mapping (plain YAML keeps the last one: a repeated `train:` block would
    silently drop every key of the first)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"found the alias *{event.anchor}: aliases (*name, <<: *name) are not accepted; "
                "write the values out", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nests more than {MAX_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = sum(c.isalnum() for c in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"found an integer of {digits:,} digits",
                                                    node.start_mark)
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
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


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def parse_yaml(text: str, source: str | os.PathLike, error: ErrorType, advice: str = "") -> Any:
    """One YAML document, bounded as `_BoundedLoader` says; a problem names the file, line and column."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        fail(error, source, f"is not valid YAML: {yaml_problem(e)}", advice)
    except (ValueError, RecursionError) as e:  # a value PyYAML's constructors cannot make
        fail(error, source, f"is not valid YAML ({e})", advice)


def read_yaml(path: str | os.PathLike, error: ErrorType, *, limit: int = MAX_SIDE_FILE, advice: str = "") -> Any:
    """A whole YAML file of at most `limit` bytes."""
    return parse_yaml(read_text(path, error, limit=limit, advice=advice), path, error, advice)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line, where it is first: 'line 5, column 1: found key ...'. PyYAML's own text
    spreads over several lines with the file name on each."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    mark = e.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
    return f"{where}: {e.problem}{context}"


# --- fields --------------------------------------------------------------------------------------------

_MISSING: Any = object()


def kind_of(value: Any) -> str:
    """How JSON would call `value`'s type: 'an object', 'a list', 'a string', ..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def int_field(doc: dict, key: str, source: str | os.PathLike, error: ErrorType, *, lo: int = 0, hi: int = 2**62,
              default: Any = _MISSING, advice: str = "") -> int:
    """`doc[key]` as an int in [lo, hi] (a bool is not an int; 4.0 is 4); `default` when absent or null."""
    value = doc.get(key)
    if value is None:
        if default is not _MISSING:
            return default
        fail(error, source, f"has no {key!r}", advice)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        fail(error, source, f"{key!r} is {kind_of(value)} ({_short(value)}), not a whole number", advice)
    if not lo <= value <= hi:
        fail(error, source, f"{key!r} is {value:,}, outside {lo:,}..{hi:,}", advice)
    return value


def number_field(doc: dict, key: str, source: str | os.PathLike, error: ErrorType, *, lo: float = -math.inf,
                 hi: float = math.inf, default: Any = _MISSING, advice: str = "") -> float:
    """`doc[key]` as a finite float in [lo, hi]; `default` when absent or null."""
    value = doc.get(key)
    if value is None:
        if default is not _MISSING:
            return default
        fail(error, source, f"has no {key!r}", advice)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(error, source, f"{key!r} is {kind_of(value)} ({_short(value)}), not a number", advice)
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        fail(error, source, f"{key!r} is {value}, outside {lo}..{hi}", advice)
    return value


def str_field(doc: dict, key: str, source: str | os.PathLike, error: ErrorType, *, max_len: int = 1024,
              default: Any = _MISSING, advice: str = "") -> str:
    """`doc[key]` as a string of at most `max_len` characters; `default` when absent or null."""
    value = doc.get(key)
    if value is None:
        if default is not _MISSING:
            return default
        fail(error, source, f"has no {key!r}", advice)
    if not isinstance(value, str):
        fail(error, source, f"{key!r} is {kind_of(value)} ({_short(value)}), not a string", advice)
    if len(value) > max_len:
        fail(error, source, f"{key!r} is {len(value):,} characters long, more than {max_len:,}", advice)
    return value


def bool_field(doc: dict, key: str, source: str | os.PathLike, error: ErrorType, *, default: Any = _MISSING,
               advice: str = "") -> bool:
    """`doc[key]` as a JSON boolean; `default` when absent or null."""
    value = doc.get(key)
    if value is None:
        if default is not _MISSING:
            return default
        fail(error, source, f"has no {key!r}", advice)
    if not isinstance(value, bool):
        fail(error, source, f"{key!r} is {kind_of(value)} ({_short(value)}), not true or false", advice)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def ascii_digits(text: str) -> bool:
    """Whether `text` is a non-empty run of the ASCII digits 0-9 (str.isdigit also takes '٣' and '³')."""
    return bool(text) and text.isascii() and text.isdigit()


# --- regular expressions -------------------------------------------------------------------------------


def compile_pattern(pattern: str, source: str | os.PathLike, error: ErrorType, *, max_len: int = 1000,
                    advice: str = "") -> regex.Pattern:
    """A regular expression from a file, compiled with the `regex` package (which bounds matching time)."""
    if not isinstance(pattern, str):
        fail(error, source, f"the pattern is {kind_of(pattern)}, not a string", advice)
    if len(pattern) > max_len:
        fail(error, source, f"holds a regular expression of {len(pattern):,} characters, more than {max_len:,}", advice)
    try:
        return regex.compile(pattern, flags=regex.VERSION0)
    except (regex.error, ValueError, OverflowError, RecursionError) as e:
        fail(error, source, f"holds {pattern!r}, which is not a regular expression ({e})", advice)


def bounded_fullmatch(pattern: regex.Pattern, name: str, source: str | os.PathLike, error: ErrorType, *,
                      seconds: float = REGEX_SECONDS, advice: str = "") -> bool:
    """Whether `pattern` matches the whole of `name`, giving up (an error naming the file) after
    `seconds`: a pattern like (a+)+$ takes exponential time on some names."""
    try:
        return pattern.fullmatch(name, timeout=seconds) is not None
    except TimeoutError:
        fail(error, source, f"the regular expression {pattern.pattern!r} took more than {seconds:g} s to match "
             f"{name!r} (it backtracks without end)", advice)


# --- paths ---------------------------------------------------------------------------------------------


def inside(path: Path, directory: Path) -> bool:
    """Whether `path`, symbolic links resolved, lies in `directory` (resolved too)."""
    try:
        path.resolve(strict=False).relative_to(directory.resolve(strict=False))
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symbolic-link loop (Python < 3.13)
        return False
    return True
