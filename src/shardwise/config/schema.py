"""The schema of a whole run: five sections (`model`, `parallel`, `optimize`, `train`, `data`), the
fine-tuning ones (`lora`, `freeze`) and a small `run` section (device, eager or compiled).

Validation checks values and how they fit together, and nothing else: it reads no file and builds no
model. What a config points at (the weights of `model.init_from`, their tokenizer, LoRA targets that
must exist in the model, the parallel layout) is checked after it by `shardwise.resolve`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ConfigError
from ..loss import DEFAULT_LOSS_CHUNK_TOKENS
from ..models.config import ModelConfig
from ..models.registry import get_preset

# Learning rates a fine-tune from `model.init_from` starts with unless train.lr is given (seed 003, 4.3:
# 2e-5..5e-5 for full fine-tuning, 1e-4..3e-4 for LoRA).
FINETUNE_LR_FULL = 2e-5
FINETUNE_LR_LORA = 2e-4
# The optimizer's chunked update (train.optimizer_impl chunked) steps at most this many elements at a
# time (64 MiB of fp32): its temporaries are one chunk's, not a parameter group's.
OPTIMIZER_CHUNK_ELEMENTS = 2**24
# Optimizers whose update a library steps with its own kernel: train.optimizer -> the library.
LIBRARY_OPTIMIZERS = {"adamw_8bit": "torchao", "paged_adamw_8bit": "bitsandbytes", "paged_adamw": "bitsandbytes"}
PAGED_OPTIMIZERS = tuple(name for name, lib in LIBRARY_OPTIMIZERS.items() if lib == "bitsandbytes")
FUSED_OPTIMIZER_DEVICES = ("cuda", "cpu")  # where optimizer_impl auto picks torch's fused AdamW
COMPILED_BY_DEFAULT = ("cuda", "npu")  # where run.compile auto compiles the blocks (see RunConfig.compiles)
# run.compile auto on a CPU: compile when the run is predicted to train this long. Measured on the 2-core
# development CPU (bench model, docs/performance.md): compiling costs about 29 s once with an empty
# inductor cache (less when torch's on-disk cache already holds the kernels) and makes each step about 5%
# faster, so from cold it pays back after about 10 minutes of training.
CPU_COMPILE_PAYS_AFTER_S = 600.0


class _Section(BaseModel):
    # inf and nan are no setting's value (an epoch count of inf would never end): refuse them here.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ParallelConfig(_Section):
    """How the run is split over devices. The product dp x tp x pp x cp must equal the device count."""

    data_parallel: int = Field(1, description="data-parallel degree; -1 = what the device count leaves")
    data_parallel_replicate: int = Field(
        1, ge=1, description="HSDP: replicas of the sharded group (e.g. nodes); must divide data_parallel"
    )
    tensor_parallel: int = Field(1, ge=1, description="tensor (model) parallel degree")
    sequence_parallel: bool = Field(True, description="shard norms/dropout over the sequence with TP")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline stages")
    context_parallel: int = Field(
        1, ge=1, description="context parallel degree: each sequence is split into this many contiguous chunks, "
        "one per rank, and attention runs over the whole sequence by two all-to-alls per layer (DeepSpeed-Ulysses: "
        "heads split instead of tokens), for sequences whose activations do not fit one device; the ranks' "
        "gradients are reduced with the data-parallel ones. Needs seq_length and the attention heads (per tensor-"
        "parallel rank) divisible by it, the chunked loss, no pipeline parallelism"
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="0 replicate; 1 shard optimizer state; 2 + gradients; 3 + parameters"
    )
    expert_parallel: int = Field(
        1, ge=1, description="mixture-of-experts models: each group of N consecutive data-parallel ranks spreads "
        "every MoE block's experts over its ranks (num_experts / N each), tokens reach them by all-to-all; groups "
        "hold replicas of the experts, whose gradients are summed over them. N divides data_parallel"
    )
    micro_batch_num: int = Field(1, ge=1, description="pipeline micro-batches per step")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b", description="pipeline schedule"
    )
    virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved)")
    stage_layers: Optional[list[int]] = Field(None, description="layers per pipeline stage")
    reduce_gradients: Literal["auto", "every_micro_batch", "once_per_step"] = Field(
        "auto", description="ZeRO 2/3 with accumulation: reduce-scatter every micro-batch (sharded gradients; HSDP "
        "defers only the replica all-reduce) or once per step (full-size gradients until then); auto: every "
        "micro-batch for ZeRO 2/3, once per step for ZeRO 0/1 and pipelines"
    )

    @model_validator(mode="after")
    def _reduce_gradients(self) -> "ParallelConfig":
        if self.reduce_gradients == "auto":
            return self
        if self.pipeline_parallel > 1:
            raise ValueError(
                f"parallel.reduce_gradients {self.reduce_gradients} with pipeline_parallel > 1: torch's pipeline "
                "schedule decides, and it reduces data-parallel gradients once per pipeline step (its stages' "
                "backwards run without gradient sync, the schedule reduces after the last micro-batch); leave "
                "parallel.reduce_gradients at auto"
            )
        if self.reduce_gradients == "every_micro_batch" and self.zero_stage < 2:
            raise ValueError(
                f"parallel.reduce_gradients every_micro_batch needs zero_stage 2 or 3, got {self.zero_stage}: "
                "ZeRO 0 and 1 keep full gradients on every rank, so reducing every micro-batch would only add "
                "all-reduces; leave it at auto (once per step), or set parallel.zero_stage: 2 or 3 to keep "
                "gradients sharded"
            )
        return self

    def reduces_every_micro_batch(self) -> bool:
        """Whether data-parallel gradients are reduced after every micro-batch (`reduce_gradients` resolved:
        auto is every micro-batch for ZeRO 2/3 without a pipeline, once per step otherwise)."""
        if self.reduce_gradients != "auto":
            return self.reduce_gradients == "every_micro_batch"
        return self.zero_stage >= 2 and self.pipeline_parallel == 1

    @field_validator("data_parallel")
    @classmethod
    def _dp(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be a positive integer, or -1 for what the device count leaves")
        return v

    def world_size(self, devices: int | None = None) -> int:
        """Number of devices this layout needs (resolving data_parallel=-1 against `devices`)."""
        tp_pp = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if self.data_parallel == -1:
            if devices is None:
                return tp_pp
            if devices % tp_pp:
                raise ConfigError(
                    f"parallel.data_parallel is -1 but {devices} devices are not divisible by "
                    f"tensor_parallel x pipeline_parallel x context_parallel = {tp_pp}; use a device count that is a "
                    f"multiple of {tp_pp} or lower those degrees"
                )
            return devices
        return self.data_parallel * tp_pp

    def dp_degree(self, devices: int | None = None) -> int:
        """Resolved data-parallel degree."""
        return self.world_size(devices) // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)


class OptimizeConfig(_Section):
    """Memory and speed settings: precision, recompute, accumulation, offload, the chunked loss."""

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
    recompute: Literal["none", "full", "selective", "auto"] = Field(
        "none", description="activation recomputation: none; full blocks; selective (keep attention and every "
        "other matmul output, recompute the rest); auto: per layer the least recompute that fits the device's "
        "memory by the estimator (none, then selective, then full), chosen at launch into recompute_layers"
    )
    recompute_every: int = Field(1, ge=1, description="recompute every k-th layer (full recompute)")
    recompute_layers: Optional[list[Literal["none", "selective", "full"]]] = Field(
        None, description="recompute auto: the per-layer plan, one mode per model layer from the bottom (null: "
        "chosen at launch from the device's memory; the config in force records the choice)"
    )
    gradient_accumulation_steps: Optional[int] = Field(
        None, ge=1, description="micro-batches per optimizer step (derived from global_batch_size if unset)"
    )
    offload_optimizer: Union[bool, Literal["cpu", "stream"]] = Field(
        False, description="optimizer state (and fp32 masters) in host memory. stream: each parameter's state is "
        "copied to the device on a side stream, updated there by the fused AdamW kernel and copied back (with "
        "train.optimizer_in_backward, hidden behind the backward); gradients and weights stay on the device. "
        "cpu (or true): ZeRO-Offload, gradients streamed to the host during backward and the whole update on the "
        "CPU. One device, or data parallelism with ZeRO 2/3"
    )
    offload_params: bool = Field(
        False, description="FSDP2's CPU offload (ZeRO 2/3; on one GPU/NPU FSDP2 alone, at ZeRO-3): sharded "
        "parameters, gradients and optimizer state in host memory, each block's parameters copied to the device "
        "for its all-gather; the step on the CPU"
    )
    offload_params_blocks: Optional[int] = Field(
        None, ge=1, description="with offload_params: only the first N transformer blocks' parameters (and "
        "their gradients and optimizer state) in host memory; the other blocks, the embeddings and the head stay "
        "on the device, so fewer weights cross the host link each pass (null: everything offloaded)"
    )
    offload_activations: bool = Field(
        False, description="move the tensors saved for backward to host memory during the forward and back for "
        "the backward (with recompute: only what recompute keeps, the blocks' inputs); not under a pipeline"
    )
    chunked_loss: bool = Field(
        True, description="cross-entropy straight from the hidden states, loss_chunk_tokens at a time: the "
        "[tokens, vocab] logits and their gradient are never held (false: full logits, then the loss)"
    )
    loss_chunk_tokens: int = Field(
        DEFAULT_LOSS_CHUNK_TOKENS, ge=1, description="chunked loss: tokens per chunk (one [chunk, vocab] fp32 block)"
    )
    float8: bool = Field(
        False, description="float8 training (torchao, dynamic per-tensor scales): the blocks' linears multiply in "
        "float8, about twice the bf16 matmul rate, and ZeRO 2/3 all-gather their weights in 1 byte instead of 2; "
        "the head, attention and norms stay bf16; a small accuracy cost. CUDA GPUs with float8 tensor cores "
        "(compute capability 8.9+: H100, H200, L40S, RTX 4090) only; needs mixed_precision bf16, torchao (pip "
        "install shardwise[lowbit]), no LoRA, no tensor parallelism; pays with run.compile (fused casts)"
    )

    @model_validator(mode="after")
    def _level_needs_16_bit(self) -> "OptimizeConfig":
        if self.mixed_precision == "fp32" and self.precision_level not in (None, "O0"):
            raise ValueError(
                f"optimize.precision_level {self.precision_level} needs optimize.mixed_precision bf16 or fp16 "
                "(fp32 is O0)"
            )
        return self

    @field_validator("offload_optimizer", mode="before")
    @classmethod
    def _offload_optimizer_kind(cls, v: Any) -> Any:
        if v is True or v == "true":
            return "cpu"
        if v is None or v == "false" or v == "none":
            return False
        return v

    def params_on_host(self, block: Optional[int]) -> bool:
        """Whether offload_params keeps the parameters of transformer block `block` (None: the embeddings,
        final norm and head) in host memory."""
        if not self.offload_params:
            return False
        if self.offload_params_blocks is None:
            return True
        return block is not None and block < self.offload_params_blocks

    def streams_optimizer(self) -> bool:
        """optimize.offload_optimizer stream: state in host memory, the update on the device."""
        return self.offload_optimizer == "stream"

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_bool(cls, v: Any) -> Any:
        if v is True:
            return "full"
        if v is False or v is None:
            return "none"
        return v

    @model_validator(mode="after")
    def _layers_need_auto(self) -> "OptimizeConfig":
        if self.recompute_layers is not None and self.recompute != "auto":
            raise ValueError(f"optimize.recompute_layers is a per-layer plan for recompute: auto, but recompute is "
                             f"{self.recompute}; set optimize.recompute: auto or drop recompute_layers")
        return self

    def layer_recompute(self, layers: list[int]) -> list[str]:
        """The recompute mode of each of `layers` (global indices of one model part, in order): the
        auto plan's entry, full for every `recompute_every`-th layer of the part, or the one mode."""
        if self.recompute == "auto":
            if self.recompute_layers is None:
                raise ConfigError("optimize.recompute auto has no per-layer plan yet: it is chosen at launch from "
                                  "the device's memory (shardwise.memory.auto_recompute.resolve_auto_recompute)")
            return [self.recompute_layers[i] for i in layers]
        if self.recompute == "full":
            return ["full" if k % self.recompute_every == 0 else "none" for k in range(len(layers))]
        return [self.recompute] * len(layers)

    def level(self) -> str:
        """The precision level in force."""
        if self.mixed_precision == "fp32":
            return "O0"
        return self.precision_level or "O2"

    def loss_chunk(self) -> Optional[int]:
        """Tokens per chunk of the chunked loss, or None for the plain path (full logits)."""
        return self.loss_chunk_tokens if self.chunked_loss else None


