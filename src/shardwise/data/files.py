"""Input files: finding them (globs), telling their kind (format, gzip, binary or empty), opening them,
and the cache: where it lives and the keys that change when a file does.

Everything the other data modules need to know about files is here, so that this module imports no
other data module and each of them can import it.

Everything here is bounded, since the files (and what a glob finds) are not the user's own writing:

- a glob is walked by `glob_files`, not `glob.glob`: `**` enters each real directory once (a symbolic
  link back to a directory already searched, such as `a -> .`, is not followed again), at most
  `MAX_GLOB_DEPTH` levels deep, and the walk stops with a DataError past `MAX_GLOB_ENTRIES` directory
  entries or `MAX_GLOB_FILES` matches;
- gzip and zstd input (`.gz`, `.zst`, told by their magic bytes) is decompressed as it is read and
  refused (DataError naming the file) once it has inflated to more than `MAX_GZIP_RATIO` times its
  compressed size (past a floor of `GZIP_RATIO_FLOOR` bytes) or past `MAX_GZIP_BYTES`: a 1.5 MB gzip bomb
  inflates to 4 GB, real text to 3-10 times its size (zstd's best ratios on text are below 20);
- a line (`read_lines`) or a whole-file document (`read_whole`) longer than `MAX_RECORD_BYTES` is
  refused naming the file and line, read no further than that bound;
- a JSON line (`parse_json_line`) is parsed with integers of at most `MAX_INT_DIGITS` digits and a
  nesting too deep for the parser's recursion is a bad line, not a traceback.

Rules for bad files, checked for every file before any work starts (`inspect_input`): an empty
file is skipped and counted by the reader (it holds no document, so nothing is lost); a binary file
(a NUL byte, or mostly undecodable bytes, in its first 8 KiB) stops with a DataError, since it is
almost always a glob that caught the wrong file or a text in another encoding (UTF-16), which must be
converted.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import json
import logging
import os
import stat
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from ..errors import DataError
from ..untrusted import MAX_INT_DIGITS, read_json_object

logger = logging.getLogger(__name__)

FORMATS = ("auto", "txt", "jsonl", "parquet", "arrow")

_GZIP_MAGIC = b"\x1f\x8b"
_PARQUET_MAGIC = b"PAR1"
_ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message (its continuation marker)
_ARROW_FILE_MAGIC = b"ARROW1"
HF_DATASET_FILES = ("state.json", "dataset_info.json")  # a Hugging Face `datasets` save_to_disk directory
HF_DATASET_DICT = "dataset_dict.json"
MAX_HF_STATE_BYTES = 16 << 20
_REPLACEMENT = "\ufffd"
_SNIFF_BYTES = 8192
# More than this share of undecodable characters in the first 8 KiB: not UTF-8 text at all.
_BINARY_SHARE = 0.3
_EXTENSIONS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl",
               ".parquet": "parquet", ".arrow": "arrow"}
_DATA_EXTENSIONS = (".txt", ".text", ".md", ".jsonl", ".ndjson", ".json", ".parquet", ".arrow", ".gz", ".zst")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Bump when what files_key feeds changes, so that old caches are never read as new ones.
_CACHE_VERSION = 1

MiB = 1 << 20
# Globs: directory levels a `**` descends, directory entries looked at, files matched (per pattern).
MAX_GLOB_DEPTH = 32
MAX_GLOB_ENTRIES = 5_000_000
MAX_GLOB_FILES = 2_000_000
# gzip: decompressed / compressed size (real text: 3-10; a gzip bomb: about 1000), the decompressed
# size always allowed (a small file of very repetitive text), and the most any one file may inflate to.
MAX_GZIP_RATIO = 200
GZIP_RATIO_FLOOR = 16 * MiB
MAX_GZIP_BYTES = 1 << 40
# One line, one paragraph or one whole-file document: what is held in memory at once.
MAX_RECORD_BYTES = 256 * MiB


@dataclass(frozen=True)
class InputFile:
    """One input file: its path, format ("txt", "jsonl", "parquet", "arrow"), compression and size."""

    path: str
    format: str
    gzip: bool
    bytes: int
    empty: bool
    zstd: bool = False
    arrow_file: bool = False  # Arrow IPC file format (else the stream format, what `datasets` writes)


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
        matches = [pattern] if os.path.exists(pattern) else glob_files(pattern)
        files = [m for m in matches if os.path.isfile(m)]
        files += [f for m in matches if os.path.isdir(m) and _is_hf_dataset(m) for f in hf_dataset_files(m)]
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


def _is_hf_dataset(path: str) -> bool:
    if os.path.isfile(os.path.join(path, HF_DATASET_DICT)):
        splits = sorted(e.name for e in os.scandir(path) if e.is_dir() and _is_hf_dataset(e.path))
        raise DataError(
            f"{path} is a Hugging Face DatasetDict (splits {', '.join(splits) or 'none'}); give one split's "
            f"directory, such as {os.path.join(path, splits[0] if splits else 'train')}"
        )
    return all(os.path.isfile(os.path.join(path, name)) for name in HF_DATASET_FILES)


def hf_dataset_files(path: str) -> list[str]:
    """The .arrow files of a Hugging Face `datasets` directory saved with save_to_disk, in its order."""
    state_file = os.path.join(path, HF_DATASET_FILES[0])
    state = read_json_object(state_file, DataError, limit=MAX_HF_STATE_BYTES)
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{state_file} lists no data files ('_data_files'); save the dataset again")
    names = [e.get("filename") if isinstance(e, dict) else None for e in entries]
    for name in names:
        # a plain file name: a dataset's state never points outside its own directory
        if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".arrow"):
            raise DataError(f"{state_file} names a data file {name!r}, not an .arrow file in the directory")
        if not os.path.isfile(os.path.join(path, name)):
            raise DataError(f"{state_file} lists {name}, which is not in {path}; copy the dataset again")
    if state.get("_indices_data_files"):
        raise DataError(f"{path} is a dataset saved with an indices mapping (a select or shuffle not yet "
                        f"applied); save it again after dataset.flatten_indices()")
    return [os.path.join(path, name) for name in names]


def _has_magic(part: str) -> bool:
    return any(c in part for c in "*?[")


class _GlobWalk:
    """One pattern's walk: `glob.glob(pattern, recursive=True)`'s matches, bounded (see `glob_files`)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.entries = 0
        # Real directories (device, inode) each `**` of the pattern has entered: entered once only.
        self.seen: dict[int, set[tuple[int, int]]] = {}
        self.loops_skipped: list[str] = []

    def _scan(self, directory: str) -> list[os.DirEntry]:
        try:
            with os.scandir(directory or ".") as it:
                entries = list(it)
        except OSError:
            return []  # not a directory, unreadable, gone: glob.glob skips it too
        self.entries += len(entries)
        if self.entries > MAX_GLOB_ENTRIES:
            raise DataError(
                f"data file pattern {self.pattern!r} looked at more than {MAX_GLOB_ENTRIES:,} directory entries "
                f"(under {directory or '.'!r}) without finishing; narrow the pattern to the data files"
            )
        return entries

    def _enter(self, index: int, directory: str) -> bool:
        """Whether `**` number `index` enters `directory`: not when it has entered that real directory already."""
        try:
            st = os.stat(directory or ".")
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return False
        seen = self.seen.setdefault(index, set())
        key = (st.st_dev, st.st_ino)
        if key in seen:
            if len(self.loops_skipped) < 3:
                self.loops_skipped.append(directory)
            return False
        seen.add(key)
        return True

    def walk(self, base: str, parts: list[str], i: int) -> Iterator[str]:
        """Paths under `base` matching `parts[i:]`."""
        if i == len(parts):
            yield base
            return
        part = parts[i]
        if part == "**":
            yield from self._recurse(base, parts, i, 0)
        elif _has_magic(part):
            hidden_ok = part.startswith(".")
            for entry in self._scan(base):
                if (hidden_ok or not entry.name.startswith(".")) and fnmatch.fnmatchcase(entry.name, part):
                    yield from self.walk(os.path.join(base, entry.name), parts, i + 1)
        else:
            path = os.path.join(base, part)
            if os.path.lexists(path):
                yield from self.walk(path, parts, i + 1)

    def _recurse(self, base: str, parts: list[str], i: int, depth: int) -> Iterator[str]:
        """`**` (parts[i]) at `base`: zero directories, then each non-hidden subdirectory in turn."""
        if not self._enter(i, base):
            return
        last = i == len(parts) - 1
        if not last:
            yield from self.walk(base, parts, i + 1)
        elif depth == 0 and base:
            yield os.path.join(base, "")  # `**` matching no directory: the base itself, as glob gives it
        for entry in self._scan(base):
            if entry.name.startswith("."):
                continue
            path = os.path.join(base, entry.name)
            try:
                is_dir = entry.is_dir()  # follows symbolic links, as glob does
            except OSError:
                is_dir = False
            if last:
                yield path
            if is_dir:
                if depth + 1 > MAX_GLOB_DEPTH:
                    raise DataError(
                        f"data file pattern {self.pattern!r}: '**' goes more than {MAX_GLOB_DEPTH} directories "
                        f"deep (at {path!r}); is there a symbolic-link loop? Narrow the pattern (one '*' per level)"
                    )
                yield from self._recurse(path, parts, i, depth + 1)


