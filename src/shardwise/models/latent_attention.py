"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values from a low-rank latent.

Per token, in the order of the forward (names as Hugging Face's DeepSeek-V3 -> ours):
- queries: q_a_proj -> `wq_a` [q_lora_rank, hidden], q_a_layernorm -> `q_norm`, q_b_proj -> `wq_b`
  [heads x head_dim, q_lora_rank] (or one q_proj -> `wq` without q_lora_rank); each head's query is
  head_dim = qk_nope + qk_rope dims, the last qk_rope_head_dim of them rotated;
- keys and values: kv_a_proj_with_mqa -> `wkv_a` [kv_lora_rank + qk_rope_head_dim, hidden] gives the
  latent (normed by kv_a_layernorm -> `kv_norm`) and ONE rotary key shared by every head;
  kv_b_proj -> `wkv_b` [heads x (qk_nope + v_head_dim), kv_lora_rank] expands the latent into each
  head's non-rotary key and its value;
- o_proj -> `wo` [hidden, heads x v_head_dim].
The scores use 1/sqrt(head_dim), times YaRN's temperature squared when the RoPE is YaRN with
mscale_all_dim (`rope.softmax_scale`). The two latent norms use eps 1e-6 whatever rms_norm_eps says, as
transformers' DeepSeek-V3 does. Training computes full keys and values per head (as transformers and
torchtitan do); the KV cache holds them expanded too, not the latent.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from shardwise.models.attention import AttentionMask, attend
from shardwise.models.config import ModelConfig
from shardwise.models.init import init_linears
from shardwise.models.norms import RMSNorm
from shardwise.models.rope import apply_rope, softmax_scale

LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention with the forward signature of `transformer.Attention`."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.nope_dim = cfg.head_dim - cfg.qk_rope_head_dim
        self.value_dim = cfg.value_dim
        self.kv_rank = cfg.kv_lora_rank
        self.dropout = cfg.dropout
        self.rope_interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        heads, hidden, bias = cfg.num_heads, cfg.hidden_size, cfg.qkv_bias
        if cfg.q_lora_rank is None:
            self.wq: Optional[nn.Linear] = nn.Linear(hidden, heads * cfg.head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * cfg.head_dim, bias=False)
        self.wkv_a = nn.Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (self.nope_dim + self.value_dim), bias=False)
        self.wo = nn.Linear(heads * self.value_dim, hidden, bias=cfg.out_bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.sequence_exchange = None  # context parallelism is refused with latent attention (run config)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        mask: Optional[AttentionMask],
        is_causal: bool,
        kv_cache: Optional[Any],
    ) -> torch.Tensor:
        """Attend over x [B, T, hidden] as `transformer.Attention.forward` does."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.head_dim)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope_dim + self.value_dim)
        k_nope, v = kv.split([self.nope_dim, self.value_dim], dim=-1)
        k_rot = k_rot.view(bsz, seqlen, 1, self.rope_dim)
        cos, sin = rope
        q_rot, k_rot = apply_rope(q_rot, cos, sin, self.rope_interleave), apply_rope(k_rot, cos, sin,
                                                                                     self.rope_interleave)
        q = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_id, k, v)
        out = attend(q, k, v, mask, is_causal, self.dropout if self.training else 0.0, self.scale)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.resid_dropout(self.wo(out))

    def init_weights(self, std: float, out_std: float) -> None:
        """Normal weights, zero biases, unit norms; the output projection gets the depth-scaled std."""
        init_linears(((self.wq, std), (self.wq_a, std), (self.wq_b, std), (self.wkv_a, std), (self.wkv_b, std),
                      (self.wo, out_std)))
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
