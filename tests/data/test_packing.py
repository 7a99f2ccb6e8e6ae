"""Pre-training samples: packing a token stream, with document ids and positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.data import PackedDataset
from shardwise.data.packing import ArrayTokens, window_documents
from shardwise.errors import DataError


def test_packed_dataset_every_token_a_target_once() -> None:
    tokens = np.arange(23, dtype=np.uint16)
    ds = PackedDataset(tokens, seq_length=5)
    assert len(ds) == 4  # (23 - 1) // 5
    targets: list[int] = []
    for i in range(len(ds)):
        s = ds[i]
        assert s["input_ids"].dtype == torch.long and s["labels"].dtype == torch.long
        assert s["input_ids"].tolist() == list(range(5 * i, 5 * i + 5))
        assert s["labels"].tolist() == list(range(5 * i + 1, 5 * i + 6))
        targets += s["labels"].tolist()
    assert targets == list(range(1, 21))
    assert ds[-1]["input_ids"].tolist() == ds[3]["input_ids"].tolist()
    with pytest.raises(IndexError):
        ds[4]


def test_packed_dataset_too_few_tokens() -> None:
    assert len(PackedDataset(np.arange(6), 5)) == 1
    with pytest.raises(DataError, match="only 5 tokens.*needs 6"):
        PackedDataset(np.arange(5), 5)


def test_get_batch_equals_stacked_samples() -> None:
    ds = PackedDataset(np.arange(41, dtype=np.uint16), seq_length=4)
    batch = ds.get_batch([7, 0, 3])
    for key in ("input_ids", "labels"):
        assert batch[key].dtype == torch.long
        assert torch.equal(batch[key], torch.stack([ds[i][key] for i in (7, 0, 3)]))
    with pytest.raises(IndexError):
        ds.get_batch([10])


def test_window_documents_ids_and_positions() -> None:
    docs, pos = window_documents(np.array([13, 15]), 10, 8)
    assert docs.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]


def test_packed_samples_carry_document_ids_and_positions() -> None:
    # Documents of 3, 6 and 5 tokens (each ending in EOS = 0) in one stream.
    lengths = [3, 6, 5]
    tokens = np.arange(1, 15, dtype=np.uint16)
    starts = np.cumsum([0] + lengths[:-1])
    ds = PackedDataset(ArrayTokens(tokens, starts), seq_length=4)
    assert len(ds) == 3
    s0, s1, s2 = ds[0], ds[1], ds[2]
    # Sample 0: tokens 0-3; document 1 starts at 3.
    assert s0["document_ids"].tolist() == [0, 0, 0, 1] and s0["position_ids"].tolist() == [0, 1, 2, 0]
    # Sample 1: tokens 4-7, inside document 1, which continues from position 0.
    assert s1["document_ids"].tolist() == [0, 0, 0, 0] and s1["position_ids"].tolist() == [0, 1, 2, 3]
    # Sample 2: tokens 8-11; document 2 starts at 9.
    assert s2["document_ids"].tolist() == [0, 1, 1, 1] and s2["position_ids"].tolist() == [0, 0, 1, 2]
    batch = ds.get_batch([2, 0])
    assert torch.equal(batch["document_ids"], torch.stack([s2["document_ids"], s0["document_ids"]]))
    plain = PackedDataset(ArrayTokens(tokens, starts), 4, reset_attention_mask=False, reset_position_ids=False)
    assert set(plain[0]) == {"input_ids", "labels"}
    positions_only = PackedDataset(ArrayTokens(tokens, starts), 4, reset_attention_mask=False)
    assert set(positions_only[0]) == {"input_ids", "labels", "position_ids"}


def test_packed_dataset_token_range() -> None:
    ds = PackedDataset(np.arange(40, dtype=np.uint16), 4, start=20)
    assert len(ds) == 4 and ds[0]["input_ids"].tolist() == [20, 21, 22, 23]
