"""Weights from elsewhere: a Hugging Face model directory, or a shardwise checkpoint (or run
directory, meaning its newest checkpoint), for `model.init_from`, generation and export.

The architecture comes from the weights' own config (config.json, or the checkpoint's config.yaml);
a run may change only what does not change a weight's shape (`architecture_with_overrides`). The
weights are checked from their headers or saved shapes before any data is prepared
(`check_pretrained`), then read onto the model as this rank holds it after parallelisation (a
pipeline stage; tensor- and data-parallel DTensor shards), slice by slice, so that no rank ever holds
the whole model (`load_pretrained_tensors`). `load_model` builds a checkpoint's own model whole, for
one process (generation, export).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from .. import untrusted
from ..builder import build_adapted_model
from ..config import RunConfig, load_config, read_yaml
from ..errors import CheckpointError, ConfigError
from ..models.config import ModelConfig
from ..models.hf import check_hf_weights, check_saved_shapes, copy_full_into, load_hf_config, load_hf_into
from ..peft.lora import is_lora_name, lora_init
from .format import SafeCheckpointReader
from .storage import (
    CHECKSUMS_FILE,
    check_shapes,
    find_checkpoint,
    load_weights,
    read_saved_group,
    read_trainer_state,
    skipped_verification,
    verify_checkpoint,
)

# Model keys a config may set next to init_from: they do not change any weight's shape.
ADJUSTABLE = ("init_from", "dropout", "use_flash_attention", "initializer_range", "max_position_embeddings")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def pretrained_source(path: str) -> tuple[str, Path]:
    """("hf", directory) or ("checkpoint", checkpoint directory) for an init_from path."""
    p = Path(path).expanduser()
    if (p / "config.json").exists() or (p / "config.json").is_symlink():  # a FIFO or a link is refused when read
        return "hf", p
    if p.is_dir():
        try:
            return "checkpoint", find_checkpoint(p)
        except CheckpointError as exc:
            raise ConfigError(f"model.init_from {path}: no config.json (so not a Hugging Face model directory) "
                              f"and {exc}") from None
    raise ConfigError(
        f"model.init_from {path} does not exist; give a Hugging Face model directory (config.json + "
        "*.safetensors) or a shardwise checkpoint or run directory"
    )


def pretrained_architecture(path: str) -> dict[str, Any]:
    """The ModelConfig fields of the weights at `path` (no preset, no init_from)."""
    kind, p = pretrained_source(path)
    if kind == "hf":
        cfg = load_hf_config(p)
    else:
        model = read_yaml(p / "config.yaml").get("model") or {}
        try:
            raw = {k: v for k, v in dict(model).items() if k != "init_from"}
            cfg = ModelConfig(**raw)
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"the model section of {p / 'config.yaml'} is not a valid model config "
                              f"({' '.join(str(exc).split())}); it must be the config of the run that saved "
                              "the checkpoint") from None
    return cfg.model_dump(exclude={"preset", "init_from"})


def architecture_with_overrides(model_section: dict[str, Any]) -> dict[str, Any]:
    """The model section of a config with `init_from`: the weights' architecture, plus the keys a
    config may change; a key that contradicts the weights fails here, naming both values."""
    if model_section.get("preset"):
        raise ConfigError("model.preset and model.init_from both give the architecture; with init_from the "
                          "architecture is the weights' own: drop model.preset")
    arch = pretrained_architecture(model_section["init_from"])
    adjustable = set(ADJUSTABLE)
    if arch["position"] == "learned":
        adjustable.discard("max_position_embeddings")  # learned positions are a weight
    wrong = [f"model.{k} {v!r} (the weights have {arch[k]!r})" for k, v in model_section.items()
             if k in arch and k not in adjustable and v != arch[k] and _normalised(v) != _normalised(arch[k])]
    if wrong:
        raise ConfigError(
            f"model.init_from {model_section['init_from']} fixes the architecture, but the config sets "
            f"{'; '.join(wrong)}; remove those keys (only {', '.join(sorted(adjustable - {'init_from'}))} may change)"
        )
    return {**arch, **model_section}


def _normalised(value: Any) -> Any:
    """Compare 4 and 4.0, and a rope_scaling given in part, as the validated config would hold them."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value


