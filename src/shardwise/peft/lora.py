"""LoRA for the shardwise Transformer, with adapters in peft's on-disk format (both ways).

`apply_lora` swaps the targeted block linears for `LoRALinear`, an nn.Linear subclass that keeps the
base `weight`/`bias` Parameters as its own, so every base name (and Parameter object) is unchanged and
only `...lora_A.weight` / `...lora_B.weight` are new. Adapter files use Hugging Face module names, as
`peft.PeftModel.save_pretrained` writes them:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

GPT-2 keeps q, k and v in one Conv1D (`attn.c_attn`) that peft adapts with a single lora_A and a
stacked lora_B, so our wq/wk/wv adapters of one layer share one lora_A module; then the export is exact.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import CheckpointError, ConfigError
from shardwise.models.config import ModelConfig
from shardwise.models.flops import attention_dims
from shardwise.models.hf import (
    GPT2_NAMES,
    check_weight_dtype,
    hf_layer_modules,
    open_safetensors,
    routed_expert_names,
    save_safetensors,
)
from shardwise.models.moe import GroupedExperts, grouped_mm, local_experts
from shardwise.peft.quantize import is_quantized, lora_linear, quantized_experts
from shardwise.untrusted import (
    bool_field,
    bounded_fullmatch,
    compile_pattern,
    fail,
    int_field,
    kind_of,
    number_field,
    parse_json,
    read_json_object,
    str_field,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Safetensors metadata key holding the architecture the adapter was trained on (JSON).
ARCH_METADATA_KEY = "shardwise_architecture"

# The linears inside one block that LoRA may wrap, in forward order (names relative to layers.{i}): attention
# (latent attention's down and up projections too), the dense MLP or a MoE block's shared experts. Where
# several of them are one HF module (GPT-2's c_attn, Baichuan's W_pack: q, k, v; GLM-4's gate_up_proj:
# w1, w3), they share one lora_A and peft's lora_B stacks theirs, in this order.
BLOCK_LINEARS = (
    "attention.wq", "attention.wk", "attention.wv", "attention.wq_a", "attention.wq_b", "attention.wkv_a",
    "attention.wkv_b", "attention.wo",
    "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
    "feed_forward.shared.w1", "feed_forward.shared.w3", "feed_forward.shared.w2",
)
# A MoE block's routed experts: each stacked weight [experts, out, in] gets one adapter per expert (lora_A
# [experts, r, in], lora_B [experts, out, r]), saved per expert as peft writes LoRA on the experts' linears
# (`mlp.experts.{j}.gate_proj`), the form peft converts for transformers 5's fused experts.
ROUTED_EXPERTS = ("feed_forward.experts.w1", "feed_forward.experts.w3", "feed_forward.experts.w2")
_QKV = ("attention.wq", "attention.wk", "attention.wv")
_GPT2_BACK = {ours: hf for hf, ours in GPT2_NAMES.items() if ours in BLOCK_LINEARS}
_GPT2_BACK.update({name: "attn.c_attn" for name in _QKV})

# Characters that make a target_modules entry a regular expression ('.' is a name separator, so not one).
_REGEX_CHARS = set("\\^$*+?{}[]()|")

# ModelConfig fields that decide which base models an adapter fits (not max length, RoPE base or dropout,
# which a fine-tune may change; not model_type, a label that export may rewrite).
_ARCH_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "norm", "mlp", "activation", "position", "qkv_bias", "out_bias", "mlp_bias", "tie_embeddings",
)

# adapter_config.json keys that change what the adapter computes in ways shardwise does not implement.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on raw parameters (target_parameters: on transformers 5's fused experts; shardwise "
                         "reads and writes LoRA on routed experts per expert, as mlp.experts.{j}.gate_proj ...)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "megatron_config": "Megatron-sharded LoRA (megatron_config)",
    "arrow_config": "Arrow routing (arrow_config)",
}
# init_lora_weights values that also rewrite the base weights: the adapter then needs that residual base.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


# ---------------------------------------------------------------- module ----

class LoRALinear(nn.Linear):
    """y = x W^T + b + scaling * B(A(dropout(x))), with W and b the wrapped linear's own Parameters."""

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        lora_A: Optional[nn.Linear] = None,
        use_rslora: bool = False,
    ) -> None:
        # nn.Module's init, not nn.Linear's: that one would allocate and initialise a second weight.
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.r = r
        self.lora_alpha = alpha
        self.use_rslora = use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        device, dtype = base.weight.device, base.weight.dtype
        # Built on meta and then allocated, so that wrapping never draws from the global RNG; the values
        # come from lora_init (or an adapter file).
        if lora_A is None:
            lora_A = nn.Linear(self.in_features, r, bias=False, device="meta", dtype=dtype).to_empty(device=device)
        elif tuple(lora_A.weight.shape) != (r, self.in_features):
            raise ValueError(
                f"a shared lora_A must have shape {(r, self.in_features)}, got {tuple(lora_A.weight.shape)}")
        self.lora_A = lora_A
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device="meta", dtype=dtype).to_empty(device=device)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.train(base.training)  # new modules start in training mode; follow the model's (eval: no dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base linear (its weight plain or quantised, `quantize_base`) plus the scaled low-rank update.
        On a quantised base the whole layer is one autograd function (`peft.quantize.lora_linear`), whose
        input gradient is summed in fp32 and rounded once."""
        if is_quantized(self.weight):
            p = self.lora_dropout.p if self.training and isinstance(self.lora_dropout, nn.Dropout) else 0.0
            return lora_linear(x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.scaling, p)
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        """Shapes, rank and scaling for print(model)."""
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}"


class _Stacked(nn.Module):
    """One stacked adapter factor, `weight` [experts, rows, columns] (a module so that its name ends in
    `.lora_A.weight` / `.lora_B.weight` as a linear adapter's does)."""

    def __init__(self, experts: int, rows: int, columns: int, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, rows, columns, device=device, dtype=dtype))  # no RNG drawn


