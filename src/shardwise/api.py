"""The Python API of the source documents (`AutoModelForCausalLM`, `TrainingArguments`, `Trainer`,
`LLMArguments`, `LLMTrainer`), mapped onto shardwise's one config and one training loop.

Seed 000, section 5.4 and seed 002, section 3.3 run as written once their import line reads
`from shardwise import ...`. The model remembers the `parallel_config` / `optimize_config` it was
created with (or the whole seed YAML for `from_config`); the arguments object adds the training
hyper-parameters; together they become a `RunConfig`, validated like a YAML file.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from torch import nn

from .config import RunConfig, translate_seed_keys, validate
from .errors import CheckpointError, ConfigError
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
        elif _looks_like_path(name_or_path):
            raise CheckpointError(
                f"{name_or_path} does not exist; give a run directory or checkpoint saved by shardwise "
                "(train.output_dir), or a preset name such as llama_7b"
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


# Which arguments fields decide which `train` / `parallel` key. A key the user did not pass
# explicitly keeps the value of the seed YAML the model was made from (seed 002 puts min_lr,
# warmup_steps, decay_style, optimizer, micro_batch_size and grad_clip_norm there, not in
# LLMArguments), and only falls back to the arguments' default when the YAML does not give it.
_TRAIN_KEY_FIELDS = {
    "output_dir": ("output_dir",), "epochs": ("num_train_epochs", "epochs"), "max_steps": ("max_steps",),
    "micro_batch_size": ("per_device_train_batch_size", "micro_batch_size"),
    "lr": ("learning_rate", "lr"), "log_steps": ("log_steps", "logging_steps"),
    "warmup_steps": ("warmup_steps",), "weight_decay": ("weight_decay",), "max_grad_norm": ("max_grad_norm",),
    "optimizer": ("optimizer",), "decay_style": ("lr_scheduler_type",), "min_lr": ("min_lr",),
    "seed": ("seed",), "save_steps": ("save_steps", "save_strategy"), "eval_steps": ("eval_steps",),
    "global_batch_size": ("batch_size",),
}
_PARALLEL_KEY_FIELDS = {
    "tensor_parallel": ("tensor_parallel",), "pipeline_parallel": ("pipeline_parallel",),
    "zero_stage": ("use_zero", "zero_level"), "data_parallel": ("data_parallel",),
}


def _track_explicit(cls: type) -> type:
    """Record which fields a dataclass instance was given (in the call, or assigned later)."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_explicit", set(names[: len(args)]) | set(kwargs))
        object.__setattr__(self, "_tracking", False)
        init(self, *args, **kwargs)
        object.__setattr__(self, "_tracking", True)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if getattr(self, "_tracking", False):
            self._explicit.add(name)
        object.__setattr__(self, name, value)

    cls.__init__ = __init__
    cls.__setattr__ = __setattr__
    return cls


@_track_explicit
@dataclass
class TrainingArguments:
    """Training hyper-parameters in the names of the documents (and of Hugging Face).

    Fields left at their defaults do not override what the model's config (a seed YAML given to
    `from_config`, or `optimize_config` given to `from_pretrained`) already says.
    """

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
        elif self.sets_precision() and self.mixed_precision is None:
            section["mixed_precision"] = "fp32"  # fp16=False, bf16=False given: full precision
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

    def explicit_keys(self, table: dict[str, tuple[str, ...]]) -> set[str]:
        """Config keys (of `_TRAIN_KEY_FIELDS` or `_PARALLEL_KEY_FIELDS`) the user set explicitly."""
        given = getattr(self, "_explicit", set())
        return {key for key, names in table.items() if given.intersection(names)}

    def sets_precision(self) -> bool:
        """True when fp16 / bf16 / mixed_precision were given, so the arguments decide the dtype."""
        return bool(getattr(self, "_explicit", set()) & {"fp16", "bf16", "mixed_precision"})


@_track_explicit
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
            if self.micro_batch_size is None and "per_device_train_batch_size" not in self._explicit:
                section["micro_batch_size"] = 1  # seed 002's default micro-batch
        return section

    def parallel_section(self) -> dict:
        """TP, PP and ZeRO as seed 002 names them."""
        section = {"tensor_parallel": self.tensor_parallel, "pipeline_parallel": self.pipeline_parallel,
                   "zero_stage": self.zero_level if self.use_zero else 0}
        if self.data_parallel is not None:
            section["data_parallel"] = self.data_parallel
        return section


