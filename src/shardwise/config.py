"""One typed schema for a whole run, YAML loading, the source documents' YAML shapes, and overrides.

A run is described by five sections (`model`, `parallel`, `optimize`, `train`, `data`) and a small
`run` section (device, eager or compiled). `load_config(path, overrides)` reads YAML, translates the
keys of the two seed shapes (MindSpore Transformers' `train_config.yaml` and `llm_pretrain.yaml`) to
ours, applies `--set a.b=value` overrides, and validates everything. Mistakes raise `ConfigError`
naming the key as the user's file (or `--set`) spells it, what is allowed, and the closest valid key
in the spelling of the shape the file is written in (a seed 000 file gets `learning_rate`, not
`train.lr`).
"""

from __future__ import annotations

import difflib
import io
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError
from .models.config import ModelConfig

log = logging.getLogger(__name__)


# Learning rates a fine-tune from `model.init_from` starts with unless train.lr is given (seed 003, 4.3:
# 2e-5..5e-5 for full fine-tuning, 1e-4..3e-4 for LoRA).
FINETUNE_LR_FULL = 2e-5
FINETUNE_LR_LORA = 2e-4


class _Section(BaseModel):
    # inf and nan are no setting's value (an epoch count of inf would never end): refuse them here.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ParallelConfig(_Section):
    """How the run is split over devices. The product dp x tp x pp must equal the device count."""

    data_parallel: int = Field(1, description="data-parallel degree; -1 = what the device count leaves")
    data_parallel_replicate: int = Field(
        1, ge=1, description="HSDP: replicas of the sharded group (e.g. nodes); must divide data_parallel"
    )
    tensor_parallel: int = Field(1, ge=1, description="tensor (model) parallel degree")
    sequence_parallel: bool = Field(True, description="shard norms/dropout over the sequence with TP")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline stages")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="0 replicate; 1 shard optimizer state; 2 + gradients; 3 + parameters"
    )
    micro_batch_num: int = Field(1, ge=1, description="pipeline micro-batches per step")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b", description="pipeline schedule"
    )
    virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved)")
    stage_layers: Optional[list[int]] = Field(None, description="layers per pipeline stage")

    @field_validator("data_parallel")
    @classmethod
    def _dp(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be a positive integer, or -1 for what the device count leaves")
        return v

    def world_size(self, devices: int | None = None) -> int:
        """Number of devices this layout needs (resolving data_parallel=-1 against `devices`)."""
        tp_pp = self.tensor_parallel * self.pipeline_parallel
        if self.data_parallel == -1:
            if devices is None:
                return tp_pp
            if devices % tp_pp:
                raise ConfigError(
                    f"parallel.data_parallel is -1 but {devices} devices are not divisible by "
                    f"tensor_parallel x pipeline_parallel = {tp_pp}; use a device count that is a "
                    f"multiple of {tp_pp} or lower those degrees"
                )
            return devices
        return self.data_parallel * tp_pp

    def dp_degree(self, devices: int | None = None) -> int:
        """Resolved data-parallel degree."""
        return self.world_size(devices) // (self.tensor_parallel * self.pipeline_parallel)


class OptimizeConfig(_Section):
    """Memory and speed settings: precision, recompute, accumulation, offload, compile."""

    mixed_precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="training dtype")
    precision_level: Optional[Literal["O0", "O1", "O2", "O3"]] = Field(
        None,
        description="O0 fp32; O1 autocast, fp32 weights; O2 16-bit weights + fp32 master copy in the "
        "optimizer; O3 pure 16-bit. Default: O0 for fp32, O2 otherwise",
    )
    loss_scale: Union[Literal["dynamic"], float] = Field(
        "dynamic", description="fp16 loss scaling: 'dynamic' or a fixed scale"
    )
    initial_loss_scale: float = Field(2.0**16, gt=0, description="starting dynamic loss scale")
    recompute: Literal["none", "full", "selective"] = Field(
        "none", description="activation recomputation: none, full blocks, or selective (keep matmuls)"
    )
    recompute_every: int = Field(1, ge=1, description="recompute every k-th layer (full recompute)")
    gradient_accumulation_steps: Optional[int] = Field(
        None, ge=1, description="micro-batches per optimizer step (derived from global_batch_size if unset)"
    )
    offload_optimizer: bool = Field(False, description="keep optimizer state in CPU memory")
    offload_params: bool = Field(False, description="keep parameters in CPU memory between uses")

    @model_validator(mode="after")
    def _level_needs_16_bit(self) -> "OptimizeConfig":
        if self.mixed_precision == "fp32" and self.precision_level not in (None, "O0"):
            raise ValueError(
                f"optimize.precision_level {self.precision_level} needs optimize.mixed_precision bf16 or fp16 "
                "(fp32 is O0)"
            )
        return self

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_bool(cls, v: Any) -> Any:
        if v is True:
            return "full"
        if v is False or v is None:
            return "none"
        return v

    def level(self) -> str:
        """The precision level in force."""
        if self.mixed_precision == "fp32":
            return "O0"
        return self.precision_level or "O2"


