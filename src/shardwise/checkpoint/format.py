"""How a checkpoint is laid out on disk, and how it is read back without trusting it.

A checkpoint directory holds `.metadata.json` (DCP's metadata, as JSON: every tensor's dtype, global
shape and chunks, and which bytes of which file hold each chunk) and one `__<rank>_0.distcp` file per
rank of chunks, each written by `torch.save` of one tensor. Shardwise writes tensors and nothing else.

A checkpoint may come from anywhere, so reading one never runs code and believes nothing in it before
checking it:

- `.metadata.json` is validated as it is read, before DCP plans anything: tensor items only (DCP
  unpickles an item marked `bytes`), dtypes from an allow-list, chunks that tile their tensor, storage
  entries naming plain files inside the directory with byte ranges inside those files;
- `SafeCheckpointReader.read_data` reads each chunk with `torch.load(weights_only=True)` and accepts it
  only as a plain tensor of exactly the metadata's dtype and the chunk's shape;
- `TensorOnlyLoadPlanner` refuses to unpickle anything, whatever reaches it.

Each problem raises a CheckpointError naming the checkpoint, the file and what is wrong.
"""

from __future__ import annotations

import io
import math
import os
import pickle  # for its UnpicklingError only: the weights-only unpickler raises it for what it refuses
import stat
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..errors import CheckpointError
from ..files import plain_file_name, write_json_atomic
from ..untrusted import MAX_SIDE_FILE, MiB
from ..untrusted import read_json_object as untrusted_json_object

METADATA_FILE = ".metadata.json"


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as `.metadata.json` names it: "bfloat16", not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")


# What shardwise saves (parameters, optimizer state, fp32 masters, step counters). A name from the file
# is looked up here, never with getattr(torch, name), which would accept any attribute of torch.
DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d
    for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool)
}

_TENSOR_KEYS = {"kind", "dtype", "requires_grad", "size", "chunks"}
_STORAGE_KEYS = {"fqn", "offset", "index", "path", "byte_offset", "length", "transforms"}
_DOCUMENT_KEYS = {"version", "state_dict", "storage", "planner"}
_ADVICE = ("shardwise never writes that, so the checkpoint is damaged or was altered: copy it again from the "
           "run that saved it (or save it again there), and do not load checkpoints from sources you do not "
           "trust as they are")


def refused(checkpoint: Path, file: str, problem: str) -> CheckpointError:
    """The error for a checkpoint file that is not what shardwise writes, in one paragraph."""
    return CheckpointError(f"checkpoint {checkpoint} cannot be loaded: {file} {problem}; {_ADVICE}.")


def is_count(value: Any) -> bool:
    """A non-negative int as JSON gives it, small enough for a torch size (True is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _json_kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# --- JSON files -----------------------------------------------------------------------------------------


class _Refused(CheckpointError):
    """What `untrusted` raises here, turned into `refused`'s one paragraph by `read_json_object`."""


# Bounds on a checkpoint's JSON files, checked before they are read: .metadata.json grows with tensors x
# ranks (a 70B model on 1024 ranks writes some tens of MiB), the others are small.
JSON_LIMITS = {METADATA_FILE: 512 * MiB}
SMALL_JSON_LIMIT = 1 * MiB  # a rank's random state (some KiB), the checksum manifest of small checkpoints


def read_json_object(file: Path, checkpoint: Path, *, limit: int | None = None) -> dict:
    """A checkpoint's JSON file as a dict, read through `shardwise.untrusted` (a regular file of at most
    `limit` bytes, UTF-8, nested at most 100 levels, integers of at most 40 digits, no NaN): anything
    else fails as a CheckpointError naming the checkpoint and the file."""
    limit = limit if limit is not None else JSON_LIMITS.get(file.name, MAX_SIDE_FILE)
    try:
        return untrusted_json_object(file, _Refused, limit=limit)
    except _Refused as e:
        problem = str(e).removeprefix(f"{file}: ")
        raise refused(checkpoint, file.name, problem) from None


