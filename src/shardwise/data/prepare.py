"""Corpus preparation: raw files -> clean documents -> tokens (worker processes) -> token shards.

`prepare_corpus` streams. Documents are read one at a time (sources.py), too short ones dropped, and
grouped into chunks of about 256K characters; a pool of worker processes cleans the chunks (the quality
rules of quality.py), computes each document's keys (its digest and, for near duplicates, its MinHash
band keys: duplicates.py) and tokenises them, at most two chunks per worker in flight. The main process
drops the documents whose keys repeat an earlier document's and writes the rest to the current shard in
input order, so the output is the same for any number of workers. Peak memory is bounded by chunk size x
workers and does not grow with the corpus; the one structure that does is the set of keys seen
(`DuplicateIndex`: 8 bytes per unique document and key column, about 0.8 GB per 100 million documents
for exact deduplication, 15 times that with the default 14 bands of near deduplication).

The layout written is described in shards.py (`TokenShards` reads it). Everything is written into a
temp directory next to `out` (`.NAME.tmp-HOST-PID-XXXX`), the manifest last, and the finished
directory is renamed to `out`: an interrupted run leaves at most a temp directory (removed by the
next run once its process is gone) and never a half-written `out`. An existing prepared `out` is only
replaced with `overwrite=True`, and only after the new one is complete.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import DataError
from ..files import fsync_dir, write_json_atomic
from ..untrusted import read_json_object
from .boilerplate import BoilerplateLines, check_min_docs, sketch_width
from .duplicates import DuplicateIndex, check_near, document_keys
from .files import FORMATS, InputFile, check_choice, default_cache_dir, file_stamps, resolve_inputs
from .quality import quality_problem
from .shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DTYPE,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    TokenShards,
    shard_dtype,
    shard_names,
    token_dtype,
)
from .sources import ON_BAD_LINE, TXT_DOCUMENTS, ReadStats, read_documents

logger = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_MIN_CHARS = 1
QUALITY_LEVELS = ("none", "default")  # data.quality: off, or the rules of data/quality.py
DEDUP_LEVELS = ("none", "exact", "near")  # data.dedup: near adds MinHash LSH (data/duplicates.py) to exact
REMOVED_SAMPLES = 20  # removals kept beside the manifest for each quality rule, near duplicates, boilerplate lines
REMOVED_SAMPLE_CHARS = 2000  # of each sample, its start
REMOVED_SAMPLES_FILE = "removed_samples.jsonl"
NEAR_DUPLICATE = "near_duplicate"  # the rule name of near duplicates in the samples
BOILERPLATE_LINE = "boilerplate_line"  # the rule name of lines removed as boilerplate in the samples
KEYS_FILE = "document_keys.bin"  # a part's documents' keys (uint64, documents x key columns)
TRUNCATED_FILE = "truncated.bin"  # a part's ordinals (int64) of the documents max_length cut
# A chunk is the unit of work sent to a worker: big enough to amortise the transfer, small enough
# that (chunks in flight) x (chunk size) stays a few tens of MB.
_CHUNK_CHARS = 1 << 18
_CHUNK_DOCS = 4096
_IN_FLIGHT_PER_WORKER = 2
_ENV_PARALLEL = "TOKENIZERS_PARALLELISM"
_NAMED_FILES = 3  # input files named in the message when none of them holds a document


def default_workers() -> int:
    """Tokenising processes by default: the usable cores, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def check_options(
    fmt: str = "auto",
    text_field: str = "text",
    txt_documents: str = "file",
    min_chars: int = DEFAULT_MIN_CHARS,
    max_length: int | None = None,
    dedup: bool | str = "exact",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_bad_line: str = "stop",
    quality: str = "none",
    near_dedup: dict[str, int] | None = None,
    boilerplate_lines: int = 0,
) -> dict[str, Any]:
    """The options that decide the output, checked; they are recorded in the manifest and key the cache."""
    check_choice("format", fmt, FORMATS)
    dedup = {True: "exact", False: "none"}.get(dedup, dedup)  # type: ignore[call-overload]
    check_choice("dedup", dedup, DEDUP_LEVELS)
    check_choice("quality", quality, QUALITY_LEVELS)
    check_choice("txt_documents", txt_documents, TXT_DOCUMENTS)
    check_choice("on_bad_line", on_bad_line, ON_BAD_LINE)
    if not isinstance(text_field, str) or not text_field:
        raise DataError(f"text_field must be a non-empty field name, got {text_field!r}")
    if int(min_chars) < 0:
        raise DataError(f"min_chars must be 0 or more, got {min_chars}")
    if max_length is not None and int(max_length) < 1:
        raise DataError(f"max_length must be at least 1 token (or None for no limit), got {max_length}")
    if int(shard_tokens) < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    return {
        "format": fmt,
        "text_field": text_field,
        "txt_documents": txt_documents,
        "min_chars": int(min_chars),
        "max_length": None if max_length is None else int(max_length),
        "dedup": dedup != "none",  # exact duplicates (a bool, as before near duplicates existed)
        "shard_tokens": int(shard_tokens),
        "on_bad_line": on_bad_line,
        # Only when on: data prepared (and cached) before these options existed keeps its cache key.
        **({"quality": quality} if quality != "none" else {}),
        **({"near_dedup": check_near(near_dedup)} if dedup == "near" else {}),
        **({"boilerplate_lines": boilerplate_lines} if check_min_docs(boilerplate_lines) else {}),
    }


