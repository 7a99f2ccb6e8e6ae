"""An exact, resumable, data-parallel-aware loader.

Training data is one endless stream: the permutation of epoch 0, then that of epoch 1, and so on,
epoch e being `numpy.random.default_rng([seed, e]).permutation(len(dataset))` (or `arange` without
shuffling). Every optimizer step takes the next global batch of micro_batch_size x grad_accum x
dp_size samples from the stream; rank r takes its contiguous slice of it, cut into grad_accum
micro-batches. A step may straddle two epochs, and nothing is ever dropped: every sample of every
epoch is read exactly once over all ranks.

The position is a single count: global samples consumed since the start. It does not depend on the
number of ranks or the batch shape, so a checkpoint saved with one layout resumes with any other and
continues with exactly the samples not yet seen. With `num_workers > 0`, worker processes of a torch
DataLoader read the micro-batches; the main process counts what it has handed out, so the saved
position is what the trainer took, not what the workers prefetched.

With `prefetch` (the default on CUDA/NPU when num_workers is 0) a background thread reads the next
step's micro-batches, in pinned memory, while the current step computes; it too counts nothing:
a step it read but the trainer did not take is read again after a resume. `batches_to_device`
copies a step's micro-batches to the device without waiting (non_blocking from pinned memory).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import DataError
from ..untrusted import int_field, kind_of
from .mixture import Mixture, Permutations

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]

# Version of the state_dict layout; state without a version is the older per-epoch layout.
STATE_VERSION = 2
# Epoch permutations kept in memory: the current epoch and the next, for steps that straddle them.
_ORDER_CACHE = 2
# data.num_workers auto on CUDA/NPU. Reading a micro-batch is a numpy gather from memory-mapped shards
# (pre-training) or a fill of a few rows (SFT): milliseconds against a step of a tenth of a second or
# more, so one worker keeps up; the second covers a slow read (a cold page of a shard, a long SFT batch)
# without stalling the step. More would only hold cores and host memory (each worker is a fork of the
# trainer) that the ranks of a node share: 8 GPUs x 2 workers are already 16 processes.
ACCELERATOR_WORKERS = 2
# How often the prefetch thread and its reader look whether they should stop (seconds).
_POLL_S = 0.05


class _Stream:
    """The endless sample stream: global position p is sample order(p // N)[p % N]."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._orders = Permutations(keep=_ORDER_CACHE)

    def order(self, epoch: int) -> np.ndarray:
        """Sample indices of `epoch` in visiting order."""
        return self._orders.get([self.seed, epoch], self.num_samples, self.shuffle)

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at global positions [start, stop), across epoch boundaries."""
        n = self.num_samples
        parts = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, n)
            take = min(stop - pos, n - offset)
            parts.append(self.order(epoch)[offset : offset + take])
            pos += take
        # Always a fresh array: the cached permutations are read-only and must stay unchanged.
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class _RankMicroBatches(Sampler):
    """Index arrays of one rank's micro-batches, step after step, from global position `start` on.

    It runs in the main process (DataLoader workers receive its output), so it shares the loader's
    stream and sees a seed taken from a checkpoint.
    """

    def __init__(self, stream: _Stream, micro_batch_size: int, grad_accum: int, dp_rank: int,
                 dp_size: int) -> None:
        self.stream = stream
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.start = 0

    def step(self, position: int) -> list[np.ndarray]:
        """This rank's micro-batch indices for the step that begins at global `position`."""
        mbs = self.micro_batch_size
        first = position + self.dp_rank * mbs * self.grad_accum
        mine = self.stream.indices(first, first + mbs * self.grad_accum)
        return [mine[k * mbs : (k + 1) * mbs] for k in range(self.grad_accum)]

    def __iter__(self) -> Iterator[np.ndarray]:
        position = self.start
        global_batch = self.micro_batch_size * self.grad_accum * self.dp_size
        while True:
            yield from self.step(position)
            position += global_batch


class _WireBatch:
    """A micro-batch on its way from a worker, its tensors as numpy arrays.

    Token batches are small: pickled through the worker's pipe they arrive about twice as fast as
    torch's shared-memory tensors, whose file descriptors cost a round trip to the worker each.
    The DataLoader's pin-memory thread calls `pin_memory()`, which makes the batch there.
    """

    def __init__(self, batch: Batch) -> None:
        self.items: list[tuple[str, Any, bool]] = []
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                try:
                    self.items.append((key, value.numpy(), True))
                    continue
                except (TypeError, RuntimeError):  # bfloat16 and the like: torch sends it itself
                    pass
            self.items.append((key, value, False))

    def to_batch(self, pin: bool = False) -> Batch:
        """The micro-batch as tensors again, in pinned memory with `pin`."""
        out = {}
        for key, value, was_numpy in self.items:
            if was_numpy:
                value = torch.from_numpy(value)
            if pin and isinstance(value, torch.Tensor):
                value = value.pin_memory()
            out[key] = value
        return out

    def pin_memory(self, device: Any = None) -> Batch:
        """Called by the DataLoader's pin-memory thread."""
        return self.to_batch(pin=True)


class _MicroBatchReader(Dataset):
    """Reads a whole micro-batch per item (the item is an index array), for DataLoader workers."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, indices: np.ndarray) -> _WireBatch:  # type: ignore[override]
        return _WireBatch(collate(self.dataset, indices))


def _as_is(batch: _WireBatch) -> _WireBatch:
    """collate_fn for micro-batches that are already collated (module level: picklable)."""
    return batch


def resolve_num_workers(setting: int | str, device_type: str, local_world_size: int = 1) -> int:
    """Loader worker processes for data.num_workers `setting` on a device of kind `device_type`.

    An int is taken as it is. auto: 0 on CPU, where workers would compete with the compute threads
    for the cores; on CUDA/NPU `ACCELERATOR_WORKERS`, fewer when this rank's share of the node's
    cores (over `local_world_size` ranks) leaves no core spare beside the trainer's own.
    """
    if setting != "auto":
        return int(setting)
    if device_type == "cpu":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    spare = cores // max(1, local_world_size) - 1
    return max(0, min(ACCELERATOR_WORKERS, spare))


class _StepPrefetcher:
    """A background thread that reads the steps from global position `start` on, one step ahead.

    It has its own stream and sampler (the loader's cache of epoch permutations is not shared between
    threads) and puts (position, micro-batches) or, when reading fails, (position, the exception) into
    a queue of one; `pin` pins the micro-batches. It counts nothing: the loader counts what it takes.
    """

    def __init__(self, dataset: Dataset, sampler: _RankMicroBatches, start: int, global_batch: int,
                 pin: bool) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.start = start
        self.global_batch = global_batch
        self.pin = pin
        self.next_position = start  # of the step get() hands out next
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardwise-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        position = self.start
        try:
            while not self._stop.is_set():
                batches = [collate(self.dataset, idx) for idx in self.sampler.step(position)]
                if self.pin:
                    batches = [pin_batch(b) for b in batches]
                if not self._put((position, batches)):
                    return
                position += self.global_batch
        except BaseException as exc:  # handed to the reader, who raises it in next_step
            self._put((position, exc))

    def _put(self, item: tuple[int, Any]) -> bool:
        """Queue `item` unless told to stop first; whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> tuple[int, list[Batch] | BaseException]:
        """The next (position, micro-batches or exception), waiting for the thread to read it."""
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                self.next_position += self.global_batch
                return item
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise DataError("the loader's prefetch thread stopped without a batch or an error") from None

    def stop(self, wait: bool = True) -> None:
        """Stop the thread; with `wait`, wait for it (it finishes the micro-batch it is reading)."""
        self._stop.set()
        if wait:
            self._thread.join()


class StatefulLoader:
    """Micro-batches for each optimizer step of one data-parallel rank; the position is checkpointable.

    Over all ranks, every epoch's samples are each read exactly once, none dropped: the stream runs
    on into the next epoch's permutation, so a step may hold the end of one epoch and the start of
    the next. `steps_per_epoch` is ceil(len(dataset) / global batch), so that `ceil(epochs *
    steps_per_epoch)` steps read every sample of `epochs` epochs at least once.

    With `num_workers == 0` samples are read in this process. With `num_workers > 0` a torch
    DataLoader with persistent worker processes reads this rank's micro-batches from the current
    position on (pinned memory when CUDA is available, unless `pin_memory` says otherwise); call
    `close()` to stop the workers early, otherwise they stop with the loader. With `num_workers == 0`
    and `prefetch`, a background thread reads the next step while the trainer computes (pinned with
    `pin_memory`); `close()` stops it too.

    Datasets with `get_batch(indices)` read a whole micro-batch at once; a dataset with
    `items_are_batches = True` holds ready micro-batches as items (micro_batch_size must be 1).
    """

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        grad_accum: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch_factor: int = 2,
        prefetch: bool = False,
    ) -> None:
        """Serve rank `dp_rank` of `dp_size`: `grad_accum` micro-batches of `micro_batch_size` a step."""
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("grad_accum", grad_accum),
            ("dp_size", dp_size),
            ("prefetch_factor", prefetch_factor),
        ):
            if value < 1:
                raise DataError(f"{name} must be at least 1, got {value}")
        if num_workers < 0:
            raise DataError(f"num_workers must be 0 (read in this process) or more, got {num_workers}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1} for dp_size {dp_size}")
        if getattr(dataset, "items_are_batches", False) and micro_batch_size != 1:
            raise DataError(
                f"the dataset's items are already micro-batches (items_are_batches = True), so "
                f"micro_batch_size must be 1, got {micro_batch_size}; set train.micro_batch_size: 1 "
                f"(the dataset's token budget sets the batch size)"
            )
        num_samples = len(dataset)  # type: ignore[arg-type]
        if num_samples < 1:
            raise DataError("the training dataset is empty; add data or lower data.seq_length")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.prefetch_factor = prefetch_factor
        self.prefetch = prefetch
        self.num_samples = num_samples
        self.global_batch_size = micro_batch_size * grad_accum * dp_size
        if num_samples < self.global_batch_size:
            logger.warning(
                "the dataset has %d samples, fewer than one global batch of %d (micro_batch_size %d x "
                "gradient accumulation %d x data_parallel %d): every step holds some samples twice "
                "(from successive epochs)", num_samples, self.global_batch_size, micro_batch_size,
                grad_accum, dp_size)
        self.consumed = 0  # global samples handed out since the start of training, over all ranks
        # A mixture of sources (`data.mixture.MixtureDataset`) is read in its blend's order, else the samples
        # in a permutation per epoch.
        blend = getattr(dataset, "blend", None)
        self._stream: Any = blend(seed, self.global_batch_size) if blend is not None else \
            _Stream(num_samples, seed, shuffle)
        self._sampler = _RankMicroBatches(self._stream, micro_batch_size, grad_accum, dp_rank, dp_size)
        self._workers: DataLoader | None = None
        self._worker_iter: Iterator[Batch] | None = None
        self._prefetcher: _StepPrefetcher | None = None

    # --- where the stream is -------------------------------------------------------------------

    @property
    def seed(self) -> int:
        """Seed of the shuffles (a resumed checkpoint's seed replaces the configured one)."""
        return self._stream.seed

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from (0-based)."""
        return self.consumed // self.num_samples

    @property
    def epochs_done(self) -> float:
        """Epochs read so far, fractional: global samples consumed / dataset size."""
        return self.consumed / self.num_samples

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch, rounded up: ceil(len(dataset) / global batch size)."""
        return -(-self.num_samples // self.global_batch_size)

    def steps_for_epochs(self, epochs: float) -> int:
        """Fewest steps that read every sample of `epochs` epochs at least once (at least 1)."""
        return max(1, math.ceil(epochs * self.num_samples / self.global_batch_size))

    def __len__(self) -> int:
        """Optimizer steps per epoch (rounded up)."""
        return self.steps_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of `epoch` in visiting order, the same on every rank (read-only)."""
        return self._stream.order(epoch)

    def step_indices(self) -> list[np.ndarray]:
        """Sample indices of this rank's micro-batches for the next step, without advancing."""
        return self._sampler.step(self.consumed)

    # --- reading ---------------------------------------------------------------------------------

    def next_step(self) -> list[Batch]:
        """This rank's grad_accum micro-batches for the next step; runs on into the next epoch."""
        if self.num_workers > 0:
            batches = self._next_from_workers()
        elif self.prefetch:
            batches = self._next_prefetched()
        else:
            batches = [collate(self.dataset, idx) for idx in self.step_indices()]
        self.consumed += self.global_batch_size
        return batches

    def _next_prefetched(self) -> list[Batch]:
        if self._prefetcher is not None and self._prefetcher.next_position != self.consumed:
            self._stop_prefetch()  # the position was set from outside: read from there instead
        if self._prefetcher is None:
            self._start_prefetch()
        position, got = self._prefetcher.get()  # type: ignore[union-attr]
        if position != self.consumed:
            self._stop_prefetch()
            raise DataError(f"the prefetch thread read the step at sample {position}, but the loader is at "
                            f"{self.consumed}; this is a shardwise bug, please report it (data.num_workers 1 or "
                            f"more reads in worker processes instead)")
        if isinstance(got, BaseException):
            self._stop_prefetch()  # the next call starts again from the counted position
            raise got
        return got

    def _start_prefetch(self) -> None:
        # Its own stream and sampler: the thread must not share the permutation cache with this one.
        stream = self._stream.copy() if isinstance(self._stream, Mixture) else \
            _Stream(self.num_samples, self.seed, self.shuffle)
        sampler = _RankMicroBatches(stream, self.micro_batch_size, self.grad_accum, self.dp_rank, self.dp_size)
        self._prefetcher = _StepPrefetcher(self.dataset, sampler, self.consumed, self.global_batch_size,
                                           self.pin_memory)

    def _stop_prefetch(self) -> None:
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.stop()

    def _next_from_workers(self) -> list[Batch]:
        if self._worker_iter is None:
            if self._workers is None:
                self._workers = DataLoader(
                    _MicroBatchReader(self.dataset), batch_size=None, sampler=self._sampler,
                    num_workers=self.num_workers, collate_fn=_as_is, pin_memory=self.pin_memory,
                    persistent_workers=True, prefetch_factor=self.prefetch_factor,
                    # Its own generator: creating worker iterators must not draw from torch's global RNG,
                    # which the model's dropout uses.
                    generator=torch.Generator().manual_seed(self.seed),
                )
            self._sampler.start = self.consumed
            # With persistent workers a second iter() reuses the processes and drops their prefetch.
            self._worker_iter = iter(self._workers)
        try:
            batches = [next(self._worker_iter) for _ in range(self.grad_accum)]
            # Pinned batches come as tensors from the pin-memory thread; the others still on the wire.
            return [b.to_batch() if isinstance(b, _WireBatch) else b for b in batches]
        except BaseException:
            # Part of a step may have been taken: restart from the counted position next time.
            self._worker_iter = None
            raise

    def __iter__(self) -> Iterator[list[Batch]]:
        """Steps until the current epoch is complete, each a list of grad_accum micro-batches.

        The last one may hold the first samples of the next epoch; at most steps_per_epoch steps.
        """
        end = (self.epoch + 1) * self.num_samples
        while self.consumed < end:
            yield self.next_step()

    def close(self) -> None:
        """Stop the worker processes or the prefetch thread (if any); reading again starts new ones."""
        self._stop_prefetch()
        self._worker_iter = None
        workers, self._workers = self._workers, None
        if workers is not None:
            iterator = getattr(workers, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
            workers._iterator = None

    def __del__(self) -> None:
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:  # a loader dropped without close(): its thread ends on its own
            prefetcher.stop(wait=False)

    # --- checkpointing -------------------------------------------------------------------------

    @property
    def mixture(self) -> Optional[Mixture]:
        """The blend of a mixture of sources (None for one dataset)."""
        return self._stream if isinstance(self._stream, Mixture) else None

    def samples_by_source(self) -> dict[str, int]:
        """A mixture's samples read so far, per source name, over all ranks (empty for one dataset)."""
        mixture = self.mixture
        if mixture is None:
            return {}
        return {name: int(c) for name, c in zip(mixture.names, mixture.counts(self.consumed))}

    def state_dict(self) -> dict[str, Any]:
        """Position to save in a checkpoint: global samples consumed since the start, seed, dataset size;
        for a mixture also each source's samples read and size, by name."""
        state: dict[str, Any] = {"version": STATE_VERSION, "consumed": self.consumed, "seed": self.seed,
                                 "num_samples": self.num_samples}
        mixture = self.mixture
        if mixture is not None:
            state["sources"] = {name: {"read": count, "samples": int(length)} for (name, count), length in
                                zip(self.samples_by_source().items(), mixture.lengths)}
        return state

    @classmethod
    def for_run(cls, dataset: Any, cfg: Any, dp_rank: int, dp_size: int, world_size: int,
                device_type: str = "cpu", local_world_size: int = 1) -> "StatefulLoader":
        """The loader of a run (a RunConfig) on data-parallel rank `dp_rank` of `dp_size`, feeding a device
        of kind `device_type`: on CUDA/NPU pinned, read ahead by workers or (num_workers 0) a thread."""
        # Dynamically batched data holds whole micro-batches per item (sized by micro_batch_size rows).
        per_item = 1 if getattr(dataset, "items_are_batches", False) else cfg.train.micro_batch_size
        accelerator = device_type != "cpu"
        workers = resolve_num_workers(cfg.data.num_workers, device_type, local_world_size)
        logger.info("data loader: %s%s", f"{workers} worker processes" if workers else "read in the trainer",
                    ", pinned, next step read ahead" if accelerator else "")
        return cls(dataset, per_item, cfg.gradient_accumulation(world_size), cfg.train.seed, dp_rank=dp_rank,
                   dp_size=dp_size, shuffle=getattr(dataset, "shuffle", True), num_workers=workers,
                   pin_memory=accelerator, prefetch=accelerator)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, also with a different dp_size or batch shape.

        Accepts the older layout {"epoch", "consumed" (within that epoch), "seed"} too. Every field is
        checked for type and range (the state comes from a checkpoint, which may be damaged).
        """
        if not isinstance(state, Mapping):
            raise DataError(f"{_STATE}is {kind_of(state)}, not a mapping; {_DAMAGED}")
        if "version" in state:
            consumed, seed = self._read_current(state)
        elif "epoch" in state:
            consumed, seed = self._read_per_epoch(state)
        else:
            keys = ", ".join(repr(k)[:40] for k in list(state)[:8]) or "none"
            raise DataError(f"{_STATE}has neither 'version' nor 'epoch' (keys: {keys}); {_DAMAGED}")
        if seed != self.seed:
            logger.warning(
                "data order follows the checkpoint's seed %d, not the configured %d", seed, self.seed
            )
        self._stream.seed = seed
        self.consumed = consumed
        if self.mixture is not None:
            self._resume_mixture(state.get("sources"))
        self._worker_iter = None  # the workers restart at the new position on the next step
        self._stop_prefetch()  # and so does the prefetch thread (with the checkpoint's seed)

    def _resume_mixture(self, saved: Any) -> None:
        """Continue the blend from where the checkpoint's was: each source from the samples it had read (the
        same as this blend's there unless the weights or the sources changed; a new source from none)."""
        mixture = self.mixture
        if not isinstance(saved, Mapping):
            raise DataError(f"{_STATE}has no per-source positions ('sources'), but this run reads a mixture of "
                            f"sources: resume a run made with data.sources, or start a new one")
        counts = []
        for name, length in zip(mixture.names, mixture.lengths):
            entry = saved.get(name)
            if entry is None:
                counts.append(0)  # a source added on resuming
                continue
            fields = _state_fields(entry if isinstance(entry, Mapping) else {}, ("read", "samples"))
            if fields["samples"] != int(length):
                raise DataError(
                    f"data.sources {name!r}: the checkpoint read a source of {fields['samples']} samples, but "
                    f"this one has {int(length)}, so its position means nothing here; resume with the same files "
                    f"and data.seq_length for that source, or give it another name (it then starts afresh)")
            counts.append(fields["read"])
        if counts != [int(c) for c in mixture.counts(self.consumed)]:
            mixture.resumed(self.consumed, counts)
            logger.info("data mixture: weights or sources differ from the checkpoint's; the blend continues from "
                        "each source's position (%s)", ", ".join(f"{n} {c}" for n, c in zip(mixture.names, counts)))

    def _read_current(self, state: Mapping[str, Any]) -> tuple[int, int]:
        fields = _state_fields(state, ("version", "consumed", "seed", "num_samples"))
        version, consumed, seed, size = (fields[k] for k in ("version", "consumed", "seed", "num_samples"))
        if version != STATE_VERSION:
            raise DataError(
                f"the checkpoint's data loader state has version {version}, but this shardwise reads "
                f"version {STATE_VERSION}; resume with the shardwise version that wrote the checkpoint"
            )
        if size != self.num_samples and self.mixture is None:  # a mixture checks each source by name
            raise DataError(
                f"the checkpoint was trained on a dataset of {size} samples, but this one has "
                f"{self.num_samples}, so its data position means nothing here; resume with the same "
                f"data files and data.seq_length (with packing dynamic also data.pad_to_multiple_of; 1 before "
                f"it existed) as the checkpoint, or start a new run (or load only the weights) to train on "
                f"other data"
            )
        return consumed, seed

    def _read_per_epoch(self, state: Mapping[str, Any]) -> tuple[int, int]:
        fields = _state_fields(state, ("epoch", "consumed", "seed"))
        epoch, within, seed = fields["epoch"], fields["consumed"], fields["seed"]
        if within > self.num_samples:
            raise DataError(
                f"the checkpoint stopped {within} samples into epoch {epoch}, but one epoch of this "
                f"dataset has only {self.num_samples} samples; resume with the same data files and "
                f"data.seq_length as the checkpoint"
            )
        # The older loader dropped each epoch's incomplete last global batch; its earlier epochs are
        # over either way, and epoch `epoch` continues with its own permutation from `within` on.
        logger.info("converted an older data loader state (epoch %d, %d samples in)", epoch, within)
        return epoch * self.num_samples + within, seed


_STATE = "the checkpoint's data loader state "
_DAMAGED = "the checkpoint is damaged or not from shardwise"
# Positions and sizes in samples, and seeds: whole numbers no run comes near.
_STATE_MAX = 1 << 62


def _state_fields(state: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, int]:
    """`keys` of a saved loader state as whole numbers in 0..2**62 (a tensor or numpy scalar counts as one
    number); DataError naming the field otherwise."""
    out = {}
    for key in keys:
        value = state.get(key)
        if isinstance(value, np.integer) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                             and not value.is_floating_point()):
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise DataError(f"{_STATE}has a negative {key!r} ({value}), which is no position; {_DAMAGED}")
        out[key] = int_field({key: value}, key, _STATE.strip(), DataError, hi=_STATE_MAX,
                             advice=f"it needs whole numbers {', '.join(map(repr, keys))}; {_DAMAGED}")
    return out


def create_dataset(
    dataset: Dataset,
    batch_size: int,
    num_parallel_workers: int = 1,
    distributed: bool = False,
    seed: int = 0,
) -> StatefulLoader:
    """The seed documents' loader factory: a StatefulLoader of `batch_size` samples per rank and step.

    With `distributed=True` and torch.distributed initialised, every process is one data-parallel
    rank. `num_parallel_workers` of 0 or 1 reads in this process; more start that many worker
    processes (when the loader is first read).
    """
    rank, world = 0, 1
    if distributed:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            logger.info("create_dataset(distributed=True) without torch.distributed: one process reads all")
    shuffle = bool(getattr(dataset, "shuffle", True))
    workers = num_parallel_workers if num_parallel_workers > 1 else 0
    return StatefulLoader(dataset, batch_size, 1, seed, dp_rank=rank, dp_size=world, shuffle=shuffle,
                          num_workers=workers)


def unwrap_loader(data: Any) -> Any:
    """The dataset itself, also when `create_dataset` wrapped it in a loader (the trainer batches)."""
    if isinstance(data, StatefulLoader):
        return data.dataset
    return data


def sequential_batches(dataset: Dataset, batch_size: int, limit: int | None = None, rank: int = 0,
                       world: int = 1) -> Iterator[Batch]:
    """Micro-batches of `dataset` in order, the last one possibly smaller (for evaluation); with
    `world` > 1 only batches `rank`, `rank + world`, ... of them (one data-parallel rank's share).

    A dataset whose items are already micro-batches (items_are_batches) yields its items as they are.
    """
    n = len(dataset)  # type: ignore[arg-type]
    step = 1 if getattr(dataset, "items_are_batches", False) else batch_size
    for start in _sequential_starts(dataset, batch_size, limit)[rank::world]:
        yield collate(dataset, np.arange(start, min(start + step, n)))


def sequential_batch_count(dataset: Dataset, batch_size: int, limit: int | None = None) -> int:
    """How many micro-batches `sequential_batches` yields over all ranks."""
    return len(_sequential_starts(dataset, batch_size, limit))


def _sequential_starts(dataset: Dataset, batch_size: int, limit: int | None) -> range:
    step = 1 if getattr(dataset, "items_are_batches", False) else batch_size
    starts = range(0, len(dataset), step)  # type: ignore[arg-type]
    return starts[:limit] if limit is not None else starts


def pin_batch(batch: Batch) -> Batch:
    """The micro-batch with its tensors in pinned (page-locked) host memory, for copies that do not wait."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def batches_to_device(micro_batches: list[Batch], device: torch.device | str) -> list[Batch]:
    """A step's micro-batches on `device`, every copy queued without waiting (non_blocking): from pinned
    memory (the loader's on CUDA/NPU) the host goes on at once. On the CPU the tensors stay as they are."""
    return [{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
            for mb in micro_batches]


def collate(dataset: Dataset, indices: np.ndarray) -> Batch:
    """Samples `indices` of `dataset` stacked into one micro-batch."""
    if getattr(dataset, "items_are_batches", False):
        if len(indices) != 1:
            raise DataError(
                f"the dataset's items are already micro-batches (items_are_batches = True); read them "
                f"one at a time (micro_batch_size 1), not {len(indices)} together"
            )
        return dataset[int(indices[0])]
    # A PackedDataset gathers a whole micro-batch in one numpy op; other datasets go sample by sample.
    get_batch = getattr(dataset, "get_batch", None)
    if get_batch is not None:
        return get_batch(indices)
    samples = [dataset[int(i)] for i in indices]
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
