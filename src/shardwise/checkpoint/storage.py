"""Atomic, resumable, resharding checkpoints written with torch.distributed.checkpoint (DCP).

Layout of a run directory:

    RUN_DIR/checkpoints/step_00000100/   one complete checkpoint
        .metadata.json                   DCP metadata of every rank's shards, as JSON (never pickle)
        __0_0.distcp __1_0.distcp ...    tensors, one file per rank: model, optimizer state, fp32 masters
        trainer_state.json               step, data position, loss scaler, global tensor shapes (rank 0)
        rng_rank0.json rng_rank1.json    random generator states, one file per rank
        config.yaml, tokenizer/          what `shardwise generate` needs to use it on its own
        adapter/                         a LoRA run's adapters in peft's format
        checksums.json                   every other file's size and SHA-256, written last

Tensors are stored by canonical name in groups: `model.<param>` (no wrapper prefixes such as
`_checkpoint_wrapped_module.` or `_orig_mod.`), `optim.<param>.<state key>` and, at precision level
O2, `master.<param>`. DCP records every tensor by its global shape and each shard by its offsets, so
a checkpoint written under one layout (one process, FSDP2/ZeRO, tensor parallel, pipeline stages that
each hold some layers) loads under any other: every rank reads the pieces its own shards cover.

A checkpoint is written into a hidden temporary directory shared by all ranks and renamed into place
by rank 0 only when every rank's files are on disk (checked: every shard file the DCP metadata names,
and every rank's state file, so that ranks writing to disks of their own nodes never publish a
checkpoint with shards missing); a failure on any rank stops every rank before the rename, so the
previous checkpoints stay the newest good ones. Whatever stands at the checkpoint's place (one a crash
left incomplete) is moved aside to `step_N.incomplete-<time>`, kept and named in a warning, never
written into or skipped. Every load first checks each file against `checksums.json`
(`verify_checkpoint`). `is_complete` checks the shard files too. An asynchronous save
(`start_async_save`, `finish_async_save`) copies the tensors into host memory and returns; DCP writes
them into the same temporary directory in the background, and the directory is published the same
way, later, once every rank's write has finished.

A checkpoint may come from anywhere: every load goes through `_dcp_load`, which reads it with
`checkpoint.format` (metadata as validated JSON, tensors with `torch.load(weights_only=True)`, checked
against the metadata; nothing is unpickled), and the JSON files beside the tensors are checked as they
are read. (DCP exchanges its save and load plans between the processes of a job with pickled objects
in memory; nothing pickled is written to disk or read from it.)
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..errors import CheckpointError
from ..files import fsync_dir, fsync_tree, plain_file_name, write_json_atomic
from ..parallel.collectives import all_reduce, attempt, fail_together
from .format import (
    METADATA_FILE,
    SMALL_JSON_LIMIT,
    JsonMetadataWriter,
    SafeCheckpointReader,
    TensorOnlyLoadPlanner,
    is_count,
    read_json_object,
    refused,
)
from .rng import capture as capture_rng

log = logging.getLogger(__name__)

CPU = torch.device("cpu")

STATE_FILE = "trainer_state.json"
CHECKSUMS_FILE = "checksums.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: Any = None) -> int:
    return dist.get_rank(group) if _distributed() else 0


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if _distributed() else 1


# --- Per-rank state ------------------------------------------------------------------------------------------


def rank_state_file(path: str | Path, rank: int) -> Path:
    """The file holding rank `rank`'s own state (its random generators) in a checkpoint."""
    return Path(path) / f"rng_rank{rank}.json"


def read_rank_state(path: str | Path, rank: int) -> dict | None:
    """Rank `rank`'s saved state (`train.rng.capture`), or None when the checkpoint has none for it."""
    file = rank_state_file(path, rank)
    return read_json_object(file, Path(path), limit=SMALL_JSON_LIMIT) if file.is_file() else None


def saved_ranks(path: str | Path) -> int:
    """How many ranks saved their own state into a checkpoint."""
    return sum(1 for p in Path(path).glob("rng_rank*.json") if p.is_file())


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
    """A checkpoint counts only when its metadata and trainer state are both on disk, and every shard
    file the metadata names (`missing_shards`)."""
    return (path / METADATA_FILE).is_file() and (path / STATE_FILE).is_file() and not missing_shards(path)


def shard_files(md: Metadata) -> list[str]:
    """The shard files (names relative to the checkpoint directory) that DCP's metadata puts tensors in."""
    return sorted({info.relative_path for info in (md.storage_data or {}).values()})


def missing_shards(path: Path) -> list[str]:
    """Shard files that `path`'s metadata names but that are not in the directory (a rank's files written
    to a disk of its node's own, or lost since). A metadata file that cannot be read names none here: the
    load refuses it with the reason."""
    try:
        storage = read_json_object(path / METADATA_FILE, path).get("storage")
    except CheckpointError:
        return []
    if not isinstance(storage, list):
        return []
    names = {entry.get("path") for entry in storage if isinstance(entry, dict)}
    return sorted(n for n in names if isinstance(n, str) and not (path / n).is_file())


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
        raise CheckpointError(f"--resume {resume}: {_incomplete(path)}; use an older one or --resume auto")
    return path


