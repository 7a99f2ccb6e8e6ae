"""QLoRA on a shardwise Transformer: the LoRA-wrapped linears' base weights quantised in place
(`quantize_base`), and the checks a run makes before it starts (`check_quantize_base`).

Only the base weights of LoRA-wrapped linears are quantised, as in torchtune and peft's QLoRA:
embeddings, the output projection, norms and the block linears LoRA does not target stay as they are
(16 bits at O2/O3). The tensors and the matmul are in `peft.quantize`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.transformer import Transformer
from shardwise.peft.lora import LoRALinear, is_lora_name, select_targets
from shardwise.peft.quantize import is_quantized, quantizable, quantize_tensor, torchao_import

_HOOKED = "_shardwise_quantized_hooks"


def quantizes_base(lora: Any) -> bool:
    """Whether a run's lora section (or None) quantises the base weights."""
    return lora is not None and getattr(lora, "quantize_base", "none") != "none"


@torch.no_grad()
def quantize_base(model: nn.Module, kind: str) -> list[str]:
    """Store the base weight of every LoRALinear of an allocated model (or model part) quantised as
    `kind` ("nf4", "int8"), frozen, in place of its plain weight; returns the quantised weights' names.
    The weights must hold their final values: quantise after loading them. A quantised weight is left
    out of the model's state dict, so checkpoints never hold it and loading one does not miss it (the
    run rebuilds the base from its source on every start)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear) or is_quantized(module.weight):
            continue
        if module.weight.is_meta or type(module.weight.data) is not torch.Tensor:
            raise ValueError(f"{name}.weight is a {type(module.weight.data).__name__} on {module.weight.device}: "
                             "quantize_base needs plain, allocated weights (quantise after loading)")
        module.weight = nn.Parameter(quantize_tensor(module.weight, kind), requires_grad=False)
        if not getattr(module, _HOOKED, False):
            module.register_state_dict_post_hook(_drop_quantized_weight)
            module.register_load_state_dict_post_hook(_forgive_quantized_weight)
            setattr(module, _HOOKED, True)
        names.append(f"{name}.weight")
    return names


def _drop_quantized_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: a quantised base weight is not part of the saved state."""
    if is_quantized(module.weight):
        state_dict.pop(f"{prefix}weight", None)


def _forgive_quantized_weight(module: nn.Module, incompatible: Any) -> None:
    """Load-state-dict post-hook: a quantised base weight, absent from every saved state, is not missing."""
    if is_quantized(module.weight):
        for key in [k for k in incompatible.missing_keys if k.endswith(".weight") and not is_lora_name(k)]:
            incompatible.missing_keys.remove(key)


def quantized_layout_problem(cfg: Any, dims: Any) -> Optional[str]:
    """Why a run's layout cannot hold its quantised base (the end of a message after "lora.quantize_base
    KIND with "), or None; the planner skips such layouts. `dims`: the run's ParallelDims."""
    if not quantizes_base(cfg.lora):
        return None
    kind = cfg.lora.quantize_base
    if dims.tp > 1:
        return (f"tensor_parallel {dims.tp}: tensor parallelism would shard the quantised base weights into "
                "DTensors, which torchao's quantised tensors do not support here; use tensor_parallel 1 (data "
                "parallelism with zero_stage 0 or 1 works)")
    if dims.pp > 1:
        return (f"pipeline_parallel {dims.pp} is not supported yet (the stages' checkpoints and schedules are "
                "untested with quantised weights); use pipeline_parallel 1")
    if dims.dp > 1 and cfg.parallel.zero_stage >= 2:
        return (f"zero_stage {cfg.parallel.zero_stage}: FSDP2 sharding of the quantised base is not supported yet; "
                f"use zero_stage 0 or 1 (each rank keeps the whole base in {'4' if kind == 'nf4' else '8'} bits, a "
                "fraction of a 16-bit one)")
    if dims.dp > 1 and (cfg.optimize.mixed_precision == "fp32" or cfg.optimize.level() in ("O0", "O1")):
        return (f"data_parallel {dims.dp}: it needs a 16-bit frozen base (fp32 frozen weights are replicated by "
                "FSDP2's replicate, which cannot hold quantised ones): use mixed_precision bf16 at precision_level "
                "O2 or O3, or one device")
    if cfg.optimize.offload_params or cfg.optimize.offload_optimizer:
        return ("CPU offload (optimize.offload_params / offload_optimizer) is not supported; the quantised base is "
                "already small: turn offload off")
    return None


def check_quantize_base(cfg: Any, dims: Any) -> None:
    """ConfigError, before anything is built, for a quantised base the run cannot have: a layout that
    would split or re-wrap the quantised tensors, torch.compile, no torchao, or a targeted weight whose
    size NF4's blocks do not divide. `cfg`: the RunConfig; `dims`: its ParallelDims."""
    if not quantizes_base(cfg.lora):
        return
    kind = cfg.lora.quantize_base
    key = f"lora.quantize_base {kind}"
    problem = quantized_layout_problem(cfg, dims)
    if problem:
        raise ConfigError(f"{key} with {problem}")
    if cfg.run.compile is True:  # auto leaves a quantised base eager (RunConfig.compiles)
        raise ConfigError(f"{key} with run.compile is not supported yet; set run.compile: false (or auto)")
    torchao_import()
    with torch.device("meta"):
        model = Transformer(cfg.model)
    for name in select_targets(model, cfg.lora.target_modules):
        why = quantizable(kind, tuple(model.get_submodule(name).weight.shape))
        if why is not None:
            raise ConfigError(f"{key} cannot quantise {name}.weight: {why}; choose other lora.target_modules or "
                              "lora.quantize_base int8")
