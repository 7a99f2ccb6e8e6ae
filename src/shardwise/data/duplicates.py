"""Duplicate documents, exact and near: the keys each document is known by, and the index that says which
documents repeat an earlier one.

A document's keys are one row of 64-bit integers:
- column 0, its digest (blake2b of its text): equal digests are exact duplicates;
- with near-duplicate detection, one more column per LSH band: its MinHash signature over word n-gram
  shingles (`ngram` words; in Chinese a CJK character is a word), cut into `bands` bands of `rows`
  values, each band hashed to one key. Two documents whose shingle sets have Jaccard similarity s share
  at least one band key with probability 1 - (1 - s^rows)^bands: with the default 14 bands of 8 rows
  (datatrove's), 0.92 at s = 0.8, 0.9996 at s = 0.9, 0.21 at s = 0.6, 0.05 at s = 0.5.

The rule (`DuplicateIndex`): a document is removed when any of its keys was a key of an earlier document,
kept or removed (an exact duplicate when the digest repeats, else a near duplicate). Earlier means earlier
in input order, so the first of a group stays. Deciding needs only the keys, never the texts, so one
process can decide column by column over the keys that many processes computed (`prepare_parts.py`),
and the answer is the same as one process seeing the documents in order.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import DataError

NEAR_DEFAULTS = {"ngram": 5, "bands": 14, "rows": 8}
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f"
# A CJK character alone, or a run of other letters and digits.
_WORD = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")
_SEED = 0x5EED_D0C5  # fixed: keys must be the same in every process, on every machine, in every run
_MASK32 = (1 << 32) - 1


def check_near(near: dict[str, Any] | None) -> dict[str, int]:
    """The near-duplicate parameters, defaults filled in, checked."""
    out = dict(NEAR_DEFAULTS)
    for name, value in (near or {}).items():
        if name not in NEAR_DEFAULTS:
            raise DataError(f"near-duplicate option {name!r} is unknown; expected some of {sorted(NEAR_DEFAULTS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"near-duplicate option {name} must be a positive integer, got {value!r}")
        out[name] = value
    if out["bands"] * out["rows"] > 1024:
        raise DataError(f"near-duplicate bands x rows is {out['bands'] * out['rows']}; at most 1024 hashes a document")
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _permutations(count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` hash permutations h -> a*h + b (mod 2^64, a odd): each is a bijection of the 64-bit keys."""
    rng = np.random.default_rng(_SEED)
    a = rng.integers(0, 1 << 63, count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return a, rng.integers(0, 1 << 63, count, dtype=np.uint64)


def _hashes64(strings: Iterable[str]) -> np.ndarray:
    """The 8-byte blake2b of each string, as uint64: the same in every process and on every machine."""
    blob = b"".join(hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=8).digest() for s in strings)
    return np.frombuffer(blob, dtype="<u8").astype(np.uint64)


def _word_hashes(words: list[str]) -> np.ndarray:
    """A 64-bit hash of each word (each distinct word hashed once: words repeat, Zipf's law)."""
    vocabulary: dict[str, int] = {}
    ids = np.fromiter((vocabulary.setdefault(w, len(vocabulary)) for w in words), np.int64, len(words))
    return _hashes64(vocabulary)[ids]


