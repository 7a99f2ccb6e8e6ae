"""Hugging Face format in and out: config.json <-> ModelConfig, safetensors weights <-> our parameter names.

Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
MistralForCausalLM, MixtralForCausalLM, GPT2LMHeadModel. A mixture-of-experts block's experts are one
stacked parameter per projection here ([experts, out, in], `models.moe.GroupedExperts`) and one tensor per
expert in the files (`_stacked_names`): reading fills each expert's slice, writing splits them again.
Reading is tensor by tensor from memory-mapped safetensors files (one file or a sharded index), so
peak memory is the model plus one tensor. `transformers` is not needed for any of this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardwise.errors import CheckpointError, ConfigError, ShardwiseError
from shardwise.files import plain_file_name
from shardwise.models.config import MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ModelConfig
from shardwise.models.moe import reset_moe_buffers
from shardwise.models.transformer import Transformer
from shardwise.untrusted import (
    ascii_digits,
    bool_field,
    fail,
    int_field,
    kind_of,
    number_field,
    read_json_object,
    str_field,
)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Gemma3ForCausalLM": "gemma3",
    "BaiChuanForCausalLM": "baichuan",  # Baichuan-7B (RoPE); its code, not transformers', defines both
    "BaichuanForCausalLM": "baichuan",  # Baichuan-13B (ALiBi)
    "GPT2LMHeadModel": "gpt2",
}
_ARCH_BY_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
# config.json's model_type where it is not our family's name (Kimi-K2 is a DeepSeek-V3 architecture).
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}
_FAMILY_OF_MODEL_TYPE = {"gemma3_text": "gemma3", "kimi_k2": "deepseek_v3"}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3

# HF hidden_act / activation_function -> ours, and back (per family).
_ACT_FROM_HF = {
    "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "relu": "relu",
}
_ACT_TO_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
_ACT_TO_GPT2 = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# LLaMA / Qwen2 / Mistral module names inside model.layers.{i} -> ours inside layers.{i}.
LLAMA_NAMES = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
}
# A MoE block's router and experts: Qwen3-MoE's names, and Mixtral's.
_MOE_NAMES = {"qwen": {"router": "mlp.gate", "experts": "mlp.experts",
                       "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
              "mixtral": {"router": "block_sparse_moe.gate", "experts": "block_sparse_moe.experts",
                          "w1": "w1", "w3": "w3", "w2": "w2"}}
_STACKED = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w1|w2|w3)")
_LLAMA_NAMES_BACK = {v: k for k, v in LLAMA_NAMES.items()}
# Where a family's names inside model.layers.{i} differ from LLaMA's (ours -> theirs).
_SHARED_EXPERTS = {"feed_forward.shared.w1": "mlp.shared_experts.gate_proj",
                   "feed_forward.shared.w3": "mlp.shared_experts.up_proj",
                   "feed_forward.shared.w2": "mlp.shared_experts.down_proj"}
_FAMILY_NAMES = {
    "deepseek_v3": {"attention.wq": "self_attn.q_proj", "attention.wq_a": "self_attn.q_a_proj",
                    "attention.q_norm": "self_attn.q_a_layernorm", "attention.wq_b": "self_attn.q_b_proj",
                    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa", "attention.kv_norm": "self_attn.kv_a_layernorm",
                    "attention.wkv_b": "self_attn.kv_b_proj", **_SHARED_EXPERTS},
    "glm4_moe": _SHARED_EXPERTS,
    "glm4": {"attention_post_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
             "ffn_post_norm": "post_mlp_layernorm", "feed_forward.w1": "mlp.gate_up_proj",
             "feed_forward.w3": "mlp.gate_up_proj"},
    "baichuan": {"attention.wq": "self_attn.W_pack", "attention.wk": "self_attn.W_pack",
                 "attention.wv": "self_attn.W_pack"},
    "gemma3": {"attention_post_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "ffn_post_norm": "post_feedforward_layernorm"},
}
_FUSED_GATE_UP = "mlp.gate_up_proj"  # GLM-4 keeps the gated MLP's w1 and w3 in one tensor, w1's rows first
_FUSED_QKV = "self_attn.W_pack"  # Baichuan keeps q, k and v in one tensor, in that order
# The router's correction bias is a buffer here (moved by the balancing update, not by the optimizer).
_EXPERT_BIAS = re.compile(r"layers\.(\d+)\.feed_forward\.router\.expert_bias")
GPT2_NAMES = {"ln_1": "attention_norm", "ln_2": "ffn_norm", "attn.c_proj": "attention.wo",
               "mlp.c_fc": "feed_forward.w1", "mlp.c_proj": "feed_forward.w2"}
_GPT2_NAMES_BACK = {v: k for k, v in GPT2_NAMES.items()}


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


# ---------------------------------------------------------------- config ----

_CONFIG_ADVICE = "fix it or download the model again"


def _read_json(path: Path, what: str) -> dict:
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{path} not found: a Hugging Face model directory needs {what}")
    return read_json_object(path, CheckpointError, advice=_CONFIG_ADVICE)


def _names(values: list[str], limit: int = 5) -> str:
    shown = [v if len(v) <= 80 else v[:77] + "..." for v in values[:limit]]
    return ", ".join(shown) + (f" and {len(values) - limit} more" if len(values) > limit else "")


def hf_family(hf: dict, source: str | os.PathLike = "config.json") -> str:
    """Our model_type for an HF config dict; ConfigError naming the supported architectures otherwise."""
    archs = hf.get("architectures")
    if archs is None:
        archs = []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        fail(CheckpointError, source, f"'architectures' is {kind_of(archs)}, not a list of class names such as "
             '["LlamaForCausalLM"]', _CONFIG_ADVICE)
    if archs:
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad:
            raise ConfigError(
                f"unsupported architecture {_names(bad)} in {source}; supported: {_supported_list()}"
            )
        return SUPPORTED_ARCHITECTURES[archs[0]]
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type in _FAMILY_OF_MODEL_TYPE:
        return _FAMILY_OF_MODEL_TYPE[model_type]
    if isinstance(model_type, str) and model_type in _ARCH_BY_TYPE:
        return model_type
    shown = model_type if isinstance(model_type, str) and len(model_type) <= 80 else kind_of(model_type)
    raise ConfigError(
        f"{source} names no supported architecture (architectures={archs}, model_type={shown!r}); "
        f"supported: {_supported_list()}"
    )


def _activation(hf: dict, key: str, default: str, source: str | os.PathLike) -> str:
    name = str_field(hf, key, source, CheckpointError, max_len=100, default=default, advice=_CONFIG_ADVICE)
    if name not in _ACT_FROM_HF:
        raise ConfigError(f"unsupported activation {name!r} in {source}; supported: {', '.join(_ACT_FROM_HF)}")
    return _ACT_FROM_HF[name]


def _mapping(hf: dict, key: str, source: str | os.PathLike) -> dict:
    """`hf[key]` as an object ({} when absent or null)."""
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        fail(CheckpointError, source, f"{key!r} is {kind_of(value)}, not an object", _CONFIG_ADVICE)
    return value


def _rope_parameters(hf: dict, source: str | os.PathLike) -> dict:
    """The RoPE settings of config.json: transformers 5's `rope_parameters` merged over the older
    `rope_scaling`."""
    params = dict(_mapping(hf, "rope_parameters", source))
    for k, v in _mapping(hf, "rope_scaling", source).items():
        params.setdefault(k, v)
    return params


def _rope(hf: dict, source: str | os.PathLike, params: Optional[dict] = None) -> tuple[float, Optional[dict]]:
    """(rope_theta, our rope_scaling) from `params` (default the config's `_rope_parameters`) and the
    top-level `rope_theta` of older configs."""
    params = _rope_parameters(hf, source) if params is None else params
    where = f"{source} (rope_parameters / rope_scaling)"
    theta = number_field(hf, "rope_theta", source, CheckpointError, lo=1e-9, hi=1e30, default=None,
                         advice=_CONFIG_ADVICE)
    if theta is None:
        theta = number_field(params, "rope_theta", where, CheckpointError, lo=1e-9, hi=1e30, default=10000.0,
                             advice=_CONFIG_ADVICE)
    kind = params.get("rope_type") if params.get("rope_type") is not None else params.get("type")
    kind = "default" if kind is None else kind
    if not isinstance(kind, str):
        fail(CheckpointError, where, f"'rope_type' is {kind_of(kind)}, not a name", _CONFIG_ADVICE)
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3", "yarn"):
        raise ConfigError(f"unsupported RoPE scaling {kind[:80]!r} in {source}; supported: default, linear, llama3, "
                          "yarn")
    scaling: dict[str, Any] = {"type": kind, "factor": number_field(params, "factor", where, CheckpointError,
                                                                    lo=1e-9, hi=1e9, default=1.0)}
    keys = {"llama3": ("low_freq_factor", "high_freq_factor"),
            "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")}.get(kind, ())
    for key in keys:
        if params.get(key) is not None:
            scaling[key] = number_field(params, key, where, CheckpointError, lo=0.0, hi=1e9)
    if kind == "yarn" and params.get("truncate") is not None:
        scaling["truncate"] = bool_field(params, "truncate", where, CheckpointError)
    if kind != "linear" and params.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = int_field(
            params, "original_max_position_embeddings", where, CheckpointError, lo=1, hi=MAX_POSITIONS)
    return theta, scaling


def hf_to_model_config(hf: dict, source: str | os.PathLike = "config.json") -> ModelConfig:
    """A ModelConfig for an HF config dict (as in config.json, whose name `source` is): every field used
    is checked for its type and range, a CheckpointError naming the file and the field otherwise."""
    family = hf_family(hf, source)
    try:
        if family == "gpt2":
            return _gpt2_config(hf, source)
        return _llama_like_config(hf, family, source)
    except ShardwiseError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"{source} cannot be used for a {family} model: {' '.join(str(exc).split())}") \
            from None


def _size(hf: dict, key: str, source: str | os.PathLike, hi: int, default: Any = None, lo: int = 1) -> Any:
    """A size of config.json: a whole number in [lo, hi]; `default` when absent (None: required)."""
    if default is None:
        return int_field(hf, key, source, CheckpointError, lo=lo, hi=hi, advice=_CONFIG_ADVICE)
    return int_field(hf, key, source, CheckpointError, lo=lo, hi=hi, default=default, advice=_CONFIG_ADVICE)


def _flag(hf: dict, key: str, source: str | os.PathLike, default: bool) -> bool:
    return bool_field(hf, key, source, CheckpointError, default=default, advice=_CONFIG_ADVICE)


def _positive(hf: dict, key: str, source: str | os.PathLike, default: float, hi: float = 1e6) -> float:
    value = number_field(hf, key, source, CheckpointError, lo=0.0, hi=hi, default=default, advice=_CONFIG_ADVICE)
    if value <= 0:
        fail(CheckpointError, source, f"{key!r} is {value}, but it must be positive", _CONFIG_ADVICE)
    return value


def _llama_like_config(hf: dict, family: str, source: str | os.PathLike) -> ModelConfig:
    fields = _decoder_fields(hf, family, source)
    if family in ("qwen3_moe", "mixtral"):
        fields.update(_experts_config(hf, family, source))
    elif family in ("deepseek_v3", "glm4_moe"):
        fields.update(_deepseek_experts_config(hf, source))
    if family == "deepseek_v3":
        fields.update(_latent_attention_config(hf, source))
    elif family in ("glm4", "glm4_moe"):
        fields.update(_glm_config(hf, family, source))
    elif family == "gemma3":
        fields.update(_gemma3_config(hf, source))
    elif family == "baichuan":
        fields.update(_baichuan_config(hf, source))
    return ModelConfig(**fields)


def _decoder_fields(hf: dict, family: str, source: str | os.PathLike) -> dict[str, Any]:
    """The fields every RoPE family's config.json gives the same way (LLaMA's names)."""
    theta, scaling = _rope(hf, source)
    hidden = _size(hf, "hidden_size", source, MAX_WIDTH)
    heads = _size(hf, "num_attention_heads", source, MAX_HEADS)
    if family == "qwen2":
        qkv_bias, out_bias = True, False
    elif family in ("glm4", "glm4_moe"):  # attention_bias covers q/k/v; the output projection has none
        qkv_bias, out_bias = _flag(hf, "attention_bias", source, family == "glm4"), False
    else:
        qkv_bias = out_bias = _flag(hf, "attention_bias", source, False)
    max_pos = _size(hf, "max_position_embeddings", source, MAX_POSITIONS,
                    _size(hf, "model_max_length", source, MAX_POSITIONS, 4096) if family in ("llama", "baichuan")
                    else 32768)
    window = 0
    if family in ("mistral", "mixtral"):  # every block slides (Gemma 3 reads its pattern itself)
        window = int_field(hf, "sliding_window", source, CheckpointError, lo=0, hi=MAX_POSITIONS, default=0,
                           advice=_CONFIG_ADVICE) or 0
        window = window if window < max_pos else 0  # a window the context never exceeds changes nothing
    elif family != "gemma3":
        _warn_sliding_window(hf, family, source, max_pos)
    head_dim = int_field(hf, "head_dim", source, CheckpointError, lo=1, hi=MAX_WIDTH, default=0,
                         advice=_CONFIG_ADVICE) or None
    if head_dim is None and hidden % heads:
        fail(CheckpointError, source, f"'hidden_size' {hidden} is not divisible by 'num_attention_heads' {heads} "
             "and there is no 'head_dim'", _CONFIG_ADVICE)
    return dict(
        model_type=family,
        vocab_size=_size(hf, "vocab_size", source, MAX_VOCAB),
        hidden_size=hidden,
        num_layers=_size(hf, "num_hidden_layers", source, MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=_size(hf, "num_key_value_heads", source, MAX_HEADS, heads),
        head_dim=head_dim or hidden // heads,
        intermediate_size=_size(hf, "intermediate_size", source, MAX_WIDTH),
        max_position_embeddings=max_pos,
        norm="rmsnorm",
        norm_eps=_positive(hf, "rms_norm_eps", source, 1e-6, hi=1.0),
        mlp="gated",
        activation=_activation(hf, "hidden_act", "silu", source),
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=_flag(hf, "mlp_bias", source, False),
        tie_embeddings=_flag(hf, "tie_word_embeddings", source, False),
        initializer_range=_positive(hf, "initializer_range", source, 0.02),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=window,
    )


def _warn_sliding_window(hf: dict, family: str, source: str | os.PathLike, max_pos: int) -> None:
    window = int_field(hf, "sliding_window", source, CheckpointError, lo=0, default=None, advice=_CONFIG_ADVICE)
    uses_window = _flag(hf, "use_sliding_window", source, True) if family == "qwen2" else True
    if window and uses_window and window < max_pos:
        warnings.warn(
            f"config.json asks for sliding-window attention ({window} tokens), which shardwise does not "
            f"implement for {family}: attention is full causal, identical up to {window} tokens",
            stacklevel=4,
        )


def _deepseek_experts_config(hf: dict, source: str | os.PathLike) -> dict[str, Any]:
    """DeepSeek-V3's and GLM-4.5's routing: sigmoid scores, a correction bias for the choice, groups, scaling,
    shared experts, the first blocks dense."""
    scoring = str_field(hf, "scoring_func", source, CheckpointError, max_len=40, default="sigmoid",
                        advice=_CONFIG_ADVICE)
    if scoring != "sigmoid":
        raise ConfigError(f"{source}: scoring_func {scoring[:40]!r}; shardwise reads DeepSeek-V3-style routers with "
                          "sigmoid scores")
    every = _size(hf, "moe_layer_freq", source, MAX_LAYERS, 1)
    if every != 1:
        raise ConfigError(f"{source}: moe_layer_freq {every}; DeepSeek-V3 and GLM-4.5 route every block after "
                          "first_k_dense_replace, which is all shardwise reads")
    return {
        "num_experts": _size(hf, "n_routed_experts", source, MAX_WIDTH),
        "num_experts_per_tok": _size(hf, "num_experts_per_tok", source, MAX_WIDTH),
        "moe_intermediate_size": _size(hf, "moe_intermediate_size", source, MAX_WIDTH),
        "num_shared_experts": _size(hf, "n_shared_experts", source, MAX_WIDTH, 0, lo=0),
        "first_k_dense": _size(hf, "first_k_dense_replace", source, MAX_LAYERS, 0, lo=0),
        "router_score": "sigmoid",
        "router_bias": True,
        "norm_topk_prob": _flag(hf, "norm_topk_prob", source, True),
        "n_group": _size(hf, "n_group", source, MAX_WIDTH, 1),
        "topk_group": _size(hf, "topk_group", source, MAX_WIDTH, 1),
        "routed_scaling_factor": _positive(hf, "routed_scaling_factor", source, 1.0),
        "moe_aux_loss": "seq",  # DeepSeek-V3's complementary balance loss is per sequence (off unless asked)
    }


def _latent_attention_config(hf: dict, source: str | os.PathLike) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: the query head is qk_nope + qk_rope dims."""
    rope = _size(hf, "qk_rope_head_dim", source, MAX_WIDTH)
    nope = _size(hf, "qk_nope_head_dim", source, MAX_WIDTH)
    q_rank = hf.get("q_lora_rank")
    return {
        "kv_lora_rank": _size(hf, "kv_lora_rank", source, MAX_WIDTH),
        "q_lora_rank": None if q_rank is None else _size(hf, "q_lora_rank", source, MAX_WIDTH),
        "qk_rope_head_dim": rope,
        "head_dim": nope + rope,
        "v_head_dim": _size(hf, "v_head_dim", source, MAX_WIDTH),
        "rope_interleave": _flag(hf, "rope_interleave", source, True),
    }


