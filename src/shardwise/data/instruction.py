"""Instruction data (SFT): JSON lines -> templated tokens (chat.py) with assistant-only loss -> batches.

Records
-------
Each line of a `.jsonl` file (or each element of a `.json` file holding one JSON array) is one
conversation. The shape is detected per record:

* alpaca: ``{"instruction": str, "input": str (optional), "output": str, "system": str (optional)}``.
  The user message is the instruction, or ``instruction + "\\n\\n" + input`` when the input is not
  empty; the assistant message is the output.
* chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``: an optional
  system message first, then user and assistant messages alternating, starting with a user message,
  with at least one assistant message. A last user message without an answer is dropped (counted as
  ``unanswered_dropped``): it would only cost tokens.

A record that is not JSON, matches neither shape or breaks these rules is reported by file and line;
``on_bad_line="stop"`` (default) raises DataError, ``"skip"`` leaves it out, counts it and warns.

Templates (``template=``) are those of chat.py: "auto" (default), "default" (seed 003's [INST] form),
"tokenizer" (its Jinja chat template), a dict of format strings per role, or a Jinja string.

Samples and batches
-------------------
Labels follow the batch contract: ``labels[i]`` is the next token of the same sample where that token
is trained, else -100, and the last position of a sample is always -100, so no target ever crosses
into the next sample. Over-long samples (more than ``max_seq_len`` tokens) are cut to ``max_seq_len``
(``truncation="truncate"``) or left out (``"drop"``); samples left without a trained target are left
out too; all counted in ``stats``. ``packing``:

* ``"pack"`` (default): samples packed into rows of ``max_seq_len`` by best-fit decreasing (a sample is
  never split; a multi-turn conversation is one sample), with ``document_ids`` and ``position_ids``
  restarting per sample; the rest of a row
  is padding (pad id, label -100, its own document id).
* ``"pad"``: one sample per row, padded to ``max_seq_len``.
* ``"dynamic"``: every item is a whole micro-batch (``items_are_batches = True``) of samples of similar
  length, padded to its longest rounded up to a multiple of ``pad_to_multiple_of`` (at most
  ``max_seq_len``; compiled kernels then see few widths), with rows x width <= ``token_budget``.
  Samples are sorted by that width (equal widths in a seeded random order) and cut greedily; the
  loader shuffles the batches.

Tokens are read and encoded once and kept as flat numpy arrays (tokens, trained-token mask, sample
offsets), optionally cached in ``cache_dir`` keyed by the files, the tokenizer and the template.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..errors import DataError
from ..loss import IGNORE_INDEX
from ..untrusted import parse_json
from .chat import BadRecord, Message, Piece, Renderer, encode_pieces, parse_messages, resolve_template
from .files import (
    BadJson,
    InputFile,
    expand_files,
    files_key,
    inspect_input,
    open_input,
    parse_json_line,
    read_at_most,
    read_lines,
)
from .shards import token_dtype
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PACKING_MODES = ("pack", "pad", "dynamic")
TRUNCATION_MODES = ("truncate", "drop")
BAD_LINE_MODES = ("stop", "skip")
SUFFIXES = (".jsonl", ".json", ".ndjson")

# Bump when the cached layout or the rendering changes, so that old caches are never read as new ones.
_CACHE_VERSION = 1
_RECORDS_PER_CHUNK = 1024
_WARN_LINES = 10
# A .json array is parsed whole (JSON lines stream): at most this many bytes.
MAX_JSON_ARRAY_BYTES = 1 << 30


# --- records --------------------------------------------------------------------------------------


def _text_field(obj: Mapping[str, Any], key: str, required: bool) -> str:
    value = obj.get(key)
    if value is None:
        if required:
            raise BadRecord(f"missing field {key!r}")
        return ""
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} is a {type(value).__name__}, not a string")
    return value


def _alpaca_messages(obj: Mapping[str, Any]) -> list[Message]:
    instruction = _text_field(obj, "instruction", True)
    extra = _text_field(obj, "input", False)
    output = _text_field(obj, "output", True)
    system = _text_field(obj, "system", False)
    user = "\n\n".join(p for p in (instruction, extra) if p)
    if not user:
        raise BadRecord("'instruction' and 'input' are both empty")
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def parse_record(obj: Any) -> tuple[list[Message], bool]:
    """Messages of one record (alpaca or chat shape) and whether a last unanswered user turn was dropped."""
    if not isinstance(obj, dict):
        raise BadRecord(f"is a JSON {type(obj).__name__}, not an object")
    if "messages" in obj:
        return parse_messages(obj["messages"])
    if "instruction" in obj or "output" in obj:
        return _alpaca_messages(obj), False
    keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
    raise BadRecord(
        f"matches neither shape: expected 'messages' (chat) or 'instruction' and 'output' (alpaca); "
        f"keys found: {keys}"
    )


class BadLines:
    """Counts and reports bad records: raises in "stop" mode, warns (the first few) in "skip" mode."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.count = 0

    def __call__(self, where: str, problem: str) -> None:
        self.count += 1
        if self.mode == "stop":
            raise DataError(
                f"{where}: {problem}; fix the record, or skip such lines with on_bad_line='skip' "
                f"(data.on_bad_line: skip)"
            )
        if self.count <= _WARN_LINES:
            logger.warning("skipping %s: %s", where, problem)
        elif self.count == _WARN_LINES + 1:
            logger.warning("skipping more bad records; only their count is reported from now on")


