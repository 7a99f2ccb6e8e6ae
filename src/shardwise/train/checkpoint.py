"""Atomic, resumable checkpoints written with torch.distributed.checkpoint (DCP).

Layout of a run directory:

    RUN_DIR/checkpoints/step_00000100/   one complete checkpoint
        .metadata.json                   DCP metadata, as JSON (never pickle)
        __0_0.distcp ...                 tensors: model, optimizer state, fp32 master weights
        trainer_state.json               step, data position, loss scaler, tensor shapes
        rng_rank0.json                   random generator states, one file per rank
        config.yaml, tokenizer/          what `shardwise generate` needs to use it on its own

A checkpoint is written into a hidden temporary directory and renamed into place only when every
file is on disk, so a crash during a save leaves the previous checkpoints untouched. Tensors are
read back with `torch.load(weights_only=True)` by DCP and metadata with `json`: nothing is unpickled.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointError

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata.json"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# --- DCP storage with JSON metadata ------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _metadata_to_json(md: Metadata) -> dict:
    items = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            items[fqn] = {"kind": "bytes"}
        else:
            items[fqn] = {
                "kind": "tensor",
                "dtype": _dtype_name(m.properties.dtype),
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


def _metadata_from_json(doc: dict) -> Metadata:
    items: dict[str, Any] = {}
    for fqn, m in doc["state_dict"].items():
        if m["kind"] == "bytes":
            items[fqn] = BytesStorageMetadata()
            continue
        props = TensorProperties(dtype=getattr(torch, m["dtype"]), requires_grad=m["requires_grad"])
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                  for c in m["chunks"]]
        items[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(m["size"]), chunks=chunks)
    storage = {}
    for s in doc["storage"]:
        idx = MetadataIndex(fqn=s["fqn"], offset=None if s["offset"] is None else torch.Size(s["offset"]),
                            index=s["index"])
        storage[idx] = _StorageInfo(relative_path=s["path"], offset=s["byte_offset"], length=s["length"],
                                    transform_descriptors=s["transforms"])
    planner = {k: tuple(v) for k, v in doc["planner"].items()}
    return Metadata(state_dict_metadata=items, planner_data=planner, storage_data=storage,
                    version=doc["version"])


class JsonMetadataWriter(FileSystemWriter):
    """DCP's file writer, but the checkpoint's metadata is written as JSON instead of a pickle."""

    def finish(self, metadata: Metadata, results: list) -> None:
        """Write the metadata file once every rank's tensors are on disk."""
        storage = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage
        _write_json_atomic(Path(self.path) / METADATA_FILE, _metadata_to_json(metadata))


class JsonMetadataReader(FileSystemReader):
    """DCP's file reader for checkpoints written by `JsonMetadataWriter`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read the JSON metadata."""
        with open(Path(self.path) / METADATA_FILE, encoding="utf-8") as f:
            return _metadata_from_json(json.load(f))