def _incomplete(path: Path) -> str:
    """What makes the checkpoint `path` incomplete."""
    missing = missing_shards(path) if (path / METADATA_FILE).is_file() else []
    if missing:
        return (f"the checkpoint is incomplete: its shard file(s) {', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''} are missing")
    return f"the checkpoint is incomplete (missing {METADATA_FILE} or {STATE_FILE})"


# --- Save and load: flat tensor groups -------------------------------------------------------------------


def tensor_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Name -> (global) shape, recorded so that a load into another model shape fails clearly."""
    return {k: list(v.shape) for k, v in tensors.items()}


def _check_tensor_values(tensors: dict[str, dict[str, Any]]) -> None:
    for group, items in tensors.items():
        for name, value in items.items():
            if not torch.is_tensor(value):
                raise CheckpointError(
                    f"checkpoint item {group}.{name} is a {type(value).__name__}, not a tensor: checkpoints "
                    "hold tensors only (anything else would need pickle); put it in the trainer state")


def _shapes_from_metadata(md: Metadata, groups: Any) -> dict[str, dict[str, list[int]]]:
    """Global shapes of every tensor that any rank saved, by group (DCP keys are `group.name`)."""
    shapes: dict[str, dict[str, list[int]]] = {g: {} for g in groups}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            group, _, name = fqn.partition(".")
            shapes.setdefault(group, {})[name] = list(item.size)
    return shapes


def step_dir(run_dir: str | Path, step: int) -> Path:
    """The directory the checkpoint of `step` is published under."""
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def _temporary_dir(final: Path) -> Path:
    """Where the checkpoint `final` is written before it is published (hidden: never taken for one)."""
    return final.parent / f".{final.name}.tmp"


def save_checkpoint(run_dir: str | Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    trainer_state: dict, extra_files: dict[str, str | Path] | None = None,
                    keep: int = 3, *, rank_state: dict | None = None, process_group: Any = None,
                    before_publish: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint for `step` atomically, then drop all but the newest `keep`.

    `tensors` maps groups ("model", "optim", "master") to flat name -> tensor dicts; `extra_files`
    maps names inside the checkpoint to files or directories to copy (config, tokenizer);
    `rank_state` is this rank's own JSON state (its random generators; default: the CPU's).

    Distributed (torch.distributed initialised): every rank of `process_group` (default: all) calls
    this with its own tensors - DTensor shards (FSDP2, tensor parallel) or plain tensors, and the
    ranks need not hold the same names (pipeline stages); replicated tensors are written once.
    `run_dir` must be the same shared directory on every rank. `trainer_state` and `extra_files` are
    taken from rank 0 only. Every rank returns the final path, or every rank raises.

    Every file gets its SHA-256 checksum in `checksums.json` (each rank hashes the shard files it wrote;
    rank 0 the rest, then writes the manifest last). `before_publish(tmp)` runs on rank 0 once the
    tensors and the trainer state are in the temporary directory, before the manifest: what it adds
    there (a LoRA run's adapter) is published with the checkpoint, or not at all.

    A directory already at the step's place is never written into nor skipped: it is moved aside
    (`_move_aside`), kept, and a warning says where.
    """
    group = process_group
    rank = _rank(group)
    final = step_dir(run_dir, step)
    tmp = _temporary_dir(final)
    _, error = attempt(lambda: _prepare_temporary(tmp, final, rank, tensors))
    fail_together(error, group, f"preparing {tmp}", error_class=CheckpointError)
    # DCP stops every rank with a CheckpointException when any rank fails inside it.
    with warnings.catch_warnings():  # DCP warns that one process means no process group: we know
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        metadata = dcp.save(tensors, storage_writer=JsonMetadataWriter(tmp, sync_files=True),
                            process_group=group, no_dist=not _distributed())

    def finish_rank() -> None:
        write_json_atomic(rank_state_file(tmp, rank), rank_state if rank_state is not None else capture_rng(CPU))
        hash_own_files(tmp, rank)
    _, error = attempt(finish_rank)
    fail_together(error, group, f"writing {tmp}", error_class=CheckpointError)
    # Rank 0, once every rank's files are on disk; the other ranks wait in `fail_together` for the rename.
    _, error = attempt(lambda: _publish(tmp, final, step, trainer_state, metadata, list(tensors), extra_files,
                                        keep, _world(group), before_publish)) if rank == 0 else (None, None)
    fail_together(error, group, f"finishing {final}", error_class=CheckpointError)
    if rank == 0:
        log.info("saved checkpoint %s", final)
    return final


def _prepare_temporary(tmp: Path, final: Path, rank: int, tensors: dict[str, dict[str, Any]]) -> None:
    """Check what is to be saved; on rank 0 create the empty temporary directory (stale ones removed),
    after moving aside whatever is at `final`'s place."""
    _check_tensor_values(tensors)
    if rank == 0:
        check_checkpoint_root(tmp.parent)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(tmp.parent)
        if os.path.lexists(final):
            _move_aside(final)
        tmp.mkdir()