class ExpertAdapter(nn.Module):
    """LoRA on one stacked expert weight: expert e's update is scaling * lora_B[e] @ lora_A[e]."""

    def __init__(self, experts: int, in_features: int, out_features: int, r: int, device: Any,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.lora_A = _Stacked(experts, r, in_features, device, dtype)
        self.lora_B = _Stacked(experts, out_features, r, device, dtype)


class LoRAExperts(GroupedExperts):
    """A MoE block's routed experts with LoRA on some of their stacked weights (`lora`: "w1", "w3", "w2" ->
    ExpertAdapter). The base weights are the wrapped module's own Parameters (names unchanged); each adapter
    runs as two more grouped matrix multiplies over the same rows sorted by expert (rank r in between), so
    no expert's full update is ever formed. Under expert parallelism the adapters are spread with the
    experts (`parallel.expert`: every parameter here is stacked by expert along its first dimension)."""

    def __init__(self, base: GroupedExperts, weights: Sequence[str], r: int, alpha: float,
                 use_rslora: bool = False) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.activation = base.num_experts, base.activation
        self.w1, self.w3, self.w2 = base.w1, base.w3, base.w2
        self.token_exchange, self.expert_replicas = base.token_exchange, base.expert_replicas
        self.r, self.lora_alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora = nn.ModuleDict({
            w: ExpertAdapter(self.num_experts, getattr(base, w).shape[2], getattr(base, w).shape[1], r,
                             base.w1.device, base.w1.dtype) for w in weights})
        self.train(base.training)

    def project(self, rows: torch.Tensor, weight: str, offsets: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """The base projection plus, for an adapted weight, scaling * B_e A_e applied to each expert's rows. A
        quantised base (QLoRA, `peft.qlora.quantize_base`: the stack stored as one [experts x out, in]
        matrix) is dequantised for its matmul only."""
        base = getattr(self, weight)
        if is_quantized(base):
            out = quantized_experts(rows, base, self.num_experts, offsets, groups, grouped_mm)
        else:
            out = super().project(rows, weight, offsets, groups)
        if weight not in self.lora:
            return out
        adapter = self.lora[weight]
        a, b = (local_experts(f.weight).to(rows.dtype) for f in (adapter.lora_A, adapter.lora_B))
        low = grouped_mm(rows, a.transpose(1, 2), offsets, groups)  # [rows, r]
        # In place (the base product is not saved for backward): no third [rows, out] tensor at once.
        return out.add_(grouped_mm(low, b.transpose(1, 2), offsets, groups), alpha=self.scaling)

    def extra_repr(self) -> str:
        """Adapted weights, rank and scaling for print(model)."""
        return f"lora on {', '.join(self.lora)}, r={self.r}, scaling={self.scaling:g}"


# ----------------------------------------------------------------- names ----

@contextmanager
def adapters_off(*models: nn.Module) -> Iterator[None]:
    """Within the block, the `models` (a model, or a pipeline rank's chunks) compute as their base: every
    adapter's scaling is 0 (its update adds exact zeros), and restored after. Preference tuning's reference
    model with LoRA: no second copy in memory."""
    adapted = [m for model in models for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))]
    scalings = [m.scaling for m in adapted]
    for m in adapted:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(adapted, scalings):
            m.scaling = scaling


