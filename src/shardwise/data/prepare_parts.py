"""Preparation by many processes or nodes: each prepares a part of the inputs, one merge writes the corpus.

`prepare_part(inputs, tokenizer, out, "I/N")` prepares part I of N into `OUT.parts/part-I-of-N`: the
inputs (sorted, as every part sees them) are cut into N runs of whole files of about equal bytes, and part
I cleans and tokenises its run exactly as `prepare_corpus` would, but drops no duplicates: it keeps every
document's keys (digest and MinHash band keys, duplicates.py) beside its shards. The parts run anywhere
that sees the inputs, at the same time or not, and each is published atomically like any preparation.

`merge_parts(out, tokenizer)` then reads the N parts in order, decides the duplicates over all of them at
once, key column by key column (one `DigestSet` at a time: 8 bytes per document, plus a byte per document
for the flags), and copies the kept documents' tokens into the shards of `out` with one manifest. Since
the parts' runs concatenate to the sorted inputs and a document's fate depends only on the keys before it
(`DuplicateIndex`), `out` is the same, shard for shard, as one `prepare_corpus` over all the inputs.

A part is not training data (it still holds the duplicates across parts): `TokenShards` refuses it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from .duplicates import DigestSet
from .files import InputFile, resolve_inputs
from .prepare import (
    KEYS_FILE,
    NEAR_DUPLICATE,
    REMOVED_SAMPLE_CHARS,
    REMOVED_SAMPLES,
    REMOVED_SAMPLES_FILE,
    TRUNCATED_FILE,
    ShardWriter,
    build_and_publish,
    check_options,
    check_workers,
    prepare_into,
    shardwise_version,
    tokenizer_info,
)
from .shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, TokenShards, file_blake2b, shard_dtype

logger = logging.getLogger(__name__)

MAX_PARTS = 99_999
_PART_NAME = re.compile(r"part-(\d{5})-of-(\d{5})")
_COPY_TOKENS = 1 << 24  # tokens read at a time when copying a part into the corpus
_KEY_ROWS = 1 << 20  # documents' keys read at a time when deciding


def parse_part(part: str | tuple[int, int]) -> tuple[int, int]:
    """(index, count) from "I/N" (0 <= I < N), checked."""
    if isinstance(part, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
        if not m:
            raise DataError(f"part {part!r} is not I/N (this process's part I of N, counted from 0), e.g. 0/8")
        part = int(m.group(1)), int(m.group(2))
    index, count = int(part[0]), int(part[1])
    if not 1 <= count <= MAX_PARTS or not 0 <= index < count:
        raise DataError(f"part {index}/{count}: need 0 <= I < N <= {MAX_PARTS:,} (parts are counted from 0)")
    return index, count


def parts_dir(out: Path) -> Path:
    """Where the parts of the preparation into `out` go: OUT.parts beside it."""
    return out.parent / f"{out.name}.parts"


def part_path(out: Path, index: int, count: int) -> Path:
    """The directory of part `index` of `count` of the preparation into `out`."""
    return parts_dir(out) / f"part-{index:05d}-of-{count:05d}"


def part_files(files: Sequence[InputFile], index: int, count: int) -> list[InputFile]:
    """Part `index` of `count` runs of whole files, of about equal bytes (a file goes to the part its middle
    byte falls in), in order: the runs concatenate to `files`."""
    total = sum(f.bytes for f in files) or 1
    chosen, before = [], 0
    for f in files:
        if min(count - 1, count * (before + f.bytes / 2) // total) == index:
            chosen.append(f)
        before += f.bytes
    return chosen


def inputs_fingerprint(files: Sequence[InputFile]) -> str:
    """Of the inputs every part must agree on: their paths below the common folder and their sizes (so
    that nodes which mount the corpus at different places agree)."""
    root = os.path.commonpath([f.path for f in files]) if len(files) > 1 else os.path.dirname(files[0].path)
    listed = [(os.path.relpath(f.path, root), f.bytes) for f in files]
    return hashlib.sha256(json.dumps(listed).encode("utf-8")).hexdigest()[:20]


def prepare_part(
    inputs: Sequence[str] | str,
    tokenizer: Any,
    out: str | os.PathLike[str],
    part: str | tuple[int, int],
    *,
    workers: int | None = None,
    overwrite: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Prepare part `part` ("I/N") of `inputs` for the corpus `out` (into `OUT.parts`); its manifest.

    `options` are those of `prepare_corpus`; every part must be given the same inputs and options."""
    index, count = parse_part(part)
    opts = check_options(**options)
    n_workers = check_workers(workers)
    out_path = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    files = resolve_inputs(inputs, opts["format"])
    mine = part_files(files, index, count)
    info = {"index": index, "count": count, "inputs": inputs_fingerprint(files), "inputs_total": len(files)}
    existing = "replace" if overwrite else "refuse"
    return prepare_into(mine, tokenizer, part_path(out_path, index, count), opts, n_workers, existing, info)