def check_checkpoint_root(root: Path) -> None:
    """RUN_DIR/checkpoints must be a directory of the run's own, not a symbolic link: saves write into it
    and remove old checkpoints from it, which would happen in the directory the link points to."""
    if root.is_symlink():
        raise CheckpointError(
            f"{root} is a symbolic link (to {os.readlink(root)}): shardwise writes checkpoints into it and removes "
            "old ones from it, so it never works through a link. To keep checkpoints on another disk, set "
            "train.output_dir to a directory on that disk (and remove the link)")


def _move_aside(final: Path) -> Path:
    """Rename what stands at a checkpoint's place (a checkpoint left incomplete by a crash, a complete one
    that a resume skipped past, a link) to `step_N.incomplete-<time>` / `step_N.replaced-<time>`: a name
    `list_checkpoints` never takes for a checkpoint and nothing of shardwise ever removes. The warning
    says where it went; the user may look at it, and delete it."""
    complete = final.is_dir() and not final.is_symlink() and is_complete(final)
    kind = "replaced" if complete else "incomplete"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = final.with_name(f"{final.name}.{kind}-{stamp}")
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = final.with_name(f"{final.name}.{kind}-{stamp}-{n}")
    os.rename(final, aside)
    fsync_dir(final.parent)
    if complete:
        log.warning("%s already held a complete checkpoint that this run did not resume from (another run "
                    "writing into the same train.output_dir?); it was moved to %s, kept, and the checkpoint of "
                    "this run is saved in its place", final, aside)
    else:
        log.warning("%s held an incomplete checkpoint (%s; left by a save that did not finish); it was moved to "
                    "%s, kept (delete it when you no longer need it), and the new checkpoint is saved in its place",
                    final, "a symbolic link" if final.is_symlink() or aside.is_symlink() else _incomplete(aside),
                    aside)
    return aside