class ProfileConfig(_Section):
    """train.profile: which optimizer steps torch.profiler records (train/profiling.py)."""

    start_step: int = Field(..., ge=1, description="the first profiled step (1-based, as metrics.jsonl counts "
                            "them); the step before it warms the profiler up")
    steps: int = Field(..., ge=1, description="how many steps to record from start_step (a few: a trace grows "
                       "with every operator)")


LOGGERS = ("tensorboard", "wandb", "mlflow")  # train.loggers


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
    optimizer: Literal["adamw", "adam", "sgd", "adamw_8bit", "paged_adamw_8bit", "paged_adamw"] = Field(
        "adamw", description="optimizer; adamw_8bit: torchao's block-wise 8-bit AdamW (pip install shardwise[lowbit]); "
        "paged_adamw_8bit / paged_adamw: bitsandbytes' paged AdamW, 8-bit or fp32 state in CUDA unified memory that "
        "pages to host memory when the GPU is short (CUDA, pip install bitsandbytes; one device or ZeRO-0)"
    )
    optimizer_impl: Literal["auto", "fused", "foreach", "chunked"] = Field(
        "auto", description="the update's kernel: fused (no temporaries), foreach (a temporary the size of a "
        "parameter group), chunked (foreach over chunks of 2^24 elements); auto: fused on CUDA and CPU, chunked "
        "elsewhere (SGD: foreach)"
    )
    optimizer_state_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="dtype of the optimizer's moments; bf16 halves them (the update runs in fp32, the "
        "moments rounded back stochastically); auto: fp32, or the 16-bit weights' dtype at precision O3"
    )
    optimizer_in_backward: bool = Field(
        False, description="update each parameter as soon as its gradient is final and free it (no full set of "
        "gradients); needs max_grad_norm null, one micro-batch per step, no pipeline, no ZeRO-1, no fp16"
    )
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
    save_minutes: Optional[float] = Field(
        None, gt=0, description="also checkpoint when this many minutes of wall-clock time have passed since the "
        "last save (rank 0's clock, agreed by all ranks one step later); counts towards keep_checkpoints"
    )
    keep_checkpoints: int = Field(3, ge=1, description="keep the newest K checkpoints")
    async_save: bool = Field(
        False, description="write checkpoints in the background: a save only copies the state into host memory "
        "(pinned on CUDA) and training goes on while it is written, then published atomically; costs one more "
        "copy of the model, optimizer and master state per rank in host memory for the whole run, so off by default"
    )
    verify_checkpoints: bool = Field(
        True, description="check every file of a checkpoint against the SHA-256 checksums saved with it "
        "(checksums.json) before loading it (resume, init_from), and a LoRA/QLoRA run's base model at init_from "
        "against the fingerprint its checkpoint recorded; false skips both (faster resumes of very large "
        "checkpoints: a flipped bit in a file, or another base model, then loads unnoticed)"
    )
    nan_policy: Literal["stop", "skip"] = Field("stop", description="on a NaN/Inf loss")
    check_replicas_steps: Optional[int] = Field(
        None, ge=1, description="every N steps compare parameter checksums across data-parallel replicas"
    )
    peak_tflops: Optional[float] = Field(None, gt=0, description="device peak for MFU (default: table/measured)")
    progress_bar: bool = Field(True, description="show a progress bar")
    tensorboard: bool = Field(True, description="write TensorBoard events when it is installed; the same as "
                              "tensorboard in train.loggers (kept for older configs)")
    loggers: Optional[list[str]] = Field(
        None, description="where metrics.jsonl's records also go (rank 0): tensorboard (RUN_DIR/tensorboard), wandb "
        "(Weights & Biases; pip install 'shardwise[wandb]'; honours WANDB_MODE, WANDB_PROJECT), mlflow (pip install "
        "'shardwise[mlflow]'; MLFLOW_TRACKING_URI, else file:RUN_DIR/mlruns); a resumed run continues the same "
        "W&B / MLflow run (ids in RUN_DIR/trackers.json); null = [tensorboard] when train.tensorboard, else []"
    )
    profile: Optional[ProfileConfig] = Field(
        None, description="record steps start_step..start_step+steps-1 with torch.profiler (rank 0): "
        "RUN_DIR/profile/trace_rank0.json (Chrome / Perfetto), summary.json (top operators; compute, "
        "communication and idle shares) and on CUDA memory_snapshot.pickle; null = off"
    )

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is None:
            return v
        unknown = [name for name in v if name not in LOGGERS]
        if unknown:
            raise ValueError(f"train.loggers: unknown logger(s) {', '.join(map(repr, unknown))}; the allowed values "
                             f"are {', '.join(LOGGERS)}")
        return list(dict.fromkeys(v))  # each once, in the order given

    @model_validator(mode="after")
    def _resolve_loggers(self) -> "TrainConfig":
        """train.loggers and the older train.tensorboard switch, made one: tensorboard is in the list exactly when
        train.tensorboard is true."""
        if self.loggers is None:
            self.loggers = ["tensorboard"] if self.tensorboard else []
        elif "tensorboard" in self.model_fields_set and self.tensorboard != ("tensorboard" in self.loggers):
            if not self.tensorboard:
                raise ValueError(f"train.tensorboard is false but train.loggers {self.loggers} names tensorboard; "
                                 "drop one of the two (train.loggers alone is enough)")
            self.loggers = ["tensorboard", *self.loggers]  # an explicit train.tensorboard: true still counts
        self.tensorboard = "tensorboard" in self.loggers
        return self

    @model_validator(mode="after")
    def _length(self) -> "TrainConfig":
        if self.max_steps is None and self.epochs is None:
            raise ValueError("give train.max_steps or train.epochs")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr {self.min_lr} is above train.lr {self.lr}; lower min_lr")
        if self.optimizer in LIBRARY_OPTIMIZERS and self.optimizer_impl != "auto":
            raise ValueError(f"train.optimizer_impl {self.optimizer_impl} with {self.optimizer}: "
                             f"{LIBRARY_OPTIMIZERS[self.optimizer]} steps it with its own kernel; leave optimizer_impl "
                             "at auto")
        if self.optimizer in LIBRARY_OPTIMIZERS and self.optimizer_state_dtype != "auto":
            raise ValueError(f"train.optimizer_state_dtype {self.optimizer_state_dtype} with {self.optimizer}: its "
                             "moments are its own; leave optimizer_state_dtype at auto, or use adamw for fp32 / bf16 "
                             "moments")
        if self.optimizer == "sgd" and self.optimizer_impl == "fused":
            raise ValueError("train.optimizer_impl fused with sgd: SGD's foreach update makes no temporaries (and "
                             "torch's fused SGD has no DTensor support); use auto or foreach")
        if self.optimizer_in_backward:
            if self.max_grad_norm is not None:
                raise ValueError(
                    f"train.optimizer_in_backward updates each parameter before the gradients of the others exist, "
                    f"so the global norm that train.max_grad_norm {self.max_grad_norm:g} clips by is not known yet; "
                    "set train.max_grad_norm: null (no clipping), or optimizer_in_backward: false")
            if self.nan_policy == "skip":
                raise ValueError(
                    "train.nan_policy skip with optimizer_in_backward: a gradient that overflows in the middle of the "
                    "backward comes after parameters already updated, so the step cannot be skipped whole; use "
                    "nan_policy stop (the run stops there), or optimizer_in_backward: false")
        return self

    def optimizer_kernel(self, device_type: str) -> str:
        """What steps the optimizer on a device of kind `device_type`: "fused", "foreach", "chunked"
        (optimizer_impl, with auto resolved), "torchao" (adamw_8bit) or "bitsandbytes" (the paged ones).

        auto is fused where torch has the fused Adam kernel (CUDA, CPU): no temporaries, and on this
        project's CPU ~6x faster than foreach, equal to it within ~5e-9 per tensor in fp32; elsewhere
        the chunked foreach update (temporaries of one chunk); SGD's foreach makes none, so foreach.
        """
        if self.optimizer in LIBRARY_OPTIMIZERS:
            return LIBRARY_OPTIMIZERS[self.optimizer]
        if self.optimizer_impl != "auto":
            return self.optimizer_impl
        if self.optimizer == "sgd":
            return "foreach"
        return "fused" if device_type in FUSED_OPTIMIZER_DEVICES else "chunked"


