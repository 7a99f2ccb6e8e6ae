"""StatefulLoader: exact epochs over data-parallel ranks, deterministic shuffles, exact resumes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardwise.data.loader as loader_mod
from shardwise.data import PackedDataset, StatefulLoader, create_dataset
from shardwise.errors import DataError

T = 4  # tokens per sample


def dataset(n_samples: int) -> PackedDataset:
    """Samples whose first input token is sample_index * T, so a batch tells which samples it holds."""
    return PackedDataset(np.arange(n_samples * T + 1, dtype=np.uint16), T)


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // T).tolist()


def step_ids(step: list[dict[str, torch.Tensor]]) -> list[int]:
    return [i for mb in step for i in sample_ids(mb)]


def loaders(ds: PackedDataset, dp: int, mbs: int = 2, ga: int = 3, seed: int = 7) -> list[StatefulLoader]:
    return [StatefulLoader(ds, mbs, ga, seed, dp_rank=r, dp_size=dp) for r in range(dp)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_each_sample_once_per_epoch_over_ranks(dp: int) -> None:
    ds = dataset(50)
    ranks = loaders(ds, dp)
    g = 2 * 3 * dp
    assert ranks[0].steps_per_epoch == 50 // g
    order = ranks[0].epoch_order(0)
    assert sorted(order.tolist()) == list(range(50))
    seen: list[list[int]] = [[] for _ in range(dp)]
    for step in range(ranks[0].steps_per_epoch):
        global_batch = []
        for r, ld in enumerate(ranks):
            micro = ld.next_step()
            assert len(micro) == 3
            for mb in micro:
                assert mb["input_ids"].shape == (2, T) and mb["labels"].shape == (2, T)
                assert torch.equal(mb["labels"], mb["input_ids"] + 1)
            seen[r] += step_ids(micro)
            global_batch += step_ids(micro)
        # Rank slices in rank order make up exactly the global batch of this step.
        assert global_batch == order[step * g : (step + 1) * g].tolist()
    all_seen = [i for s in seen for i in s]
    assert len(all_seen) == len(set(all_seen))  # disjoint across ranks, no repeats
    assert set(all_seen) == set(order[: ranks[0].steps_per_epoch * g].tolist())
    assert len(all_seen) == 50 - 50 % g  # only the incomplete last global batch is dropped
    assert all(ld.state_dict() == {"epoch": 1, "consumed": 0, "seed": 7} for ld in ranks)


def test_full_coverage_when_divisible() -> None:
    ds = dataset(48)
    for dp in (1, 2, 4):
        ranks = loaders(ds, dp)
        got = [i for _ in range(ranks[0].steps_per_epoch) for ld in ranks for i in step_ids(ld.next_step())]
        assert sorted(got) == list(range(48))


def test_order_depends_on_seed_and_epoch_only() -> None:
    ds = dataset(40)
    a, b = StatefulLoader(ds, 2, 1, seed=1), StatefulLoader(ds, 4, 2, seed=1)
    c = StatefulLoader(ds, 2, 1, seed=2)
    assert a.epoch_order(0).tolist() == b.epoch_order(0).tolist()  # batch shape does not matter
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()  # reshuffled every epoch
    assert a.epoch_order(0).tolist() != c.epoch_order(0).tolist()  # the seed matters
    assert a.epoch_order(3).tolist() == np.random.default_rng([1, 3]).permutation(40).tolist()
    plain = StatefulLoader(ds, 2, 1, seed=1, shuffle=False)
    assert plain.epoch_order(5).tolist() == list(range(40))
    assert step_ids(plain.next_step()) == [0, 1]


def test_epochs_advance_and_differ() -> None:
    ld = StatefulLoader(dataset(12), 2, 2, seed=3)
    assert len(ld) == 3
    epoch0 = [step_ids(s) for s in ld]
    assert ld.state_dict() == {"epoch": 1, "consumed": 0, "seed": 3}
    epoch1 = [step_ids(s) for s in ld]
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(12))
    assert epoch0 != epoch1


def test_resume_mid_epoch_gives_identical_batches() -> None:
    ds = dataset(30)
    ld = StatefulLoader(ds, 2, 2, seed=11, dp_rank=1, dp_size=2)  # G = 8: 3 steps per epoch
    ld.next_step()
    ld.next_step()
    state = ld.state_dict()
    assert state == {"epoch": 0, "consumed": 16, "seed": 11}
    expected = [ld.next_step() for _ in range(4)]  # crosses into epoch 1
    fresh = StatefulLoader(ds, 2, 2, seed=999, dp_rank=1, dp_size=2)
    fresh.load_state_dict(state)  # the checkpoint's seed wins, so the order is the same
    assert fresh.seed == 11
    for want in expected:
        got = fresh.next_step()
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["labels"], w["labels"])
    assert fresh.state_dict() == ld.state_dict()


def test_resume_from_two_ranks_to_one() -> None:
    ds = dataset(50)
    old = loaders(ds, dp=2, mbs=2, ga=1)  # G = 4
    before = [i for _ in range(5) for ld in old for i in step_ids(ld.next_step())]
    state = old[0].state_dict()
    assert state == old[1].state_dict() == {"epoch": 0, "consumed": 20, "seed": 7}
    new = StatefulLoader(ds, 2, 1, 7, dp_rank=0, dp_size=1)  # G = 2
    new.load_state_dict(state)
    after = [i for _ in range(new.steps_per_epoch - 10) for i in step_ids(new.next_step())]
    assert new.state_dict()["epoch"] == 1
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(50))  # 50 % 2 == 0: nothing dropped now


def test_resume_from_one_rank_to_four() -> None:
    ds = dataset(64)
    old = StatefulLoader(ds, 2, 1, 7)  # G = 2
    before = [i for _ in range(4) for i in step_ids(old.next_step())]
    state = old.state_dict()
    assert state["consumed"] == 8
    new = loaders(ds, dp=4, mbs=2, ga=1)  # G = 8
    for ld in new:
        ld.load_state_dict(state)
    after = [i for _ in range(new[0].steps_per_epoch - 1) for ld in new for i in step_ids(ld.next_step())]
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(64))
    assert before + after == old.epoch_order(0).tolist()


def test_resume_off_the_new_batch_grid_is_refused() -> None:
    ds = dataset(64)
    old = StatefulLoader(ds, 2, 1, 7)
    old.next_step()  # consumed = 2, not a multiple of 8
    new = StatefulLoader(ds, 2, 1, 7, dp_rank=0, dp_size=4)
    with pytest.raises(DataError, match="2 samples into epoch 0.*not a multiple of the new global batch 8"):
        new.load_state_dict(old.state_dict())
    with pytest.raises(DataError, match="'epoch', 'consumed'"):
        new.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="only 64 samples"):
        new.load_state_dict({"epoch": 0, "consumed": 72, "seed": 7})


def test_resume_at_end_of_epoch_starts_next() -> None:
    ld = StatefulLoader(dataset(16), 2, 1, 5)
    ld.load_state_dict({"epoch": 2, "consumed": 16, "seed": 5})
    assert ld.state_dict() == {"epoch": 3, "consumed": 0, "seed": 5}
    assert step_ids(ld.next_step()) == ld.epoch_order(3)[:2].tolist()


def test_argument_errors() -> None:
    with pytest.raises(DataError, match="10 samples, fewer than one global batch of 12"):
        StatefulLoader(dataset(10), 2, 3, 0, dp_size=2)
    with pytest.raises(DataError, match="dp_rank 2"):
        StatefulLoader(dataset(10), 1, 1, 0, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="micro_batch_size"):
        StatefulLoader(dataset(10), 0, 1, 0)


def test_create_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(20)
    ld = create_dataset(ds, batch_size=4, num_parallel_workers=4, distributed=True, seed=3)
    assert (ld.micro_batch_size, ld.grad_accum, ld.dp_rank, ld.dp_size) == (4, 1, 0, 1)
    (mb,) = ld.next_step()
    assert mb["input_ids"].shape == (4, T)

    ds.shuffle = False  # as TextDataset(shuffle=False) stores it
    assert step_ids(create_dataset(ds, 4).next_step()) == [0, 1, 2, 3]

    # Under torch.distributed every process is one data-parallel rank.
    monkeypatch.setattr(loader_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loader_mod.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(loader_mod.dist, "get_world_size", lambda: 2)
    ld = create_dataset(ds, batch_size=3, distributed=True)
    assert (ld.dp_rank, ld.dp_size) == (1, 2)
    assert step_ids(ld.next_step()) == [3, 4, 5]


class PlainDataset(torch.utils.data.Dataset):
    """A dataset without get_batch, to exercise the sample-by-sample path."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((T,), i * T), "labels": torch.full((T,), i * T + 1)}


def test_any_map_style_dataset_works() -> None:
    plain = StatefulLoader(PlainDataset(), 2, 2, seed=4)
    packed = StatefulLoader(dataset(10), 2, 2, seed=4)
    for _ in range(5):  # two epochs and a half
        a, b = plain.next_step(), packed.next_step()
        assert [sample_ids(mb) for mb in a] == [sample_ids(mb) for mb in b]
        assert a[0]["input_ids"].shape == (2, T)