def glob_files(pattern: str) -> list[str]:
    """What `glob.glob(pattern, recursive=True)` finds, bounded: `**` enters each real directory once
    (a symbolic link back to one already searched is not followed), at most MAX_GLOB_DEPTH levels deep;
    past MAX_GLOB_ENTRIES directory entries or MAX_GLOB_FILES matches it stops with a DataError."""
    if not _has_magic(pattern):
        return [pattern] if os.path.lexists(pattern) else []
    dir_only = pattern.endswith(os.sep)
    parts = [p for p in pattern.split(os.sep) if p]
    base = os.sep if pattern.startswith(os.sep) else ""
    walk = _GlobWalk(pattern)
    found: list[str] = []
    for path in walk.walk(base, parts, 0):
        if dir_only and not os.path.isdir(path):
            continue
        found.append(os.path.join(path, "") if dir_only else path)
        if len(found) > MAX_GLOB_FILES:
            raise DataError(
                f"data file pattern {pattern!r} matches more than {MAX_GLOB_FILES:,} paths; narrow it, or join "
                f"small files into larger ones"
            )
    if walk.loops_skipped:
        logger.info("%s: directories reached a second time (symbolic links) were searched once: %s", pattern,
                    ", ".join(walk.loops_skipped))
    return found


def resolve_inputs(inputs: Sequence[str] | str, fmt: str = "auto") -> list[InputFile]:
    """The files matching `inputs` (globs or paths), inspected; DataError for an empty glob or a bad file."""
    files = [inspect_input(p, fmt) for p in expand_files(inputs)]
    if any(f.format in ("parquet", "arrow") for f in files):
        import_pyarrow_parquet()  # fail before any work when pyarrow is missing
    return files