def _json_lines(f: InputFile) -> Iterator[tuple[int, str | None, int]]:
    """(line number, text or None when not UTF-8, bytes) of the non-blank lines of a file."""
    lineno = 0
    try:
        with open_input(f) as fh:
            for lineno, raw in enumerate(read_lines(fh, f.path), 1):
                try:
                    text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError:
                    yield lineno, None, len(raw)
                    continue
                if text.strip():
                    yield lineno, text, len(raw)
    except (OSError, EOFError, zlib.error) as e:  # a gzip file cut short, a disk error
        raise DataError(f"cannot read instruction data file {f.path} after line {lineno}: {e}") from e


def inspect_instruction_file(path: str) -> InputFile:
    """An instruction data file checked before it is read: a JSON-lines (or .json) name, not binary,
    valid gzip when compressed; DataError naming the file otherwise."""
    name = path.removesuffix(".gz").removesuffix(".zst")
    if not name.endswith(SUFFIXES) or (name != path and name.endswith(".json")):
        raise DataError(
            f"instruction data file {path!r} is not JSON lines; give .jsonl files (also .jsonl.gz, .jsonl.zst; one "
            f"{{\"instruction\", \"output\"}} or {{\"messages\"}} object per line) or a .json array"
        )
    # The same rules as pre-training files: a binary file (or broken gzip) is refused whole.
    return inspect_input(path, "jsonl")


def iter_records(
    files: Sequence[str], bad: BadLines, stats: dict[str, int], progress: Any = None
) -> Iterator[tuple[str, list[Message]]]:
    """("file:line", messages) of every usable record; bad ones go to `bad`, counts into `stats`."""
    for path in files:
        good = seen = 0
        for where, obj, size in file_objects(inspect_instruction_file(path)):
            seen += 1
            if progress is not None:
                progress.update(size)
            if isinstance(obj, BadRecord):
                bad(where, str(obj))
                continue
            try:
                messages, unanswered = parse_record(obj)
            except BadRecord as e:
                bad(where, str(e))
                continue
            stats["unanswered_dropped"] += unanswered
            good += 1
            yield where, messages
        if seen == 0:
            raise DataError(
                f"instruction data file {path!r} is empty; it needs one JSON object per line "
                f"(alpaca: instruction/input/output, or chat: messages)"
            )
        if good == 0:
            raise DataError(
                f"none of the {seen} records of {path!r} is usable (is it a binary or non-JSON-lines "
                f"file?); see the warnings above for the first problems"
            )
        stats["records"] += good


def file_objects(f: InputFile) -> Iterator[tuple[str, Any, int]]:
    """("file:line", parsed object or BadRecord, bytes) for each record of a .jsonl or .json file."""
    path = f.path
    if path.endswith(".json") and not f.empty:
        items = _json_array(f)
        if items is not None:
            size = os.path.getsize(path) // max(1, len(items))
            for i, item in enumerate(items):
                yield f"{path} item {i}", item, size
            return
    for lineno, text, size in _json_lines(f):
        where = f"{path}:{lineno}"
        if text is None:
            yield where, BadRecord("is not valid UTF-8 text (a binary file?)"), size
            continue
        try:
            obj = parse_json_line(text)
        except BadJson as e:
            yield where, BadRecord("is " + str(e).replace("not valid JSON", "not JSON", 1)), size
            continue
        yield where, obj, size


