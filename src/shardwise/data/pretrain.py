"""Pre-training samples: a token stream (prepared shards, or an array) -> fixed-length packed samples.

Documents follow each other in the stream, each ending in EOS. Samples are consecutive windows of
the stream, `seq_length + 1` tokens long and overlapping by one token, so that every token after the
first is a prediction target exactly once per epoch; a document longer than a sample continues in
the next one. Where the stream knows its document boundaries, each sample carries `document_ids`
(attention stays inside a document, seed 003 2.1) and `position_ids` that restart at each document.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Bump when what files_key feeds changes, so that old caches are never read as new ones.
_CACHE_VERSION = 1
_DATA_EXTENSIONS = (".txt", ".text", ".md", ".jsonl", ".ndjson", ".json", ".parquet", ".gz")


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


def default_cache_dir() -> str:
    """Where tokenizers, token arrays and the measured CPU peak are cached: $SHARDWISE_CACHE, else
    ~/.cache/shardwise (data.cache_dir overrides it for data)."""
    return os.environ.get("SHARDWISE_CACHE") or str(Path.home() / ".cache" / "shardwise")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def files_key(files: Sequence[str], *extra: object) -> str:
    """Hash of file paths, sizes and modification times (plus `extra`): changes when any file does."""
    parts = []
    for f in files:
        st = os.stat(f)
        parts.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps([_CACHE_VERSION, parts, [str(e) for e in extra]])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


class ArrayTokens:
    """Tokens held in one array (tests, small corpora), with optional document start positions.

    Offers the reading interface of `TokenShards`, so PackedDataset treats both alike.
    """

    def __init__(self, tokens: np.ndarray, document_starts: np.ndarray | None = None) -> None:
        """Wrap `tokens`; `document_starts` (sorted positions where documents begin) enable masks."""
        self.tokens = tokens
        self.has_documents = document_starts is not None
        self._starts = np.asarray(document_starts if document_starts is not None else [0], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Tokens in the array."""
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens of positions [start, stop)."""
        return np.asarray(self.tokens[start:stop])

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Positions p with start <= p < stop at which a document begins."""
        lo, hi = np.searchsorted(self._starts, [start, stop])
        return self._starts[lo:hi]


def window_documents(starts: np.ndarray, window_start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(document_ids, position_ids) of a `length`-token window, given the document starts inside it.

    Ids count documents from 0 at the window's first token; positions restart at each document start
    and at the window start (a document split across samples continues from position 0).
    """
    arange = np.arange(length, dtype=np.int64)
    begins = np.zeros(length, dtype=bool)
    begins[np.asarray(starts, dtype=np.int64) - window_start] = True
    begins[0] = False  # the window start opens a segment anyway; it must not open a second one
    document_ids = np.cumsum(begins)
    segment_start = np.maximum.accumulate(np.where(begins, arange, 0))
    return document_ids, arange - segment_start


class PackedDataset(Dataset):
    """Fixed-length samples cut from a token stream: sample i holds tokens [i*T, i*T + T + 1).

    The stream is a flat array, an `ArrayTokens`, or prepared `TokenShards` (documents followed by
    EOS). When document boundaries are known, each sample also carries `document_ids` (with
    `reset_attention_mask`: attention stays inside each document) and `position_ids` (with
    `reset_position_ids`: positions restart at each document). `start`/`stop` restrict the samples
    to a token range (the eval split).
    """

    def __init__(
        self,
        tokens: Any,
        seq_length: int,
        *,
        start: int = 0,
        stop: int | None = None,
        reset_attention_mask: bool = True,
        reset_position_ids: bool = True,
    ) -> None:
        """Cut the stream `tokens` into samples of `seq_length` inputs (and `seq_length` shifted labels)."""
        if seq_length < 1:
            raise DataError(f"data.seq_length must be at least 1, got {seq_length}")
        self.source = ArrayTokens(tokens) if isinstance(tokens, np.ndarray) else tokens
        self.seq_length = seq_length
        self.start = start
        self.stop = self.source.num_tokens if stop is None else stop
        documents = getattr(self.source, "has_documents", True)
        self.document_masks = documents and reset_attention_mask
        self.document_positions = documents and reset_position_ids
        # The +1: labels are the inputs shifted by one, so a sample reads one token past its window.
        self._len = max(0, (self.stop - self.start - 1) // seq_length)
        if self._len == 0:
            raise DataError(
                f"only {self.stop - self.start} tokens, but one sample of seq_length {seq_length} needs "
                f"{seq_length + 1}; add more text or lower data.seq_length"
            )

    @property
    def tokens(self) -> np.ndarray:
        """The token array of an in-memory stream (for tests and tools)."""
        return self.source.tokens

    def __len__(self) -> int:
        """Number of samples."""
        return self._len

    def _check(self, indices: np.ndarray) -> None:
        if indices.size and (indices.min() < 0 or indices.max() >= self._len):
            raise IndexError(f"sample indices out of range for {self._len} samples")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """{"input_ids", "labels"[, "document_ids", "position_ids"]}: LongTensors [T] of sample `index`."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples")
        return {k: v[0] for k, v in self.get_batch([index]).items()}

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked: {"input_ids": [B, T], "labels": [B, T], ...}."""
        idx = np.asarray(indices, dtype=np.int64)
        self._check(idx)
        T = self.seq_length
        begins = self.start + idx * T
        if isinstance(self.source, ArrayTokens):
            # One numpy gather for the whole micro-batch.
            windows = self.source.tokens[begins[:, None] + np.arange(T + 1)].astype(np.int64)
        else:
            windows = np.stack([self.source.read(b, b + T + 1) for b in begins]).astype(np.int64)
        windows = torch.from_numpy(windows)
        batch = {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
        if self.document_masks or self.document_positions:
            docs, positions = zip(*(
                window_documents(self.source.document_starts(b + 1, b + T), b, T) for b in begins
            ))
            if self.document_masks:
                batch["document_ids"] = torch.from_numpy(np.stack(docs))
            if self.document_positions:
                batch["position_ids"] = torch.from_numpy(np.stack(positions))
        return batch

    @property
    def num_tokens(self) -> int:
        """Tokens in this dataset's range of the stream."""
        return self.stop - self.start


class TextDataset(PackedDataset):
    """The seed documents' pretraining dataset: text files packed into `max_seq_len` samples.

    The files are prepared into token shards once (cached by input, tokenizer and options, see
    `prepare_cached`); samples carry document masks and restarting positions.
    """

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Tokenizer,
        max_seq_len: int,
        shuffle: bool = True,
        cache_dir: str | None = None,
        **prepare_options: Any,
    ) -> None:
        """Prepare the files matching `data_files` (options as `prepare_corpus`); `shuffle` is for the loader."""
        from .prepare import prepare_cached
        from .shards import TokenShards

        self.files = expand_files(data_files)
        self.tokenizer = tokenizer
        self.shuffle = shuffle
        directory = prepare_cached(self.files, tokenizer, cache_dir, **prepare_options)
        super().__init__(TokenShards(directory, tokenizer), max_seq_len)