# --- the kind of a file ---------------------------------------------------------------------------


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.lower()
    for compressed in (".gz", ".zst"):
        name = name.removesuffix(compressed)
    ext = os.path.splitext(name)[1]
    if ext == ".json":
        raise DataError(
            f"{path}: .json files are not read, only JSON Lines (one object per line, .jsonl); convert "
            f"it, or pass format 'jsonl' (--format jsonl) if it already has one object per line"
        )
    if ext not in _EXTENSIONS:
        logger.info("%s: unknown extension, read as plain text", path)
    return _EXTENSIONS.get(ext, "txt")


class _ZstdFrames:
    """The decompressed bytes of a zstd file of one or more frames, its input fed 1 KiB at a time (a zstd
    block inflates to at most 128 KiB, so one step makes a few MB at most, whatever the file); a DataError
    naming the file when it is not valid zstd or ends inside a frame (a file cut short)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._raw = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False
        self._out = bytearray()

    def read(self, size: int) -> bytes:
        """Up to `size` decompressed bytes (fewer only at the end of the file)."""
        while len(self._out) < size:
            chunk = self._raw.read(1024)
            if not chunk:
                if self._in_frame:
                    raise DataError(f"cannot read {self.path}: the file ends inside a zstd frame (cut short?); "
                                    f"check it (`zstd -t {self.path}`) or fetch it again")
                break
            self._feed(chunk)
        out = bytes(self._out[:size])
        del self._out[:size]
        return out

    def _feed(self, chunk: bytes) -> None:
        while chunk:
            if self._frame.eof:  # the next frame
                self._frame = zstandard.ZstdDecompressor().decompressobj()
            try:
                self._out += self._frame.decompress(chunk)
            except zstandard.ZstdError as e:
                raise DataError(f"cannot read {self.path}: it is not valid zstd ({e}); check the file "
                                f"(`zstd -t {self.path}`)") from None
            self._in_frame = not self._frame.eof
            chunk = self._frame.unused_data if self._frame.eof else b""

    def close(self) -> None:
        self._raw.close()


class _BoundedDecompression(io.RawIOBase):
    """A gzip or zstd file's decompressed bytes, counted as they stream: past MAX_GZIP_RATIO times the
    compressed size (and GZIP_RATIO_FLOOR) or past MAX_GZIP_BYTES, reading stops with a DataError naming the
    file."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__()
        self.path, self.kind = path, kind
        compressed = os.path.getsize(path)
        self.allowed = min(MAX_GZIP_BYTES, max(GZIP_RATIO_FLOOR, MAX_GZIP_RATIO * compressed))
        self.compressed = compressed
        self.count = 0
        self._stream: Any = gzip.GzipFile(path, "rb") if kind == "gzip" else _ZstdFrames(path)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.kind == "gzip":
            n = self._stream.readinto(buffer)
        else:
            data = self._stream.read(len(buffer))
            n = len(data)
            buffer[:n] = data
        self.count += n
        if self.count > self.allowed:
            ratio = f"{self.count / max(1, self.compressed):,.0f} times" if self.compressed else "far more than"
            tool = "gunzip -k" if self.kind == "gzip" else "zstd -d"
            raise DataError(
                f"{self.path}: this {self.kind} file inflates to more than {self.allowed:,} bytes ({ratio} its "
                f"{self.compressed:,} compressed bytes; text compresses 3-10 times, and more than "
                f"{MAX_GZIP_RATIO} times is a decompression bomb), so it is not read; if it is genuine, "
                f"decompress it yourself (`{tool} {self.path}`) and give the uncompressed file"
            )
        return n

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


