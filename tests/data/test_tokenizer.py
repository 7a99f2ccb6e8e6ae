"""Tokenizer: BPE training, round trips, special tokens, files, and interop with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.data import AutoTokenizer, Tokenizer, load_tokenizer, train_bpe_tokenizer
from shardwise.errors import DataError

SAMPLES = [
    "Elizabeth walked to the house.",
    "  leading spaces, tabs\tand\n\nblank lines\n",
    "Café naïve — “curly quotes” and ünïcödé, 数字 123, emoji 🙂",
    "",
]


def test_trained_tokenizer_files_and_special_ids(tiny_tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tiny_tokenizer_dir / name).is_file()
    tok = load_tokenizer(tiny_tokenizer_dir)
    # 256 byte symbols + 3 special tokens, then merges up to the requested 300.
    assert 259 < tok.vocab_size <= 300
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert len(tok) == tok.vocab_size
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|eos|>" and config["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_round_trip(tiny_tokenizer: Tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    assert all(0 <= i < tiny_tokenizer.vocab_size for i in ids)
    assert tiny_tokenizer.decode(ids) == text
    wrapped = tiny_tokenizer.encode(text, add_bos=True, add_eos=True)
    assert wrapped == [tiny_tokenizer.bos_id, *ids, tiny_tokenizer.eos_id]
    assert tiny_tokenizer.decode(wrapped) == text
    assert tiny_tokenizer.decode(wrapped, skip_special_tokens=False) == f"<|bos|>{text}<|eos|>"


def test_bpe_merges_frequent_words(tiny_tokenizer: Tokenizer, unseen_text: str) -> None:
    # Text like the training text compresses well below one token per byte ...
    text = unseen_text
    assert len(tiny_tokenizer.encode(text)) < 0.7 * len(text.encode("utf-8"))
    # ... a frequent long word became one token, and unseen letters stay one byte symbol each.
    assert tiny_tokenizer.encode("lizabeth") == [tiny_tokenizer.token_to_id("lizabeth")]
    assert len(tiny_tokenizer.encode("xqzj")) == 4


def test_encode_batch_matches_encode(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.encode_batch(SAMPLES) == [tiny_tokenizer.encode(t) for t in SAMPLES]


def test_save_load_round_trip_and_fingerprint(
    tiny_tokenizer: Tokenizer, tmp_path: Path, corpus_files: list[str]
) -> None:
    tiny_tokenizer.save(tmp_path / "copy")
    again = load_tokenizer(tmp_path / "copy")
    assert again.fingerprint == tiny_tokenizer.fingerprint
    assert len(again.fingerprint) == 16
    assert [again.encode(t) for t in SAMPLES] == [tiny_tokenizer.encode(t) for t in SAMPLES]
    other = train_bpe_tokenizer(corpus_files, 280, tmp_path / "other", show_progress=False)
    assert other.fingerprint != tiny_tokenizer.fingerprint


def test_transformers_loads_saved_tokenizer(tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    for hf in (
        transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)),
        transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_tokenizer_dir)),
    ):
        assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
        assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
        for text in SAMPLES:
            ids = tiny_tokenizer.encode(text)
            assert hf.encode(text, add_special_tokens=False) == ids
            assert hf.decode(ids) == text


def test_loads_directory_saved_by_transformers(
    tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_tokenizer_dir / "tokenizer.json"), eos_token="<|eos|>", bos_token="<|bos|>"
    )
    hf.save_pretrained(str(tmp_path / "hf"))
    tok = load_tokenizer(tmp_path / "hf")
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.encode(SAMPLES[2]) == tiny_tokenizer.encode(SAMPLES[2])


def test_pad_defaults_to_eos_and_seed_assignment(
    corpus_files: list[str], tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    tok = train_bpe_tokenizer(
        corpus_files, 270, tmp_path, special_tokens=("<s>", "</s>"), show_progress=False
    )
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "</s>")
    assert tok.pad_id == tok.eos_id == 1
    # The seed documents' line: tokenizer.pad_token = tokenizer.eos_token
    tiny_tokenizer.pad_token = tiny_tokenizer.eos_token
    assert tiny_tokenizer.pad_id == tiny_tokenizer.eos_id == 1
    assert tiny_tokenizer.pad_token_id == 1


def test_pad_token_not_in_vocabulary_is_refused(
    tiny_tokenizer: Tokenizer, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(DataError, match="<nope>"):
        tiny_tokenizer.pad_token = "<nope>"
    assert tiny_tokenizer.pad_token == "<|pad|>"  # unchanged after the refused assignment

    bad = tmp_path / "bad"
    tiny_tokenizer.save(bad)
    config = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<nope>"}))
    with pytest.raises(DataError, match=r"pad_token '<nope>'.*not in its vocabulary"):
        load_tokenizer(bad)

    (bad / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token_id": 99999}))
    with pytest.raises(DataError, match="pad_token_id 99999"):
        load_tokenizer(bad)


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="nowhere.*does not exist"):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no tokenizer\.json in tokenizer directory .*empty"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid"):
        load_tokenizer(tmp_path / "broken")


def test_auto_tokenizer(tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert isinstance(tok, Tokenizer)
    assert tok.fingerprint == tiny_tokenizer.fingerprint
    with pytest.raises(DataError) as err:
        AutoTokenizer.from_pretrained("llama_7b")
    msg = str(err.value)
    assert "'llama_7b'" in msg and "tokenizer.json" in msg
    assert "data.tokenizer: null" in msg and "Hugging Face tokenizer.json" in msg
    assert "shardwise tokenizer" not in msg  # no such command


def test_training_survives_invalid_utf8_and_checks_arguments(tmp_path: Path) -> None:
    f = tmp_path / "bad.txt"
    f.write_bytes(b"good text here \xff\xfe and more good text\n" * 20)
    tok = train_bpe_tokenizer([str(f)], 270, tmp_path / "tok", show_progress=False)
    assert tok.decode(tok.encode("good text")) == "good text"
    with pytest.raises(DataError, match="at least 259"):
        train_bpe_tokenizer([str(f)], 100, tmp_path / "small", show_progress=False)
    with pytest.raises(DataError, match="missing.txt"):
        train_bpe_tokenizer([str(tmp_path / "missing.txt")], 300, tmp_path / "x", show_progress=False)
