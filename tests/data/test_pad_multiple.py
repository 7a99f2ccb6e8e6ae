"""data.pad_to_multiple_of: dynamic SFT batches padded to few widths, with the same loss as unpadded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from shardwise.config.schema import DataConfig
from shardwise.data import Tokenizer, build_data
from shardwise.data.instruction import InstructionDataset
from shardwise.errors import DataError
from shardwise.loss import IGNORE_INDEX, token_loss_sum
from shardwise.models import ModelConfig, build_model

from .test_chat import write_jsonl
from .test_instruction import alpaca

T = 128  # seq_length


def records(n: int = 30) -> list[dict[str, str]]:
    return [alpaca(i, words=1 + (i * 7) % 9) for i in range(n)]


def rows(batch: dict[str, torch.Tensor]) -> Counter:
    """The real tokens of each row (up to the padding, which is the row's last document)."""
    out: Counter = Counter()
    for r in range(batch["input_ids"].shape[0]):
        real = batch["document_ids"][r] == 0
        out[tuple(batch["input_ids"][r][real].tolist())] += 1
    return out


def test_widths_are_multiples_within_the_budget(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    f = write_jsonl(tmp_path / "a.jsonl", records())
    budget = 200
    plain = InstructionDataset(f, tiny_tokenizer, T, packing="dynamic", token_budget=budget, template="default")
    padded = InstructionDataset(f, tiny_tokenizer, T, packing="dynamic", token_budget=budget, template="default",
                                pad_to_multiple_of=16)
    widths = set()
    seen: Counter = Counter()
    for k in range(len(padded)):
        b = padded[k]
        n_rows, width = b["input_ids"].shape
        widths.add(width)
        assert width % 16 == 0 or width == T
        assert n_rows * width <= budget
        longest = int((b["document_ids"] == 0).sum(1).max())
        assert longest <= width < longest + 16  # the longest sample, rounded up
        pad = b["document_ids"] > 0  # each row: one sample (document 0), then its padding
        assert bool((b["labels"][pad] == IGNORE_INDEX).all())  # padding is never a target
        seen += rows(b)
    assert seen == sum((rows(plain[k]) for k in range(len(plain))), Counter())  # every sample once
    assert len(widths) < len({plain[k]["input_ids"].shape[1] for k in range(len(plain))})
    assert padded.stats["padding_tokens"] == sum(padded[k]["input_ids"].numel() for k in range(len(padded))) - \
        padded.stats["tokens"]
    with pytest.raises(DataError, match="pad_to_multiple_of"):
        InstructionDataset(f, tiny_tokenizer, T, packing="dynamic", pad_to_multiple_of=0)


def test_padding_to_a_multiple_does_not_change_the_loss(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    f = write_jsonl(tmp_path / "a.jsonl", records(12))
    budget = 12 * T  # one batch holds every sample, with and without the rounding
    kw = dict(packing="dynamic", token_budget=budget, template="default")
    (unpadded,) = [InstructionDataset(f, tiny_tokenizer, T, **kw)[k] for k in range(1)]
    padded = InstructionDataset(f, tiny_tokenizer, T, pad_to_multiple_of=32, **kw)
    assert len(padded) == 1
    padded = padded[0]
    assert padded["input_ids"].shape[1] % 32 == 0 and padded["input_ids"].shape[1] > unpadded["input_ids"].shape[1]
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=tiny_tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, intermediate_size=48, max_position_embeddings=T), device="cpu")

    def mean_loss(b: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            logits = model(b["input_ids"], position_ids=b["position_ids"], document_ids=b["document_ids"])
        return float(token_loss_sum(logits, b["labels"]) / (b["labels"] != IGNORE_INDEX).sum())

    assert (padded["labels"] != IGNORE_INDEX).sum() == (unpadded["labels"] != IGNORE_INDEX).sum()
    assert mean_loss(padded) == pytest.approx(mean_loss(unpadded), rel=1e-6)


def test_the_config_option_reaches_the_dataset(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    f = write_jsonl(tmp_path / "a.jsonl", records())
    assert DataConfig().pad_to_multiple_of == 64
    data = DataConfig(kind="instruction", train_files=[f], tokenizer=str(tiny_tokenizer_dir), seq_length=T,
                      packing="dynamic", template="default", pad_to_multiple_of=16, cache_dir=str(tmp_path))
    _, train, _ = build_data(data, vocab_size=300, micro_batch_size=2)
    assert train.pad_to_multiple_of == 16
    assert all(train[k]["input_ids"].shape[1] % 16 == 0 or train[k]["input_ids"].shape[1] == T
               for k in range(len(train)))
