"""StatefulLoader: an endless stream of epoch permutations, exact over ranks, workers and resumes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import shardwise.data.loader as loader_mod
from shardwise.data import PackedDataset, StatefulLoader, create_dataset
from shardwise.data.loader import sequential_batches
from shardwise.errors import DataError

T = 4  # tokens per sample


def dataset(n_samples: int) -> PackedDataset:
    """Samples whose first input token is sample_index * T, so a batch tells which samples it holds."""
    return PackedDataset(np.arange(n_samples * T + 1, dtype=np.uint16), T)


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // T).tolist()


def step_ids(step: list[dict[str, torch.Tensor]]) -> list[int]:
    return [i for mb in step for i in sample_ids(mb)]


def loaders(ds, dp: int, mbs: int = 2, ga: int = 3, seed: int = 7, **kw) -> list[StatefulLoader]:
    return [StatefulLoader(ds, mbs, ga, seed, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]


def global_steps(ranks: list[StatefulLoader], n_steps: int) -> list[int]:
    """The samples of n_steps steps over all ranks, rank slices in rank order (one process)."""
    return [i for _ in range(n_steps) for ld in ranks for i in step_ids(ld.next_step())]


def stream(seed: int, n: int, length: int) -> list[int]:
    """The reference stream: epoch permutations one after the other."""
    epochs = -(-length // n)
    return np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(epochs)])[
        :length].tolist()


def assert_same_steps(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [72, 50])  # 72: a multiple of every global batch here; 50: of none
def test_each_sample_once_per_epoch_over_ranks(dp: int, n: int) -> None:
    ds = dataset(n)
    ranks = loaders(ds, dp)
    g = 2 * 3 * dp
    assert ranks[0].steps_per_epoch == math.ceil(n / g)
    n_steps = ranks[0].steps_for_epochs(3)
    assert n_steps == math.ceil(3 * n / g)
    got: list[int] = []
    rank_of: list[int] = []  # which rank read each stream position
    for step in range(n_steps):
        for r, ld in enumerate(ranks):
            micro = ld.next_step()
            assert len(micro) == 3
            for mb in micro:
                assert mb["input_ids"].shape == (2, T) and mb["labels"].shape == (2, T)
                assert torch.equal(mb["labels"], mb["input_ids"] + 1)
            got += step_ids(micro)
            rank_of += [r] * 6
        if step * g // n == ((step + 1) * g - 1) // n:  # a step inside one epoch: disjoint ranks
            assert len(set(got[-g:])) == g
    # Rank slices in rank order make up exactly the stream of epoch permutations, nothing dropped ...
    assert got == stream(7, n, n_steps * g)
    # ... so every epoch, also those whose end shares a step with the next epoch, is each sample once,
    # and the ranks' parts of an epoch are disjoint.
    for e in range(3):
        assert sorted(got[e * n : (e + 1) * n]) == list(range(n))
        per_rank = [{i for i, rr in zip(got[e * n : (e + 1) * n], rank_of[e * n : (e + 1) * n]) if rr == r}
                    for r in range(dp)]
        assert sum(len(p) for p in per_rank) == n and len(set().union(*per_rank)) == n
    assert len(got) >= 3 * n and len(got) - 3 * n < g
    assert all(ld.state_dict() == {"version": 2, "consumed": n_steps * g, "seed": 7, "num_samples": n}
               for ld in ranks)
    assert ranks[0].epoch == n_steps * g // n and ranks[0].epochs_done == pytest.approx(n_steps * g / n)


def test_order_depends_on_seed_and_epoch_only() -> None:
    ds = dataset(40)
    a, b = StatefulLoader(ds, 2, 1, seed=1), StatefulLoader(ds, 4, 2, seed=1)
    c = StatefulLoader(ds, 2, 1, seed=2)
    assert a.epoch_order(0).tolist() == b.epoch_order(0).tolist()  # batch shape does not matter
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()  # reshuffled every epoch
    assert a.epoch_order(0).tolist() != c.epoch_order(0).tolist()  # the seed matters
    assert sorted(a.epoch_order(1).tolist()) == list(range(40))
    assert a.epoch_order(3).tolist() == np.random.default_rng([1, 3]).permutation(40).tolist()
    assert global_steps([a], 40) == global_steps([b], 10) == stream(1, 40, 80)  # same seed, same order
    plain = StatefulLoader(ds, 2, 1, seed=1, shuffle=False)
    assert plain.epoch_order(5).tolist() == list(range(40))
    assert step_ids(plain.next_step()) == [0, 1]


def test_a_step_straddles_two_epochs() -> None:
    ld = StatefulLoader(dataset(10), 2, 2, seed=3)  # G = 4: 10 = 4 + 4 + (2 of epoch 0, 2 of epoch 1)
    assert len(ld) == ld.steps_per_epoch == 3
    epoch0 = list(ld)  # the steps until epoch 0 is complete
    assert len(epoch0) == 3 and ld.consumed == 12 and ld.epoch == 1
    last = step_ids(epoch0[2])
    assert last[:2] == ld.epoch_order(0)[8:].tolist() and last[2:] == ld.epoch_order(1)[:2].tolist()
    epoch1 = list(ld)  # epoch 1's remaining 8 samples: two steps
    assert len(epoch1) == 2 and ld.consumed == 20
    assert sorted(last[2:] + [i for s in epoch1 for i in step_ids(s)]) == list(range(10))


def test_fewer_samples_than_a_global_batch() -> None:
    ld = StatefulLoader(dataset(3), 2, 2, seed=5)  # every step spans more than one epoch
    assert ld.steps_per_epoch == 1 and ld.steps_for_epochs(2) == 2
    assert global_steps([ld], 3) == stream(5, 3, 12)


def test_resume_mid_epoch_gives_identical_batches() -> None:
    ds = dataset(30)
    ld = StatefulLoader(ds, 2, 2, seed=11, dp_rank=1, dp_size=2)  # G = 8: 30 is no multiple of it
    ld.next_step()
    ld.next_step()
    state = ld.state_dict()
    assert state == {"version": 2, "consumed": 16, "seed": 11, "num_samples": 30}
    expected = [ld.next_step() for _ in range(4)]  # crosses into epoch 1 and 2
    fresh = StatefulLoader(ds, 2, 2, seed=999, dp_rank=1, dp_size=2)
    fresh.load_state_dict(state)  # the checkpoint's seed wins, so the order is the same
    assert fresh.seed == 11
    for want in expected:
        assert_same_steps(fresh.next_step(), want)
    assert fresh.state_dict() == ld.state_dict()


@pytest.mark.parametrize(
    ("old_dp", "old_mbs", "old_ga", "new_dp", "new_mbs", "new_ga", "steps_before"),
    [
        (2, 2, 1, 3, 2, 1, 5),  # 2 -> 3 ranks: 20 samples read, new global batch 6
        (4, 2, 1, 1, 2, 1, 3),  # 4 -> 1
        (1, 2, 1, 4, 2, 1, 7),  # 1 -> 4: 14 samples read, no multiple of the new global batch 8
        (2, 2, 2, 2, 3, 1, 2),  # micro-batch size and accumulation change on the same ranks
        (3, 1, 2, 2, 5, 2, 9),  # 54 read: the checkpoint lies in epoch 1
    ],
)
def test_a_new_layout_continues_with_the_unseen_samples(
    old_dp: int, old_mbs: int, old_ga: int, new_dp: int, new_mbs: int, new_ga: int, steps_before: int
) -> None:
    n = 50
    ds = dataset(n)
    old = loaders(ds, old_dp, old_mbs, old_ga)
    before = global_steps(old, steps_before)
    state = old[0].state_dict()
    assert all(ld.state_dict() == state for ld in old)
    new = loaders(ds, new_dp, new_mbs, new_ga, seed=123)
    for ld in new:
        ld.load_state_dict(state)
    epoch = state["consumed"] // n
    seen = before[epoch * n :]  # what the checkpoint's epoch already handed out
    new_g = new_dp * new_mbs * new_ga
    after = global_steps(new, -(-((epoch + 1) * n - state["consumed"]) // new_g))
    rest = after[: (epoch + 1) * n - state["consumed"]]
    # Exactly the samples not yet seen in that epoch, in the epoch's own order, and then the next epoch.
    assert not set(seen) & set(rest)
    assert sorted(seen + rest) == list(range(n))
    assert before + after == stream(7, n, len(before) + len(after))


def test_workers_give_identical_batches_and_exact_positions() -> None:
    ds = dataset(23)
    ranks = loaders(ds, 2, mbs=2, ga=2, seed=5)  # G = 8
    worker_ranks = loaders(ds, 2, mbs=2, ga=2, seed=5, num_workers=2)
    try:
        for _ in range(7):  # two epochs and a half, steps straddling epochs
            for plain, with_workers in zip(ranks, worker_ranks, strict=True):
                assert_same_steps(with_workers.next_step(), plain.next_step())
                # The workers have prefetched ahead; the state is what was handed out.
                assert with_workers.state_dict() == plain.state_dict()
        state = ranks[0].state_dict()
        want = [ranks[1].next_step() for _ in range(3)]
        # Resuming a worker loader: the same processes restart at the saved position, behind their
        # prefetch, and also at a position they had never reached.
        resumed = worker_ranks[1]
        resumed.next_step()
        resumed.load_state_dict(state)
        for w in want:
            assert_same_steps(resumed.next_step(), w)
        resumed.load_state_dict({**state, "consumed": 400})
        plain = StatefulLoader(ds, 2, 2, 5, dp_rank=1, dp_size=2)
        plain.load_state_dict({**state, "consumed": 400})
        assert_same_steps(resumed.next_step(), plain.next_step())
    finally:
        for ld in worker_ranks:
            ld.close()


class PlainDataset(torch.utils.data.Dataset):
    """A dataset without get_batch, to exercise the sample-by-sample path."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((T,), i * T), "labels": torch.full((T,), i * T + 1)}