def _glm_config(hf: dict, family: str, source: str | os.PathLike) -> dict[str, Any]:
    """GLM-4 (sandwich norms, interleaved pairs) and GLM-4.5 (halves, optional q/k norms): RoPE on the first
    partial_rotary_factor of each head."""
    params = _rope_parameters(hf, source)
    factor = number_field(hf, "partial_rotary_factor", source, CheckpointError, lo=0.0, hi=1.0, default=None,
                          advice=_CONFIG_ADVICE)
    if factor is None:
        factor = number_field(params, "partial_rotary_factor", source, CheckpointError, lo=0.0, hi=1.0,
                              default=0.5, advice=_CONFIG_ADVICE)
    if family == "glm4":
        return {"partial_rotary_factor": factor, "rope_interleave": True, "sandwich_norm": True}
    return {"partial_rotary_factor": factor, "qk_norm": _flag(hf, "use_qk_norm", source, False)}


def _gemma3_config(hf: dict, source: str | os.PathLike) -> dict[str, Any]:
    """Gemma 3's text model: sandwich norms scaling by 1 + weight, q/k norms, scaled embeddings, its own
    softmax scale, and sliding blocks with their own RoPE base between the global ones."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"{source}: {key} is set; Gemma 3 has none and shardwise implements none")
    if _flag(hf, "use_bidirectional_attention", source, False):
        raise ConfigError(f"{source}: use_bidirectional_attention is true (an encoder); shardwise trains causal "
                          "decoders only")
    params = _rope_parameters(hf, source)
    if "full_attention" in params:  # transformers 5: one set of RoPE parameters per kind of block
        theta, scaling = _rope({}, source, _mapping(params, "full_attention", source))
        local_theta, local_scaling = _rope({}, source, _mapping(params, "sliding_attention", source))
    else:  # transformers 4: rope_theta and rope_scaling for the global blocks, rope_local_base_freq
        theta, scaling = _rope(hf, source, params)
        local_theta = _positive(hf, "rope_local_base_freq", source, 10000.0, hi=1e30)
        local_scaling = None
    if local_scaling is not None:
        raise ConfigError(f"{source}: the sliding blocks' RoPE is scaled ({local_scaling['type']}); shardwise "
                          "scales the global blocks' only")
    window = _size(hf, "sliding_window", source, MAX_POSITIONS, 0, lo=0)
    layers = _size(hf, "num_hidden_layers", source, MAX_LAYERS)
    return {
        "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
        "sliding_window": window, "full_attention_every": _full_attention_every(hf, layers, source) if window else 0,
        "activation": _activation(hf, "hidden_activation", "gelu_pytorch_tanh", source),
        "attention_scale": _positive(hf, "query_pre_attn_scalar", source, 256, hi=1e9) ** -0.5,
        "qk_norm": True, "sandwich_norm": True, "norm_unit_offset": True, "scale_embeddings": True,
        "tie_embeddings": _flag(hf, "tie_word_embeddings", source, True),
    }


def _baichuan_config(hf: dict, source: str | os.PathLike) -> dict[str, Any]:
    """Baichuan-7B (BaiChuanForCausalLM: RoPE) or Baichuan-13B (BaichuanForCausalLM: ALiBi, unless 4096 wide,
    the rule of Baichuan's own code); Baichuan 2's normalised output head is refused."""
    if "z_loss_weight" in hf or _size(hf, "vocab_size", source, MAX_VOCAB) == 125696:
        raise ConfigError(f"{source} is a Baichuan 2 model, whose output head normalises its weights (NormHead); "
                          "shardwise reads Baichuan-7B and Baichuan-13B only")
    archs = hf.get("architectures") or []
    rope = "BaiChuanForCausalLM" in archs or _size(hf, "hidden_size", source, MAX_WIDTH) == 4096
    return {"position": "rope" if rope else "alibi"}


def _full_attention_every(hf: dict, layers: int, source: str | os.PathLike) -> int:
    """Gemma 3's layer_types as `full_attention_every`: every n-th block full, the others sliding (0: all slide)."""
    types = hf.get("layer_types")
    if types is None:
        return _size(hf, "sliding_window_pattern", source, MAX_LAYERS, 6)
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        fail(CheckpointError, source, f"'layer_types' should list 'sliding_attention' or 'full_attention' for each "
             f"of the {layers} layers", _CONFIG_ADVICE)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else 0
    if [i for i in range(layers) if every and (i + 1) % every == 0] != full:
        raise ConfigError(f"{source}: layer_types puts full attention in blocks {_names([str(i) for i in full])}; "
                          "shardwise reads every n-th block full (Gemma 3's pattern)")
    return every


def _experts_config(hf: dict, family: str, source: str | os.PathLike) -> dict[str, Any]:
    """The mixture-of-experts fields of Qwen3-MoE's and Mixtral's config.json (transformers 5 writes the
    expert count as num_local_experts for both; Qwen's own files say num_experts)."""
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    out: dict[str, Any] = {
        "num_experts": _size(hf, key, source, MAX_WIDTH),
        "num_experts_per_tok": _size(hf, "num_experts_per_tok", source, MAX_WIDTH),
        "moe_aux_loss": "batch",  # transformers' load_balancing_loss_func: over the batch
        # transformers adds the auxiliary loss only when output_router_logits is set
        "moe_aux_loss_coef": number_field(hf, "router_aux_loss_coef", source, CheckpointError, lo=0.0, hi=1e3,
                                          default=0.0, advice=_CONFIG_ADVICE)
        if _flag(hf, "output_router_logits", source, False) else 0.0,
    }
    if family == "mixtral":
        out["moe_intermediate_size"] = _size(hf, "intermediate_size", source, MAX_WIDTH)
        return out
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        fail(CheckpointError, source, f"'mlp_only_layers' is {kind_of(dense)}, not a list of layer numbers",
             _CONFIG_ADVICE)
    out.update(moe_intermediate_size=_size(hf, "moe_intermediate_size", source, MAX_WIDTH),
               norm_topk_prob=_flag(hf, "norm_topk_prob", source, False),
               moe_every=_size(hf, "decoder_sparse_step", source, MAX_LAYERS, 1), dense_layers=dense)
    return out


def _gpt2_config(hf: dict, source: str | os.PathLike) -> ModelConfig:
    if _flag(hf, "scale_attn_by_inverse_layer_idx", source, False) or _flag(hf, "reorder_and_upcast_attn",
                                                                           source, False):
        raise ConfigError("GPT-2 configs with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn "
                          "are not supported")
    if _flag(hf, "scale_attn_weights", source, True) is False:
        raise ConfigError("GPT-2 configs with scale_attn_weights=false are not supported")
    hidden = _size(hf, "n_embd", source, MAX_WIDTH, 768)
    heads = _size(hf, "n_head", source, MAX_HEADS, 12)
    if hidden % heads:
        fail(CheckpointError, source, f"'n_embd' {hidden} is not divisible by 'n_head' {heads}", _CONFIG_ADVICE)
    return ModelConfig(
        model_type="gpt2",
        vocab_size=_size(hf, "vocab_size", source, MAX_VOCAB, 50257),
        hidden_size=hidden,
        num_layers=_size(hf, "n_layer", source, MAX_LAYERS, 12),
        num_heads=heads,
        intermediate_size=_size(hf, "n_inner", source, MAX_WIDTH, 4 * hidden),
        max_position_embeddings=_size(hf, "n_positions", source, MAX_POSITIONS, 1024),
        norm="layernorm",
        norm_eps=_positive(hf, "layer_norm_epsilon", source, 1e-5, hi=1.0),
        mlp="plain",
        activation=_activation(hf, "activation_function", "gelu_new", source),
        position="learned",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        norm_bias=True,
        tie_embeddings=_flag(hf, "tie_word_embeddings", source, True),
        initializer_range=_positive(hf, "initializer_range", source, 0.02),
    )


def load_hf_config(directory: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory (its config.json)."""
    path = Path(directory) / "config.json"
    return hf_to_model_config(_read_json(path, "config.json"), path)


def model_config_to_hf(cfg: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
    """config.json contents for `cfg`; ConfigError when no supported HF architecture expresses it."""
    family = _export_family(cfg)
    arch = _ARCH_BY_TYPE[family] if family != "baichuan" else \
        "BaichuanForCausalLM" if cfg.position == "alibi" else "BaiChuanForCausalLM"
    hf: dict[str, Any] = {"architectures": [arch], "model_type": _HF_MODEL_TYPE.get(family, family)}
    if family == "gpt2":
        hf.update(
            vocab_size=cfg.vocab_size, n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
            n_inner=cfg.intermediate_size, n_positions=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.norm_eps, activation_function=_ACT_TO_GPT2[cfg.activation],
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            scale_attn_weights=True, tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.initializer_range,
        )
    else:
        rope = _rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
        if cfg.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        hf.update(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
            hidden_act=_ACT_TO_HF[cfg.activation], tie_word_embeddings=cfg.tie_embeddings,
            attention_dropout=cfg.dropout, initializer_range=cfg.initializer_range,
            # transformers >= 5 reads rope_parameters; older versions read rope_theta / rope_scaling.
            rope_parameters=rope, rope_theta=cfg.rope_theta,
            rope_scaling=None if cfg.rope_scaling is None else {**rope, "type": rope["rope_type"]},
        )
        if family == "llama":
            hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
        elif family in ("mistral", "mixtral"):
            hf.update(sliding_window=cfg.sliding_window or None)
        elif family in ("qwen2", "qwen3", "qwen3_moe"):
            hf.update(use_sliding_window=False, sliding_window=None)
        if family in ("qwen3", "qwen3_moe"):
            hf.update(attention_bias=cfg.qkv_bias)
        if family in ("qwen3_moe", "mixtral"):
            hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                      router_aux_loss_coef=cfg.moe_aux_loss_coef, output_router_logits=cfg.moe_aux_loss_coef > 0)
        if family == "qwen3_moe":
            hf.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                      norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.moe_every,
                      mlp_only_layers=list(cfg.dense_layers))
        elif family == "mixtral":
            hf.update(intermediate_size=cfg.moe_intermediate_size)
        hf.update(_family_config_to_hf(cfg, family, rope))
        if family == "baichuan":  # its code has RoPE base 10000 and head_dim hidden / heads built in
            for key in ("rope_parameters", "rope_theta", "rope_scaling", "head_dim"):
                hf.pop(key)
    if dtype is not None:
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    return hf


def _rope_to_hf(theta: float, s: Optional[Any]) -> dict[str, Any]:
    """transformers' rope_parameters for a base and our scaling."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if s is not None:
        rope.update(rope_type=s.type, factor=s.factor)
        if s.type == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
        elif s.type == "yarn":
            rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate,
                        original_max_position_embeddings=s.original_max_position_embeddings,
                        **{k: getattr(s, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                           if getattr(s, k) is not None})
    return rope


def _family_config_to_hf(cfg: ModelConfig, family: str, rope: dict[str, Any]) -> dict[str, Any]:
    """config.json keys of DeepSeek-V3, GLM-4, GLM-4.5 and Gemma 3 beyond LLaMA's."""
    # Their config classes default to the published tokenizers' ids, which a smaller vocabulary may not hold
    # (save_hf writes the tokenizer's own ids over these).
    hf: dict[str, Any] = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if family in ("deepseek_v3", "glm4_moe"):
        hf.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                  moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=cfg.num_shared_experts,
                  first_k_dense_replace=cfg.first_k_dense, n_group=cfg.n_group, topk_group=cfg.topk_group,
                  norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
                  num_nextn_predict_layers=0, attention_bias=cfg.qkv_bias)
    if family == "deepseek_v3":
        hf.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                  qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                  rope_interleave=cfg.rope_interleave, head_dim=cfg.qk_rope_head_dim)
    elif family == "glm4_moe":
        hf.update(use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor)
    elif family == "glm4":
        hf.update(attention_bias=cfg.qkv_bias, partial_rotary_factor=cfg.partial_rotary_factor)
    elif family == "baichuan":  # Baichuan's own code reads model_max_length (13B) or max_position_embeddings (7B)
        hf.update(model_max_length=cfg.max_position_embeddings)
    elif family == "gemma3":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        types = ["sliding_attention" if cfg.is_sliding_layer(i) else "full_attention" for i in range(cfg.num_layers)]
        hf.update(rope_parameters={"full_attention": rope, "sliding_attention": local}, rope_theta=None,
                  rope_scaling=None, layer_types=types, sliding_window=cfg.sliding_window or None,
                  hidden_activation=_ACT_TO_HF[cfg.activation], query_pre_attn_scalar=round(_gemma_scalar(cfg)),
                  attention_bias=cfg.qkv_bias, attn_logit_softcapping=None, final_logit_softcapping=None)
    return hf