class SourceConfig(_Section):
    """One source of a pre-training mixture (`data.sources`)."""

    name: str = Field(..., min_length=1, max_length=100, description="the source's name (in metrics and reports)")
    train_files: list[str] = Field(..., description="globs of its files, or one `shardwise prepare` directory")
    weight: float = Field(..., description="its share of the training tokens (the weights are normalised); > 0")
    eval_files: Optional[list[str]] = Field(None, description="its held-out files: evaluation reports its loss")

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("weight")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"weight {v}: a source's weight must be positive (leave the source out, or lower its "
                             "weight in a data.mixture_schedule step)")
        return v


class MixtureStepConfig(_Section):
    """From optimizer step `step` on, blend the sources with `weights` (by source name)."""

    step: int = Field(..., ge=2, description="the first step with these weights (the run's first step is 1)")
    weights: dict[str, float] = Field(..., description="every source's new weight by name (0 leaves it out)")


class NearDedupConfig(_Section):
    """Near-duplicate detection (data.dedup: near): MinHash over word n-grams, cut into LSH bands."""

    ngram: int = Field(5, ge=1, description="words a shingle (a CJK character is a word)")
    bands: int = Field(14, ge=1, description="LSH bands; a document is a near duplicate when one band matches")
    rows: int = Field(8, ge=1, description="MinHash values a band; similarity found half the time ~(1/bands)^(1/rows)")


