"""Weighted mixtures of pre-training sources: which source, and which of its samples, each position of the
run's sample stream reads.

Positions are global (over all data-parallel ranks, `StatefulLoader.consumed`) and samples are packed
windows of `seq_length` tokens, so samples per source are tokens per source. The blend is deterministic,
as Megatron's blended index is, not a random draw: source s's j-th sample has the ideal time
(j + 1/2) / w_s (weights normalised to sum to 1), and the sources' samples take the positions in the order of
those times (ties to the earlier source). Then after any p positions source s has had w_s x p samples within
1/2 + w_s x S / 2 (S: the number of sources; tests/data/test_mixture.py checks the bound), about one sample,
whatever p is: the shares follow the weights at every point of the run. A source of weight 0 gets none.

A schedule changes the weights at given positions (`Segment`): each segment blends from the counts the
run had reached when it starts, so a change never re-reads or skips a sample. A run resumed with other
weights starts a segment where it resumes (`Mixture.resumed`), from the counts saved in its checkpoint.

Within a source, its samples are read in a fresh permutation per source epoch (seeded by the run's seed and
the source's name, so adding a source does not reshuffle the others): a small source repeats, a large one
is read in part; `epochs` reports how far each has gone. Nothing here reads data: the positions map to
indices of the sources' datasets laid end to end (`MixtureDataset` in `data.build`).
"""

from __future__ import annotations

import copy
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


