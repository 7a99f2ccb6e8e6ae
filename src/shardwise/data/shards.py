"""Reading a prepared corpus: memory-mapped token shards with per-shard document indexes.

A directory written by `prepare_corpus` (prepare.py) holds:

- `shard-00000.bin`, `shard-00001.bin`, ...: the token stream, little-endian uint16 (vocabularies up
  to 65535 ids) or uint32, each document's tokens followed by EOS. Shards hold `shard_tokens` tokens
  each (the last one fewer), so a document may continue from one shard into the next.
- `shard-00000.idx`, ...: int64 offsets, within the shard, at which the documents that begin in it
  begin (sorted; shard 0 starts with 0).
- `manifest.json`, written last: format and version, tokenizer fingerprint / vocab size / eos id,
  dtype, counts, options, inputs and the shard list (see `prepare.py`). A directory without it is not
  a prepared corpus (or its preparation was interrupted) and is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from ..untrusted import fail, int_field, kind_of, read_json_object, str_field

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
FORMAT_NAME = "shardwise-token-shards"
# Bump when the layout changes; a reader refuses versions it does not know.
FORMAT_VERSION = 1
INDEX_DTYPE = np.dtype("<i8")
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# A manifest lists every input file, so a corpus of millions of small files has a large one.
MAX_MANIFEST_BYTES = 256 << 20
MAX_SHARDS = 1_000_000
MAX_TOKENS = 1 << 50
_SHARD_FILE = re.compile(r"shard-\d{5,}\.(bin|idx)")


def shard_dtype(name: str) -> np.dtype:
    """The on-disk (little-endian) numpy dtype of a manifest dtype name ("uint16" or "uint32")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise DataError(f"unknown token dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary (its name is the manifest's dtype)."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def shard_names(i: int) -> tuple[str, str]:
    """File names (tokens, index) of shard `i`."""
    return f"shard-{i:05d}.bin", f"shard-{i:05d}.idx"


def _reprepare_hint(directory: Path) -> str:
    return (
        f"prepare it again: `shardwise prepare --input ... --tokenizer ... --out {directory} --overwrite` "
        f"(or delete the directory; a training run that prepares its own data re-creates it)"
    )


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a prepared directory, checked for format and version; DataError when absent."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise DataError(
            f"prepared data directory {str(d)!r} does not exist; prepare one with "
            f"`shardwise prepare --input GLOB --tokenizer DIR --out {d}`"
        )
    path = d / MANIFEST_FILE
    if not path.is_file():
        raise DataError(
            f"{str(d)!r} has no {MANIFEST_FILE}: it is not a prepared corpus, or its preparation was "
            f"interrupted before it finished (the manifest is written last, so nothing in it is used); "
            f"{_reprepare_hint(d)}"
        )
    advice = f"the directory is damaged, {_reprepare_hint(d)}"
    manifest = read_json_object(path, DataError, limit=MAX_MANIFEST_BYTES, advice=advice)
    if manifest.get("format") != FORMAT_NAME:
        raise DataError(
            f"{path} is not a shardwise token-shard manifest (no \"format\": \"{FORMAT_NAME}\"); "
            f"point at a directory written by `shardwise prepare`"
        )
    version = manifest.get("version")
    if version != FORMAT_VERSION or type(version) is not int:
        raise DataError(
            f"{path} has format version {repr(version)[:40]}, but this shardwise reads version {FORMAT_VERSION}; "
            f"{_reprepare_hint(d)}, or use the shardwise release that wrote it"
        )
    _check_manifest(manifest, path, advice)
    return manifest


def _check_manifest(m: dict[str, Any], path: Path, advice: str) -> None:
    """Type and range of every manifest field a reader uses; DataError naming the file and field."""
    dtype = str_field(m, "dtype", path, DataError, advice=advice)
    if dtype not in _DTYPES:
        fail(DataError, path, f"'dtype' is {dtype!r}, not one of {sorted(_DTYPES)}", advice)
    for key in ("num_tokens", "num_documents"):
        int_field(m, key, path, DataError, hi=MAX_TOKENS, advice=advice)
    info = m.get("tokenizer")
    if not isinstance(info, dict):
        fail(DataError, path, f"'tokenizer' is {kind_of(info)}, not an object", advice)
    where = f"{path} (tokenizer)"
    vocab = int_field(info, "vocab_size", where, DataError, lo=1, hi=1 << 32, advice=advice)
    int_field(info, "eos_id", where, DataError, hi=vocab - 1, advice=advice)
    str_field(info, "fingerprint", where, DataError, max_len=256, advice=advice)
    if info.get("source") is not None:
        str_field(info, "source", where, DataError, max_len=4096, advice=advice)
    if dtype == "uint16" and vocab > 65536:
        fail(DataError, path, f"'dtype' uint16 cannot hold the ids of a vocabulary of {vocab:,}", advice)
    shards = m.get("shards")
    if not isinstance(shards, list) or len(shards) > MAX_SHARDS:
        what = kind_of(shards) if not isinstance(shards, list) else f"a list of {len(shards):,}"
        fail(DataError, path, f"'shards' is {what}, not a list of at most {MAX_SHARDS:,} shards", advice)
    for i, shard in enumerate(shards):
        where = f"{path} (shard {i})"
        if not isinstance(shard, dict):
            fail(DataError, where, f"is {kind_of(shard)}, not an object", advice)
        for key in ("file", "index"):
            name = str_field(shard, key, where, DataError, max_len=64, advice=advice)
            # A plain shard file name: a manifest never points outside its own directory.
            if not _SHARD_FILE.fullmatch(name):
                fail(DataError, where, f"{key!r} is {name!r}, not a shard file name like 'shard-00000.bin'", advice)
        for key in ("num_tokens", "num_documents"):
            int_field(shard, key, where, DataError, hi=MAX_TOKENS, advice=advice)
        for key in ("blake2b", "index_blake2b"):
            if shard.get(key) is not None:
                str_field(shard, key, where, DataError, max_len=128, advice=advice)


