"""A step's figures reach the host exactly: token counts above 2^24 (where float32 stops counting
every integer) come back as counted, in the one copy of the figures a step makes."""

from __future__ import annotations

import torch

from shardwise.train.metrics import StepTokens
from shardwise.train.step_result import StepResult
from shardwise.train.trainer import Trainer

from .conftest import tiny_config

# Odd counts above 2^24: float32 would round each to an even neighbour.
TARGET, REAL = 2**24 + 1, 2**25 + 3


def test_token_counts_above_float32s_integers_come_back_exactly(tmp_path, dataset, monkeypatch):
    # Under data parallelism the counts are summed on the device and travel with the loss and the norm;
    # here one process stands in, its counts given as the collective would leave them.
    trainer = Trainer(tiny_config(tmp_path), train_dataset=dataset)
    trainer.state = trainer.setup(overwrite=True)
    counts = torch.tensor([TARGET, REAL], dtype=torch.int64)
    monkeypatch.setattr(trainer, "_step_tokens", lambda micro_batches, step: counts)
    result = trainer.train_step(trainer.state.loader.next_step(), 0)
    assert result.tokens == StepTokens(real=REAL, target=TARGET)
    assert 0 < result.loss < 1e-3  # the step's loss sum over the (pretended) 2^24 target tokens
    assert not result.skipped and result.grad_norm > 0


def test_figures_keep_float64_values():
    figures = torch.tensor([1.0 + 2**-40, 3.0, 0.0, 0.0, 1.0, TARGET, REAL], dtype=torch.float64)
    result = StepResult(0, figures)
    assert result.loss == 1.0 + 2**-40 and result.tokens == StepTokens(real=REAL, target=TARGET)
    known = StepResult.known(1, 1.0 + 2**-40, 2.0 + 2**-40, False, StepTokens(real=REAL, target=TARGET))
    assert (known.loss, known.grad_norm) == (1.0 + 2**-40, 2.0 + 2**-40)