def _gemma_scalar(cfg: ModelConfig) -> float:
    """Gemma's query_pre_attn_scalar (a whole number in its config): the softmax scale is its inverse square root."""
    return (cfg.attention_scale or cfg.head_dim ** -0.5) ** -2


# Flags only some families have (a family missing here has none of them), and the value each flag must
# have where that family leaves no choice.
_FEATURES = {
    "qk_norm": ("qwen3", "qwen3_moe", "glm4_moe", "gemma3"),
    "partial_rotary_factor": ("glm4", "glm4_moe"),
    "rope_interleave": ("glm4", "deepseek_v3"),
    "sandwich_norm": ("glm4", "gemma3"),
    "norm_unit_offset": ("gemma3",),
    "scale_embeddings": ("gemma3",),
    "attention_scale": ("gemma3",),
    "sliding_window": ("gemma3", "mistral", "mixtral"),
    "full_attention_every": ("gemma3",),
    "rope_local_theta": ("gemma3",),
    "latent_attention": ("deepseek_v3",),
}
_FIXED = {"glm4": {"rope_interleave": True, "sandwich_norm": True},
          "gemma3": {"qk_norm": True, "sandwich_norm": True, "norm_unit_offset": True, "scale_embeddings": True},
          "qwen3": {"qk_norm": True}, "qwen3_moe": {"qk_norm": True}, "deepseek_v3": {"latent_attention": True}}
