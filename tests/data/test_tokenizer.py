"""Tokenizer: BPE training, SentencePiece models, round trips, special tokens, chat templates, files,
and interop with transformers."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import shutil
import stat
import sys
from pathlib import Path

import pytest

from shardwise.data import AutoTokenizer, Tokenizer, load_tokenizer, train_bpe_tokenizer
from shardwise.data.tokenizer import SentencePieceTokenizer, train_tokenizer
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


def test_fingerprint_of_tokenizer_json_is_unchanged(tiny_tokenizer: Tokenizer) -> None:
    # The fingerprint keys token caches and prepared shards: it must stay this formula.
    h = hashlib.sha256(tiny_tokenizer.backend.to_str().encode("utf-8"))
    h.update(b"\0<|bos|>\0<|eos|>")
    assert tiny_tokenizer.fingerprint == h.hexdigest()[:16]


def test_tokenizers_pickle(tiny_tokenizer: Tokenizer, sp_model: Path) -> None:
    for tok in (tiny_tokenizer, load_tokenizer(sp_model)):
        again = pickle.loads(pickle.dumps(tok))
        assert type(again) is type(tok)
        assert again.fingerprint == tok.fingerprint
        assert again.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)


def test_saved_files_get_usual_permissions(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    tiny_tokenizer.save(tmp_path / "t")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert stat.S_IMODE((tmp_path / "t" / name).stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in (tmp_path / "t").iterdir() if p.name.startswith(".")] == []


# --- SentencePiece ---------------------------------------------------------------------------------


def _train_sentencepiece(lines: list[str], **options: object) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, minloglevel=2, **options
    )
    return buf.getvalue()


def _corpus_lines(corpus_files: list[str]) -> list[str]:
    return [ln for f in corpus_files for ln in Path(f).read_text(encoding="utf-8").splitlines() if ln.strip()]


# LLaMA-style: BPE with byte fallback; identity normalisation so that decoding gives back the exact text.
_EXACT = dict(
    model_type="bpe", vocab_size=400, byte_fallback=True, character_coverage=1.0,
    normalization_rule_name="identity", remove_extra_whitespaces=False, pad_id=3,
)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory: pytest.TempPathFactory, corpus_files: list[str]) -> Path:
    """A SentencePiece BPE .model (bos 1, eos 2, pad 3, byte fallback) trained on `corpus_files`."""
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(_train_sentencepiece(_corpus_lines(corpus_files), **_EXACT))
    return path


@pytest.mark.parametrize("kind", ["bpe-exact", "unigram-default"])
def test_sentencepiece_ids_equal_processor(
    kind: str, sp_model: Path, corpus_files: list[str], tmp_path: Path, unseen_text: str
) -> None:
    spm = pytest.importorskip("sentencepiece")
    if kind == "bpe-exact":
        path = sp_model
    else:  # SentencePiece's defaults: unigram, NFKC, whitespace collapsing, no pad
        path = tmp_path / "uni.model"
        path.write_bytes(_train_sentencepiece(_corpus_lines(corpus_files), vocab_size=100))
    ref = spm.SentencePieceProcessor(model_file=str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    assert isinstance(tok, Tokenizer) and isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == len(tok) == ref.get_piece_size()
    texts = [*SAMPLES, unseen_text, "Hello  World  "]
    want = [ref.encode(t) for t in texts]
    assert [tok.encode(t) for t in texts] == want
    assert tok.encode_batch(texts) == want
    assert tok.encode_batch([]) == []
    assert [tok.decode(ids) for ids in want] == [ref.decode(ids) for ids in want]
    # Frequent words are single pieces, so the model really is the trained one, not a byte fallback.
    assert len(tok.encode(unseen_text)) < 0.5 * len(unseen_text)


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_round_trip_and_special_tokens(sp_model: Path, text: str) -> None:
    tok = load_tokenizer(sp_model)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    wrapped = tok.encode(text, add_bos=True, add_eos=True)
    assert wrapped == [1, *ids, 2]
    assert tok.decode(wrapped) == text
    assert tok.decode(wrapped, skip_special_tokens=False) == f"<s>{text}</s>"
    assert tok.decode([*ids, 3, *ids], skip_special_tokens=False) == f"{text}<pad>{text}"


def test_sentencepiece_token_to_id(sp_model: Path) -> None:
    tok = load_tokenizer(sp_model)
    assert tok.token_to_id("<unk>") == 0
    assert tok.token_to_id("</s>") == 2
    assert tok.token_to_id("no such piece") is None
    assert tok.token_to_id("<|pad|>") is None


def test_sentencepiece_pad_defaults_to_eos_and_missing_bos(corpus_files: list[str], tmp_path: Path) -> None:
    lines = _corpus_lines(corpus_files)
    (tmp_path / "nopad.model").write_bytes(_train_sentencepiece(lines, vocab_size=100))
    tok = load_tokenizer(tmp_path / "nopad.model")
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.pad_token == tok.eos_token == "</s>" and tok.pad_id == 2
    (tmp_path / "nobos.model").write_bytes(_train_sentencepiece(lines, vocab_size=100, bos_id=-1, eos_id=1))
    tok = load_tokenizer(tmp_path / "nobos.model")
    assert tok.bos_token is None and tok.bos_id is None and tok.eos_id == 1
    with pytest.raises(DataError, match="no bos token"):
        tok.encode("x", add_bos=True)
    (tmp_path / "noeos.model").write_bytes(_train_sentencepiece(lines, vocab_size=100, eos_id=-1))
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(tmp_path / "noeos.model")


def test_sentencepiece_special_id_outside_vocabulary_is_refused() -> None:
    class Processor:  # a model whose pad id lies beyond its pieces (a corrupt or hand-edited file)
        def get_piece_size(self) -> int:
            return 10

        def bos_id(self) -> int:
            return 1

        def eos_id(self) -> int:
            return 2

        def pad_id(self) -> int:
            return 10

    with pytest.raises(DataError, match=r"pad_id 10 .* outside its vocabulary of 10 pieces"):
        SentencePieceTokenizer(Processor(), source="tokenizer 'x.model'")


def _llama_dir(sp_model: Path, directory: Path, **config: object) -> Path:
    directory.mkdir()
    shutil.copy(sp_model, directory / "tokenizer.model")
    base = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False},
        "eos_token": "</s>",
        "pad_token": None,
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return directory


def test_sentencepiece_directory_save_and_reload(
    sp_model: Path, tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    d = _llama_dir(sp_model, tmp_path / "llama", chat_template="{{ messages[0]['content'] }}")
    tok = AutoTokenizer.from_pretrained(d)
    assert isinstance(tok, SentencePieceTokenizer)
    # The config names bos/eos and no pad; the model's own pad piece stays out of it.
    assert (tok.bos_id, tok.eos_id, tok.pad_token) == (1, 2, "</s>")
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert load_tokenizer(d / "tokenizer.model").fingerprint == tok.fingerprint
    by_file = load_tokenizer(sp_model)  # a lone .model file: the model's own pad
    assert by_file.pad_token == "<pad>" and by_file.fingerprint == tok.fingerprint
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["pad_token"]  # a config silent about pad (not null) leaves the model's own
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(d).pad_id == 3

    out = tok.save(tmp_path / "copy")
    assert sorted(p.name for p in out.iterdir()) == [
        "special_tokens_map.json", "tokenizer.model", "tokenizer_config.json"
    ]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "LlamaTokenizer" and config["add_bos_token"] is True
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<s>", "</s>", "</s>")
    assert config["chat_template"] == tok.chat_template
    again = load_tokenizer(out)
    assert isinstance(again, SentencePieceTokenizer)
    assert again.fingerprint == tok.fingerprint != tiny_tokenizer.fingerprint
    assert again.chat_template == tok.chat_template
    assert again.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)

    # Saving over a tokenizer.json directory: the stale tokenizer.json would shadow the model.
    tiny_tokenizer.save(tmp_path / "was_bpe")
    tok.save(tmp_path / "was_bpe")
    assert not (tmp_path / "was_bpe" / "tokenizer.json").exists()
    assert load_tokenizer(tmp_path / "was_bpe").fingerprint == tok.fingerprint


def test_sentencepiece_directory_config_errors(sp_model: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"pad_token '<nope>'.*not in its vocabulary"):
        load_tokenizer(_llama_dir(sp_model, tmp_path / "a", pad_token="<nope>"))
    with pytest.raises(DataError, match="pad_token_id 99999"):
        load_tokenizer(_llama_dir(sp_model, tmp_path / "b", pad_token_id=99999))
    d = _llama_dir(sp_model, tmp_path / "c")
    (d / "added_tokens.json").write_text(json.dumps({"<pad>": 400}))
    with pytest.raises(DataError, match=r"added_tokens\.json adds 1 tokens.*save_pretrained"):
        load_tokenizer(d)


def test_sentencepiece_bad_file_and_missing_package(
    sp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sentencepiece")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"bad\.model is not a valid SentencePiece model"):
        load_tokenizer(bad)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import now fails as if not installed
    with pytest.raises(DataError, match=r"pip install sentencepiece.*shardwise\[sentencepiece\]"):
        AutoTokenizer.from_pretrained(sp_model)


# --- chat template ---------------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_chat_template_load_and_save(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    assert tiny_tokenizer.chat_template is None
    tiny_tokenizer.save(tmp_path / "plain")
    assert "chat_template" not in json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())

    tiny_tokenizer.chat_template = TEMPLATE
    assert tiny_tokenizer.fingerprint == load_tokenizer(tmp_path / "plain").fingerprint
    d = tiny_tokenizer.save(tmp_path / "chat")
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert load_tokenizer(d).chat_template == TEMPLATE

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert hf.chat_template == TEMPLATE


def test_chat_template_list_form_and_jinja_file(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    d = tiny_tokenizer.save(tmp_path / "t")
    config = json.loads((d / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "{{ tools }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    tok = load_tokenizer(d)
    assert tok.chat_template == TEMPLATE
    assert tok.chat_templates == {"default": TEMPLATE, "tool_use": "{{ tools }}"}
    tok.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["chat_template"] == named

    # A chat_template.jinja file wins over the config entry, as in transformers.
    (d / "chat_template.jinja").write_text("{{ 'from file' }}", encoding="utf-8")
    tok = load_tokenizer(d)
    assert tok.chat_template == "{{ 'from file' }}"
    assert tok.chat_templates["tool_use"] == "{{ tools }}"
    # Saving keeps the file in step, and removing the template removes the file that would revive it.
    tok.chat_template = TEMPLATE
    tok.save(d)
    assert (d / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    tok.chat_template = None
    tok.save(d)
    assert not (d / "chat_template.jinja").exists()
    assert load_tokenizer(d).chat_template is None

    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 42}))
    with pytest.raises(DataError, match="chat_template .* must be a Jinja string"):
        load_tokenizer(d)


# --- training from files (`shardwise tokenizer train`) ---------------------------------------------


def test_train_tokenizer_from_txt_and_jsonl(corpus_files: list[str], tmp_path: Path) -> None:
    txt = train_tokenizer(corpus_files, 300, tmp_path / "from_txt", show_progress=False)
    # The same texts as JSON lines, under another field name: the same tokenizer, no JSON syntax learned.
    jsonl = tmp_path / "docs.jsonl"
    with open(jsonl, "w", encoding="utf-8") as fh:
        for f in corpus_files:
            for line in Path(f).read_text(encoding="utf-8").splitlines(keepends=True):
                fh.write(json.dumps({"id": 1, "content": line}) + "\n")
    tok = train_tokenizer(
        [str(tmp_path / "*.jsonl")], 300, tmp_path / "from_jsonl", text_field="content", show_progress=False
    )
    assert tok.fingerprint == txt.fingerprint
    assert tok.token_to_id("content") is None
    assert tok.encode("lizabeth") == [tok.token_to_id("lizabeth")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "from_jsonl", "from_txt"]

    with pytest.raises(DataError, match=r"docs\.jsonl:1: no 'text' field \(its fields: 'id', 'content'\)"):
        train_tokenizer([str(jsonl)], 300, tmp_path / "x", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_train_tokenizer_bad_lines_and_bad_files(corpus_files: list[str], tmp_path: Path) -> None:
    jsonl = tmp_path / "in.jsonl"
    lines = _corpus_lines(corpus_files)
    jsonl.write_text(
        "\n".join(json.dumps({"text": ln}) for ln in lines)
        + '\n{"text": "cut off\n{"text": 5}\n["a list"]\n\n',
        encoding="utf-8",
    )
    with pytest.raises(DataError, match=rf"in\.jsonl:{len(lines) + 1}: not valid JSON.*skip_bad_lines=True"):
        train_tokenizer([str(jsonl)], 280, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()  # an interrupted training leaves nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    tok = train_tokenizer([str(jsonl)], 280, tmp_path / "out", skip_bad_lines=True, show_progress=False)
    assert tok.decode(tok.encode("Elizabeth")) == "Elizabeth"

    gz = tmp_path / "data.txt"
    gz.write_bytes(gzip.compress(b"some text\n" * 10))
    with pytest.raises(DataError, match=r"data\.txt' looks like a gzip file"):
        train_bpe_tokenizer([str(gz)], 280, tmp_path / "g", show_progress=False)
    utf16 = tmp_path / "u16.txt"
    utf16.write_text("some text\n", encoding="utf-16")
    with pytest.raises(DataError, match=r"u16\.txt' looks like a binary file"):
        train_bpe_tokenizer([str(utf16)], 280, tmp_path / "g", show_progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="hold no text"):
        train_bpe_tokenizer([str(tmp_path / "empty.txt")], 280, tmp_path / "g", show_progress=False)
    with pytest.raises(DataError, match="distinct"):
        train_bpe_tokenizer(corpus_files, 280, tmp_path / "g", special_tokens=("<s>", "<s>"))
    with pytest.raises(DataError, match="matches no file"):
        train_tokenizer([str(tmp_path / "nothing*.txt")], 280, tmp_path / "g", show_progress=False)


def test_train_tokenizer_never_replaces_silently(corpus_files: list[str], tmp_path: Path) -> None:
    out = tmp_path / "tok"
    first = train_tokenizer(corpus_files, 300, out, special_tokens=("<s>", "</s>"), show_progress=False)
    assert first.pad_token == first.eos_token == "</s>"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match=r"already holds a tokenizer.*overwrite=True \(--overwrite\)"):
        train_tokenizer(corpus_files, 280, out, show_progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    second = train_tokenizer(corpus_files, 280, out, overwrite=True, show_progress=False)
    assert second.fingerprint != first.fingerprint
    assert load_tokenizer(out).fingerprint == second.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no temp or backup directory left

    # A directory with the user's other files: those stay, only the tokenizer's files are replaced.
    (out / "chat_template.jinja").write_text("stale")
    (out / "notes.txt").write_text("mine")
    third = train_tokenizer(corpus_files, 290, out, overwrite=True, show_progress=False)
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "chat_template.jinja").exists()
    assert load_tokenizer(out).fingerprint == third.fingerprint
    # An empty existing directory is simply filled.
    (tmp_path / "empty").mkdir()
    assert train_tokenizer(corpus_files, 290, tmp_path / "empty", show_progress=False).fingerprint == (
        third.fingerprint
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is a file, not a directory"):
        train_tokenizer(corpus_files, 290, tmp_path / "file", show_progress=False)


def test_reading_streams_in_bounded_batches(tmp_path: Path) -> None:
    from shardwise.data.tokenizer import _read_texts

    f = tmp_path / "big.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2500)) + "oops\n")
    batches = _read_texts([str(f)])
    # Batches arrive before the bad last line is read: nothing is loaded whole.
    first, second = next(batches), next(batches)
    assert (len(first), first[0], len(second), second[-1]) == (1000, "doc 0", 1000, "doc 1999")
    with pytest.raises(DataError, match=r"big\.jsonl:2501"):
        next(batches)


def test_training_reads_text_files_as_text_mode_lines(tmp_path: Path) -> None:
    """The shared reader gives tokenizer training the lines a text-mode file gives: CRLF and a lone CR
    end lines as "\n", blank lines count, invalid UTF-8 becomes U+FFFD."""
    from shardwise.data.tokenizer import _read_texts

    f = tmp_path / "mixed.txt"
    f.write_bytes(b"dos line\r\nold mac\rnext\n\n  indented\nbad \xff byte\nlast")
    with open(f, encoding="utf-8", errors="replace") as fh:
        want = fh.readlines()
    assert [t for batch in _read_texts([str(f)]) for t in batch] == want
    assert want[:2] == ["dos line\n", "old mac\n"] and want[-1] == "last"
