"""Each rank's random generators: saved per rank (its own device only), restored exactly on the same
layout, re-seeded consistently (and said so) on another one."""

from __future__ import annotations

import json
import random

import pytest
import torch

from shardwise.checkpoint import rng
from shardwise.errors import CheckpointError
from shardwise.parallel.tensor import RankRNG


class FakeDevice:
    """A device module (torch.cuda's interface) with several devices, each with its own state."""

    def __init__(self, count: int) -> None:
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        self.current = 0

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        index = self.current if device is None or device.index is None else device.index
        return self.states[index].clone()

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        index = self.current if device is None or device.index is None else device.index
        self.states[index] = state.clone()


def _draw(stream: RankRNG) -> torch.Tensor:
    return torch.rand(4, generator=torch.Generator().set_state(stream.state()))


def test_cpu_python_and_streams_round_trip() -> None:
    stream = RankRNG("cpu", tp_rank=1, base=123)
    torch.manual_seed(5)
    random.seed(5)
    saved = json.loads(json.dumps(rng.capture(torch.device("cpu"), {"tensor_parallel.0": stream.state()})))
    want = (torch.rand(3), random.random(), _draw(stream))
    torch.manual_seed(99)
    random.seed(99)
    stream.reseed(7)
    assert rng.restore(saved, torch.device("cpu"), {"tensor_parallel.0": stream}) == []
    got = (torch.rand(3), random.random(), _draw(stream))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2])


def test_a_rank_saves_and_restores_only_its_own_device(monkeypatch) -> None:  # noqa: ANN001
    """Saved by the process that drove GPU 5 of 8 visible; resumed where the process sees one GPU."""
    saving = FakeDevice(8)
    monkeypatch.setattr(rng, "_device_module", lambda device: saving)
    state = rng.capture(torch.device("cuda", 5))
    assert state["device"] == {"type": "cuda", "state": rng._b64(saving.states[5])}
    assert "cuda" not in state  # not the list of every visible GPU's states
    resuming = FakeDevice(1)
    monkeypatch.setattr(rng, "_device_module", lambda device: resuming)
    assert rng.restore(state, torch.device("cuda", 0)) == []
    assert torch.equal(resuming.states[0], saving.states[5])


def test_older_checkpoints_and_other_devices(monkeypatch) -> None:  # noqa: ANN001
    cpu = rng._b64(torch.get_rng_state())
    old = {"torch": cpu, "python": rng._jsonable(random.getstate()), "cuda": ["AAAA", "AAAA"]}
    assert rng.restore(old, torch.device("cpu")) == []  # no device here: its list is not needed
    # Saved on a CPU, resumed on a GPU: the GPU's generator has nothing saved and is said so.
    monkeypatch.setattr(rng, "_device_module", lambda device: FakeDevice(1))
    assert rng.restore(rng.capture(torch.device("cpu")), torch.device("cuda", 0)) == ["the cuda generator"]


def test_a_malformed_state_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="random state is malformed"):
        rng.restore({"format": 2, "cpu": "not base64!", "python": []}, torch.device("cpu"))


def test_reseed_is_the_same_on_every_rank_and_differs_by_step() -> None:
    streams = [RankRNG("cpu", tp_rank=r, base=0) for r in (0, 1)]
    draws = []
    for step in (10, 10, 11):
        rng.reseed(42, step, torch.device("cpu"), {"s": streams[0]})
        draws.append(torch.rand(2))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    rng.reseed(42, 10, torch.device("cpu"), {"a": streams[0], "b": streams[1]})
    assert not torch.equal(streams[0].state(), streams[1].state())  # each TP rank its own stream