def pretrained_tokenizer(path: str, required: bool = True) -> str | None:
    """The tokenizer that comes with the weights at `path` (data.tokenizer defaults to it); None when
    there is none and it is not `required`."""
    kind, p = pretrained_source(path)
    if kind == "hf" and any((p / name).is_file() for name in _TOKENIZER_FILES):
        return str(p)
    if kind == "checkpoint" and (p / "tokenizer").is_dir():
        return str(p / "tokenizer")
    if not required:
        return None
    raise ConfigError(
        f"model.init_from {path} holds no tokenizer ({' or '.join(_TOKENIZER_FILES)}"
        f"{'' if kind == 'hf' else ' in tokenizer/'}); set data.tokenizer to the tokenizer these weights "
        "were trained with"
    )


def check_pretrained(model_cfg: ModelConfig, lora: bool) -> None:
    """Check the weights of `model_cfg.init_from` against the model from their headers or saved
    shapes alone (before any data is prepared): files present, every weight there with its shape.
    `lora`: the run adds LoRA adapters (a checkpoint that holds some of its own is then accepted)."""
    kind, path = pretrained_source(model_cfg.init_from)
    if kind == "hf":
        check_hf_weights(path, model_cfg)
        return
    saved = read_trainer_state(path).get("shapes", {}).get("model", {})
    if not lora and any(is_lora_name(n) for n in saved):
        raise ConfigError(
            f"model.init_from {path} was trained with LoRA: its adapters are not merged into its weights. "
            f"Merge them first (shardwise convert {path} --to hf OUT --merge-lora, then init_from: OUT), "
            "or add the run's lora section to continue training the adapters"
        )
    check_saved_shapes(model_cfg, saved, path / "config.yaml")


@torch.no_grad()
def load_pretrained_tensors(named: dict[str, torch.Tensor], init_from: str, model_cfg: ModelConfig,
                            seed: int, verify: bool = True) -> str:
    """Fill this rank's tensors (checkpoint name -> the tensor as this rank holds it: whole, a stage's,
    DTensor shards; fp32 masters where the run has them) from the weights of `init_from`, each read
    only where this rank holds it. LoRA adapters the weights do not hold get their initial values
    (a function of name and seed, the same in every layout). A checkpoint's files are checked against
    its checksums first (`verify`). Returns "hf" or "checkpoint"."""
    kind, path = pretrained_source(init_from)
    base = {n: t for n, t in named.items() if not is_lora_name(n)}
    saved: dict[str, Any] = {}
    if kind == "hf":
        load_hf_into(base.items(), path, model_cfg)
    else:
        if verify:
            verify_checkpoint(path)
        else:
            skipped_verification(path)
        shapes = read_trainer_state(path).get("shapes", {})
        saved = shapes.get("model", {})
        wanted = {**base, **{n: t for n, t in named.items() if n in saved}}
        groups = {"model": wanted}
        if shapes.get("master"):  # a precision-O2 run: its fp32 master copies are the exact weights
            groups["master"] = {n: t for n, t in wanted.items() if n in shapes["master"]}
        load_weights(path, groups)
    for name, t in named.items():
        if is_lora_name(name) and name not in saved:
            copy_full_into(t, lora_init(name, tuple(t.shape), seed))
    return kind


def checkpoint_config(path: Path) -> tuple[RunConfig, str | None]:
    """A checkpoint's config.yaml as a file from elsewhere: read bounded and without aliases, and
    validated. Returns the config and model.init_from, which is taken out: where the run started is
    history and need not exist any more. CheckpointError naming config.yaml otherwise."""
    file = path / "config.yaml"
    damaged = "the checkpoint's config is damaged; restore it from the run that saved it"
    raw = untrusted.read_yaml(file, CheckpointError, advice=damaged)
    if not isinstance(raw, dict) or not isinstance(raw.get("model") or {}, dict):
        untrusted.fail(CheckpointError, file, "is not a mapping of sections with a model mapping", damaged)
    model = dict(raw.get("model") or {})
    init_from = model.pop("init_from", None)
    if init_from is not None and not isinstance(init_from, str):
        untrusted.fail(CheckpointError, file, f"model.init_from is {untrusted.kind_of(init_from)}, not a path",
                       damaged)
    try:
        cfg = load_config(raw={**raw, "model": model})
    except (ConfigError, ValueError) as e:
        untrusted.fail(CheckpointError, file, f"is not a valid run config ({' '.join(str(e).split())})", damaged)
    return cfg, init_from


