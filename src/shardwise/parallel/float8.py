"""float8 training (`optimize.float8`): the blocks' linear layers multiply in float8, through torchao.

torchao's `Float8Linear` replaces `nn.Linear`: each forward casts its input and weight to float8 e4m3
with one dynamic scale per tensor (max |x| maps to e4m3's largest value, 448), multiplies them with
`torch._scaled_mm` (bf16 out), and the backward casts the output gradient to e5m2 (2 bits of mantissa,
more range) for the input- and weight-gradient matmuls. Nothing else changes: the parameters, their
gradients and the optimizer stay as the precision level says (bf16 weights, fp32 masters), and what
autograd saves is the same bf16 input (torchao's `matmul_with_hp_or_float8_args` saves the input and
weight it was given, and casts again in backward). On GPUs with float8 tensor cores (compute
capability 8.9 and later: L40S, RTX 4090, H100, H200) the matmuls run at about twice the bf16 rate;
the casts are memory-bound extra work that `torch.compile` fuses into the neighbouring ops (eager
float8 gains little).

What is converted: the trainable `nn.Linear`s inside the blocks whose weight dimensions are both
multiples of 16 (`_scaled_mm` needs them), as torchtitan's filter does. The output head (the largest
matmul of small models, and the one whose precision the loss feels most), the embeddings and frozen
linears (a frozen weight would still pay the weight-gradient matmul torchao always computes) stay bf16.

Under FSDP2 (ZeRO 2/3) the converted weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`:
each rank casts its fp32 or bf16 shard with a scale shared by all shards, so the gathered weight is
already the forward's float8 operand, 1 byte per element instead of 2), and after every optimizer step
`after_optimizer_step` computes those scales for the next step in one all-reduce
(`precompute_float8_dynamic_scale_for_fsdp`) instead of one per weight inside the forward. Not under
FSDP2's CPU offload (`optimize.offload_params`), whose shards live on the host: there each forward casts
the gathered bf16 weight, as without data parallelism.

Not supported, and refused before anything is built (`check_float8`): the CPU and Ascend NPUs, CUDA
devices below compute capability 8.9, a precision other than bf16, LoRA (its base is frozen: nothing
would be converted but the adapters, too small to gain), and tensor parallelism (torchao's float8
tensor-parallel styles are not wired here).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError

log = logging.getLogger(__name__)

FLOAT8_CAPABILITY = (8, 9)  # CUDA compute capability of the first float8 tensor cores (Ada; Hopper is 9.0)
FLOAT8_ALIGN = 16  # torch._scaled_mm: both dimensions of each operand must be multiples of 16
LOWBIT_EXTRA = "pip install 'shardwise[lowbit]'"
_ALL_GATHER = "_shardwise_float8_all_gather"  # set on a model part whose float8 weights FSDP2 gathers in float8


def float8_on(cfg: Any) -> bool:
    """Whether a run config asks for float8 training."""
    return bool(getattr(cfg.optimize, "float8", False))


def converts(shape: Sequence[int], trainable: bool) -> bool:
    """Whether `apply_float8` converts a block linear whose weight has `shape`: trainable, both
    dimensions multiples of 16. The estimator and the step-time model ask the same question."""
    return trainable and len(shape) == 2 and all(d % FLOAT8_ALIGN == 0 for d in shape)


def float8_all_gather(cfg: Any, dp: int) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8 at data-parallel degree `dp`: ZeRO 2/3
    (ZeRO 0/1's `replicate` gathers nothing; one device has nothing to gather), but not under FSDP2's
    CPU offload (optimize.offload_params), whose host shards the scales' all-reduce after each step
    cannot reach: there each forward casts the gathered bf16 weight."""
    return float8_on(cfg) and dp > 1 and cfg.parallel.zero_stage >= 2 and not cfg.optimize.offload_params


def float8_layout_problem(cfg: Any, dims: Any) -> Optional[str]:
    """Why the config or its layout cannot train in float8 (the end of a message after "optimize.float8
    "), or None (also when float8 is off). `dims`: ParallelDims, or anything with `.tp` (the planner's
    Layout); the device is `float8_device_problem`'s."""
    if not float8_on(cfg):
        return None
    o = cfg.optimize
    if o.mixed_precision != "bf16":
        return (f"needs optimize.mixed_precision bf16, got {o.mixed_precision}: torchao's float8 matmuls take "
                "bf16 inputs and give bf16 outputs (fp16 would need loss scaling of e5m2 gradients); set "
                "mixed_precision: bf16 or optimize.float8: false")
    if cfg.lora is not None:
        return ("does not run with LoRA: the base weights are frozen, so only the small adapters would be "
                "converted, too small to gain from float8; set optimize.float8: false (or train without lora)")
    if dims.tp > 1:
        return (f"does not run under tensor parallelism (tensor_parallel {dims.tp}): torchao's float8 "
                "tensor-parallel styles are not wired in; use data parallelism (ZeRO 3 all-gathers the weights "
                "in float8) or set optimize.float8: false")
    return None