def _open_binary(path: str, gz: bool, zst: bool = False) -> BinaryIO:
    if not gz and not zst:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    stream = _BoundedDecompression(path, "gzip" if gz else "zstd")
    return io.BufferedReader(stream, buffer_size=1 << 16)  # type: ignore[return-value]


def open_input(f: InputFile) -> BinaryIO:
    """The bytes of an inspected input file, decompressed when it is gzip or zstd."""
    return _open_binary(f.path, f.gzip, f.zstd)


def read_lines(fh: BinaryIO, path: str) -> Iterator[bytes]:
    """The lines of an opened input, each with its newline; a line longer than MAX_RECORD_BYTES stops
    with a DataError naming the file and line, after reading no more than that."""
    lineno = 0
    while True:
        line = fh.readline(MAX_RECORD_BYTES + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_RECORD_BYTES:
            raise DataError(
                f"{path}:{lineno}: the line is longer than {MAX_RECORD_BYTES:,} bytes (no newline within it), "
                f"so it is not read; is it one record per line? Split it into lines (records) of reasonable size"
            )
        yield line


def read_at_most(fh: BinaryIO, limit: int) -> bytes:
    """The rest of an opened file, but no more than `limit` + 1 bytes, read in pieces (`read(limit)` would
    set aside `limit` bytes at once, however small the file)."""
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = fh.read(min(16 * MiB, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_whole(fh: BinaryIO, path: str, advice: str) -> bytes:
    """All of an opened input, which is one document; more than MAX_RECORD_BYTES stops with a DataError."""
    data = read_at_most(fh, MAX_RECORD_BYTES)
    if len(data) > MAX_RECORD_BYTES:
        raise DataError(f"{path}: one document of more than {MAX_RECORD_BYTES:,} bytes is not read whole; {advice}")
    return data


class BadJson(ValueError):
    """A line that is not usable JSON; the message says why (without file and line)."""


def _line_int(digits: str) -> int:
    if len(digits) - digits.startswith("-") > MAX_INT_DIGITS:
        raise BadJson(f"a JSON integer of {len(digits):,} digits (at most {MAX_INT_DIGITS} are read)")
    return int(digits)


_LINE_DECODER = json.JSONDecoder(parse_int=_line_int)


def parse_json_line(text: str) -> Any:
    """One JSON line, or BadJson saying why not: not JSON, an integer of more than MAX_INT_DIGITS
    digits, nesting deeper than the parser recurses (about 1,000 levels; a RecursionError)."""
    try:
        return _LINE_DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise BadJson(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except BadJson:
        raise
    except RecursionError:
        raise BadJson("JSON nested too deeply (more levels than the parser recurses; records nest a few)") from None
    except (ValueError, OverflowError) as e:  # Python's own 4,300-digit bound, a float it cannot make
        raise BadJson(f"JSON that cannot be read ({e})") from None


def inspect_input(path: str, fmt: str = "auto") -> InputFile:
    """Format, compression and size of `path`; DataError for a binary or unreadable file."""
    check_choice("format", fmt, FORMATS)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e}") from e
    magic = head[:4]
    kind = _format_of(path, fmt)
    if size == 0:
        return InputFile(path, kind, False, 0, True)
    if kind == "arrow":
        arrow_file = head == _ARROW_FILE_MAGIC
        if magic != _ARROW_STREAM_MAGIC and not arrow_file:
            raise DataError(f"{path} is not an Arrow IPC file (what Hugging Face datasets saves); rename it or "
                            f"pass the right format")
        return InputFile(path, kind, False, size, False, arrow_file=arrow_file)
    if kind == "parquet":
        if magic != _PARQUET_MAGIC:
            raise DataError(
                f"{path} is not a parquet file (it does not start with {_PARQUET_MAGIC!r}); "
                f"rename it or pass the right format"
            )
        return InputFile(path, kind, False, size, False)
    gz, zst = magic[:2] == _GZIP_MAGIC, magic == _ZSTD_MAGIC
    try:
        # Both inflate no more than the bytes asked for (about): the sniff is bounded as it is.
        with gzip.open(path, "rb") if gz else _open_binary(path, False, zst) as f:
            head = f.read(_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {path}: it looks gzip-compressed but is not valid gzip ({e})") from e
    if not head:
        return InputFile(path, kind, gz, size, True, zst)
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
    return InputFile(path, kind, gz, size, False, zst)


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
    "BadJson",
    "MAX_RECORD_BYTES",
    "expand_files",
    "file_stamps",
    "files_key",
    "glob_files",
    "import_pyarrow_parquet",
    "inspect_input",
    "open_input",
    "parse_json_line",
    "read_at_most",
    "read_lines",
    "read_whole",
    "resolve_inputs",
]
