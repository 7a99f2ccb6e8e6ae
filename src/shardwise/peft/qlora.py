"""QLoRA on a shardwise Transformer: the LoRA-wrapped linears' base weights quantised in place
(`quantize_base`), and the checks a run makes before it starts (`check_quantize_base`).

Only the base weights of LoRA-wrapped modules are quantised, as in torchtune and peft's QLoRA:
embeddings, the output projection, norms and the block linears LoRA does not target stay as they are
(16 bits at O2/O3). A MoE block's routed experts with an adapter (`LoRAExperts`) have all three of their
stacked weights quantised, each stack [experts, out, in] as one [experts x out, in] matrix; a MoE model's
routed experts must be among the targets (they are most of its weights). The tensors and the matmuls are
in `peft.quantize`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.moe import GroupedExperts
from shardwise.models.transformer import Transformer
from shardwise.peft.lora import ROUTED_EXPERTS, LoRAExperts, LoRALinear, is_lora_name, select_targets
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
        if isinstance(module, LoRALinear):
            weights = ["weight"]
        elif isinstance(module, LoRAExperts):
            weights = ["w1", "w3", "w2"]
        else:
            continue
        for leaf in weights:
            param = getattr(module, leaf)
            if is_quantized(param):
                continue
            if param.is_meta or type(param.data) is not torch.Tensor:
                raise ValueError(f"{name}.{leaf} is a {type(param.data).__name__} on {param.device}: quantize_base "
                                 "needs plain, allocated weights (quantise after loading)")
            matrix = param.detach().reshape(-1, param.shape[-1])  # an experts' stack as one matrix
            setattr(module, leaf, nn.Parameter(quantize_tensor(matrix, kind), requires_grad=False))
            names.append(f"{name}.{leaf}")
        if not getattr(module, _HOOKED, False):
            module.register_state_dict_post_hook(_drop_quantized_weights)
            module.register_load_state_dict_post_hook(_forgive_quantized_weights)
            setattr(module, _HOOKED, True)
    return names


def _quantized_names(module: nn.Module) -> list[str]:
    """The module's own parameters that are quantised base weights."""
    return [n for n, p in module.named_parameters(recurse=False) if is_quantized(p)]


def _drop_quantized_weights(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: a quantised base weight is not part of the saved state."""
    for leaf in _quantized_names(module):
        state_dict.pop(f"{prefix}{leaf}", None)


def _forgive_quantized_weights(module: nn.Module, incompatible: Any) -> None:
    """Load-state-dict post-hook: a quantised base weight, absent from every saved state, is not missing."""
    leaves = _quantized_names(module)
    for key in [k for k in incompatible.missing_keys if k.rsplit(".", 1)[-1] in leaves and not is_lora_name(k)]:
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
    if cfg.model.num_experts and cfg.parallel.expert_parallel > 1:
        return (f"expert_parallel {cfg.parallel.expert_parallel}: the experts' quantised stacks would be split into "
                "DTensors, which torchao's quantised tensors do not support here; use expert_parallel 1 (data "
                "parallelism with zero_stage 0 or 1 works)")
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
    targets = select_targets(model, cfg.lora.target_modules)
    routed = {n.rsplit(".", 1)[0] for n in targets if n.split(".", 2)[2] in ROUTED_EXPERTS}
    moe_blocks = [n for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if moe_blocks and set(moe_blocks) - routed:
        missing = sorted(set(moe_blocks) - routed, key=lambda n: int(n.split(".")[1]))[0]
        raise ConfigError(f"{key} quantises the adapted weights, and lora.target_modules adapts no routed expert of "
                          f"{missing}: the experts, most of a mixture-of-experts model, would stay 16-bit; add "
                          "gate_proj, up_proj and down_proj (experts.w1 ...) to lora.target_modules")
    for name in targets:
        weight = name if name.split(".", 2)[2] in ROUTED_EXPERTS else f"{name}.weight"
        shape = tuple(model.get_parameter(weight).shape)
        why = quantizable(kind, (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape)  # a stack: one matrix
        if why is not None:
            raise ConfigError(f"{key} cannot quantise {weight}: {why}; choose other lora.target_modules or "
                              "lora.quantize_base int8")
