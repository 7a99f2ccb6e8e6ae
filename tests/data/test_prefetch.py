"""The loader's prefetch thread: the plain loader's batches, exact resumes, errors with their message,
no thread left after close; data.num_workers auto; a step's batches to the device.

Pinned memory needs CUDA: on this CPU the pin step is off (pin_memory False), so what is tested is
the reading ahead, not the pinning; bench/gpu_checks.sh runs the pinned path.
"""

from __future__ import annotations

import threading

import numpy as np
import pydantic
import pytest
import torch

from shardwise.config.schema import RunConfig
from shardwise.data import PackedDataset, StatefulLoader
from shardwise.data.loader import ACCELERATOR_WORKERS, batches_to_device, resolve_num_workers

T = 4  # tokens per sample


def dataset(n_samples: int) -> PackedDataset:
    """Samples whose first input token is sample_index * T, so a batch tells which samples it holds."""
    return PackedDataset(np.arange(n_samples * T + 1, dtype=np.int64), T)


class Broken(PackedDataset):
    """Reading sample `bad` fails with a message of its own."""

    def __init__(self, n_samples: int, bad: int) -> None:
        super().__init__(np.arange(n_samples * T + 1, dtype=np.int64), T)
        self.bad = bad

    def get_batch(self, indices):  # noqa: ANN001, ANN201
        if self.bad in np.asarray(indices).tolist():
            raise ValueError(f"sample {self.bad} is unreadable: disk sector 0x2a")
        return super().get_batch(indices)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardwise-prefetch" and t.is_alive()]


def assert_same_step(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def loader(ds, prefetch: bool, dp_rank: int = 1, **kw) -> StatefulLoader:  # noqa: ANN001
    # 22 samples, global batch 2 x 3 x 2 = 12: step 2 holds the end of epoch 0 and the start of epoch 1.
    return StatefulLoader(ds, 2, 3, seed=3, dp_rank=dp_rank, dp_size=2, prefetch=prefetch, **kw)


def test_prefetching_gives_the_plain_loaders_steps_across_epochs() -> None:
    ds = dataset(22)
    plain, ahead = loader(ds, False), loader(ds, True)
    try:
        for _ in range(5):  # two and a half epochs
            assert_same_step(ahead.next_step(), plain.next_step())
            assert ahead.consumed == plain.consumed  # only what was handed out is counted
        assert ahead.epoch == plain.epoch == 2
    finally:
        ahead.close()


def test_a_mid_run_state_resumes_with_the_next_steps() -> None:
    ds = dataset(22)
    plain = loader(ds, False)
    reference = [plain.next_step() for _ in range(6)]
    ahead = loader(ds, True)
    resumed = loader(ds, True)
    try:
        for k in range(2):
            assert_same_step(ahead.next_step(), reference[k])
        state = ahead.state_dict()  # the thread has read step 2 (and maybe 3) already
        assert state["consumed"] == 2 * 12
        resumed.load_state_dict(state)
        for k in range(2, 6):
            assert_same_step(resumed.next_step(), reference[k])
        ahead.load_state_dict({**state, "consumed": 12})  # back to step 1, in the same loader
        assert_same_step(ahead.next_step(), reference[1])
    finally:
        ahead.close()
        resumed.close()


def test_an_error_in_the_dataset_surfaces_with_its_message() -> None:
    ds = Broken(22, bad=int(loader(dataset(22), False).epoch_order(0)[20]))  # in rank 1's part of step 1
    ld = loader(ds, True)
    try:
        ld.next_step()
        with pytest.raises(ValueError, match=r"sample \d+ is unreadable: disk sector 0x2a"):
            ld.next_step()
        assert ld.consumed == 12  # the failed step is not counted
        assert not prefetch_threads()
        ds.bad = -1  # mended: reading again starts from the counted position
        plain = loader(dataset(22), False)
        plain.next_step()
        assert_same_step(ld.next_step(), plain.next_step())
    finally:
        ld.close()


def test_close_stops_the_thread() -> None:
    assert not prefetch_threads()
    ld = loader(dataset(22), True)
    ld.next_step()
    assert len(prefetch_threads()) == 1
    ld.close()
    assert not prefetch_threads()
    ld.next_step()  # reading again starts a new one, from the counted position
    assert ld.consumed == 24 and len(prefetch_threads()) == 1
    ld.close()
    assert not prefetch_threads()


def test_num_workers_auto_resolves_by_device() -> None:
    assert resolve_num_workers("auto", "cpu") == 0
    assert resolve_num_workers(3, "cpu") == 3 and resolve_num_workers(0, "cuda") == 0
    assert 0 <= resolve_num_workers("auto", "cuda") <= ACCELERATOR_WORKERS
    assert resolve_num_workers("auto", "npu", local_world_size=10**6) == 0  # no core to spare
    base = {"model": {"preset": "tiny_llama"}, "train": {"micro_batch_size": 2, "max_steps": 1}}
    cfg = RunConfig.model_validate(base)
    assert cfg.data.num_workers == "auto"
    on_cpu = StatefulLoader.for_run(dataset(22), cfg, 0, 1, 1)
    assert (on_cpu.num_workers, on_cpu.prefetch, on_cpu.pin_memory) == (0, False, False)
    cfg0 = RunConfig.model_validate({**base, "data": {"num_workers": 0}})
    on_gpu = StatefulLoader.for_run(dataset(22), cfg0, 0, 1, 1, device_type="cuda")
    assert (on_gpu.num_workers, on_gpu.prefetch, on_gpu.pin_memory) == (0, True, True)
    for bad in (-1, "many"):
        with pytest.raises(pydantic.ValidationError, match="num_workers"):
            RunConfig.model_validate({**base, "data": {"num_workers": bad}})


def test_batches_to_device_keeps_every_tensor() -> None:
    step = loader(dataset(22), False).next_step()
    moved = batches_to_device(step, torch.device("cpu"))
    assert_same_step(moved, step)
    assert all(moved[i][k] is step[i][k] for i in range(len(step)) for k in step[i])  # no copy on the CPU
