"""The one way a run's model is made: the config's architecture as a Transformer, on the meta device
(the structure only: names, shapes, what trains) or allocated on a device and initialised from the
current random state, then converted for fine-tuning: LoRA adapters beside the chosen projections,
or frozen embeddings and bottom layers.

The trainer, the dry run, the memory estimator and planner, loading a checkpoint's model for
generation and export, and the benchmarks all build through here, so they all see the same model.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import FreezeConfig, LoraConfig, RunConfig
from .models.config import ModelConfig
from .models.transformer import Transformer, materialize
from .peft.freeze import freeze_parameters
from .peft.lora import LoRALinear, apply_lora


def build_run_model(cfg: RunConfig, device: str | torch.device = "meta",
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """The run's model on `device` ("meta": no memory), its fine-tuning converters applied."""
    return build_adapted_model(cfg.model, cfg.lora, cfg.freeze, device, dtype, seed=cfg.train.seed)


def build_adapted_model(model_cfg: ModelConfig, lora: LoraConfig | None, freeze: FreezeConfig | None,
                        device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                        seed: int = 0) -> Transformer:
    """`build_run_model` from the three sections that decide the model (for callers that hold no
    whole run config, such as the estimator's cache)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    if torch.device(device).type == "meta":
        model.to(dtype=dtype)
    else:
        materialize(model, device, dtype)
    adapt_for_finetuning(model, lora, freeze, seed)
    return model


def prepare_given_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A model handed to the Python API, on `device` in `dtype` (initialised first when it is on meta)."""
    if any(p.is_meta for p in model.parameters()):
        return materialize(model, device, dtype)
    model = model.to(device=device, dtype=dtype)
    model.reset_rope_tables()  # keep RoPE tables in fp32 when the weights became 16-bit
    return model


def adapt_for_finetuning(model: nn.Module, lora: LoraConfig | None, freeze: FreezeConfig | None,
                         seed: int = 0) -> None:
    """Apply LoRA adapters or frozen layers to the whole model (before it is split or sharded).
    Adapters start from values that depend only on (name, seed): every layout starts alike."""
    if lora is not None:
        apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules, seed=seed)
    elif freeze is not None and freeze.active():
        freeze_parameters(model, freeze.embeddings, freeze.layers)


def describe_finetuning(model: nn.Module, lora: LoraConfig | None, freeze: FreezeConfig | None) -> str | None:
    """What fine-tuning does to an adapted model, in words ("LoRA r=16 alpha=32 on 112 projections",
    "frozen embeddings and bottom 12 layers"); None when every weight trains."""
    if lora is not None:
        wrapped = sum(isinstance(m, LoRALinear) for m in model.modules())
        base = "" if lora.quantize_base == "none" else f", their base in {lora.quantize_base} (QLoRA)"
        return f"LoRA r={lora.r} alpha={lora.alpha:g} on {wrapped} projections{base}"
    if freeze is not None and freeze.active():
        parts = (["embeddings"] if freeze.embeddings else []) + (
            [f"bottom {freeze.layers} layers"] if freeze.layers else [])
        return f"frozen {' and '.join(parts)}"
    return None


def trainable_summary(model: nn.Module) -> str:
    """'4,358,144 of 1,548,072,448 parameters train (0.28%)'."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{trainable:,} of {total:,} parameters train ({100 * trainable / max(total, 1):.2f}%)"