def check_workers(workers: int | None) -> int:
    """Worker processes: the default for None, else `workers` checked."""
    if workers is None:
        return default_workers()
    if int(workers) < 1:
        raise DataError(f"workers must be at least 1, got {workers}")
    return int(workers)


# --- cleaning and tokenising, in the workers ------------------------------------------------------


def _raw_chunks(
    docs: Iterable[str], min_chars: int, counts: dict[str, Any], boilerplate: BoilerplateLines | None
) -> Iterator[list[str]]:
    """Documents grouped into chunks (the workers' unit of work), without the lines that earlier documents
    repeated (with `boilerplate`: in input order, so here) and without the too-short ones (counted)."""
    batch: list[str] = []
    size = 0
    for text in docs:
        if boilerplate is not None:
            cleaned = boilerplate.clean(text)
            if cleaned is not text and not cleaned.strip():
                counts["emptied_by_boilerplate"] += 1
                continue
            text = cleaned
        # strip() copies only when there is whitespace at an end; most documents pass the first test.
        if len(text) < min_chars or (min_chars and len(text.strip()) < min_chars):
            counts["dropped_short"] += 1
            continue
        batch.append(text)
        size += len(text)
        if size >= _CHUNK_CHARS or len(batch) >= _CHUNK_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


Encoded = tuple[np.ndarray, np.ndarray, np.ndarray]


def _encode_texts(tokenizer: Any, texts: list[str], max_length: int | None, dtype: np.dtype) -> Encoded:
    """(tokens with an EOS after each document, per-document lengths with the EOS, which were truncated)."""
    ids = tokenizer.encode_batch(texts)
    truncated = np.zeros(len(ids), dtype=bool)
    if max_length is not None:
        for i, x in enumerate(ids):
            if len(x) > max_length:
                ids[i] = x[:max_length]
                truncated[i] = True
    eos = tokenizer.eos_id
    for x in ids:
        x.append(eos)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return tokens, lengths, truncated


@dataclass
class _Work:
    """What a worker does to a chunk (fixed for a preparation)."""

    tokenizer: Any
    max_length: int | None
    dtype: np.dtype
    quality: bool
    dedup: bool
    near: dict[str, int] | None


@dataclass
class _Chunk:
    """A chunk after a worker: the documents the quality rules kept, tokenised, and their keys."""

    tokens: np.ndarray
    lengths: np.ndarray  # per kept document, its EOS included
    truncated: np.ndarray  # per kept document, whether max_length cut it
    keys: np.ndarray  # (kept documents, key columns) uint64; no columns without deduplication
    kept: np.ndarray  # positions in the chunk of the kept documents
    rules: list[tuple[int, str]]  # (position, rule) of each document a quality rule removed


def _process(work: _Work, texts: list[str]) -> _Chunk:
    rules: list[tuple[int, str]] = []
    if work.quality:
        for i, text in enumerate(texts):
            rule = quality_problem(text)
            if rule is not None:
                rules.append((i, rule))
    removed = {i for i, _ in rules}
    kept = np.array([i for i in range(len(texts)) if i not in removed], dtype=np.int64)
    texts = [texts[i] for i in kept] if rules else texts
    keys = document_keys(texts, work.near) if work.dedup else np.zeros((len(texts), 0), np.uint64)
    tokens, lengths, truncated = _encode_texts(work.tokenizer, texts, work.max_length, work.dtype)
    return _Chunk(tokens, lengths, truncated, keys, kept, rules)


_worker: dict[str, Any] = {}


