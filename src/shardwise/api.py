"""The Python API of the source documents (`AutoModelForCausalLM`, `TrainingArguments`, `Trainer`,
`LLMArguments`, `LLMTrainer`), mapped onto shardwise's one config and one training loop.

Seed 000, section 5.4 and seed 002, section 3.3 run as written once their import line reads
`from shardwise import ...`. The model remembers the `parallel_config` / `optimize_config` it was
created with (or the whole seed YAML for `from_config`); the arguments object adds the training
hyper-parameters; together they become a `RunConfig`, validated like a YAML file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .config import RunConfig, translate_seed_keys, validate
from .errors import ConfigError
from .models import build_model, resolve_model_config
from .train.trainer import Trainer as _LoopTrainer
from .train.trainer import TrainResult

log = logging.getLogger(__name__)


class AutoModelForCausalLM:
    """Builds a causal LM from a preset name, a shardwise checkpoint, or a seed-shaped config."""

    @staticmethod
    def from_pretrained(name_or_path: str, parallel_config: dict | None = None,
                        optimize_config: dict | None = None, device: str | torch.device = "cpu",
                        **model_overrides: Any) -> nn.Module:
        """A preset by name (freshly initialised), or the weights of a checkpoint / run directory.

        Pass device="meta" to get the structure without memory; the Trainer materialises it.
        """
        if os.path.isdir(name_or_path):
            from .train.checkpoint import load_model

            model, cfg = load_model(name_or_path, device=device)
            layout = {"parallel": cfg.parallel.model_dump(), "optimize": cfg.optimize.model_dump()}
        else:
            model = build_model(resolve_model_config({"preset": name_or_path, **model_overrides}), device=device)
            layout = {}
        if parallel_config is not None:
            layout["parallel"] = dict(parallel_config)
        if optimize_config is not None:
            layout["optimize"] = dict(optimize_config)
        model.shardwise_layout = layout
        return model

    @staticmethod
    def from_config(config: dict, device: str | torch.device = "cpu") -> nn.Module:
        """A model from a whole seed-shaped (or shardwise) config dict; its layout is remembered."""
        canonical, _ = translate_seed_keys(config)
        model_cfg = resolve_model_config(canonical.get("model") or {})
        model = build_model(model_cfg, device=device)
        model.shardwise_layout = {k: canonical[k] for k in ("parallel", "optimize", "train", "data", "run")
                                  if k in canonical}
        return model


@dataclass
class TrainingArguments:
    """Training hyper-parameters in the names of the documents (and of Hugging Face)."""

    output_dir: str = "runs/default"
    num_train_epochs: Optional[float] = None
    max_steps: Optional[int] = None
    per_device_train_batch_size: int = 8
    learning_rate: float = 5e-5
    fp16: bool = False
    bf16: bool = False
    mixed_precision: Optional[str] = None  # "O0".."O3" (seed 003) or "fp16"/"bf16"/"fp32"
    gradient_accumulation_steps: Optional[int] = None
    save_steps: Optional[int] = None
    save_strategy: str = "steps"
    log_steps: int = 10
    logging_steps: Optional[int] = None
    eval_steps: Optional[int] = None
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = 1.0
    optimizer: str = "adamw"
    lr_scheduler_type: str = "cosine"
    min_lr: float = 0.0
    seed: int = 42
    overwrite_output_dir: bool = False

    def train_section(self) -> dict:
        """The `train` section these arguments describe."""
        section = {
            "output_dir": self.output_dir, "micro_batch_size": self.per_device_train_batch_size,
            "lr": self.learning_rate, "log_steps": self.logging_steps or self.log_steps,
            "warmup_steps": self.warmup_steps, "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm, "optimizer": self.optimizer,
            "decay_style": self.lr_scheduler_type, "min_lr": self.min_lr, "seed": self.seed,
        }
        if self.save_strategy == "steps" and self.save_steps:
            section["save_steps"] = self.save_steps
        if self.eval_steps:
            section["eval_steps"] = self.eval_steps
        if self.max_steps:
            section["max_steps"] = self.max_steps
        else:
            section["epochs"] = self.num_train_epochs if self.num_train_epochs is not None else 3.0
        return section

    def optimize_section(self) -> dict:
        """Precision and accumulation settings these arguments describe (only what they set)."""
        section: dict[str, Any] = {}
        if self.gradient_accumulation_steps is not None:
            section["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.fp16 and self.bf16:
            raise ConfigError("TrainingArguments: fp16 and bf16 are both True; choose one")
        if self.fp16 or self.bf16:
            section["mixed_precision"] = "fp16" if self.fp16 else "bf16"
        mp = self.mixed_precision
        if mp in ("O0", "O1", "O2", "O3"):
            section["precision_level"] = mp
            section.setdefault("mixed_precision", "fp32" if mp == "O0" else "bf16")
        elif mp is not None:
            section["mixed_precision"] = mp
        return section

    def parallel_section(self) -> dict:
        """Layout settings these arguments describe (none for the seed-000 shape)."""
        return {}


@dataclass
class LLMArguments(TrainingArguments):
    """Seed 002's arguments: layout plus `epochs`, `batch_size` (global) and `lr`."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: Optional[int] = None
    use_zero: bool = False
    zero_level: int = 1
    epochs: Optional[float] = None
    batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    lr: Optional[float] = None

    def __post_init__(self) -> None:
        if self.epochs is not None:
            self.num_train_epochs = self.epochs
        if self.lr is not None:
            self.learning_rate = self.lr
        if self.micro_batch_size is not None:
            self.per_device_train_batch_size = self.micro_batch_size

    def train_section(self) -> dict:
        """As TrainingArguments, with `batch_size` as the global batch."""
        section = super().train_section()
        if self.batch_size is not None:
            section["global_batch_size"] = self.batch_size
            if self.micro_batch_size is None:
                section["micro_batch_size"] = 1
        return section

    def parallel_section(self) -> dict:
        """TP, PP and ZeRO as seed 002 names them."""
        section = {"tensor_parallel": self.tensor_parallel, "pipeline_parallel": self.pipeline_parallel,
                   "zero_stage": self.zero_level if self.use_zero else 0}
        if self.data_parallel is not None:
            section["data_parallel"] = self.data_parallel
        return section