class TrainConfig(_Section):
    """Optimizer, schedule, length, batch sizes, logging, evaluation and checkpoints."""

    output_dir: str = Field("runs/default", description="run directory: checkpoints, metrics, logs")
    seed: int = Field(42, ge=0, le=2**63 - 1, description="seed for weights, data order and dropout")
    max_steps: Optional[int] = Field(None, ge=1, description="optimizer steps (or give epochs)")
    epochs: Optional[float] = Field(None, gt=0, description="passes over the training data")
    micro_batch_size: int = Field(1, ge=1, description="samples per device per micro-batch")
    global_batch_size: Optional[int] = Field(
        None, ge=1, description="samples per optimizer step over all devices"
    )
    optimizer: Literal["adamw", "adam", "sgd"] = Field("adamw", description="optimizer")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of decay")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="decay after warmup; wsd = warmup-stable-decay"
    )
    wsd_decay_ratio: float = Field(0.1, gt=0, le=1, description="WSD: fraction of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only)")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1 (SGD: momentum)")
    beta2: float = Field(0.95, ge=0, lt=1, description="Adam beta2")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="gradient clipping norm; null = off")
    log_steps: int = Field(10, ge=1, description="log metrics every N steps")
    eval_steps: Optional[int] = Field(
        None, ge=1, description="evaluate every N steps; with eval data the last step is always evaluated"
    )
    eval_batches: Optional[int] = Field(None, ge=1, description="cap on eval micro-batches")
    save_steps: Optional[int] = Field(None, ge=1, description="checkpoint every N steps (and at the end)")
    keep_checkpoints: int = Field(3, ge=1, description="keep the newest K checkpoints")
    nan_policy: Literal["stop", "skip"] = Field("stop", description="on a NaN/Inf loss")
    check_replicas_steps: Optional[int] = Field(
        None, ge=1, description="every N steps compare parameter checksums across data-parallel replicas"
    )
    peak_tflops: Optional[float] = Field(None, gt=0, description="device peak for MFU (default: table/measured)")
    progress_bar: bool = Field(True, description="show a progress bar")
    tensorboard: bool = Field(True, description="write TensorBoard events when it is installed")

    @model_validator(mode="after")
    def _length(self) -> "TrainConfig":
        if self.max_steps is None and self.epochs is None:
            raise ValueError("give train.max_steps or train.epochs")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr {self.min_lr} is above train.lr {self.lr}; lower min_lr")
        return self


class DataConfig(_Section):
    """Where the data comes from and how it becomes samples."""

    kind: Literal["pretrain", "instruction"] = Field(
        "pretrain", description="pretrain: raw text packed into samples; instruction: SFT .jsonl"
    )
    train_files: list[str] = Field(
        default_factory=list, description="globs of .txt/.jsonl/.parquet files, or a `shardwise prepare` dir"
    )
    eval_files: Optional[list[str]] = Field(None, description="globs of held-out files (or a prepared dir)")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="tail of the data held out for eval")
    format: Literal["auto", "txt", "jsonl", "parquet"] = Field(
        "auto", description="input format; auto = by file extension"
    )
    text_field: str = Field("text", description="field holding the text in .jsonl/.parquet records")
    txt_documents: Literal["file", "paragraph"] = Field(
        "file", description=".txt: one document per file, or documents separated by blank lines"
    )
    min_chars: int = Field(1, ge=0, description="drop documents with fewer non-space characters")
    max_length: Optional[int] = Field(
        None, ge=1, description="truncate each document to this many tokens (null: split across samples)"
    )
    on_bad_line: Literal["stop", "skip"] = Field(
        "stop", description="a .jsonl line that is not JSON or lacks the field: stop, or skip and count"
    )
    prepare_workers: Optional[int] = Field(None, ge=1, description="tokenising processes (default: cores)")
    tokenizer: Optional[str] = Field(
        None, description="tokenizer dir or SentencePiece .model; null = train a BPE one"
    )
    seq_length: Optional[int] = Field(
        None, ge=2, description="tokens per sample; default model.max_position_embeddings"
    )
    reset_attention_mask: bool = Field(True, description="attention stays inside each packed document")
    reset_position_ids: bool = Field(True, description="positions restart at each packed document")
    num_workers: int = Field(0, ge=0, description="loader worker processes (0 = read in the trainer)")
    template: Union[Literal["auto", "default", "tokenizer"], dict[str, Any]] = Field(
        "auto", description="instruction: chat template (auto = tokenizer's if any, else [INST] form)"
    )
    packing: Literal["pack", "pad", "dynamic"] = Field(
        "pack", description="instruction: pack samples, pad each, or batch by a token budget"
    )
    truncation: Literal["truncate", "drop"] = Field(
        "truncate", description="instruction: what to do with samples longer than seq_length"
    )
    cache_dir: Optional[str] = Field(
        None, description="tokenizer/prepared-data cache (default $SHARDWISE_CACHE or ~/.cache/shardwise)"
    )

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class LoraConfig(_Section):
    """LoRA: train low-rank adapters beside chosen projections; every base weight stays frozen."""

    r: int = Field(8, ge=1, description="rank of the adapters")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: adapters are scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Union[str, list[str]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="projections to adapt: names (ours wq.. or HF q_proj..; suffix match) or regexes",
    )

    @model_validator(mode="before")
    @classmethod
    def _peft_names(cls, v: Any) -> Any:
        # peft and the documents' LoRAConfig call them lora_alpha / lora_dropout (and rank lora_rank).
        if isinstance(v, dict):
            v = dict(v)
            for theirs, ours in (("lora_alpha", "alpha"), ("lora_dropout", "dropout"), ("lora_rank", "r")):
                if theirs in v:
                    if ours in v and v[ours] != v[theirs]:
                        raise ValueError(f"lora.{theirs} and lora.{ours} differ; give one of them")
                    v[ours] = v.pop(theirs)
        return v

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: Any) -> Any:
        if not v:
            raise ValueError("name at least one module, e.g. [q_proj, v_proj]")
        return v


