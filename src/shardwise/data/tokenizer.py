"""Tokenizers: Hugging Face `tokenizers` or SentencePiece behind one class, byte-level BPE training, loading.

A tokenizer directory is the Hugging Face layout (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`, optionally `chat_template.jinja`), so what shardwise trains opens in
`transformers` and what `transformers` saves opens here. A SentencePiece model (a `.model` file, or a
directory holding `tokenizer.model` and no `tokenizer.json`, as LLaMA-1/2 ship) is run by the optional
`sentencepiece` package itself rather than converted to `tokenizers`: a conversion reproduces
SentencePiece only for some normaliser and model settings, while the model itself gives exactly its
own ids for all of them.

Special tokens are explicit: bos and eos are found in the configs (or by their usual names, or, for
SentencePiece, the model's own bos/eos/pad ids), pad falls back to eos, and a special token that is
not in the vocabulary is refused, because a pad id outside the embedding table silently corrupts
training (seed 003, 4.2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from ..errors import DataError
from ..files import publish_dir, write_bytes_atomic, write_text_atomic
from ..untrusted import MAX_SIDE_FILE, decode_text, fail, kind_of, read_bytes, read_json_object, read_text
from .files import InputFile, expand_files
from .sources import TXT_LINES, BadLineWording, ReadStats, read_documents

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
# Files that make a directory a tokenizer directory (what `train_tokenizer` refuses to replace).
TOKENIZER_FILES = (TOKENIZER_FILE, SENTENCEPIECE_FILE, CONFIG_FILE, SPECIAL_MAP_FILE, CHAT_TEMPLATE_FILE)

# Usual names, tried in order when a tokenizer directory does not say which token plays which role.
_GUESSES = {
    "bos": ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[BOS]"),
    "eos": ("<|eos|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[EOS]"),
    "pad": ("<|pad|>", "<pad>", "[PAD]"),
}

_HOW_TO_MAKE_ONE = (
    "set `data.tokenizer: null` in the config to train a byte-level BPE tokenizer on the training files, "
    f"or pass a directory holding a Hugging Face {TOKENIZER_FILE} (or a SentencePiece .model file)"
)

_INSTALL_SENTENCEPIECE = "pip install sentencepiece (or pip install shardwise[sentencepiece])"

# Bounds on what a tokenizer directory holds, all far above real ones: a model file (Gemma's 262k-token
# tokenizer.json is 33 MB), a chat template (a few KB), a special token, the largest token id.
MAX_MODEL_FILE = 512 << 20
MAX_CHAT_TEMPLATE = 1 << 20
MAX_TOKEN_CHARS = 1024
MAX_VOCAB = 1 << 24
_FIX_FILE = "fix or delete the file"


def backend_call(source: str, what: str, fn: Any, *args: Any, panics_only: bool = False, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, a call into a tokenizer library: any failure it raises (with `panics_only`,
    only a panic: other errors are the caller's, such as a negative id to decode) becomes a DataError
    naming the tokenizer. The Rust `tokenizers` library panics on some inputs (a pre-tokenizer regex that
    backtracks past Oniguruma's retry limit), which Python sees as pyo3_runtime.PanicException, a
    BaseException; SentencePiece raises RuntimeError or OSError."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError, DataError):
        raise
    except BaseException as e:  # noqa: BLE001 - PanicException derives from BaseException
        if panics_only and isinstance(e, Exception):
            raise
        text = " ".join(str(e).split())[:300] or type(e).__name__
        raise DataError(
            f"{source}: the tokenizer library failed {what} ({type(e).__name__}: {text}); the tokenizer's files "
            f"are damaged or hold a setting the library cannot run (such as a pre-tokenizer regex that "
            f"backtracks without end): fix the tokenizer, or use another one"
        ) from None


class Tokenizer:
    """Text to token ids and back, with explicit bos/eos/pad tokens and the Hugging Face directory layout.

    `backend` is the library object that does the work: a `tokenizers.Tokenizer` here, a
    `sentencepiece.SentencePieceProcessor` in `SentencePieceTokenizer`. Code outside this module uses
    the methods, which behave the same for both.
    """

    # Whether unnamed special tokens are looked up by their usual names (SentencePiece models name theirs).
    _guess_special_tokens = True

    def __init__(
        self,
        backend: Any,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        source: str = "tokenizer",
        chat_template: str | Sequence[Mapping[str, str]] | Mapping[str, str] | None = None,
    ) -> None:
        """Wrap `backend`; unnamed special tokens are looked up by their usual names."""
        self.backend = backend
        self._source = source
        # Embedding rows must cover the largest id, which can exceed the token count when ids have gaps.
        self._vocab_size = self._count_vocab()
        self._bos = self._resolve("bos", bos_token)
        self._eos = self._resolve("eos", eos_token)
        self._pad = self._resolve("pad", pad_token)
        if self._eos is None:
            raise DataError(
                f"{source} has no end-of-text token: pretraining separates documents with eos. "
                f"Set eos_token in {CONFIG_FILE} to a token of the vocabulary (usual names: "
                f"{', '.join(_GUESSES['eos'])}), or {_HOW_TO_MAKE_ONE}"
            )
        self._chat_templates = _chat_templates(chat_template, source)
        self._fingerprint: str | None = None

    def _count_vocab(self) -> int:
        vocab = backend_call(self._source, "listing its vocabulary", self.backend.get_vocab, with_added_tokens=True)
        return _checked_vocab_size(max(vocab.values()) + 1 if vocab else 0, self._source)

    def _resolve(self, role: str, token: str | None) -> str | None:
        if token is not None:
            self._check_in_vocab(role, token)
            return token
        if not self._guess_special_tokens:
            return None
        return next((t for t in _GUESSES[role] if self.token_to_id(t) is not None), None)

    def _check_in_vocab(self, role: str, token: str) -> int:
        tid = self.token_to_id(token)
        if tid is None or not 0 <= tid < self._vocab_size:
            eos = getattr(self, "_eos", None)
            fix = (
                f"use its eos token {eos!r} or another token it has"
                if role == "pad" and eos
                else "use a token it has"
            )
            raise DataError(
                f"{role}_token {token!r} of {self._source} is not in its vocabulary of "
                f"{self._vocab_size} tokens, and a special token outside the vocabulary corrupts "
                f"training; {fix}"
            )
        return tid

    # --- encoding -------------------------------------------------------------------------------

    def _encode_plain(self, text: str) -> list[int]:
        return backend_call(self._source, "encoding text", self.backend.encode, text, add_special_tokens=False).ids

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in bos/eos."""
        ids = self._encode_plain(text)
        if add_bos:
            ids.insert(0, self._required_bos_id())
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust library."""
        # encode_batch_fast skips offset tracking (newer tokenizers releases only).
        fast = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        encoded = backend_call(self._source, "encoding text", fast, list(texts), add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of a sequence of token ids."""
        return backend_call(self._source, "decoding ids", self.backend.decode, [int(i) for i in ids],
                            panics_only=True, skip_special_tokens=skip_special_tokens)

    @property
    def source(self) -> str:
        """The tokenizer as messages name it ("tokenizer '/path/to/dir'")."""
        return self._source

    def __len__(self) -> int:
        """Vocabulary size (as `len()` of a Hugging Face tokenizer)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        """Id of `token`, or None when it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    # --- special tokens -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of embedding rows the vocabulary needs (largest id + 1)."""
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        """Beginning-of-sequence token, or None when the tokenizer has none."""
        return self._bos

    @property
    def eos_token(self) -> str:
        """End-of-sequence token; it also separates packed documents."""
        return self._eos  # type: ignore[return-value]

    @property
    def pad_token(self) -> str:
        """Padding token; the eos token when none was set."""
        return self._pad if self._pad is not None else self.eos_token

    @pad_token.setter
    def pad_token(self, token: str | None) -> None:
        """Set the padding token (None: fall back to eos); it must be in the vocabulary."""
        if token is not None:
            self._check_in_vocab("pad", token)
        self._pad = token

    @property
    def bos_id(self) -> int | None:
        """Id of the bos token, or None."""
        return None if self._bos is None else self.token_to_id(self._bos)

    @property
    def eos_id(self) -> int:
        """Id of the eos token."""
        return self.token_to_id(self.eos_token)  # type: ignore[return-value]

    @property
    def pad_id(self) -> int:
        """Id of the padding token (the eos id when no pad token was set)."""
        return self.token_to_id(self.pad_token)  # type: ignore[return-value]

    # Hugging Face spellings, so code written for `transformers` tokenizers keeps working.
    bos_token_id = bos_id
    eos_token_id = eos_id
    pad_token_id = pad_id

    def _required_bos_id(self) -> int:
        if self.bos_id is None:
            raise DataError(
                f"{self._source} has no bos token but add_bos=True was asked; set bos_token in "
                f"{CONFIG_FILE} or encode without add_bos"
            )
        return self.bos_id

    # --- chat template --------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template (tokenizer_config.json or chat_template.jinja), or None when absent."""
        return self._chat_templates.get("default")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        """Set (or with None remove) the chat template that `save()` writes."""
        if template is None:
            self._chat_templates.pop("default", None)
        elif isinstance(template, str):
            self._chat_templates["default"] = template
        else:
            raise TypeError(f"a chat template is a Jinja string, got {type(template).__name__}")

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every named chat template (tokenizer_config.json's list form); "default" is `chat_template`."""
        return dict(self._chat_templates)

    # --- identity and files ---------------------------------------------------------------------

    def _content_hash(self) -> Any:
        return hashlib.sha256(self.backend.to_str().encode("utf-8"))

    @property
    def fingerprint(self) -> str:
        """Short sha256 of the model file content and the bos/eos choice (keys token caches)."""
        if self._fingerprint is None:
            h = self._content_hash()
            # pad (and the chat template) are left out: they never appear in packed pretraining tokens,
            # so changing them keeps caches.
            h.update(f"\0{self._bos}\0{self._eos}".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def _write_model(self, out: Path) -> None:
        write_text_atomic(out / TOKENIZER_FILE, self.backend.to_str(pretty=True))

    def _base_config(self) -> dict[str, Any]:
        return {"tokenizer_class": "PreTrainedTokenizerFast"}

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the model file, tokenizer_config.json (with chat template) and special_tokens_map.json."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        specials = {k: v for k, v in specials.items() if v is not None}
        config = {**self._base_config(), **specials}
        config.setdefault("clean_up_tokenization_spaces", False)
        templates = self._chat_templates
        if list(templates) == ["default"]:
            config["chat_template"] = templates["default"]
        elif templates:
            config["chat_template"] = [{"name": n, "template": t} for n, t in templates.items()]
        self._write_model(out)
        write_text_atomic(out / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        write_text_atomic(out / SPECIAL_MAP_FILE, json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
        # A chat_template.jinja overrides the config's template when loading (here and in transformers),
        # so one left in the directory must say the same or go.
        jinja = out / CHAT_TEMPLATE_FILE
        if jinja.exists():
            if self.chat_template is None:
                jinja.unlink()
            else:
                write_text_atomic(jinja, self.chat_template)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, pad={self.pad_token!r}, fingerprint={self.fingerprint})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (LLaMA-1/2 `tokenizer.model`) behind the Tokenizer methods, exact ids."""

    _guess_special_tokens = False

    def __init__(
        self,
        processor: Any,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        source: str = "tokenizer",
        chat_template: str | Sequence[Mapping[str, str]] | Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
        without: Collection[str] = (),
    ) -> None:
        """Wrap a `SentencePieceProcessor`; unnamed special tokens are the model's bos/eos/pad ids (-1: none).

        `without` names roles ("bos", "pad") a config explicitly left empty (null), which overrides the
        model's id, as in transformers. `config` holds the other keys of the tokenizer_config.json it
        came with, written back by `save()`.
        """
        self.backend = processor
        self._source = source
        size = processor.get_piece_size()
        model_ids = {"bos": processor.bos_id(), "eos": processor.eos_id(), "pad": processor.pad_id()}
        for role, tid in model_ids.items():
            if tid >= size:
                raise DataError(
                    f"{role}_id {tid} of {source} is outside its vocabulary of {size} pieces, and a "
                    f"special token outside the vocabulary corrupts training; retrain the SentencePiece "
                    f"model with {role}_id below {size} (or -1 for none)"
                )
        named = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
        tokens = {
            role: named[role]
            if named[role] is not None or role in without
            else (processor.id_to_piece(tid) if tid >= 0 else None)
            for role, tid in model_ids.items()
        }
        drop = {"chat_template"} | {f"{r}_token{s}" for r in ("bos", "eos", "pad") for s in ("", "_id")}
        self._config = {k: v for k, v in (config or {}).items() if k not in drop}
        super().__init__(
            processor, tokens["bos"], tokens["eos"], tokens["pad"], source=source, chat_template=chat_template
        )

    def _count_vocab(self) -> int:
        return _checked_vocab_size(self.backend.get_piece_size(), self._source)

    def _encode_plain(self, text: str) -> list[int]:
        # Explicit add_bos/add_eos=False: a processor can be configured to add them by default.
        return backend_call(self._source, "encoding text", self.backend.encode, text, out_type=int, add_bos=False,
                            add_eos=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the C++ library."""
        if not texts:
            return []
        return backend_call(self._source, "encoding text", self.backend.encode, list(texts), out_type=int,
                            add_bos=False, add_eos=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of a sequence of token ids (control tokens such as bos/eos shown as text unless skipped)."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self.backend.decode(ids)
        # SentencePiece always drops control pieces, so they are spliced in between decoded runs.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if self.backend.is_control(i):
                if run:
                    parts.append(self.backend.decode(run))
                    run = []
                parts.append(self.backend.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(self.backend.decode(run))
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        """Id of the piece `token`, or None when it is not in the vocabulary."""
        tid = self.backend.piece_to_id(token)
        # piece_to_id answers the unknown-piece id for anything it does not know.
        if tid == self.backend.unk_id() and token != self.backend.id_to_piece(tid):
            return None
        return tid

    def _content_hash(self) -> Any:
        return hashlib.sha256(b"sentencepiece\0" + self.backend.serialized_model_proto())

    def _write_model(self, out: Path) -> None:
        stale = out / TOKENIZER_FILE
        if stale.exists():
            # It would be loaded instead of the tokenizer.model being saved.
            logger.warning("removing %s: it would shadow the SentencePiece model saved there", stale)
            stale.unlink()
        write_bytes_atomic(out / SENTENCEPIECE_FILE, self.backend.serialized_model_proto())

    def _base_config(self) -> dict[str, Any]:
        # The source config's other keys (tokenizer_class, add_bos_token, ...) describe this model for
        # transformers; a class is not invented when there was none, since none fits every model.
        return dict(self._config)


def _checked_vocab_size(size: int, source: str) -> int:
    if size > MAX_VOCAB:
        raise DataError(
            f"{source} has token ids up to {size - 1:,}, but vocabularies stay below {MAX_VOCAB:,} (the largest "
            f"real ones hold about 260,000), and every id is a row of the embedding table; the tokenizer is "
            f"damaged: fix it, or use another one"
        )
    return size


def _chat_templates(value: Any, source: str) -> dict[str, str]:
    """Named chat templates from a config value: a string (default), a list of {name, template}, a dict."""
    if value is None:
        return {}
    if isinstance(value, str):
        templates = {"default": value}
    elif isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        templates = dict(value)
    elif isinstance(value, Sequence) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in value
    ):
        templates = {t["name"]: t["template"] for t in value}
    else:
        raise DataError(
            f"chat_template of {source} must be a Jinja string or a list of "
            f'{{"name": ..., "template": ...}} entries, got {kind_of(value)}; fix or remove it'
        )
    for name, template in templates.items():
        if len(template) > MAX_CHAT_TEMPLATE or len(name) > MAX_TOKEN_CHARS:
            raise DataError(
                f"chat template {name[:40]!r} of {source} is {len(template):,} characters long, more than the "
                f"{MAX_CHAT_TEMPLATE:,} a chat template can be (real ones have a few thousand); fix or remove it"
            )
    return templates


def _token_content(value: Any) -> str | None:
    """A special token as configs store it: a string, or an AddedToken dict with `content` (checked by
    `_read_config`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


_ROLES = ("bos", "eos", "pad")


def _read_config(path: Path) -> dict[str, Any]:
    """A tokenizer side file (tokenizer_config.json, special_tokens_map.json): a JSON object read within
    bounds, with each field shardwise uses checked for its type; {} when there is no such file."""
    if not os.path.lexists(path):
        return {}
    doc = read_json_object(path, DataError, limit=MAX_SIDE_FILE, advice=_FIX_FILE)
    for role in _ROLES:
        key = f"{role}_token"
        value = doc.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(content, str):
            what = f"{{'content': {kind_of(content)}}}" if isinstance(value, dict) else kind_of(value)
            fail(DataError, path, f"{key!r} is {what}, not a token (a string, or {{\"content\": \"...\"}})",
                 _FIX_FILE)
        if isinstance(content, str) and len(content) > MAX_TOKEN_CHARS:
            fail(DataError, path, f"{key!r} is {len(content):,} characters long, not a token", _FIX_FILE)
        tid = doc.get(f"{role}_token_id")
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int)):
            fail(DataError, path, f"'{role}_token_id' is {kind_of(tid)}, not a token id", _FIX_FILE)
    limit = doc.get("model_max_length")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
        fail(DataError, path, f"'model_max_length' is {kind_of(limit)}, not a number", _FIX_FILE)
    if "chat_template" in doc:
        _chat_templates(doc["chat_template"], str(path))
    return doc


def _read_added_tokens(path: Path) -> dict[str, Any]:
    """added_tokens.json: {token: id}, checked; {} when absent."""
    doc = _read_config(path)
    for token, tid in doc.items():
        if isinstance(tid, bool) or not isinstance(tid, int):
            fail(DataError, path, f"token {token[:40]!r} has {kind_of(tid)}, not an id", _FIX_FILE)
    return doc


def _read_chat_template(d: Path, config: Mapping[str, Any], source: str) -> dict[str, str]:
    """The directory's chat templates; a chat_template.jinja file wins over the config, as in transformers."""
    templates = _chat_templates(config.get("chat_template"), f"{source} ({CONFIG_FILE})")
    jinja = d / CHAT_TEMPLATE_FILE
    if os.path.lexists(jinja):
        templates["default"] = read_text(jinja, DataError, limit=MAX_CHAT_TEMPLATE, advice=_FIX_FILE)
    if templates and "default" not in templates:
        logger.warning(
            "%s has chat templates %s but none named 'default'; chat_template is None",
            source,
            sorted(templates),
        )
    return templates


def _check_token_ids(tok: Tokenizer, config: Mapping[str, Any], where: Path) -> None:
    """Refuse `*_token_id` entries of a config that point outside the vocabulary."""
    for role in _ROLES:
        want = config.get(f"{role}_token_id")
        if isinstance(want, int) and not isinstance(want, bool) and not 0 <= want < tok.vocab_size:
            raise DataError(
                f"{role}_token_id {want} in {where} is outside the vocabulary of "
                f"{tok.vocab_size} tokens; remove it or use an id below {tok.vocab_size}"
            )


def _load_hf(d: Path) -> Tokenizer:
    """A Hugging Face tokenizer directory holding tokenizer.json."""
    path = d / TOKENIZER_FILE
    text = decode_text(read_bytes(path, DataError, limit=MAX_MODEL_FILE, advice=_FIX_FILE), path, DataError,
                       _FIX_FILE)
    try:
        backend = _HFTokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # noqa: BLE001 - plain Exception for malformed files; a Rust panic is a BaseException
        problem = " ".join(str(e).split())[:300] or type(e).__name__
        raise DataError(f"{path} is not a valid Hugging Face tokenizer file: {problem}; {_FIX_FILE}") from None
    del text
    config = {**_read_config(d / SPECIAL_MAP_FILE), **_read_config(d / CONFIG_FILE)}
    tokens = {role: _token_content(config.get(f"{role}_token")) for role in ("bos", "eos", "pad")}
    source = f"tokenizer {str(d)!r}"
    tok = Tokenizer(
        backend,
        **{f"{r}_token": t for r, t in tokens.items()},
        source=source,
        chat_template=_read_chat_template(d, config, source),
    )
    _check_token_ids(tok, config, d / CONFIG_FILE)
    return tok


def _import_sentencepiece(what: Path) -> Any:
    """The optional sentencepiece module, or a DataError saying how to install it."""
    try:
        import sentencepiece
    except ImportError as e:
        raise DataError(
            f"{what} is a SentencePiece model, and reading it needs the sentencepiece package: "
            f"{_INSTALL_SENTENCEPIECE}"
        ) from e
    return sentencepiece


def _load_sentencepiece(model_file: Path, config_dir: Path | None) -> SentencePieceTokenizer:
    """A SentencePiece model file, with the configs of `config_dir` (its Hugging Face directory) if given."""
    spm = _import_sentencepiece(model_file)
    data = read_bytes(model_file, DataError, limit=MAX_MODEL_FILE, advice=_FIX_FILE)
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # noqa: BLE001 - the C++ library raises RuntimeError/OSError variously
        raise DataError(
            f"{model_file} is not a valid SentencePiece model ({e}); pass the .model file written by "
            f"SentencePieceTrainer, or a directory holding a Hugging Face {TOKENIZER_FILE}"
        ) from e
    source = f"tokenizer {str(model_file)!r}"
    config: dict[str, Any] = {}
    own_config: dict[str, Any] = {}
    templates: dict[str, str] = {}
    if config_dir is not None:
        added = _read_added_tokens(config_dir / "added_tokens.json")
        if added:
            # Those ids lie beyond the model's pieces and SentencePiece never produces them, so text holding
            # such tokens would be tokenised differently from the model's training.
            raise DataError(
                f"{config_dir / 'added_tokens.json'} adds {len(added)} tokens to the SentencePiece model, "
                f"which shardwise does not support; convert the directory to a {TOKENIZER_FILE} with "
                f"transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(new_dir)) and use that"
            )
        own_config = _read_config(config_dir / CONFIG_FILE)
        config = {**_read_config(config_dir / SPECIAL_MAP_FILE), **own_config}
        templates = _read_chat_template(config_dir, config, source)
    tokens = {role: _token_content(config.get(f"{role}_token")) for role in ("bos", "eos", "pad")}
    tok = SentencePieceTokenizer(
        processor,
        **{f"{r}_token": t for r, t in tokens.items()},
        source=source,
        chat_template=templates,
        config=own_config,
        without=[r for r in ("bos", "eos", "pad") if f"{r}_token" in config and config[f"{r}_token"] is None],
    )
    if config_dir is not None:
        _check_token_ids(tok, config, config_dir / CONFIG_FILE)
    return tok


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a Hugging Face tokenizer.json directory, a SentencePiece .model file, or a directory holding
    tokenizer.model and no tokenizer.json (LLaMA-1/2 style)."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.name == TOKENIZER_FILE:
            return load_tokenizer(p.parent)
        # A tokenizer.model keeps the configs beside it; a differently named .model stands alone.
        tok: Tokenizer = _load_sentencepiece(p, p.parent if p.name == SENTENCEPIECE_FILE else None)
    elif not p.is_dir():
        raise DataError(f"tokenizer {str(p)!r} does not exist; {_HOW_TO_MAKE_ONE}")
    elif (p / TOKENIZER_FILE).is_file():
        tok = _load_hf(p)
    elif (p / SENTENCEPIECE_FILE).is_file():
        tok = _load_sentencepiece(p / SENTENCEPIECE_FILE, p)
    else:
        raise DataError(
            f"no {TOKENIZER_FILE} in tokenizer directory {str(p)!r} (nor a SentencePiece "
            f"{SENTENCEPIECE_FILE}); save one there with transformers' `tokenizer.save_pretrained(dir)`, "
            f"or {_HOW_TO_MAKE_ONE}"
        )
    logger.debug("loaded %r from %s", tok, p)
    return tok


# --- training ------------------------------------------------------------------------------------

# Texts handed to the trainer at a time: bounded in count and characters, so that memory stays flat.
_BATCH_TEXTS = 1000
_BATCH_CHARS = 1 << 20
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Leading bytes of compressed or columnar files, which are not text however they are named.
_BINARY_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bzip2"),
    (b"PK\x03\x04", "zip"),
    (b"PAR1", "parquet"),
)


def _check_text_file(path: str) -> None:
    """Refuse a file that is missing or binary (compressed, parquet, UTF-16), naming it."""
    if not os.path.isfile(path):
        raise DataError(f"tokenizer training file {path!r} does not exist; check the input paths")
    try:
        with open(path, "rb") as fh:
            head = fh.read(8192)
    except OSError as e:
        raise DataError(f"tokenizer training file {path!r} cannot be read ({e.strerror or e}); check its "
                        f"permissions") from None
    kind = next((name for magic, name in _BINARY_MAGIC if head.startswith(magic)), None)
    if kind == "bzip2" and not head[3:4].isdigit():
        kind = None  # plain text that happens to start with "BZh"
    if kind is None and b"\0" in head:
        kind = "binary"
    if kind is not None:
        raise DataError(
            f"tokenizer training file {path!r} looks like a {kind} file, not text; tokenizer training "
            f"reads UTF-8 text files (.txt) and JSON lines (.jsonl): decompress or convert it first"
        )


# Bad lines as `shardwise tokenizer train` has always worded them (prepare words them its own way).
_TRAINING_WORDING = BadLineWording(
    # This runs for `shardwise tokenizer train` and for a run's own tokenizer.
    fix="fix the line, or skip such lines with skip_bad_lines=True (--skip-bad-lines; in a run's config: "
    "data.on_bad_line: skip)",
    no_field="no {field!r} field (its fields: {fields}); name the text field with text_field (--text-field)",
    not_a_string="field {field!r} is a {type}, not a string",
    fields_shown=8,
    show_line=False,
    more_skipped=None,
)


def _training_input(path: str) -> InputFile:
    """A checked training file as the reader takes it: JSON lines by name, any other name text lines."""
    fmt = "jsonl" if path.lower().endswith(_JSONL_SUFFIXES) else "txt"
    # An empty file is read as holding nothing; the "hold no text" error covers inputs that are all empty.
    return InputFile(path, fmt, gzip=False, bytes=os.path.getsize(path), empty=False)


def _read_texts(
    files: Sequence[str],
    text_field: str = "text",
    skip_bad_lines: bool = False,
    stats: dict[str, int] | None = None,
) -> Iterator[list[str]]:
    """Stream texts in small batches: lines of text files, the `text_field` of .jsonl lines.

    Invalid UTF-8 becomes U+FFFD instead of failing. A bad .jsonl line (not JSON, no text field) stops
    with a DataError naming file and line, or is skipped and counted with `skip_bad_lines`.
    """
    stats = stats if stats is not None else {}
    for key in ("texts", "chars", "bad_lines"):
        stats.setdefault(key, 0)
    read = ReadStats()
    texts = read_documents(
        [_training_input(f) for f in files], text_field=text_field, txt_documents=TXT_LINES,
        on_bad_line="skip" if skip_bad_lines else "stop", stats=read, wording=_TRAINING_WORDING,
    )
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        stats["texts"] += 1
        stats["chars"] += len(text)
        if len(batch) >= _BATCH_TEXTS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    stats["bad_lines"] += read.bad_lines
    if batch:
        yield batch


def train_bpe_tokenizer(
    files: Sequence[str],
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    min_frequency: int = 2,
    show_progress: bool = True,
    text_field: str = "text",
    skip_bad_lines: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on text (.txt) or JSON-lines (.jsonl) files and save it to `out_dir`.

    `special_tokens` are (bos, eos[, pad]) in that order and get ids 0, 1, 2. Files are streamed.
    """
    special_tokens = tuple(special_tokens)
    if len(special_tokens) not in (2, 3):
        raise DataError(f"special_tokens must be (bos, eos) or (bos, eos, pad), got {special_tokens}")
    if len(set(special_tokens)) != len(special_tokens) or not all(special_tokens):
        raise DataError(f"special_tokens must be distinct non-empty strings, got {special_tokens}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(alphabet) + len(special_tokens)
    if vocab_size < smallest:
        raise DataError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE tokenizer: the 256 byte symbols "
            f"and {len(special_tokens)} special tokens alone need {smallest}; use at least {smallest}"
        )
    if not files:
        raise DataError("no files to train the tokenizer on; set data.train_files")
    for f in files:
        _check_text_file(f)
    backend = _HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    logger.info("training a byte-level BPE tokenizer (vocab %d) on %d files", vocab_size, len(files))
    stats: dict[str, int] = {}
    # Reading in Python (not trainer.train(files)) so that invalid UTF-8 is replaced, not fatal, and
    # .jsonl lines give their text field.
    backend.train_from_iterator(_read_texts(files, text_field, skip_bad_lines, stats), trainer=trainer)
    if not stats["chars"]:
        raise DataError(
            f"the {len(files)} tokenizer training files hold no text"
            + (f" (the .jsonl files have no non-empty {text_field!r} field)" if stats["texts"] else "")
            + "; check the input paths"
        )
    if stats["bad_lines"]:
        logger.warning("skipped %d bad .jsonl lines while training the tokenizer", stats["bad_lines"])
    pad = special_tokens[2] if len(special_tokens) == 3 else None
    tok = Tokenizer(backend, special_tokens[0], special_tokens[1], pad, source=f"tokenizer {str(out_dir)!r}")
    tok.save(out_dir)
    logger.info("saved %r to %s (%d texts, %d characters)", tok, out_dir, stats["texts"], stats["chars"])
    return tok


def train_tokenizer(
    inputs: Sequence[str] | str,
    vocab_size: int,
    out: str | os.PathLike[str],
    *,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    text_field: str = "text",
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Tokenizer:
    """`shardwise tokenizer train`: a byte-level BPE tokenizer from files or globs, saved atomically to `out`.

    An `out` that already holds tokenizer files is refused unless `overwrite`; the tokenizer is trained
    into a temporary directory beside `out` and renamed into place, so an interrupted run leaves `out`
    as it was.
    """
    # Resolved, so that "." or a symlink still has a parent to hold the temporary directory.
    out = Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise DataError(f"tokenizer output {str(out)!r} is a file, not a directory; choose a directory")
    held = [n for n in TOKENIZER_FILES if (out / n).exists()]
    if held and not overwrite:
        raise DataError(
            f"{str(out)!r} already holds a tokenizer ({', '.join(held)}); choose another output "
            f"directory, or replace it with overwrite=True (--overwrite)"
        )
    files = expand_files(inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (not mkdtemp's 0o700) so the directory that becomes `out` gets the usual permissions.
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    os.mkdir(tmp)
    try:
        train_bpe_tokenizer(
            files, vocab_size, tmp, special_tokens=special_tokens, min_frequency=min_frequency,
            show_progress=show_progress, text_field=text_field, skip_bad_lines=skip_bad_lines,
        )
        _install_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(out)


def _install_directory(new: Path, out: Path) -> None:
    """Move the finished tokenizer directory `new` to `out`, replacing only tokenizer files there."""
    entries = list(out.iterdir()) if out.exists() else []
    # Renaming the working directory away would leave this process (and the user's shell) in a
    # deleted one, so that directory is filled file by file instead.
    is_cwd = out.exists() and out == Path.cwd().resolve()
    if not is_cwd and all(p.name in TOKENIZER_FILES for p in entries):
        # Nothing there, or only an old tokenizer: whole directories, so no mix of old and new files is
        # ever visible (the old one is put back if the move fails).
        publish_dir(new, out)
        return
    # Other files share the directory: leave them, replace the tokenizer's files one by one, and drop
    # old ones the new tokenizer does not write (they would change what loads).
    written = {p.name for p in new.iterdir()}
    for name in TOKENIZER_FILES:
        if name not in written and (out / name).exists():
            (out / name).unlink()
    for name in sorted(written, key=lambda n: n == TOKENIZER_FILE):  # tokenizer.json last
        os.replace(new / name, out / name)


class AutoTokenizer:
    """The seed documents' entry point: `AutoTokenizer.from_pretrained(dir)` gives a shardwise Tokenizer."""

    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike[str], **kwargs: Any) -> Tokenizer:
        """Load the tokenizer directory or SentencePiece .model `name_or_dir`; hubs are not used."""
        if kwargs:
            logger.debug("AutoTokenizer.from_pretrained ignores %s", sorted(kwargs))
        d = Path(name_or_dir).expanduser()
        model_files = (TOKENIZER_FILE, SENTENCEPIECE_FILE)
        if d.is_file() or (d.is_dir() and any((d / n).is_file() for n in model_files)):
            return load_tokenizer(d)
        found = (
            f"the directory has no {TOKENIZER_FILE} or {SENTENCEPIECE_FILE}"
            if d.is_dir()
            else "no such directory"
        )
        raise DataError(
            f"cannot load tokenizer {str(name_or_dir)!r}: looked for a directory containing "
            f"{TOKENIZER_FILE} or a SentencePiece {SENTENCEPIECE_FILE}, or a .model file ({found}); "
            f"shardwise does not download model names from a hub. To fix it, {_HOW_TO_MAKE_ONE}"
        )
