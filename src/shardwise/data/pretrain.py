"""Pre-training data: text files -> one flat token array (cached) -> fixed-length packed samples.

Each file is one document and is followed by EOS. Samples are consecutive windows of the token
stream, `seq_length + 1` tokens long and overlapping by one token, so that every token after the
first is a prediction target exactly once per epoch. Attention masks that stop at document
boundaries are not built here yet; the EOS separator is what marks them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..errors import DataError
from .tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer

logger = logging.getLogger(__name__)

# Bump when the cached token layout changes, so that old caches are never read as new ones.
_CACHE_VERSION = 1
# Files encoded per encode_batch call: enough to keep every core busy, few enough to bound memory.
_FILES_PER_BATCH = 16


def expand_files(globs: Sequence[str] | str) -> list[str]:
    """Sorted, de-duplicated files matching the glob patterns; a pattern that matches nothing fails."""
    if isinstance(globs, (str, os.PathLike)):
        globs = [str(globs)]
    if not globs:
        raise DataError("no data files given; set data.train_files to one or more paths or glob patterns")
    found: set[str] = set()
    for pattern in globs:
        pattern = os.path.expanduser(str(pattern))
        # A literal path wins, so that names containing [ ] or ? are not read as patterns.
        matches = [pattern] if os.path.exists(pattern) else glob.glob(pattern, recursive=True)
        files = [m for m in matches if os.path.isfile(m)]
        if not files:
            if any(os.path.isdir(m) for m in matches):
                raise DataError(
                    f"data file pattern {pattern!r} matches only directories; "
                    f"use a pattern for the files in it, such as '{os.path.join(pattern, '*.txt')}'"
                )
            raise DataError(
                f"data file pattern {pattern!r} matches no file (working directory {os.getcwd()}); "
                f"check the path, or quote a glob such as 'corpora/austen/*.txt'"
            )
        found.update(os.path.abspath(f) for f in files)
    return sorted(found)


def default_cache_dir() -> str:
    """Where tokenizers, token arrays and the measured CPU peak are cached: $SHARDWISE_CACHE, else
    ~/.cache/shardwise (data.cache_dir overrides it for data)."""
    return os.environ.get("SHARDWISE_CACHE") or str(Path.home() / ".cache" / "shardwise")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def _files_key(files: Sequence[str], *extra: object) -> str:
    """Hash of file paths, sizes and modification times (plus `extra`): changes when any file does."""
    parts = []
    for f in files:
        st = os.stat(f)
        parts.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps([_CACHE_VERSION, parts, [str(e) for e in extra]])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


def _read_text(path: str) -> str:
    """File contents as text; invalid UTF-8 becomes U+FFFD so one bad byte does not stop a run."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _tokenize(files: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    chunks: list[np.ndarray] = []
    total_bytes = sum(os.path.getsize(f) for f in files)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None) as bar:
        for start in range(0, len(files), _FILES_PER_BATCH):
            batch = files[start : start + _FILES_PER_BATCH]
            for ids in tokenizer.encode_batch([_read_text(f) for f in batch]):
                chunks.append(np.asarray(ids, dtype=dtype))
                chunks.append(eos)
            bar.update(sum(os.path.getsize(f) for f in batch))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """Save via a temp file and os.replace: an interrupted write never leaves a file under `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenize_files(files: Sequence[str], tokenizer: Tokenizer, cache_dir: str | None = None) -> np.ndarray:
    """One flat token array of all files, each followed by EOS; cached in `cache_dir` when given."""
    if not files:
        raise DataError("no files to tokenize; set data.train_files")
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"data file {f!r} does not exist; check data.train_files / data.eval_files")
    cache: Path | None = None
    if cache_dir is not None:
        cache = Path(cache_dir).expanduser() / f"tokens-{_files_key(files, tokenizer.fingerprint)}.npy"
        if cache.is_file():
            try:
                tokens = np.load(cache, mmap_mode="r")
                logger.info("using cached tokens %s (%d tokens)", cache, len(tokens))
                return tokens
            except (OSError, ValueError) as e:
                logger.warning("token cache %s is unreadable (%s); tokenizing again", cache, e)
    logger.info("tokenizing %d files with %r", len(files), tokenizer)
    tokens = _tokenize(files, tokenizer)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _save_npy_atomic(cache, tokens)
        logger.info("cached %d tokens in %s", len(tokens), cache)
    return tokens


class PackedDataset(Dataset):
    """Fixed-length samples cut from a flat token array: sample i is tokens [i*T, i*T + T + 1)."""

    def __init__(self, tokens: np.ndarray, seq_length: int) -> None:
        """Cut `tokens` into samples of `seq_length` inputs (and `seq_length` shifted labels)."""
        if seq_length < 1:
            raise DataError(f"data.seq_length must be at least 1, got {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        # The +1: labels are the inputs shifted by one, so a sample reads one token past its window.
        self._len = max(0, (len(tokens) - 1) // seq_length)
        if self._len == 0:
            raise DataError(
                f"only {len(tokens)} tokens, but one sample of seq_length {seq_length} needs "
                f"{seq_length + 1}; add more text or lower data.seq_length"
            )

    def __len__(self) -> int:
        """Number of samples."""
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """{"input_ids": LongTensor[T], "labels": LongTensor[T]} for sample `index`."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples")
        start = index * self.seq_length
        window = torch.from_numpy(
            np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)
        )
        return {"input_ids": window[:-1], "labels": window[1:]}

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked: {"input_ids": [B, T], "labels": [B, T]}, gathered in one numpy op."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"sample indices out of range for {self._len} samples")
        offsets = idx[:, None] * self.seq_length + np.arange(self.seq_length + 1)
        windows = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}

    @property
    def num_tokens(self) -> int:
        """Tokens in the underlying array."""
        return len(self.tokens)


