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
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from .checkpoint.weights import load_model
from .config import RunConfig, translate_seed_keys, zero_stage_from
from .data.loader import unwrap_loader
from .errors import CheckpointError, ConfigError
from .models import build_model, resolve_model_config
from .models.hf import from_hf
from .resolve import resolve_config
from .train.trainer import Trainer as _LoopTrainer
from .train.trainer import TrainResult

log = logging.getLogger(__name__)


class AutoModelForCausalLM:
    """Builds a causal LM from a preset name, a shardwise checkpoint, or a seed-shaped config."""

    @staticmethod
    def from_pretrained(name_or_path: str, parallel_config: dict | None = None,
                        optimize_config: dict | None = None, device: str | torch.device = "cpu",
                        **model_overrides: Any) -> nn.Module:
        """A preset by name (freshly initialised), or the weights of a Hugging Face model directory
        (config.json + safetensors; LLaMA, Qwen2, Mistral, GPT-2) or of a checkpoint / run directory.

        Pass device="meta" to get the structure without memory; the Trainer materialises it.
        """
        if os.path.isdir(name_or_path):
            if model_overrides:
                raise ConfigError(
                    f"from_pretrained({name_or_path!r}, {', '.join(sorted(model_overrides))}=...): model "
                    "overrides apply to presets only; a checkpoint's model is the one it was trained as"
                )
            if os.path.isfile(os.path.join(name_or_path, "config.json")):  # a Hugging Face model directory
                model = from_hf(name_or_path, device=device)
                layout = {}
            else:
                model, cfg = load_model(name_or_path, device=device)
                layout = {"parallel": cfg.parallel.model_dump(), "optimize": cfg.optimize.model_dump()}
        elif _looks_like_path(name_or_path):
            raise CheckpointError(
                f"{name_or_path} does not exist; give a Hugging Face model directory, a run directory or "
                "checkpoint saved by shardwise (train.output_dir), or a preset name such as llama_7b"
            )
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
        canonical, warnings = translate_seed_keys(config)
        for w in warnings:
            log.warning(w)
        model_cfg = resolve_model_config(canonical.get("model") or {})
        model = build_model(model_cfg, device=device)
        model.shardwise_layout = {k: canonical[k] for k in ("parallel", "optimize", "train", "data", "run")
                                  if k in canonical}
        return model


def _looks_like_path(name: str) -> bool:
    """True for names a user means as a directory (./ckpt, /data/run, ~/x), never for preset names."""
    text = str(name)
    return os.sep in text or text.startswith((".", "~")) or (os.altsep is not None and os.altsep in text)