# --- Small file helpers ----------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --- RNG ------------------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """Every random generator's state, JSON-serialisable."""
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    state = {"torch": b64(torch.get_rng_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned."""
    def unb64(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()

    torch.set_rng_state(unb64(state["torch"]))
    random.setstate(_tupled(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([unb64(s) for s in state["cuda"]])


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


# --- Finding checkpoints ----------------------------------------------------------------------------------


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / "checkpoints"


def step_of(path: str | Path) -> int:
    """The optimizer step a checkpoint directory was saved at."""
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path} is not a checkpoint directory (expected a name like step_00000100)")
    return int(m.group(1))


def is_complete(path: Path) -> bool:
    """A checkpoint counts only when its metadata and trainer state are both on disk."""
    return (path / METADATA_FILE).is_file() and (path / STATE_FILE).is_file()


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """`auto` -> the newest complete checkpoint of the run (or None); a path -> that checkpoint."""
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"--resume {resume}: no such directory; give a checkpoint path or 'auto'")
    if not _STEP_DIR.match(path.name):
        found = list_checkpoints(path)
        if not found:
            raise CheckpointError(f"--resume {resume}: no complete checkpoint in that directory")
        return found[-1]
    if not is_complete(path):
        raise CheckpointError(
            f"--resume {resume}: the checkpoint is incomplete (missing {METADATA_FILE} or {STATE_FILE}); "
            "use an older one or --resume auto"
        )
    return path


# --- Save and load ---------------------------------------------------------------------------------------


def tensor_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Name -> shape, recorded so that a load into another model shape fails clearly."""
    return {k: list(v.shape) for k, v in tensors.items()}


def save_checkpoint(run_dir: str | Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    trainer_state: dict, extra_files: dict[str, str | Path] | None = None,
                    keep: int = 3) -> Path:
    """Write a checkpoint for `step` atomically, then drop all but the newest `keep`.

    `tensors` maps groups ("model", "optim", "master") to flat name -> tensor dicts; `extra_files`
    maps names inside the checkpoint to files or directories to copy (config, tokenizer).
    """
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    if final.exists():
        log.info("checkpoint %s already exists; not saving it again", final)
        return final
    tmp = root / f".step_{step:08d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # DCP warns that one process means no process group: we know
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(tensors, storage_writer=JsonMetadataWriter(tmp, sync_files=True),
                 no_dist=not dist.is_initialized())
    _write_json_atomic(tmp / f"rng_rank{_rank()}.json", rng_state())
    _barrier()
    if _rank() == 0:
        for name, src in (extra_files or {}).items():
            src = Path(src)
            if src.is_dir():
                shutil.copytree(src, tmp / name)
            elif src.is_file():
                shutil.copy2(src, tmp / name)
        state = dict(trainer_state, step=step,
                     shapes={g: tensor_shapes(t) for g, t in tensors.items()})
        _write_json_atomic(tmp / STATE_FILE, state)
        _fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(run_dir, keep)
    _barrier()
    log.info("saved checkpoint %s", final)
    return final


def _remove_stale_temporaries(root: Path) -> None:
    # Only hidden .tmp directories: they were never renamed into place, so they hold no good state.
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(".step_") and p.name.endswith(".tmp"):
            shutil.rmtree(p, ignore_errors=True)


def _prune(run_dir: str | Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
        log.info("removed old checkpoint %s (keep_checkpoints=%d)", old, keep)


def read_trainer_state(path: str | Path) -> dict:
    """The JSON trainer state of a checkpoint."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{path} has no {STATE_FILE}: it is not a complete shardwise checkpoint")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


_MISMATCH_HINTS = {
    "model": "it was saved from another model; check model.* against the checkpoint's config.yaml",
    "optim": "the optimizer state differs; resume with the train.optimizer the checkpoint was saved with "
             "(see its config.yaml)",
    "master": "the fp32 master weights differ from the model's; check model.* against the checkpoint's "
              "config.yaml",
}


def check_shapes(path: str | Path, group: str, tensors: dict[str, torch.Tensor]) -> None:
    """Fail naming the first tensor whose saved shape differs from the run's (or is missing)."""
    saved = read_trainer_state(path).get("shapes", {}).get(group, {})
    hint = _MISMATCH_HINTS.get(group, _MISMATCH_HINTS["model"])
    for name, t in tensors.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {group}.{name}: {hint}")
        if list(t.shape) != saved[name]:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run: {group}.{name} has shape {saved[name]} in the "
                f"checkpoint but {list(t.shape)} here; {hint}"
            )
    extra = sorted(set(saved) - set(tensors))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds {group}.{extra[0]}, which this run lacks: {hint}")


def _dcp_load(tensors: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(tensors, storage_reader=JsonMetadataReader(path), no_dist=not dist.is_initialized())


def load_checkpoint(path: str | Path, tensors: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Load tensors in place (after checking shapes), restore RNG, and return the trainer state."""
    path = Path(path)
    for group, group_tensors in tensors.items():
        check_shapes(path, group, group_tensors)
    _dcp_load(tensors, path)
    rng_file = path / f"rng_rank{_rank()}.json"
    if rng_file.is_file():
        with open(rng_file, encoding="utf-8") as f:
            set_rng_state(json.load(f))
    return read_trainer_state(path)


# --- Using a checkpoint on its own (generation, from_pretrained) ------------------------------------------


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete one inside a run directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a checkpoint directory or a run directory")
    if _STEP_DIR.match(path.name):
        if not is_complete(path):
            raise CheckpointError(f"{path} is an incomplete checkpoint; use an older one")
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} holds no complete checkpoint (looked in {checkpoint_root(path)})")
    return found[-1]


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """Build the checkpoint's model from its config.yaml and load its weights (fp32 masters if any)."""
    from ..config import load_config
    from ..models import build_model

    path = find_checkpoint(path)
    cfg = load_config(path / "config.yaml")
    model = build_model(cfg.model, device=device, dtype=dtype)
    weights = dict(model.state_dict())
    groups = read_trainer_state(path).get("shapes", {})
    check_shapes(path, "model", weights)
    _dcp_load({"model": weights}, path)
    if "master" in groups:  # level O2: the fp32 master copies are the exact weights
        masters = {n: weights[n] for n in groups["master"] if n in weights}
        _dcp_load({"master": masters}, path)
    model.eval()
    return model, cfg