_OFF = {"qk_norm": False, "partial_rotary_factor": 1.0, "rope_interleave": False, "sandwich_norm": False,
        "norm_unit_offset": False, "scale_embeddings": False, "attention_scale": None, "sliding_window": 0,
        "full_attention_every": 0,
        "rope_local_theta": None, "latent_attention": False}


def _check_features(cfg: ModelConfig, family: str, need: Callable[[bool, str, str], None]) -> None:
    """Every family-specific flag of `cfg` is one `family` has, with the value it fixes."""
    for flag, families in _FEATURES.items():
        value = getattr(cfg, flag)
        if family not in families:
            need(value == _OFF[flag], f"it has no {flag} (this model's is {value})", family)
        elif flag in _FIXED.get(family, {}):
            need(value == _FIXED[family][flag], f"its {flag} is {_FIXED[family][flag]}", family)


def _family_by_features(cfg: ModelConfig) -> Optional[str]:
    """The family a config's distinctive flags point to (None: a LLaMA-shaped one)."""
    if cfg.latent_attention:
        return "deepseek_v3"
    if cfg.norm_unit_offset or cfg.scale_embeddings:
        return "gemma3"
    if cfg.sandwich_norm:
        return "glm4"
    if cfg.num_experts and (cfg.router_score == "sigmoid" or cfg.partial_rotary_factor != 1.0):
        return "glm4_moe"
    return None


