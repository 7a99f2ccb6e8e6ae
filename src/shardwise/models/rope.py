"""Rotary position embeddings: the frequency tables (plain, linear, LLaMA-3 and YaRN scaling, as Hugging
Face computes them, bit for bit) and their application to queries and keys.

Three layouts of the rotated dims exist among the families:
- halves (LLaMA, Qwen, Mistral, Gemma): dim i turns with dim i + d/2 (`rotate_half`);
- interleaved pairs (DeepSeek-V3, GLM-4): dim 2i turns with dim 2i + 1. `apply_rope` gathers the even
  dims before the odd ones and then rotates halves; queries and keys are permuted alike, so every
  attention score is the one of the interleaved form (DeepSeek's own code returns this layout too);
- partial (GLM-4): only the first `rope_dim` dims of a head turn, the others pass through.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from shardwise.models.config import ModelConfig, RopeScaling
from shardwise.models.lean_ops import rotary


def rope_inv_freq(dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """RoPE inverse frequencies (fp32) of `dim` rotated dims, with optional scaling, as Hugging Face computes them."""
    # int64 arange then float, exactly as transformers does, so the tables agree bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, inv_freq)
    # LLaMA 3.1: long wavelengths are divided by `factor`, short ones kept, the middle band interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are divided by
    `factor`, those that turn more than beta_fast times are kept, a linear ramp in between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (s.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Optional[RopeScaling]) -> float:
    """What YaRN multiplies the cos and sin tables by (1 for every other kind)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def softmax_scale(cfg: ModelConfig) -> Optional[float]:
    """The attention's softmax scale when it is not 1/sqrt(query head dim) (None): Gemma's
    `attention_scale`, or latent attention under YaRN, which also scales the scores by mscale_all_dim's
    temperature squared (DeepSeek-V3)."""
    if cfg.attention_scale is not None:
        return cfg.attention_scale
    s = cfg.rope_scaling
    if cfg.latent_attention and s is not None and s.type == "yarn" and s.mscale_all_dim:
        return cfg.head_dim ** -0.5 * yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return None


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_position_embeddings, rope_dim], fp32; with `local`, those of the
    sliding blocks (`rope_local_theta`, no scaling)."""
    theta, scaling = (cfg.rope_local_theta, None) if local else (cfg.rope_theta, cfg.rope_scaling)
    inv_freq = rope_inv_freq(cfg.rope_dim, theta, scaling).to(device)
    positions = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """x [..., head_dim] with its first cos.shape[-1] dims rotated (all of them when they match): halves,
    or neighbouring pairs with `interleave` (the result then holds the even dims before the odd ones)."""
    dim = cos.shape[-1]
    turned, passed = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    if interleave:
        turned = torch.cat((turned[..., 0::2], turned[..., 1::2]), dim=-1)
    out = rotary(turned, cos, sin)
    return out if passed is None else torch.cat((out, passed), dim=-1)
