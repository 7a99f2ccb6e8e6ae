"""Out-of-memory help: the message names the rank, the phase, the estimate, and changes that fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.errors import TrainingError
from shardwise.memory.estimate import estimate_memory
from shardwise.models import build_model
from shardwise.train import oom
from shardwise.train.trainer import Trainer

from .conftest import SEQ, make_tokens, tiny_config, with_changes


class _RunsOutInBackward(torch.nn.Module):
    """The model, except that its backward fails as a full device would."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.cfg = model.cfg

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        logits = self.inner(*args, **kwargs)

        def fail(_grad: torch.Tensor) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        logits.register_hook(fail)
        return logits

    def reset_rope_tables(self) -> None:
        self.inner.reset_rope_tables()


def test_out_of_memory_says_where_and_what_would_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.data.packing import PackedDataset

    cfg = with_changes(tiny_config(tmp_path), train={"micro_batch_size": 8})
    peak = estimate_memory(cfg, 1, "cpu").peak
    monkeypatch.setattr(oom, "device_memory_bytes", lambda _device: int(peak * 0.95))
    torch.manual_seed(0)
    model = _RunsOutInBackward(build_model(cfg.model))
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, model=model, train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    text = str(info.value)
    assert "rank 0 ran out of cpu memory during the backward" in text
    assert f"peak {oom.size_text(peak)}" in text
    suggestions = [line for line in text.splitlines() if line.startswith("  ")]
    assert suggestions, text
    for line in suggestions:  # each one fits the device (with the 10% margin), by the estimator's own numbers
        number, unit = line.rsplit(": ", 1)[1].split()
        assert float(number) * {"MiB": 2**20, "GiB": 2**30}[unit] < peak * 0.95 * 0.9 + 2**20 * 0.05
    assert any("micro_batch_size: 4" in line or "recompute" in line for line in suggestions)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_other_errors_pass_through() -> None:
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert oom.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    assert not oom.is_out_of_memory(RuntimeError("shape mismatch"))