def is_lora_name(name: str) -> bool:
    """Whether a parameter or state name belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name


def lora_parameter_names(model: nn.Module) -> list[str]:
    """Names of the model's LoRA parameters (a shared GPT-2 lora_A appears once, under its first user)."""
    return [name for name, _ in model.named_parameters() if is_lora_name(name)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA parameters of a plain (non-DTensor) model, detached, keyed by our names."""
    return {name: p.detach() for name, p in model.named_parameters() if is_lora_name(name)}


def _is_gpt2(cfg: ModelConfig) -> bool:
    """Whether the model maps to GPT-2's layout (the same test hf.py uses)."""
    return cfg.position == "learned"


def block_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our block linears (relative to layers.{i}) -> the HF module inside a layer that holds each; a routed
    expert weight -> its experts' linears with the index left out (`mlp.experts.gate_proj`)."""
    if _is_gpt2(cfg):
        return _GPT2_BACK
    out = hf_layer_modules(BLOCK_LINEARS, cfg)
    if cfg.num_experts:
        for unit in ROUTED_EXPERTS:
            experts, linear = routed_expert_names(unit.rsplit(".", 1)[1], cfg)
            out[unit] = f"{experts}.{linear}"
    return out


def _routed_key(hf_name: str, cfg: ModelConfig) -> Optional[tuple[str, int]]:
    """(our routed expert weight, the expert) for one expert's HF linear (`model.layers.1.mlp.experts.3.
    gate_proj` -> (`layers.1.feed_forward.experts.w1`, 3)); None for any other name."""
    if not cfg.num_experts or _is_gpt2(cfg):
        return None
    match = re.fullmatch(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)\.(0|[1-9][0-9]*)\.([^.]+)", hf_name)
    if match is None:
        return None
    idx, experts, j, linear = match.groups()
    for unit in ROUTED_EXPERTS:
        if routed_expert_names(unit.rsplit(".", 1)[1], cfg) == (experts, linear) and int(j) < cfg.num_experts:
            return f"layers.{idx}.{unit}", int(j)
    return None


def _expert_linears(unit: str, cfg: ModelConfig) -> list[str]:
    """Every expert's HF linear of our routed expert weight `layers.{i}.feed_forward.experts.w1`, in order."""
    _, idx, rest = unit.split(".", 2)
    experts, linear = routed_expert_names(rest.rsplit(".", 1)[1], cfg)
    return [f"model.layers.{idx}.{experts}.{j}.{linear}" for j in range(cfg.num_experts)]


def _fused_groups(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """HF module -> our block linears it holds, where it holds several (c_attn, W_pack, gate_up_proj)."""
    groups: dict[str, list[str]] = {}
    for ours, theirs in block_hf_names(cfg).items():
        groups.setdefault(theirs, []).append(ours)
    return {theirs: tuple(ours) for theirs, ours in groups.items() if len(ours) > 1}


def hf_module_name(name: str, cfg: ModelConfig) -> str:
    """The Hugging Face module name of one of our block linears (`layers.0.attention.wq` ->
    `model.layers.0.self_attn.q_proj`, or `transformer.h.0.attn.c_attn` for GPT-2)."""
    _, idx, rest = name.split(".", 2)
    prefix = "transformer.h" if _is_gpt2(cfg) else "model.layers"
    return f"{prefix}.{idx}.{block_hf_names(cfg)[rest]}"


def our_module_names(hf_name: str, cfg: ModelConfig) -> Optional[list[str]]:
    """Our block linears behind an HF module name (several for a fused one); None if it is not one."""
    if _is_gpt2(cfg):
        match = re.fullmatch(r"(?:transformer\.)?h\.(0|[1-9][0-9]*)\.(.+)", hf_name)
    else:
        match = re.fullmatch(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)", hf_name)
    if match is None:  # the index in ASCII digits without leading zeros: '٣' or '03' name no layer of ours
        return None
    idx, rest = match.groups()
    names = [f"layers.{idx}.{ours}" for ours, theirs in block_hf_names(cfg).items() if theirs == rest]
    return names or None


def _linear_dims(name: str, cfg: ModelConfig) -> tuple[int, int]:
    """(in_features, out_features) of one of our block linears (of one expert, for a routed expert weight)."""
    h, width, expert = cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size or 0
    shared = cfg.num_shared_experts * expert
    dims = {
        **attention_dims(cfg),
        "feed_forward.w1": (h, width), "feed_forward.w3": (h, width), "feed_forward.w2": (width, h),
        "feed_forward.shared.w1": (h, shared), "feed_forward.shared.w3": (h, shared),
        "feed_forward.shared.w2": (shared, h),
        "feed_forward.experts.w1": (h, expert), "feed_forward.experts.w3": (h, expert),
        "feed_forward.experts.w2": (expert, h),
    }
    return dims[name.split(".", 2)[2]]


def _split_lora_name(name: str) -> tuple[str, str]:
    """(`layers.0.attention.wq`, `lora_A`) for `layers.0.attention.wq.lora_A.weight`; a routed expert
    weight's adapter (`layers.1.feed_forward.experts.lora.w1.lora_A.weight`) by the weight it adapts
    (`layers.1.feed_forward.experts.w1`)."""
    for kind in ("lora_A", "lora_B"):
        suffix = f".{kind}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)].replace(".feed_forward.experts.lora.", ".feed_forward.experts."), kind
    raise ValueError(f"{name!r} is not a LoRA weight name (expected ...lora_A.weight or ...lora_B.weight)")


def to_peft_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """peft's adapter tensors for our LoRA state (full tensors); the linears of one fused HF module (GPT-2's
    c_attn, Baichuan's W_pack, GLM-4's gate_up_proj) become one adapter: the shared lora_A, lora_B stacked,
    zeros for a member without LoRA."""
    out: dict[str, torch.Tensor] = {}
    groups = _fused_groups(cfg)
    members = {ours: theirs for theirs, group in groups.items() for ours in group}
    fused: dict[tuple[str, str], dict[str, dict[str, torch.Tensor]]] = {}  # (layer, HF module) -> ours -> kind
    for name, tensor in state.items():
        module, kind = _split_lora_name(name)
        _, idx, rest = module.split(".", 2)
        if rest in members:
            fused.setdefault((idx, members[rest]), {}).setdefault(rest, {})[kind] = tensor
        elif rest in ROUTED_EXPERTS:  # [experts, ...]: one adapter per expert's linear
            out.update({f"{PEFT_PREFIX}{linear}.{kind}.weight": part
                        for linear, part in zip(_expert_linears(module, cfg), tensor.unbind(0))})
        else:
            out[f"{PEFT_PREFIX}{hf_module_name(module, cfg)}.{kind}.weight"] = tensor
    for (idx, theirs), parts in fused.items():
        group = groups[theirs]
        key = f"{PEFT_PREFIX}{hf_module_name(f'layers.{idx}.{group[0]}', cfg)}"
        shared = [parts[m]["lora_A"] for m in group if "lora_A" in parts.get(m, {})]
        if not shared:
            raise ValueError(f"no lora_A for layer {idx}'s {theirs} in the LoRA state")
        if any(not torch.equal(a, shared[0]) for a in shared[1:]):
            raise CheckpointError(
                f"layer {idx}: the fused {theirs} needs one lora_A shared by {', '.join(group)}, but they differ; "
                "apply LoRA with shardwise.peft.apply_lora, which shares it"
            )
        lora_a = shared[0]
        blocks = []
        for m in group:
            b = parts.get(m, {}).get("lora_B")
            out_dim = _linear_dims(f"layers.{idx}.{m}", cfg)[1]
            blocks.append(b if b is not None else torch.zeros(out_dim, lora_a.shape[0], dtype=lora_a.dtype))
        out[f"{key}.lora_A.weight"] = lora_a
        out[f"{key}.lora_B.weight"] = torch.cat([b.to(lora_a.device) for b in blocks], dim=0)
    return out


def _parse_peft_key(key: str) -> Optional[tuple[str, str]]:
    """(HF module name, `lora_A`|`lora_B`) of a peft adapter tensor key; None for anything else."""
    match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.default)?\.weight", key)
    return (match.group(1), match.group(2)) if match else None


def from_peft_state(peft_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our LoRA state for peft's adapter tensors (GPT-2's c_attn lora_B is split into q, k and v; the routed
    experts' per-expert adapters stacked); CheckpointError for tensors that are no block-linear LoRA weight,
    and for routed experts of which some have no adapter."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (our weight, kind) -> expert -> tensor
    for key, tensor in peft_state.items():
        parsed = _parse_peft_key(key)
        routed = _routed_key(parsed[0], cfg) if parsed else None
        if routed is not None:
            experts.setdefault((routed[0], parsed[1]), {})[routed[1]] = tensor
            continue
        ours = our_module_names(parsed[0], cfg) if parsed else None
        if ours is None:
            raise CheckpointError(
                f"adapter tensor {key} is not a LoRA weight of an attention or MLP linear of a {cfg.model_type} "
                "model; shardwise supports LoRA on those linears only"
            )
        kind = parsed[1]
        if kind == "lora_A" or len(ours) == 1:
            out.update({f"{name}.{kind}.weight": tensor for name in ours})
        else:  # GPT-2's c_attn lora_B stacks q, k and v outputs
            sizes = [_linear_dims(name, cfg)[1] for name in ours]
            out.update({f"{name}.lora_B.weight": part for name, part in zip(ours, tensor.split(sizes, dim=0))})
    for (unit, kind), by_expert in experts.items():
        missing = sorted(set(range(cfg.num_experts)) - set(by_expert))
        if missing:
            raise CheckpointError(
                f"the adapter has {kind} for {len(by_expert)} of the {cfg.num_experts} experts of "
                f"{_expert_linears(unit, cfg)[missing[0]]} (none for expert {missing[0]}): LoRA on the routed experts "
                "needs an adapter on every expert of a block")
        out[f"{unit}.{kind}.weight"] = torch.stack([by_expert[j] for j in range(cfg.num_experts)])
    return out


# ------------------------------------------------------------- targeting ----

def _eligible(model: nn.Module) -> list[str]:
    """Our names of the block linears present in the model (a pipeline stage holds only some layers), and of
    the MoE blocks' routed expert weights."""
    names = []
    for idx, block in model.layers.items():
        for rest in BLOCK_LINEARS:
            module: Any = block
            for part in rest.split("."):  # w3 is None in plain MLPs; wq_a only in latent attention...
                module = getattr(module, part, None)
            if isinstance(module, nn.Linear):
                names.append(f"layers.{idx}.{rest}")
        if isinstance(getattr(block.feed_forward, "experts", None), GroupedExperts):
            names.extend(f"layers.{idx}.{rest}" for rest in ROUTED_EXPERTS)
    return names


def _suffix_match(entry: str, name: str) -> bool:
    """peft's list semantics: the whole name, or a suffix starting after a '.'."""
    return name == entry or name.endswith("." + entry)


_TARGETS = "lora.target_modules"
_TARGETS_ADVICE = "escape a literal '.' as '\\.' or give plain names such as [q_proj, v_proj]"


def _compile(pattern: str) -> Any:
    """A target_modules regex, compiled with the `regex` package (matched with a time bound); ConfigError
    naming it when it does not compile."""
    return compile_pattern(pattern, _TARGETS, ConfigError, advice=_TARGETS_ADVICE)


def _hit(pattern: Any, ours: str, hf: str) -> bool:
    """Whether `pattern` matches our name or the HF name in full, within the time bound (a pattern that
    backtracks without end fails naming itself instead of hanging)."""
    return (bounded_fullmatch(pattern, ours, _TARGETS, ConfigError, advice=_TARGETS_ADVICE)
            or bounded_fullmatch(pattern, hf, _TARGETS, ConfigError, advice=_TARGETS_ADVICE))


def _check_targets(target_modules: Any) -> None:
    """A string, or a non-empty list of strings (each at most 1,000 characters)."""
    entries = [target_modules] if isinstance(target_modules, str) else target_modules
    if not isinstance(entries, (list, tuple)) or not entries or len(entries) > 10_000 \
            or not all(isinstance(e, str) and 0 < len(e) <= 1000 for e in entries):
        raise ConfigError(f"{_TARGETS} is {kind_of(target_modules)}: give 'all-linear', a regular expression, "
                          "or a list of module names (each a non-empty string of at most 1,000 characters)")


def select_targets(model: nn.Module, target_modules: Union[str, Sequence[str]]) -> list[str]:
    """Our names of the block linears that `target_modules` selects (see apply_lora); ConfigError if none."""
    cfg = model.cfg
    _check_targets(target_modules)
    eligible = _eligible(model)
    both = [(name, hf_module_name(name, cfg)) for name in eligible]
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            chosen = eligible
        else:
            pattern = _compile(target_modules)
            chosen = [ours for ours, hf in both if _hit(pattern, ours, hf)]
    else:
        entries = list(target_modules)
        patterns = {e: _compile(e) for e in entries if set(e) & _REGEX_CHARS}  # each compiled once, checked first
        chosen = []
        for ours, hf in both:
            for entry in entries:
                if entry in patterns:
                    hit = _hit(patterns[entry], ours, hf)
                else:
                    hit = _suffix_match(entry, ours) or _suffix_match(entry, hf)
                if hit:
                    chosen.append(ours)
                    break
    if not chosen:
        first = eligible[0].split(".")[1] if eligible else "0"
        layer = [(o, h) for o, h in both if o.split(".")[1] == first]
        listing = ", ".join(f"{o} ({h})" for o, h in layer)
        hint = ""
        if isinstance(target_modules, str) and not set(target_modules) & _REGEX_CHARS:
            hint = (f"; a single string is a regex matched against the full name: use a list such as "
                    f"[{target_modules}] for a suffix match")
        raise ConfigError(
            f"lora.target_modules {target_modules!r} matches no linear layer of this model{hint}. Eligible "
            f"modules of layer {first} (ours, Hugging Face): {listing}; entries match a name suffix "
            f"(e.g. q_proj or attention.wq), a regex (re.fullmatch), or use 'all-linear'"
        )
    return chosen


# --------------------------------------------------------------- init ----

def lora_init(param_name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """The initial value (fp32, CPU) of a LoRA parameter, a function of (name, seed) only: lora_A is
    kaiming-uniform (a=sqrt(5), as peft and nn.Linear), lora_B zero."""
    _, kind = _split_lora_name(param_name)
    if kind == "lora_B":
        return torch.zeros(tuple(shape), dtype=torch.float32)
    # Seeded by the name, so every parallel layout and pipeline split draws the same values. The CPU
    # generator keeps only 32 bits of a seed, so seed and name are hashed together into 32 bits.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{param_name}".encode()))
    value = torch.empty(tuple(shape), dtype=torch.float32)
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    return value


@torch.no_grad()
def reset_lora_parameters(model: nn.Module, seed: int = 0) -> None:
    """Fill every LoRA parameter of a plain (non-DTensor, allocated) model with lora_init."""
    for name, param in model.named_parameters():
        if not is_lora_name(name):
            continue
        if type(param.data) is not torch.Tensor or param.is_meta:
            raise ValueError(
                f"{name} is a {type(param.data).__name__} on {param.device}: reset_lora_parameters fills plain, "
                "allocated tensors; for sharded ones use lora_init and copy each rank's slice"
            )
        param.copy_(lora_init(name, param.shape, seed))


# ------------------------------------------------------------ apply ----

def _check_hyper(r: int, alpha: float, dropout: float) -> None:
    """ConfigError for a rank, alpha or dropout LoRA cannot use."""
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ConfigError(f"lora.r must be a positive integer, got {r!r}")
    if not alpha > 0:
        raise ConfigError(f"lora.alpha must be positive, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {dropout!r}")


def _has_lora(model: nn.Module) -> bool:
    """Whether any module is already a LoRALinear or LoRAExperts."""
    return any(isinstance(m, (LoRALinear, LoRAExperts)) for m in model.modules())


def _wrap(model: nn.Module, names: Iterable[str], r: int, alpha: float, dropout: float, use_rslora: bool) -> list[str]:
    """Replace the named block linears with LoRALinear (GPT-2's q/k/v of a layer share lora_A) and a MoE
    block's experts with LoRAExperts when any of their weights is named; make only LoRA parameters trainable."""
    wanted = set(names)
    on_experts = sorted(n for n in wanted if n.split(".", 2)[2] in ROUTED_EXPERTS)
    if on_experts and dropout > 0:
        raise ConfigError(
            f"lora.dropout {dropout} with LoRA on the routed experts ({on_experts[0]}...): peft runs adapters on "
            "transformers' fused experts without dropout (and refuses them otherwise); set lora.dropout: 0, or "
            "leave the routed experts out of lora.target_modules")
    wrapped = []
    shared: dict[tuple[str, str], nn.Linear] = {}  # (layer, fused HF module) -> the lora_A its members share
    members = {ours: theirs for theirs, group in _fused_groups(model.cfg).items() for ours in group}
    routed: dict[str, list[str]] = {}  # a MoE block's experts module -> its adapted weights, in order
    for name in _eligible(model):  # model order, so the first of q/k/v owns the shared lora_A's name
        if name not in wanted:
            continue
        if name.split(".", 2)[2] in ROUTED_EXPERTS:
            experts, _, weight = name.rpartition(".")
            routed.setdefault(experts, []).append(weight)
            wrapped.append(name)
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, leaf)
        idx, rest = name.split(".")[1], name.split(".", 2)[2]
        fuse = (idx, members[rest]) if rest in members else None
        module = LoRALinear(base, r, alpha, dropout, lora_A=shared.get(fuse) if fuse else None, use_rslora=use_rslora)
        if fuse:
            shared.setdefault(fuse, module.lora_A)
        setattr(parent, leaf, module)
        wrapped.append(name)
    for experts, weights in routed.items():
        parent_name, _, leaf = experts.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRAExperts(getattr(parent, leaf), weights, r, alpha, use_rslora))
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_name(name))
    return wrapped


