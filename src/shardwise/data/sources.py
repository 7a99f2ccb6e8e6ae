"""Reading raw inputs into documents: `.txt`, `.jsonl` and `.parquet` files, streamed.

- `.txt` (also `.text`, `.md` and any unknown extension): a document per file, or (option
  `txt_documents="paragraph"`) documents separated by blank lines.
- `.jsonl` / `.ndjson`: one JSON object per line, the document in a text field (default "text").
  A line that is not JSON, not an object, or lacks the field (or whose field is not a string) is a
  bad line: reported with file and line number, and by option either fatal (`on_bad_line="stop"`)
  or skipped and counted (`"skip"`). Blank lines are ignored.
- `.parquet` (needs the optional `pyarrow`): a string (or binary) column, read one batch of rows at
  a time; a null value is a bad line like those of JSON Lines.
- Text and JSON Lines may be gzip-compressed (`.gz`, recognised by its magic bytes).

Rules for bad files, checked for every file before any work starts (`inspect_input`): an empty
file is skipped and counted (it holds no document, so nothing is lost); a binary file (a NUL byte,
or mostly undecodable bytes, in its first 8 KiB) stops with a DataError, since it is almost always a
glob that caught the wrong file or a text in another encoding (UTF-16), which must be converted.

Invalid UTF-8 is repaired (each bad byte sequence becomes U+FFFD) and counted: documents affected
and characters replaced, in `ReadStats`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import DataError

logger = logging.getLogger(__name__)

FORMATS = ("auto", "txt", "jsonl", "parquet")
TXT_DOCUMENTS = ("file", "paragraph")
ON_BAD_LINE = ("stop", "skip")

_GZIP_MAGIC = b"\x1f\x8b"
_PARQUET_MAGIC = b"PAR1"
_UTF8_BOM = b"\xef\xbb\xbf"
_REPLACEMENT = "\ufffd"
_SNIFF_BYTES = 8192
# More than this share of undecodable characters in the first 8 KiB: not UTF-8 text at all.
_BINARY_SHARE = 0.3
_WARN_BAD_LINES = 5
_PARQUET_BATCH_ROWS = 1024
_EXTENSIONS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl",
               ".parquet": "parquet"}


@dataclass(frozen=True)
class InputFile:
    """One input file: its path, format ("txt", "jsonl", "parquet"), compression and size."""

    path: str
    format: str
    gzip: bool
    bytes: int
    empty: bool


@dataclass
class ReadStats:
    """What reading found: documents read, bad lines skipped, empty files, UTF-8 repairs."""

    documents: int = 0
    bad_lines: int = 0
    empty_files: int = 0
    invalid_utf8_documents: int = 0
    replaced_chars: int = 0
    first_bad_line: str | None = None
    per_file: dict[str, int] = field(default_factory=dict)


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


class _Decoder:
    """UTF-8 decoding that repairs invalid bytes and counts what it repaired."""

    def __init__(self, stats: ReadStats) -> None:
        self.stats = stats

    def __call__(self, raw: bytes) -> tuple[str, int]:
        """(text, characters replaced); the caller counts the document once it keeps it."""
        try:
            return raw.decode("utf-8"), 0
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            # U+FFFD that was already in the input is not a repair.
            return text, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode())

    def count(self, replaced: int) -> None:
        """Record a kept document that needed `replaced` repairs."""
        if replaced:
            self.stats.invalid_utf8_documents += 1
            self.stats.replaced_chars += replaced


def _fix_surrogates(text: str) -> tuple[str, int]:
    """Lone surrogates (from JSON `\\ud800` escapes) cannot be encoded: replace them like bad UTF-8."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        before = text.count(_REPLACEMENT)
        fixed = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
        return fixed, fixed.count(_REPLACEMENT) - before


class _BadLines:
    """Reports bad lines: raise (stop) or count and warn about the first few (skip)."""

    def __init__(self, stats: ReadStats, on_bad_line: str) -> None:
        self.stats = stats
        self.skip = on_bad_line == "skip"

    def __call__(self, where: str, why: str, line: bytes | None = None) -> None:
        shown = ""
        if line is not None:
            snippet = line[:80].decode("utf-8", errors="replace").rstrip("\r\n")
            shown = f" (line starts {snippet!r})"
        message = f"{where}: {why}{shown}"
        if not self.skip:
            # Read by `shardwise prepare` and by a run preparing its own data: both spellings.
            raise DataError(
                f"{message}; fix it, or skip such lines with on_bad_line='skip' (--on-bad-line skip; in a "
                f"run's config data.on_bad_line: skip), which counts them in the manifest"
            )
        self.stats.bad_lines += 1
        if self.stats.first_bad_line is None:
            self.stats.first_bad_line = message
        if self.stats.bad_lines <= _WARN_BAD_LINES:
            logger.warning("skipping %s", message)
        elif self.stats.bad_lines == _WARN_BAD_LINES + 1:
            logger.warning("more bad lines are skipped without a warning; the manifest counts them all")