def _publish(tmp: Path, final: Path, step: int, trainer_state: dict, metadata: Metadata, groups: list[str],
             extra_files: dict[str, str | Path] | None, keep: int, world: int,
             before_publish: Callable[[Path], None] | None = None) -> None:
    """Rank 0, once every rank's files are in `tmp` (checked: the shard files the metadata names and the
    state file of each of the `world` ranks): the extra files and the trainer state beside them,
    `before_publish`'s files, the checksum manifest last, everything flushed, `tmp` renamed to `final`,
    then all but the newest `keep` checkpoints removed."""
    for name, src in (extra_files or {}).items():
        src = Path(src)
        if src.is_dir():
            shutil.copytree(src, tmp / name)  # copies of the files, links followed: the checkpoint holds no link
        elif src.is_file():
            shutil.copyfile(src, tmp / name)
    _check_every_file(tmp, final, metadata, world)
    state = dict(trainer_state, step=step, shapes=_shapes_from_metadata(metadata, groups))
    write_json_atomic(tmp / STATE_FILE, state)
    if before_publish is not None:
        before_publish(tmp)
    write_checksums(tmp, world)
    fsync_tree(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    _prune(final.parent.parent, keep)


def _check_every_file(tmp: Path, final: Path, metadata: Metadata, world: int) -> None:
    """Every shard file DCP's metadata names, and every rank's state file, is in `tmp`: a rank whose
    train.output_dir is a disk of its node's own wrote its files there, and the checkpoint must not be
    published without them."""
    missing = [name for name in shard_files(metadata) if not (tmp / name).is_file()]
    missing += [rank_state_file(tmp, r).name for r in range(world) if not rank_state_file(tmp, r).is_file()]
    if not missing:
        return
    shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
    raise CheckpointError(
        f"checkpoint {final.name} was not published: {len(missing)} file(s) the ranks wrote are not in {tmp} as "
        f"rank 0 sees it ({shown}). The ranks do not share train.output_dir's storage (a disk of each node's own?): "
        "put train.output_dir on a file system that every node mounts at the same path (NFS, Lustre, GPFS, ...; "
        f"in Kubernetes a ReadWriteMany volume). The newest complete checkpoint in {final.parent} is still the "
        "one before it")


# --- Checksums: every file of a checkpoint, recorded when saved and checked when loaded -------------------
#
# checksums.json = {"format": 1, "algorithm": "sha256", "files": {"<relative path>": {"size": N, "sha256": HEX}}}
# lists every file of the checkpoint but itself; it is written last, before the rename. Each rank hashes the
# shard files and the random state it wrote (`hash_own_files`, into a hidden `.checksums_rank<r>.json` that
# rank 0 folds into the manifest); rank 0 hashes the rest. SHA-256 because it is the fastest of hashlib's
# strong hashes on CPUs with SHA extensions (x86 since Ice Lake / Zen, ARMv8): it guards against disk and
# copy faults, not against someone who rewrites the manifest too (`format` checks what no one may write).

_MANIFEST_FORMAT = 1
_HASH = "sha256"
_BLOCK = 8 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
_MAX_FILES = 1_000_000
_OWN_DIGESTS = re.compile(r"^\.checksums_rank(\d+)\.json$")


def file_digest(path: Path) -> str:
    """The SHA-256 of a regular file (not followed through a symbolic link), read in 8 MiB blocks."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        h = hashlib.sha256()
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _own_digests_file(tmp: Path, rank: int) -> Path:
    return tmp / f".checksums_rank{rank}.json"


def hash_own_files(tmp: Path, rank: int) -> None:
    """On each rank, after its writes: the checksums of the shard files it wrote (`__<rank>_*.distcp`) and
    of its random state, into `.checksums_rank<rank>.json` for rank 0 to fold into the manifest."""
    names = [p.name for p in tmp.iterdir() if p.name.startswith(f"__{rank}_") and p.name.endswith(".distcp")]
    names.append(rank_state_file(tmp, rank).name)
    files = {}
    for name in sorted(names):
        files[name] = {"size": os.stat(tmp / name).st_size, _HASH: file_digest(tmp / name)}
    write_json_atomic(_own_digests_file(tmp, rank), files)


def _files_below(path: Path) -> dict[str, os.stat_result]:
    """Every file below `path` by relative name (POSIX separators), directories walked without following
    links; a symbolic link or anything but a regular file or directory is refused (shardwise writes none)."""
    found: dict[str, os.stat_result] = {}
    pending = [Path()]
    while pending:
        rel = pending.pop()
        for entry in os.scandir(path / rel):
            name = (rel / entry.name).as_posix()
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                pending.append(rel / entry.name)
            elif stat.S_ISREG(st.st_mode):
                found[name] = st
            else:
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise refused(path, name, f"is {what}; shardwise writes only regular files into a checkpoint")
            if len(found) > _MAX_FILES:
                raise refused(path, ".", f"holds more than {_MAX_FILES:,} files")
    return found


def write_checksums(tmp: Path, world: int = 1) -> None:
    """Rank 0, last before publishing: `checksums.json`, from the ranks' own checksums of their files
    (checked against the files' sizes) and rank 0's of the rest."""
    files: dict[str, dict] = {}
    for rank in range(world):
        own = _own_digests_file(tmp, rank)
        if own.is_file():
            files.update(_manifest_entries(read_json_object(own, tmp), tmp, own.name))
            own.unlink()
    present = _files_below(tmp)
    for name in [n for n in present if _OWN_DIGESTS.match(n)]:  # a rank of another world size: stale
        (tmp / name).unlink()
        present.pop(name)
    present.pop(CHECKSUMS_FILE, None)
    for name in [n for n in files if n not in present or present[n].st_size != files[n]["size"]]:
        files.pop(name)  # changed since its rank hashed it (cannot happen but by a bug): hash it again
    for name, st in present.items():
        if name not in files:
            files[name] = {"size": st.st_size, _HASH: file_digest(tmp / name)}
    manifest = {"format": _MANIFEST_FORMAT, "algorithm": _HASH, "files": dict(sorted(files.items()))}
    write_json_atomic(tmp / CHECKSUMS_FILE, manifest)


def _manifest_entries(doc: Any, path: Path, file: str) -> dict[str, dict]:
    """{relative name: {"size", "sha256"}} checked by type and range (the names: relative, plain parts)."""
    def bad(problem: str) -> CheckpointError:
        return refused(path, file, problem)

    if not isinstance(doc, dict) or len(doc) > _MAX_FILES:
        raise bad("has no object of files")
    out = {}
    for name, entry in doc.items():
        parts = name.split("/")
        if not all(plain_file_name(part) for part in parts) or len(name) > 4096:
            raise bad(f"lists {name[:200]!r}, which is not a file name inside the checkpoint")
        if not isinstance(entry, dict) or set(entry) != {"size", _HASH}:
            raise bad(f"gives {name} the entry {str(entry)[:200]}; shardwise writes "
                      f"{{\"size\": ..., \"{_HASH}\": ...}}")
        if not is_count(entry["size"]) or not isinstance(entry[_HASH], str) or not _HEX.match(entry[_HASH]):
            raise bad(f"gives {name} the size {entry['size']!r} and checksum {str(entry[_HASH])[:80]!r}; a size is a "
                      "non-negative integer, a SHA-256 checksum 64 hexadecimal digits")
        out[name] = entry
    return out


def read_checksums(path: Path) -> dict[str, dict] | None:
    """The checked entries of a checkpoint's `checksums.json`, or None when it has none (an older checkpoint)."""
    file = path / CHECKSUMS_FILE
    if not os.path.lexists(file):
        return None
    doc = read_json_object(file, path)
    if doc.get("format") != _MANIFEST_FORMAT or doc.get("algorithm") != _HASH:
        raise refused(path, CHECKSUMS_FILE, f"has the format {str(doc.get('format'))[:40]!r} and algorithm "
                                            f"{str(doc.get('algorithm'))[:40]!r}; this shardwise writes and reads "
                                            f"format {_MANIFEST_FORMAT} with {_HASH}")
    return _manifest_entries(doc.get("files"), path, CHECKSUMS_FILE)


def _changed(path: Path, name: str, how: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} cannot be loaded: {name} changed since it was saved ({how}): a disk or copy fault, "
        f"or an edit. Copy the checkpoint again from where it was saved (its {CHECKSUMS_FILE} lists every file's "
        f"checksum: `sha256sum`), or load an older checkpoint of the run (--resume {path.parent}/step_...)")


def _verify_listing(path: Path, entries: dict[str, dict]) -> list[str]:
    """Files listed and present with the listed sizes (cheap: no file read); the names, in order."""
    present = _files_below(path)
    present.pop(CHECKSUMS_FILE, None)
    # A whole directory beside the tensors left out of a copy (tokenizer/, adapter/) is no damage to what a load
    # reads: what needs it says so (generate asks for --tokenizer). A file missing from one that is there is.
    gone = {name.split("/")[0] for name in entries if "/" in name and not os.path.lexists(path / name.split("/")[0])}
    for directory in sorted(gone):
        log.warning("%s: %s/ was saved with the checkpoint (its %s lists it) but is not there any more; loading "
                    "without it", path, directory, CHECKSUMS_FILE)
    entries = {name: entry for name, entry in entries.items() if name.split("/")[0] not in gone or "/" not in name}
    for name in sorted(entries):
        if name not in present:
            raise _changed(path, name, f"it is missing, but {CHECKSUMS_FILE} lists it")
        if present[name].st_size != entries[name]["size"]:
            raise _changed(path, name, f"it has {present[name].st_size:,} bytes; {entries[name]['size']:,} were saved")
    extra = sorted(set(present) - set(entries))
    if extra:
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded: {extra[0]} was not saved with it ({CHECKSUMS_FILE} does not list "
            f"it{f', nor {len(extra) - 1} more' if len(extra) > 1 else ''}): it was added or renamed since. Remove "
            "it, or copy the checkpoint again from where it was saved")
    return sorted(entries)


def verify_checkpoint(path: str | Path, *, process_group: Any = None, no_dist: bool | None = None) -> bool:
    """Check every file of a checkpoint against its `checksums.json`: none missing, none added, each with
    its size and SHA-256 (the ranks of a job share the hashing, file by file, and fail together).
    A CheckpointError names the first file that changed. A checkpoint without a manifest (written before
    shardwise kept checksums) loads with a warning; returns whether the files were verified."""
    path = Path(path)
    alone = not _distributed() if no_dist is None else no_dist
    rank, world = (0, 1) if alone else (_rank(process_group), _world(process_group))

    def check() -> bool:
        entries = read_checksums(path)
        if entries is None:
            return False
        names = _verify_listing(path, entries)
        for name in names[rank::world]:
            if file_digest(path / name) != entries[name][_HASH]:
                raise _changed(path, name, f"its {_HASH} checksum is not the one in {CHECKSUMS_FILE}")
        return True
    verified, error = attempt(check)
    if not alone:
        fail_together(error, process_group, verbatim=True, error_class=CheckpointError)
    elif error is not None:
        raise error
    if not verified and rank == 0:
        log.warning("%s has no %s (saved by a shardwise before checksums, or removed): its files are loaded "
                    "without checking that they are the bytes that were saved", path, CHECKSUMS_FILE)
    return bool(verified)


def skipped_verification(path: str | Path, switch: str = "train.verify_checkpoints is false") -> None:
    """Say that a checkpoint's files are loaded unchecked, and which `switch` said so."""
    log.warning("%s: the files of %s are not checked against its %s, so a flipped bit in them would load "
                "unnoticed", switch, path, CHECKSUMS_FILE)


# --- Asynchronous saves: staged in host memory, written in the background, published later ---------------


class HostStager:
    """DCP's stager for `start_async_save`: synchronous copies into host memory, pinned (and copied
    without blocking, then synchronised once) where CUDA is available. It keeps its host buffers
    between saves (one copy of the state for the run), refilled in place by each save.

    torch 2.11's DefaultStager empties itself at the end of every `stage` (its buffers and the table it
    copies with), so that a second save raises KeyError there; where it did, the next save gets a fresh
    one (and new buffers, as that torch would give it anyway)."""

    def __init__(self) -> None:
        self._stager = self._new()

    @staticmethod
    def _new() -> DefaultStager:
        cuda = torch.cuda.is_available()
        return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=cuda))

    def stage(self, tensors: dict) -> dict:
        """A copy of `tensors` in host memory (DCP's state-dict layout, as `dcp.save` takes it)."""
        staged = self._stager.stage(tensors)
        if not getattr(self._stager._state_dict_stager, "_deepcopy_dispatch", True):  # emptied (torch 2.11)
            self._stager = self._new()
        return staged


