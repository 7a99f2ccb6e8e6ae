"""Input files: finding them (globs), telling their kind (format, gzip, binary or empty), opening them,
and the cache: where it lives and the keys that change when a file does.

Everything the other data modules need to know about files is here, so that this module imports no
other data module and each of them can import it.

Rules for bad files, checked for every file before any work starts (`inspect_input`): an empty
file is skipped and counted by the reader (it holds no document, so nothing is lost); a binary file
(a NUL byte, or mostly undecodable bytes, in its first 8 KiB) stops with a DataError, since it is
almost always a glob that caught the wrong file or a text in another encoding (UTF-16), which must be
converted.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import DataError

logger = logging.getLogger(__name__)

FORMATS = ("auto", "txt", "jsonl", "parquet")

_GZIP_MAGIC = b"\x1f\x8b"
_PARQUET_MAGIC = b"PAR1"
_REPLACEMENT = "\ufffd"
_SNIFF_BYTES = 8192
# More than this share of undecodable characters in the first 8 KiB: not UTF-8 text at all.
_BINARY_SHARE = 0.3
_EXTENSIONS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl",
               ".parquet": "parquet"}
_DATA_EXTENSIONS = (".txt", ".text", ".md", ".jsonl", ".ndjson", ".json", ".parquet", ".gz")
# Bump when what files_key feeds changes, so that old caches are never read as new ones.
_CACHE_VERSION = 1


@dataclass(frozen=True)
class InputFile:
    """One input file: its path, format ("txt", "jsonl", "parquet"), compression and size."""

    path: str
    format: str
    gzip: bool
    bytes: int
    empty: bool


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """`value` if it is one of `choices`, else a DataError naming the option and the choices."""
    if value not in choices:
        raise DataError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def import_pyarrow_parquet() -> Any:
    """`pyarrow.parquet`, or a DataError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(
            f"reading .parquet files needs pyarrow, which is not installed ({e}); "
            f"install it with `pip install pyarrow` (or `pip install shardwise[parquet]`)"
        ) from e
    return pq


# --- finding files --------------------------------------------------------------------------------


def expand_files(globs: Sequence[str] | str) -> list[str]:
    """Sorted, de-duplicated files matching the glob patterns; a pattern that matches nothing fails."""
    if isinstance(globs, (str, os.PathLike)):
        globs = [str(globs)]
    if not globs:
        raise DataError("no data files given; set data.train_files to one or more paths or glob patterns")
    found: set[str] = set()
    for pattern in globs:
        pattern = os.path.expanduser(str(pattern))
        # A literal path wins, so that names containing [ ] or ? are not read as patterns.
        matches = [pattern] if os.path.exists(pattern) else glob.glob(pattern, recursive=True)
        files = [m for m in matches if os.path.isfile(m)]
        if not files:
            if any(os.path.isdir(m) for m in matches):
                # A directory named like a file (`x.jsonl/`) most often holds files of that kind.
                ext = os.path.splitext(pattern.rstrip("/"))[1]
                example = os.path.join(pattern, "*" + (ext if ext in _DATA_EXTENSIONS else ".txt"))
                raise DataError(
                    f"data file pattern {pattern!r} matches only directories, not files (and none is a "
                    f"`shardwise prepare` directory, which holds a manifest.json); use a pattern for the "
                    f"files in it, such as '{example}'"
                )
            raise DataError(
                f"data file pattern {pattern!r} matches no file (working directory {os.getcwd()}); "
                f"check the path, or quote a glob such as 'corpora/austen/*.txt'"
            )
        found.update(os.path.abspath(f) for f in files)
    return sorted(found)


def resolve_inputs(inputs: Sequence[str] | str, fmt: str = "auto") -> list[InputFile]:
    """The files matching `inputs` (globs or paths), inspected; DataError for an empty glob or a bad file."""
    files = [inspect_input(p, fmt) for p in expand_files(inputs)]
    if any(f.format == "parquet" for f in files):
        import_pyarrow_parquet()  # fail before any work when pyarrow is missing
    return files


