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
from tqdm import tqdm

from shardwise.cli import setup_logging
from shardwise.data.packing import PackedDataset
from shardwise.train import progress
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
    (text,) = suggestions(_with(peak_memory_gb=at * 0.95, recompute="auto"))
    assert "recompute" not in text  # auto recomputes only what memory needs already
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
    first, speed, third = summary_lines(HEALTHY)
    assert first == "run summary: 100 steps (to step 100), 1,000,000 tokens in 100.0 s"
    assert speed == ("throughput: 10,000 tokens/s over the wall time (checkpoints, evaluation and profiling "
                     "included; MFU 45.0%)")  # the time inside the steps is not known
    assert "peak memory 60.00 GiB of 80.0 GiB (75%)" in third and "final loss 2.5000, eval loss 2.6000" in third
    assert "2 checkpoint(s) written; 0 step(s) skipped; data loading 1% of the wall time" in third
    assert "MFU" not in summary_lines(_with(mfu=math.nan))[1]


def test_summary_gives_the_training_step_and_the_overall_throughput() -> None:
    # 100 s of wall time, 40 s of it checkpoints and evaluation: 60 s in the steps.
    lines = summary_lines(_with(step_s=60.0, step_mfu=0.75, data_s=3.0))
    assert lines[1] == ("throughput: 16,667 tokens/s in the training steps (60.0 s; MFU 75.0%), 10,000 tokens/s "
                        "over the wall time (checkpoints, evaluation and profiling included; MFU 45.0%)")
    assert "data loading 5% of the training-step time" in lines[2]
    # Data loading is judged against the steps' time: 7 s is 7% of the wall time but 11.7% of the steps'.
    assert suggestions(_with(data_s=7.0)) == []
    (text,) = suggestions(_with(data_s=7.0, step_s=60.0, step_mfu=0.75))
    assert "data loader took 12% of the training-step time" in text
    # MFU is judged in the steps when known: saves and evaluation lower the overall one, not the steps'.
    assert suggestions(_with(mfu=0.2, step_s=60.0, step_mfu=0.4)) == []
    (text,) = suggestions(_with(mfu=0.2, step_s=60.0, step_mfu=0.25))
    assert "MFU 25% in the training steps is below 30%" in text


def test_a_compiled_run_is_not_told_to_compile() -> None:
    assert "run.compile: true" in suggestions(_with(mfu=0.1))[0]
    (text,) = suggestions(_with(mfu=0.1, compiled=True))
    assert "run.compile" not in text and "train.micro_batch_size" in text


def test_a_run_with_no_step_left_says_so() -> None:
    # Resumed at its end: no step, no record (peak memory and loss unknown): no "nan GiB (nan%)".
    figures = _with(steps=0, tokens=0, wall_s=0.0, data_s=0.0, peak_memory_gb=math.nan, final_loss=math.nan)
    assert summary_lines(figures) == ["run summary: no step trained (the run was already at step 100)"]
    assert summary_lines(_with(peak_memory_gb=math.nan))[2].startswith("peak memory not measured; final loss")


def test_tally_leaves_the_work_set_aside_out_of_the_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [10.0]
    monkeypatch.setattr(rs.time, "perf_counter", lambda: now[0])
    tally = rs.RunTally(start=10.0)
    now[0] = 13.0  # 3 s of steps
    with tally.aside():  # a checkpoint save of 2 s
        now[0] = 15.0
    tally.set_aside(0.5)  # the profiler's writing
    now[0] = 20.0
    tally.end()
    now[0] = 99.0  # closing the trackers' runs afterwards is not the run's time
    assert tally.elapsed() == 10.0 and tally.step_s() == 7.5


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
    text = "\n".join(lines)
    assert f"final loss {last['loss']:.4f}" in text  # log_steps 1: the record is the last step's loss
    assert f"{result.losses[4]:.4f}" == f"{last['loss']:.4f}"
    assert f"eval loss {evaluated['eval_loss']:.4f}" in text
    assert f"peak memory {last['peak_memory_gb']:.2f} GiB" in text
    assert "2 checkpoint(s) written" in text  # steps 2 and 4


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


def test_log_lines_stay_above_the_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    console = logging.StreamHandler(sys.stderr)  # what logging.basicConfig puts on the root logger
    console.setLevel(logging.INFO)
    elsewhere = logging.StreamHandler(io.StringIO())  # a log file, say: left alone
    root, ours = logging.getLogger(), logging.getLogger("shardwise")
    monkeypatch.setattr(root, "handlers", [console, elsewhere])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    monkeypatch.setattr(ours, "level", logging.DEBUG)
    log = logging.getLogger("shardwise.train.loop")
    bar = tqdm(total=3, desc="train")
    with progress.logs_above_bar(bar):
        for step in range(3):
            bar.update(1)
            log.info("step %d logged", step)
        log.debug("hidden: below the console handler's level")
    bar.close()
    out = terminal.getvalue()
    for step in range(3):
        assert out.count(f"step {step} logged") == 1
        at = out.index(f"step {step} logged")
        assert out[at - 1] in "\r\n", repr(out[max(at - 40, 0):at + 15])  # on a line of its own, not in the bar
    assert "hidden" not in out and root.handlers == [console, elsewhere]  # restored
    assert elsewhere.stream.getvalue().count("logged") == 3
    hidden = tqdm(total=1, disable=True)
    with progress.logs_above_bar(hidden):
        assert root.handlers == [console, elsewhere]  # no bar: nothing to keep clear of
    # The CLI's logging already writes through tqdm, on the shardwise logger: left alone, each line once.
    monkeypatch.setattr(ours, "handlers", [])
    setup_logging()
    bar = tqdm(total=1, desc="train")
    with progress.logs_above_bar(bar):
        log.info("once only")
    bar.close()
    assert terminal.getvalue().count("once only") == 1