class FreezeConfig(_Section):
    """Parameters kept fixed while fine-tuning: they get no gradients and no optimizer state."""

    embeddings: bool = Field(False, description="freeze the token (and position) embeddings")
    layers: int = Field(0, ge=0, description="freeze the bottom N transformer blocks")

    def active(self) -> bool:
        """Whether anything is frozen."""
        return self.embeddings or self.layers > 0


class RunSection(_Section):
    """Where and how the run executes."""

    device: Literal["auto", "cpu", "cuda", "npu"] = Field("auto", description="device kind")
    compile: bool = Field(False, description="torch.compile the model (seed: mode graph / mode 0)")
    num_threads: Optional[int] = Field(None, ge=1, description="CPU threads (default: all cores)")
    timeout_s: float = Field(
        600.0, gt=0, description="distributed: how long a rank waits for the others before failing"
    )


class RunConfig(_Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optimize: OptimizeConfig = Field(default_factory=OptimizeConfig)
    train: TrainConfig
    data: DataConfig = Field(default_factory=DataConfig)
    run: RunSection = Field(default_factory=RunSection)
    lora: Optional[LoraConfig] = Field(None, description="LoRA adapters; null = train the weights themselves")
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)

    @field_validator("model", mode="before")
    @classmethod
    def _preset(cls, v: Any) -> Any:
        for key in ("preset", "init_from"):  # both are looked up before the section is validated
            if isinstance(v, dict) and v.get(key) is not None and not isinstance(v[key], str):
                raise ValueError(f"model.{key} = {v[key]!r} must be text: "
                                 + ("a preset name" if key == "preset" else "a model or checkpoint directory"))
        if isinstance(v, dict) and v.get("init_from"):
            from .models.pretrained import architecture_with_overrides

            return architecture_with_overrides(v)  # the architecture of the weights, checked against v
        if isinstance(v, dict) and v.get("preset"):
            from .models.registry import get_preset

            return {**get_preset(v["preset"]), **v}  # the user's keys win over the preset's
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        m, p = self.model, self.parallel
        _check_numbers(self)
        if self.data.seq_length is None:
            self.data.seq_length = m.max_position_embeddings
        if self.data.seq_length > m.max_position_embeddings:
            raise ValueError(
                f"data.seq_length {self.data.seq_length} is above model.max_position_embeddings "
                f"{m.max_position_embeddings}; lower seq_length or raise max_position_embeddings"
            )
        if p.tensor_parallel > 1:
            if p.sequence_parallel and self.data.seq_length % p.tensor_parallel:
                raise ValueError(
                    f"sequence parallel splits each sample's {self.data.seq_length} positions over "
                    f"tensor_parallel {p.tensor_parallel} ranks: make data.seq_length a multiple of it"
                )
            for name, n in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads),
                            ("intermediate_size", m.intermediate_size)):
                if n % p.tensor_parallel:
                    raise ValueError(
                        f"parallel.tensor_parallel {p.tensor_parallel} must divide model.{name} {n}"
                    )
        if p.pipeline_parallel * p.virtual_stages > m.num_layers:
            raise ValueError(
                f"pipeline_parallel x virtual_stages = {p.pipeline_parallel * p.virtual_stages} "
                f"exceeds model.num_layers {m.num_layers}"
            )
        o = self.optimize
        if o.mixed_precision == "fp16" and o.level() == "O3" and self.train.eps < 1e-4:
            raise ValueError(
                f"fp16 level O3 keeps the optimizer state in fp16, where train.eps {self.train.eps:g} rounds "
                "to 0 and Adam divides by zero; set train.eps: 1.0e-4, or use precision_level O2 or bf16"
            )
        if p.stage_layers is not None and sum(p.stage_layers) != m.num_layers:
            raise ValueError(
                f"parallel.stage_layers sums to {sum(p.stage_layers)}, not model.num_layers {m.num_layers}"
            )
        if p.pipeline_parallel > 1:
            self._check_pipeline()
        self._check_finetuning()
        return self

    def _check_finetuning(self) -> None:
        """Freezing and LoRA settings that cannot work, and the fine-tuning defaults of `init_from`."""
        m, f = self.model, self.freeze
        if f.layers > m.num_layers:
            raise ValueError(f"freeze.layers {f.layers} exceeds model.num_layers {m.num_layers}")
        if self.lora is not None and f.active():
            raise ValueError(
                "freeze has no effect with lora: LoRA already keeps every base weight fixed and trains only "
                "the adapters; remove the freeze section, or lora to freeze layers of a full fine-tune"
            )
        if self.lora is not None:
            import torch

            from .models.transformer import Transformer
            from .peft.lora import select_targets

            with torch.device("meta"):  # the structure only: a target that matches nothing fails now
                select_targets(Transformer(m), self.lora.target_modules)
        if self.lora is not None and self.lora.dropout and self.parallel.tensor_parallel > 1:
            raise ValueError(
                "lora.dropout with tensor_parallel > 1 is not supported (the adapters' input is replicated "
                "over the TP ranks and would get different masks on each); set lora.dropout: 0"
            )
        if m.init_from is not None:
            # Fine-tuning starts from trained weights: smaller steps and no weight decay toward zero,
            # unless the config says otherwise.
            given = self.train.model_fields_set
            if "lr" not in given:
                self.train.lr = FINETUNE_LR_LORA if self.lora is not None else FINETUNE_LR_FULL
            if "weight_decay" not in given:
                self.train.weight_decay = 0.0
            if self.train.min_lr > self.train.lr:
                raise ValueError(f"train.min_lr {self.train.min_lr} is above the fine-tuning lr {self.train.lr}")
            if self.data.tokenizer is None:
                from .models.pretrained import pretrained_tokenizer

                # Data read from files is tokenised with the weights' own tokenizer (a dataset handed
                # to the Python API brings its own).
                self.data.tokenizer = pretrained_tokenizer(m.init_from, required=bool(self.data.train_files))

    def _check_pipeline(self) -> None:
        """The pipeline layout fails here, before any process starts (schedule, virtual stages, stage
        layers), and so do an accumulation that is not a whole number of pipeline steps and data whose
        micro-batches vary in shape. Whether micro_batch_num suits the schedule is checked when a run
        starts (`trainer.layout_for`), so that configs written for other frameworks (seed 002's) load."""
        from .parallel.pipeline import check_pipeline

        p = self.parallel
        check_pipeline(self.model.num_layers, p.pipeline_parallel, p.virtual_stages, p.schedule, p.stage_layers)
        if self.data.kind == "instruction" and self.data.packing == "dynamic":
            raise ConfigError(
                "data.packing dynamic makes micro-batches of varying shapes, but a pipeline step runs its "
                "micro-batches as one batch of one shape; use data.packing pack or pad with pipeline_parallel > 1"
            )
        ga = self.optimize.gradient_accumulation_steps
        if ga is not None and ga % p.micro_batch_num:
            raise ConfigError(
                f"optimize.gradient_accumulation_steps {ga} is not a multiple of parallel.micro_batch_num "
                f"{p.micro_batch_num}: under pipeline parallelism an optimizer step runs whole pipeline steps of "
                f"micro_batch_num micro-batches each; set gradient_accumulation_steps to a multiple of "
                f"{p.micro_batch_num}, or leave it unset (it then equals micro_batch_num)"
            )

    def gradient_accumulation(self, devices: int | None = None) -> int:
        """Micro-batches per optimizer step on each data-parallel rank.

        Under pipeline parallelism the micro-batches are the pipeline's: a pipeline step (one
        schedule run) takes `parallel.micro_batch_num` of them, and an optimizer step runs
        accumulation / micro_batch_num pipeline steps. The accumulation defaults to micro_batch_num
        (one pipeline step per optimizer step) and must be a multiple of it.
        """
        dp = self.parallel.dp_degree(devices)
        ga = self.optimize.gradient_accumulation_steps
        gbs = self.train.global_batch_size
        mbs = self.train.micro_batch_size
        pipeline = self.parallel.pipeline_parallel > 1
        mbn = self.parallel.micro_batch_num
        if gbs is None:
            return ga or (mbn if pipeline else 1)
        if gbs % (mbs * dp):
            raise ConfigError(
                f"train.global_batch_size {gbs} is not divisible by micro_batch_size {mbs} x "
                f"data_parallel {dp} = {mbs * dp}; choose a global batch that is a multiple of {mbs * dp}"
            )
        derived = gbs // (mbs * dp)
        if ga is not None and ga != derived:
            raise ConfigError(
                f"optimize.gradient_accumulation_steps {ga} contradicts train.global_batch_size {gbs} "
                f"= micro_batch_size {mbs} x data_parallel {dp} x {derived}; set only one of them"
            )
        if pipeline and derived % mbn:
            raise ConfigError(
                f"train.global_batch_size {gbs} = micro_batch_size {mbs} x data_parallel {dp} x {derived} "
                f"micro-batches per step, which is not a multiple of parallel.micro_batch_num {mbn}: under "
                "pipeline parallelism an optimizer step runs whole pipeline steps; choose a global batch that "
                f"is a multiple of {mbs * dp * mbn}"
            )
        return derived

    def global_batch_size(self, devices: int | None = None) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        dp = self.parallel.dp_degree(devices)
        return self.train.micro_batch_size * dp * self.gradient_accumulation(devices)