def _init_worker(work: _Work) -> None:
    # Each worker is one core: the Rust library's own thread pool would only oversubscribe them.
    os.environ[_ENV_PARALLEL] = "false"
    # Ctrl-C goes to the whole process group; the main process handles it and stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker["work"] = work


def _process_in_worker(texts: list[str]) -> _Chunk:
    return _process(_worker["work"], texts)


@contextmanager
def _env(name: str, value: str, only_if_unset: bool = False) -> Iterator[None]:
    old = os.environ.get(name)
    if not (only_if_unset and old is not None):
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _mp_context() -> Any:
    # fork: workers start at once with the tokenizer already loaded; spawn would re-import torch
    # (seconds per worker). Where fork does not exist, spawn pickles the tokenizer instead.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


class _Workers:
    """Cleans and tokenises chunks in order: in this process (workers=1) or in a pool of worker processes."""

    def __init__(self, work: _Work, workers: int) -> None:
        self.work, self.workers = work, workers
        self.pool: ProcessPoolExecutor | None = None
        self._env: Any = None

    def __enter__(self) -> _Workers:
        if self.workers > 1:
            # A ProcessPoolExecutor, not a multiprocessing.Pool: when a worker dies (killed, out of
            # memory) its futures fail with BrokenProcessPool instead of waiting forever.
            self.pool = ProcessPoolExecutor(
                self.workers, mp_context=_mp_context(), initializer=_init_worker, initargs=(self.work,),
            )
            # Start the workers now, with the variable set, so that the tokenizers library sees its
            # parallelism as configured and does not warn in each worker about forking after threads.
            with _env(_ENV_PARALLEL, "false", only_if_unset=True):
                self.pool.submit(int).result()
        else:
            # One worker means one core, also for the Rust library's thread pool.
            self._env = _env(_ENV_PARALLEL, "false")
            self._env.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.pool is not None:
            if exc_type is not None:
                # Do not wait for chunks nobody will write: stop the workers now.
                terminate = getattr(self.pool, "terminate_workers", None)  # Python 3.14+
                if terminate is not None:
                    terminate()
                else:
                    for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
                        proc.terminate()
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self._env is not None:
            self._env.__exit__(None, None, None)

    def map(self, chunks: Iterable[list[str]]) -> Iterator[tuple[list[str], _Chunk]]:
        """(texts, processed chunk) in the order of `chunks`, with a bounded number in flight."""
        if self.pool is None:
            for texts in chunks:
                yield texts, _process(self.work, texts)
            return
        pending: deque[tuple[list[str], Future]] = deque()
        try:
            for texts in chunks:
                pending.append((texts, self.pool.submit(_process_in_worker, texts)))
                if len(pending) >= _IN_FLIGHT_PER_WORKER * self.workers:
                    texts, future = pending.popleft()
                    yield texts, future.result()
            while pending:
                texts, future = pending.popleft()
                yield texts, future.result()
        except BrokenProcessPool as e:
            raise DataError(
                f"a tokenising worker process died ({e}); if the system ran out of memory, use fewer "
                f"workers (--workers) or set max_length"
            ) from e


# --- writing --------------------------------------------------------------------------------------


class ShardWriter:
    """Appends the token stream to shard files of `shard_tokens` tokens, with per-shard document indexes."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.total = 0
        self._files: tuple[Any, Any] | None = None

    def _open(self) -> None:
        names = shard_names(len(self.shards))
        self._files = (open(self.directory / names[0], "wb"), open(self.directory / names[1], "wb"))
        self._hashes = (hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16))
        self._names, self._first, self._tokens, self._docs = names, self.total, 0, 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: their tokens (EOS included) and their lengths."""
        starts = self.total + np.cumsum(lengths) - lengths
        pos = 0
        while pos < tokens.size:
            if self._files is None:
                self._open()
            take = min(self.shard_tokens - self._tokens, tokens.size - pos)
            piece = np.ascontiguousarray(tokens[pos : pos + take], dtype=self.dtype)
            lo, hi = np.searchsorted(starts, [self.total, self.total + take], side="left")
            index = (starts[lo:hi] - self._first).astype(INDEX_DTYPE)
            for f, h, data in zip(self._files, self._hashes, (piece, index)):  # type: ignore[arg-type]
                f.write(memoryview(data).cast("B"))
                h.update(memoryview(data).cast("B"))
            self._tokens += take
            self._docs += int(hi - lo)
            self.total += take
            pos += take
            if self._tokens == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._files is not None
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._files = None
        self.shards.append(
            {
                "file": self._names[0],
                "index": self._names[1],
                "first_token": self._first,
                "num_tokens": self._tokens,
                "num_documents": self._docs,
                "bytes": self._tokens * self.dtype.itemsize,
                "index_bytes": self._docs * INDEX_DTYPE.itemsize,
                "blake2b": self._hashes[0].hexdigest(),
                "index_blake2b": self._hashes[1].hexdigest(),
            }
        )

    def close(self) -> list[dict[str, Any]]:
        """Finish the last shard; the shard list for the manifest."""
        if self._files is not None:
            self._close_shard()
        return self.shards

    def abort(self) -> None:
        """Close open files without recording them (the temp directory is removed next)."""
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None