def _shingles(texts: Sequence[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every document's word n-grams, concatenated, and where each document's start.

    A document with fewer than `ngram` words has one shingle: all its words (none: the empty one)."""
    words = [_WORD.findall(t.lower()) for t in texts]
    counts = np.fromiter(map(len, words), np.int64, len(words))
    h = _word_hashes([w for ws in words for w in ws])
    total = h.size
    shingle = h.copy()
    for k in range(1, ngram):
        # shingle[i] folds in word i + k; past the end of the whole array the values are never used
        shifted = np.zeros_like(h)
        shifted[: max(total - k, 0)] = h[k:]
        shingle = _mix(shingle ^ (shifted + np.uint64(k)))
    word_start = np.cumsum(counts) - counts
    per_doc = np.maximum(counts - ngram + 1, 1)
    picks = [np.arange(s, s + m) for s, m in zip(word_start, per_doc)]
    index = np.concatenate(picks) if picks else np.zeros(0, np.int64)
    values = shingle[np.minimum(index, total - 1)] if total else np.zeros(index.size, np.uint64)
    starts = np.cumsum(per_doc) - per_doc
    for d in np.flatnonzero(counts < ngram):  # short: its one shingle folds what words it has
        v = np.asarray(np.uint64(counts[d]))
        for x in h[word_start[d]: word_start[d] + counts[d]]:
            v = _mix(v ^ x)
        values[starts[d]] = v
    return values, starts


def minhash(texts: Sequence[str], ngram: int, hashes: int) -> np.ndarray:
    """MinHash signatures, one row of `hashes` uint64 per text (equal entries estimate Jaccard similarity)."""
    out = np.empty((len(texts), hashes), np.uint64)
    if not texts:
        return out
    values, starts = _shingles(texts, ngram)
    a, b = _permutations(hashes)
    with np.errstate(over="ignore"):
        for j in range(0, hashes, 16):  # 16 permutations at a time bounds the temporary to 16 x shingles
            permuted = values[None, :] * a[j:j + 16, None] + b[j:j + 16, None]
            out[:, j:j + 16] = np.minimum.reduceat(permuted, starts, axis=1).T
    return out


def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per band of `rows` signature values: (documents, bands) uint64."""
    keys = np.zeros((signatures.shape[0], bands), np.uint64)
    with np.errstate(over="ignore"):
        for r in range(rows):
            keys = _mix(keys ^ signatures[:, r::rows][:, :bands] + np.uint64(r))
    return keys


def document_keys(texts: Sequence[str], near: dict[str, int] | None) -> np.ndarray:
    """The keys of each text (one row each): its digest, then (with `near`) its LSH band keys."""
    digests = _hashes64(texts).reshape(-1, 1)
    if near is None:
        return digests
    signatures = minhash(texts, near["ngram"], near["bands"] * near["rows"])
    return np.concatenate([digests, band_keys(signatures, near["bands"], near["rows"])], axis=1)


class DigestSet:
    """A set of 64-bit keys at 8 bytes per entry (a Python set of ints takes ~70).

    Entries live in sorted numpy runs whose sizes shrink geometrically (merged like a binary
    counter), so a lookup is a few `searchsorted` calls and adding n keys costs O(n log n) overall.
    8 bytes per unique key, and twice that briefly while the largest runs merge. With 64-bit keys, two
    distinct documents collide (one wrongly dropped as a duplicate) with probability about n^2 / 2^65:
    about 3e-4 for 100 million documents.
    """

    def __init__(self) -> None:
        """An empty set."""
        self._runs: list[np.ndarray] = []

    def __len__(self) -> int:
        """Number of keys held."""
        return sum(r.size for r in self._runs)

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """Add `keys` (uint64); True where a key was not seen before (nor earlier in `keys`)."""
        keys = np.asarray(keys, dtype=np.uint64)
        new = np.zeros(keys.size, dtype=bool)
        if not keys.size:
            return new
        _, first = np.unique(keys, return_index=True)
        new[first] = True
        for run in self._runs:
            pos = np.minimum(np.searchsorted(run, keys), run.size - 1)
            new &= run[pos] != keys
        added = np.sort(keys[new])
        if added.size:
            self._runs.append(added)
            while len(self._runs) > 1 and self._runs[-2].size <= 2 * self._runs[-1].size:
                b, a = self._runs.pop(), self._runs.pop()
                # Two sorted runs: the stable sort (timsort) merges them in linear time.
                self._runs.append(np.sort(np.concatenate([a, b]), kind="stable"))
        return new


class DuplicateIndex:
    """Every key column seen so far; says which documents repeat an earlier one (kept or not)."""

    def __init__(self, columns: int) -> None:
        """An index of `columns` key columns (1: exact only; 1 + bands: exact and near)."""
        self.columns = [DigestSet() for _ in range(columns)]

    def add(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add the keys of documents in order: (exact duplicate, near duplicate and not exact) flags."""
        exact = ~self.columns[0].add_new(keys[:, 0])
        near = np.zeros_like(exact)
        for c in range(1, len(self.columns)):
            near |= ~self.columns[c].add_new(keys[:, c])
        return exact, near & ~exact


__all__ = ["NEAR_DEFAULTS", "DigestSet", "DuplicateIndex", "band_keys", "check_near", "document_keys", "minhash"]
