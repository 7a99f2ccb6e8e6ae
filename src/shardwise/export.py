"""`shardwise convert`: a shardwise checkpoint (any parallel layout) as a Hugging Face model directory or
a peft LoRA adapter.

The checkpoint is read whole into one process (`checkpoint.weights.load_model`), so what any layout wrote
converts the same way. Output is written into a hidden directory next to OUT and moved into place at
the end: a failed conversion leaves OUT as it was; a non-empty OUT is replaced only when asked
(--overwrite), and only once the new one is complete; an empty OUT is filled in place.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .checkpoint.storage import find_checkpoint, skipped_verification, step_of, verify_checkpoint
from .checkpoint.weights import checkpoint_config, load_model
from .data.tokenizer import load_tokenizer
from .errors import ConfigError
from .files import publish_dir
from .models.hf import model_config_to_hf, save_hf
from .peft.lora import lora_state_dict, remove_lora, save_adapter
from .peft.lora import merge_lora as merge_adapters

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TARGETS = ("hf", "peft")
ADAPTER_DIR = "adapter"


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    out: Path
    target: str  # "hf" or "peft"
    architecture: Optional[str]  # HF class of the model written (None: adapter only)
    num_parameters: int  # of the model written (0: adapter only)
    adapter_parameters: int  # of the adapter written (0: none)
    dtype: str
    merged: bool = False
    tokenizer: bool = False
    step: Optional[int] = None

    def summary(self) -> str:
        """One line: what was written where, parameter counts and dtype."""
        source = f"step {self.step} " if self.step is not None else ""
        if self.target == "peft":
            return (f"wrote peft LoRA adapter ({self.adapter_parameters:,} parameters, {self.dtype}) of "
                    f"checkpoint {source}to {self.out}")
        what = f"{'merged ' if self.merged else ''}{self.architecture}"
        extras = ["tokenizer" if self.tokenizer else "no tokenizer"]
        if self.adapter_parameters and not self.merged:
            extras.append(f"LoRA adapter in {ADAPTER_DIR}/ ({self.adapter_parameters:,} parameters)")
        return (f"wrote Hugging Face {what} ({self.num_parameters:,} parameters, {self.dtype}; "
                f"{', '.join(extras)}) of checkpoint {source}to {self.out}")


def _check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse an OUT whose replacement would destroy the checkpoint or data the user did not offer up."""
    out_abs, ckpt_abs = out.resolve(), checkpoint.resolve()
    if out_abs == ckpt_abs or out_abs.is_relative_to(ckpt_abs):
        raise ConfigError(f"output {out} is inside the checkpoint {checkpoint}; choose a directory outside it")
    if ckpt_abs.is_relative_to(out_abs):
        raise ConfigError(f"output {out} holds the checkpoint {checkpoint}, which replacing it would delete; "
                          "choose another directory")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} is a file; choose a directory path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"output {out} already exists and is not empty; pass --overwrite to replace it, "
                              "or choose another directory")
        if Path.cwd().resolve().is_relative_to(out_abs):
            raise ConfigError(f"output {out} holds the current directory, which replacing it would delete; "
                              "run from outside it or choose another directory")


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights once


def _generation_config(model_cfg: Any) -> dict:
    """Defaults for HF generate(): greedy like `shardwise generate`, at most the trained context
    (the bos/eos/pad ids are added by save_hf from the tokenizer)."""
    return {"do_sample": False, "max_length": model_cfg.max_position_embeddings}


def convert_checkpoint(checkpoint: str | Path, out: str | Path, to: str = "hf", merge_lora: bool = False,
                       dtype: str = "fp32", overwrite: bool = False,
                       tokenizer: str | Path | None = None, verify: bool = True) -> ConvertResult:
    """Write a checkpoint (or a run directory's newest) as a Hugging Face model (to="hf": LoRA merged,
    or the base plus OUT/adapter) or as a peft adapter only (to="peft")."""
    if to not in TARGETS:
        raise ConfigError(f"--to {to}: choose one of {', '.join(TARGETS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    path = find_checkpoint(checkpoint)
    out = Path(out)
    _check_out(out, path, overwrite)
    target = out.resolve()  # what is replaced: a symlink's target; `.` and `..` get their real names
    if verify:  # every file against the checksums before any is read
        verify_checkpoint(path, no_dist=True)
    else:
        skipped_verification(path, "--no-verify")
    cfg, init_from = checkpoint_config(path)
    lora = cfg.lora
    if merge_lora and lora is None:
        raise ConfigError(f"--merge-lora: checkpoint {path} has no LoRA adapters (its config has no lora "
                          "section); drop --merge-lora to convert the full model")
    if merge_lora and to == "peft":
        raise ConfigError("--merge-lora writes a full model; use it with --to hf, or drop it for --to peft")
    if to == "peft" and lora is None:
        raise ConfigError(f"--to peft: checkpoint {path} has no LoRA adapters (its config has no lora section); "
                          "use --to hf to convert the full model")
    # Both targets name tensors as an HF architecture does: one that none expresses fails here, before
    # the checkpoint is read or anything is written.
    architecture = model_config_to_hf(cfg.model)["architectures"][0]
    tok = None
    if to == "hf":
        tok_dir = Path(tokenizer) if tokenizer is not None else path / "tokenizer"
        if tokenizer is not None or tok_dir.is_dir():
            tok = load_tokenizer(tok_dir)
        else:
            log.warning("checkpoint %s holds no tokenizer/: writing the model without one (pass --tokenizer "
                        "DIR to include the tokenizer the run was trained with)", path)

    model, _ = load_model(path, verify=False)  # verified above
    adapter: dict[str, torch.Tensor] = {}
    if lora is not None and not merge_lora:
        adapter = {n: t.to(DTYPES[dtype]) for n, t in lora_state_dict(model).items()}  # a shared lora_A once
    adapter_count = sum(t.numel() for t in adapter.values())
    if merge_lora:
        merge_adapters(model)  # in fp32 (the checkpoint's precision), before any cast
    elif lora is not None:
        remove_lora(model)  # the base the adapters were trained on
    if to == "hf":
        model.to(DTYPES[dtype])

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.convert-{uuid.uuid4().hex[:8]}.tmp")
    try:
        if to == "hf":
            staging.mkdir()
            save_hf(model, staging, tokenizer=tok, generation_config=_generation_config(cfg.model))
        if adapter:
            # Beside the base model, the adapter names it (OUT) as its base; alone, the model the run
            # started from, when that is an HF directory.
            if to == "hf":
                base, adapter_dir = str(target), staging / ADAPTER_DIR
            else:
                base = init_from if init_from and (Path(init_from) / "config.json").is_file() else None
                adapter_dir = staging
            save_adapter(adapter, cfg.model, lora.r, lora.alpha, lora.dropout, lora.target_modules, adapter_dir,
                         base_model_name_or_path=base)
        _check_out(out, path, overwrite)  # again: OUT may have appeared while the checkpoint was read
        publish_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    return ConvertResult(out=out, target=to, architecture=architecture if to == "hf" else None,
                         num_parameters=_count(model) if to == "hf" else 0, adapter_parameters=adapter_count,
                         dtype=dtype, merged=merge_lora, tokenizer=tok is not None, step=step_of(path))

