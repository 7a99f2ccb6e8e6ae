"""Out-of-memory help: the message names the rank, the phase, the estimate, and changes that fit."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest
import torch

from shardwise.config import apply_overrides
from shardwise.errors import TrainingError
from shardwise.memory.estimate import estimate_all_ranks, estimate_memory
from shardwise.models import build_model
from shardwise.train import oom
from shardwise.train.trainer import Trainer

from .conftest import SEQ, make_tokens, tiny_config, validate, with_changes


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

    def __getattr__(self, name: str):  # noqa: ANN204 - the rest (layers, ...) is the model's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


def _suggested_sets(text: str) -> list[list[str]]:
    """The `--set` options of each suggestion in the message, split as a shell splits a pasted line."""
    out = []
    for line in text.splitlines():
        if line.strip().startswith("--set "):
            words = shlex.split(line)
            assert words[::2] == ["--set"] * (len(words) // 2) and len(words) % 2 == 0, line
            out.append(words[1::2])
    return out


def test_out_of_memory_says_where_and_what_would_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that runs out of memory names the rank, the phase and the estimate, and gives `--set` lines
    whose configs, applied as the command line applies them, fit the device by the estimator and train:
    the first (a smaller micro-batch with more accumulation) with the very losses of the original."""
    from shardwise.data.packing import PackedDataset

    cfg = with_changes(tiny_config(tmp_path, max_steps=2), train={"micro_batch_size": 8})
    peak = estimate_memory(cfg, 1, "cpu").peak
    capacity = int(peak * 0.95)
    monkeypatch.setattr(oom, "device_memory_bytes", lambda _device: capacity)
    torch.manual_seed(0)
    model = _RunsOutInBackward(build_model(cfg.model))
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, model=model, train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    text = str(info.value)
    assert "rank 0 ran out of cpu memory during the backward" in text
    assert f"peak {oom.size_text(peak)}" in text
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    suggestions = _suggested_sets(text)
    assert 1 <= len(suggestions) <= 2, text
    peaks = re.findall(r"estimated peak ([\d.]+ [KMG]iB), step time x([\d.]+)", text)
    assert len(peaks) == len(suggestions), text
    raw = cfg.model_dump()
    for sets, (printed, _) in zip(suggestions, peaks):
        suggested = validate(apply_overrides(raw, sets))  # what `shardwise train CONFIG --set ...` runs
        need = max(e.peak for e in estimate_all_ranks(suggested, 1, "cpu"))
        assert need <= 0.9 * capacity, (sets, need, capacity)  # fits, with the planner's 10% margin
        assert oom.size_text(need) == printed
        assert suggested.global_batch_size(1) == cfg.global_batch_size(1)  # the same samples per step
    first = validate(apply_overrides(raw, suggestions[0]))
    assert first.train.micro_batch_size < 8, suggestions[0]  # no single lever but the micro-batch changes
    runs = {}
    for name, c in (("original", cfg), ("suggested", first)):
        c = with_changes(c, train={"output_dir": str(tmp_path / name)})
        torch.manual_seed(0)
        runs[name] = Trainer(c, model=build_model(c.model), train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    assert len(runs["suggested"].losses) == 2
    for step, loss in runs["original"].losses.items():
        assert runs["suggested"].losses[step] == pytest.approx(loss, rel=1e-6)


def test_other_errors_pass_through() -> None:
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert oom.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    assert not oom.is_out_of_memory(RuntimeError("shape mismatch"))


def test_a_run_refused_for_the_free_memory_gets_a_line_that_starts(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a run estimated above the free memory is refused before it starts, with `--set` lines;
    the first one's config passes the same check and trains."""
    from shardwise.data.packing import PackedDataset
    from shardwise.errors import ConfigError
    from shardwise.train import run_dir

    cfg = with_changes(tiny_config(tmp_path, max_steps=1), train={"micro_batch_size": 8})
    free = int(estimate_memory(cfg, 1, "cpu").peak * 0.95)
    monkeypatch.setattr(run_dir, "available_host_memory", lambda: free)
    with pytest.raises(ConfigError, match="needs about") as info:
        Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    suggestions = _suggested_sets(str(info.value))
    assert suggestions, str(info.value)
    suggested = validate(apply_overrides(cfg.model_dump(), suggestions[0]))
    assert max(e.peak for e in estimate_all_ranks(suggested, 1, "cpu")) <= 0.9 * free
    result = Trainer(suggested, train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    assert len(result.losses) == 1 and all(math.isfinite(v) for v in result.losses.values())


def test_a_limited_process_has_less_memory_than_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    machine = oom.device_memory_bytes(torch.device("cpu"))
    limited = {resource.RLIMIT_AS: 2**30}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limited.get(which, resource.RLIM_INFINITY),) * 2)
    assert machine > 2**30 and oom.device_memory_bytes(torch.device("cpu")) == min(machine, *oom.process_limits())
    assert 2**30 in oom.process_limits() and oom.device_memory_bytes(torch.device("cpu")) <= 2**30
