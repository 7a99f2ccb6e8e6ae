"""Tiny models and synthetic token data for trainer tests (seconds, not minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.data.packing import PackedDataset
from shardwise.resolve import resolve_config as validate

SEQ = 32


def make_tokens(n: int = 20000, vocab: int = 512, seed: int = 0) -> np.ndarray:
    """A learnable token stream: a repeating pattern with noise, so the loss falls quickly."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(3, vocab, size=97)
    tokens = np.resize(pattern, n)
    noise = rng.random(n) < 0.1
    tokens[noise] = rng.integers(3, vocab, size=int(noise.sum()))
    return tokens.astype(np.uint16)


class MaskedDataset(PackedDataset):
    """Packed samples where a sample-dependent number of labels is ignored (-100)."""

    def get_batch(self, indices):  # noqa: ANN001
        batch = super().get_batch(indices)
        labels = batch["labels"].clone()
        for row, index in enumerate(indices):
            labels[row, : (int(index) * 7) % (SEQ - 1)] = -100
        return {"input_ids": batch["input_ids"], "labels": labels}


class PaddedDataset(PackedDataset):
    """Packed samples with very uneven target-token counts: a sample-dependent prefix of labels is
    ignored (-100, a prompt), a sample-dependent tail is padding (input `pad_id`, label -100), and
    every 11th sample has no target at all. Over a step the counts then differ between the
    data-parallel ranks and between the micro-batches of a rank, so a layout that normalises by a
    local (per-rank or per-micro-batch) count, or drops a rank's share, shows in the gradients.

    `target_counts` records the target tokens of every micro-batch this process read, in order.
    """

    def __init__(self, tokens, seq_length: int, pad_id: int = 0, **kw) -> None:  # noqa: ANN001
        super().__init__(tokens, seq_length, **kw)
        self.pad_id = pad_id
        self.target_counts: list[int] = []

    def get_batch(self, indices):  # noqa: ANN001, ANN201
        batch = super().get_batch(indices)
        ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
        T = ids.shape[1]
        for row, index in enumerate(indices):
            i = int(index)
            if i % 11 == 3:
                labels[row] = -100
                continue
            labels[row, : (i * 7) % (T // 2)] = -100
            pad = (i * 5) % (T // 2)
            if pad:
                ids[row, T - pad:] = self.pad_id
                labels[row, T - pad:] = -100
        self.target_counts.append(int((labels != -100).sum()))
        return {"input_ids": ids, "labels": labels}


def tiny_config(tmp_path: Path, **train) -> "RunConfig":  # noqa: F821
    """A tiny LLaMA run config writing into tmp_path/run."""
    section = {"output_dir": str(tmp_path / "run"), "max_steps": 4, "micro_batch_size": 4, "lr": 3e-3,
               "warmup_steps": 1, "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7,
               # a fixed MFU denominator: measuring this CPU's peak costs ~0.6 s per run start
               "peak_tflops": 1.0}
    section.update(train)
    return validate({"model": {"preset": "tiny_llama"}, "data": {"seq_length": SEQ}, "train": section,
                     "run": {"num_threads": 1}})


def with_changes(cfg, **sections):  # noqa: ANN001, ANN201
    """A copy of a config with some section fields replaced, validated again."""
    raw = cfg.model_dump()
    for section, values in sections.items():
        raw[section] = {**(raw.get(section) or {}), **values}  # `lora` may be None
    return validate(raw)


def read_metrics(run_dir: Path) -> list[dict]:
    """Records of metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def dataset() -> PackedDataset:
    return PackedDataset(make_tokens(), SEQ)