def _export_family(cfg: ModelConfig) -> str:
    """Which HF architecture can hold this config, checking every flag it fixes."""
    def need(ok: bool, what: str, family: str) -> None:
        if not ok:
            raise ConfigError(f"this model cannot be exported as {_ARCH_BY_TYPE[family]}: {what}")

    if cfg.position == "alibi" or cfg.model_type == "baichuan":
        family = "baichuan"
        _check_features(cfg, family, need)
        need(cfg.norm == "rmsnorm" and cfg.mlp == "gated" and not (cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias)
             and not cfg.num_experts and cfg.num_kv_heads == cfg.num_heads and cfg.rope_scaling is None
             and cfg.rope_theta == 10000.0 and cfg.head_dim * cfg.num_heads == cfg.hidden_size,
             "it needs RMSNorm, a gated MLP, no biases, no experts, full heads and plain RoPE", family)
        need(cfg.position != "learned" and not (cfg.position == "alibi" and cfg.hidden_size == 4096),
             "Baichuan's code takes a 4096-wide BaichuanForCausalLM for RoPE, not ALiBi", family)
        return family
    if cfg.position == "learned":
        need(cfg.norm == "layernorm" and cfg.norm_bias, "GPT-2 needs LayerNorm with bias", "gpt2")
        need(cfg.mlp == "plain", "GPT-2 needs a plain MLP", "gpt2")
        need(cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias, "GPT-2 needs every linear bias", "gpt2")
        need(cfg.head_dim * cfg.num_heads == cfg.hidden_size, "GPT-2 needs head_dim * heads == hidden", "gpt2")
        need(cfg.num_kv_heads == cfg.num_heads, "GPT-2 has no grouped-query attention", "gpt2")
        return "gpt2"
    family = _family_by_features(cfg)
    if family is not None:
        _check_features(cfg, family, need)
        need(cfg.norm == "rmsnorm" and cfg.mlp == "gated" and not cfg.mlp_bias, "it needs RMSNorm and a gated "
             "MLP without biases", family)
        need(not cfg.out_bias or family in ("deepseek_v3", "gemma3"), "its output projection has no bias", family)
        if family in ("deepseek_v3", "glm4_moe"):
            need(cfg.num_experts > 0 and cfg.router_score == "sigmoid" and cfg.router_bias and cfg.moe_every == 1
                 and not cfg.dense_layers and cfg.num_shared_experts > 0, "its router scores by sigmoid with a "
                 "correction bias and shared experts in every block after first_k_dense", family)
            need(cfg.num_kv_heads == cfg.num_heads or family == "glm4_moe", "it has no grouped-query heads", family)
        else:
            need(not cfg.num_experts, "it has no experts", family)
        if family == "gemma3":
            scalar = _gemma_scalar(cfg)
            need(abs(scalar - round(scalar)) < 1e-6 * scalar, "its attention_scale is 1/sqrt(n) for a whole n "
                 "(query_pre_attn_scalar)", family)
        return family
    if cfg.num_experts:
        _check_features(cfg, "qwen3_moe" if cfg.qk_norm else "mixtral", need)
        return _export_moe_family(cfg, need)
    family = cfg.model_type if cfg.model_type in ("llama", "qwen2", "qwen3", "mistral") else "llama"
    if family == "llama" and cfg.qk_norm:
        family = "qwen3"
    if family == "llama" and cfg.qkv_bias and not cfg.out_bias:
        family = "qwen2"
    need(cfg.norm == "rmsnorm", "it needs RMSNorm", family)
    need(cfg.mlp == "gated", "it needs a gated MLP", family)
    _check_features(cfg, family, need)
    if family == "qwen3":
        need(cfg.qkv_bias == cfg.out_bias and not cfg.mlp_bias, "Qwen3's attention_bias covers q/k/v and o",
             family)
        return family
    if family == "qwen2":
        need(cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias, "Qwen2 has biases on q/k/v only", family)
    elif family == "mistral":
        need(not (cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias), "Mistral has no biases", family)
    else:
        need(cfg.qkv_bias == cfg.out_bias, "LLaMA's attention_bias covers q/k/v and o together", family)
    return family


def _export_moe_family(cfg: ModelConfig, need: Callable[[bool, str, str], None]) -> str:
    """Qwen3-MoE (queries and keys normalised) or Mixtral, checking the routing each of them fixes."""
    family = "qwen3_moe" if cfg.qk_norm else "mixtral"
    need(cfg.norm == "rmsnorm" and not (cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias),
         "it needs RMSNorm and no biases", family)
    need(cfg.router_score == "softmax" and not cfg.router_bias and cfg.n_group == 1
         and cfg.routed_scaling_factor == 1.0 and not cfg.num_shared_experts,
         "its router is a softmax over the experts, with no bias, groups, scaling or shared experts", family)
    if family == "mixtral":
        need(cfg.norm_topk_prob and cfg.first_k_dense == 0 and not cfg.dense_layers and cfg.moe_every == 1,
             "Mixtral routes every block and normalises the chosen weights", family)
    else:
        need(cfg.first_k_dense == 0, "Qwen3-MoE names its dense blocks in mlp_only_layers, not first_k_dense",
             family)
    return family


def _moe_names(cfg: ModelConfig) -> dict[str, str]:
    """The HF names of a MoE block's router and experts for the model's family."""
    return _MOE_NAMES["mixtral" if cfg.model_type == "mixtral" or
                      (cfg.model_type not in ("qwen3_moe", "deepseek_v3", "glm4_moe") and not cfg.qk_norm) else "qwen"]