def check_config_against_weights(path: Path, cfg: RunConfig) -> None:
    """The model of a checkpoint's config against the tensors its (checked) .metadata.json holds, so that
    a config claiming sizes its weights lack fails before anything is allocated."""
    metadata = SafeCheckpointReader(path).read_metadata().state_dict_metadata
    saved = {key.removeprefix("model."): list(item.size) for key, item in metadata.items()
             if key.startswith("model.") and hasattr(item, "size")}
    check_saved_shapes(cfg.model, saved, path / "config.yaml", cfg.lora.r if cfg.lora is not None else None)


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, verify: bool = True) -> tuple[torch.nn.Module, Any]:
    """Build a checkpoint's model from its config.yaml (with its LoRA adapters, when the run had them)
    and load its weights (fp32 masters if any), whole, in this process; returns (model, the run's config).
    Every file is checked against the checkpoint's checksums first (`verify`: False when the caller
    verified them, or says that it skips that), and the config against the weights' shapes before the
    model is built (`check_config_against_weights`)."""
    path = find_checkpoint(path)
    if verify:
        verify_checkpoint(path, no_dist=True)
    cfg, _ = checkpoint_config(path)
    check_config_against_weights(path, cfg)
    model = build_adapted_model(cfg.model, cfg.lora, None, device, dtype, seed=cfg.train.seed)
    weights = dict(model.state_dict())
    groups = read_trainer_state(path).get("shapes", {})
    check_shapes(path, "model", weights)
    # Each process reads the whole model on its own, whatever layout wrote it.
    read_saved_group(path, "model", weights)
    if "master" in groups:  # level O2: the fp32 master copies are the exact weights
        read_saved_group(path, "master", {n: weights[n] for n in groups["master"] if n in weights})
    model.eval()
    return model, cfg


# --- the base model of an adapter run ------------------------------------------------------------------

_WEIGHT_SUFFIXES = (".safetensors", ".distcp", ".bin", ".pt", ".pth", ".index.json")
_WEIGHT_NAMES = ("config.json", ".metadata.json", CHECKSUMS_FILE)  # not the tokenizer's: it is no weight
_WHOLE = 16 << 20        # files up to this size are hashed whole
_HEAD = 1 << 20          # else: the first MiB (a safetensors header: every tensor's name, dtype, shape, offsets) ...
_SAMPLES, _SAMPLE = 64, 64 << 10  # ... and 64 blocks of 64 KiB spread over the file, the last one at its end


def _sampled_digest(path: Path, size: int) -> str:
    """SHA-256 of a whole small file, or of a large one's head and 64 blocks spread evenly over it."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        if size <= _WHOLE:
            spans = [(0, size)]
        else:
            step = (size - _SAMPLE) // (_SAMPLES - 1)
            spans = [(0, _HEAD)] + [(i * step, _SAMPLE) for i in range(_SAMPLES)]
        for offset, length in spans:
            h.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)
    return h.hexdigest()


def base_fingerprint(init_from: str) -> dict[str, Any]:
    """What identifies the weights at `init_from` (a Hugging Face directory or a checkpoint), recorded in
    the checkpoints of a run that keeps them outside (LoRA adapters over a frozen base; with QLoRA it is
    read and quantised again on every start): each weight file's size (and config.json's, an index's, a
    checkpoint's metadata and checksums), and a SHA-256 of the file
    whole up to 16 MiB, else of its first MiB and 64 blocks of 64 KiB spread over it. A checkpoint's
    checksums.json (every file's full checksum) is hashed whole.

    Not every byte: a 70B base is 140 GB, minutes to hash at every start. The samples tell another model
    (another fine-tune or revision of the same architecture differs in every block), any change of size,
    tensor list or layout, and a file added or removed, in milliseconds; a few bytes edited in place
    between samples pass. Modification times are not used: a copy changes them, not the weights."""
    kind, path = pretrained_source(init_from)
    files: dict[str, Any] = {}
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.endswith(_WEIGHT_SUFFIXES) or entry.name in _WEIGHT_NAMES:
            if not entry.is_file():
                continue
            size = entry.stat().st_size
            files[entry.name] = {"size": size, "sample": _sampled_digest(Path(entry.path), size)}
    return {"init_from": str(init_from), "kind": kind, "files": files}


def fingerprint_difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first difference between two `base_fingerprint`s in words, or None when they agree."""
    old, new = saved.get("files") or {}, now.get("files") or {}
    for name in sorted(set(old) | set(new)):
        if name not in new:
            return f"{name} is gone"
        if name not in old:
            return f"{name} was added"
        was = old[name] if isinstance(old[name], dict) else {}
        if was.get("size") != new[name]["size"]:
            return f"{name} has {new[name]['size']:,} bytes, not the {str(was.get('size'))[:30]} it had"
        if was.get("sample") != new[name]["sample"]:
            return f"{name} holds other bytes (same size)"
    return None