class HashedFile:
    """A file of raw little-endian int64/uint64 arrays, written with its blake2b digest."""

    def __init__(self, path: Path) -> None:
        """Create `path`."""
        self.path, self.file, self.hash, self.bytes = path, open(path, "wb"), hashlib.blake2b(digest_size=16), 0

    def write(self, values: np.ndarray) -> None:
        """Append `values` (8-byte integers, C order; an empty array writes nothing)."""
        data = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        """Flush to disk; the file's entry for the manifest."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"file": self.path.name, "bytes": self.bytes, "blake2b": self.hash.hexdigest()}

    def abort(self) -> None:
        """Close without recording."""
        self.file.close()


# --- the pipeline ---------------------------------------------------------------------------------


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    # `_source` names the directory the tokenizer came from; it makes a mismatch message actionable.
    source = getattr(tokenizer, "_source", None)
    return {
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "bos_id": getattr(tokenizer, "bos_id", None),
        "source": source if isinstance(source, str) else None,
    }


def shardwise_version() -> str:
    try:
        return version("shardwise")
    except Exception:  # not installed (running from a checkout)
        return "unknown"


def _no_documents(
    files: Sequence[InputFile], stats: ReadStats, counts: dict[str, int], options: dict[str, Any]
) -> DataError:
    why = [f"{stats.documents} documents read"]
    if counts["dropped_short"]:
        why.append(f"{counts['dropped_short']} shorter than min_chars={options['min_chars']}")
    if counts["duplicates"]:
        why.append(f"{counts['duplicates']} duplicates")
    if stats.bad_lines:
        why.append(f"{stats.bad_lines} bad lines skipped (first: {stats.first_bad_line})")
    if stats.empty_files:
        why.append(f"{stats.empty_files} empty files skipped")
    named = ", ".join(f.path for f in files[:_NAMED_FILES]) + (", ..." if len(files) > _NAMED_FILES else "")
    return DataError(
        f"no documents to prepare from {len(files)} input files ({named}: {'; '.join(why)}); check the inputs, "
        f"the format and text field (format={options['format']!r}, text_field={options['text_field']!r}) "
        f"and min_chars"
    )


def _sample(counts: dict[str, Any], rule: str, removed: int, text: str) -> None:
    """Keep the start of `text` as a sample of what `rule` removed, while it has removed few."""
    if removed <= REMOVED_SAMPLES:
        counts["samples"].append({"rule": rule, "text": text[:REMOVED_SAMPLE_CHARS]})


def _count_quality(texts: list[str], chunk: _Chunk, counts: dict[str, Any]) -> None:
    by_rule = counts["quality"]
    for i, rule in chunk.rules:
        by_rule[rule] = by_rule.get(rule, 0) + 1
        _sample(counts, rule, by_rule[rule], texts[i])


def _drop_duplicates(
    texts: list[str], chunk: _Chunk, index: DuplicateIndex | None, counts: dict[str, Any]
) -> np.ndarray:
    """Which of the chunk's kept documents are not duplicates of earlier ones (counted, near ones sampled)."""
    if index is None:
        return np.ones(chunk.lengths.size, dtype=bool)
    exact, near = index.add(chunk.keys)
    counts["duplicates"] += int(exact.sum())
    for i in np.flatnonzero(near):
        counts["near_duplicates"] += 1
        _sample(counts, NEAR_DUPLICATE, counts["near_duplicates"], texts[chunk.kept[i]])
    return ~(exact | near)