class DataConfig(_Section):
    """Where the data comes from and how it becomes samples."""

    kind: Literal["pretrain", "instruction", "preference"] = Field(
        "pretrain", description="pretrain: raw text packed into samples; instruction: SFT .jsonl; preference: "
        "prompt/chosen/rejected .jsonl pairs (the `preference` section's loss)"
    )
    train_files: list[str] = Field(
        default_factory=list, description="globs of .txt/.jsonl/.parquet files, or a `shardwise prepare` dir"
    )
    sources: Optional[list[SourceConfig]] = Field(
        None, description="pre-training: a weighted mixture in place of train_files, each source {name, train_files, "
        "weight}; the tokens read per source follow the weights at every point of the run")
    mixture_schedule: list[MixtureStepConfig] = Field(
        default_factory=list, description="new source weights from given steps on: [{step, weights: {name: w}}]")
    eval_files: Optional[list[str]] = Field(None, description="globs of held-out files (or a prepared dir)")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="tail of the data held out for eval")
    format: Literal["auto", "txt", "jsonl", "parquet", "arrow"] = Field(
        "auto", description="input format; auto = by file extension (a Hugging Face save_to_disk directory: arrow)"
    )
    text_field: str = Field("text", description="field holding the text in .jsonl/.parquet records")
    txt_documents: Literal["file", "paragraph"] = Field(
        "file", description=".txt: one document per file, or documents separated by blank lines"
    )
    min_chars: int = Field(1, ge=0, description="drop documents with fewer non-space characters")
    dedup: Literal["exact", "near", "none"] = Field(
        "exact", description="pre-training: drop exact duplicate documents, also near duplicates (MinHash LSH: Jaccard "
        "0.9 found 99.96% of the time, 0.8 92%, 0.5 5%), or none; decided over all inputs, counted in the manifest")
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig, description="dedup near: its parameters")
    boilerplate_lines: int = Field(
        0, ge=0, le=255, description="pre-training: N > 0 removes each line (20+ characters) that N earlier documents "
        "had (navigation, cookie notices, footers), counted in the manifest; 0 = off")
    quality: Literal["none", "default"] = Field(
        "none", description="pre-training: default drops documents by Gopher/C4-style rules for English and Chinese "
        "(short, mojibake, garbled, code, repetition...), counted by rule in the prepared data's manifest")
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
    num_workers: Union[Literal["auto"], int] = Field(
        "auto", description="loader worker processes; 0 = read in the trainer (on CUDA/NPU in a background thread "
        "that prefetches the next step); auto = 2 on CUDA/NPU (pinned memory, fewer when the rank has few cores), "
        "0 on CPU, where workers would take cores from the compute threads")
    pad_to_multiple_of: int = Field(
        64, ge=1, description="instruction packing dynamic: round each batch's width (its longest sample) up to a "
        "multiple of this, at most seq_length, so compiled kernels see few shapes; padding carries no loss; 1 = off")
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

    @model_validator(mode="after")
    def _check_mixture(self) -> "DataConfig":
        if self.sources is None:
            if self.mixture_schedule:
                raise ValueError("data.mixture_schedule needs data.sources (a mixture of named sources)")
            return self
        if self.train_files:
            raise ValueError("data.sources and data.train_files are both set: give the files of a mixture in its "
                             "sources (or train_files alone, for one source)")
        if self.kind != "pretrain":
            raise ValueError("data.sources is a pre-training mixture; instruction data takes data.train_files")
        if not self.sources:
            raise ValueError("data.sources is empty: give at least one source {name, train_files, weight}")
        names = [src.name for src in self.sources]
        if self.eval_files and any(src.eval_files for src in self.sources):
            raise ValueError("data.eval_files and the sources' eval_files are both set: give the held-out data of "
                             "each source with it (evaluation then reports each source's loss), or data.eval_files "
                             "alone")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.sources has two sources named {twice[0]!r}: give each its own name")
        last = 0
        for i, entry in enumerate(self.mixture_schedule):
            where = f"data.mixture_schedule[{i}] (step {entry.step})"
            if entry.step <= last:
                raise ValueError(f"{where}: steps must increase (the one before is step {last})")
            last = entry.step
            if set(entry.weights) != set(names):
                unknown = sorted(set(entry.weights) - set(names))
                missing = sorted(set(names) - set(entry.weights))
                raise ValueError(f"{where}: give a weight for every source and only for them "
                                 f"({'unknown ' + repr(unknown) if unknown else 'missing ' + repr(missing)}; "
                                 f"the sources are {names})")
            if any(not w >= 0 for w in entry.weights.values()) or not sum(entry.weights.values()) > 0:
                raise ValueError(f"{where}: weights must be 0 or more, at least one above 0; got {entry.weights}")
        return self

    def source_list(self) -> list[tuple[str, list[str], float]]:
        """(name, train_files, weight) of each pre-training source: data.sources, or train_files as one."""
        if self.sources is None:
            return [("data", list(self.train_files), 1.0)]
        return [(src.name, list(src.train_files), src.weight) for src in self.sources]

    @field_validator("num_workers")
    @classmethod
    def _workers_not_negative(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"{v} workers: give 0 (read in the trainer), a number of worker processes, or auto")
        return v


