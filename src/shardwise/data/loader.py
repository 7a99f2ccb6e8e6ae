"""An exact, resumable, data-parallel-aware loader.

The order of samples depends only on (seed, epoch), never on the number of ranks: epoch e is a
permutation of range(len(dataset)) from `numpy.random.default_rng([seed, e])`, cut into global
batches of micro_batch_size x grad_accum x dp_size samples. Rank r takes its contiguous slice of each
global batch. The position is counted in global samples, so a run saved on one number of ranks
resumes on another with exactly the samples it has not seen yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ..errors import DataError

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


class StatefulLoader:
    """Micro-batches for each optimizer step of one data-parallel rank; the position is checkpointable.

    Every epoch visits each sample at most once over all ranks, and exactly once apart from the
    incomplete last global batch, which is dropped (fewer than micro_batch_size x grad_accum x
    dp_size samples at the end of the epoch's order; a different shuffle drops different ones).
    Samples are read by indexing the dataset in this process and stacked with torch: no workers.
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
    ) -> None:
        """Serve rank `dp_rank` of `dp_size`: `grad_accum` micro-batches of `micro_batch_size` a step."""
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("grad_accum", grad_accum),
            ("dp_size", dp_size),
        ):
            if value < 1:
                raise DataError(f"{name} must be at least 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1} for dp_size {dp_size}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        self.global_batch_size = micro_batch_size * grad_accum * dp_size
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (micro_batch_size {micro_batch_size} x gradient accumulation "
                f"{grad_accum} x data_parallel {dp_size}); add data, lower data.seq_length or use a "
                f"smaller batch"
            )
        self.epoch = 0
        self.consumed = 0
        self._order: np.ndarray | None = None
        self._order_key: tuple[int, int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch (the incomplete last global batch is dropped)."""
        return self.num_samples // self.global_batch_size

    def __len__(self) -> int:
        """Optimizer steps in one epoch."""
        return self.steps_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of `epoch` in visiting order, the same on every rank."""
        if self._order_key != (self.seed, epoch):
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
            self._order_key = (self.seed, epoch)
        return self._order  # type: ignore[return-value]

    def step_indices(self) -> list[np.ndarray]:
        """Sample indices of this rank's micro-batches for the next step, without advancing."""
        per_rank = self.micro_batch_size * self.grad_accum
        start = self.consumed + self.dp_rank * per_rank
        mine = self.epoch_order(self.epoch)[start : start + per_rank]
        mbs = self.micro_batch_size
        return [mine[k * mbs : (k + 1) * mbs] for k in range(self.grad_accum)]

    def _collate(self, indices: np.ndarray) -> Batch:
        return collate(self.dataset, indices)

    def next_step(self) -> list[Batch]:
        """This rank's grad_accum micro-batches for the next step; rolls over to the next epoch at its end."""
        batches = [self._collate(idx) for idx in self.step_indices()]
        self.consumed += self.global_batch_size
        if self.consumed >= self.steps_per_epoch * self.global_batch_size:
            self.epoch += 1
            self.consumed = 0
        return batches

    def __iter__(self) -> Iterator[list[Batch]]:
        """The remaining steps of the current epoch, each a list of grad_accum micro-batches."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_step()

    def state_dict(self) -> dict[str, int]:
        """Position to save in a checkpoint: epoch, global samples consumed in it, and the seed."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, also with a different dp_size or batch shape."""
        try:
            epoch, consumed, seed = int(state["epoch"]), int(state["consumed"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"the checkpoint's data loader state {dict(state)!r} needs integer 'epoch', 'consumed' "
                f"and 'seed'; the checkpoint is damaged or not from shardwise"
            ) from e
        if epoch < 0 or consumed < 0:
            raise DataError(f"the checkpoint's data loader state has a negative position: {dict(state)!r}")
        g = self.global_batch_size
        if consumed % g:
            raise DataError(
                f"the checkpoint stopped {consumed} samples into epoch {epoch}, which is not a multiple "
                f"of the new global batch {g} (micro_batch_size {self.micro_batch_size} x gradient "
                f"accumulation {self.grad_accum} x data_parallel {self.dp_size}), so resuming here would "
                f"repeat or skip samples; pick a global batch that divides {consumed}, such as the one "
                f"the checkpoint was saved with"
            )
        if consumed > self.steps_per_epoch * g:
            raise DataError(
                f"the checkpoint stopped {consumed} samples into epoch {epoch}, but one epoch of this "
                f"dataset has only {self.steps_per_epoch * g} samples; resume with the same data files "
                f"and seq_length as the checkpoint"
            )
        if seed != self.seed:
            logger.warning(
                "data order follows the checkpoint's seed %d, not the configured %d", seed, self.seed
            )
        self.seed, self.epoch, self.consumed = seed, epoch, consumed
        if consumed == self.steps_per_epoch * g:
            self.epoch, self.consumed = epoch + 1, 0


def create_dataset(
    dataset: Dataset,
    batch_size: int,
    num_parallel_workers: int = 1,
    distributed: bool = False,
    seed: int = 0,
) -> StatefulLoader:
    """The seed documents' loader factory: a StatefulLoader of `batch_size` samples per rank and step.

    With `distributed=True` and torch.distributed initialised, every process is one data-parallel
    rank. `num_parallel_workers` is accepted for compatibility: samples are read in-process.
    """
    rank, world = 0, 1
    if distributed:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            logger.info("create_dataset(distributed=True) without torch.distributed: one process reads all")
    if num_parallel_workers != 1:
        logger.debug("num_parallel_workers=%d ignored: samples are indexed in-process", num_parallel_workers)
    shuffle = bool(getattr(dataset, "shuffle", True))
    return StatefulLoader(dataset, batch_size, 1, seed, dp_rank=rank, dp_size=world, shuffle=shuffle)


def unwrap_loader(data: Any) -> Any:
    """The dataset itself, also when `create_dataset` wrapped it in a loader (the trainer batches)."""
    if isinstance(data, StatefulLoader):
        return data.dataset
    return data


def sequential_batches(dataset: Dataset, batch_size: int, limit: int | None = None) -> Iterator[Batch]:
    """Micro-batches of `dataset` in order, the last one possibly smaller (for evaluation)."""
    n = len(dataset)  # type: ignore[arg-type]
    starts = range(0, n, batch_size)
    if limit is not None:
        starts = starts[:limit]
    for start in starts:
        yield collate(dataset, np.arange(start, min(start + batch_size, n)))


def collate(dataset: Dataset, indices: np.ndarray) -> Batch:
    """Samples `indices` of `dataset` stacked into one micro-batch."""
    # A PackedDataset gathers a whole micro-batch in one numpy op; other datasets go sample by sample.
    get_batch = getattr(dataset, "get_batch", None)
    if get_batch is not None:
        return get_batch(indices)
    samples = [dataset[int(i)] for i in indices]
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