@dataclass
class PendingCheckpoint:
    """A checkpoint whose tensors are being written in the background; `finish_async_save` publishes it."""

    final: Path
    step: int
    trainer_state: dict
    extra_files: dict[str, str | Path] | None
    keep: int
    groups: list[str]
    process_group: Any
    write: Future  # -> DCP's Metadata, or the write's exception
    before_publish: Callable[[Path], None] | None = None

    @property
    def tmp(self) -> Path:
        """The hidden directory it is written into."""
        return _temporary_dir(self.final)


def start_async_save(run_dir: str | Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                     trainer_state: dict, extra_files: dict[str, str | Path] | None = None, keep: int = 3, *,
                     rank_state: dict, process_group: Any, stager: HostStager,
                     executor: ThreadPoolExecutor,
                     before_publish: Callable[[Path], None] | None = None) -> PendingCheckpoint:
    """Begin the checkpoint of `step` as `save_checkpoint` writes it, but return once the tensors are
    staged (copied by `stager` into host memory): DCP writes them from there on `executor`'s thread,
    into the same hidden temporary directory, with `process_group` (a group of its own: the write's
    collectives must not interleave with training's). Nothing is published until `finish_async_save`.

    Every rank calls it; every rank returns, or every rank raises (nothing is then left running).
    What stands at the step's place is moved aside as `save_checkpoint` does."""
    group = process_group
    rank = _rank(group)
    final = step_dir(run_dir, step)
    tmp = _temporary_dir(final)

    def prepare() -> dict:
        _prepare_temporary(tmp, final, rank, tensors)
        return stager.stage(tensors)
    staged, error = attempt(prepare)
    fail_together(error, group, f"preparing {tmp}", error_class=CheckpointError)
    _, error = attempt(lambda: write_json_atomic(rank_state_file(tmp, rank), rank_state))
    fail_together(error, group, f"writing {tmp}", error_class=CheckpointError)
    if not _distributed():
        _quiet_single_process_warning()
    write = executor.submit(_write_tensors, staged, tmp, group, rank)
    return PendingCheckpoint(final=final, step=step, trainer_state=trainer_state, extra_files=extra_files, keep=keep,
                             groups=list(tensors), process_group=group, write=write, before_publish=before_publish)