class LoraConfig(_Section):
    """LoRA: train low-rank adapters beside chosen projections; every base weight stays frozen."""

    r: int = Field(8, ge=1, description="rank of the adapters")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: adapters are scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Union[str, list[str]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="projections to adapt: names (ours wq.. or HF q_proj..; suffix match) or regexes; a MoE "
        "block's routed experts by their projections (gate_proj / experts.w1 ...: one adapter per expert)",
    )
    quantize_base: Literal["none", "nf4", "int8"] = Field(
        "none", description="QLoRA: store the adapted projections' frozen base weights in 4 bits (nf4, torchao's "
        "NF4Tensor) or 8 bits (int8); needs torchao (pip install 'shardwise[lowbit]'); one device or ZeRO 0/1")

    @model_validator(mode="before")
    @classmethod
    def _peft_names(cls, v: Any) -> Any:
        # peft and the documents' LoRAConfig call them lora_alpha / lora_dropout (and rank lora_rank).
        if isinstance(v, dict):
            if set(v) == {"quantize_base"} and v["quantize_base"] != "none":  # e.g. --set on a full fine-tune
                raise ValueError("lora.quantize_base alone: QLoRA quantises the frozen base under LoRA adapters, "
                                 "so give the LoRA settings too, e.g. lora: {r: 16, alpha: 32, quantize_base: nf4}; "
                                 "a full fine-tune cannot train quantised weights")
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
    compile: Union[bool, Literal["auto"]] = Field(
        "auto", description="torch.compile each transformer block and the loss head (seed: mode graph / mode 0; "
        "pynative: false). auto: on CUDA and Ascend NPU; on a CPU only for a run predicted to train 10 minutes or "
        "more (compiling costs ~30 s there and saves ~5% a step: docs/performance.md); never for a quantised base "
        "(QLoRA). A graph that fails to compile runs eagerly with a warning")
    num_threads: Optional[int] = Field(None, ge=1, description="CPU threads (default: all cores)")
    keep_host_memory: Union[bool, Literal["auto"]] = Field(
        "auto", description="keep freed host memory in the process for the next step instead of returning it to "
        "the kernel (glibc malloc without mmap and heap trimming): large tensors stop page-faulting their memory "
        "in every step, about 5% off a step on the 2-core CPU (docs/performance.md); the process's resident "
        "memory stays at its peak until it ends. auto: on a CPU run; false leaves malloc as it is")
    timeout_s: float = Field(
        600.0, gt=0, description="distributed: how long a rank waits for the others before failing"
    )