# --- merging --------------------------------------------------------------------------------------


def _find_parts(out: Path) -> list[Path]:
    """The part directories of `out`, all N of them, in order; DataError naming what is missing."""
    root = parts_dir(out)
    found: dict[int, set[int]] = {}
    if root.is_dir():
        for entry in root.iterdir():
            m = _PART_NAME.fullmatch(entry.name)
            if m and entry.is_dir():
                found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        raise DataError(f"no parts to merge in {root}; prepare them first: shardwise prepare --out {out} --part I/N "
                        f"(for each I of 0..N-1)")
    if len(found) > 1:
        raise DataError(f"{root} holds parts of preparations in {sorted(found)} parts; keep one count (delete the "
                        f"others' part-*-of-* directories) and merge again")
    (count, indices), = found.items()
    missing = sorted(set(range(count)) - indices)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise DataError(f"{root} lacks {len(missing)} of {count} parts ({shown}); prepare them "
                        f"(shardwise prepare --out {out} --part I/{count}) and merge again")
    return [part_path(out, i, count) for i in range(count)]


def _open_part(path: Path, tokenizer: Any) -> tuple[TokenShards, dict[str, Any]]:
    """A part's shards and its part entry, checked: tokenizer, files present and unchanged."""
    shards = TokenShards(path, tokenizer, part_ok=True)
    info = shards.manifest.get("part")
    if not isinstance(info, dict):
        raise DataError(f"{path / MANIFEST_FILE} is a whole corpus, not a part; it cannot be merged")
    shards.verify()
    columns = info.get("key_columns")
    files = info.get("files")
    if not isinstance(columns, int) or not isinstance(files, dict) or columns < 0:
        raise DataError(f"{path / MANIFEST_FILE}: its part entry is malformed; prepare the part again")
    for name, per_document in ((KEYS_FILE, 8 * columns), (TRUNCATED_FILE, None)):
        entry = files.get(name)
        expected = per_document * shards.num_documents if per_document else None
        _check_side_file(path, name, entry, expected)
    return shards, info


def _check_side_file(path: Path, name: str, entry: Any, expected: int | None) -> None:
    file = path / name
    if not isinstance(entry, dict) or entry.get("file") != name or not file.is_file():
        raise DataError(f"{path}: {name} is missing or not in the manifest; prepare the part again")
    size = file.stat().st_size
    if size != entry.get("bytes") or (expected is not None and size != expected) or size % 8:
        raise DataError(f"{file} has {size:,} bytes, not what the manifest says; prepare the part again")
    if file_blake2b(file) != entry.get("blake2b"):
        raise DataError(f"{file} changed after preparation (its digest differs); prepare the part again")


def _check_agree(paths: list[Path], manifests: list[dict[str, Any]]) -> None:
    """The parts were prepared from the same inputs, with the same options, tokenizer and version."""
    first = manifests[0]
    for path, m in zip(paths[1:], manifests[1:]):
        for what, a, b in (
            ("inputs", first["part"].get("inputs"), m["part"].get("inputs")),
            ("options", first.get("options"), m.get("options")),
            ("tokenizer", first["tokenizer"].get("fingerprint"), m["tokenizer"].get("fingerprint")),
            ("format version", first.get("version"), m.get("version")),
        ):
            if a != b:
                raise DataError(f"part {path.name} was prepared with other {what} than {paths[0].name} ({b!r} vs "
                                f"{a!r}); prepare every part with the same command, only --part changing")