def _write_tensors(staged: dict, tmp: Path, group: Any, rank: int) -> Metadata:
    """The background part of an asynchronous save: DCP writes the staged tensors into `tmp`, then this
    rank hashes the files it wrote (off the training thread too)."""
    metadata = dcp.save(staged, storage_writer=JsonMetadataWriter(tmp, sync_files=True), process_group=group,
                        no_dist=not _distributed())
    hash_own_files(tmp, rank)
    return metadata


def _quiet_single_process_warning() -> None:
    # DCP warns from the writing thread that one process means no process group; a filter scoped by
    # `catch_warnings` would be undone there by the main thread, so this one stays (it matches that
    # message only).
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled.*save in a single process")


def _outcome(pending: PendingCheckpoint) -> tuple[Metadata | None, CheckpointError | None]:
    """(the metadata, None) once the background write finished, or (None, the error saying why it failed)."""
    try:
        return pending.write.result(), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        where = ""
        if isinstance(e, CheckpointException) and e.failures:  # every rank's failure: the first rank's cause
            rank = min(e.failures)
            where, e = (f" on rank {rank}" if _distributed() else ""), e.failures[rank][0]
        return None, CheckpointError(
            f"the background write of checkpoint {pending.final} (into {pending.tmp}) failed{where}: "
            f"{type(e).__name__}: {e}. It was not published: the newest complete checkpoint in "
            f"{pending.final.parent} is still the one before it")


def finish_async_save(pending: PendingCheckpoint) -> Path:
    """Wait for `pending`'s background write on every rank, then publish it as `save_checkpoint` does
    (rank 0 renames it into place once the ranks agree that every write finished). A failed write
    raises a CheckpointError on every rank naming the checkpoint and the cause; its temporary directory
    is removed and the previous checkpoint stays the newest good one."""
    group, final, tmp = pending.process_group, pending.final, pending.tmp
    rank = _rank(group)
    metadata, error = _outcome(pending)
    try:
        fail_together(error, group, f"the background write of checkpoint {final}", error_class=CheckpointError)
        _, error = attempt(lambda: _publish(tmp, final, pending.step, pending.trainer_state, metadata,
                                            pending.groups, pending.extra_files, pending.keep, _world(group),
                                            pending.before_publish)) \
            if rank == 0 else (None, None)
        fail_together(error, group, f"finishing {final}", error_class=CheckpointError)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        log.info("saved checkpoint %s (written in the background)", final)
    return final