def float8_device_problem(device: torch.device) -> Optional[str]:
    """Why `device` cannot run float8 matmuls fast (None: it can)."""
    fix = "set optimize.float8: false"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= FLOAT8_CAPABILITY:
            return None
        return (f"needs float8 tensor cores (CUDA compute capability {FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} "
                f"or later: L40S, RTX 4090, H100, H200); {torch.cuda.get_device_name(device)} has {major}.{minor}: "
                f"{fix}")
    if device.type == "npu":
        return f"runs on NVIDIA GPUs with float8 tensor cores; torchao's float8 training has no Ascend NPU path: {fix}"
    return (f"runs on NVIDIA GPUs with float8 tensor cores (H100, H200, L40S, RTX 4090); this run is on the "
            f"{device.type.upper()}, where float8 matmuls would be emulated, slower than bf16: {fix}")


def float8_import() -> Any:
    """torchao's float8 package, or a ConfigError with the install line."""
    try:
        import torchao.float8 as f8
    except Exception as exc:  # noqa: BLE001 - missing, or built for another torch: either way not usable
        raise ConfigError(
            f"optimize.float8 needs torchao: {LOWBIT_EXTRA} (or pip install torchao, built for torch "
            f"{torch.__version__}); it could not be imported ({type(exc).__name__}: {exc}). Or set "
            "optimize.float8: false") from None
    return f8


def check_float8(cfg: Any, device: torch.device, dims: Any) -> None:
    """ConfigError, before anything is built, when the run asks for float8 where it cannot have it:
    the config or layout (`float8_layout_problem`), the device (`float8_device_problem`), no torchao."""
    if not float8_on(cfg):
        return
    problem = float8_layout_problem(cfg, dims) or float8_device_problem(device)
    if problem:
        raise ConfigError(f"optimize.float8 {problem}")
    float8_import()


def apply_float8(model: nn.Module, cfg: Any, dims: Any) -> list[str]:
    """Convert the block linears of `model` (a whole model or a pipeline chunk, before recompute,
    compile and data parallelism) to torchao's Float8Linear as the module docstring says; returns the
    converted modules' names (none when float8 is off). The device is not checked here
    (`check_float8` does that at setup), so tests can convert on a CPU, where `_scaled_mm` runs."""
    if not float8_on(cfg):
        return []
    problem = float8_layout_problem(cfg, dims)
    if problem:
        raise ConfigError(f"optimize.float8 {problem}")
    f8 = float8_import()
    gather = float8_all_gather(cfg, dims.dp)
    config = f8.Float8LinearConfig(enable_fsdp_float8_all_gather=gather)
    converted: list[str] = []

    def wanted(module: nn.Module, fqn: str) -> bool:
        take = isinstance(module, nn.Linear) and converts(tuple(module.weight.shape), module.weight.requires_grad)
        if take:
            converted.append(fqn)
        return take

    for index, block in model.layers.items():
        start = len(converted)
        f8.convert_to_float8_training(block, module_filter_fn=wanted, config=config)
        if gather:
            for fqn in converted[start:]:
                block.get_submodule(fqn).register_state_dict_post_hook(_plain_weight_in_state_dict)
        converted[start:] = [f"layers.{index}.{fqn}" for fqn in converted[start:]]
    setattr(model, _ALL_GATHER, gather and bool(converted))
    log.info("float8: %d block linears converted (dynamic tensorwise scaling%s); the output head stays bf16",
             len(converted), ", float8 all-gather" if gather else "")
    return converted


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
    """A state-dict post-hook: the float8 all-gather weight (torchao's WeightWithDynamicFloat8CastTensor,
    inside FSDP2's DTensor) as the plain tensor it wraps, so checkpoints hold plain tensors (the loader
    refuses anything else). The plain tensor shares the parameter's storage, so loading into it in place
    (DCP) or copying into the parameter (`load_state_dict`) both reach the weight."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    key = prefix + "weight"
    t = state_dict.get(key)
    if isinstance(t, DTensor) and isinstance(t._local_tensor, WeightWithDynamicFloat8CastTensor):
        state_dict[key] = DTensor.from_local(t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
                                             shape=t.shape, stride=t.stride())
    elif isinstance(t, WeightWithDynamicFloat8CastTensor):
        state_dict[key] = t._tensor


def after_optimizer_step(parts: Sequence[nn.Module]) -> None:
    """Call after every optimizer step that updated the weights: under FSDP2's float8 all-gather, the
    float8 scales of the next step's weights, for all of them in one all-reduce. A no-op otherwise
    (float8 off, or nothing gathered in float8)."""
    parts = [p for p in parts if getattr(p, _ALL_GATHER, False)]
    if not parts:
        return
    f8 = float8_import()
    for part in parts:
        f8.precompute_float8_dynamic_scale_for_fsdp(part)