def _write_corpus(
    files: Sequence[InputFile], tokenizer: Any, directory: Path, options: dict[str, Any], workers: int,
    part: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write shards into `directory` and return the manifest (not yet written).

    With `part` (prepare_parts.py), duplicates are not dropped: every document's keys are written beside
    its shards (KEYS_FILE), with the ordinals of the documents max_length cut (TRUNCATED_FILE), for the merge
    to decide over all parts."""
    started = time.perf_counter()
    dtype_name = token_dtype(tokenizer.vocab_size).name
    dtype = shard_dtype(dtype_name)  # little-endian on every machine, so shards can be copied between them
    stats = ReadStats()
    counts: dict[str, Any] = {"dropped_short": 0, "duplicates": 0, "near_duplicates": 0, "truncated": 0,
                              "quality": {}, "samples": [], "emptied_by_boilerplate": 0}
    docs = read_documents(
        files,
        text_field=options["text_field"],
        txt_documents=options["txt_documents"],
        on_bad_line=options["on_bad_line"],
        stats=stats,
    )
    boilerplate = None
    if options.get("boilerplate_lines"):
        # compressed inputs hold about 4 times their bytes of text
        text_bytes = sum(f.bytes * (4 if f.gzip or f.zstd or f.format in ("parquet", "arrow") else 1) for f in files)
        boilerplate = BoilerplateLines(options["boilerplate_lines"], sketch_width(text_bytes), REMOVED_SAMPLES)
    chunks = _raw_chunks(docs, options["min_chars"], counts, boilerplate)
    near = options.get("near_dedup")
    work = _Work(tokenizer, options["max_length"], dtype, "quality" in options, options["dedup"], near)
    index = DuplicateIndex(1 + near["bands"] if near else 1) if options["dedup"] and part is None else None
    writer = ShardWriter(directory, dtype, options["shard_tokens"])
    side = {name: HashedFile(directory / name) for name in (KEYS_FILE, TRUNCATED_FILE)} if part else {}
    documents = 0
    try:
        # The pool forks before the progress bar starts its monitor thread.
        with _Workers(work, workers) as pool, tqdm(desc="preparing", unit="doc", unit_scale=True, disable=None) as bar:
            for texts, chunk in pool.map(chunks):
                _count_quality(texts, chunk, counts)
                keep = _drop_duplicates(texts, chunk, index, counts)
                tokens, lengths = chunk.tokens, chunk.lengths
                if not keep.all():
                    tokens, lengths = tokens[np.repeat(keep, lengths)], lengths[keep]
                try:
                    writer.add(tokens, lengths)
                    if side:
                        side[KEYS_FILE].write(chunk.keys)
                        side[TRUNCATED_FILE].write(documents + np.flatnonzero(chunk.truncated))
                except OSError as e:
                    raise DataError(f"cannot write token shards in {directory}: {e}") from e
                documents += lengths.size
                counts["truncated"] += int(chunk.truncated[keep].sum())
                bar.update(len(texts))
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix_str(
                    f"{writer.total:,} tokens, {writer.total / elapsed:,.0f} tok/s", refresh=False
                )
        try:
            shards = writer.close()
            side_files = {name: f.close() for name, f in side.items()}
        except OSError as e:
            raise DataError(f"cannot write token shards in {directory}: {e}") from e
    except BaseException:
        writer.abort()
        for f in side.values():
            f.abort()
        raise
    if boilerplate is not None:
        counts["samples"] += [{"rule": BOILERPLATE_LINE, "text": line[:REMOVED_SAMPLE_CHARS], "removed": n}
                              for line, n in boilerplate.examples.items()]
    if counts["samples"]:  # beside the manifest, for a person to check what the filters removed
        with open(directory / REMOVED_SAMPLES_FILE, "w", encoding="utf-8") as f:
            # ASCII: mojibake holds U+0085 and friends, which line readers would take for line ends
            f.writelines(json.dumps(sample) + "\n" for sample in counts["samples"])
    if documents == 0 and part is None:  # a part may be empty: the others hold the corpus
        raise _no_documents(files, stats, counts, options)
    seconds = time.perf_counter() - started
    all_counts = {
        "documents_read": stats.documents,
        "documents": documents,
        "tokens": writer.total,
        "dropped_short": counts["dropped_short"],
        "duplicates": counts["duplicates"],
        **({"near_duplicates": counts["near_duplicates"]} if near else {}),
        **({"boilerplate_lines": boilerplate.lines_removed, "emptied_by_boilerplate": counts["emptied_by_boilerplate"]}
           if boilerplate is not None else {}),
        **({"removed_by_quality": dict(sorted(counts["quality"].items()))} if "quality" in options else {}),
        "truncated": counts["truncated"],
        "invalid_utf8_documents": stats.invalid_utf8_documents,
        "replaced_chars": stats.replaced_chars,
        "bad_lines": stats.bad_lines,
        "empty_files": stats.empty_files,
    }
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shardwise_version": shardwise_version(),
        "tokenizer": tokenizer_info(tokenizer),
        "dtype": dtype_name,
        "num_tokens": writer.total,
        "num_documents": documents,
        "counts": all_counts,
        "options": dict(options),
        "workers": workers,
        "seconds": round(seconds, 3),
        "inputs": [
            {"path": f.path, "format": f.format, "gzip": f.gzip, "zstd": f.zstd, "bytes": f.bytes,
             "documents": stats.per_file.get(f.path, 0)}
            for f in files
        ],
        "shards": shards,
        # key columns as the workers wrote them: none without deduplication
        **({"part": {**part, "key_columns": (1 + near["bands"] if near else 1) if options["dedup"] else 0,
                     "files": side_files}} if part else {}),
    }


def _log_summary(out: Path, manifest: dict[str, Any]) -> None:
    c = manifest["counts"]
    seconds = manifest["seconds"]
    logger.info(
        "prepared %s: %d documents, %d tokens (%s) in %d shards from %d files, %.1f s (%.0f tokens/s); "
        "dropped %d shorter than min_chars, %d duplicates; %d truncated to max_length",
        out, c["documents"], c["tokens"], manifest["dtype"], len(manifest["shards"]), len(manifest["inputs"]),
        seconds, c["tokens"] / max(seconds, 1e-9), c["dropped_short"], c["duplicates"], c["truncated"],
    )
    if c["invalid_utf8_documents"]:
        logger.warning(
            "%d documents had invalid UTF-8; %d characters were replaced by U+FFFD",
            c["invalid_utf8_documents"], c["replaced_chars"],
        )
    if c["bad_lines"]:
        logger.warning("%d bad lines were skipped", c["bad_lines"])
    if c["empty_files"]:
        logger.warning("%d empty files were skipped", c["empty_files"])


# --- publishing: temp directory -> out ------------------------------------------------------------


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(out: Path) -> None:
    """Remove temp directories of earlier runs for `out` on this host whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-{re.escape(_host())}-(\d+)-")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if not (m and entry.is_dir() and not _pid_alive(int(m.group(2)))):
            continue
        if m.group(1) == "old" and not os.path.lexists(out) and _is_prepared(entry):
            # The run died between moving the old `out` aside and moving the new one in: restore it.
            logger.warning("restoring %s from %s, left by an interrupted preparation", out, entry)
            os.rename(entry, out)
            continue
        logger.info("removing %s, left by an interrupted preparation", entry)
        shutil.rmtree(entry, ignore_errors=True)


def _is_prepared(path: Path) -> bool:
    """Whether `path` holds a shardwise manifest (what `overwrite` may replace), read within bounds."""
    try:
        manifest = read_json_object(path / MANIFEST_FILE, DataError, limit=MAX_MANIFEST_BYTES)
    except DataError:
        return False
    return manifest.get("format") == FORMAT_NAME


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _check_out(out: Path, existing: str) -> None:
    """Refuse an `out` that must not be replaced, before any work is done."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} exists and is a file, not a directory; choose another --out")
    if not out.exists() or _is_empty_dir(out) or existing == "cache":
        return
    if existing == "refuse":
        raise DataError(
            f"output directory {out} already exists and is not empty; pass overwrite=True (--overwrite) "
            f"to replace it (the old one stays until the new one is complete), or choose another --out"
        )
    if not _is_prepared(out):
        raise DataError(
            f"output directory {out} is not empty and is not a prepared corpus (it has no shardwise "
            f"{MANIFEST_FILE}); it is not replaced even with overwrite, so that nothing else is deleted. "
            f"Choose another --out, or empty it yourself"
        )


def _publish(tmp: Path, out: Path, existing: str, tokenizer: Any) -> bool:
    """Move the finished `tmp` to `out`; False when a complete one by another process was kept instead."""
    for _ in range(5):  # other processes may be publishing the same `out` at the same time
        if not os.path.lexists(out):
            try:
                os.rename(tmp, out)
                return True
            except OSError:
                continue
        if _is_empty_dir(out):
            try:
                os.rmdir(out)
            except OSError:
                pass
            continue
        if existing == "cache":
            try:
                TokenShards(out, tokenizer)
                return False  # someone else finished the same preparation first: keep theirs
            except DataError:
                pass
        else:
            _check_out(out, existing)
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-{_host()}-{os.getpid()}-"))
        try:
            os.replace(out, old)  # onto the empty placeholder just made
        except OSError:
            old.rmdir()
            continue
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old, out)  # put the old one back rather than leave nothing
            raise
        shutil.rmtree(old, ignore_errors=True)
        return True
    raise DataError(f"could not move the prepared data into {out}: other processes keep changing it")


def prepare_into(
    files: Sequence[InputFile],
    tokenizer: Any,
    out: Path,
    options: dict[str, Any],
    workers: int,
    existing: str,
    part: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prepare into a temp directory next to `out`, then publish it (see `build_and_publish`)."""
    total = sum(f.bytes for f in files)
    logger.info(
        "preparing %d files (%.1f MB) into %s with %d worker%s",
        len(files), total / 1e6, out, workers, "" if workers == 1 else "s",
    )
    return build_and_publish(out, existing, tokenizer,
                             lambda tmp: _write_corpus(files, tokenizer, tmp, options, workers, part))


def build_and_publish(
    out: Path, existing: str, tokenizer: Any, write: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """`write` the shards into a temp directory next to `out`, with the manifest it returns written last,
    then move the directory to `out` (`_publish`); the manifest."""
    _remove_stale_temps(out)  # first: it may restore an `out` that a killed run had moved aside
    _check_out(out, existing)
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (not mkdtemp, which makes it private): `out` gets the usual permissions after the rename.
    tmp = out.parent / f".{out.name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(tmp)
    except OSError as e:
        raise DataError(f"cannot create a directory next to {out}: {e}; choose another --out") from e
    try:
        manifest = write(tmp)
        # The manifest last: a directory without one is never read as prepared data.
        write_json_atomic(tmp / MANIFEST_FILE, manifest)
        fsync_dir(tmp)
        if _publish(tmp, out, existing, tokenizer):
            fsync_dir(out.parent)
            _log_summary(out, manifest)
        else:
            logger.info("%s was prepared by another process meanwhile; using it", out)
            manifest = TokenShards(out).manifest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def prepare_corpus(
    inputs: Sequence[str] | str,
    tokenizer: Any,
    out: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    text_field: str = "text",
    txt_documents: str = "file",
    min_chars: int = DEFAULT_MIN_CHARS,
    max_length: int | None = None,
    dedup: bool | str = "exact",
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_bad_line: str = "stop",
    overwrite: bool = False,
    quality: str = "none",
    near_dedup: dict[str, int] | None = None,
    boilerplate_lines: int = 0,
) -> dict[str, Any]:
    """Tokenise the files matching `inputs` into token shards in `out`; returns the manifest.

    fmt: "auto" (by extension), "txt", "jsonl", "parquet" or "arrow". text_field: the JSON field / parquet
    column holding the text. txt_documents: "file" (a document per file) or "paragraph" (documents
    separated by blank lines). min_chars: documents with fewer characters (leading and trailing
    whitespace not counted) are dropped. max_length: documents with more tokens are cut to this many
    (the EOS after them not counted). dedup: "exact" (True) drops exact duplicate documents, "near" also
    near duplicates (MinHash LSH with `near_dedup`'s {ngram, bands, rows}, see data/duplicates.py; each
    counted in the manifest, the first few written to removed_samples.jsonl), "none" (False) keeps them.
    workers: tokenising processes (None: the cores, at most 8). shard_tokens: tokens per shard file. on_bad_line: "stop"
    (DataError) or "skip" (counted) for a bad .jsonl line. overwrite: replace an existing prepared `out`.
    quality: "default" removes documents by the rules of `data.quality` (counted by rule in the manifest, the
    first few of each written to removed_samples.jsonl beside it); "none" keeps them. boilerplate_lines: N > 0
    removes each line (of 20 characters or more) that N earlier documents had (data/boilerplate.py).
    """
    options = check_options(
        fmt, text_field, txt_documents, min_chars, max_length, dedup, shard_tokens, on_bad_line, quality, near_dedup,
        boilerplate_lines,
    )
    workers = check_workers(workers)
    out_path = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    _check_out(out_path, "replace" if overwrite else "refuse")
    files = resolve_inputs(inputs, fmt)
    return prepare_into(files, tokenizer, out_path, options, workers, "replace" if overwrite else "refuse")


def cache_key(files: Sequence[InputFile], tokenizer: Any, options: dict[str, Any]) -> str:
    """Hash of the input paths, sizes and modification times, the tokenizer and the output options."""
    # The paths are absolute already (resolve_inputs), so the stamps are what they always were.
    blob = json.dumps([FORMAT_VERSION, file_stamps([f.path for f in files]), tokenizer.fingerprint,
                       sorted(options.items())])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


def prepare_cached(
    inputs: Sequence[str] | str,
    tokenizer: Any,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    workers: int | None = None,
    **options: Any,
) -> Path:
    """Directory of token shards for `inputs` in `cache_dir`, prepared unless a complete one exists.

    Keyed by input paths, sizes and mtimes, tokenizer fingerprint and `options` (those of
    `prepare_corpus`, less `out`, `workers` and `overwrite`). Concurrent or interrupted runs are safe:
    the processes that share the cache's file system prepare an entry once (`cache_lock`: the others
    wait for it), and each preparation writes into its own temp directory, the first finished kept.
    """
    opts = check_options(**options)
    n_workers = check_workers(workers)
    files = resolve_inputs(inputs, opts["format"])
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    out = Path(os.path.abspath(root / f"shards-{cache_key(files, tokenizer, opts)}"))
    if _usable(out, tokenizer):
        return out
    with cache_lock(out):
        if not _usable(out, tokenizer):  # else prepared by another process while this one waited
            prepare_into(files, tokenizer, out, opts, n_workers, "cache")
    return out


def _usable(out: Path, tokenizer: Any) -> bool:
    """Whether `out` holds complete prepared data for `tokenizer` (said in the log either way)."""
    if not (out / MANIFEST_FILE).is_file():
        return False
    try:
        shards = TokenShards(out, tokenizer)
    except DataError as e:
        logger.warning("prepared data in %s is unusable (%s); preparing it again", out, e)
        return False
    logger.info("using prepared data %s (%d tokens)", out, shards.num_tokens)
    return True


CACHE_LOCK_POLL_S = 0.5
CACHE_LOCK_PROGRESS_S = 60.0
_held_locks: dict[str, int] = {}  # lock files this process holds -> how deeply (the lock is re-entrant)


@contextmanager
def cache_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for preparing the cache entry `target` (the file `.NAME.lock` beside it,
    removed again when released).

    The processes that use one file system for the cache (every rank with a shared cache, the ranks of
    one node with a cache on its own disk) then prepare the entry once: the first one to come prepares
    it, the others wait here, a line every CACHE_LOCK_PROGRESS_S seconds, and find it ready when they
    get the lock. The lock is the operating system's (flock; NFS carries it to the server), so it goes
    with a process that dies. Within one process it is re-entrant. Where the file system takes no locks
    (Lustre mounted without `flock`), nothing is locked: each process prepares its own copy and the
    first finished is kept, as without the lock.
    """
    path = target.parent / f".{target.name}.lock"
    key = os.path.abspath(path)
    if key in _held_locks:
        _held_locks[key] += 1
        try:
            yield
        finally:
            _held_locks[key] -= 1
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, target)
    if fd is None:
        yield
        return
    _held_locks[key] = 1
    try:
        yield
    finally:
        del _held_locks[key]
        with contextlib.suppress(OSError):
            path.unlink()  # before the unlock: a process that opened it meanwhile sees it gone and opens anew
        os.close(fd)


def _acquire(path: Path, target: Path) -> int | None:
    """An open descriptor of the lock file `path`, locked; None where no lock can be had (said in the log)."""
    start = last = time.monotonic()
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            logger.warning("cannot create the lock file %s (%s); preparing %s without one", path, e, target)
            return None
        try:
            locked = _try_lock(fd)
        except OSError as e:  # ENOLCK, EINVAL, ENOSYS: this file system takes no locks
            os.close(fd)
            logger.warning("the file system of %s takes no file locks (%s); preparing it without one", target, e)
            return None
        if locked and _still_there(fd, path):
            return fd
        os.close(fd)  # not ours yet, or released and removed by its holder meanwhile: look again
        now = time.monotonic()
        if now - last >= CACHE_LOCK_PROGRESS_S:
            logger.info("waiting for another process to finish preparing %s (%.0f s so far)", target, now - start)
            last = now
        if not locked:
            time.sleep(CACHE_LOCK_POLL_S)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _still_there(fd: int, path: Path) -> bool:
    """Whether the locked descriptor `fd` is still the file at `path` (its holder removes it on release)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


__all__ = [
    "DEFAULT_MIN_CHARS",
    "DEFAULT_SHARD_TOKENS",
    "DEDUP_LEVELS",
    "cache_key",
    "cache_lock",
    "default_workers",
    "prepare_cached",
    "prepare_corpus",
]
