"""Tokenizers: a thin wrapper over Hugging Face `tokenizers`, byte-level BPE training, loading.

A tokenizer directory is the Hugging Face layout (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`), so what shardwise trains opens in `transformers` and what
`transformers` saves opens here. Special tokens are explicit: bos and eos are found in the configs
(or by their usual names), pad falls back to eos, and a special token that is not in the vocabulary
is refused, because a pad id outside the embedding table silently corrupts training (seed 003, 4.2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from ..errors import DataError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
DEFAULT_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")

# Usual names, tried in order when a tokenizer directory does not say which token plays which role.
_GUESSES = {
    "bos": ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[BOS]"),
    "eos": ("<|eos|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[EOS]"),
    "pad": ("<|pad|>", "<pad>", "[PAD]"),
}

_HOW_TO_MAKE_ONE = (
    "set `data.tokenizer: null` in the config to train a byte-level BPE tokenizer on the training files, "
    f"or pass a directory holding a Hugging Face {TOKENIZER_FILE}"
)


class Tokenizer:
    """A `tokenizers.Tokenizer` with explicit bos/eos/pad tokens and the Hugging Face directory layout."""

    def __init__(
        self,
        backend: _HFTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        source: str = "tokenizer",
    ) -> None:
        """Wrap `backend`; unnamed special tokens are looked up by their usual names."""
        self.backend = backend
        self._source = source
        vocab = backend.get_vocab(with_added_tokens=True)
        # Embedding rows must cover the largest id, which can exceed the token count when ids have gaps.
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._bos = self._resolve("bos", bos_token, vocab)
        self._eos = self._resolve("eos", eos_token, vocab)
        self._pad = self._resolve("pad", pad_token, vocab)
        if self._eos is None:
            raise DataError(
                f"{source} has no end-of-text token: pretraining separates documents with eos. "
                f"Set eos_token in {CONFIG_FILE} to a token of the vocabulary (usual names: "
                f"{', '.join(_GUESSES['eos'])}), or {_HOW_TO_MAKE_ONE}"
            )
        self._fingerprint: str | None = None

    def _resolve(self, role: str, token: str | None, vocab: dict[str, int]) -> str | None:
        if token is not None:
            self._check_in_vocab(role, token)
            return token
        return next((t for t in _GUESSES[role] if t in vocab), None)

    def _check_in_vocab(self, role: str, token: str) -> int:
        tid = self.backend.token_to_id(token)
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

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in bos/eos."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids.insert(0, self._required_bos_id())
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust library."""
        # encode_batch_fast skips offset tracking (newer tokenizers releases only).
        fast = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of a sequence of token ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

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
        return None if self._bos is None else self.backend.token_to_id(self._bos)

    @property
    def eos_id(self) -> int:
        """Id of the eos token."""
        return self.backend.token_to_id(self.eos_token)  # type: ignore[return-value]

    @property
    def pad_id(self) -> int:
        """Id of the padding token (the eos id when no pad token was set)."""
        return self.backend.token_to_id(self.pad_token)  # type: ignore[return-value]

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

    # --- identity and files ---------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """Short sha256 of the tokenizer.json content and the bos/eos choice (keys token caches)."""
        if self._fingerprint is None:
            h = hashlib.sha256(self.backend.to_str().encode("utf-8"))
            # pad is left out: it never appears in packed pretraining tokens, so changing it keeps caches.
            h.update(f"\0{self._bos}\0{self._eos}".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        specials = {k: v for k, v in specials.items() if v is not None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "clean_up_tokenization_spaces": False,
        }
        _write_atomic(out / TOKENIZER_FILE, self.backend.to_str(pretty=True))
        _write_atomic(out / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        _write_atomic(out / SPECIAL_MAP_FILE, json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
        return out

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"pad={self.pad_token!r}, fingerprint={self.fingerprint})"
        )


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a crash never leaves a half-written file under that name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _token_content(value: Any) -> str | None:
    """A special token as configs store it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}; fix or delete the file") from e
    return data if isinstance(data, dict) else {}


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """Load a Hugging Face tokenizer directory (tokenizer.json plus optional config files)."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise DataError(
            f"tokenizer directory {str(d)!r} does not exist; {_HOW_TO_MAKE_ONE}"
        )
    path = d / TOKENIZER_FILE
    if not path.is_file():
        hint = (
            " (a SentencePiece tokenizer.model is not supported yet)"
            if (d / "tokenizer.model").exists()
            else ""
        )
        raise DataError(
            f"no {TOKENIZER_FILE} in tokenizer directory {str(d)!r}{hint}; save one there with "
            f"transformers' `tokenizer.save_pretrained(dir)`, or {_HOW_TO_MAKE_ONE}"
        )
    try:
        backend = _HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises plain Exception for malformed files
        raise DataError(f"{path} is not a valid Hugging Face tokenizer file: {e}") from e
    config = {**_read_json(d / SPECIAL_MAP_FILE), **_read_json(d / CONFIG_FILE)}
    tokens = {role: _token_content(config.get(f"{role}_token")) for role in ("bos", "eos", "pad")}
    tok = Tokenizer(backend, **{f"{r}_token": t for r, t in tokens.items()}, source=f"tokenizer {str(d)!r}")
    for role in ("bos", "eos", "pad"):
        want = config.get(f"{role}_token_id")
        if isinstance(want, int) and not 0 <= want < tok.vocab_size:
            raise DataError(
                f"{role}_token_id {want} in {d / CONFIG_FILE} is outside the vocabulary of "
                f"{tok.vocab_size} tokens; remove it or use an id below {tok.vocab_size}"
            )
    logger.debug("loaded %r from %s", tok, d)
    return tok


def _read_lines(files: Sequence[str], batch: int = 1000) -> Iterator[list[str]]:
    """Lines of the files in batches; invalid UTF-8 becomes U+FFFD instead of failing."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            lines: list[str] = []
            for line in fh:
                lines.append(line)
                if len(lines) == batch:
                    yield lines
                    lines = []
            if lines:
                yield lines


def train_bpe_tokenizer(
    files: Sequence[str],
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on text files and save it to `out_dir`.

    `special_tokens` are (bos, eos[, pad]) in that order and get ids 0, 1, 2.
    """
    if len(special_tokens) not in (2, 3):
        raise DataError(f"special_tokens must be (bos, eos) or (bos, eos, pad), got {tuple(special_tokens)}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(alphabet) + len(special_tokens)
    if vocab_size < smallest:
        raise DataError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE tokenizer: the 256 byte symbols "
            f"and {len(special_tokens)} special tokens alone need {smallest}; use at least {smallest}"
        )
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"tokenizer training file {f!r} does not exist; check data.train_files")
    if not files:
        raise DataError("no files to train the tokenizer on; set data.train_files")
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
    # Reading in Python (not trainer.train(files)) so that invalid UTF-8 is replaced, not fatal.
    backend.train_from_iterator(_read_lines(files), trainer=trainer)
    pad = special_tokens[2] if len(special_tokens) == 3 else None
    tok = Tokenizer(backend, special_tokens[0], special_tokens[1], pad, source=f"tokenizer {str(out_dir)!r}")
    tok.save(out_dir)
    logger.info("saved %r to %s", tok, out_dir)
    return tok


class AutoTokenizer:
    """The seed documents' entry point: `AutoTokenizer.from_pretrained(dir)` gives a shardwise Tokenizer."""

    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike[str], **kwargs: Any) -> Tokenizer:
        """Load the tokenizer directory `name_or_dir`; hub names are not downloaded."""
        if kwargs:
            logger.debug("AutoTokenizer.from_pretrained ignores %s", sorted(kwargs))
        d = Path(name_or_dir).expanduser()
        if d.is_dir() and (d / TOKENIZER_FILE).is_file():
            return load_tokenizer(d)
        found = "the directory has no tokenizer.json" if d.is_dir() else "no such directory"
        raise DataError(
            f"cannot load tokenizer {str(name_or_dir)!r}: looked for a directory containing "
            f"{TOKENIZER_FILE} ({found}); shardwise does not download model names from a hub. "
            f"To fix it, {_HOW_TO_MAKE_ONE}"
        )