def _numbers_of(section: BaseModel, prefix: str) -> list[tuple[str, float]]:
    """(dotted key, value) of every number in a validated section, nested sections included."""
    out: list[tuple[str, float]] = []
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            out.extend(_numbers_of(value, f"{prefix}.{name}"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((f"{prefix}.{name}", value))
    return out


# An integer setting (a size, a degree, a count of steps) above this is a slip, not a plan: torch
# takes 64-bit sizes, and the product of two settings (a weight's shape) must still fit in one.
MAX_SETTING = 2**31 - 1
_UNBOUNDED = ("train.seed",)  # bounded by its own field (any 63-bit seed is fine)


def _check_numbers(cfg: BaseModel) -> None:
    """Every float finite (the model section's schema takes inf and nan) and every integer setting
    within MAX_SETTING, in one place for all sections."""
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        if not isinstance(value, BaseModel):
            continue
        for name, number in _numbers_of(value, section):
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"{name} = {number}: give a finite number")
            if isinstance(number, int) and abs(number) > MAX_SETTING and name not in _UNBOUNDED:
                raise ValueError(f"{name} = {number} is larger than any run can use (at most {MAX_SETTING:,}); "
                                 "check for a slip of the keyboard")


# --- The source documents' YAML shapes -------------------------------------------------------------

_DEVICE_NAMES = {"ascend": "npu", "npu": "npu", "gpu": "cuda", "cuda": "cuda", "cpu": "cpu", "auto": "auto"}


def _device(v: Any) -> Any:
    if isinstance(v, str) and v.lower() in _DEVICE_NAMES:
        return _DEVICE_NAMES[v.lower()]
    raise ValueError("use Ascend (or npu), GPU (or cuda), CPU, or auto")


def _graph_mode(v: Any) -> Any:
    # MindSpore: mode graph / GRAPH_MODE = 0 compiles; pynative / PYNATIVE_MODE = 1 runs eagerly.
    text = str(v).lower() if isinstance(v, (str, int)) and not isinstance(v, bool) else None
    if text in ("graph", "graph_mode", "0"):
        return True
    if text in ("pynative", "pynative_mode", "1", "eager"):
        return False
    raise ValueError("use graph (or 0) to compile, pynative (or 1) for eager")


# The two shapes by the document that uses them: a typo is matched against the spellings of the
# shapes the user's file is written in (a seed 000 file gets `learning_rate`, ours `train.lr`).
SEED_000, SEED_002 = "seed 000 (train_config.yaml)", "seed 002 (llm_pretrain.yaml)"

_SEED_000_KEYS: dict[str, tuple[str, Any]] = {
    "model_name": ("model.preset", None),
    "device_target": ("run.device", _device),
    "mode": ("run.compile", _graph_mode),
    "seed": ("train.seed", None),
    "batch_size": ("train.micro_batch_size", None),
    "seq_length": ("data.seq_length", None),
    "epochs": ("train.epochs", None),
    "learning_rate": ("train.lr", None),
    "save_ckpt": ("train.output_dir", None),
    "save_steps": ("train.save_steps", None),
    "parallel.model_parallel": ("parallel.tensor_parallel", None),
    "parallel.pipeline_stages": ("parallel.pipeline_parallel", None),
    "optimize.max_grad_norm": ("train.max_grad_norm", None),
}
_SEED_002_KEYS: dict[str, tuple[str, Any]] = {
    "model.seq_length": ("data.seq_length", None),
    "train.batch_size": ("train.global_batch_size", None),
    "train.grad_clip_norm": ("train.max_grad_norm", None),
    "train.loss_scale": ("optimize.loss_scale", None),
    "run.mode": ("run.compile", _graph_mode),
    "run.device_target": ("run.device", _device),
}
# Each entry: seed key (dotted) -> (our key, value translation). Applied before validation, so both
# seed files load as written there.
_SEED_KEYS: dict[str, tuple[str, Any]] = {**_SEED_000_KEYS, **_SEED_002_KEYS}
_ZERO_KEYS = ("parallel.use_zero", "parallel.zero_level")  # seed 002's ZeRO pair -> parallel.zero_stage

# Accepted so that seed files load, but they change nothing here: the warning says why.
_NO_EFFECT_KEYS = {
    "run.enable_graph_kernel": "MindSpore graph-kernel fusion has no PyTorch equivalent; use run.compile",
    "run.graph_kernel_flags": "MindSpore graph-kernel flags have no PyTorch equivalent; use run.compile",
    "enable_graph_kernel": "MindSpore graph-kernel fusion has no PyTorch equivalent; use run.compile",
    "graph_kernel_flags": "MindSpore graph-kernel flags have no PyTorch equivalent; use run.compile",
    "parallel.auto_parallel": "shardwise applies the layout you give in parallel.*",
    "parallel.micro_batch_interleave": "MindSpore's micro-batch interleaving has no PyTorch equivalent",
}

# Every seed spelling and the shape it belongs to.
_SEED_SPELLINGS: dict[str, str] = {
    **{k: SEED_000 for k in _SEED_000_KEYS},
    **{k: SEED_002 for k in _SEED_002_KEYS},
    **{k: SEED_002 for k in _ZERO_KEYS},
    "enable_graph_kernel": SEED_000, "graph_kernel_flags": SEED_000, "parallel.auto_parallel": SEED_000,
    "run.enable_graph_kernel": SEED_002, "run.graph_kernel_flags": SEED_002,
    "parallel.micro_batch_interleave": SEED_002,
}

# Hints for names people commonly try that are neither ours nor a seed key.
_HINTS = {"learning_rate": "lr", "batch_size": "micro_batch_size", "grad_clip": "max_grad_norm",
          "n_layers": "num_layers", "n_heads": "num_heads", "steps": "max_steps",
          "gradient_accumulation_steps": "optimize.gradient_accumulation_steps"}


def _get(d: dict, dotted: str) -> tuple[bool, Any]:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _pop(d: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    cur = d
    for part in parents:
        cur = cur[part]
    del cur[last]
    if parents and not cur:
        _pop(d, ".".join(parents))


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    cur = d
    for i, part in enumerate(parents):
        nxt = cur.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {dotted}: {'.'.join(parents[: i + 1])} is not a section")
        cur = nxt
    cur[last] = value


def zero_stage_from(use_zero: bool | None, zero_level: int | None) -> int:
    """Seed 002's `use_zero` + `zero_level` as one ZeRO stage (use_zero false means stage 0)."""
    if use_zero is False:
        return 0
    return int(zero_level) if zero_level is not None else 1


def translate_seed_keys(raw: dict) -> tuple[dict, list[str]]:
    """Rewrite the seed documents' keys into ours; return the new dict and warnings to show."""
    canonical, warnings, _ = translate_with_origins(raw)
    return canonical, warnings


def translate_with_origins(raw: dict) -> tuple[dict, list[str], dict[str, str]]:
    """`translate_seed_keys`, plus where each translated key came from (our dotted key -> the key as
    the user wrote it), so that an error about its value can name the key the user knows."""
    raw = _deepcopy(raw)
    warnings: list[str] = []
    origins: dict[str, str] = {}
    _translate_zero(raw, origins)
    # `batch_size` is the per-device batch at the top level of seed 000 but the global batch under
    # `train` in seed 002 (next to micro_batch_size): the table keeps the two apart by their paths.
    for seed_key, (our_key, fn) in _SEED_KEYS.items():
        found, value = _get(raw, seed_key)
        if not found:
            continue
        _pop(raw, seed_key)
        _merge_into(raw, our_key, _seed_value(seed_key, value, fn), seed_key)
        origins[our_key] = seed_key
    for key, why in _NO_EFFECT_KEYS.items():
        found, value = _get(raw, key)
        if found:
            _pop(raw, key)
            warnings.append(f"{key}: {value!r} has no effect in shardwise ({why})")
    # Seed 002 gives seq_length in the model section: make the model long enough for it. Only a
    # usable length is copied, so that a wrong one is reported once, under the key the user wrote.
    found_seq, seq = _get(raw, "data.seq_length")
    model = raw.get("model")
    if found_seq and isinstance(model, dict) and model and "max_position_embeddings" not in model:
        if not model.get("preset") and isinstance(seq, int) and not isinstance(seq, bool) and seq >= 2:
            model["max_position_embeddings"] = seq
    return raw, warnings, origins


def _seed_value(seed_key: str, value: Any, fn: Any) -> Any:
    """A seed value in our terms; a value the seed key cannot take names the key as written."""
    if fn is None:
        return value
    try:
        return fn(value)
    except ValueError as e:
        raise ConfigError(f"{seed_key} = {value!r} is not allowed; {e}") from None


def _translate_zero(raw: dict, origins: dict[str, str]) -> None:
    """Seed 002's `parallel.use_zero` + `parallel.zero_level` -> `parallel.zero_stage`."""
    found_use, use_zero = _get(raw, "parallel.use_zero")
    found_lvl, level = _get(raw, "parallel.zero_level")
    if not (found_use or found_lvl):
        return
    if found_use and not isinstance(use_zero, bool):
        raise ConfigError(f"parallel.use_zero = {use_zero!r} is not allowed; use true or false")
    if found_lvl and (isinstance(level, bool) or level not in (0, 1, 2, 3)):
        raise ConfigError(f"parallel.zero_level = {level!r} is not allowed; use 0, 1, 2 or 3 (the ZeRO stage)")
    stage = zero_stage_from(use_zero if found_use else None, level if found_lvl else None)
    for key in _ZERO_KEYS:
        if _get(raw, key)[0]:
            _pop(raw, key)
    _merge_into(raw, "parallel.zero_stage", stage, "parallel.use_zero/zero_level")
    origins["parallel.zero_stage"] = "parallel.zero_level" if found_lvl else "parallel.use_zero"


def _merge_into(raw: dict, our_key: str, value: Any, seed_key: str) -> None:
    found, existing = _get(raw, our_key)
    if found and existing != value:
        raise ConfigError(
            f"{seed_key} ({value!r}) and {our_key} ({existing!r}) set the same thing differently; "
            "keep one of them"
        )
    _set(raw, our_key, value)


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


# --- Overrides ---------------------------------------------------------------------------------------


def apply_overrides(raw: dict, overrides: list[str], origins: dict[str, str] | None = None) -> dict:
    """Apply `a.b=value` strings (value parsed as YAML) to a canonical raw dict.

    `origins` (from `translate_with_origins`), when given, is updated to the key each override was
    written as: an error about an overridden value then names the key of the `--set`."""
    raw = _deepcopy(raw)
    for item in overrides:
        written, value = _parse_override(item)
        key = written
        if key in _SEED_KEYS:
            our_key, fn = _SEED_KEYS[key]
            key, value = our_key, _seed_value(written, value, fn)
        _set(raw, key, value)
        if origins is not None:
            for ours in [k for k in origins if k == key or k.startswith(key + ".")]:
                del origins[ours]  # the file's spelling of this key no longer holds its value
            if written != key:
                origins[key] = written
    return raw


def _parse_override(item: str) -> tuple[str, Any]:
    """(dotted key, value) of one `--set key=value`."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. train.lr=1e-4")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or "" in key.split("."):
        raise ConfigError(f"--set {item!r} has no key before '='; write section.key=value, e.g. train.lr=1e-4")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None
    return key, value


# --- Loading and validation --------------------------------------------------------------------------


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                raw: dict | None = None) -> RunConfig:
    """Read YAML (or a dict), translate seed keys, apply overrides, validate; warn about no-op keys.

    Errors name each key as the file (or the `--set`) wrote it, and a misspelt key is matched against
    the spellings of the shape the file is written in (ours, seed 000's or seed 002's)."""
    if raw is None:
        if path is None:
            raise ConfigError("give a config file")
        raw = read_yaml(path)
    canonical, warnings, origins = translate_with_origins(raw)
    canonical = apply_overrides(canonical, overrides or [], origins)
    for w in warnings:
        log.warning(w)
    return validate(canonical, Spelling(origins, _seeds_used(raw)))


def _seeds_used(raw: dict) -> frozenset[str]:
    """The seed shapes (SEED_000, SEED_002) whose own keys a raw config uses."""
    return frozenset(shape for key, shape in _SEED_SPELLINGS.items() if _get(raw, key)[0])


@dataclass(frozen=True)
class Spelling:
    """How the user's file spells its keys, so that an error names a key as it is written there.

    origins: our dotted key -> the key as the user wrote it (a seed key, or the key of a `--set`).
    seeds: the seed shapes the file uses; a misspelt key is matched against their spellings too.
    """

    origins: dict[str, str]
    seeds: frozenset[str]

    def written(self, dotted: str) -> str:
        """Our dotted key (or a path below it) as the user wrote it."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in self.origins:
                return ".".join([self.origins[head], *parts[n:]])
        return dotted

    def in_user_terms(self, text: str) -> str:
        """`text` with each of our translated keys replaced by the user's spelling of it."""
        for ours, theirs in self.origins.items():
            # A whole key only: not inside a longer key, a path or a quoted value.
            text = re.sub(rf"(?<![\w./'\"-]){re.escape(ours)}(?![\w'\"/-])", lambda _: theirs, text)
        return text


def read_yaml(path: str | os.PathLike) -> dict:
    """Load a YAML mapping from a file, with clear messages for a missing, binary or malformed file
    (and for a key given twice, which YAML itself would let the second silently replace)."""
    if os.path.isdir(path):
        raise ConfigError(f"config path {path} is a directory; give the YAML file in it")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist; check the path")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not a YAML text file: byte {e.start} is not UTF-8 (a binary file, or "
                          "another encoding); give a UTF-8 YAML config") from None
    stream = io.StringIO(text)
    stream.name = str(path)  # YAML's messages then say which file (with line and column)
    try:
        raw = yaml.load(stream, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, train:, ...), not a {type(raw).__name__}")
    return raw


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line, where it is first: 'line 5, column 1: found key ...'. PyYAML's own text
    spreads over several lines with the file name on each."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    mark = e.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
    return f"{where}: {e.problem}{context}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one,
    so a repeated section (two `train:` blocks) would silently drop every key of the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping of `node`; a ConstructorError naming both lines for a repeated key."""
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` may be overridden by the keys beside it: that is its purpose
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = key in first
            except TypeError:
                continue  # an unhashable key: SafeLoader's own check reports it
            if seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found key {key!r} a second time (first on line {first[key].line + 1}); keep one of them",
                    key_node.start_mark)
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def validate(raw: dict, spelling: Spelling | None = None) -> RunConfig:
    """Validate a canonical dict into a RunConfig, turning pydantic's errors into one clear message
    that names each key as the user wrote it (`spelling`, from `load_config`)."""
    spelling = spelling or Spelling({}, frozenset())
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(spelling.in_user_terms(_explain(e, spelling))) from None
    except ConfigError as e:
        raise ConfigError(spelling.in_user_terms(str(e))) from None


# --- Explaining validation errors --------------------------------------------------------------------


def _explain(err: ValidationError, spelling: Spelling) -> str:
    """One line per key at fault (a value failing every member of a union is one error, not several)."""
    grouped: dict[str, tuple[list[Any], Any, list[dict]]] = {}
    for item in err.errors():
        path, field_info = _schema_path(item["loc"])
        entry = grouped.setdefault(_dotted(path), (path, field_info, []))
        entry[2].append(item)
    lines: list[str] = []
    for path, field_info, items in grouped.values():
        line = _explain_key(path, field_info, items, spelling)
        if line not in lines:
            lines.append(line)
    return "invalid config: " + "; ".join(lines)


def _explain_key(path: list[Any], field_info: Any, items: list[dict], spelling: Spelling) -> str:
    """The message for one key: unknown (with the closest key), missing, or a value that is not allowed."""
    written = spelling.written(_dotted(path)) or "(top level)"
    kinds = {item["type"] for item in items}
    value = _shown(items[0].get("input"))
    if "extra_forbidden" in kinds:
        return f"unknown key {written}{_suggest([str(p) for p in path], spelling)}"
    if "invalid_key" in kinds:
        where = _dotted(path[:-1]) or "the top level"
        return f"key {path[-1]!r} in {where} is not text; keys are names such as lr or max_steps"
    if "missing" in kinds:
        return f"{written} is required" + (" (give at least train.max_steps or train.epochs)"
                                          if written == "train" else "")
    custom = [i["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
              for i in items if i["type"] in ("value_error", "assertion_error")]
    if custom:
        # Our validators' own words; those of a section already name its keys.
        section = field_info is None or _model_in(field_info.annotation) is not None
        return "; ".join(custom) if section else f"{written} = {value}: {'; '.join(custom)}"
    allowed = _allowed(field_info, of_item=bool(path) and isinstance(path[-1], int)) if field_info else ""
    if field_info is not None and _model_in(field_info.annotation) is not None:
        return f"{written} = {value} is not a section; expected {allowed}"
    if kinds == {"literal_error"} or len(items) > 1:
        return f"{written} = {value} is not allowed; expected {allowed or items[0]['msg']}"
    msg = items[0]["msg"]
    why = msg[:1].lower() + msg[1:]
    return f"{written} = {value}: {why}" + (f"; expected {allowed}" if allowed else "")


def _dotted(path: list[Any]) -> str:
    """["data", "train_files", 1] -> "data.train_files[1]"."""
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def _shown(value: Any) -> str:
    """A value as the message shows it: its repr, cut to fit on a line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section class an annotation holds (Section, or Optional[Section]), else None."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _schema_path(loc: tuple) -> tuple[list[Any], Any]:
    """The keys (and list indexes) of an error's location, without pydantic's union-member tags, and
    the schema field the path ends in (None for an unknown key or a whole section)."""
    cls: Any = RunConfig
    field_info: Any = None
    path: list[Any] = []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
        elif cls is not None:
            path.append(part)
            field_info = cls.model_fields.get(part)
            cls = _model_in(field_info.annotation) if field_info is not None else None
            if field_info is None:
                break  # an unknown key; nothing deeper is a key of ours
        # else: a tag such as "literal['dynamic']" or "float" naming the member of a union that failed
    return path, field_info


def _allowed(field_info: Any, of_item: bool = False) -> str:
    """What a key (or, `of_item`, each item of its list) takes, in words: type, bounds and meaning
    (`a number > 0 (peak learning rate)`)."""
    annotation = field_info.annotation
    if of_item:
        lists = [a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is list]
        annotation = typing.get_args(lists[0])[0] if lists and typing.get_args(lists[0]) else Any
    kind = _kind(annotation, _bounds(field_info))
    return f"{kind} ({field_info.description})" if field_info.description else kind


def _bounds(field_info: Any) -> str:
    """A field's numeric bounds in words: '>= 0 and < 1'."""
    marks = []
    for m in field_info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                marks.append(f"{sign} {getattr(m, attr)}")
    return " and ".join(marks)


def _kind(annotation: Any, bounds: str = "") -> str:
    """`annotation` in words; numbers get `bounds` (e.g. '>= 1')."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        members = [_kind(a, bounds) for a in args if a is not type(None)]
        return " or ".join(members) + (", or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list (each {_kind(args[0]) if args else 'any value'})"
    if origin is dict or annotation is dict:
        return "a mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        keys = list(annotation.model_fields)
        return f"a mapping of keys such as {', '.join(keys[:5])}" + (", ..." if len(keys) > 5 else "")
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}
    name = names.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return f"{name} {bounds}" if bounds and annotation in (int, float) else name


def _section_class(parents: list[str]) -> type[BaseModel] | None:
    """The section class at the dotted path `parents` ([] = the whole config), else None."""
    cls: Any = RunConfig
    for part in parents:
        field_info = cls.model_fields.get(part)
        cls = _model_in(field_info.annotation) if field_info is not None else None
        if cls is None:
            return None
    return cls


def _candidates(parents: list[str], seeds: frozenset[str]) -> dict[str, str]:
    """Keys that may be meant at `parents`: name as typed there -> the key to suggest (dotted).

    A seed spelling is suggested as written in the seed shapes the file uses (a seed 000 file gets
    `learning_rate`), and as our key otherwise (`train.lr`)."""
    out: dict[str, str] = {}
    cls = _section_class(parents)
    if cls is not None:
        out.update({name: ".".join([*parents, name]) for name in cls.model_fields})
    for seed_key, shape in _SEED_SPELLINGS.items():
        *seed_parents, last = seed_key.split(".")
        if seed_parents != parents:
            continue
        if shape in seeds:
            out[last] = seed_key
        elif seed_key in _SEED_KEYS:
            out.setdefault(last, _SEED_KEYS[seed_key][0])
    return out


def _elsewhere(seeds: frozenset[str]) -> dict[str, str]:
    """Every key of every section (`lr` -> `train.lr`) and every seed spelling (as `_candidates`
    shows it), by its last part: a key put in the wrong section is found too."""
    out: dict[str, str] = {section: section for section in RunConfig.model_fields}  # a section put inside another
    for section, section_field in RunConfig.model_fields.items():
        cls = _model_in(section_field.annotation)
        for name in cls.model_fields if cls is not None else ():
            out.setdefault(name, f"{section}.{name}")
    for seed_key, shape in _SEED_SPELLINGS.items():
        if shape in seeds:
            out.setdefault(seed_key.split(".")[-1], seed_key)
        elif seed_key in _SEED_KEYS:
            out.setdefault(seed_key.split(".")[-1], _SEED_KEYS[seed_key][0])
    return out


# A key where the unknown one stands wins over an equally close key of another section, which must be
# closer to be suggested at all: a key put in the wrong section is usually spelt right.
_HERE_CUTOFF, _ELSEWHERE_CUTOFF, _HERE_BONUS = 0.6, 0.8, 0.05


def _closest(name: str, here: dict[str, str], elsewhere: dict[str, str]) -> str | None:
    """The suggestion whose typed name is closest to `name` (case ignored), if close enough."""
    best: tuple[float, str] | None = None
    for candidates, cutoff, bonus in ((here, _HERE_CUTOFF, _HERE_BONUS), (elsewhere, _ELSEWHERE_CUTOFF, 0.0)):
        for typed, suggestion in candidates.items():
            ratio = difflib.SequenceMatcher(None, name.lower(), typed.lower()).ratio()
            if ratio >= cutoff and (best is None or ratio + bonus > best[0]):
                best = (ratio + bonus, suggestion)
    return best[1] if best else None


def _suggest(loc: list[str], spelling: Spelling) -> str:
    """'; did you mean KEY?' for an unknown key, or the keys valid where it stands."""
    name, parents = loc[-1], loc[:-1]
    here = _candidates(parents, spelling.seeds)
    hint = _HINTS.get(name)
    if hint is not None and ("." in hint or hint in here):
        return f"; did you mean {spelling.written(here.get(hint, hint))}?"
    close = _closest(name, here, _elsewhere(spelling.seeds))
    if close is not None:
        return f"; did you mean {spelling.written(close)}?"
    valid = [typed for typed, key in here.items() if key == ".".join([*parents, typed])]
    return f"; valid keys here: {', '.join(valid)}" if valid else ""


def to_yaml(cfg: RunConfig) -> str:
    """The full resolved config as YAML (saved in the run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_reference() -> str:
    """A Markdown table of every key, its default and what it means (for the README)."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section, field in RunConfig.model_fields.items():
        cls = field.annotation
        # An optional section (lora) is Optional[Section]: list the section's own keys.
        cls = next((a for a in getattr(cls, "__args__", (cls,)) if isinstance(a, type) and issubclass(a, BaseModel)))
        for name, f in cls.model_fields.items():
            default = f.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = "{...}"
            text = (f.description or "").replace("|", "/")
            rows.append(f"| `{section}.{name}` | `{default!r}` | {text} |")
    return "\n".join(rows)


def tokens_per_step(cfg: RunConfig, devices: int | None = None) -> int:
    """Tokens consumed by one optimizer step over all devices."""
    return cfg.global_batch_size(devices) * cfg.data.seq_length


def human(n: float) -> str:
    """1234567 -> '1.23M' (for logs and dry runs)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}" if not math.isclose(n, round(n)) else str(int(n))