def run_config_from(model: nn.Module, args: TrainingArguments, seq_length: int | None = None) -> RunConfig:
    """Combine the model's remembered layout with the arguments into one validated RunConfig.

    `seq_length` is the length of the dataset's samples, which is what the run really trains on.
    """
    layout = getattr(model, "shardwise_layout", {}) or {}
    raw: dict[str, Any] = {"model": model.cfg.model_dump()}
    for section in ("parallel", "optimize", "train", "run", "data"):
        if section in layout:
            raw[section] = dict(layout[section])
    raw, warnings = translate_seed_keys(raw)  # e.g. optimize.max_grad_norm (seed 000) -> train
    for w in warnings:
        log.warning(w)
    explicit = args.explicit_keys(_TRAIN_KEY_FIELDS)
    from_config = raw.get("train") or {}
    raw["train"] = _merge_arguments(from_config, args.train_section(), explicit)
    # One length: the one the user passed, else the config's; the default 3 epochs only without either.
    for given, other in (("max_steps", "epochs"), ("epochs", "max_steps")):
        if given in explicit and other not in explicit:
            raw["train"].pop(other, None)
        elif given in from_config and other not in from_config and other not in explicit:
            raw["train"].pop(other, None)
    if args.save_strategy != "steps":
        raw["train"].pop("save_steps", None)  # save_strategy "no"/"epoch": no periodic saves
    raw["parallel"] = _merge_arguments(raw.get("parallel") or {}, args.parallel_section(),
                                       args.explicit_keys(_PARALLEL_KEY_FIELDS))
    # Only what the arguments set: fp16/bf16 left unset keep the model's optimize_config precision.
    raw.setdefault("optimize", {}).update(args.optimize_section())
    _fold_data_parallel_on_one_process(raw)
    data = raw.setdefault("data", {})
    if seq_length is not None:
        if data.get("seq_length") not in (None, seq_length):
            log.warning("the config says seq_length %s but the dataset's samples are %d tokens long; "
                        "training on %d", data["seq_length"], seq_length, seq_length)
        data["seq_length"] = seq_length
    data["seq_length"] = data.get("seq_length") or model.cfg.max_position_embeddings
    return validate(raw)


def _merge_arguments(from_config: dict, from_args: dict, explicit: set[str]) -> dict:
    """The config's section overlaid by the arguments the user passed, then by the arguments' defaults
    for keys the config does not give."""
    merged = dict(from_config)
    for key, value in from_args.items():
        if key in explicit or key not in merged:
            merged[key] = value
    return merged


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
                    "batch (gradient accumulation x%d); launching one process per device is not available "
                    "yet", dp, dp)
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
        self._given_tokenizer = tokenizer

    def train(self, resume: str | None = None, overwrite: bool | None = None) -> TrainResult:
        """Train; arguments are turned into a config now, so a changed train_dataset is used."""
        dataset = _underlying_dataset(self.train_dataset)
        if self.args is not None:
            self.config = run_config_from(self.model, self.args, getattr(dataset, "seq_length", None))
            if overwrite is None:
                overwrite = self.args.overwrite_output_dir
            _check_loader_batch(self.train_dataset, self.config.train.micro_batch_size)
        if self.train_dataset is None and not self.config.data.train_files:
            raise ConfigError("Trainer has no train_dataset; pass one (TextDataset or create_dataset(...)), "
                              "or give data.train_files in the config")
        # The dataset's tokenizer is saved with the run, so `shardwise generate RUN_DIR` can use it.
        self.tokenizer = self._given_tokenizer or getattr(dataset, "tokenizer", None)
        return super().train(resume=resume, overwrite=bool(overwrite))


def _underlying_dataset(data: Any) -> Any:
    """The dataset itself, also when `create_dataset` wrapped it in a loader."""
    if hasattr(data, "dataset") and hasattr(data, "next_step"):
        return data.dataset
    return data


def _check_loader_batch(data: Any, micro_batch_size: int) -> None:
    """The trainer batches samples itself: say so when create_dataset was given another batch size."""
    loader_batch = getattr(data, "micro_batch_size", None) if hasattr(data, "next_step") else None
    if loader_batch is not None and loader_batch != micro_batch_size:
        log.warning("create_dataset(batch_size=%d) differs from the arguments' per-device batch size %d; "
                    "training uses %d samples per micro-batch", loader_batch, micro_batch_size, micro_batch_size)


class LLMTrainer(Trainer):
    """Seed 002's trainer: the same loop, taking `LLMArguments`."""
