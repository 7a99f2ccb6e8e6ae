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

from pathlib import Path
from typing import Any

import torch

from ..builder import build_adapted_model
from ..config import load_config, read_yaml
from ..errors import CheckpointError, ConfigError
from ..models.config import ModelConfig
from ..models.hf import check_hf_weights, copy_full_into, load_hf_config, load_hf_into
from ..models.transformer import Transformer
from ..peft.lora import is_lora_name, lora_init
from .storage import check_shapes, find_checkpoint, load_weights, read_saved_group, read_trainer_state

# Model keys a config may set next to init_from: they do not change any weight's shape.
ADJUSTABLE = ("init_from", "dropout", "use_flash_attention", "initializer_range", "max_position_embeddings")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def pretrained_source(path: str) -> tuple[str, Path]:
    """("hf", directory) or ("checkpoint", checkpoint directory) for an init_from path."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
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
    with torch.device("meta"):
        shapes = {n: list(p.shape) for n, p in Transformer(model_cfg).named_parameters()}
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no weight {name}; it is not a {model_cfg.model_type} "
                                  "model of this architecture")
        if saved[name] != shape:
            raise CheckpointError(f"checkpoint {path} holds {name} with shape {saved[name]}, but the model "
                                  f"expects {shape}")


@torch.no_grad()
def load_pretrained_tensors(named: dict[str, torch.Tensor], init_from: str, model_cfg: ModelConfig,
                            seed: int) -> str:
    """Fill this rank's tensors (checkpoint name -> the tensor as this rank holds it: whole, a stage's,
    DTensor shards; fp32 masters where the run has them) from the weights of `init_from`, each read
    only where this rank holds it. LoRA adapters the weights do not hold get their initial values
    (a function of name and seed, the same in every layout). Returns "hf" or "checkpoint"."""
    kind, path = pretrained_source(init_from)
    base = {n: t for n, t in named.items() if not is_lora_name(n)}
    saved: dict[str, Any] = {}
    if kind == "hf":
        load_hf_into(base.items(), path, model_cfg)
    else:
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


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """Build a checkpoint's model from its config.yaml (with its LoRA adapters, when the run had them)
    and load its weights (fp32 masters if any), whole, in this process; returns (model, the run's config)."""
    path = find_checkpoint(path)
    raw = read_yaml(path / "config.yaml")
    # The checkpoint holds the weights and its config the whole architecture: where the run started
    # from (model.init_from) is history, and need not exist any more.
    (raw.get("model") or {}).pop("init_from", None)
    cfg = load_config(raw=raw)
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