def apply_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: Union[str, Sequence[str]],
    seed: int = 0,
    use_rslora: bool = False,
) -> list[str]:
    """Wrap the targeted block linears of a shardwise Transformer with LoRA in place, freeze everything
    else, and initialise the adapters with lora_init unless the model is on meta; returns our names of
    the wrapped modules.

    target_modules: "all-linear"; a single string = a regex (re.fullmatch, peft semantics); or a list
    whose entries match a name suffix on '.' boundaries (`q_proj`, `wq`, `attention.wq`) or, when they
    contain regex characters, fully as a regex, against our module name or its Hugging Face name.
    """
    _check_hyper(r, alpha, dropout)
    if _has_lora(model):
        raise ConfigError("the model already has LoRA adapters; apply LoRA once (or merge_lora first)")
    names = _wrap(model, select_targets(model, target_modules), r, alpha, dropout, use_rslora)
    if not any(p.is_meta for p in model.parameters()):
        reset_lora_parameters(model, seed)
    return names


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += scaling * B @ A in fp32) and put back plain
    nn.Linear modules holding the same base Parameters, so the model has exactly the base names.
    A quantised base (QLoRA) is refused: merge into the full-precision base the adapter was trained on
    (load the adapter onto it, `load_adapter`), not into its 4- or 8-bit copy."""
    quantized = [name for name, m in model.named_modules() if (isinstance(m, LoRALinear) and is_quantized(m.weight))
                 or (isinstance(m, LoRAExperts) and any(is_quantized(w) for w in (m.w1, m.w3, m.w2)))]
    if quantized:
        raise ConfigError(
            f"merge_lora: {len(quantized)} base weights are quantised (lora.quantize_base, e.g. {quantized[0]}); "
            "merging into them would need a dequantised copy of the whole base. Merge the run's adapter "
            "(CHECKPOINT/adapter, peft's format) into the full-precision base it was trained on: load_adapter onto "
            "that base, then merge_lora (or peft's PeftModel.from_pretrained(...).merge_and_unload())")
    _unwrap(model, merge=True)


def remove_lora(model: nn.Module) -> None:
    """Drop every adapter without merging it: plain nn.Linear modules holding the same base Parameters
    (the base model the adapters were trained on)."""
    _unwrap(model, merge=False)


@torch.no_grad()
def _unwrap(model: nn.Module, merge: bool) -> None:
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAExperts)]:
        _unwrap_experts(model, name, module, merge)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, module in targets:
        weight = module.weight
        if merge:
            delta = (module.lora_B.weight.float() @ module.lora_A.weight.float()) * module.scaling
            weight.copy_((weight.float() + delta).to(weight.dtype))
        with torch.device("meta"):  # the new module's own weight is replaced at once, so never allocated
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        plain.weight = weight
        if module.bias is not None:
            plain.bias = module.bias
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, plain)


def _unwrap_experts(model: nn.Module, name: str, module: LoRAExperts, merge: bool) -> None:
    """Put back plain GroupedExperts holding the same base Parameters, each adapted expert's update
    scaling * B_e @ A_e added first when `merge`."""
    if merge:
        for weight, adapter in module.lora.items():
            base = getattr(module, weight)
            delta = torch.bmm(adapter.lora_B.weight.float(), adapter.lora_A.weight.float()) * module.scaling
            base.copy_((base.float() + delta).to(base.dtype))
    with torch.device("meta"):  # its own weights are replaced at once, so never allocated
        plain = GroupedExperts(model.cfg)
    plain.w1, plain.w3, plain.w2 = module.w1, module.w3, module.w2
    plain.token_exchange, plain.expert_replicas = module.token_exchange, module.expert_replicas
    plain.train(module.training)
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, plain)


# ------------------------------------------------------------ on disk ----

def architecture_fingerprint(cfg: ModelConfig) -> dict:
    """The ModelConfig fields an adapter depends on (stored with it, compared on load)."""
    return {field: getattr(cfg, field) for field in _ARCH_FIELDS}


def _layer_units(cfg: ModelConfig, layer: int) -> list[str]:
    """Our adaptable names inside block `layer` of a model of `cfg` (relative to layers.{i})."""
    units = [u for u in attention_dims(cfg)]
    if cfg.is_moe_layer(layer):
        shared = ("feed_forward.shared.w1", "feed_forward.shared.w3", "feed_forward.shared.w2")
        return units + list(shared if cfg.num_shared_experts else ()) + list(ROUTED_EXPERTS)
    return units + ["feed_forward.w1", "feed_forward.w2"] + (["feed_forward.w3"] if cfg.mlp == "gated" else [])


def _peft_target_modules(modules: list[str], cfg: ModelConfig) -> Union[list[str], str]:
    """adapter_config target_modules that make peft wrap exactly these HF modules: a list of suffixes when
    each is adapted in every layer that has it, else a regex of the full names (a routed expert's index
    optional in it, which transformers 5's fused experts leave out)."""
    if _is_gpt2(cfg):
        per_layer = _layers_of(modules, r"transformer\.h")
        present = {m: {str(i) for i in range(cfg.num_layers)} for m in _GPT2_BACK.values()}
    else:
        names = block_hf_names(cfg)
        per_layer = _layers_of([_unindexed(m, cfg) for m in modules], r"model\.layers")
        present = {}
        for i in range(cfg.num_layers):
            for unit in _layer_units(cfg, i):
                if unit in names:
                    present.setdefault(names[unit], set()).add(str(i))
    if all(layers == present.get(inner) for inner, layers in per_layer.items()):
        suffixes = set()
        for inner in per_layer:
            leaf = inner.rsplit(".", 1)[-1]
            # A bare leaf (q_proj) when it names nothing else; GPT-2's c_proj is in attn and mlp.
            same_leaf = {e for e in present if e.rsplit(".", 1)[-1] == leaf}
            suffixes.add(leaf if same_leaf <= set(per_layer) else inner)
        return sorted(suffixes)
    full = sorted({_unindexed(m, cfg) for m in modules})
    return "(" + "|".join(_routed_pattern(m, cfg) for m in full) + ")"


def _layers_of(modules: Iterable[str], layer_re: str) -> dict[str, set[str]]:
    """In-layer HF name (self_attn.q_proj) -> the layer indices it is adapted in."""
    per_layer: dict[str, set[str]] = {}
    for hf in modules:
        match = re.fullmatch(rf"{layer_re}\.(\d+)\.(.+)", hf)
        per_layer.setdefault(match.group(2), set()).add(match.group(1))
    return per_layer


def _unindexed(hf_module: str, cfg: ModelConfig) -> str:
    """An expert's linear without its index (`model.layers.1.mlp.experts.gate_proj`); others as they are."""
    routed = _routed_key(hf_module, cfg)
    if routed is None:
        return hf_module
    return f"model.layers.{routed[0].split('.')[1]}.{block_hf_names(cfg)[routed[0].split('.', 2)[2]]}"


def _routed_pattern(module: str, cfg: ModelConfig) -> str:
    """`module` as an escaped regex, with an optional expert index before a routed expert linear's name."""
    for unit in ROUTED_EXPERTS:
        experts, linear = routed_expert_names(unit.rsplit(".", 1)[1], cfg)
        if module.endswith(f".{experts}.{linear}"):
            head = module[: -len(linear) - 1]
            return f"{re.escape(head)}(?:\\.[0-9]+)?\\.{re.escape(linear)}"
    return re.escape(module)


def _adapter_config(
    target_modules: Union[list[str], str], fan_in_fan_out: bool, r: int, alpha: float, dropout: float,
    use_rslora: bool, base_model_name_or_path: Optional[str],
) -> dict:
    """adapter_config.json contents with the keys peft has read since 0.7 (newer ones take defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`, replacing an older `out` only once the new one is complete."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def save_adapter(
    state: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: Union[str, Sequence[str], None],
    out_dir: Union[str, os.PathLike[str]],
    base_model_name_or_path: Optional[str] = None,
    use_rslora: bool = False,
) -> Path:
    """Write `state` (our LoRA names -> full tensors) as a peft adapter directory (adapter_config.json +
    adapter_model.safetensors), atomically; returns the directory.

    The config's target_modules are derived from the tensors so peft wraps exactly the trained modules;
    `target_modules` (the run's setting) and the architecture fingerprint go into the file's metadata.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / ADAPTER_CONFIG).is_file():
        raise CheckpointError(f"{out} exists and is not an adapter directory; choose an empty or new directory")
    peft_state = to_peft_state(state, model_cfg)
    if not peft_state:
        raise ValueError("save_adapter got no LoRA tensors")
    modules = sorted({_parse_peft_key(k)[0] for k in peft_state})
    for module in modules:
        for kind in ("lora_A", "lora_B"):
            key = f"{PEFT_PREFIX}{module}.{kind}.weight"
            if key not in peft_state:
                raise ValueError(f"the LoRA state has no {kind} for {module}")
            expected = _expected_shape(module, kind, r, model_cfg)
            if tuple(peft_state[key].shape) != expected:
                raise ValueError(f"{key} has shape {tuple(peft_state[key].shape)}, expected {expected}")
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in peft_state.items()}
    config = _adapter_config(_peft_target_modules(modules, model_cfg), _is_gpt2(model_cfg), r, alpha, dropout,
                             use_rslora, base_model_name_or_path)
    metadata = {
        "format": "pt",
        ARCH_METADATA_KEY: json.dumps(architecture_fingerprint(model_cfg), sort_keys=True),
        "shardwise_target_modules": json.dumps(
            target_modules if target_modules is None or isinstance(target_modules, str) else list(target_modules)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        save_safetensors(tensors, tmp / ADAPTER_WEIGHTS, metadata=metadata)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _expected_shape(hf_module: str, kind: str, r: int, cfg: ModelConfig) -> tuple[int, int]:
    """peft's shape of an adapter tensor for this model: lora_A [r, in], lora_B [out, r] (an expert's own)."""
    routed = _routed_key(hf_module, cfg)
    ours = [routed[0]] if routed else our_module_names(hf_module, cfg)
    in_features = _linear_dims(ours[0], cfg)[0]
    out_features = sum(_linear_dims(name, cfg)[1] for name in ours)  # c_attn: q + k + v
    return (r, in_features) if kind == "lora_A" else (out_features, r)


@dataclass(frozen=True)
class AdapterSettings:
    """The LoRA hyper-parameters of an adapter directory."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: Union[list[str], str, None]
    base_model_name_or_path: Optional[str]

    @property
    def scaling(self) -> float:
        """The factor on B @ A."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


MAX_RANK = 1 << 16  # no adapter has a rank near this; each tensor's shape is checked against it too
_ADVICE = "fix the file or save the adapter again"


def read_adapter_config(adapter_dir: Union[str, os.PathLike[str]]) -> AdapterSettings:
    """The settings in a peft adapter_config.json, each checked for its type and range; CheckpointError
    naming the file and the field for a bad one, and for options shardwise does not support."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{path} not found: a LoRA adapter directory needs {ADAPTER_CONFIG} "
                              f"and {ADAPTER_WEIGHTS} (as peft's save_pretrained writes them)")
    cfg = read_json_object(path, CheckpointError, advice=_ADVICE)
    peft_type = str_field(cfg, "peft_type", path, CheckpointError, max_len=100, default="LORA", advice=_ADVICE)
    if peft_type != "LORA":
        raise CheckpointError(f"{path} is a {peft_type} adapter; shardwise loads LoRA adapters only")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if cfg.get(key):
            raise CheckpointError(f"{path} uses {what}, which shardwise does not support; "
                                  "train the adapter without it")
    bias = str_field(cfg, "bias", path, CheckpointError, max_len=100, default="none", advice=_ADVICE)
    if bias != "none":
        raise CheckpointError(f"{path} trains biases (bias={bias!r}); shardwise supports bias='none' only")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise CheckpointError(
            f"{path} was initialised with init_lora_weights={init[:100]!r}, which also changes the base weights; "
            "convert it to a plain LoRA adapter with peft (path_initial_model_for_weight_conversion) first"
        )
    r = int_field(cfg, "r", path, CheckpointError, lo=1, hi=MAX_RANK, advice=_ADVICE)
    alpha = number_field(cfg, "lora_alpha", path, CheckpointError, lo=0.0, hi=1e9, default=8.0, advice=_ADVICE)
    if alpha <= 0:
        fail(CheckpointError, path, f"'lora_alpha' is {alpha}, but it must be positive", _ADVICE)
    dropout = number_field(cfg, "lora_dropout", path, CheckpointError, lo=0.0, hi=1.0, default=0.0, advice=_ADVICE)
    if dropout >= 1:
        fail(CheckpointError, path, f"'lora_dropout' is {dropout}, but it must be below 1", _ADVICE)
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        fail(CheckpointError, path, f"'target_modules' is {kind_of(targets)}, not a name, a pattern or a list of "
             "names", _ADVICE)
    return AdapterSettings(
        r=r, alpha=alpha, dropout=dropout,
        use_rslora=bool_field(cfg, "use_rslora", path, CheckpointError, default=False, advice=_ADVICE),
        target_modules=targets,
        base_model_name_or_path=str_field(cfg, "base_model_name_or_path", path, CheckpointError, max_len=4096,
                                          default=None, advice=_ADVICE),
    )


def _saved_architecture(metadata: dict, path: Path) -> Optional[dict]:
    """The architecture fingerprint saved in the adapter file's metadata (None when there is none)."""
    if ARCH_METADATA_KEY not in metadata:
        return None
    saved = parse_json(metadata[ARCH_METADATA_KEY], f"{path} (its {ARCH_METADATA_KEY} entry)", CheckpointError,
                       advice="save the adapter again")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} has a {ARCH_METADATA_KEY} entry that is not a JSON object; save the "
                              "adapter again")
    return saved