def _read_txt(f: InputFile, mode: str, decode: _Decoder) -> Iterator[str]:
    with _open_binary(f.path, f.gzip) as fh:
        if mode == "file":
            raw = fh.read()
            if raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM):]
            text, replaced = decode(raw)
            decode.count(replaced)
            yield text
            return
        lines: list[bytes] = []
        first = True
        for line in fh:
            if first:
                first = False
                if line.startswith(_UTF8_BOM):
                    line = line[len(_UTF8_BOM):]
            if line.strip():
                lines.append(line)
            elif lines:
                yield _paragraph(lines, decode)
                lines = []
        if lines:
            yield _paragraph(lines, decode)


def _paragraph(lines: list[bytes], decode: _Decoder) -> str:
    text, replaced = decode(b"".join(lines).rstrip(b"\r\n"))
    decode.count(replaced)
    return text


def _read_jsonl(f: InputFile, text_field: str, decode: _Decoder, bad: _BadLines) -> Iterator[str]:
    with _open_binary(f.path, f.gzip) as fh:
        for lineno, line in enumerate(fh, 1):
            if lineno == 1 and line.startswith(_UTF8_BOM):
                line = line[len(_UTF8_BOM):]
            if not line.strip():
                continue
            where = f"{f.path}:{lineno}"
            text, replaced = decode(line)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                bad(where, f"not valid JSON ({e.msg} at column {e.colno})", line)
                continue
            if not isinstance(obj, dict):
                bad(where, f"a JSON {type(obj).__name__}, not an object with a {text_field!r} field", line)
                continue
            if text_field not in obj:
                fields = ", ".join(map(repr, list(obj)[:10])) or "none"
                bad(where, f"no field {text_field!r} (fields: {fields}); set text_field (--text-field)")
                continue
            value = obj[text_field]
            if not isinstance(value, str):
                bad(where, f"field {text_field!r} is {_json_kind(value)}, not a string")
                continue
            value, more = _fix_surrogates(value)
            # Repairs of the raw line land in this document's text (JSON strings hold most of a line).
            decode.count(replaced + more)
            yield value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _read_parquet(f: InputFile, text_field: str, decode: _Decoder, bad: _BadLines) -> Iterator[str]:
    pq = import_pyarrow_parquet()
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(f.path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for broken files
        raise DataError(
            f"cannot read parquet file {f.path}: {_first_line(e)}; it is not a valid parquet file (cut short by an "
            f"interrupted copy, or another format named .parquet): copy it again or remove it from the inputs"
        ) from e
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"parquet file {f.path} has no column {text_field!r} (columns: "
            f"{', '.join(map(repr, schema.names[:20]))}); set text_field (--text-field)"
        )
    kind = schema.field(text_field).type
    is_text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    is_bytes = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if not (is_text or is_bytes or str(kind) in ("string_view", "binary_view")):
        raise DataError(
            f"column {text_field!r} of parquet file {f.path} has type {kind}, not string; "
            f"set text_field (--text-field) to a string column"
        )
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if value is None:
                    bad(f"{f.path}: row {row}", f"column {text_field!r} is null")
                    continue
                if isinstance(value, bytes):
                    value, replaced = decode(value)
                    decode.count(replaced)
                yield value
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot read parquet file {f.path} after row {row}: {_first_line(e)}") from e


def _first_line(e: Exception) -> str:
    """pyarrow's messages run over several lines; the first says what is wrong, and a message stays one line."""
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def read_documents(
    files: Sequence[InputFile],
    *,
    text_field: str = "text",
    txt_documents: str = "file",
    on_bad_line: str = "stop",
    stats: ReadStats | None = None,
) -> Iterator[str]:
    """Documents of the files, in order, one at a time; `stats` collects what reading found."""
    check_choice("txt_documents", txt_documents, TXT_DOCUMENTS)
    check_choice("on_bad_line", on_bad_line, ON_BAD_LINE)
    stats = stats if stats is not None else ReadStats()
    decode = _Decoder(stats)
    bad = _BadLines(stats, on_bad_line)
    for f in files:
        if f.empty:
            stats.empty_files += 1
            stats.per_file[f.path] = 0
            logger.warning("skipping empty file %s", f.path)
            continue
        if f.format == "txt":
            docs = _read_txt(f, txt_documents, decode)
        elif f.format == "jsonl":
            docs = _read_jsonl(f, text_field, decode, bad)
        elif f.format == "parquet":
            docs = _read_parquet(f, text_field, decode, bad)
        else:  # inspect_input only makes the formats above
            raise AssertionError(f.format)
        n = 0
        try:
            for doc in docs:
                n += 1
                yield doc
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"cannot read {f.path} (after {n} documents): {e}") from e
        stats.documents += n
        stats.per_file[f.path] = n


def resolve_inputs(inputs: Sequence[str] | str, fmt: str = "auto") -> list[InputFile]:
    """The files matching `inputs` (globs or paths), inspected; DataError for an empty glob or a bad file."""
    from .pretrain import expand_files

    files = [inspect_input(p, fmt) for p in expand_files(inputs)]
    if any(f.format == "parquet" for f in files):
        import_pyarrow_parquet()  # fail before any work when pyarrow is missing
    return files


__all__ = [
    "FORMATS",
    "InputFile",
    "ON_BAD_LINE",
    "ReadStats",
    "TXT_DOCUMENTS",
    "import_pyarrow_parquet",
    "inspect_input",
    "open_input",
    "read_documents",
    "resolve_inputs",
]
