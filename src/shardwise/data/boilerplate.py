"""Boilerplate lines: lines that recur across many documents (navigation, cookie notices, share buttons,
licence footers) removed from the documents that repeat them.

`BoilerplateLines(min_docs).clean(text)` removes from `text` each line (compared with surrounding
whitespace stripped, and only lines of at least MIN_LINE_CHARS characters: short lines such as "Yes." or
"CHAPTER I" recur by chance) that appeared in at least `min_docs` earlier documents. The first `min_docs`
documents keep it; a line counts once per document.

Counting is online, in input order, in a count-min sketch: DEPTH rows of uint8 counters (saturating at
255), each line hashed to one counter a row, its count the smallest of its counters (never below the
true count). With at least as many counters a row as distinct lines, a line seen fewer than `min_docs`
times looks like `min_docs` only if all DEPTH of its counters are pushed that high by others:
probability about P(Poisson(1) >= min_docs)^DEPTH, 2e-10 at min_docs = 5. The width is sized from the
input's bytes (a line every ~64 bytes), at most 2^27 counters a row (512 MiB in all): memory is fixed
before the first document; a part of a preparation in parts counts its own inputs.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import DataError

MIN_LINE_CHARS = 20
DEPTH = 4
MIN_WIDTH, MAX_WIDTH = 1 << 16, 1 << 27
BYTES_PER_LINE = 64
MAX_MIN_DOCS = 255  # the counters saturate there


def check_min_docs(min_docs: int) -> int:
    """`min_docs` checked: 0 (off) or 1..MAX_MIN_DOCS."""
    if isinstance(min_docs, bool) or not isinstance(min_docs, int) or not 0 <= min_docs <= MAX_MIN_DOCS:
        raise DataError(f"boilerplate_lines must be 0 (off) or the documents a line may recur in before it is "
                        f"removed, 1 to {MAX_MIN_DOCS}; got {min_docs!r}")
    return min_docs


def sketch_width(input_bytes: int) -> int:
    """Counters a row for inputs of `input_bytes`: a power of two, at least one per expected line."""
    lines = max(int(input_bytes) // BYTES_PER_LINE, 1)
    return int(min(MAX_WIDTH, max(MIN_WIDTH, 1 << (lines - 1).bit_length())))


class BoilerplateLines:
    """Removes the lines that earlier documents repeated (see the module's docstring)."""

    def __init__(self, min_docs: int, width: int, examples: int = 20) -> None:
        """Remove a line once `min_docs` earlier documents had it; `width` counters a row (sketch_width); keep
        the first `examples` lines removed as examples."""
        self.min_docs, self.width, self.keep_examples = min_docs, width, examples
        self.table = np.zeros((DEPTH, width), dtype=np.uint8)
        self.rows = np.arange(DEPTH)[:, None]
        self.lines_removed = 0
        self.examples: dict[str, int] = {}  # the first removed lines, each with how often it was removed

    def _cells(self, lines: list[str]) -> np.ndarray:
        blob = b"".join(hashlib.blake2b(line.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                        for line in lines)
        words = np.frombuffer(blob, dtype="<u4").reshape(len(lines), 4).T  # DEPTH independent 32-bit hashes
        return (words % np.uint32(self.width)).astype(np.int64)

    def clean(self, text: str) -> str:
        """`text` without its lines that `min_docs` earlier documents had; counts this document's lines."""
        lines = text.split("\n")
        keys = {line.strip() for line in lines}
        keys = sorted(k for k in keys if len(k) >= MIN_LINE_CHARS)
        if not keys:
            return text
        cells = self._cells(keys)
        current = self.table[self.rows, cells]
        counts = current.min(axis=0).astype(np.int64)
        # conservative update: each counter becomes at least the line's count plus one (a tighter estimate
        # than adding one to all of them)
        self.table[self.rows, cells] = np.maximum(current, np.minimum(counts + 1, 255).astype(np.uint8))
        repeated = {k for k, c in zip(keys, counts) if c >= self.min_docs}
        if not repeated:
            return text
        kept = [line for line in lines if line.strip() not in repeated]
        removed = len(lines) - len(kept)
        self.lines_removed += removed
        for k in repeated:
            if k in self.examples or len(self.examples) < self.keep_examples:
                self.examples[k] = self.examples.get(k, 0) + 1
        return "\n".join(kept)


__all__ = ["BoilerplateLines", "check_min_docs", "sketch_width"]