# --- .metadata.json <-> DCP Metadata ----------------------------------------------------------------------


def metadata_to_json(md: Metadata) -> dict:
    """DCP's metadata as the JSON document of `.metadata.json` (the format every shardwise version reads)."""
    items = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            raise CheckpointError(f"checkpoint item {fqn} is not a tensor: checkpoints hold tensors only")
        items[fqn] = {
            "kind": "tensor",
            "dtype": dtype_name(m.properties.dtype),
            "requires_grad": m.properties.requires_grad,
            "size": list(m.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
        }
    storage = [
        {
            "fqn": idx.fqn,
            "offset": None if idx.offset is None else list(idx.offset),
            "index": idx.index,
            "path": info.relative_path,
            "byte_offset": info.offset,
            "length": info.length,
            "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors),
        }
        for idx, info in (md.storage_data or {}).items()
    ]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {"version": md.version, "state_dict": items, "storage": storage, "planner": planner}


def _bad(checkpoint: Path, problem: str) -> CheckpointError:
    return refused(checkpoint, METADATA_FILE, problem)


def _object(value: Any, keys: set[str], what: str, checkpoint: Path) -> dict:
    """`value` as an object with exactly `keys` (the fields shardwise writes there)."""
    if not isinstance(value, dict):
        raise _bad(checkpoint, f"has {_json_kind(value)} for {what}, where shardwise writes an object")
    if set(value) != keys:
        odd = sorted(set(value) - keys) or sorted(keys - set(value))
        which = "an unknown field" if set(value) - keys else "no field"
        raise _bad(checkpoint, f"has {which} {odd[0]!r} in {what}")
    return value


def _counts(value: Any, what: str, checkpoint: Path, length: int | None = None) -> list[int]:
    """A list of non-negative ints (of `length` entries, when given)."""
    if not isinstance(value, list) or not all(is_count(v) for v in value):
        raise _bad(checkpoint, f"gives {what} as {value!r}; it must be a list of non-negative integers")
    if length is not None and len(value) != length:
        raise _bad(checkpoint, f"gives {what} {len(value)} dimensions, but the tensor has {length}")
    return value


def chunks_tile(size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> bool:
    """Whether chunks (each inside the tensor) cover every element of a tensor of `size` exactly once."""
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(size):
        return False
    boxes = [c for c in chunks if math.prod(c.sizes) > 0]
    if not size:
        return True
    # Sweep along the dimension the chunks are cut most along: a chunk is compared only with those
    # that start before it ends there.
    dim = max(range(len(size)), key=lambda d: len({c.offsets[d] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[dim])
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if b.offsets[dim] >= a.offsets[dim] + a.sizes[dim]:
                break
            if all(b.offsets[d] < a.offsets[d] + a.sizes[d] and a.offsets[d] < b.offsets[d] + b.sizes[d]
                   for d in range(len(size))):
                return False
    return True


def _tensor_item(fqn: str, value: Any, checkpoint: Path) -> TensorStorageMetadata:
    """One state_dict entry: a tensor with a known dtype whose chunks tile it."""
    if isinstance(value, dict) and value.get("kind") != "tensor":
        kind = value.get("kind")
        pickled = " (DCP would unpickle it)" if kind == "bytes" else ""
        raise _bad(checkpoint, f"lists {fqn} as kind {kind!r}{pickled}, but shardwise checkpoints hold tensors only")
    m = _object(value, _TENSOR_KEYS, f"the entry of {fqn}", checkpoint)
    dtype = DTYPES.get(m["dtype"]) if isinstance(m["dtype"], str) else None
    if dtype is None:
        raise _bad(checkpoint, f"gives {fqn} the dtype {m['dtype']!r}, which is not one of {', '.join(DTYPES)}")
    if not isinstance(m["requires_grad"], bool):
        raise _bad(checkpoint, f"gives {fqn} requires_grad {m['requires_grad']!r}, not true or false")
    size = _counts(m["size"], f"the size of {fqn}", checkpoint)
    if not isinstance(m["chunks"], list) or not m["chunks"]:
        raise _bad(checkpoint, f"gives {fqn} no list of chunks")
    chunks = []
    for c in m["chunks"]:
        c = _object(c, {"offsets", "sizes"}, f"a chunk of {fqn}", checkpoint)
        offsets = _counts(c["offsets"], f"a chunk offset of {fqn}", checkpoint, len(size))
        sizes = _counts(c["sizes"], f"a chunk size of {fqn}", checkpoint, len(size))
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise _bad(checkpoint, f"puts a chunk of {fqn} (offsets {offsets}, sizes {sizes}) outside the "
                                   f"tensor's size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    if not chunks_tile(size, chunks):
        raise _bad(checkpoint, f"gives {fqn} chunks that overlap or leave part of it out")
    props = TensorProperties(dtype=dtype, requires_grad=m["requires_grad"])
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _storage_entry(value: Any, items: dict[str, TensorStorageMetadata],
                   checkpoint: Path) -> tuple[MetadataIndex, _StorageInfo]:
    """One storage entry: a chunk of a listed tensor, at a byte range of a plain file name."""
    s = _object(value, _STORAGE_KEYS, "a storage entry", checkpoint)
    fqn = s["fqn"]
    if not isinstance(fqn, str) or fqn not in items:
        raise _bad(checkpoint, f"has a storage entry for {fqn!r}, which is not one of its tensors")
    item = items[fqn]
    offset = _counts(s["offset"], f"the storage offset of {fqn}", checkpoint, len(item.size))
    chunk = next((c for c in item.chunks if list(c.offsets) == offset), None)
    if chunk is None:
        raise _bad(checkpoint, f"has a storage entry for {fqn} at offsets {offset}, where it lists no chunk")
    if s["index"] is not None and not is_count(s["index"]):
        raise _bad(checkpoint, f"gives the storage entry of {fqn} the index {s['index']!r}")
    if not plain_file_name(s["path"]):
        raise _bad(checkpoint, f"stores {fqn} in {s['path']!r}, which is not a plain file name inside the "
                               "checkpoint directory (no '/', '\\', '..' or absolute path)")
    if not is_count(s["byte_offset"]) or not is_count(s["length"]):
        raise _bad(checkpoint, f"gives {fqn} the byte range {s['byte_offset']!r} + {s['length']!r} in "
                               f"{s['path']}; both must be non-negative integers")
    least = math.prod(chunk.sizes) * item.properties.dtype.itemsize
    if s["length"] < least:
        raise _bad(checkpoint, f"gives {fqn} {s['length']} bytes of {s['path']}, fewer than its "
                               f"{least} bytes of data")
    if s["transforms"] not in (None, []):
        raise _bad(checkpoint, f"asks for the stream transforms {s['transforms']!r} on {fqn}")
    index = MetadataIndex(fqn=fqn, offset=torch.Size(offset), index=s["index"])
    return index, _StorageInfo(relative_path=s["path"], offset=s["byte_offset"], length=s["length"],
                               transform_descriptors=s["transforms"])


def _planner_data(value: Any, items: dict[str, TensorStorageMetadata], checkpoint: Path) -> dict:
    """DCP's flattening record: a listed tensor's name -> its (group, name) path."""
    if not isinstance(value, dict):
        raise _bad(checkpoint, f"has {_json_kind(value)} for 'planner', where shardwise writes an object")
    for fqn, keys in value.items():
        if fqn not in items or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) \
                or ".".join(keys) != fqn:
            raise _bad(checkpoint, f"has the planner entry {fqn!r}: {keys!r}, which does not name one of its "
                                   "tensors by its path")
    return {fqn: tuple(keys) for fqn, keys in value.items()}


def metadata_from_json(doc: dict, checkpoint: Path) -> Metadata:
    """DCP Metadata from the `.metadata.json` document, checked field by field (no file is opened)."""
    doc = _object(doc, _DOCUMENT_KEYS, "the document", checkpoint)
    if doc["version"] is not None and not isinstance(doc["version"], str):
        raise _bad(checkpoint, f"has the version {doc['version']!r}, where DCP writes a string or null")
    if not isinstance(doc["state_dict"], dict):
        raise _bad(checkpoint, f"has {_json_kind(doc['state_dict'])} for 'state_dict', where shardwise "
                               "writes an object")
    items = {fqn: _tensor_item(fqn, m, checkpoint) for fqn, m in doc["state_dict"].items()}
    if not isinstance(doc["storage"], list):
        raise _bad(checkpoint, f"has {_json_kind(doc['storage'])} for 'storage', where shardwise writes a list")
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for entry in doc["storage"]:
        index, info = _storage_entry(entry, items, checkpoint)
        if index in storage:
            raise _bad(checkpoint, f"stores the chunk of {index.fqn} at offsets {list(index.offset)} twice")
        storage[index] = info
    for fqn, item in items.items():
        for c in item.chunks:
            if MetadataIndex(fqn=fqn, offset=c.offsets) not in storage:
                raise _bad(checkpoint, f"says where no file holds the chunk of {fqn} at offsets {list(c.offsets)}")
    return Metadata(state_dict_metadata=dict(items), planner_data=_planner_data(doc["planner"], items, checkpoint),
                    storage_data=storage, version=doc["version"])


def check_storage_files(md: Metadata, checkpoint: Path) -> dict[str, Path]:
    """Each shard file the metadata names, resolved: a regular file inside the checkpoint directory that
    holds every byte range listed in it, the ranges apart (as DCP writes them: so the tensors a
    checkpoint claims are bounded by its bytes on disk)."""
    root = checkpoint.resolve()
    files: dict[str, tuple[Path, int]] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in md.storage_data.items():
        name = info.relative_path
        if name not in files:
            files[name] = _shard_file(root, name, checkpoint)
        end, size = info.offset + info.length, files[name][1]
        if end > size:
            raise _bad(checkpoint, f"puts {index.fqn} at bytes {info.offset} to {end} of {name}, but {name} "
                                   f"has {size} bytes")
        ranges.setdefault(name, []).append((info.offset, end, index.fqn))
    for name, spans in ranges.items():
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise _bad(checkpoint, f"puts {first} and {second} on the same bytes of {name}")
    return {name: path for name, (path, _) in files.items()}


def _shard_file(root: Path, name: str, checkpoint: Path) -> tuple[Path, int]:
    """The resolved path and size of shard file `name`, which must be a regular file inside `root`."""
    try:
        path = (root / name).resolve(strict=True)
    except FileNotFoundError:
        raise _bad(checkpoint, f"lists the shard file {name}, which is not in the checkpoint directory") from None
    except (OSError, RuntimeError) as e:  # a symlink loop is a RuntimeError before Python 3.13
        raise _bad(checkpoint, f"lists the shard file {name}, which cannot be opened ({e})") from None
    if not path.is_relative_to(root):
        raise refused(checkpoint, name, f"is a link to {path}, outside the checkpoint directory")
    status = path.stat()
    if not stat.S_ISREG(status.st_mode):
        raise refused(checkpoint, name, "is not a regular file")
    return path, status.st_size


# --- Writing and reading with DCP -----------------------------------------------------------------------


class JsonMetadataWriter(FileSystemWriter):
    """DCP's file writer, but the checkpoint's metadata is written as JSON instead of a pickle."""

    def finish(self, metadata: Metadata, results: list) -> None:
        """Write the metadata file once every rank's tensors are on disk."""
        storage = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage
        write_json_atomic(Path(self.path) / METADATA_FILE, metadata_to_json(metadata))


def _never_unpickled(checkpoint: Path, fqn: str) -> CheckpointError:
    return _bad(checkpoint, f"makes {fqn} an object to unpickle; shardwise checkpoints hold tensors only and "
                            "are never unpickled")


def _first_sentence(error: Exception) -> str:
    text = (str(error).splitlines() or [""])[0].split(". ")[0][:160]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class SafeCheckpointReader(FileSystemReader):
    """DCP's file reader for checkpoints from anywhere: metadata from JSON, validated before DCP plans
    anything, and chunks accepted only as the plain tensors the metadata describes (never unpickled)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.checkpoint = Path(path)
        self._metadata: Metadata | None = None
        self._files: dict[str, Path] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point at another checkpoint (DCP's reuse of a reader): its metadata is read and checked anew."""
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.checkpoint, self._metadata, self._files = Path(checkpoint_id), None, {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, validated once per reader; CheckpointError for anything shardwise
        does not write. (No per-rank metadata files: shardwise writes one for all ranks.)"""
        if self._metadata is None:
            doc = read_json_object(self.checkpoint / METADATA_FILE, self.checkpoint)
            md = metadata_from_json(doc, self.checkpoint)
            self._files = check_storage_files(md, self.checkpoint)
            self._metadata = md
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the planned chunks, file by file, each checked against the metadata, into the planner's
        tensors. Unlike DCP's reader nothing goes to `planner.load_bytes` (which unpickles)."""
        md = self.read_metadata()
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise _never_unpickled(self.checkpoint, item.storage_index.fqn)
            by_file.setdefault(md.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            with open(self._files[name], "rb") as f:
                for item in items:
                    piece = _narrow(self._read_chunk(f, name, item), item.storage_offsets, item.lengths)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != piece.shape:  # the plan came from the checked metadata: a bug
                        raise RuntimeError(f"{item.storage_index} read {list(piece.shape)} into "
                                           f"{list(target.shape)}")
                    target.copy_(piece)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_chunk(self, f: io.BufferedReader, name: str, item: ReadItem) -> torch.Tensor:
        """The stored chunk of `item`: a plain CPU tensor of the metadata's dtype and the chunk's shape."""
        md = self.read_metadata()
        info = md.storage_data[item.storage_index]
        fqn = item.storage_index.fqn
        tensor_md = md.state_dict_metadata[fqn]
        sizes = next(c.sizes for c in tensor_md.chunks if c.offsets == item.storage_index.offset)
        where = f"at bytes {info.offset} to {info.offset + info.length}, where {METADATA_FILE} puts {fqn}"
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length:
            raise refused(self.checkpoint, name, f"ends before the data {where}")
        try:
            with warnings.catch_warnings():  # the unpickler's warnings are about a file refused below
                warnings.simplefilter("ignore")
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise refused(self.checkpoint, name, f"holds no saved tensor {where}: what is there is something "
                                                 "the weights-only unpickler refused (nothing was unpickled)") from None
        except Exception as e:  # noqa: BLE001 - whatever the bytes make torch.load raise, the file is bad
            raise refused(self.checkpoint, name, f"holds no readable tensor {where} ({_first_sentence(e)})") from e
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            what = type(tensor).__name__ if type(tensor) is not torch.Tensor else f"{tensor.layout} tensor"
            raise refused(self.checkpoint, name, f"holds a {what} {where}, not a plain tensor")
        expected = tensor_md.properties.dtype
        if tensor.dtype != expected or tensor.shape != sizes:
            raise refused(self.checkpoint, name, f"holds a {dtype_name(tensor.dtype)} tensor of shape "
                                                 f"{list(tensor.shape)} {where} as {dtype_name(expected)} of "
                                                 f"shape {list(sizes)}")
        return tensor


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, minus the one thing a checkpoint must never make it do: unpickle an object."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, refused if it would read anything but tensors."""
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise _never_unpickled(self.checkpoint, item.dest_index.fqn)
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Refuse: DCP's planner would `torch.load(weights_only=False)` these bytes."""
        raise _never_unpickled(self.checkpoint, read_item.dest_index.fqn)