def read_adapter(
    adapter_dir: Union[str, os.PathLike[str]], model_cfg: ModelConfig
) -> tuple[AdapterSettings, dict[str, torch.Tensor]]:
    """An adapter's settings and its tensors under our names (full, CPU), checked against `model_cfg`:
    CheckpointError for names that are no LoRA weight of this model (an index in other than ASCII
    digits included: nothing is dropped), layers the model lacks, tensors of the wrong shape or dtype
    (checked from the header, before any is read), incomplete pairs and a different architecture."""
    directory = Path(adapter_dir)
    settings = read_adapter_config(directory)
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        found = sorted(p.name for p in directory.glob("adapter_model*"))
        if found:
            raise CheckpointError(
                f"{directory} holds the adapter as {', '.join(found)} and no {ADAPTER_WEIGHTS}: shardwise reads "
                "adapters from safetensors only, since unpickling a .bin file can run any code in it. Convert it "
                f"once, where you trust the file, e.g. with peft: PeftModel.from_pretrained(base_model, "
                f"'{directory}').save_pretrained('OUT', safe_serialization=True), then use OUT"
            )
        raise CheckpointError(f"{path} not found")
    with open_safetensors(path) as f:
        metadata = f.metadata() or {}
        keys = list(f.keys())
        if not keys:
            raise CheckpointError(f"{path} holds no LoRA tensors")
        modules: dict[str, set[str]] = {}
        for key in keys:
            parsed = _parse_peft_key(key)
            routed = _routed_key(parsed[0], model_cfg) if parsed else None
            ours = [routed[0]] if routed else our_module_names(parsed[0], model_cfg) if parsed else None
            if ours is None:
                raise CheckpointError(
                    f"adapter tensor {key[:200]!r} in {path} is not a LoRA weight of an attention or MLP linear of a "
                    f"{model_cfg.model_type} model; shardwise supports LoRA on those linears only (or the adapter "
                    "belongs to another architecture)"
                )
            layer = int(ours[0].split(".")[1])
            if layer >= model_cfg.num_layers:
                raise CheckpointError(
                    f"adapter tensor {key} in {path} is for layer {layer}, but the model has {model_cfg.num_layers} "
                    "layers: the adapter was trained on another base model"
                )
            if parsed[1] in modules.get(parsed[0], set()):
                raise CheckpointError(f"{path} holds {parsed[1]} of {parsed[0]} twice (as {key}); save the adapter "
                                      "again")
            modules.setdefault(parsed[0], set()).add(parsed[1])
        for module, kinds in sorted(modules.items()):
            if kinds != {"lora_A", "lora_B"}:
                missing = ({"lora_A", "lora_B"} - kinds).pop()
                raise CheckpointError(f"{path} has no {missing} for {module}: the adapter file is incomplete")
        for key in keys:
            module, kind = _parse_peft_key(key)
            expected = _expected_shape(module, kind, settings.r, model_cfg)
            check_weight_dtype(f, key, path)
            shape = tuple(f.get_slice(key).get_shape())
            if shape != expected:
                raise CheckpointError(
                    f"adapter tensor {key} in {path} has shape {shape}, but this model (r={settings.r}) "
                    f"needs {expected}: the adapter was trained on another base model or with another rank"
                )
        peft_state = {key: f.get_tensor(key) for key in keys}
    saved = _saved_architecture(metadata, path)
    if saved is not None:
        current = architecture_fingerprint(model_cfg)
        diffs = [f"{k}: adapter {saved.get(k)!r}, model {current.get(k)!r}"[:200]
                 for k in sorted(set(saved) | set(current), key=str) if saved.get(k) != current.get(k)]
        if diffs:
            raise CheckpointError(
                f"the adapter in {directory} was trained on another architecture ({'; '.join(diffs[:10])}); "
                "load it onto the base model it was trained on"
            )
    return settings, from_peft_state(peft_state, model_cfg)


