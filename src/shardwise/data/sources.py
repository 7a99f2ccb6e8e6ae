"""Reading inspected input files (files.py) into text documents, streamed: the one reader that corpus
preparation and tokenizer training share.

- `.txt` (also `.text`, `.md` and any unknown extension): a document per file, or (option
  `txt_documents="paragraph"`) documents separated by blank lines, or (`"line"`, what tokenizer
  training reads) every line with its newline, as a text-mode file gives it ("\\r\\n" and a lone
  "\\r" read as "\\n").
- `.jsonl` / `.ndjson`: one JSON object per line, the document in a text field (default "text").
  A line that is not JSON, not an object, or lacks the field (or whose field is not a string) is a
  bad line: reported with file and line number, and by option either fatal (`on_bad_line="stop"`)
  or skipped and counted (`"skip"`). Blank lines are ignored.
- `.parquet` (needs the optional `pyarrow`): a string (or binary) column, read one batch of rows at
  a time; a null value is a bad line like those of JSON Lines.
- `.arrow` (needs `pyarrow`): Arrow IPC, as Hugging Face `datasets` saves a dataset to disk (a directory
  given as an input expands to its `.arrow` files, files.py), read like parquet.
- Text and JSON Lines may be gzip-compressed (`.gz`, recognised by its magic bytes).

Nothing is held in memory past `files.MAX_RECORD_BYTES` at once: a longer line, paragraph or
whole-file document stops with a DataError naming the file (and line); gzip input is bounded as
files.py says (a decompression bomb is refused). A JSON line nested too deeply or holding an
over-long integer is a bad line like any other.

Invalid UTF-8 is repaired (each bad byte sequence becomes U+FFFD) and counted: documents affected
and characters replaced, in `ReadStats`. A UTF-8 byte order mark at the start of a file is dropped.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DataError
from .files import (
    GZIP_RATIO_FLOOR,
    MAX_GZIP_BYTES,
    MAX_GZIP_RATIO,
    MAX_RECORD_BYTES,
    BadJson,
    InputFile,
    check_choice,
    import_pyarrow_parquet,
    open_input,
    parse_json_line,
    read_lines,
    read_whole,
)

logger = logging.getLogger(__name__)

TXT_DOCUMENTS = ("file", "paragraph")
# Not a preparation option: tokenizer training reads text files line by line.
TXT_LINES = "line"
ON_BAD_LINE = ("stop", "skip")

_UTF8_BOM = b"\xef\xbb\xbf"
_REPLACEMENT = "\ufffd"
_WARN_BAD_LINES = 5
_PARQUET_BATCH_ROWS = 1024


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


@dataclass(frozen=True)
class BadLineWording:
    """How a bad line is put to the user: the reader finds it, its caller names the option that skips it.

    `fix` ends the error when reading stops. `no_field` and `not_a_string` are format strings over
    `field`, `fields` (the line's first `fields_shown` keys), `kind` (JSON's name of the value's type)
    and `type` (Python's). `show_line` quotes the start of an unparsable line; `more_skipped` is logged
    once when skipped lines stop being warned about one by one.
    """

    fix: str
    no_field: str = "no field {field!r} (fields: {fields}); set text_field (--text-field)"
    not_a_string: str = "field {field!r} is {kind}, not a string"
    fields_shown: int = 10
    show_line: bool = True
    more_skipped: str | None = "more bad lines are skipped without a warning; the manifest counts them all"


# Read by `shardwise prepare` and by a run preparing its own data: both spellings.
PREPARE_WORDING = BadLineWording(
    fix="fix it, or skip such lines with on_bad_line='skip' (--on-bad-line skip; in a run's config "
    "data.on_bad_line: skip), which counts them in the manifest"
)


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

    def __init__(self, stats: ReadStats, on_bad_line: str, wording: BadLineWording) -> None:
        self.stats = stats
        self.skip = on_bad_line == "skip"
        self.wording = wording

    def __call__(self, where: str, why: str, line: bytes | None = None) -> None:
        shown = ""
        if line is not None and self.wording.show_line:
            snippet = line[:80].decode("utf-8", errors="replace").rstrip("\r\n")
            shown = f" (line starts {snippet!r})"
        message = f"{where}: {why}{shown}"
        if not self.skip:
            raise DataError(f"{message}; {self.wording.fix}")
        self.stats.bad_lines += 1
        if self.stats.first_bad_line is None:
            self.stats.first_bad_line = message
        if self.stats.bad_lines <= _WARN_BAD_LINES:
            logger.warning("skipping %s", message)
        elif self.stats.bad_lines == _WARN_BAD_LINES + 1 and self.wording.more_skipped:
            logger.warning(self.wording.more_skipped)


def _read_txt(f: InputFile, mode: str, decode: _Decoder) -> Iterator[str]:
    with open_input(f) as fh:
        if mode == "file":
            raw = read_whole(fh, f.path, "split it into smaller files, or read it by paragraphs "
                             "(txt_documents='paragraph', --txt-documents paragraph)")
            if raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM):]
            text, replaced = decode(raw)
            decode.count(replaced)
            yield text
            return
        lines: list[bytes] = []
        held = 0
        first = True
        for line in read_lines(fh, f.path):
            if first:
                first = False
                if line.startswith(_UTF8_BOM):
                    line = line[len(_UTF8_BOM):]
            if mode == TXT_LINES:
                yield from _text_lines(line, decode)
            elif line.strip():
                lines.append(line)
                held += len(line)
                if held > MAX_RECORD_BYTES:
                    raise DataError(
                        f"{f.path}: a paragraph of more than {MAX_RECORD_BYTES:,} bytes (no blank line within "
                        f"it) is not read whole; separate its documents with blank lines, or split the file"
                    )
            elif lines:
                yield _paragraph(lines, decode)
                lines, held = [], 0
        if lines:
            yield _paragraph(lines, decode)


def _text_lines(raw: bytes, decode: _Decoder) -> Iterator[str]:
    """The lines of one b"\\n"-ended line as a text-mode file reads them: "\\r\\n" and "\\r" end lines too."""
    text, replaced = decode(raw)
    decode.count(replaced)
    if "\r" not in text:
        yield text
        return
    parts = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for part in parts[:-1]:
        yield part + "\n"
    if parts[-1]:
        yield parts[-1]


def _paragraph(lines: list[bytes], decode: _Decoder) -> str:
    text, replaced = decode(b"".join(lines).rstrip(b"\r\n"))
    decode.count(replaced)
    return text


def _read_jsonl(f: InputFile, text_field: str, decode: _Decoder, bad: _BadLines) -> Iterator[str]:
    wording = bad.wording
    with open_input(f) as fh:
        for lineno, line in enumerate(read_lines(fh, f.path), 1):
            if lineno == 1 and line.startswith(_UTF8_BOM):
                line = line[len(_UTF8_BOM):]
            if not line.strip():
                continue
            where = f"{f.path}:{lineno}"
            text, replaced = decode(line)
            try:
                obj = parse_json_line(text)
            except BadJson as e:
                bad(where, str(e), line)
                continue
            if not isinstance(obj, dict):
                bad(where, f"a JSON {type(obj).__name__}, not an object with a {text_field!r} field", line)
                continue
            if text_field not in obj:
                fields = ", ".join(map(repr, list(obj)[: wording.fields_shown])) or "none"
                bad(where, wording.no_field.format(field=text_field, fields=fields))
                continue
            value = obj[text_field]
            if not isinstance(value, str):
                why = wording.not_a_string.format(field=text_field, kind=_json_kind(value), type=type(value).__name__)
                bad(where, why)
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
    try:
        pf = pq.ParquetFile(f.path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for broken files
        raise DataError(
            f"cannot read parquet file {f.path}: {_first_line(e)}; it is not a valid parquet file (cut short by an "
            f"interrupted copy, or another format named .parquet): copy it again or remove it from the inputs"
        ) from e
    _check_text_column(pf.schema_arrow, f.path, text_field, "parquet file")
    _check_parquet_sizes(pf, f.path, text_field)
    # A dictionary-encoded column can repeat one long value in every row, so it is read as a dictionary
    # (each value decoded once, rows sharing it).
    pf = pq.ParquetFile(f.path, read_dictionary=[text_field])
    batches = pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field])
    yield from _column_texts(batches, f, text_field, decode, bad, "parquet file")


def _read_arrow(f: InputFile, text_field: str, decode: _Decoder, bad: _BadLines) -> Iterator[str]:
    """An Arrow IPC file, stream format (what Hugging Face `datasets`' save_to_disk writes) or file format."""
    import pyarrow as pa

    try:
        source = pa.memory_map(f.path)
        reader = pa.ipc.open_file(source) if f.arrow_file else pa.ipc.open_stream(source)
    except Exception as e:  # ArrowInvalid and friends
        raise DataError(f"cannot read Arrow file {f.path}: {_first_line(e)}; it is damaged or not Arrow IPC: copy "
                        f"it again or remove it from the inputs") from e
    _check_text_column(reader.schema, f.path, text_field, "Arrow file")
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if f.arrow_file else reader
    yield from _column_texts(batches, f, text_field, decode, bad, "Arrow file")


def _check_text_column(schema: Any, path: str, text_field: str, what: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(
            f"{what} {path} has no column {text_field!r} (columns: "
            f"{', '.join(map(repr, schema.names[:20]))}); set text_field (--text-field)"
        )
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    is_bytes = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if not (is_text or is_bytes or str(kind) in ("string_view", "binary_view")):
        raise DataError(
            f"column {text_field!r} of {what} {path} has type {kind}, not string; "
            f"set text_field (--text-field) to a string column"
        )


def _column_texts(
    batches: Any, f: InputFile, text_field: str, decode: _Decoder, bad: _BadLines, what: str
) -> Iterator[str]:
    """The text of column `text_field` of each row of record `batches`, counted as it is read and bounded
    like gzip (compressed columns inflate)."""
    import pyarrow as pa

    budget = min(MAX_GZIP_BYTES, max(GZIP_RATIO_FLOOR, MAX_GZIP_RATIO * f.bytes))
    total = row = 0
    try:
        for batch in batches:
            column = batch.column(text_field)
            # Offsets that point outside the buffers of a damaged or hostile file are refused, not followed.
            column.validate(full=True)
            if pa.types.is_dictionary(column.type):
                values = column.dictionary.to_pylist()
                rows = [None if i is None else values[i] for i in column.indices.to_pylist()]
            else:
                rows = column.to_pylist()
            for value in rows:
                row += 1
                if value is None:
                    bad(f"{f.path}: row {row}", f"column {text_field!r} is null")
                    continue
                total += len(value)
                if total > budget:
                    raise DataError(
                        f"{f.path}: column {text_field!r} holds more than {budget:,} bytes of text by row {row}, "
                        f"more than {MAX_GZIP_RATIO} times the file's {f.bytes:,} bytes (a decompression bomb), so "
                        f"it is not read; if it is genuine, split it into smaller files"
                    )
                if isinstance(value, bytes):
                    value, replaced = decode(value)
                    decode.count(replaced)
                yield value
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot read {what} {f.path} after row {row}: {_first_line(e)}") from e


def _check_parquet_sizes(pf: Any, path: str, text_field: str) -> None:
    """Refuse a parquet file whose text column inflates like a decompression bomb (the gzip bounds of
    files.py, from the sizes its metadata states) or holds more than MAX_RECORD_BYTES a row on average."""
    try:
        md = pf.metadata
        leaves = [md.schema.column(i).path for i in range(md.num_columns)]
        index = leaves.index(text_field)
        for g in range(md.num_row_groups):
            group = md.row_group(g)
            column = group.column(index)
            inflated, stored = int(column.total_uncompressed_size), int(column.total_compressed_size)
            if inflated > max(GZIP_RATIO_FLOOR, MAX_GZIP_RATIO * stored) or inflated > MAX_GZIP_BYTES:
                raise DataError(
                    f"{path}: column {text_field!r} of row group {g} inflates from {stored:,} to {inflated:,} "
                    f"bytes (more than {MAX_GZIP_RATIO} times: a decompression bomb), so it is not read; if it is "
                    f"genuine, rewrite the file uncompressed or with fewer rows per group"
                )
            if inflated > MAX_RECORD_BYTES * max(1, int(group.num_rows)):
                raise DataError(f"{path}: rows of row group {g} average more than {MAX_RECORD_BYTES:,} bytes of "
                                f"{text_field!r}; split its documents")
    except DataError:
        raise
    except Exception as e:  # metadata pyarrow cannot read: the reader below says so on the first batch
        logger.debug("%s: parquet metadata not checked (%s)", path, e)


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
    wording: BadLineWording = PREPARE_WORDING,
) -> Iterator[str]:
    """Documents of the files, in order, one at a time; `stats` collects what reading found.

    `txt_documents` is one of TXT_DOCUMENTS or TXT_LINES; `wording` says how bad lines are reported.
    """
    check_choice("txt_documents", txt_documents, (*TXT_DOCUMENTS, TXT_LINES))
    check_choice("on_bad_line", on_bad_line, ON_BAD_LINE)
    stats = stats if stats is not None else ReadStats()
    decode = _Decoder(stats)
    bad = _BadLines(stats, on_bad_line, wording)
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
        elif f.format == "arrow":
            docs = _read_arrow(f, text_field, decode, bad)
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


__all__ = [
    "BadLineWording",
    "ON_BAD_LINE",
    "PREPARE_WORDING",
    "ReadStats",
    "TXT_DOCUMENTS",
    "TXT_LINES",
    "read_documents",
]