def _remove_stale_temporaries(root: Path) -> None:
    # Only hidden .tmp directories: they were never renamed into place, so they hold no good state.
    for p in root.iterdir():
        if p.name.startswith(".step_") and p.name.endswith(".tmp"):
            if p.is_symlink():
                p.unlink()  # only the link: never what it points to
            elif p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def _prune(run_dir: str | Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        if old.is_symlink():  # removing through it would delete what the link points to
            log.warning("%s is a symbolic link; old checkpoints are removed only when they are directories of the "
                        "run's own, so it is left as it is (keep_checkpoints=%d)", old, keep)
            continue
        shutil.rmtree(old)
        log.info("removed old checkpoint %s (keep_checkpoints=%d)", old, keep)


def read_trainer_state(path: str | Path) -> dict:
    """The JSON trainer state of a checkpoint, its fields checked (the checkpoint may come from elsewhere)."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{path} has no {STATE_FILE}: it is not a complete shardwise checkpoint")
    state = read_json_object(file, Path(path))
    _check_trainer_state(state, Path(path))
    return state


def _check_trainer_state(state: dict, path: Path) -> None:
    """The fields read back have the types `save_checkpoint` writes, so a crafted or hand-edited file
    fails here, naming the field, instead of deep inside a load."""
    def bad(problem: str) -> CheckpointError:
        return refused(path, STATE_FILE, problem)

    if not is_count(state.get("step")):
        raise bad(f"has the step {state.get('step')!r}; it must be a non-negative integer")
    shapes = state.get("shapes")
    if not isinstance(shapes, dict):
        raise bad(f"has the shapes {shapes!r}; they must be an object of groups (model, optim, ...)")
    for group, names in shapes.items():
        if not isinstance(names, dict):
            raise bad(f"has the shapes of group {group!r} as {names!r}; they must be an object of tensor names")
        for name, shape in names.items():
            if not isinstance(shape, list) or not all(is_count(n) for n in shape):
                raise bad(f"gives {group}.{name} the shape {shape!r}; a shape is a list of non-negative integers")
    if not isinstance(state.get("loader", {}), dict):
        raise bad(f"has the data loader state {state['loader']!r}; it must be an object")
    if state.get("scaler") is not None and not isinstance(state["scaler"], dict):
        raise bad(f"has the loss scaler state {state['scaler']!r}; it must be an object or null")
    layout = state.get("layout")
    if layout is not None and (not isinstance(layout, dict) or
                               not all(isinstance(k, str) and is_count(v) for k, v in layout.items())):
        raise bad(f"has the layout {str(layout)[:200]}; it must be an object of counts (world_size, dp, tp, pp)")
    base = state.get("base")
    if base is not None and (not isinstance(base, dict) or not isinstance(base.get("files"), dict)):
        raise bad(f"has the base model fingerprint {str(base)[:200]}; it must be an object with the base's files")


_MISMATCH_HINTS = {
    "model": "it was saved from another model; check model.* against the checkpoint's config.yaml",
    "optim": "the optimizer state differs; resume with the train.optimizer the checkpoint was saved with "
             "(see its config.yaml)",
    "master": "the fp32 master weights differ from the model's; check model.* against the checkpoint's "
              "config.yaml",
}


def _hint(group: str) -> str:
    return _MISMATCH_HINTS.get(group, _MISMATCH_HINTS["model"])


def _check_held(path: str | Path, group: str, tensors: dict[str, torch.Tensor], saved: dict) -> None:
    """The tensors this process holds must be in the checkpoint, with the same (global) shape."""
    for name, t in tensors.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {group}.{name}: {_hint(group)}")
        if list(t.shape) != saved[name]:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run: {group}.{name} has shape {saved[name]} in the "
                f"checkpoint but {list(t.shape)} here; {_hint(group)}"
            )


def _extra_error(path: str | Path, group: str, extra: list[str]) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} holds {group}.{sorted(extra)[0]}, which this run lacks: "
                           f"{_hint(group)}")


def check_shapes(path: str | Path, group: str, tensors: dict[str, torch.Tensor]) -> None:
    """Fail naming the first tensor whose saved shape differs from the run's (or is missing)."""
    saved = read_trainer_state(path).get("shapes", {}).get(group, {})
    _check_held(path, group, tensors, saved)
    extra = sorted(set(saved) - set(tensors))
    if extra:
        raise _extra_error(path, group, extra)


def check_all_shapes(path: str | Path, tensors: dict[str, dict[str, torch.Tensor]],
                     process_group: Any = None) -> None:
    """`check_shapes` for every group, across the ranks of a distributed run.

    Each rank checks the tensors it holds; a saved tensor counts as lacking only when no rank holds it
    (pipeline stages hold some layers each). Every rank raises the same message, or none does.
    """
    if not _distributed():
        _check_tensor_values(tensors)
        for group, group_tensors in tensors.items():
            check_shapes(path, group, group_tensors)
        return

    def check_held() -> dict:
        _check_tensor_values(tensors)
        saved = read_trainer_state(path).get("shapes", {})
        for g, t in tensors.items():
            _check_held(path, g, t, saved.get(g, {}))
        return saved
    shapes, error = attempt(check_held)
    fail_together(error, process_group, verbatim=True, error_class=CheckpointError)
    # Which saved names does any rank hold? One flag per group ("this rank loads the group"), then one
    # per saved name, in an order every rank derives from the same file.
    groups = sorted(shapes)
    names = {g: sorted(shapes[g]) for g in groups}
    flags = []
    for g in groups:
        held = tensors.get(g)
        flags.append(int(held is not None))
        flags.extend(int(held is not None and n in held) for n in names[g])
    if not flags:
        return
    reduced = all_reduce(torch.tensor(flags, dtype=torch.int32), process_group, dist.ReduceOp.MAX)
    reduced_list, i = reduced.tolist(), 0
    for g in groups:
        loaded, held = reduced_list[i], reduced_list[i + 1: i + 1 + len(names[g])]
        i += 1 + len(names[g])
        extra = [n for n, h in zip(names[g], held) if not h]
        if loaded and extra:
            raise _extra_error(path, g, extra)


def _check_against_metadata(md: Metadata, tensors: dict[str, dict[str, torch.Tensor]], path: Path) -> None:
    """Every tensor to load is in the checked metadata with its shape: the shapes were compared with
    trainer_state.json before, which a crafted checkpoint could make disagree with .metadata.json."""
    for group, items in tensors.items():
        for name, t in items.items():
            saved = md.state_dict_metadata.get(f"{group}.{name}")
            if saved is None:
                raise refused(path, METADATA_FILE, f"has no tensor {group}.{name}, which {STATE_FILE} lists")
            if list(saved.size) != list(t.shape):
                raise refused(path, METADATA_FILE, f"gives {group}.{name} the shape {list(saved.size)}, but "
                                                   f"{STATE_FILE} and the model have {list(t.shape)}")


def _checkpoint_error(e: CheckpointException) -> BaseException:
    """The first rank's CheckpointError inside DCP's wrapper of every rank's failures (else the wrapper)."""
    errors = [e.failures[rank][0] for rank in sorted(e.failures)]
    return next((error for error in errors if isinstance(error, CheckpointError)), e)


def _dcp_load(tensors: dict, path: Path, process_group: Any = None, no_dist: bool | None = None) -> None:
    """Load tensors in place through DCP, the way every load goes: the metadata validated before DCP
    plans anything (on every rank, failing together), chunks read and checked by `SafeCheckpointReader`,
    and a planner that never unpickles. `no_dist`: this process reads alone inside a distributed job."""
    alone = not _distributed() if no_dist is None else no_dist
    reader = SafeCheckpointReader(path)
    _, error = attempt(lambda: _check_against_metadata(reader.read_metadata(), tensors, path))
    if not alone:
        fail_together(error, process_group, verbatim=True, error_class=CheckpointError)
    elif error is not None:
        raise error
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(tensors, storage_reader=reader, planner=TensorOnlyLoadPlanner(path),
                     process_group=process_group, no_dist=alone)
    except CheckpointException as e:  # DCP wraps a failure on any rank: the user needs its message
        raise _checkpoint_error(e) from None


def load_checkpoint(path: str | Path, tensors: dict[str, dict[str, torch.Tensor]], *,
                    process_group: Any = None) -> dict:
    """Load tensors in place (after checking shapes) and return the trainer state (each rank's random
    state is the caller's: `read_rank_state`).

    Distributed: every rank calls it with the tensors it holds (DTensor shards or plain tensors, any
    layout); each reads the parts of the saved tensors that its shards cover.
    """
    path = Path(path)
    check_all_shapes(path, tensors, process_group)
    _dcp_load(tensors, path, process_group)
    return read_trainer_state(path)


def load_weights(path: str | Path, tensors: dict[str, dict[str, torch.Tensor]], *,
                 process_group: Any = None) -> None:
    """Load tensors in place (after checking shapes) and nothing else: no RNG, no trainer state. For
    starting a new run from a checkpoint's weights (`model.init_from`); every rank calls it."""
    path = Path(path)
    check_all_shapes(path, tensors, process_group)
    _dcp_load(tensors, path, process_group)


def read_saved_tensors(path: str | Path, group: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Whole fp32 copies of some saved tensors, read in this process alone (whatever layout wrote them)."""
    path = Path(path)
    # Sized by the checked metadata, whose chunks are bounded by the bytes on disk.
    saved = SafeCheckpointReader(path).read_metadata().state_dict_metadata
    missing = [n for n in names if f"{group}.{n}" not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no tensor {group}.{missing[0]}")
    tensors = {n: torch.empty(saved[f"{group}.{n}"].size, dtype=torch.float32) for n in names}
    _dcp_load({group: tensors}, path, no_dist=True)
    return tensors


def read_saved_group(path: str | Path, group: str, tensors: dict[str, torch.Tensor]) -> None:
    """Fill whole tensors in place from one group of a checkpoint, in this process alone (whatever
    layout wrote it); shapes are the caller's to have checked (`check_shapes`)."""
    _dcp_load({group: tensors}, Path(path), no_dist=True)


# --- A checkpoint given by the user ------------------------------------------------------------------------


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete one inside a run directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a checkpoint directory or a run directory")
    if _STEP_DIR.match(path.name):
        if not is_complete(path):
            raise CheckpointError(f"{path}: {_incomplete(path)}; use an older one")
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} holds no complete checkpoint (looked in {checkpoint_root(path)})")
    return found[-1]


