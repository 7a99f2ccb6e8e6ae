"""Saving and loading a run's whole state: model parts, optimizer state, fp32 master weights, loss
scaler, data position, random generators and LoRA adapters, in any layout.

A run's model may be split into parts (pipeline stages; several per rank with interleaved schedules),
each wrapped for recompute, compile, FSDP2 or DDP and sharded as DTensors. The checkpointer takes the
parts as they are and names everything as one process would (`model.<param>` without wrapper
prefixes, `optim.<param>.<state key>`, `master.<param>`), so that a checkpoint written under one
layout loads under any other (`checkpoint.storage` does the writing and reading). It owns the three
things that make that true:

- names: canonical parameter names, and a pipeline's last-stage copy of a tied embedding matrix
  stored as the one matrix of one process (both copies are equal);
- precision: a run at level O2 keeps fp32 masters, which are the exact weights; a checkpoint saved
  with masters loads into a run without them and the other way round;
- ranks: each rank saves its own random state, restored only on the layout that saved it.

With `async_save`, `save` returns once the state is copied into host memory and the checkpoint is
written in the background; it is published (renamed into place) only later, from the main thread, once
every rank's write finished: at the next `save`, at `wait` or before a `load`.
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import _get_fqns, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..config import LoraConfig
from ..errors import CheckpointError, ConfigError
from ..models.config import ModelConfig
from ..models.hf import hf_buffers
from ..parallel.collectives import distributed, max_over, rank0_first, sum_over
from ..parallel.dtensors import local_tensor
from ..peft.lora import is_lora_name, save_adapter
from . import rng
from .storage import (
    STATE_FILE,
    HostStager,
    PendingCheckpoint,
    finish_async_save,
    is_complete,
    list_checkpoints,
    load_checkpoint,
    rank_state_file,
    read_rank_state,
    read_saved_tensors,
    read_trainer_state,
    resolve_resume,
    save_checkpoint,
    saved_ranks,
    skipped_verification,
    start_async_save,
    step_dir,
    step_of,
    verify_checkpoint,
)
from .weights import base_fingerprint, fingerprint_difference, load_pretrained_tensors

log = logging.getLogger(__name__)

# A tied embedding matrix is one parameter in one process, named by its first use (the embedding);
# a pipeline's last stage holds a copy of it under the output projection's name.
TIED_NAME, TIED_COPY = "tok_embeddings.weight", "output.weight"


# --- names ------------------------------------------------------------------------------------------


def canonical_param_names(parts: list[nn.Module]) -> dict[int, str]:
    """id(parameter) -> its canonical name (no `_checkpoint_wrapped_module.`, `_orig_mod.`, DDP's
    `module.`), the name `get_model_state_dict` gives it."""
    names: dict[int, str] = {}
    for part in parts:
        for name, p in part.named_parameters():
            fqns = _get_fqns(part, name)
            if len(fqns) != 1:
                raise CheckpointError(f"parameter {name} maps to several names {sorted(fqns)}: flat-parameter "
                                      "FSDP (version 1) is not supported; use fully_shard (FSDP2)")
            names.setdefault(id(p), next(iter(fqns)))
    return names


def model_state(parts: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Each part's state dict by canonical name; FSDP2 / tensor-parallel shards stay DTensors."""
    return [dict(get_model_state_dict(part)) for part in parts]


def optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                            named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as `param_name.key` -> tensor (non-tensor state is left out:
    it would need pickle); a name given twice keeps its first parameter's state.

    A state held as a tensor subclass (torchao's 8-bit moments: codes, block scales, the code map) is
    saved as its plain parts, `param_name.key.packed_<part>`, and in a distributed run as this rank's
    own (`...rank<r>`): its blocks follow the rank's shard, so it loads back only into the layout that
    saved it (`check_packed_state`)."""
    out: dict[str, torch.Tensor] = {}
    suffix = f".rank{dist.get_rank()}" if distributed() else ""
    for name, p in named:
        for key, value in optimizer.state.get(p, {}).items():
            if not torch.is_tensor(value):
                continue
            inner = local_tensor(value)
            if is_packed(inner):
                for part in inner.__tensor_flatten__()[0]:
                    out.setdefault(f"{name}.{key}.{PACKED}{part}{suffix}", getattr(inner, part))
            else:
                out.setdefault(f"{name}.{key}", value)
    return out


PACKED = "packed_"  # the name of a tensor subclass's part in a checkpoint: `param.key.packed_<part>`


def is_packed(t: torch.Tensor) -> bool:
    """Whether `t` is a wrapper tensor subclass made of plain tensors (torchao's quantised state)."""
    return type(t) is not torch.Tensor and not isinstance(t, (nn.Parameter, DTensor)) and \
        hasattr(t, "__tensor_flatten__")


def check_packed_state(path: Path, saved_names: Any, holds_packed: bool, layout: dict, saved_layout: Any) -> None:
    """A checkpoint of 8-bit (packed) optimizer state loads only into a run with the same optimizer and
    layout, and a run with packed state loads only such a checkpoint: refuse anything else clearly.
    `holds_packed`: whether any rank of this run holds packed state (the same on every rank)."""
    saved_packed = any(f".{PACKED}" in n for n in saved_names)
    if saved_packed and not holds_packed:
        raise CheckpointError(
            f"checkpoint {path} holds the 8-bit optimizer state of train.optimizer adamw_8bit, which this run's "
            "optimizer cannot take: resume with train.optimizer adamw_8bit, or start a new run from its weights with "
            "model.init_from")
    if holds_packed and not saved_packed:
        raise CheckpointError(
            f"checkpoint {path} holds the optimizer state of another optimizer, not adamw_8bit's 8-bit state: resume "
            "with the optimizer it was saved with, or start a new run from its weights with model.init_from")
    if saved_packed and saved_layout not in (None, layout):
        raise CheckpointError(
            f"checkpoint {path} holds 8-bit optimizer state saved by the layout {_describe_layout(saved_layout)}; its "
            f"blocks follow each rank's shard, so it loads only into that layout, not {_describe_layout(layout)}. "
            "Resume with that layout, or start a new run from its weights with model.init_from")


@torch.no_grad()
def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazy state (one step with zero gradients and lr 0) so a load fills it.

    Existing gradients are kept; parameters and an existing state are left as they are.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def parameters(parts: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of all model parts, each once."""
    seen: dict[int, nn.Parameter] = {}
    for part in parts:
        for p in part.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


# --- the checkpointer ---------------------------------------------------------------------------------


class Checkpointer:
    """Saves a run's state into RUN_DIR/checkpoints/step_N and loads it back, in any layout.

    `parts`: this rank's model parts. `optimizer` and `masters` (the fp32 copies at level O2, which the
    optimizer then steps), `scaler` and `loader` are saved and restored when given. `tied_copy`: this
    rank holds a pipeline's last-stage copy of a tied embedding matrix. `layout`: the parallel layout,
    recorded so that random states are restored only where they belong. `lora`/`model_cfg`/`base`:
    a LoRA run also saves its adapters in peft's format (`step_N/adapter`). `extra_files`: files of
    the run directory copied into each checkpoint (config.yaml, tokenizer/), when they exist.
    `async_save`: `save` stages the state in host memory and writes it in the background (`wait`);
    in a distributed run the checkpointer then creates a gloo process group of its own, so every rank
    must construct it at the same point. `verify`: loads check every file of a checkpoint against its
    checksums, and a LoRA run's base (`base`) against the fingerprint its checkpoint recorded
    (train.verify_checkpoints).
    """

    def __init__(self, run_dir: str | Path, parts: list[nn.Module], optimizer: torch.optim.Optimizer, *,
                 masters: Any = None, scaler: Any = None, loader: Any = None, tied_copy: bool = False,
                 layout: dict[str, int] | None = None, device: torch.device = torch.device("cpu"),
                 rank: int = 0, keep: int = 3, seed: int = 0, lora: LoraConfig | None = None,
                 model_cfg: ModelConfig | None = None, base: str | None = None,
                 extra_files: tuple[str, ...] = ("config.yaml", "tokenizer"), async_save: bool = False,
                 verify: bool = True) -> None:
        self.run_dir, self.parts, self.optimizer = Path(run_dir), list(parts), optimizer
        self.masters, self.scaler, self.loader = masters, scaler, loader
        self.tied_copy, self.layout, self.device, self.rank = tied_copy, layout or {}, device, rank
        self.keep, self.seed, self.extra_files = keep, seed, extra_files
        self.lora, self.model_cfg, self.base = lora, model_cfg, base
        self.verify = verify
        self._resumed_from: Path | None = None  # the checkpoint this run resumed from
        self._base_fingerprint: dict | None = None  # init_from's, for a LoRA run (computed once)
        self.rank_streams: dict[str, Any] = {}  # name -> object with state()/set_state()/reseed() (TP dropout)
        names = canonical_param_names(self.parts)
        # What the optimizer steps, by name: the fp32 masters at level O2, else the trainable parameters.
        self.opt_named: list[tuple[str, torch.Tensor]] = (
            list(masters.named_masters()) if masters is not None
            else [(names[id(p)], p) for p in parameters(self.parts) if p.requires_grad])
        self.async_save = async_save
        self._pending: PendingCheckpoint | None = None
        self._stager = HostStager() if async_save else None  # its host buffers are reused by every save
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-checkpoint") \
            if async_save else None
        # The background write's collectives get a group of their own (created on every rank, here).
        self._group = dist.new_group(backend="gloo") if async_save and distributed() else None

    # --- names under which one process would store this rank's tensors

    def checkpoint_name(self, name: str) -> str:
        """The name one process gives this rank's parameter `name`."""
        return TIED_NAME if self.tied_copy and name == TIED_COPY else name

    def by_checkpoint_name(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`named` under the names one process uses (the first tensor of a name wins: where a rank
        holds both copies of a tied matrix, a V schedule, the first stands for both)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in named:
            out.setdefault(self.checkpoint_name(name), t)
        return out

    def tensors(self, per_part: list[dict[str, torch.Tensor]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Flat name -> tensor groups for DCP; sharded parameters and optimizer state stay DTensors, so
        every rank saves and loads its own shards. State kept in host memory by copies still in flight
        (optimize.offload_optimizer: stream) is waited for first."""
        settle = getattr(self.optimizer, "settle", None)
        if settle is not None:
            settle()
        model = {}
        for part in per_part if per_part is not None else model_state(self.parts):
            model.update(part)
        named = [(self.checkpoint_name(n), t) for n, t in self.opt_named]
        groups = {"model": model, "optim": optimizer_state_by_name(self.optimizer, named)}
        if self.masters is not None:
            groups["master"] = self.by_checkpoint_name(list(self.masters.named_masters()))
        return groups

    @torch.no_grad()
    def fill_tied_copies(self) -> None:
        """After a load: where this rank holds both copies of a tied matrix (a V schedule), the
        checkpoint filled the first one; give the second its values and optimizer state."""
        named = dict(self.opt_named)
        first, last = named.get(TIED_NAME), named.get(TIED_COPY)
        if not self.tied_copy or first is None or last is None:
            return
        last.copy_(first)
        src, dst = self.optimizer.state.get(first, {}), self.optimizer.state.get(last, {})
        for key, value in src.items():
            if torch.is_tensor(value) and torch.is_tensor(dst.get(key)):
                dst[key].copy_(value)

    # --- save

    def save(self, step: int) -> Path:
        """Write the checkpoint of `step` (every rank calls it); return its directory. With `async_save`
        the directory appears only when the write is published (`wait`, or the next save); a pending
        save is published first, and a failure of its write raises here."""
        self.wait()
        final = step_dir(self.run_dir, step)
        if self._resumed_from is not None and step == step_of(self._resumed_from) and final.is_dir() \
                and not final.is_symlink() and final.resolve() == self._resumed_from.resolve() and is_complete(final):
            # Nothing has changed since the load (a run resumed at its last step): that checkpoint is this state.
            log.info("checkpoint %s is the one this run resumed from, which holds this state", final)
            return final
        trainer_state: dict[str, Any] = {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                                         "layout": self.layout}
        if self.loader is not None:
            trainer_state["loader"] = self.loader.state_dict()
        if self.rank == 0 and self.lora is not None and self.base is not None:
            trainer_state["base"] = self._base()
        extra = {name: self.run_dir / name for name in self.extra_files if (self.run_dir / name).exists()}
        streams = {n: r.state() for n, r in self.rank_streams.items()}
        # A LoRA run's adapters are written into the checkpoint before it is published, with its checksums.
        adapter = self._save_adapter if self.lora is not None else None
        if self.async_save:
            self._pending = start_async_save(self.run_dir, step, self.tensors(), trainer_state, extra, keep=self.keep,
                                             rank_state=rng.capture(self.device, streams), process_group=self._group,
                                             stager=self._stager, executor=self._writer, before_publish=adapter)
            return final
        return save_checkpoint(self.run_dir, step, self.tensors(), trainer_state, extra, keep=self.keep,
                               rank_state=rng.capture(self.device, streams), before_publish=adapter)

    def _base(self) -> dict:
        """init_from's fingerprint (`weights.base_fingerprint`), computed once per run."""
        if self._base_fingerprint is None:
            self._base_fingerprint = base_fingerprint(self.base)
        return self._base_fingerprint

    def wait(self, *, training_failed: bool = False) -> Path | None:
        """Wait for the pending background save (every rank calls it) and publish it; return its directory,
        or None when nothing was pending. A failed write raises a CheckpointError naming the checkpoint
        and the cause (once: the save is then dropped). `training_failed`: called while training raises,
        so the checkpoint of an earlier, finished step is still published, but a failure here is logged,
        not raised, so that it does not hide the training error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            path = finish_async_save(pending)
        except Exception as e:
            if not training_failed:
                raise
            log.error("training stopped on an error, and finishing its pending checkpoint failed too: %s", e)
            return None
        return path

    def _save_adapter(self, path: Path) -> None:
        """The checkpoint's LoRA adapters on their own, in the format `peft` loads (path/adapter); `path` is
        the checkpoint's temporary directory, its tensors and trainer state written (rank 0)."""
        names = [n for n in read_trainer_state(path).get("shapes", {}).get("model", {}) if is_lora_name(n)]
        state = read_saved_tensors(path, "model", names)  # read back: any layout, on one rank
        lora = self.lora
        save_adapter(state, self.model_cfg, lora.r, lora.alpha, lora.dropout, lora.target_modules,
                     path / "adapter", base_model_name_or_path=self.base)

    # --- load

    def load(self, resume: str, overwrite: bool = False) -> int:
        """Continue from `resume` ("auto": the newest checkpoint of the run, or a path); return the step
        it was saved at (0 when "auto" finds none). A resume from an older checkpoint forks the run: its
        newer checkpoints are removed only with `overwrite`."""
        self.wait()  # a checkpoint still being written is published first
        path = resolve_resume(resume, self.run_dir)
        _agree_on_checkpoint(path, self.run_dir)
        if path is None:
            log.info("--resume auto: no checkpoint in %s yet, starting from step 0", self.run_dir)
            return 0
        if self.verify:
            verify_checkpoint(path)
        elif self.rank == 0:
            skipped_verification(path)
        saved = read_trainer_state(path)
        _check_step(path, saved)
        self._check_base(path, saved)
        ensure_optimizer_state(self.optimizer)
        per_part = model_state(self.parts)
        tensors = self.tensors(per_part)
        packed = any(f".{PACKED}" in n for n in tensors["optim"])
        if distributed():
            packed = sum_over([int(packed)])[0] > 0
        check_packed_state(path, saved.get("shapes", {}).get("optim", {}), packed, self.layout, saved.get("layout"))
        saved_masters = "master" in saved.get("shapes", {})
        if not saved_masters:
            tensors.pop("master", None)
        state = load_checkpoint(path, tensors)
        if distributed():
            # DCP filled the shards in place; setting them again keeps FSDP2's views consistent.
            for part, part_state in zip(self.parts, per_part):
                set_model_state_dict(part, part_state)
        self.fill_tied_copies()
        # A change of precision level on resume: the fp32 masters of an O2 run are its exact weights.
        if self.masters is not None and not saved_masters:
            self.masters.model_to_masters()
        elif self.masters is None and saved_masters:
            load_checkpoint(path, {"master": self.by_checkpoint_name(self.opt_named)})
        if self.loader is not None:
            _restore_section(path, "data position", self.loader.load_state_dict, state.get("loader"))
        if self.scaler is not None and state.get("scaler"):
            _restore_section(path, "loss scaler", self.scaler.load_state_dict, state["scaler"])
        step = int(state["step"])
        self._restore_random_state(path, state, step)
        rank0_first(lambda: _clear_newer_checkpoints(self.run_dir, step, overwrite), self.rank,
                    "removing newer checkpoints")
        self._resumed_from = path
        log.info("resumed from %s at step %d", path, step)
        return step

    def _check_base(self, path: Path, saved: dict) -> None:
        """A LoRA run's adapters belong to the base they were trained on (with QLoRA it is read from
        model.init_from again at every start): init_from must still hold the weights the checkpoint
        recorded (`weights.base_fingerprint`)."""
        if self.lora is None or self.base is None:
            return
        recorded = saved.get("base")
        if recorded is None:
            if self.rank == 0:
                log.warning("%s records no fingerprint of its base model (saved by an older shardwise): whether "
                            "model.init_from %s still holds the weights it was trained on is not checked",
                            path, self.base)
            return
        now = self._base()
        difference = fingerprint_difference(recorded, now)
        if difference is None:
            return
        message = (f"model.init_from {self.base} is not the base model that checkpoint {path} was trained on: "
                   f"{difference} since then (the checkpoint recorded its base's files in {STATE_FILE}). The "
                   "LoRA adapters only fit the weights they were trained on")
        if not self.verify:
            log.warning("%s; going on, as train.verify_checkpoints is false", message)
            return
        raise CheckpointError(
            f"{message}: point model.init_from at that base model again. If the change is on purpose (the "
            "same weights, saved again), set train.verify_checkpoints: false to go on anyway (it also skips "
            "checking the checkpoint's files against their checksums)")

    def _restore_random_state(self, path: Path, state: dict, step: int) -> None:
        """Each rank continues its own random streams where the layout is the one saved; elsewhere
        (another rank count or arrangement) every rank re-seeds from (seed, step) alike."""
        world = self.layout.get("world_size") or (dist.get_world_size() if distributed() else 1)
        own = read_rank_state(path, self.rank)
        same = state.get("layout") in (None, self.layout) and saved_ranks(path) == world
        if distributed():  # every rank must take the same branch, or TP peers' streams diverge
            same = sum_over([int(not same or own is None)])[0] == 0
        if same and own is not None:
            missing = rng.restore(own, self.device, self.rank_streams, source=str(rank_state_file(path, self.rank)))
            if missing and self.rank == 0:
                log.warning("%s: no saved state for %s (saved on another kind of device?); it continues from "
                            "its current state", path, ", ".join(missing))
            return
        rng.reseed(self.seed, step, self.device, self.rank_streams)
        if self.rank == 0:
            saved = state.get("layout") or {"world_size": saved_ranks(path)}
            log.warning("%s was saved by %s and this run is %s: the saved random states belong to other ranks, "
                        "so every rank's random generators are re-seeded from train.seed and step %d. Weights, "
                        "optimizer state and data order resume exactly; dropout masks differ from an "
                        "uninterrupted run", path, _describe_layout(saved), _describe_layout(self.layout), step)

    @torch.no_grad()
    def load_pretrained(self, init_from: str, model_cfg: ModelConfig) -> None:
        """Fill this rank's shards with the weights of `init_from` (a Hugging Face directory or a
        shardwise checkpoint), each rank reading only what it holds; LoRA adapters get their initial
        values. Into the fp32 masters where there are some (precision O2), then copied to the model."""
        named = self.by_checkpoint_name(self.opt_named)
        names = canonical_param_names(self.parts)
        for p in parameters(self.parts):  # frozen weights are not in the optimizer's list
            if self.masters is None or not p.requires_grad:
                named.setdefault(self.checkpoint_name(names[id(p)]), p)
        for part in self.parts:  # the routers' correction biases come with the weights (DeepSeek-V3)
            named.update(hf_buffers(part))
        kind = "Hugging Face" if (Path(init_from).expanduser() / "config.json").is_file() else "checkpoint"
        log.info("loading %s weights from %s", kind, init_from)
        load_pretrained_tensors(named, init_from, model_cfg, self.seed, verify=self.verify)
        self.fill_tied_copies()
        if self.masters is not None:
            self.masters.masters_to_model()


def _restore_section(path: Path, what: str, restore: Callable[[Any], None], saved: Any) -> None:
    """`restore(saved)`, where `saved` comes from a checkpoint's trainer state: one that is missing or
    does not fit is a damaged or altered checkpoint, said as such, not a traceback."""
    try:
        if saved is None:
            raise KeyError("missing")
        restore(saved)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded: {STATE_FILE} holds no usable {what} ({type(e).__name__}: {e}); "
            "shardwise never writes that, so the checkpoint is damaged or was altered: copy it again from the run "
            "that saved it") from None


def _describe_layout(layout: dict[str, int]) -> str:
    ranks = f"{layout.get('world_size', '?')} rank(s)"
    if "dp" not in layout:
        return ranks
    return f"{ranks} (dp {layout['dp']} x tp {layout['tp']} x pp {layout['pp']})"


def _agree_on_checkpoint(path: Path | None, run_dir: Path) -> None:
    """Every rank resumes from the same step: ranks that see different checkpoints (a run directory that
    is not one file system for all) stop together, before any of them loads."""
    if not distributed():
        return
    step = float(step_of(path)) if path is not None else -1.0
    newest, oldest = max_over(step), -max_over(-step)
    if newest == oldest:
        return

    def seen(s: float) -> str:
        return "none" if s < 0 else f"step {int(s)}"
    raise CheckpointError(
        f"the ranks do not see the same checkpoints in {run_dir}: the one to resume from is {seen(newest)} on "
        f"some ranks and {seen(oldest)} on others. train.output_dir must be one file system for every rank "
        "(NFS, Lustre, GPFS, ...; in Kubernetes a ReadWriteMany volume)")


def _check_step(path: Path, saved: dict) -> None:
    """The step a checkpoint records is the one its directory is named for: otherwise it was renamed or
    its files were replaced, and resuming would misplace it among the run's checkpoints."""
    recorded, named = saved["step"], step_of(path)
    if recorded == named:
        return
    raise CheckpointError(
        f"checkpoint {path} cannot be loaded: its {STATE_FILE} records step {recorded}, but the directory is named "
        f"for step {named}: it was renamed, or its files were replaced by another checkpoint's. If it is the "
        f"checkpoint of step {recorded}, move it to {path.parent / f'step_{recorded:08d}'} (where no other is); or "
        f"resume from another checkpoint with --resume PATH. Nothing was changed in {path.parent}")


def _clear_newer_checkpoints(run_dir: Path, step: int, overwrite: bool) -> None:
    """Resuming from an older checkpoint forks the run: its newer checkpoints go only when asked."""
    newer = [p for p in list_checkpoints(run_dir) if step_of(p) > step]
    if not newer:
        return
    listed = ", ".join(str(p) for p in newer)
    if not overwrite:
        raise ConfigError(
            f"{run_dir} holds checkpoints newer than step {step} ({', '.join(p.name for p in newer)}); "
            f"continuing from step {step} would replace them. Pass --overwrite (Python: "
            f"train(resume=..., overwrite=True)) to delete them ({listed}) and continue, resume from the newest "
            "with --resume auto, or set another train.output_dir"
        )
    for p in newer:
        p.unlink() if p.is_symlink() else shutil.rmtree(p)  # a link: only the link goes
    log.warning("--overwrite: deleted the checkpoints newer than step %d: %s", step, listed)