class PreferenceConfig(_Section):
    """Preference tuning (data.kind: preference): the loss on chosen/rejected pairs and its reference model."""

    loss: Literal["dpo", "ipo", "simpo", "orpo"] = Field(
        "dpo", description="dpo (sigmoid), ipo, simpo or orpo (the last two need no reference model)")
    beta: float = Field(0.1, gt=0, description="the loss's temperature (simpo: 2.0 is usual; orpo: unused)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo, simpo: the share of pairs assumed "
                                   "mislabelled (conservative DPO)")
    simpo_gamma: float = Field(0.5, description="simpo: the target reward margin")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: the weight of the odds-ratio term against the SFT term")
    precompute_reference: Optional[bool] = Field(
        None, description="dpo, ipo: the reference's log-probabilities computed once before training (no copy "
        "of the model in memory); false: online (with LoRA the base with adapters off, else a frozen copy); "
        "null: online with LoRA, precomputed otherwise")


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
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)

    @field_validator("model", mode="before")
    @classmethod
    def _preset(cls, v: Any) -> Any:
        for key in ("preset", "init_from"):  # both are looked up before the section is validated
            if isinstance(v, dict) and v.get(key) is not None and not isinstance(v[key], str):
                raise ValueError(f"model.{key} = {v[key]!r} must be text: "
                                 + ("a preset name" if key == "preset" else "a model or checkpoint directory"))
        if isinstance(v, dict) and v.get("init_from") and "hidden_size" not in v:
            # The architecture comes from the weights: `shardwise.resolve` reads it into the section.
            raise ValueError(f"model.init_from {v['init_from']}: the weights' architecture has not been read; "
                             "load the config with shardwise.resolve.load_run_config (or resolve_config)")
        if isinstance(v, dict) and v.get("preset") and not v.get("init_from"):
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
        layers = self.optimize.recompute_layers
        if o.offload_params_blocks is not None and not o.offload_params:
            raise ValueError(f"optimize.offload_params_blocks {o.offload_params_blocks} needs offload_params: true "
                             "(it says how many blocks FSDP2's CPU offload keeps in host memory); set both, or "
                             "remove offload_params_blocks")
        if (o.offload_params_blocks or 0) > m.num_layers:
            raise ValueError(f"optimize.offload_params_blocks {o.offload_params_blocks} is above model.num_layers "
                             f"{m.num_layers}; use null to offload every block, the embeddings and the head")
        if layers is not None and len(layers) != m.num_layers:
            raise ValueError(f"optimize.recompute_layers has {len(layers)} entries for model.num_layers "
                             f"{m.num_layers}: give one mode per layer, or null to choose them at launch")
        if p.stage_layers is not None and sum(p.stage_layers) != m.num_layers:
            raise ValueError(
                f"parallel.stage_layers sums to {sum(p.stage_layers)}, not model.num_layers {m.num_layers}"
            )
        if p.pipeline_parallel > 1:
            self._check_pipeline()
        self._check_attention_kinds()
        if m.num_experts:
            self._check_experts()
        elif p.expert_parallel > 1:
            raise ValueError(f"parallel.expert_parallel {p.expert_parallel} needs a mixture-of-experts model "
                             "(model.num_experts > 0); set expert_parallel: 1")
        self._check_finetuning()
        self._check_optimizer()
        if self.data.kind == "preference":
            self._check_preference()
        return self

    def _check_preference(self) -> None:
        """Batch widths the layout cannot split, a reference the loss does not use."""
        p, pref = self.parallel, self.preference
        split = p.context_parallel * (p.tensor_parallel if p.tensor_parallel > 1 and p.sequence_parallel else 1)
        if split > 1 and self.data.pad_to_multiple_of % split:
            what = " x ".join(f"{name} {n}" for name, n in (("context_parallel", p.context_parallel),
                                                            ("tensor_parallel", p.tensor_parallel)) if n > 1)
            raise ValueError(f"{'sequence parallelism' if p.context_parallel == 1 else 'context parallelism'} splits "
                             f"each row over {what} ranks, but preference batches are data.pad_to_multiple_of "
                             f"{self.data.pad_to_multiple_of}-token multiples wide; set data.pad_to_multiple_of to a "
                             f"multiple of {split}")
        if pref.loss in ("simpo", "orpo") and pref.precompute_reference:
            raise ValueError(f"preference.loss {pref.loss} uses no reference model, so precompute_reference has "
                             "nothing to compute; leave it null")
        if self.train.optimizer_in_backward:
            raise ValueError("train.optimizer_in_backward with data.kind preference is not supported yet")

    def reference_mode(self) -> Optional[str]:
        """How preference tuning gets its reference: "precompute", "adapters_off" (LoRA's base), "frozen_copy",
        or None (no reference: simpo, orpo, or not preference data)."""
        pref = self.preference
        if self.data.kind != "preference" or pref.loss in ("simpo", "orpo"):
            return None
        if pref.precompute_reference or (pref.precompute_reference is None and self.lora is None):
            return "precompute"
        return "adapters_off" if self.lora is not None else "frozen_copy"

    def _check_attention_kinds(self) -> None:
        """Layouts latent attention (DeepSeek-V3) and sliding windows (Gemma 3) do not run with yet."""
        m, p = self.model, self.parallel
        if m.latent_attention:
            if p.context_parallel > 1:
                raise ValueError(f"parallel.context_parallel {p.context_parallel} with multi-head latent attention "
                                 f"(model.kv_lora_rank {m.kv_lora_rank}): not supported yet; use data, tensor, "
                                 "expert and pipeline parallelism and set context_parallel: 1")
        if m.position == "alibi":
            for what, n in (("tensor_parallel", p.tensor_parallel), ("context_parallel", p.context_parallel)):
                if n > 1:
                    raise ValueError(f"parallel.{what} {n} with ALiBi (model.position: alibi): its per-head biases "
                                     f"are built for all heads and the whole sequence; set {what}: 1 (data and "
                                     "pipeline parallelism work)")
        if m.sliding_window and p.context_parallel > 1:
            raise ValueError(f"parallel.context_parallel {p.context_parallel} with sliding-window attention "
                             f"(model.sliding_window {m.sliding_window}): the exchange gives attention the whole "
                             "sequence without the window; set context_parallel: 1")

    def _check_experts(self) -> None:
        """What a mixture-of-experts model does not run with yet: it trains on one device, under data
        parallelism (ZeRO 0-3) and tensor parallelism, its experts spread over the data-parallel ranks
        (expert_parallel), in pipelines, with recompute, freezing, LoRA on attention, dense blocks, shared and
        routed experts."""
        p, o = self.parallel, self.optimize
        ep = p.expert_parallel
        if ep > 1:
            if self.model.num_experts % ep:
                raise ValueError(f"parallel.expert_parallel {ep} must divide model.num_experts "
                                 f"{self.model.num_experts} (each rank holds the same number of experts)")
            if p.data_parallel % ep or p.data_parallel_replicate > 1:
                raise ValueError(f"parallel.expert_parallel {ep} with data_parallel {p.data_parallel} (replicate "
                                 f"{p.data_parallel_replicate}): the experts are spread over groups of {ep} "
                                 "consecutive data-parallel ranks, so expert_parallel must divide data_parallel "
                                 "(and data_parallel_replicate be 1)")
            if ep < p.data_parallel and self.train.optimizer_in_backward:
                raise ValueError(f"parallel.expert_parallel {ep} below data_parallel {p.data_parallel} with "
                                 "train.optimizer_in_backward: the experts' gradients are summed over their replicas "
                                 "after the backward, and the update in backward would come first; set "
                                 f"expert_parallel: {p.data_parallel} or optimizer_in_backward: false")
            if o.offload_params or o.offload_optimizer:
                raise ValueError("parallel.expert_parallel with optimize.offload_params / offload_optimizer: the "
                                 "experts' shards are not offloaded yet; turn the offload off")
            if p.tensor_parallel > 1 and ep < p.data_parallel:
                raise ValueError(f"parallel.expert_parallel {ep} below data_parallel {p.data_parallel} with "
                                 f"tensor_parallel {p.tensor_parallel}: with tensor parallelism the experts spread "
                                 f"over all the data-parallel ranks; set expert_parallel: {p.data_parallel} (or 1)")
        if p.context_parallel > 1 and (ep > 1 or p.tensor_parallel > 1):
            what = f"expert_parallel {ep}" if ep > 1 else f"tensor_parallel {p.tensor_parallel}"
            raise ValueError(f"parallel.context_parallel {p.context_parallel} with {what} on a mixture-of-experts "
                             f"model (model.num_experts {self.model.num_experts}): not supported yet; split the "
                             "sequence with data parallelism (ZeRO 0-3) alone, or set context_parallel: 1")
        if o.float8:
            raise ValueError("optimize.float8 converts nn.Linear layers, and a mixture-of-experts block's experts "
                             "are grouped matrix multiplies it does not convert (its router would be): set "
                             "optimize.float8: false")

    def _check_optimizer(self) -> None:
        """Optimizer settings that do not fit the precision or the layout (the trainer checks what needs
        the device count: an accumulation derived from global_batch_size)."""
        t, o, p = self.train, self.optimize, self.parallel
        level = o.level()
        if level == "O3" and t.optimizer_state_dtype == "fp32":
            raise ValueError(
                "train.optimizer_state_dtype fp32 at precision O3: O3 keeps weights, gradients and optimizer state "
                "in 16 bits; use precision_level O2 (fp32 masters and fp32 moments), or leave it at auto")
        if level == "O3" and o.mixed_precision == "fp16" and t.optimizer_state_dtype == "bf16":
            raise ValueError(
                "train.optimizer_state_dtype bf16 with fp16 weights at O3: the update would run in fp16 on moments "
                "of another 16-bit format; leave it at auto (fp16 moments), or use precision_level O2")
        if not t.optimizer_in_backward:
            return
        why = None
        if p.pipeline_parallel > 1:
            why = ("pipeline_parallel > 1: a pipeline schedule runs several micro-batches' backwards before the "
                   "gradients are final")
        elif p.zero_stage == 1 and p.data_parallel != 1:
            why = ("zero_stage 1: ZeRO-1's owners update their parameters and broadcast them after the whole "
                   "backward; use zero_stage 0, 2 or 3")
        elif o.mixed_precision == "fp16":
            why = ("fp16: the loss scale's overflow check needs every gradient before any update; use bf16")
        elif (o.gradient_accumulation_steps or 1) > 1:
            why = (f"gradient_accumulation_steps {o.gradient_accumulation_steps}: each micro-batch's backward would "
                   "update the weights; use one micro-batch per step (a larger micro_batch_size)")
        if why:
            raise ValueError(f"train.optimizer_in_backward with {why}")

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

    def _check_pipeline(self) -> None:
        """What of a pipeline the config alone decides: an accumulation that is not a whole number of
        pipeline steps, and data whose micro-batches vary in shape. The layout itself (schedule,
        virtual stages, stage layers) is `parallel.dims`'s to check, in `shardwise.resolve`."""
        p = self.parallel
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

    def compiles(self, device_type: str, train_seconds: Optional[float] = None) -> bool:
        """Whether the blocks are torch.compile'd on a `device_type` ("cuda", "npu", "cpu") device: run.compile;
        auto means on accelerators, and on a CPU when the run is predicted to train `train_seconds` of at least
        CPU_COMPILE_PAYS_AFTER_S (None: not predicted, eager), never for a quantised base (QLoRA refuses it)."""
        if self.run.compile != "auto":
            return bool(self.run.compile)
        if self.lora is not None and self.lora.quantize_base != "none":
            return False
        if device_type in COMPILED_BY_DEFAULT:
            return True
        return device_type == "cpu" and train_seconds is not None and train_seconds >= CPU_COMPILE_PAYS_AFTER_S

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


def tokens_per_step(cfg: RunConfig, devices: int | None = None) -> int:
    """Tokens consumed by one optimizer step over all devices (at most: instruction rows may be shorter); a
    preference pair is two rows."""
    rows = 2 if cfg.data.kind == "preference" else 1
    return cfg.global_batch_size(devices) * cfg.data.seq_length * rows
