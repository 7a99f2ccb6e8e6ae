"""Metrics: real and target tokens, records and their MFU, the peak it divides by, metrics.jsonl on resume."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import shardwise.train.metrics as metrics
from shardwise.data import train_bpe_tokenizer
from shardwise.data.instruction import InstructionDataset
from shardwise.data.packing import ArrayTokens, PackedDataset
from shardwise.data.tokenizer import load_tokenizer
from shardwise.hardware import Peak
from shardwise.memory.estimate import run_flops
from shardwise.train.metrics import (
    MetricsWriter,
    MfuMeter,
    Window,
    count_real_tokens,
    format_record,
    padding_mask,
    read_metrics,
)
from shardwise.train.trainer import Trainer
from tests.data.conftest import write_corpus

from .conftest import read_metrics as read_jsonl
from .conftest import tiny_config, with_changes

IGNORE = -100

# --- real and target tokens ----------------------------------------------------------------------------


def test_padding_is_a_rows_last_document_without_targets() -> None:
    # Row 0: two samples then padding (doc 2). Row 1: full, its last sample has a target. Row 2: one
    # sample whose prompt (-100 labels) is not padding, then padding.
    doc = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]])
    labels = torch.tensor([[5, IGNORE, IGNORE, 7, IGNORE, IGNORE, IGNORE, IGNORE],
                           [IGNORE, 4, IGNORE, IGNORE, IGNORE, 9, 9, IGNORE],
                           [IGNORE, IGNORE, IGNORE, 3, IGNORE, IGNORE, IGNORE, IGNORE]])
    batch = {"input_ids": torch.zeros_like(doc), "labels": labels, "document_ids": doc}
    assert padding_mask(batch).tolist() == [[False] * 5 + [True] * 3, [False] * 8, [False] * 5 + [True] * 3]
    assert count_real_tokens([batch, batch]) == 2 * (24 - 6)
    # Without document ids nothing marks padding: every token is real, -100 labels or not.
    assert padding_mask({"input_ids": doc, "labels": labels}) is None
    assert count_real_tokens([{"input_ids": doc, "labels": labels}]) == 24


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("metrics_tok")
    train_bpe_tokenizer(write_corpus(root / "corpus", n_files=2), 300, root / "tok", show_progress=False)
    return load_tokenizer(root / "tok")


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("metrics_chat") / "chat.jsonl"
    records = [{"instruction": f"Tell me of the ball {i}.", "output": " ".join(["the evening walk"] * (1 + i % 5))}
               for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("packing", ["pack", "pad", "dynamic"])
def test_real_tokens_of_instruction_data_leave_its_padding_out(tokenizer, chat_file, packing) -> None:
    ds = InstructionDataset(chat_file, tokenizer, 64, template="default", packing=packing, token_budget=192)
    items = [ds.get_batch([i]) for i in range(len(ds))]
    assert ds.stats["padding_tokens"] > 0
    # The dataset's own count of its samples' tokens, without padding.
    assert count_real_tokens(items) == ds.stats["tokens"]
    assert sum(int((b["labels"] != IGNORE).sum()) for b in items) == ds.stats["target_tokens"]
    assert sum(b["input_ids"].numel() for b in items) == ds.stats["tokens"] + ds.stats["padding_tokens"]


def test_packed_pretraining_windows_have_no_padding() -> None:
    tokens = np.arange(1, 400, dtype=np.uint16)
    ds = PackedDataset(ArrayTokens(tokens, document_starts=np.array([0, 50, 61, 300])), 32)
    batch = ds.get_batch(range(len(ds)))
    assert "document_ids" in batch and count_real_tokens([batch]) == batch["input_ids"].numel()


def test_trainer_logs_real_and_target_tokens(tmp_path, tokenizer, chat_file) -> None:
    """One step over every padded row: tokens/s and target tokens/s are the dataset's real tokens and
    targets over the same time, so their ratio is theirs (padding included it would not be)."""
    ds = InstructionDataset(chat_file, tokenizer, 64, template="default", packing="pad")
    cfg = with_changes(tiny_config(tmp_path, max_steps=1, micro_batch_size=len(ds)), data={"seq_length": 64})
    Trainer(cfg, train_dataset=ds).train(overwrite=True)
    (record,) = read_jsonl(tmp_path / "run")
    assert record["tokens_per_s"] / record["target_tokens_per_s"] == pytest.approx(
        ds.stats["tokens"] / ds.stats["target_tokens"], rel=1e-9)
    assert record["tokens_per_s_per_device"] == record["tokens_per_s"]


# --- records and MFU ---------------------------------------------------------------------------------------


def test_window_record_counts_real_tokens_over_its_time() -> None:
    window = Window(start=10.0, clock=lambda: 12.0)  # 2 s
    window.add(2.0, real_tokens=300, target_tokens=100, skipped=False)
    window.add(float("nan"), real_tokens=100, target_tokens=20, skipped=True)
    mfu = MfuMeter(flops_per_token=1e6, peak=Peak(1e9, "train.peak_tflops"))
    r = window.record(4, lr=1e-3, grad_norm=0.5, loss_scale=1.0, mfu=mfu, device=torch.device("cpu"), world_size=2)
    assert (r["step"], r["loss"], r["skipped_steps"]) == (4, 2.0, 1)
    assert r["tokens_per_s"] == 200 and r["target_tokens_per_s"] == 60 and r["tokens_per_s_per_device"] == 100
    assert r["mfu"] == pytest.approx(100 * 1e6 / 1e9) and r["peak_in_doubt"] is False
    line = format_record(r)
    assert "tokens/s 200 (targets 60)" in line and "mfu 10.0%" in line and "doubt" not in line


def test_an_mfu_above_one_puts_the_peak_in_doubt_and_warns_once(caplog) -> None:
    mfu = MfuMeter(flops_per_token=1e9, peak=Peak(1e11, "measured on this CPU"))
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert mfu.of(50.0) == (0.5, False)
        assert mfu.of(107.0) == (pytest.approx(1.07), True)
        assert mfu.of(110.0)[1] is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "107%" in warnings[0] and "train.peak_tflops" in warnings[0] and "measured" in warnings[0]
    window = Window(start=0.0, clock=lambda: 1.0)
    window.add(1.0, 107, 107, False)
    record = window.record(1, 1e-3, 1.0, 1.0, mfu, torch.device("cpu"))
    assert record["peak_in_doubt"] is True and "mfu 107.0% (peak in doubt)" in format_record(record)


def test_an_unknown_peak_gives_no_mfu() -> None:
    assert math.isnan(MfuMeter(1e9, Peak(float("nan"), "not measured on this rank")).of(1e3)[0])


def test_the_trainer_divides_by_the_frozen_aware_flops(tmp_path, dataset) -> None:
    cfg = with_changes(tiny_config(tmp_path, max_steps=2, peak_tflops=1e-3), lora={"r": 4})
    Trainer(cfg, train_dataset=dataset).train(overwrite=True)
    for r in read_jsonl(tmp_path / "run"):
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * run_flops(cfg).total / 1e9, rel=1e-9)
        assert r["target_tokens_per_s"] == pytest.approx(r["tokens_per_s"])  # packed: every position a target


# --- metrics.jsonl -------------------------------------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_each_record_is_one_line_in_one_write(tmp_path, monkeypatch) -> None:
    writes = []
    real_write = os.write
    monkeypatch.setattr(metrics.os, "write", lambda fd, data: writes.append(data) or real_write(fd, data))
    writer = MetricsWriter(tmp_path, tensorboard=False)
    big = {"step": 1, "loss": 1.0, "text": "x" * 20000}  # larger than a buffered writer's chunks
    writer.write(big)
    writer.write({"step": 2, "loss": 0.5})
    writer.close()
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
    assert read_metrics(tmp_path) == [big, {"step": 2, "loss": 0.5}]


def test_a_resumed_run_keeps_the_records_through_its_step_and_drops_a_torn_line(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)]
    records.insert(4, {"step": 4, "eval_loss": 3.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 7, "loss": 2.', encoding="utf-8")
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 4, 5, 6]  # the torn line is skipped
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=4)
    assert [json.loads(line) for line in _lines(path)] == records[:5]
    writer.write({"step": 5, "loss": 9.0})
    writer.close()
    # The first record after the resume comes after a mark of where the curve continues (the report draws it).
    assert [json.loads(line) for line in _lines(path)][5:] == [{"step": 4, "resumed": True}, {"step": 5, "loss": 9.0}]
    # Resuming at step 0 (no checkpoint yet): the file starts again.
    MetricsWriter(tmp_path, tensorboard=False, resume_step=0).close()
    assert path.read_text() == ""


def test_a_writer_that_does_not_log_leaves_the_file_alone(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    writer = MetricsWriter(tmp_path, tensorboard=False, enabled=False, resume_step=1)
    writer.write({"step": 3})
    writer.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
