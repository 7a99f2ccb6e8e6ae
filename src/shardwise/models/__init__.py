"""Models: one decoder with family flags, named presets, parameter/FLOP counts and generation."""

from shardwise.models.config import ModelConfig
from shardwise.models.flops import (
    count_active_parameters,
    count_parameters,
    count_parameters_by_kind,
    flops_per_token,
)
from shardwise.models.generate import generate
from shardwise.models.registry import (
    get_preset,
    preset_names,
    register_preset,
    resolve_model_config,
    unregister_preset,
)
from shardwise.models.transformer import KVCache, Transformer, build_model, materialize

__all__ = [
    "ModelConfig",
    "Transformer",
    "build_model",
    "materialize",
    "KVCache",
    "register_preset",
    "unregister_preset",
    "get_preset",
    "preset_names",
    "resolve_model_config",
    "count_active_parameters",
    "count_parameters",
    "count_parameters_by_kind",
    "flops_per_token",
    "generate",
]