def _json_array(f: InputFile) -> list | None:
    """The items of a .json file holding one JSON array, or None when it does not start with '['."""
    path = f.path
    try:
        with open_input(f) as fh:
            head = fh.read(4096).lstrip()
            if head.startswith(b"\xef\xbb\xbf"):
                head = head[3:].lstrip()
            if not head.startswith(b"["):
                return None
            fh.seek(0)
            raw = read_at_most(fh, MAX_JSON_ARRAY_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read instruction data file {path}: {e}") from e
    if len(raw) > MAX_JSON_ARRAY_BYTES:
        raise DataError(
            f"{path!r} is a JSON array of more than {MAX_JSON_ARRAY_BYTES:,} bytes, which is not parsed whole; "
            f"convert it to JSON lines, which are read one record at a time (`jq -c '.[]' {path} > "
            f"{path[:-5]}.jsonl`)"
        )
    try:
        items = parse_json_line(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path!r} starts like a JSON array but is not UTF-8 text (byte {e.start:,})") from None
    except BadJson as e:
        raise DataError(f"{path!r} starts like a JSON array but does not parse: {e}") from None
    if not isinstance(items, list):
        raise DataError(f"{path!r} starts like a JSON array but holds {type(items).__name__}; give one array of "
                        f"records, or JSON lines")
    return items


# --- tokenising and caching -----------------------------------------------------------------------


def _tokenize_records(
    files: Sequence[str], tokenizer: Tokenizer, renderer: Renderer, on_bad_line: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """(tokens, trained mask, sample offsets, reading counts) of all usable records."""
    dtype = token_dtype(tokenizer.vocab_size)
    bad = BadLines(on_bad_line)
    stats = {"records": 0, "bad_lines": 0, "unanswered_dropped": 0}
    tok_chunks: list[np.ndarray] = []
    mask_chunks: list[np.ndarray] = []
    lengths: list[int] = []
    total = sum(os.path.getsize(f) for f in files)

    def flush(rendered: list[list[Piece]]) -> None:
        for ids, trained in encode_pieces(rendered, tokenizer):
            tok_chunks.append(np.asarray(ids, dtype=dtype))
            mask_chunks.append(np.asarray(trained, dtype=bool))
            lengths.append(len(ids))

    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing SFT data", disable=None) as bar:
        rendered: list[list[Piece]] = []
        for where, messages in iter_records(files, bad, stats, bar):
            try:
                rendered.append(renderer.render(messages))
            except BadRecord as e:
                bad(where, str(e))
                continue
            if len(rendered) == _RECORDS_PER_CHUNK:
                flush(rendered)
                rendered = []
        flush(rendered)
    stats["records"] = len(lengths)
    stats["bad_lines"] = bad.count
    if not lengths:
        raise DataError(f"no usable instruction records in {len(files)} file(s); see the warnings above")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.concatenate(tok_chunks), np.concatenate(mask_chunks), offsets, stats


def _save_npz_atomic(path: Path, **arrays: np.ndarray) -> None:
    """Save via a temp file and os.replace: an interrupted write never leaves a file under `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_sft_cache(cache: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """A token cache written by `load_sft_tokens`, checked whole (shapes, offsets, ids, counts); DataError
    for anything a damaged or altered file holds."""
    try:
        with np.load(cache, allow_pickle=False) as z:
            tokens, mask, offsets, raw_stats = z["tokens"], z["mask"], z["offsets"], z["stats"]
        if raw_stats.shape != () or raw_stats.dtype.kind != "U":
            raise DataError("its stats are not one string")
        stats = parse_json(str(raw_stats), cache, DataError)
        if not (isinstance(stats, dict) and all(isinstance(k, str) and type(v) is int and v >= 0
                                                for k, v in stats.items())):
            raise DataError("its stats are not counts")
        if tokens.ndim != 1 or tokens.dtype.kind != "u" or mask.shape != tokens.shape or mask.dtype != bool:
            raise DataError("its tokens or mask have the wrong shape or type")
        if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 2 or offsets[0] != 0:
            raise DataError("its sample offsets are malformed")
        if offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
            raise DataError("its sample offsets do not fit its tokens")
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise DataError(f"it holds token ids past the vocabulary of {vocab_size}")
    except DataError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zlib.error, MemoryError) as e:
        raise DataError(f"{type(e).__name__}: {e}") from None
    return tokens, mask, offsets, stats


def load_sft_tokens(
    files: Sequence[str],
    tokenizer: Tokenizer,
    renderer: Renderer,
    on_bad_line: str = "stop",
    cache_dir: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Tokens, trained mask, offsets and reading counts of the files; cached in `cache_dir` when given."""
    cache: Path | None = None
    if cache_dir is not None:
        template_hash = hashlib.sha256(renderer.key.encode("utf-8")).hexdigest()[:16]
        key = files_key(files, "sft", _CACHE_VERSION, tokenizer.fingerprint, template_hash, on_bad_line)
        cache = Path(cache_dir).expanduser() / f"sft-{key}.npz"
        if cache.is_file():
            try:
                tokens, mask, offsets, stats = _read_sft_cache(cache, tokenizer.vocab_size)
                logger.info("using cached SFT tokens %s (%d samples)", cache, len(offsets) - 1)
                return tokens, mask, offsets, stats
            except DataError as e:
                logger.warning("SFT token cache %s is unusable (%s); tokenizing again", cache, e)
    logger.info("tokenizing %d instruction file(s) with %r", len(files), tokenizer)
    tokens, mask, offsets, stats = _tokenize_records(files, tokenizer, renderer, on_bad_line)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _save_npz_atomic(cache, tokens=tokens, mask=mask, offsets=offsets, stats=np.array(json.dumps(stats)))
        logger.info("cached SFT tokens in %s", cache)
    return tokens, mask, offsets, stats


# --- grouping samples into rows and batches -------------------------------------------------------


def pack_best_fit(lengths: np.ndarray, capacity: int, seed: int = 0) -> list[np.ndarray]:
    """Sample indices of each row: best-fit decreasing into rows of `capacity` (ties in seeded order)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    # Open rows by exact free space: the best fit is the smallest free space that still holds a sample.
    have = np.zeros(capacity + 1, dtype=bool)
    rows_with_free: list[list[int]] = [[] for _ in range(capacity + 1)]
    rows: list[list[int]] = []
    free: list[int] = []
    for s in order.tolist():
        n = int(lengths[s])
        hit = int(np.argmax(have[n:])) + n
        if have[hit]:
            r = rows_with_free[hit].pop()
            if not rows_with_free[hit]:
                have[hit] = False
        else:
            r = len(rows)
            rows.append([])
            free.append(capacity)
        rows[r].append(s)
        free[r] -= n
        if free[r] > 0:
            rows_with_free[free[r]].append(r)
            have[free[r]] = True
    return [np.asarray(r, dtype=np.int64) for r in rows]


def batch_by_budget(lengths: np.ndarray, token_budget: int, seed: int = 0) -> list[np.ndarray]:
    """Sample indices of each batch: sorted by length (ties seeded), cut so rows x longest <= budget."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    order = order[np.argsort(lengths[order], kind="stable")]
    batches: list[np.ndarray] = []
    start = 0
    for k, s in enumerate(order.tolist()):
        # Ascending order: the sample being added is the longest of its batch.
        if (k + 1 - start) * int(lengths[s]) > token_budget:
            batches.append(order[start:k])
            start = k
    batches.append(order[start:])
    return batches


# --- the dataset ----------------------------------------------------------------------------------


class InstructionDataset(Dataset):
    """The seed documents' SFT dataset: instruction/chat JSON lines -> batch-contract samples.

    Items are packed rows, padded samples or (packing="dynamic") whole micro-batches; see the module
    docstring for the record shapes, templates and layouts. Counts are in `stats`.
    """

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Tokenizer,
        max_seq_len: int,
        shuffle: bool = True,
        *,
        template: str | Mapping[str, str] = "auto",
        packing: str = "pack",
        truncation: str = "truncate",
        on_bad_line: str = "stop",
        token_budget: int | None = None,
        cache_dir: str | None = None,
        seed: int = 0,
        pad_to_multiple_of: int = 1,
    ) -> None:
        """Read, template and tokenize `data_files` (paths or globs) into samples of <= `max_seq_len`."""
        for name, value, allowed in (
            ("packing", packing, PACKING_MODES),
            ("truncation", truncation, TRUNCATION_MODES),
            ("on_bad_line", on_bad_line, BAD_LINE_MODES),
        ):
            if value not in allowed:
                raise DataError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        if max_seq_len < 2:
            raise DataError(f"max_seq_len (data.seq_length) must be at least 2, got {max_seq_len}")
        if pad_to_multiple_of < 1:
            raise DataError(f"pad_to_multiple_of (data.pad_to_multiple_of) must be at least 1 (1 = the longest "
                            f"sample's width), got {pad_to_multiple_of}")
        if packing == "dynamic":
            if token_budget is None:
                token_budget = max_seq_len
                logger.info("dynamic batching without token_budget: using max_seq_len %d; pass "
                            "micro_batch_size x seq_length for fuller batches", max_seq_len)
            if token_budget < max_seq_len:
                raise DataError(
                    f"token_budget {token_budget} is below max_seq_len {max_seq_len}, so the longest "
                    f"samples fit in no batch; raise token_budget (micro_batch_size x seq_length is usual)"
                )
        self.files = expand_files(data_files)
        self.tokenizer = tokenizer
        self.seq_length = max_seq_len
        self.shuffle = shuffle
        self.packing = packing
        self.truncation = truncation
        self.token_budget = token_budget
        self.seed = seed
        self.pad_to_multiple_of = pad_to_multiple_of
        self.items_are_batches = packing == "dynamic"
        self.pad_id = tokenizer.pad_id
        renderer = resolve_template(template, tokenizer)
        self.template_name = renderer.label
        self._tokens, self._mask, offsets, read_stats = load_sft_tokens(
            self.files, tokenizer, renderer, on_bad_line, cache_dir
        )
        self.stats: dict[str, int] = dict(read_stats)
        self._select(offsets)
        self._group()
        self._report()

    def _select(self, offsets: np.ndarray) -> None:
        """Apply the length policy and drop samples without a target: sets _starts and _lengths."""
        starts, lengths = offsets[:-1], np.diff(offsets)
        too_long = lengths > self.seq_length
        keep = np.ones(len(lengths), dtype=bool)
        if self.truncation == "drop":
            keep &= ~too_long
            self.stats["dropped_too_long"] = int(too_long.sum())
            self.stats["truncated"] = 0
        else:
            lengths = np.minimum(lengths, self.seq_length)
            self.stats["truncated"] = int(too_long.sum())
            self.stats["dropped_too_long"] = 0
        # A target is a trained token after the sample's first position (labels are shifted by one).
        trained = np.concatenate([[0], np.cumsum(self._mask, dtype=np.int64)])
        targets = trained[starts + lengths] - trained[np.minimum(starts + 1, starts + lengths)]
        no_target = keep & (targets == 0)
        keep &= ~no_target
        self.stats["dropped_no_target"] = int(no_target.sum())
        self._starts = starts[keep].astype(np.int64)
        self._lengths = lengths[keep].astype(np.int64)
        self.stats["samples"] = len(self._starts)
        self.stats["tokens"] = int(self._lengths.sum())
        self.stats["target_tokens"] = int(targets[keep].sum())
        if not len(self._starts):
            other = " or use truncation='truncate'" if self.truncation == "drop" else ""
            raise DataError(
                f"no instruction sample is left of {len(lengths)} ({self.stats['dropped_too_long']} "
                f"longer than max_seq_len {self.seq_length}, {self.stats['dropped_no_target']} without "
                f"an assistant token within it); raise data.seq_length{other}"
            )

    def _group(self) -> None:
        """Group samples into items: packed rows, single padded rows, or budgeted batches."""
        if self.packing == "pack":
            groups = pack_best_fit(self._lengths, self.seq_length, self.seed)
        elif self.packing == "pad":
            groups = list(np.arange(len(self._lengths), dtype=np.int64).reshape(-1, 1))
        else:
            assert self.token_budget is not None  # set in __init__ for dynamic batching
            groups = batch_by_budget(self.padded_width(self._lengths), self.token_budget, self.seed)
        self._group_offsets = np.zeros(len(groups) + 1, dtype=np.int64)
        np.cumsum([len(g) for g in groups], out=self._group_offsets[1:])
        self._group_samples = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
        self.stats["items"] = len(groups)
        if self.packing == "dynamic":
            cells = np.array([self.padded_width(self._lengths[g].max()) * len(g) for g in groups], dtype=np.int64)
            self.stats["padding_tokens"] = int(cells.sum()) - self.stats["tokens"]
        else:
            self.stats["padding_tokens"] = len(groups) * self.seq_length - self.stats["tokens"]

    def _report(self) -> None:
        s = self.stats
        logger.info(
            "instruction data: %d samples (%d tokens, %d trained) in %d %s, template %s; padding %.1f%%",
            s["samples"], s["tokens"], s["target_tokens"], s["items"],
            "batches" if self.packing == "dynamic" else "rows", self.template_name,
            100.0 * s["padding_tokens"] / max(1, s["tokens"] + s["padding_tokens"]),
        )
        lost = {k: s[k] for k in ("bad_lines", "truncated", "dropped_too_long", "dropped_no_target",
                                  "unanswered_dropped") if s.get(k)}
        if lost:
            logger.warning("instruction data: %s (max_seq_len %d)",
                           ", ".join(f"{k} {v}" for k, v in lost.items()), self.seq_length)

    # --- items ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of items: rows ("pack", "pad") or micro-batches ("dynamic")."""
        return len(self._group_offsets) - 1

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and shifted labels (int64) of kept sample `index`, before grouping."""
        start, n = int(self._starts[index]), int(self._lengths[index])
        ids = self._tokens[start : start + n].astype(np.int64)
        labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
        labels[:-1] = np.where(self._mask[start + 1 : start + n], ids[1:], IGNORE_INDEX)
        return ids, labels

    def _samples_of(self, item: int) -> np.ndarray:
        if item < 0:
            item += len(self)
        if not 0 <= item < len(self):
            raise IndexError(f"item {item} out of range for {len(self)} items")
        return self._group_samples[self._group_offsets[item] : self._group_offsets[item + 1]]

    def padded_width(self, longest: Any) -> Any:
        """Width of a dynamic batch whose longest sample has `longest` tokens (an int or an array of them):
        rounded up to a multiple of pad_to_multiple_of, at most seq_length."""
        m = self.pad_to_multiple_of
        return np.minimum(-(-longest // m) * m, self.seq_length)

    def _fill(self, rows: Sequence[np.ndarray], width: int) -> dict[str, torch.Tensor]:
        """Rows (each a list of samples laid end to end) padded to `width`, as batch-contract tensors."""
        b = len(rows)
        ids = np.full((b, width), self.pad_id, dtype=np.int64)
        labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((b, width), dtype=np.int64)
        doc = np.zeros((b, width), dtype=np.int64)
        for r, samples in enumerate(rows):
            p = 0
            for d, s in enumerate(samples.tolist()):
                tok, lab = self.sample(s)
                n = len(tok)
                ids[r, p : p + n] = tok
                labels[r, p : p + n] = lab
                pos[r, p : p + n] = np.arange(n)
                doc[r, p : p + n] = d
                p += n
            # Padding is a document of its own, so no real token ever attends to it.
            pos[r, p:] = np.arange(width - p)
            doc[r, p:] = len(samples)
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(pos),
            "document_ids": torch.from_numpy(doc),
        }

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """A row ([T] tensors), or with packing="dynamic" a micro-batch ([b, T_b] tensors)."""
        samples = self._samples_of(int(index))
        if self.items_are_batches:
            width = int(self.padded_width(self._lengths[samples].max()))
            return self._fill([samples[k : k + 1] for k in range(len(samples))], width)
        return {k: v[0] for k, v in self._fill([samples], self.seq_length).items()}

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Items `indices` stacked ([B, T]); with packing="dynamic", their batches joined and padded."""
        groups = [self._samples_of(int(i)) for i in np.asarray(indices).reshape(-1)]
        if self.items_are_batches:
            rows = [g[k : k + 1] for g in groups for k in range(len(g))]
            width = max(int(self.padded_width(self._lengths[g].max())) for g in groups)
            return self._fill(rows, width)
        return self._fill(groups, self.seq_length)

    @property
    def num_tokens(self) -> int:
        """Tokens of the kept samples (without padding)."""
        return self.stats["tokens"]


__all__ = [
    "BAD_LINE_MODES",
    "PACKING_MODES",
    "BadLines",
    "SUFFIXES",
    "TRUNCATION_MODES",
    "InstructionDataset",
    "batch_by_budget",
    "file_objects",
    "inspect_instruction_file",
    "iter_records",
    "load_sft_tokens",
    "pack_best_fit",
    "parse_record",
]