# --- the kind of a file ---------------------------------------------------------------------------


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    ext = os.path.splitext(name)[1]
    if ext == ".json":
        raise DataError(
            f"{path}: .json files are not read, only JSON Lines (one object per line, .jsonl); convert "
            f"it, or pass format 'jsonl' (--format jsonl) if it already has one object per line"
        )
    if ext not in _EXTENSIONS:
        logger.info("%s: unknown extension, read as plain text", path)
    return _EXTENSIONS.get(ext, "txt")


def _open_binary(path: str, gz: bool) -> BinaryIO:
    return gzip.open(path, "rb") if gz else open(path, "rb")  # type: ignore[return-value]


def open_input(f: InputFile) -> BinaryIO:
    """The bytes of an inspected input file, decompressed when it is gzip."""
    return _open_binary(f.path, f.gzip)


def inspect_input(path: str, fmt: str = "auto") -> InputFile:
    """Format, compression and size of `path`; DataError for a binary or unreadable file."""
    check_choice("format", fmt, FORMATS)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e}") from e
    kind = _format_of(path, fmt)
    if size == 0:
        return InputFile(path, kind, False, 0, True)
    if kind == "parquet":
        if magic != _PARQUET_MAGIC:
            raise DataError(
                f"{path} is not a parquet file (it does not start with {_PARQUET_MAGIC!r}); "
                f"rename it or pass the right format"
            )
        return InputFile(path, kind, False, size, False)
    gz = magic[:2] == _GZIP_MAGIC
    try:
        with _open_binary(path, gz) as f:
            head = f.read(_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {path}: it looks gzip-compressed but is not valid gzip ({e})") from e
    if not head:
        return InputFile(path, kind, gz, size, True)
    reason = _binary_reason(head)
    if reason:
        utf16 = head[:2] in (b"\xff\xfe", b"\xfe\xff") or head[1::2].count(0) > len(head) // 4
        hint = (
            " It looks like UTF-16 text: convert it to UTF-8 (e.g. `iconv -f UTF-16 -t UTF-8`)." if utf16 else ""
        )
        raise DataError(
            f"{path} looks like a binary file, not {kind} text ({reason} in its first "
            f"{len(head)} bytes); binary files are not skipped, so remove it from the inputs "
            f"(narrow the glob).{hint}"
        )
    return InputFile(path, kind, gz, size, False)


def _binary_reason(head: bytes) -> str | None:
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"a NUL byte at offset {nul}"
    text = head.decode("utf-8", errors="replace")
    # The last character may be a multi-byte sequence cut by the sniff window; it does not count.
    bad = text[:-1].count(_REPLACEMENT) - head.count(_REPLACEMENT.encode())
    if text and bad > _BINARY_SHARE * len(text):
        return f"{bad} of {len(text)} characters are not valid UTF-8"
    return None


# --- the cache ------------------------------------------------------------------------------------


def default_cache_dir() -> str:
    """Where tokenizers, token arrays and the measured CPU peak are cached: $SHARDWISE_CACHE, else
    ~/.cache/shardwise (data.cache_dir overrides it for data)."""
    return os.environ.get("SHARDWISE_CACHE") or str(Path.home() / ".cache" / "shardwise")


def file_stamps(files: Sequence[str]) -> list[list[Any]]:
    """[absolute path, size, modification time in ns] of each file: what cache keys hash."""
    stamps = []
    for f in files:
        st = os.stat(f)
        stamps.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return stamps


def files_key(files: Sequence[str], *extra: object) -> str:
    """Hash of file paths, sizes and modification times (plus `extra`): changes when any file does."""
    blob = json.dumps([_CACHE_VERSION, file_stamps(files), [str(e) for e in extra]])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


__all__ = [
    "FORMATS",
    "InputFile",
    "check_choice",
    "default_cache_dir",
    "expand_files",
    "file_stamps",
    "files_key",
    "import_pyarrow_parquet",
    "inspect_input",
    "open_input",
    "resolve_inputs",
]