def _stacked_names(ours: str, cfg: ModelConfig) -> Optional[list[str]]:
    """For a stacked expert parameter (`layers.{i}.feed_forward.experts.w1|w2|w3`), the HF tensor of each
    expert in order; None for any other parameter."""
    match = _STACKED.fullmatch(ours)
    if match is None:
        return None
    idx, w = match.groups()
    names = _moe_names(cfg)
    return [f"model.layers.{idx}.{names['experts']}.{j}.{names[w]}.weight" for j in range(cfg.num_experts)]


def routed_expert_names(weight: str, cfg: ModelConfig) -> tuple[str, str]:
    """(the experts' module inside a layer, each expert's linear) for our stacked `weight` ("w1", "w3" or
    "w2"), named as the family the model exports as: ("mlp.experts", "gate_proj"), Mixtral's
    ("block_sparse_moe.experts", "w1"); expert j's linear is `{experts}.{j}.{linear}`."""
    names = _moe_names(_as_exported(cfg))
    return names["experts"], names[weight]


def _hf_module(module: str, cfg: ModelConfig) -> str:
    """The HF module name inside a layer for our `module` inside a block."""
    if module == "feed_forward.router.gate":
        return _moe_names(cfg)["router"]
    return _FAMILY_NAMES.get(cfg.model_type, {}).get(module) or _LLAMA_NAMES_BACK[module]


def _as_exported(cfg: ModelConfig) -> ModelConfig:
    """`cfg` under the family it exports as (its own model_type when it exports as none)."""
    try:
        family = _export_family(cfg)
    except ConfigError:
        family = cfg.model_type
    return cfg.model_copy(update={"model_type": family})


def hf_layer_modules(modules: Iterable[str], cfg: ModelConfig) -> dict[str, str]:
    """Our `modules` of a block (`attention.wq_a`...) -> the HF module inside model.layers.{i} that holds each
    (`self_attn.q_a_proj`), named as the family the model exports as; modules it has no name for are left out.
    Modules that share one HF tensor (GLM-4's gate_up_proj, Baichuan's W_pack) map to the same name."""
    named = _as_exported(cfg)
    family = named.model_type
    out = {}
    for module in modules:
        theirs = _moe_names(named)["router"] if module == "feed_forward.router.gate" else \
            _FAMILY_NAMES.get(family, {}).get(module) or _LLAMA_NAMES_BACK.get(module)
        if theirs is not None:
            out[module] = theirs
    return out


def _hf_names(ours: str, cfg: ModelConfig) -> list[str]:
    """Every HF tensor our parameter `ours` is read from."""
    return _stacked_names(ours, cfg) or [hf_tensor_for(ours, cfg)[0]]