class Permutations:
    """Permutations of range(n) seeded by a key (a list of whole numbers), the last `keep` of them kept;
    read-only (callers must not reorder them). Without `shuffle`, range(n) itself."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._cache: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()

    def get(self, key: Sequence[int], n: int, shuffle: bool = True) -> np.ndarray:
        """The permutation of range(n) for `key`."""
        key = tuple(int(k) for k in key) + (n, int(shuffle))
        order = self._cache.get(key)
        if order is None:
            order = np.random.default_rng(list(key[:-2])).permutation(n) if shuffle else np.arange(n, dtype=np.int64)
            order.flags.writeable = False
            self._cache[key] = order
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return order


@dataclass(frozen=True)
class Segment:
    """From global position `start` on, blend with `weights` (one per source, summing to 1), from the
    per-source sample `counts` reached at `start`."""

    start: int
    weights: tuple[float, ...]
    counts: tuple[int, ...]


def _normalised(weights: Sequence[float]) -> tuple[float, ...]:
    total = float(sum(weights))
    if not all(w >= 0 for w in weights) or total <= 0:
        raise ValueError(f"mixture weights {list(weights)} must be non-negative with a positive sum")
    return tuple(float(w) / total for w in weights)


def _times(weights: Sequence[float], firsts: np.ndarray, take: int) -> tuple[np.ndarray, np.ndarray]:
    """The ideal times and sources of each source's `take` samples from its sample `firsts[s]` on, merged in
    order (time, then source); sources of weight 0 give none."""
    times, sources = [], []
    for s, w in enumerate(weights):
        if w > 0:
            j = firsts[s] + np.arange(take, dtype=np.float64)
            times.append((j + 0.5) / w)
            sources.append(np.full(take, s, dtype=np.int64))
    t, src = np.concatenate(times), np.concatenate(sources)
    order = np.lexsort((src, t))
    return t[order], src[order]


def _local_counts(weights: Sequence[float], p: int) -> np.ndarray:
    """Samples of each source among the first `p` positions of a segment that blends with `weights` from
    counts 0: the first p of the merged ideal times."""
    n = len(weights)
    counts = np.zeros(n, dtype=np.int64)
    if p <= 0:
        return counts
    # Every count is within S/2 + 2 of w x p: start a little below, and merge the rest exactly.
    base = np.array([max(0, int(np.floor(w * p)) - n - 2) if w > 0 else 0 for w in weights], dtype=np.int64)
    _, sources = _times(weights, base, 2 * n + 6)
    rest = p - int(base.sum())
    return base + np.bincount(sources[:rest], minlength=n)


class Mixture:
    """The sources' blend over the run's positions (see the module docstring)."""

    def __init__(self, names: Sequence[str], lengths: Sequence[int], seed: int,
                 schedule: Sequence[tuple[int, Sequence[float]]], shuffle: bool = True) -> None:
        """`names` and `lengths` (samples) of the sources; `schedule`: (start position, weights) pairs, the
        first at position 0, positions increasing."""
        if len(set(names)) != len(names):
            raise ValueError(f"mixture sources must have distinct names, got {list(names)}")
        if any(n < 1 for n in lengths):
            raise ValueError(f"every mixture source needs at least one sample, got {dict(zip(names, lengths))}")
        starts = [start for start, _ in schedule]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"a mixture schedule starts at position 0 and increases, got {starts}")
        self.names, self.lengths = list(names), np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.seed, self.shuffle = seed, shuffle
        self.segments: list[Segment] = []
        for start, weights in schedule:
            self._append(start, weights)
        self._orders = Permutations(keep=8)  # source epochs

    def _append(self, start: int, weights: Sequence[float], counts: Optional[Sequence[int]] = None) -> None:
        if len(weights) != len(self.names):
            raise ValueError(f"{len(weights)} weights for {len(self.names)} mixture sources")
        if counts is None:
            counts = self.counts(start) if self.segments else np.zeros(len(self.names), dtype=np.int64)
        self.segments.append(Segment(start, _normalised(weights), tuple(int(c) for c in counts)))

    def resumed(self, position: int, counts: Sequence[int]) -> None:
        """Continue from `position` with the per-source `counts` a checkpoint saved there (a run whose earlier
        weights, or sources, differ from these): later segments keep their weights, from this anchor on."""
        if len(counts) != len(self.names):
            raise ValueError(f"{len(counts)} saved counts for {len(self.names)} mixture sources")
        if any(c < 0 for c in counts):
            raise ValueError(f"saved per-source counts {list(counts)} must not be negative")
        weights = self._segment(position).weights
        later = [(s.start, s.weights) for s in self.segments if s.start > position]
        self.segments = [Segment(position, weights, tuple(int(c) for c in counts))]
        for start, w in later:
            self._append(start, w)

    def _segment(self, position: int) -> Segment:
        current = self.segments[0]
        for segment in self.segments:
            if segment.start <= position:
                current = segment
        return current

    def counts(self, position: int) -> np.ndarray:
        """Samples of each source among positions [first segment's start, position)."""
        segment = self._segment(position)
        return np.asarray(segment.counts, dtype=np.int64) + _local_counts(segment.weights, position - segment.start)

    def sources(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For positions [start, stop): each one's source, and the source's sample number (since the run's
        start) it reads."""
        out_src, out_num = [], []
        pos = start
        while pos < stop:
            segment = self._segment(pos)
            later = [s.start for s in self.segments if s.start > pos]
            end = min(stop, later[0]) if later else stop
            local = pos - segment.start
            before = _local_counts(segment.weights, local)
            take = end - pos
            _, src = _times(segment.weights, before, take)  # each source's next `take`: enough for any split
            src = src[:take]
            nth = np.zeros(take, dtype=np.int64)
            for s in range(len(self.names)):
                mine = src == s
                nth[mine] = segment.counts[s] + before[s] + np.arange(int(mine.sum()))
            out_src.append(src)
            out_num.append(nth)
            pos = end
        if not out_src:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(out_src), np.concatenate(out_num)

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Indices, into the sources' datasets laid end to end, of the samples at positions [start, stop)."""
        src, nth = self.sources(start, stop)
        out = np.empty(len(src), dtype=np.int64)
        for s in np.unique(src):
            mine = src == s
            epochs, within = np.divmod(nth[mine], self.lengths[s])
            picked = np.empty(len(within), dtype=np.int64)
            for e in np.unique(epochs):
                at = epochs == e
                picked[at] = self._order(int(s), int(e))[within[at]]
            out[mine] = self.offsets[s] + picked
        return out

    def order(self, epoch: int) -> np.ndarray:
        """The indices at positions [epoch x N, (epoch + 1) x N), N the samples of all sources (the loader's
        nominal epoch)."""
        n = int(self.lengths.sum())
        return self.indices(epoch * n, (epoch + 1) * n)

    def epochs(self, position: int) -> dict[str, float]:
        """Each source's epochs read by `position` (samples read / its samples)."""
        return {n: float(c) / int(length) for n, c, length in zip(self.names, self.counts(position), self.lengths)}

    def copy(self) -> "Mixture":
        """The same blend with its own permutation cache (for a reader on another thread)."""
        twin = copy.copy(self)
        twin.segments = list(self.segments)
        twin._orders = Permutations(keep=8)
        return twin

    def _order(self, source: int, epoch: int) -> np.ndarray:
        name_key = zlib.crc32(self.names[source].encode())
        return self._orders.get([self.seed, name_key, epoch], int(self.lengths[source]), self.shuffle)


class MixtureDataset(Dataset):
    """The sources' datasets (packed samples of one length) laid end to end, with their names, weights and
    weight schedule; `StatefulLoader` reads it through the `Mixture` it makes (`blend`), in the blend's order
    and not shuffled as a whole. Index i is sample i - offset of the source it falls in."""

    shuffle = False  # the blend orders the samples (each source shuffled per epoch inside it)

    def __init__(self, names: Sequence[str], datasets: Sequence[Any], weights: Sequence[float],
                 schedule: Sequence[tuple[int, Sequence[float]]] = ()) -> None:
        """`schedule`: (step, weights) pairs, steps increasing from 2: from optimizer step `step` on (the first
        step is 1, as in the step records) the weights are `weights`."""
        self.names, self.datasets, self.weights = list(names), list(datasets), list(weights)
        self.schedule = [(int(step), list(w)) for step, w in schedule]
        self.lengths = [len(d) for d in datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.seq_length = datasets[0].seq_length

    def blend(self, seed: int, global_batch_size: int) -> Mixture:
        """The run's blend, the schedule's steps turned into positions of `global_batch_size` samples."""
        schedule = [(0, self.weights)] + [((step - 1) * global_batch_size, w) for step, w in self.schedule]
        return Mixture(self.names, self.lengths, seed, schedule)

    def __len__(self) -> int:
        """Samples of all sources (one pass over each: the loader's nominal epoch)."""
        return int(sum(self.lengths))

    def _split(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample indices out of range for {len(self)} samples")
        source = np.searchsorted(self.offsets, indices, side="right") - 1
        return source, indices - self.offsets[source]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index` of the sources laid end to end."""
        return {k: v[0] for k, v in self.get_batch([index]).items()}

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked in that order, each read from its source."""
        idx = np.asarray(indices, dtype=np.int64)
        source, local = self._split(idx)
        parts: dict[int, dict[str, torch.Tensor]] = {}
        for s in np.unique(source):
            parts[int(s)] = self.datasets[int(s)].get_batch(local[source == s])
        keys = parts[int(source[0])].keys()
        out = {}
        for key in keys:
            first = parts[int(source[0])][key]
            stacked = first.new_empty((len(idx), *first.shape[1:]))
            for s, batch in parts.items():
                stacked[torch.from_numpy(source == s)] = batch[key]
            out[key] = stacked
        return out
