"""Pre-training samples: a token stream (prepared shards, or an array) -> fixed-length packed samples.

Documents follow each other in the stream, each ending in EOS. Samples are consecutive windows of
the stream, `seq_length + 1` tokens long and overlapping by one token, so that every token after the
first is a prediction target exactly once per epoch; a document longer than a sample continues in
the next one. Where the stream knows its document boundaries, each sample carries `document_ids`
(attention stays inside a document, seed 003 2.1) and `position_ids` that restart at each document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError


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


__all__ = ["ArrayTokens", "PackedDataset", "window_documents"]