@dataclass
class TrainingArguments:
    """Training hyper-parameters in the names of the documents (and of Hugging Face).

    A field left at None was not given: it keeps what the model's config says (a seed YAML given to
    `from_config`, or the `optimize_config` given to `from_pretrained`), else `DEFAULTS`.
    """

    output_dir: Optional[str] = None
    num_train_epochs: Optional[float] = None
    max_steps: Optional[int] = None
    per_device_train_batch_size: Optional[int] = None
    learning_rate: Optional[float] = None
    fp16: Optional[bool] = None
    bf16: Optional[bool] = None
    mixed_precision: Optional[str] = None  # "O0".."O3" (seed 003) or "fp16"/"bf16"/"fp32"
    gradient_accumulation_steps: Optional[int] = None
    save_steps: Optional[int] = None
    save_strategy: Optional[str] = None  # "steps" (default) or "no"
    log_steps: Optional[int] = None
    logging_steps: Optional[int] = None
    eval_steps: Optional[int] = None
    warmup_steps: Optional[int] = None
    weight_decay: Optional[float] = None
    max_grad_norm: Optional[float] = None
    optimizer: Optional[str] = None
    lr_scheduler_type: Optional[str] = None
    min_lr: Optional[float] = None
    seed: Optional[int] = None
    overwrite_output_dir: bool = False

    SAVE_STRATEGIES: ClassVar[tuple[str, ...]] = ("steps", "no")
    # argument field -> `train` key
    TRAIN_KEYS: ClassVar[dict[str, str]] = {
        "output_dir": "output_dir", "num_train_epochs": "epochs", "max_steps": "max_steps",
        "per_device_train_batch_size": "micro_batch_size", "learning_rate": "lr", "log_steps": "log_steps",
        "logging_steps": "log_steps", "warmup_steps": "warmup_steps", "weight_decay": "weight_decay",
        "max_grad_norm": "max_grad_norm", "optimizer": "optimizer", "lr_scheduler_type": "decay_style",
        "min_lr": "min_lr", "seed": "seed", "save_steps": "save_steps", "eval_steps": "eval_steps",
    }
    # What a key is when neither the arguments nor the model's config give it (Hugging Face's choices).
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "output_dir": "runs/default", "micro_batch_size": 8, "lr": 5e-5, "log_steps": 10, "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "optimizer": "adamw", "decay_style": "cosine",
        "min_lr": 0.0, "seed": 42,
    }

    def __post_init__(self) -> None:
        """Refuse what would silently do something else (checked again when the run starts)."""
        self.check()

    def check(self) -> None:
        """Raise ConfigError for a save_strategy other than "steps" or "no"."""
        if self.save_strategy not in (None, *self.SAVE_STRATEGIES):
            raise ConfigError(f"TrainingArguments: save_strategy {self.save_strategy!r} is not supported; "
                              f"use one of {', '.join(map(repr, self.SAVE_STRATEGIES))}")

    def train_overrides(self) -> dict:
        """The `train` keys these arguments give."""
        return {key: getattr(self, name) for name, key in self.TRAIN_KEYS.items() if getattr(self, name) is not None}

    def optimize_overrides(self) -> dict:
        """The `optimize` keys these arguments give: accumulation and precision."""
        section: dict[str, Any] = {}
        if self.gradient_accumulation_steps is not None:
            section["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.fp16 and self.bf16:
            raise ConfigError("TrainingArguments: fp16 and bf16 are both True; choose one")
        if self.fp16 or self.bf16:
            section["mixed_precision"] = "fp16" if self.fp16 else "bf16"
        elif (self.fp16, self.bf16) != (None, None) and self.mixed_precision is None:
            section["mixed_precision"] = "fp32"  # fp16=False, bf16=False given: full precision
        mp = self.mixed_precision
        if mp in ("O0", "O1", "O2", "O3"):
            section["precision_level"] = mp
            section.setdefault("mixed_precision", "fp32" if mp == "O0" else "bf16")
        elif mp is not None:
            section["mixed_precision"] = mp
        return section

    def parallel_overrides(self) -> dict:
        """The `parallel` keys these arguments give (none in seed 000's shape)."""
        return {}


@dataclass
class LLMArguments(TrainingArguments):
    """Seed 002's arguments: layout plus `epochs`, `batch_size` (the global batch) and `lr`."""

    tensor_parallel: Optional[int] = None
    pipeline_parallel: Optional[int] = None
    data_parallel: Optional[int] = None
    use_zero: Optional[bool] = None
    zero_level: Optional[int] = None
    epochs: Optional[float] = None
    batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    lr: Optional[float] = None

    TRAIN_KEYS: ClassVar[dict[str, str]] = {
        **TrainingArguments.TRAIN_KEYS, "epochs": "epochs", "lr": "lr", "micro_batch_size": "micro_batch_size",
        "batch_size": "global_batch_size",
    }

    def train_overrides(self) -> dict:
        """As TrainingArguments; a global `batch_size` alone means micro-batches of 1 (seed 002)."""
        section = super().train_overrides()
        if "global_batch_size" in section:
            section.setdefault("micro_batch_size", 1)
        return section

    def parallel_overrides(self) -> dict:
        """TP, PP, DP and ZeRO as seed 002 names them."""
        section = {key: getattr(self, key) for key in ("tensor_parallel", "pipeline_parallel", "data_parallel")
                   if getattr(self, key) is not None}
        if self.use_zero is not None or self.zero_level is not None:
            section["zero_stage"] = zero_stage_from(self.use_zero, self.zero_level)  # as the YAML's keys
        return section


def run_config_from(model: nn.Module, args: TrainingArguments, seq_length: int | None = None) -> RunConfig:
    """Combine the model's remembered config with the arguments into one validated RunConfig.

    Precedence per key: what the arguments give, then the model's config, then `args.DEFAULTS`.
    `seq_length` is the length of the dataset's samples, which is what the run really trains on.
    """
    args.check()
    layout = getattr(model, "shardwise_layout", {}) or {}
    raw: dict[str, Any] = {"model": model.cfg.model_dump()}
    for section in ("parallel", "optimize", "train", "run", "data"):
        if section in layout:
            raw[section] = dict(layout[section])
    raw, warnings = translate_seed_keys(raw)  # e.g. optimize.max_grad_norm (seed 000) -> train
    for w in warnings:
        log.warning(w)
    train = raw.setdefault("train", {})
    given = args.train_overrides()
    for length, other in (("max_steps", "epochs"), ("epochs", "max_steps")):
        if length in given:  # one length: the one the user passed replaces the config's other one
            train.pop(other, None)
    train.update(given)
    for key, value in args.DEFAULTS.items():
        train.setdefault(key, value)
    if "epochs" not in train and "max_steps" not in train:
        train["epochs"] = 3.0
    if args.save_strategy == "no":
        train.pop("save_steps", None)  # save_strategy "no": only the final checkpoint
    raw.setdefault("parallel", {}).update(args.parallel_overrides())
    raw.setdefault("optimize", {}).update(args.optimize_overrides())
    _fold_data_parallel_on_one_process(raw)
    data = raw.setdefault("data", {})
    if seq_length is not None:
        if data.get("seq_length") not in (None, seq_length):
            log.warning("the config says seq_length %s but the dataset's samples are %d tokens long; "
                        "training on %d", data["seq_length"], seq_length, seq_length)
        data["seq_length"] = seq_length
    data["seq_length"] = data.get("seq_length") or model.cfg.max_position_embeddings
    return resolve_config(raw)


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
                    "batch (gradient accumulation x%d, the same loss as on %d devices); launching one process "
                    "per device is not available yet", dp, dp, dp)
    if par.get("data_parallel") == -1:
        par["data_parallel"] = 1


