"""Pretraining data: file globs, tokenization and its cache, packing, splitting, the whole build."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import shardwise.data.pretrain as pretrain
from shardwise.data import (
    PackedDataset,
    TextDataset,
    Tokenizer,
    build_pretrain_data,
    expand_files,
    split_tokens,
    token_dtype,
    tokenize_files,
)
from shardwise.errors import DataError


def expected_tokens(files: list[str], tok: Tokenizer) -> list[int]:
    """What tokenize_files must produce: each file's ids followed by EOS."""
    out: list[int] = []
    for f in files:
        out += tok.encode(Path(f).read_bytes().decode("utf-8", errors="replace")) + [tok.eos_id]
    return out


def test_expand_files_sorted_deduplicated(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", "c.md", "sub/d.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    got = expand_files([str(tmp_path / "*.txt"), str(tmp_path / "a.txt"), str(tmp_path / "**" / "*.txt")])
    assert got == [str(tmp_path / n) for n in ("a.txt", "b.txt", "sub/d.txt")]
    assert expand_files(str(tmp_path / "c.md")) == [str(tmp_path / "c.md")]


def test_expand_files_errors_name_the_pattern(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*\*\.json' matches no file"):
        expand_files([str(tmp_path / "*.json")])
    with pytest.raises(DataError, match="matches only directories"):
        expand_files([str(tmp_path)])
    with pytest.raises(DataError, match="data.train_files"):
        expand_files([])


def test_token_dtype() -> None:
    assert token_dtype(300) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


def test_tokenize_files_documents_end_with_eos(corpus_files: list[str], tiny_tokenizer: Tokenizer) -> None:
    tokens = tokenize_files(corpus_files, tiny_tokenizer, cache_dir=None)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == expected_tokens(corpus_files, tiny_tokenizer)
    assert int((tokens == tiny_tokenizer.eos_id).sum()) == len(corpus_files)


def test_invalid_utf8_is_replaced(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    f = tmp_path / "bad.txt"
    f.write_bytes(b"the house \xff\xfe was here")
    tokens = tokenize_files([str(f)], tiny_tokenizer, None)
    assert tiny_tokenizer.decode(tokens.tolist()) == "the house \ufffd\ufffd was here"


def test_token_cache_reused_and_invalidated(
    tmp_path: Path, tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "doc.txt"
    f.write_text("the evening walk")
    cache = tmp_path / "cache"
    first = tokenize_files([str(f)], tiny_tokenizer, str(cache))
    assert len(list(cache.glob("tokens-*.npy"))) == 1

    def must_not_run(self: Tokenizer, texts: list[str]) -> list[list[int]]:
        raise AssertionError("tokenized again although the cache is valid")

    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "encode_batch", must_not_run)
        again = tokenize_files([str(f)], tiny_tokenizer, str(cache))
    assert again.tolist() == first.tolist()

    # A changed file (size and mtime) gets a new cache entry with the new tokens.
    f.write_text("the evening walk to the ball")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    changed = tokenize_files([str(f)], tiny_tokenizer, str(cache))
    assert changed.tolist() == expected_tokens([str(f)], tiny_tokenizer)
    assert len(list(cache.glob("tokens-*.npy"))) == 2


def test_interrupted_cache_write_leaves_nothing_usable(
    tmp_path: Path, tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "doc.txt"
    f.write_text("her sister Jane")
    cache = tmp_path / "cache"

    def crash(file: object, array: np.ndarray) -> None:
        file.write(b"\x93NUMPY partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pretrain.np, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            tokenize_files([str(f)], tiny_tokenizer, str(cache))
    assert list(cache.iterdir()) == []  # neither a final file nor a stray temp file
    tokens = tokenize_files([str(f)], tiny_tokenizer, str(cache))
    assert tokens.tolist() == expected_tokens([str(f)], tiny_tokenizer)


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


def test_split_tokens_takes_the_tail() -> None:
    train, ev = split_tokens(np.arange(100), 0.1)
    assert train.tolist() == list(range(90)) and ev.tolist() == list(range(90, 100))
    train, ev = split_tokens(np.arange(100), 0.0)
    assert len(train) == 100 and len(ev) == 0
    with pytest.raises(DataError, match="eval_fraction"):
        split_tokens(np.arange(10), 1.0)


def test_build_trains_caches_and_reuses_tokenizer(
    corpus_files: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = str(tmp_path / "cache")
    glob = str(Path(corpus_files[0]).parent / "*.txt")
    tok, train, ev = build_pretrain_data([glob], 16, None, 300, cache, eval_fraction=0.1)
    all_tokens = expected_tokens(corpus_files, tok)
    n_eval = round(len(all_tokens) * 0.1)
    assert train.tokens.tolist() == all_tokens[: len(all_tokens) - n_eval]
    assert ev is not None and ev.tokens.tolist() == all_tokens[len(all_tokens) - n_eval :]
    assert len(train) == (len(all_tokens) - n_eval - 1) // 16

    def no_training(*args: object, **kwargs: object) -> Tokenizer:
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(pretrain, "train_bpe_tokenizer", no_training)
    tok2, train2, ev2 = build_pretrain_data([glob], 16, None, 300, cache)
    assert tok2.fingerprint == tok.fingerprint
    assert ev2 is None and train2.tokens.tolist() == all_tokens


def test_build_with_tokenizer_dir_and_eval_files(
    corpus_files: list[str], tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    tok, train, ev = build_pretrain_data(
        corpus_files[:2], 8, str(tiny_tokenizer_dir), 999, str(tmp_path), eval_files=corpus_files[2:]
    )
    assert tok.fingerprint == tiny_tokenizer.fingerprint
    assert train.tokens.tolist() == expected_tokens(corpus_files[:2], tok)
    assert ev is not None and ev.tokens.tolist() == expected_tokens(corpus_files[2:], tok)
    with pytest.raises(DataError, match="eval_fraction 0.0001 holds out"):
        build_pretrain_data(
            corpus_files, 8, str(tiny_tokenizer_dir), 999, str(tmp_path), eval_fraction=0.0001
        )


def test_text_dataset_seed_signature(corpus_files: list[str], tiny_tokenizer: Tokenizer) -> None:
    ds = TextDataset(
        data_files=str(Path(corpus_files[0]).parent / "doc*.txt"),
        tokenizer=tiny_tokenizer,
        max_seq_len=32,
        shuffle=False,
    )
    assert ds.shuffle is False and ds.files == corpus_files
    n = len(expected_tokens(corpus_files, tiny_tokenizer))
    assert len(ds) == (n - 1) // 32
    assert ds[1]["input_ids"].tolist() == ds.tokens[32:64].tolist()


def test_get_batch_equals_stacked_samples() -> None:
    ds = PackedDataset(np.arange(41, dtype=np.uint16), seq_length=4)
    batch = ds.get_batch([7, 0, 3])
    for key in ("input_ids", "labels"):
        assert batch[key].dtype == torch.long
        assert torch.equal(batch[key], torch.stack([ds[i][key] for i in (7, 0, 3)]))
    with pytest.raises(IndexError):
        ds.get_batch([10])