def file_blake2b(path: str | os.PathLike[str]) -> str:
    """The 16-byte blake2b of a file's content (what manifests record of shards), read 4 MiB at a time."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class TokenShards:
    """A prepared corpus as one token stream: `read(start, stop)` and `document_starts(start, stop)`.

    Opening checks the manifest and every shard's file sizes (not their contents; `verify()` does
    that). Shards are memory-mapped on first use, so the object pickles cheaply (only paths and small
    arrays) and a DataLoader worker maps the files itself.
    """

    # Document boundaries are always known (PackedDataset builds document masks from them).
    has_documents = True

    def __init__(self, directory: str | os.PathLike[str], tokenizer: Any | None = None, part_ok: bool = False) -> None:
        """Open `directory`; with `tokenizer`, refuse shards prepared with a different one. A part of a
        preparation by many processes (prepare_parts.py) is refused unless `part_ok` (for the merge)."""
        self.directory = Path(directory).expanduser().resolve()
        self.manifest: dict[str, Any] = read_manifest(self.directory)
        m = self.manifest
        d = self.directory
        if m.get("part") is not None and not part_ok:
            out = d.parent.with_name(d.parent.name.removesuffix(".parts"))
            raise DataError(
                f"{d} is one part of a preparation by several processes, not a corpus: duplicates across the "
                f"parts are still in it. Merge the parts (shardwise prepare --merge --out {out} --tokenizer DIR) "
                f"and use {out}"
            )
        try:
            self.dtype = shard_dtype(m["dtype"])
            info = m["tokenizer"]
            self.eos_id = int(info["eos_id"])
            self.vocab_size = int(info["vocab_size"])
            self.fingerprint = str(info["fingerprint"])
            shards = list(m["shards"])
            self.num_tokens = int(m["num_tokens"])
            self.num_documents = int(m["num_documents"])
            self._token_files = [str(d / s["file"]) for s in shards]
            self._index_files = [str(d / s["index"]) for s in shards]
            sizes = np.array([int(s["num_tokens"]) for s in shards], dtype=np.int64)
            docs = np.array([int(s["num_documents"]) for s in shards], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"{d / MANIFEST_FILE} is missing or has a malformed entry ({e!r}); the directory is "
                f"damaged, {_reprepare_hint(d)}"
            ) from e
        # Global position of each shard's first token, plus the end: a few numbers per shard.
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._shard_docs = docs
        if int(self._offsets[-1]) != self.num_tokens or int(docs.sum()) != self.num_documents:
            raise DataError(
                f"{d / MANIFEST_FILE} is inconsistent: its shards hold {int(self._offsets[-1])} tokens and "
                f"{int(docs.sum())} documents, but it says {self.num_tokens} and {self.num_documents}; "
                f"{_reprepare_hint(d)}"
            )
        for i, (tf, xf) in enumerate(zip(self._token_files, self._index_files)):
            self._check_size(tf, int(sizes[i]) * self.dtype.itemsize)
            self._check_size(xf, int(docs[i]) * INDEX_DTYPE.itemsize)
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)
        self._tokens: list[np.ndarray | None] = [None] * len(self._token_files)
        self._index: list[np.ndarray | None] = [None] * len(self._index_files)

    def _check_size(self, path: str, expected: int) -> None:
        try:
            size = os.path.getsize(path)
        except OSError:
            raise DataError(
                f"shard file {path} listed in the manifest is missing; the directory is damaged, "
                f"{_reprepare_hint(self.directory)}"
            ) from None
        if size != expected:
            raise DataError(
                f"shard file {path} is {size} bytes but the manifest says {expected}: the directory is "
                f"damaged (truncated or changed after preparation); {_reprepare_hint(self.directory)}"
            )

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise DataError unless `tokenizer` is the one these shards were prepared with."""
        theirs = self.manifest["tokenizer"]
        if tokenizer.fingerprint != self.fingerprint:
            source = theirs.get("source")
            was = f" ({source})" if source else ""
            raise DataError(
                f"{self.directory} was prepared with tokenizer fingerprint {self.fingerprint}{was}, "
                f"vocab {self.vocab_size}, eos id {self.eos_id}, but the tokenizer given has fingerprint "
                f"{tokenizer.fingerprint}, vocab {tokenizer.vocab_size}, eos id {tokenizer.eos_id}: the "
                f"token ids would mean different text. Prepare it again with this tokenizer "
                f"(`shardwise prepare ... --out {self.directory} --overwrite`), or use the tokenizer "
                f"it was prepared with"
            )

    # --- pickling: paths and small arrays only; memmaps are reopened on first use -----------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = [None] * len(self._token_files)
        state["_index"] = [None] * len(self._index_files)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _tokens_of(self, i: int) -> np.ndarray:
        arr = self._tokens[i]
        if arr is None:
            # np.memmap refuses zero-length files, and an empty shard has nothing to map anyway.
            if self._offsets[i + 1] > self._offsets[i]:
                arr = np.memmap(self._token_files[i], dtype=self.dtype, mode="r")
            else:
                arr = np.zeros(0, self.dtype)
            self._tokens[i] = arr
        return arr

    def _index_of(self, i: int) -> np.ndarray:
        arr = self._index[i]
        if arr is None:
            if self._shard_docs[i]:
                arr = np.memmap(self._index_files[i], dtype=INDEX_DTYPE, mode="r")
            else:
                arr = np.zeros(0, INDEX_DTYPE)
            self._index[i] = arr
        return arr

    # --- reading ---------------------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        """Number of shard files."""
        return len(self._token_files)

    def __len__(self) -> int:
        """Tokens in the corpus (same as `num_tokens`)."""
        return self.num_tokens

    def _check_range(self, start: int, stop: int) -> tuple[int, int]:
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) is outside [0, {self.num_tokens}]")
        return start, stop

    def _shards_in(self, start: int, stop: int) -> range:
        """Indices of the shards that hold some of the positions [start, stop) (start < stop)."""
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        last = int(np.searchsorted(self._offsets, stop, side="left")) - 1
        return range(first, last + 1)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens of global positions [start, stop) (read-only when they lie in one shard)."""
        start, stop = self._check_range(start, stop)
        if start == stop:
            return np.zeros(0, dtype=self.dtype)
        parts = []
        for i in self._shards_in(start, stop):
            base = int(self._offsets[i])
            lo, hi = max(start, base) - base, min(stop, int(self._offsets[i + 1])) - base
            if hi > lo:
                parts.append(self._tokens_of(i)[lo:hi])
        out = np.asarray(parts[0]) if len(parts) == 1 else np.concatenate(parts)
        # A shard changed after preparation (same size, other bytes) could hold ids past the vocabulary,
        # which index past the embedding table (on a GPU, a device-side assert): a few microseconds a sample.
        if self.vocab_size <= np.iinfo(self.dtype).max and len(out) and int(out.max()) >= self.vocab_size:
            shard = self._token_files[self._shards_in(start, stop)[0]]
            raise DataError(
                f"shard file {shard} (or the next) holds token id {int(out.max()):,} between positions {start:,} and "
                f"{stop:,}, past the vocabulary of {self.vocab_size:,} in the manifest: the directory is damaged "
                f"(changed after preparation); {_reprepare_hint(self.directory)}"
            )
        return out

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Sorted global positions p, start <= p < stop, at which a document begins (int64)."""
        start, stop = self._check_range(start, stop)
        if start == stop:
            return np.zeros(0, dtype=np.int64)
        parts = []
        for i in self._shards_in(start, stop):
            base = int(self._offsets[i])
            index = self._index_of(i)
            lo = int(np.searchsorted(index, start - base, side="left"))
            hi = int(np.searchsorted(index, stop - base, side="left"))
            if hi > lo:
                parts.append(np.asarray(index[lo:hi], dtype=np.int64) + base)
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def verify(self) -> None:
        """Check every shard's content against the digests in the manifest (reads all data)."""
        for i, shard in enumerate(self.manifest["shards"]):
            for path, key in ((self._token_files[i], "blake2b"), (self._index_files[i], "index_blake2b")):
                want = shard.get(key)
                if want is None:
                    continue
                if file_blake2b(path) != want:
                    raise DataError(
                        f"shard file {path} does not match the digest in the manifest: it changed after "
                        f"preparation; {_reprepare_hint(self.directory)}"
                    )

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.directory)!r}, tokens={self.num_tokens}, documents={self.num_documents}, "
            f"shards={self.num_shards}, dtype={self.dtype.name}, tokenizer={self.fingerprint})"
        )