class Trainer(_LoopTrainer):
    """`Trainer(model=..., args=..., train_dataset=...).train()` as in the source documents."""

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, tokenizer: Any = None,
                 config: RunConfig | None = None) -> None:
        if config is None and (model is None or args is None):
            raise ConfigError("Trainer needs model= and args= (TrainingArguments), or config= (a RunConfig)")
        super().__init__(config, model=model, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         tokenizer=tokenizer)
        self.args = args
        self._given_tokenizer = tokenizer

    def train(self, resume: str | None = None, overwrite: bool | None = None) -> TrainResult:
        """Train; arguments are turned into a config now, so a changed train_dataset is used."""
        dataset = unwrap_loader(self.train_dataset)
        if self.args is not None:
            self.config = run_config_from(self.model, self.args, getattr(dataset, "seq_length", None))
            if overwrite is None:
                overwrite = self.args.overwrite_output_dir
            _check_loader_batch(self.train_dataset, self.config.train.micro_batch_size)
        if self.train_dataset is None and not (self.config.data.train_files or self.config.data.sources):
            raise ConfigError("Trainer has no train_dataset; pass one (TextDataset or create_dataset(...)), "
                              "or give data.train_files (or data.sources) in the config")
        # The dataset's tokenizer is saved with the run, so `shardwise generate RUN_DIR` can use it.
        self.tokenizer = self._given_tokenizer or getattr(dataset, "tokenizer", None)
        return super().train(resume=resume, overwrite=bool(overwrite))


def _check_loader_batch(data: Any, micro_batch_size: int) -> None:
    """The trainer batches samples itself: say so when create_dataset was given another batch size."""
    loader_batch = data.micro_batch_size if unwrap_loader(data) is not data else None
    if loader_batch is not None and loader_batch != micro_batch_size:
        log.warning("create_dataset(batch_size=%d) differs from the arguments' per-device batch size %d; "
                    "training uses %d samples per micro-batch", loader_batch, micro_batch_size, micro_batch_size)


class LLMTrainer(Trainer):
    """Seed 002's trainer: the same loop, taking `LLMArguments`."""