def run_config_from(model: nn.Module, args: TrainingArguments) -> RunConfig:
    """Combine the model's remembered layout with the arguments into one validated RunConfig."""
    layout = getattr(model, "shardwise_layout", {}) or {}
    raw: dict[str, Any] = {"model": model.config.model_dump()}
    for section in ("parallel", "optimize", "run", "data"):
        if section in layout:
            raw[section] = dict(layout[section])
    raw, warnings = translate_seed_keys(raw)
    for w in warnings:
        log.warning(w)
    raw.pop("train", None)
    raw["train"] = {**{k: v for k, v in (layout.get("train") or {}).items() if k in ("min_lr", "warmup_steps",
                                                                                    "decay_style")},
                    **args.train_section()}
    if "max_grad_norm" in (layout.get("optimize") or {}):
        raw["train"]["max_grad_norm"] = layout["optimize"]["max_grad_norm"]
    raw.setdefault("optimize", {}).update(args.optimize_section())
    raw.setdefault("parallel", {}).update(args.parallel_section())
    _fold_data_parallel_on_one_process(raw)
    raw.setdefault("data", {})["seq_length"] = raw.get("data", {}).get("seq_length") or model.config.max_position_embeddings
    return validate(raw)


def _fold_data_parallel_on_one_process(raw: dict) -> None:
    """A single-process API run of a data-parallel layout keeps its global batch by accumulating.

    Seed 000 debugs "on one card" with the same config that says data_parallel: 8. Data parallelism
    does not change the maths of a step, so one process with 8x the accumulation gives the same
    loss; tensor or pipeline parallelism cannot be folded and stay an error.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    par = raw.get("parallel", {})
    dp = par.get("data_parallel", 1)
    if isinstance(dp, int) and dp > 1:
        opt = raw.setdefault("optimize", {})
        if raw.get("train", {}).get("global_batch_size") is None:
            opt["gradient_accumulation_steps"] = (opt.get("gradient_accumulation_steps") or 1) * dp
        par["data_parallel"] = 1
        log.warning("data_parallel %d on a single process: training on one device with the same global "
                    "batch (gradient accumulation x%d); launch with `shardwise train --nproc %d` to use %d "
                    "devices", dp, dp, dp, dp)
    if par.get("data_parallel") == -1:
        par["data_parallel"] = 1


class Trainer(_LoopTrainer):
    """`Trainer(model=..., args=..., train_dataset=...).train()` as in the source documents."""

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, tokenizer: Any = None,
                 config: RunConfig | None = None, **_ignored: Any) -> None:
        if config is None and (model is None or args is None):
            raise ConfigError("Trainer needs model= and args= (TrainingArguments), or config= (a RunConfig)")
        super().__init__(config, model=model, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         tokenizer=tokenizer)
        self.args = args

    def train(self, resume: str | None = None, overwrite: bool | None = None) -> TrainResult:
        """Train; arguments are turned into a config now, so a changed train_dataset is used."""
        if self.args is not None:
            self.config = run_config_from(self.model, self.args)
            if overwrite is None:
                overwrite = self.args.overwrite_output_dir
        if self.train_dataset is None:
            raise ConfigError("Trainer has no train_dataset; pass one (TextDataset or create_dataset(...))")
        return super().train(resume=resume, overwrite=bool(overwrite))


class LLMTrainer(Trainer):
    """Seed 002's trainer: the same loop, taking `LLMArguments`."""
