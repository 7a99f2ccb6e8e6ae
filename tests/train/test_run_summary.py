"""The end of a run: its summary and suggestions (train/run_summary.py), and clean logs (no progress bar
off a terminal).

The suggestions are checked at their thresholds, on both sides; the summary of a real run against its
metrics.jsonl and TrainResult; the progress bar against a stderr that is a terminal and one that is not.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import re
import sys
from pathlib import Path

import pytest

from shardwise.data.packing import PackedDataset
from shardwise.train import run_summary as rs
from shardwise.train.run_summary import RunFigures, suggestions, summary_lines
from shardwise.train.trainer import Trainer

from .conftest import SEQ, MaskedDataset, make_tokens, read_metrics, tiny_config

# A healthy GPU run: nothing to suggest.
HEALTHY = RunFigures(steps=100, last_step=100, tokens=1_000_000, wall_s=100.0, data_s=1.0, mfu=0.45,
                     peak_memory_gb=60.0, capacity_gb=80.0, device_type="cuda", final_loss=2.5, eval_loss=2.6,
                     checkpoints=2, skipped_steps=0, mixed_precision="bf16", recompute="selective")


def _with(**changes) -> RunFigures:
    return dataclasses.replace(HEALTHY, **changes)


def test_a_healthy_run_gets_no_suggestion() -> None:
    assert suggestions(HEALTHY) == []
    assert not any(line.startswith("suggestion:") for line in summary_lines(HEALTHY))


def test_data_loading_share() -> None:
    at = rs.DATA_SHARE * HEALTHY.wall_s
    assert suggestions(_with(data_s=at)) == []
    (text,) = suggestions(_with(data_s=at * 1.05))
    assert "data loader took 10%" in text and "data.num_workers" in text


def test_memory_far_below_capacity() -> None:
    at = rs.LOW_MEMORY_SHARE * HEALTHY.capacity_gb
    assert suggestions(_with(peak_memory_gb=at)) == []
    (text,) = suggestions(_with(peak_memory_gb=at * 0.95))
    assert "train.micro_batch_size" in text and "optimize.recompute is selective" in text
    (text,) = suggestions(_with(peak_memory_gb=at * 0.95, recompute="none"))
    assert "recompute" not in text  # nothing to recompute less
    # A CPU's "capacity" is the host's memory: no suggestion from it, nor from its MFU.
    assert suggestions(_with(peak_memory_gb=1.0, mfu=0.01, device_type="cpu")) == []


def test_low_mfu_on_an_accelerator() -> None:
    assert suggestions(_with(mfu=rs.LOW_MFU)) == []
    (text,) = suggestions(_with(mfu=rs.LOW_MFU - 0.01))
    assert "MFU 29% is below 30%" in text and "run.compile" in text
    assert suggestions(_with(mfu=math.nan)) == []  # no peak known: no MFU to judge


def test_skipped_steps_suggest_bf16_under_fp16() -> None:
    at = int(rs.SKIPPED_SHARE * HEALTHY.steps)
    assert suggestions(_with(skipped_steps=at, mixed_precision="fp16")) == []
    (text,) = suggestions(_with(skipped_steps=at + 1, mixed_precision="fp16"))
    assert "2 of 100 steps were skipped" in text and "optimize.mixed_precision: bf16" in text
    (text,) = suggestions(_with(skipped_steps=at + 1))
    assert "train.lr" in text and "bf16" not in text


def test_at_most_two_suggestions_most_costly_first() -> None:
    found = suggestions(_with(data_s=50.0, peak_memory_gb=1.0, mfu=0.05, skipped_steps=50))
    assert len(found) == rs.MAX_SUGGESTIONS == 2
    assert "data loader" in found[0] and "peak memory" in found[1]


def test_summary_lines_hold_the_figures() -> None:
    first, second = summary_lines(HEALTHY)
    assert first.startswith("run summary: 100 steps (to step 100), 1,000,000 tokens in 100.0 s: 10,000 tokens/s")
    assert "MFU 45.0%" in first
    assert "peak memory 60.00 GiB of 80.0 GiB (75%)" in second and "final loss 2.5000, eval loss 2.6000" in second
    assert "2 checkpoint(s) written; 0 step(s) skipped; data loading 1%" in second
    assert "MFU" not in summary_lines(_with(mfu=math.nan))[0]


def _run(tmp_path: Path, **train) -> object:
    cfg = tiny_config(tmp_path, **train)
    # Some labels ignored: the summary's tokens are the real (input) tokens, more than the targets.
    return Trainer(cfg, train_dataset=MaskedDataset(make_tokens(), SEQ),
                   eval_dataset=PackedDataset(make_tokens(2000, seed=1), SEQ)).train(overwrite=True)


def test_a_run_ends_with_its_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shardwise"):
        result = _run(tmp_path, max_steps=4, save_steps=2, eval_steps=4)
    lines = result.summary
    assert lines and all(line in caplog.messages for line in lines)  # logged, and returned
    records = read_metrics(tmp_path / "run")
    last = [r for r in records if "loss" in r][-1]
    evaluated = [r for r in records if "eval_loss" in r][-1]
    head = re.match(r"run summary: (\d+) steps \(to step (\d+)\), ([\d,]+) tokens", lines[0])
    assert head, lines[0]
    assert int(head[1]) == 4 and int(head[2]) == last["step"] == result.step
    assert int(head[3].replace(",", "")) == 4 * 4 * SEQ  # steps x micro-batch x sequence: no padding
    assert f"final loss {last['loss']:.4f}" in lines[1]  # log_steps 1: the record is the last step's loss
    assert f"{result.losses[4]:.4f}" == f"{last['loss']:.4f}"
    assert f"eval loss {evaluated['eval_loss']:.4f}" in lines[1]
    assert f"peak memory {last['peak_memory_gb']:.2f} GiB" in lines[1]
    assert "2 checkpoint(s) written" in lines[1]  # steps 2 and 4


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tmp_path: Path, capfd: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path / "file", max_steps=2, progress_bar=True)
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err and "step/s" not in err
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _run(tmp_path / "terminal", max_steps=2, progress_bar=True)
    assert "\r" in terminal.getvalue() and "train" in terminal.getvalue()  # the bar, redrawn in place