def split_tokens(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split off the last `eval_fraction` of the tokens for evaluation: (train, eval)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
    n_eval = int(round(len(tokens) * eval_fraction))
    cut = len(tokens) - n_eval
    return tokens[:cut], tokens[cut:]


def _tokenizer_for(
    train_files: Sequence[str], tokenizer_dir: str | None, vocab_size: int, cache_dir: str
) -> Tokenizer:
    """Load `tokenizer_dir`, or train a BPE tokenizer on the files (reused from the cache next time)."""
    if tokenizer_dir is not None:
        return load_tokenizer(tokenizer_dir)
    out = Path(cache_dir).expanduser() / f"tokenizer-{_files_key(train_files, 'bpe', vocab_size)}"
    if (out / "tokenizer.json").is_file():
        logger.info("using cached tokenizer %s", out)
        return load_tokenizer(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        train_bpe_tokenizer(list(train_files), vocab_size, tmp)
        if out.exists() and not (out / "tokenizer.json").is_file():
            shutil.rmtree(out)  # a leftover without tokenizer.json is unusable
        # Renaming the finished directory keeps a half-trained tokenizer from ever being reused.
        os.replace(tmp, out)
    except OSError:
        if not (out / "tokenizer.json").is_file():
            raise
        # Another process finished the same tokenizer first; theirs is identical, so use it.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(out)


def build_pretrain_data(
    train_files: list[str],
    seq_length: int,
    tokenizer_dir: str | None,
    vocab_size: int,
    cache_dir: str | None,
    eval_files: list[str] | None = None,
    eval_fraction: float = 0.0,
) -> tuple[Tokenizer, PackedDataset, PackedDataset | None]:
    """Tokenizer, training samples and (optional) eval samples from the data section of a config.

    Without `tokenizer_dir` a byte-level BPE tokenizer of `vocab_size` is trained on the training
    files and cached in `cache_dir` (None: `default_cache_dir()`), like the token arrays.
    """
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    files = expand_files(train_files)
    tokenizer = _tokenizer_for(files, tokenizer_dir, vocab_size, cache_dir)
    tokens = tokenize_files(files, tokenizer, cache_dir)
    eval_ds: PackedDataset | None = None
    if eval_files:
        if eval_fraction:
            logger.warning("data.eval_files is set, so data.eval_fraction %s is ignored", eval_fraction)
        eval_tokens = tokenize_files(expand_files(eval_files), tokenizer, cache_dir)
        eval_ds = PackedDataset(eval_tokens, seq_length)
    elif eval_fraction:
        tokens, eval_tokens = split_tokens(tokens, eval_fraction)
        if len(eval_tokens) < seq_length + 1:
            raise DataError(
                f"data.eval_fraction {eval_fraction} holds out {len(eval_tokens)} of "
                f"{len(tokens) + len(eval_tokens)} tokens, fewer than the {seq_length + 1} one eval "
                f"sample needs; raise eval_fraction, lower seq_length or give data.eval_files"
            )
        eval_ds = PackedDataset(eval_tokens, seq_length)
    train_ds = PackedDataset(tokens, seq_length)
    logger.info(
        "pretraining data: %d train samples (%d tokens)%s",
        len(train_ds),
        train_ds.num_tokens,
        f", {len(eval_ds)} eval samples" if eval_ds is not None else "",
    )
    return tokenizer, train_ds, eval_ds


class TextDataset(PackedDataset):
    """The seed documents' pretraining dataset: text files packed into `max_seq_len` samples."""

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Tokenizer,
        max_seq_len: int,
        shuffle: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        """Tokenize the files matching `data_files`; `shuffle` is kept for `create_dataset`."""
        self.files = expand_files(data_files)
        self.tokenizer = tokenizer
        self.shuffle = shuffle
        super().__init__(tokenize_files(self.files, tokenizer, cache_dir), max_seq_len)