class BatchItems(torch.utils.data.Dataset):
    """Items that are whole micro-batches of varying size, as dynamic batching by token budget gives."""

    items_are_batches = True

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i + 1).repeat(i % 3 + 1, 1) + 100 * i
        return {"input_ids": ids, "labels": ids + 1}


def test_any_map_style_dataset_works() -> None:
    plain = StatefulLoader(PlainDataset(), 2, 2, seed=4)
    packed = StatefulLoader(dataset(10), 2, 2, seed=4)
    for _ in range(5):  # two epochs
        a, b = plain.next_step(), packed.next_step()
        assert [sample_ids(mb) for mb in a] == [sample_ids(mb) for mb in b]
        assert a[0]["input_ids"].shape == (2, T)


def test_items_that_are_batches() -> None:
    ds = BatchItems()
    with pytest.raises(DataError, match="items_are_batches.*micro_batch_size must be 1, got 4.*"
                                        "train.micro_batch_size: 1"):
        StatefulLoader(ds, 4, 1, 0)
    ld = StatefulLoader(ds, 1, 2, seed=9)
    got = [mb for _ in range(7) for mb in ld.next_step()]  # two epochs
    order = stream(9, 7, 14)
    assert [int(mb["input_ids"][0, 0]) // 100 for mb in got] == order
    for mb, i in zip(got, order, strict=True):
        assert_same_steps([mb], [ds[i]])  # the item itself, not stacked again
    assert [mb["input_ids"].shape[0] for mb in sequential_batches(ds, 8)] == [1, 2, 3, 1, 2, 3, 1]


class WithBf16(PlainDataset):
    """A field numpy cannot hold (bfloat16) travels from the workers as a torch tensor."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "weight": torch.full((T,), i / 8, dtype=torch.bfloat16)}


def test_workers_read_plain_and_batch_item_datasets() -> None:
    for ds, mbs in ((WithBf16(9), 2), (BatchItems(), 1)):
        a = StatefulLoader(ds, mbs, 2, seed=2)
        b = StatefulLoader(ds, mbs, 2, seed=2, num_workers=2, prefetch_factor=1)
        try:
            for _ in range(5):
                got = b.next_step()
                assert_same_steps(got, a.next_step())
                assert got[0]["input_ids"].dtype == torch.int64
                if "weight" in got[0]:
                    assert got[0]["weight"].dtype == torch.bfloat16
        finally:
            b.close()


def test_the_older_state_layout_is_accepted() -> None:
    ds = dataset(50)
    ld = StatefulLoader(ds, 2, 3, seed=1)
    ld.load_state_dict({"epoch": 2, "consumed": 24, "seed": 7})  # 24 samples into epoch 2
    assert ld.state_dict() == {"version": 2, "consumed": 124, "seed": 7, "num_samples": 50}
    assert step_ids(ld.next_step()) == ld.epoch_order(2)[24:30].tolist()
    # The old loader's end of an epoch (its last incomplete global batch dropped): the rest is read.
    ld.load_state_dict({"epoch": 0, "consumed": 48, "seed": 7})
    assert step_ids(ld.next_step()) == ld.epoch_order(0)[48:].tolist() + ld.epoch_order(1)[:4].tolist()


def test_a_checkpoint_of_other_data_is_refused() -> None:
    ld = StatefulLoader(dataset(64), 2, 1, 7)
    other = StatefulLoader(dataset(60), 2, 1, 7)
    other.next_step()
    with pytest.raises(DataError, match="dataset of 60 samples, but this one has 64.*same data files and "
                                        "data.seq_length"):
        ld.load_state_dict(other.state_dict())
    with pytest.raises(DataError, match="72 samples into epoch 0.*only 64 samples"):
        ld.load_state_dict({"epoch": 0, "consumed": 72, "seed": 7})
    with pytest.raises(DataError, match="'epoch', 'consumed'"):
        ld.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="'version', 'consumed'"):
        ld.load_state_dict({"version": 2, "consumed": 3})
    with pytest.raises(DataError, match="version 3"):
        ld.load_state_dict({"version": 3, "consumed": 0, "seed": 7, "num_samples": 64})
    with pytest.raises(DataError, match="negative"):
        ld.load_state_dict({"version": 2, "consumed": -2, "seed": 7, "num_samples": 64})
    with pytest.raises(DataError, match="neither"):
        ld.load_state_dict({})
    assert ld.state_dict()["consumed"] == 0  # refused states leave the position alone


def test_argument_errors() -> None:
    with pytest.raises(DataError, match="dp_rank 2"):
        StatefulLoader(dataset(10), 1, 1, 0, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="micro_batch_size"):
        StatefulLoader(dataset(10), 0, 1, 0)
    with pytest.raises(DataError, match="num_workers"):
        StatefulLoader(dataset(10), 1, 1, 0, num_workers=-1)
    with pytest.raises(DataError, match="empty"):
        StatefulLoader(PlainDataset(0), 1, 1, 0)


def test_create_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(20)
    ld = create_dataset(ds, batch_size=4, num_parallel_workers=4, distributed=True, seed=3)
    assert (ld.micro_batch_size, ld.grad_accum, ld.dp_rank, ld.dp_size, ld.num_workers) == (4, 1, 0, 1, 4)
    assert create_dataset(ds, 4, num_parallel_workers=1).num_workers == 0
    assert create_dataset(ds, 4, num_parallel_workers=0).num_workers == 0

    ds.shuffle = False  # as TextDataset(shuffle=False) stores it
    assert step_ids(create_dataset(ds, 4).next_step()) == [0, 1, 2, 3]

    # Under torch.distributed every process is one data-parallel rank.
    monkeypatch.setattr(loader_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loader_mod.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(loader_mod.dist, "get_world_size", lambda: 2)
    ld = create_dataset(ds, batch_size=3, distributed=True)
    assert (ld.dp_rank, ld.dp_size) == (1, 2)
    assert step_ids(ld.next_step()) == [3, 4, 5]


def test_sequential_batches() -> None:
    got = [sample_ids(mb) for mb in sequential_batches(dataset(7), 3)]
    assert got == [[0, 1, 2], [3, 4, 5], [6]]
    assert [sample_ids(mb) for mb in sequential_batches(dataset(7), 3, limit=2)] == got[:2]
