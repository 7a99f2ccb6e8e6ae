"""The data section of a config -> tokenizer and datasets: raw files, prepared dirs, SFT, eval splits;
the seed's TextDataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardwise.data.build as build
from shardwise.config import DataConfig
from shardwise.data import TextDataset, Tokenizer, TokenShards, build_data, prepare_corpus
from shardwise.errors import DataError


def _data(**fields: object) -> DataConfig:
    return DataConfig(**{"seq_length": 16, **fields})


def _stream(ds) -> list[int]:  # noqa: ANN001
    return ds.source.read(ds.start, ds.stop).tolist()


def _expected(files: list[str], tok: Tokenizer) -> list[int]:
    out: list[int] = []
    for f in files:
        out += tok.encode(Path(f).read_text()) + [tok.eos_id]
    return out


def test_raw_files_train_a_cached_tokenizer_and_split_the_tail(
    corpus_files: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    glob = str(Path(corpus_files[0]).parent / "*.txt")
    data = _data(train_files=[glob], eval_fraction=0.1, cache_dir=str(tmp_path))
    tok, train, ev = build_data(data, vocab_size=300)
    tokens = _expected(corpus_files, tok)
    cut = len(tokens) - round(len(tokens) * 0.1)
    assert _stream(train) == tokens[:cut] and _stream(ev) == tokens[cut:]
    assert len(train) == (cut - 1) // 16
    assert "document_ids" in train[0] and "position_ids" in train[0]

    def no_training(*args: object, **kwargs: object) -> Tokenizer:
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(build, "train_bpe_tokenizer", no_training)
    tok2, train2, ev2 = build_data(_data(train_files=[glob], cache_dir=str(tmp_path)), vocab_size=300)
    assert tok2.fingerprint == tok.fingerprint and ev2 is None and _stream(train2) == tokens


def test_prepared_directory_and_eval_files(
    corpus_files: list[str], tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    out = tmp_path / "prepared"
    prepare_corpus(corpus_files[:2], tiny_tokenizer, out, workers=1)
    data = _data(train_files=[str(out)], eval_files=corpus_files[2:], tokenizer=str(tiny_tokenizer_dir),
                 cache_dir=str(tmp_path / "cache"), reset_attention_mask=False)
    tok, train, ev = build_data(data, vocab_size=999)
    assert isinstance(train.source, TokenShards) and train.source.directory == out.resolve()
    assert _stream(train) == _expected(corpus_files[:2], tok)
    assert _stream(ev) == _expected(corpus_files[2:], tok)
    assert set(train[0]) == {"input_ids", "labels", "position_ids"}  # masks off, positions on


def test_prepared_directory_needs_its_tokenizer(corpus_files: list[str], tiny_tokenizer: Tokenizer,
                                                tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1)
    with pytest.raises(DataError, match="data.tokenizer must be the tokenizer it was prepared with"):
        build_data(_data(train_files=[str(out)]), vocab_size=999)
    with pytest.raises(DataError, match="mix a prepared directory"):
        build_data(_data(train_files=[str(out), corpus_files[0]], tokenizer="x"), vocab_size=999)


def test_eval_fraction_too_small_is_refused(corpus_files: list[str], tiny_tokenizer_dir: Path,
                                            tmp_path: Path) -> None:
    data = _data(train_files=corpus_files, tokenizer=str(tiny_tokenizer_dir), eval_fraction=0.0001,
                 cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="eval_fraction 0.0001 holds out"):
        build_data(data, vocab_size=999)


def test_instruction_data(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    rows = [{"instruction": f"Say {w}.", "output": f"{w}!"} for w in ("yes", "no", "maybe", "never")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _data(kind="instruction", train_files=[str(path)], tokenizer=str(tiny_tokenizer_dir),
                 packing="dynamic", cache_dir=str(tmp_path), seq_length=64)
    tok, train, ev = build_data(data, vocab_size=999, micro_batch_size=2)
    assert ev is None and train.items_are_batches and train.stats["samples"] == 4
    batches = [train[i] for i in range(len(train))]
    assert all(b["input_ids"].numel() <= 2 * 64 for b in batches)  # the token budget of 2 rows
    assert sum(b["input_ids"].shape[0] for b in batches) == 4
    with pytest.raises(DataError, match="data.tokenizer is not set"):
        build_data(_data(kind="instruction", train_files=[str(path)]), vocab_size=999)
    with pytest.raises(DataError, match="data.eval_files"):
        build_data(_data(kind="instruction", train_files=[str(path)], tokenizer=str(tiny_tokenizer_dir),
                         eval_fraction=0.1), vocab_size=999)


def expected_tokens(files: list[str], tok: Tokenizer) -> list[int]:
    """The token stream of files prepared one document per file: each file's ids followed by EOS."""
    out: list[int] = []
    for f in files:
        out += tok.encode(Path(f).read_bytes().decode("utf-8", errors="replace")) + [tok.eos_id]
    return out


def test_text_dataset_seed_signature(corpus_files: list[str], tiny_tokenizer: Tokenizer) -> None:
    ds = TextDataset(
        data_files=str(Path(corpus_files[0]).parent / "doc*.txt"),
        tokenizer=tiny_tokenizer,
        max_seq_len=32,
        shuffle=False,
    )
    assert ds.shuffle is False and ds.files == corpus_files
    tokens = expected_tokens(corpus_files, tiny_tokenizer)
    assert len(ds) == (len(tokens) - 1) // 32
    assert ds[1]["input_ids"].tolist() == tokens[32:64]
    # Each file is one document: the second file starts a new document id and position 0.
    second = len(tiny_tokenizer.encode(Path(corpus_files[0]).read_text())) + 1
    sample, offset = divmod(second, 32)
    assert offset > 0  # the boundary falls inside a sample (else the test would check nothing)
    item = ds[sample]
    assert item["position_ids"][offset].item() == 0 and item["document_ids"][offset].item() >= 1