def hf_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a Hugging Face directory holds beside the parameters: the routers' correction biases of
    a model whose router has one (DeepSeek-V3, GLM-4.5)."""
    cfg = model.cfg
    if not cfg.router_bias:
        return []
    return [(n, b) for n, b in model.named_buffers() if _EXPERT_BIAS.fullmatch(n)]


# ------------------------------------------------------------- name maps ----

def _ours_to_hf(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for the model's weights, produced one at a time."""
    cfg = model.cfg
    params = dict(model.named_parameters())  # tied weights appear once, as tok_embeddings.weight
    if cfg.position == "learned":
        yield "transformer.wte.weight", params["tok_embeddings.weight"]
        yield "transformer.wpe.weight", params["pos_embeddings.weight"]
        for i in model.layers:
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                qkv = torch.cat([params[f"{p}attention.{w}.{kind}"] for w in ("wq", "wk", "wv")], dim=0)
                yield f"transformer.h.{i}.attn.c_attn.{kind}", qkv.t() if kind == "weight" else qkv
            for ours, theirs in _GPT2_NAMES_BACK.items():
                for kind in ("weight", "bias"):
                    t = params.get(f"{p}{ours}.{kind}")
                    if t is not None:
                        conv = theirs.startswith(("attn", "mlp")) and kind == "weight"
                        yield f"transformer.h.{i}.{theirs}.{kind}", t.t() if conv else t
        for kind in ("weight", "bias"):
            if f"norm.{kind}" in params:
                yield f"transformer.ln_f.{kind}", params[f"norm.{kind}"]
    else:
        yield "model.embed_tokens.weight", params["tok_embeddings.weight"]
        named = cfg.model_copy(update={"model_type": _export_family(cfg)})  # the names of the family written
        for name, t in [*params.items(), *hf_buffers(model)]:
            if not name.startswith("layers."):
                continue
            experts = _stacked_names(name, named)
            if experts is not None:
                yield from zip(experts, t.unbind(0))
                continue
            theirs, split = hf_tensor_for(name, named)
            if split is None:
                yield theirs, t
            elif name.endswith("feed_forward.w1.weight"):  # GLM-4's fused tensor: w1's rows, then w3's
                yield theirs, torch.cat([t, params[name.replace(".w1.", ".w3.")]])
            elif name.endswith("attention.wq.weight"):  # Baichuan's W_pack: q, k, v
                yield theirs, torch.cat([t, params[name.replace(".wq.", ".wk.")], params[name.replace(".wq.", ".wv.")]])
        yield "model.norm.weight", params["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", params["output.weight"]


# --------------------------------------------------------------- weights ----

def _weight_files(directory: Path) -> list[tuple[Path, Optional[list[str]]]]:
    """The safetensors files to read, each with the names the index assigns it (None: all of them)."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not _is_safetensors_name(file):
                raise CheckpointError(
                    f"{index} maps {name} to {file!r}, which is not a .safetensors file name inside {directory}; "
                    "shardwise reads the weights of a Hugging Face directory from its own safetensors files only"
                )
            by_file.setdefault(file, []).append(name)
        missing = [f for f in sorted(by_file) if not (directory / f).is_file()]
        if missing:
            raise CheckpointError(
                f"shard file(s) {', '.join(missing)} listed in {index} are missing from {directory}; "
                "download the complete model"
            )
        return [(directory / f, names) for f, names in sorted(by_file.items())]
    single = directory / SINGLE_FILE
    if single.is_file():
        return [(single, None)]
    pickled = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
    if pickled:
        raise CheckpointError(
            f"{directory} holds its weights as {', '.join(pickled)}, a pickle, and no {SINGLE_FILE}: shardwise "
            "reads Hugging Face weights from safetensors only, since unpickling a file can run any code in it. "
            "Convert it once, where you trust the file, e.g. with transformers: "
            f"AutoModelForCausalLM.from_pretrained('{directory}').save_pretrained('OUT', safe_serialization=True), "
            "then use OUT (with the tokenizer files copied beside it)"
        )
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")


def _is_safetensors_name(name: object) -> bool:
    """A plain .safetensors file name: an index naming a path (`../x`, `/abs`, `sub/x`) is refused."""
    return plain_file_name(name) and name.endswith(".safetensors")


def _short(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def hf_tensor_for(name: str, cfg: ModelConfig) -> tuple[str, Optional[Callable[[torch.Tensor], torch.Tensor]]]:
    """The HF tensor that holds our parameter `name`, and how to turn it into ours (None: as stored).

    A tied output projection reads the embedding matrix (a pipeline's last stage holds a copy of it).
    """
    if cfg.position == "learned":
        return _gpt2_tensor_for(name, cfg)
    if name == "tok_embeddings.weight" or (name == "output.weight" and cfg.tie_embeddings):
        return "model.embed_tokens.weight", None
    if name == "norm.weight":
        return "model.norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    _, idx, rest = name.split(".", 2)
    if _EXPERT_BIAS.fullmatch(name):
        return f"model.layers.{idx}.{_moe_names(cfg)['router']}.e_score_correction_bias", None
    module, _, kind = rest.rpartition(".")
    theirs = f"model.layers.{idx}.{_hf_module(module, cfg)}.{kind}"
    if theirs.endswith(f"{_FUSED_GATE_UP}.weight"):
        width = cfg.intermediate_size
        return theirs, (lambda t: t[:width]) if module == "feed_forward.w1" else (lambda t: t[width:])
    if theirs.endswith(f"{_FUSED_QKV}.weight"):
        rows = cfg.num_heads * cfg.head_dim
        which = ("attention.wq", "attention.wk", "attention.wv").index(module)
        return theirs, lambda t: t[which * rows:(which + 1) * rows]
    return theirs, None


def _gpt2_tensor_for(name: str, cfg: ModelConfig) -> tuple[str, Optional[Callable[[torch.Tensor], torch.Tensor]]]:
    if name == "tok_embeddings.weight" or (name == "output.weight" and cfg.tie_embeddings):
        return "transformer.wte.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    if name == "pos_embeddings.weight":
        return "transformer.wpe.weight", None
    if name.startswith("norm."):
        return f"transformer.ln_f.{name.rsplit('.', 1)[1]}", None
    _, idx, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    prefix = f"transformer.h.{idx}"
    if module in ("attention.wq", "attention.wk", "attention.wv"):
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        which = ("attention.wq", "attention.wk", "attention.wv").index(module)

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.shape[-1] != q_dim + 2 * kv_dim:
                raise CheckpointError(f"tensor {prefix}.attn.c_attn.{kind} has shape {tuple(t.shape)}, expected "
                                      f"last dimension {q_dim + 2 * kv_dim} (q, k, v)")
            chunk = t.split([q_dim, kv_dim, kv_dim], dim=-1)[which]
            return chunk.t() if kind == "weight" else chunk  # Conv1D stores [in, out]
        return f"{prefix}.attn.c_attn.{kind}", take
    theirs = _GPT2_NAMES_BACK[module]
    conv = theirs.startswith(("attn", "mlp")) and kind == "weight"
    return f"{prefix}.{theirs}.{kind}", (lambda t: t.t()) if conv else None


def _skippable(hf_name: str) -> bool:
    """Buffers old checkpoints saved (RoPE frequencies, GPT-2's causal masks): rebuilt, never read."""
    return hf_name.endswith(("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias"))


def _local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's piece of `param` (its local tensor) and where that piece sits in the full tensor."""

    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's piece of the full value `full` into `param` (a plain tensor or a DTensor shard)."""
    local, region = _local_region(param)
    local.copy_(full[region])


def open_safetensors(path: Path) -> Any:
    """safe_open of a weights file, a CheckpointError naming it when it is not valid safetensors."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); download or save it again") from None


@contextlib.contextmanager
def _open_weights(directory: Path, cfg: ModelConfig) -> Iterator[dict[str, tuple[Any, Path]]]:
    """HF tensor name -> (open safetensors file, its path), after checking that the files hold exactly
    the weights of a `cfg` model (a missing shard file, unknown tensors and missing weights fail)."""
    with contextlib.ExitStack() as stack:
        handles: dict[str, tuple[Any, Path]] = {}
        for path, names in _weight_files(directory):
            f = stack.enter_context(open_safetensors(path))
            keys = list(f.keys())
            held = set(keys)
            absent = [n for n in names or () if n not in held]
            if absent:
                raise CheckpointError(f"{directory / INDEX_FILE} places {_short(absent)} in {path}, which does not "
                                      "hold it; download the complete model again")
            for hf_name in names if names is not None else keys:
                handles[hf_name] = (f, path)
        if cfg.position == "learned" and "wte.weight" in handles:  # the original gpt2 files: no prefix
            handles = {k if k.startswith(("transformer.", "lm_head")) else f"transformer.{k}": v
                       for k, v in handles.items()}
        handles = _without_prediction_layers(handles, cfg, directory)
        _check_layer_count(handles, cfg, directory)  # before a model of cfg's size is built, even on meta
        every_name = _parameter_names(cfg)
        expected = {hf for n in every_name for hf in _hf_names(n, cfg)}
        unexpected = [k for k in handles if k not in expected and not _skippable(k)
                      and not (k == "lm_head.weight" and cfg.tie_embeddings)]
        if unexpected:
            raise CheckpointError(
                f"{len(unexpected)} tensor(s) in {directory} do not belong to a {cfg.model_type} model with this "
                f"config: {_short(unexpected)}"
            )
        missing = [hf for n in every_name for hf in _hf_names(n, cfg) if hf not in handles]
        if missing:
            raise CheckpointError(f"{len(missing)} weight(s) missing from {directory}: {_short(missing)}")
        yield handles


_HF_LAYER = re.compile(r"(?:model\.layers|transformer\.h)\.([^.]+)\.")
_OUR_LAYER = re.compile(r"layers\.([^.]+)\.")


def _layer_index(pattern: re.Pattern, name: str) -> Optional[int]:
    """The layer a tensor name is in (ASCII digits only: int() also reads '٣'), None for no layer."""
    match = pattern.match(name)
    return int(match.group(1)) if match and ascii_digits(match.group(1)) else None


def _without_prediction_layers(handles: dict[str, Any], cfg: ModelConfig, directory: Path) -> dict[str, Any]:
    """`handles` without the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 ship after the last
    block (config.json's num_nextn_predict_layers: model.layers.{L}... ), with a warning saying so:
    shardwise trains next-token prediction only, as transformers runs these models."""
    if cfg.model_type not in ("deepseek_v3", "glm4_moe"):
        return handles
    hf = _read_json(directory / "config.json", "config.json")
    extra = _size(hf, "num_nextn_predict_layers", directory / "config.json", MAX_LAYERS, 0, lo=0)
    skipped = [n for n in handles
               if (i := _layer_index(_HF_LAYER, n)) is not None and cfg.num_layers <= i < cfg.num_layers + extra]
    if skipped:
        warnings.warn(f"{directory}: skipping the {extra} multi-token-prediction layer(s) after block "
                      f"{cfg.num_layers - 1} ({len(skipped)} tensors, model.layers.{cfg.num_layers}.*): shardwise "
                      "trains and exports next-token prediction only", stacklevel=4)
    dropped = set(skipped)
    return {n: h for n, h in handles.items() if n not in dropped}


def _check_layer_count(handles: dict[str, Any], cfg: ModelConfig, directory: Path) -> None:
    """config.json's layer count against the layers the weight files hold (the highest index + 1)."""
    layers: dict[int, list[str]] = {}
    for name in handles:
        index = _layer_index(_HF_LAYER, name)
        if index is not None:
            layers.setdefault(index, []).append(name)
    present = max(layers) + 1 if layers else 0
    said = f"config.json says {cfg.num_layers} layers, the weights hold {present}"
    if cfg.num_layers < present:
        extra = [n for i in sorted(layers) if i >= cfg.num_layers for n in sorted(layers[i])]
        raise CheckpointError(f"{len(extra)} tensor(s) in {directory} do not belong to a {cfg.model_type} model "
                              f"with this config: {_short(extra)} ({said})")
    if cfg.num_layers > present:
        one = [n for n in _parameter_names(cfg.model_copy(update={"num_layers": 1})) if n.startswith("layers.0.")]
        missing = [n.replace("layers.0.", f"layers.{present}.", 1) for n in one]
        raise CheckpointError(f"{len(one) * (cfg.num_layers - present)} weight(s) missing from {directory}: "
                              f"{_short(missing)} ({said})")


def check_saved_shapes(cfg: ModelConfig, saved: dict[str, Any], source: str | os.PathLike,
                       lora_r: Optional[int] = None) -> None:
    """A model config (a checkpoint's config.yaml) against the shapes its weight files hold, under our
    parameter names (`saved`: name -> shape), before anything is allocated: the layer count first (so
    that not even a model on the meta device is built for a config that claims a billion layers), then
    every parameter's shape, and LoRA's rank (`lora_r`) against the saved lora_A. CheckpointError naming
    `source` otherwise."""
    def refuse(problem: str) -> None:
        fail(CheckpointError, source, problem, "its config.yaml does not describe the weights it holds: the "
             "checkpoint is damaged, or the config was edited")

    if cfg.position == "rope" and cfg.max_position_embeddings > MAX_POSITIONS:
        refuse(f"model.max_position_embeddings is {cfg.max_position_embeddings:,}, more than the "
               f"{MAX_POSITIONS:,} shardwise builds RoPE tables for")
    indices = {_layer_index(_OUR_LAYER, name) for name in saved} - {None}
    present = max(indices) + 1 if indices else 0
    if cfg.num_layers != present:
        refuse(f"model.num_layers is {cfg.num_layers:,}, but the weights hold {present} layers")
    for name, shape in _parameter_names(cfg).items():
        if name not in saved:
            refuse(f"the model has a weight {name}, which the checkpoint does not hold")
        if tuple(saved[name]) != shape:
            refuse(f"the weight {name} has shape {tuple(saved[name])} in the checkpoint, but the model section "
                   f"gives {shape}")
    if lora_r is not None:
        for name, shape in saved.items():
            if ".lora_A." in name and (len(shape) != 2 or shape[0] != lora_r):
                refuse(f"the adapter {name} has shape {tuple(shape)}, but lora.r is {lora_r:,}")


def _parameter_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names (a tied matrix once) and the buffers HF files hold (`hf_buffers`), with their
    shapes for `cfg`, from a meta-device model."""
    with torch.device("meta"):
        model = Transformer(cfg)
        return {n: tuple(p.shape) for n, p in [*model.named_parameters(), *hf_buffers(model)]}


# The dtypes weights are stored in that torch reads and converts exactly (not F4 or F6, whose slices torch
# cannot take, nor integers, booleans or complex numbers, which are no weights).
WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def check_weight_dtype(f: Any, name: str, path: Path) -> None:
    """CheckpointError naming the tensor and file when its stored dtype is no weight dtype (from the header)."""
    dtype = f.get_slice(name).get_dtype()
    if dtype not in WEIGHT_DTYPES:
        raise CheckpointError(f"{path}: the tensor {name} is stored as {dtype}, not as floating-point weights "
                              f"({', '.join(WEIGHT_DTYPES)}); save the weights again")


def _check_shapes(handles: dict[str, tuple[Any, Path]], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    """Every tensor as stored (after its conversion to our layout) must have our parameter's shape, in a
    floating-point dtype."""
    for ours, shape in shapes.items():
        experts = _stacked_names(ours, cfg)
        if experts is not None:  # one tensor per expert, each of the stacked parameter's shape but the first
            for hf_name in experts:
                f, path = handles[hf_name]
                check_weight_dtype(f, hf_name, path)
                stored = tuple(f.get_slice(hf_name).get_shape())
                if stored != shape[1:]:
                    raise CheckpointError(f"tensor {hf_name} (expert of our {ours}) in {path} has shape {stored}, "
                                          f"but the model expects {shape[1:]}; the checkpoint does not match "
                                          "config.json")
            continue
        hf_name, convert = hf_tensor_for(ours, cfg)
        f, path = handles[hf_name]
        check_weight_dtype(f, hf_name, path)
        stored = tuple(f.get_slice(hf_name).get_shape())
        if convert is None or len(stored) != len(shape):  # a conversion transposes 2-D weights only
            got = stored
        else:
            got = tuple(convert(torch.empty(stored, device="meta")).shape)
        if got != shape:
            raise CheckpointError(
                f"tensor {hf_name} (our {ours}) in {path} has shape {stored}, but the model expects "
                f"{shape if convert is None else f'{shape} (after conversion; got {got})'}; the checkpoint "
                "does not match config.json"
            )


def check_hf_weights(directory: str | os.PathLike[str], cfg: ModelConfig) -> None:
    """Check an HF directory's weight files against `cfg` from their headers alone (no tensor is
    read): shard files present, no unknown or missing tensors, every shape right."""
    with _open_weights(Path(directory), cfg) as handles:
        _check_shapes(handles, _parameter_names(cfg), cfg)


@torch.no_grad()
def load_hf_into(named: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike[str],
                 cfg: ModelConfig) -> None:
    """Fill the given parameters (our names -> tensors as this rank holds them: whole, a pipeline
    stage's, or DTensor shards) from an HF directory, reading only the slices this rank holds.

    Everything is checked before anything is copied: a missing shard file, a tensor of the wrong
    shape (naming it and both shapes), tensors the model lacks and weights the files lack raise
    CheckpointError.
    """
    named = list(named)
    with _open_weights(Path(directory), cfg) as handles:
        _check_shapes(handles, {n: tuple(t.shape) for n, t in named}, cfg)
        for ours, param in named:
            local, region = _local_region(param)
            experts = _stacked_names(ours, cfg)
            if experts is not None:  # the experts this rank holds, each its slice of one tensor
                for j in range(region[0].start, region[0].stop):
                    local[j - region[0].start].copy_(handles[experts[j]][0].get_slice(experts[j])[region[1:]])
                continue
            hf_name, convert = hf_tensor_for(ours, cfg)
            f, _ = handles[hf_name]
            if convert is None:
                local.copy_(f.get_slice(hf_name)[region])
            else:
                local.copy_(convert(f.get_tensor(hf_name))[region])


def load_hf_weights(model: Transformer, directory: str | os.PathLike[str]) -> None:
    """Copy the weights of an HF directory into `model` (already allocated), tensor by tensor.

    Raises CheckpointError for a missing shard file, a tensor of the wrong shape, and tensors missing
    from or unknown to the model. Tensors are converted to each parameter's dtype and device.
    """
    load_hf_into([*model.named_parameters(), *hf_buffers(model)], directory, model.cfg)
    model.tie_weights()


def from_hf(
    directory: str | os.PathLike[str], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A shardwise Transformer with the config and weights of an HF directory.

    Built on the meta device and allocated once on `device` (no random init: every weight is loaded).
    """
    cfg = load_hf_config(directory)
    check_hf_weights(directory, cfg)  # config.json's sizes against the weights present, before allocating
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype=dtype)
    model.reset_rope_tables()
    reset_moe_buffers(model)
    load_hf_weights(model, directory)
    return model


# ---------------------------------------------------------------- export ----

def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the file readable as the umask allows (safetensors creates it
    0600, which hides a model from the other users of a shared machine)."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_hf(
    model: Transformer,
    out_dir: str | os.PathLike[str],
    tokenizer: Any = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    generation_config: Optional[dict] = None,
) -> Path:
    """Write `model` as an HF directory: config.json, model.safetensors (or shards with an index when
    larger than `max_shard_size` bytes), generation_config.json, and the tokenizer when given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    special = {}
    if tokenizer is not None:
        for key in ("bos", "eos", "pad"):
            value = getattr(tokenizer, f"{key}_id", None)
            if value is not None:
                special[f"{key}_token_id"] = value
    config = model_config_to_hf(model.cfg, dtype)
    config.update(special)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {**special, **(generation_config or {})}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")

    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    total = 0
    files: list[Path] = []

    def flush() -> None:
        path = out / f"model-part-{len(files):05d}.safetensors"
        save_safetensors(shards[-1], path, metadata={"format": "pt"})
        files.append(path)

    weight_map_parts: list[list[str]] = [[]]
    for name, t in _ours_to_hf(model):
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_size:
            flush()
            shards[-1] = {}  # free the written tensors
            shards.append({})
            sizes.append(0)
            weight_map_parts.append([])
        shards[-1][name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t
        sizes[-1] += nbytes
        total += nbytes
        weight_map_parts[-1].append(name)
    flush()

    if len(files) == 1:
        files[0].rename(out / SINGLE_FILE)
    else:
        n = len(files)
        weight_map = {}
        for i, (path, names) in enumerate(zip(files, weight_map_parts)):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(out / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
    return out