@torch.no_grad()
def load_adapter(model: nn.Module, adapter_dir: Union[str, os.PathLike[str]]) -> list[str]:
    """Apply the LoRA adapter of a peft-format directory (ours or peft's) to an allocated shardwise
    Transformer without LoRA, and load its weights; returns the wrapped module names (ours)."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("load_adapter needs an allocated model; allocate it (to_empty + weights) first")
    if _has_lora(model):
        raise CheckpointError("the model already has LoRA adapters; load the adapter into the base model "
                              "(or merge_lora first)")
    settings, state = read_adapter(adapter_dir, model.cfg)
    present = set(_eligible(model))  # a pipeline stage loads only the modules it holds
    modules = sorted({_split_lora_name(name)[0] for name in state} & present)
    names = _wrap(model, modules, settings.r, settings.alpha, settings.dropout, settings.use_rslora)
    for name in names:
        module = _adapter_module(model, name)
        module.lora_A.weight.copy_(state[f"{name}.lora_A.weight"])
        module.lora_B.weight.copy_(state[f"{name}.lora_B.weight"])
    return names


def _adapter_module(model: nn.Module, name: str) -> nn.Module:
    """The module holding `lora_A` and `lora_B` for one of our adapted names (a LoRALinear, or a routed
    expert weight's ExpertAdapter)."""
    if name.split(".", 2)[2] in ROUTED_EXPERTS:
        experts, _, weight = name.rpartition(".")
        return model.get_submodule(experts).lora[weight]
    return model.get_submodule(name)


__all__ = [
    "LoRALinear", "LoRAExperts", "apply_lora",
    "lora_init", "reset_lora_parameters", "lora_parameter_names", "is_lora_name",
    "lora_state_dict", "save_adapter", "load_adapter", "read_adapter", "read_adapter_config", "AdapterSettings",
    "merge_lora", "to_peft_state", "from_peft_state", "hf_module_name", "our_module_names", "select_targets",
    "architecture_fingerprint", "BLOCK_LINEARS",
]