def _keys_column(path: Path, columns: int, column: int, documents: int) -> np.ndarray:
    keys = np.memmap(path / KEYS_FILE, dtype="<u8", mode="r", shape=(documents, columns)) if documents else \
        np.zeros((0, columns), np.uint64)
    return keys[:, column]


def _duplicates(parts: list[TokenShards], infos: list[dict[str, Any]], near: bool) -> list[tuple[np.ndarray, ...]]:
    """Per part, (exact duplicate, near duplicate and not exact) flags of its documents, decided over all
    parts in order, one key column at a time."""
    columns = infos[0]["key_columns"]
    exact = [np.zeros(p.num_documents, bool) for p in parts]
    near_flags = [np.zeros(p.num_documents, bool) for p in parts]
    for column in range(columns if near else 1):
        seen = DigestSet()
        for shards, flags, target in zip(parts, exact, near_flags):
            keys = _keys_column(shards.directory, columns, column, shards.num_documents)
            for lo in range(0, keys.size, _KEY_ROWS):
                repeated = ~seen.add_new(np.asarray(keys[lo:lo + _KEY_ROWS]))
                (flags if column == 0 else target)[lo:lo + _KEY_ROWS] |= repeated
    return [(e, n & ~e) for e, n in zip(exact, near_flags)]


def _copy_kept(shards: TokenShards, keep: np.ndarray, writer: ShardWriter) -> None:
    """Append the tokens of the documents of `shards` that `keep` marks, a block at a time."""
    starts = shards.document_starts(0, shards.num_tokens) if shards.num_tokens else np.zeros(0, np.int64)
    ends = np.append(starts[1:], shards.num_tokens)
    d = 0
    while d < starts.size:
        # as many whole documents as fit in _COPY_TOKENS (at least one)
        e = max(d + 1, int(np.searchsorted(ends, starts[d] + _COPY_TOKENS, side="right")))
        tokens = shards.read(int(starts[d]), int(ends[e - 1]))
        lengths = ends[d:e] - starts[d:e]
        k = keep[d:e]
        if k.all():
            writer.add(tokens, lengths)
        elif k.any():
            writer.add(tokens[np.repeat(k, lengths)], lengths[k])
        d = e


def _truncated(path: Path, documents: int) -> np.ndarray:
    """The ordinals of the part's documents that max_length cut, checked against its document count."""
    size = (path / TRUNCATED_FILE).stat().st_size
    ordinals = np.fromfile(path / TRUNCATED_FILE, dtype="<i8") if size else np.zeros(0, np.int64)
    if ordinals.size and (ordinals.min() < 0 or ordinals.max() >= documents):
        raise DataError(f"{path / TRUNCATED_FILE} names documents the part does not have; prepare the part again")
    return ordinals


def _samples(paths: list[Path], parts: list[TokenShards], flags: list[tuple[np.ndarray, ...]],
             tokenizer: Any) -> list[dict[str, Any]]:
    """The parts' quality samples, the first REMOVED_SAMPLES of each rule over the parts in order, then the
    first near duplicates, decoded from their tokens."""
    samples: list[dict[str, Any]] = []
    per_rule: dict[str, int] = {}
    for path in paths:
        file = path / REMOVED_SAMPLES_FILE
        if not file.is_file():
            continue
        with open(file, encoding="utf-8") as f:
            for line in f:
                sample = json.loads(line)
                rule = sample.get("rule")
                per_rule[rule] = per_rule.get(rule, 0) + 1
                if per_rule[rule] <= REMOVED_SAMPLES:
                    samples.append(sample)
    shown = 0
    for shards, (_, near) in zip(parts, flags):
        removed = np.flatnonzero(near)[:REMOVED_SAMPLES - shown]
        starts = shards.document_starts(0, shards.num_tokens) if removed.size else None
        for d in removed:
            start = int(starts[d])
            stop = start + min(REMOVED_SAMPLE_CHARS, shards.num_tokens - start)
            text = tokenizer.decode(shards.read(start, stop).tolist())
            samples.append({"rule": NEAR_DUPLICATE, "text": text[:REMOVED_SAMPLE_CHARS]})
            shown += 1
    return samples


def _merged_counts(manifests: list[dict[str, Any]], documents: int, tokens: int, duplicates: int,
                   near: int | None, truncated: int) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    for m in manifests:
        for key, value in m["counts"].items():
            if isinstance(value, dict):
                merged = counts.setdefault(key, {})
                for rule, n in value.items():
                    merged[rule] = merged.get(rule, 0) + n
            else:
                counts[key] = counts.get(key, 0) + value
    counts.update(documents=documents, tokens=tokens, duplicates=duplicates, truncated=truncated)
    if near is not None:
        counts["near_duplicates"] = near
    if "removed_by_quality" in counts:
        counts["removed_by_quality"] = dict(sorted(counts["removed_by_quality"].items()))
    return counts


def _write_merged(paths: list[Path], parts: list[TokenShards], manifests: list[dict[str, Any]], tokenizer: Any,
                  directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    options = manifests[0]["options"]
    near = "near_dedup" in options
    if options.get("dedup"):
        flags = _duplicates(parts, [m["part"] for m in manifests], near)
    else:
        flags = [(np.zeros(p.num_documents, bool),) * 2 for p in parts]
    dtype_name = manifests[0]["dtype"]
    writer = ShardWriter(directory, shard_dtype(dtype_name), options["shard_tokens"])
    truncated = 0
    try:
        for path, shards, (exact, near_flags) in zip(paths, parts, flags):
            keep = ~(exact | near_flags)
            _copy_kept(shards, keep, writer)
            truncated += int(keep[_truncated(path, keep.size)].sum())
            logger.info("merged %s: kept %d of %d documents", path.name, int(keep.sum()), keep.size)
        shards_written = writer.close()
    except OSError as e:
        writer.abort()
        raise DataError(f"cannot write token shards in {directory}: {e}") from e
    except BaseException:
        writer.abort()
        raise
    documents = sum(int((~(e | n)).sum()) for e, n in flags)
    if documents == 0:
        raise DataError(f"the {len(parts)} parts in {paths[0].parent} hold no documents to keep; check the inputs "
                        "and options (see each part's manifest counts)")
    samples = _samples(paths, parts, flags, tokenizer)
    if samples:
        with open(directory / REMOVED_SAMPLES_FILE, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(sample) + "\n" for sample in samples)
    counts = _merged_counts(manifests, documents, writer.total, sum(int(e.sum()) for e, _ in flags),
                            sum(int(n.sum()) for _, n in flags) if near else None, truncated)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shardwise_version": shardwise_version(),
        "tokenizer": tokenizer_info(tokenizer),
        "dtype": dtype_name,
        "num_tokens": writer.total,
        "num_documents": documents,
        "counts": counts,
        "options": dict(options),
        "workers": sum(int(m.get("workers", 1)) for m in manifests),
        "seconds": round(sum(float(m.get("seconds", 0)) for m in manifests) + time.perf_counter() - started, 3),
        "merged_parts": len(parts),
        "inputs": [entry for m in manifests for entry in m["inputs"]],
        "shards": shards_written,
    }


def merge_parts(out: str | os.PathLike[str], tokenizer: Any, *, overwrite: bool = False) -> dict[str, Any]:
    """Merge the parts in `OUT.parts` into the corpus `out` (exact and near duplicates decided over all
    parts); its manifest. The parts are left in place (delete `OUT.parts` once `out` is checked)."""
    out_path = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    paths = _find_parts(out_path)
    opened = [_open_part(p, tokenizer) for p in paths]
    parts = [shards for shards, _ in opened]
    manifests = [shards.manifest for shards in parts]
    _check_agree(paths, manifests)
    total = manifests[0]["part"].get("inputs_total")
    listed = sum(len(m["inputs"]) for m in manifests)
    if listed != total:
        raise DataError(f"the {len(paths)} parts in {parts_dir(out_path)} list {listed} input files between them, "
                        f"but the inputs are {total} files; prepare the parts again with the same --input")
    existing = "replace" if overwrite else "refuse"
    logger.info("merging %d parts of %s", len(paths), out_path)
    return build_and_publish(out_path, existing, tokenizer,
                             lambda tmp: _write_merged(paths, parts, manifests, tokenizer, tmp))


__all__ = ["merge_parts", "parse_part", "part_files", "part_path", "parts_dir", "prepare_part"]
