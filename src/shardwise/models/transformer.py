"""One decoder-only transformer for every family (LLaMA, Qwen2/3, Mistral, Mixtral, Baichuan, GPT-2/3), chosen
by flags; a block's feed-forward is a mixture of experts where the config says so (`models.moe`).

Plain PyTorch with no knowledge of parallelism, in the torchtitan style: FSDP, tensor parallel and
pipeline splitting are applied from outside. What that relies on:
- attention reshapes with `view(B, T, -1, head_dim)`, so column-sharded q/k/v give the local heads;
- `layers` is a ModuleDict keyed "0", "1", ... so a pipeline stage can delete the layers it does not
  own, and `tok_embeddings`, `norm`, `output` may be set to None off their stage (forward then takes
  or returns hidden states);
- the model builds on the meta device and `init_weights()` fills every parameter and buffer;
- context parallelism hooks the model's forward from outside and sets each attention's
  `sequence_exchange`, the all-to-alls that give the kernel the whole sequence for a share of the heads.

Names and RoPE follow Hugging Face LLaMA (rotate_half convention), so weights map one to one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.loss import DEFAULT_LOSS_CHUNK_TOKENS, chunked_token_loss_sum
from shardwise.models.attention import (
    AttentionMask,
    BlockMask,
    alibi_mask,
    alibi_slopes,
    attend,
    document_block_mask,
    document_mask,
    flex_available,
    flex_shapes,
)
from shardwise.models.config import ModelConfig
from shardwise.models.init import init_linears, init_normal
from shardwise.models.latent_attention import LatentAttention
from shardwise.models.lean_ops import gated_activation
from shardwise.models.moe import MoE
from shardwise.models.norms import RMSNorm, build_norm
from shardwise.models.rope import apply_rope, rope_tables, softmax_scale

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class KVCache:
    """Preallocated keys and values for incremental decoding: per layer [B, kv_heads, max_len, key_dim] and
    [B, kv_heads, max_len, value_dim] (the two widths differ under latent attention)."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        value_dim: Optional[int] = None,
    ) -> None:
        k_shape = (batch_size, num_kv_heads, max_len, head_dim)
        v_shape = (batch_size, num_kv_heads, max_len, value_dim or head_dim)
        self.k = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0  # tokens already stored; the next forward's positions start here

    @classmethod
    def for_model(cls, model: "Transformer", batch_size: int, max_len: Optional[int] = None) -> "KVCache":
        """A cache sized for `model` (layer count, kv heads, dtype and device of its weights)."""
        cfg = model.cfg
        weight = next(model.parameters())
        return cls(
            num_layers=cfg.num_layers,
            batch_size=batch_size,
            max_len=max_len or cfg.max_position_embeddings,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            device=weight.device,
            dtype=weight.dtype,
            value_dim=cfg.value_dim,
        )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim] after the cached ones and return all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens do not fit its max_len {self.max_len}")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Mark `num_tokens` more positions as stored (called once per forward, after every layer)."""
        self.length += num_tokens

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are kept)."""
        self.length = 0


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads, optional RoPE and biases."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.rope_interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.out_bias)
        # Qwen3, Gemma 3: each head's queries and keys RMS-normalised over head_dim before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # Context parallelism (set from outside, `parallel.context`): x holds a chunk of the sequence, and this
        # exchange gives attention the whole sequence for a share of the heads (to_heads) and back (to_sequence).
        self.sequence_exchange = None

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        mask: Optional[AttentionMask],
        is_causal: bool,
        kv_cache: Optional[KVCache],
    ) -> torch.Tensor:
        """Attend over x [B, T, hidden]; `mask` is boolean [B, 1, T, S] (True = may attend), a flex
        block mask, or None."""
        bsz, seqlen, _ = x.shape
        # -1 rather than num_heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin, self.rope_interleave), apply_rope(k, cos, sin, self.rope_interleave)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_id, k, v)
        if self.sequence_exchange is not None:
            q, k, v = self.sequence_exchange.to_heads(q, k, v)
        out = attend(q, k, v, mask, is_causal, self.dropout if self.training else 0.0, self.scale)
        if self.sequence_exchange is not None:
            out = self.sequence_exchange.to_sequence(out)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.resid_dropout(self.wo(out))

    def init_weights(self, std: float, out_std: float) -> None:
        """Normal weights, zero biases; the output projection gets the depth-scaled std."""
        init_linears(((self.wq, std), (self.wk, std), (self.wv, std), (self.wo, out_std)))
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    """Gated MLP (w2(act(w1 x) * w3 x), SwiGLU; `lean_ops.gated_activation` saves w1 x and w3 x only)
    or plain MLP (w2(act(w1 x)), GPT-2)."""

    def __init__(self, cfg: ModelConfig, width: Optional[int] = None) -> None:
        super().__init__()
        width = width or cfg.intermediate_size  # a MoE block's shared experts are narrower
        self.activation = cfg.activation
        self.act = _ACTIVATIONS[cfg.activation]
        self.w1 = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias) if cfg.mlp == "gated" else None
        self.w2 = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to x [B, T, hidden]."""
        if self.w3 is not None:
            h = gated_activation(self.w1(x), self.w3(x), self.activation)
        else:
            h = self.act(self.w1(x))
        return self.dropout(self.w2(h))

    def init_weights(self, std: float, out_std: float) -> None:
        """Normal weights, zero biases; the down projection gets the depth-scaled std."""
        init_linears(((self.w1, std), (self.w3, std), (self.w2, out_std)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(...)); with `sandwich_norm` each
    output is normed again before its residual add (GLM-4, Gemma 3). The attention is latent
    (`latent_attention.LatentAttention`) when the config gives kv_lora_rank; the feed-forward is a mixture
    of experts (`moe.MoE`) in the blocks `ModelConfig.is_moe_layer` names. `sliding` says whether the block
    attends through the sliding window (the model gives it that mask and RoPE table)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.sliding = cfg.is_sliding_layer(layer_id)
        self.attention_norm = build_norm(cfg)
        self.attention: nn.Module = LatentAttention(cfg, layer_id) if cfg.latent_attention else Attention(cfg, layer_id)
        self.attention_post_norm = build_norm(cfg) if cfg.sandwich_norm else None
        self.ffn_norm = build_norm(cfg)
        self.ffn_post_norm = build_norm(cfg) if cfg.sandwich_norm else None
        if cfg.is_moe_layer(layer_id):
            shared = FeedForward(cfg, cfg.num_shared_experts * cfg.moe_intermediate_size) \
                if cfg.num_shared_experts else None
            self.feed_forward: nn.Module = MoE(cfg, shared)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        mask: Optional[AttentionMask],
        is_causal: bool,
        kv_cache: Optional[KVCache],
    ) -> torch.Tensor:
        """Run one block on x [B, T, hidden]."""
        a = self.attention(self.attention_norm(x), rope, mask, is_causal, kv_cache)
        h = x + (a if self.attention_post_norm is None else self.attention_post_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.ffn_post_norm is None else self.ffn_post_norm(f))

    def init_weights(self, std: float, out_std: float) -> None:
        """Initialise the block's norms and linears."""
        for norm in (self.attention_norm, self.attention_post_norm, self.ffn_norm, self.ffn_post_norm):
            if norm is not None:
                norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


class Transformer(nn.Module):
    """Decoder-only causal LM: embeddings, `layers` of TransformerBlock, final norm, output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = (
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.position == "learned" else None
        )
        self.emb_dropout = nn.Dropout(cfg.dropout)
        # How document masks are computed: "auto" (flex on CUDA, else explicit), "flex" or "mask".
        self.document_attention = "auto"
        self.compile_loss_head = False  # run.compile: the chunked loss's chunks run through torch.compile
        # The chunked loss makes its gradients in forward (`chunked_token_loss_sum`); a pipeline turns it off.
        self.loss_gradients_in_forward = True
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.num_layers)})
        self.norm = build_norm(cfg)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not saved in checkpoints: they are a function of the config, rebuilt by init_weights. Sliding
        # blocks may turn at their own base (Gemma 3's local RoPE).
        shape = (cfg.max_position_embeddings, cfg.rope_dim)
        for name, wanted in (("rope_cos", cfg.position == "rope"), ("rope_sin", cfg.position == "rope"),
                             ("rope_local_cos", self._local_rope()), ("rope_local_sin", self._local_rope())):
            self.register_buffer(name, torch.empty(shape, dtype=torch.float32) if wanted else None, persistent=False)

    def _local_rope(self) -> bool:
        """Whether the sliding blocks have RoPE tables of their own."""
        return self.cfg.rope_local_theta is not None and self.cfg.sliding_window > 0

    def tie_weights(self) -> None:
        """Make `output.weight` the very tensor of `tok_embeddings.weight` when the config ties them."""
        # Module.to_empty() gives each module a fresh parameter, which silently unties shared weights.
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from the global RNG and rebuild the RoPE tables (in fp32)."""
        self.tie_weights()
        cfg = self.cfg
        std = cfg.initializer_range
        # GPT-2's scheme: projections that write into the residual stream shrink with depth.
        out_std = std / math.sqrt(2 * cfg.num_layers)
        if self.tok_embeddings is not None:
            init_normal(self.tok_embeddings.weight, std)
        if self.pos_embeddings is not None:
            init_normal(self.pos_embeddings.weight, std)
        for layer in self.layers.values():
            layer.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        # A tied output on a pipeline stage without the embedding owns its own copy, so it needs init.
        if self.output is not None and (not cfg.tie_embeddings or self.tok_embeddings is None):
            init_normal(self.output.weight, std)
        self.reset_rope_tables()

    def reset_rope_tables(self) -> None:
        """Rebuild the RoPE cos/sin tables in fp32 on their device (after to_empty or a dtype cast)."""
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
            self.rope_cos, self.rope_sin = cos, sin  # assigning to a buffer name replaces the buffer
            if self._local_rope():
                self.rope_local_cos, self.rope_local_sin = rope_tables(self.cfg, self.rope_cos.device, local=True)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        document_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        loss_per_row: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] for tokens [B, T] (or hidden states in and out on a pipeline's middle stages).

        `position_ids` [B, T] default to 0..T-1 (continuing from the cache length with a KV cache).
        `attention_mask` is boolean [B, 1, T, S] or [B, T, S], True where a query may attend to a key
        (S = cached + new tokens); every query must be allowed at least one key. `document_ids`
        [B, T] number the documents packed into each sample: a token then attends only to earlier
        tokens of its own document. Without either the attention is causal.
        With `labels` [B, T] the result is instead the SUM of next-token cross-entropy over the
        positions with a label (`shardwise.loss.chunked_token_loss_sum`), computed `loss_chunk_tokens`
        tokens at a time from the output projection's weight, never the [B*T, vocab] logits; a
        pipeline stage without the output projection ignores the labels and returns hidden states.
        `loss_per_row`: with `labels`, each row's sum [B] instead (minus its answer's log-probability in
        preference tuning).
        """
        past = kv_cache.length if kv_cache is not None else 0
        seqlen = tokens.shape[1]
        if position_ids is None:
            # Checked only here: checking given ids would need a device sync on every step.
            if past + seqlen > self.cfg.max_position_embeddings:
                raise ValueError(
                    f"{past + seqlen} positions exceed max_position_embeddings="
                    f"{self.cfg.max_position_embeddings}; use shorter sequences or a larger model config"
                )
            position_ids = torch.arange(past, past + seqlen, device=tokens.device).unsqueeze(0)

        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.cfg.scale_embeddings:  # Gemma: by sqrt(hidden) rounded to the weights' dtype, as its code does
                h = h * torch.tensor(self.cfg.hidden_size ** 0.5).to(h.dtype).item()
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(position_ids)
            h = self.emb_dropout(h)
        else:
            h = tokens  # a later pipeline stage receives hidden states

        rope = self._rope(self.rope_cos, self.rope_sin, position_ids, h.dtype)
        local_rope = self._rope(self.rope_local_cos, self.rope_local_sin, position_ids, h.dtype) or rope

        if document_ids is not None:
            if attention_mask is not None or kv_cache is not None:
                raise ValueError("document_ids cannot be combined with attention_mask or a KV cache")
            mask, is_causal = self._document_mask(document_ids)
        else:
            mask, is_causal = self._attention_mask(attention_mask, seqlen, past, h.device)
        sliding = (mask, is_causal)
        if self.cfg.sliding_window and past + seqlen > self.cfg.sliding_window:
            sliding = self._sliding_mask(mask, document_ids, seqlen, past, h.device), False
        if self.cfg.position == "alibi":
            mask, is_causal = self._alibi_mask(mask, seqlen, past, h), False
        # use_flash_attention: false keeps SDPA to its plain (math) kernel, e.g. to rule out a fused one.
        kernels = contextlib.nullcontext() if self.cfg.use_flash_attention else sdpa_kernel(SDPBackend.MATH)
        with kernels, flex_shapes(mask):  # compiled blocks with flex inside: fewer recompiles
            for layer in self.layers.values():
                if layer.sliding:
                    h = layer(h, local_rope, *sliding, kv_cache)
                else:
                    h = layer(h, rope, mask, is_causal, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(seqlen)

        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            if labels is not None:
                # The weight is read inside forward, so FSDP2 has gathered it and its gradient is reduced.
                return chunked_token_loss_sum(h, self.output.weight, labels, loss_chunk_tokens,
                                              compiled=self.compile_loss_head,
                                              gradients_in_forward=self.loss_gradients_in_forward,
                                              per_row=loss_per_row)
            h = self.output(h)
        return h

    @staticmethod
    def _rope(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], position_ids: torch.Tensor,
              dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The cos and sin rows of `position_ids` [B, T], as [B, T, 1, rope_dim] in `dtype` (None without tables)."""
        if cos is None:
            return None
        return cos[position_ids].unsqueeze(2).to(dtype), sin[position_ids].unsqueeze(2).to(dtype)

    def _sliding_mask(self, mask: Optional[AttentionMask], document_ids: Optional[torch.Tensor], seqlen: int,
                      past: int, device: torch.device) -> AttentionMask:
        """The sliding blocks' mask: the full mask (`mask`, or causal when None) narrowed to keys fewer than
        `sliding_window` positions back (Gemma 3's window: key j is seen from query i when i - j < window)."""
        window = self.cfg.sliding_window
        if BlockMask is not None and isinstance(mask, BlockMask):
            return document_block_mask(document_ids, window)
        if mask is None:
            mask = torch.ones(seqlen, past + seqlen, dtype=torch.bool, device=device).tril(diagonal=past)
        queries = torch.arange(past, past + seqlen, device=device)[:, None]
        keys = torch.arange(past + seqlen, device=device)[None, :]
        return mask & (queries - keys < window)

    def _alibi_mask(self, mask: Optional[torch.Tensor], seqlen: int, past: int, h: torch.Tensor) -> torch.Tensor:
        """ALiBi's additive mask over the boolean one (`mask`, or causal when None)."""
        if mask is None:
            mask = torch.ones(seqlen, past + seqlen, dtype=torch.bool, device=h.device).tril(diagonal=past)
        if mask.dim() == 2:
            mask = mask[None, None]
        return alibi_mask(mask, alibi_slopes(self.cfg.num_heads), past, h.dtype)

    def _document_mask(self, document_ids: torch.Tensor) -> tuple[Optional[AttentionMask], bool]:
        """Flex block mask on CUDA (fused, no T x T tensor), else an explicit boolean mask for SDPA;
        plain causal attention when every sample holds one document (checked on CPU only, where it
        costs no device sync and the causal kernel is a few percent faster)."""
        if document_ids.device.type == "cpu" and not bool(document_ids.any()):
            return None, True
        kind = "mask" if self.cfg.position == "alibi" else self.document_attention  # ALiBi adds to a mask
        if kind == "auto":
            use_flex = (
                flex_available()
                and document_ids.device.type == "cuda"
                and self.cfg.use_flash_attention
                and not (self.training and self.cfg.dropout)
            )
            kind = "flex" if use_flex else "mask"
        return (document_block_mask(document_ids) if kind == "flex" else document_mask(document_ids)), False

    @staticmethod
    def _attention_mask(
        attention_mask: Optional[torch.Tensor], seqlen: int, past: int, device: torch.device
    ) -> tuple[Optional[torch.Tensor], bool]:
        """The boolean mask to give SDPA, and whether to use its built-in causal mask instead."""
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be boolean (True = may attend), got {attention_mask.dtype}")
            if attention_mask.dim() == 3:
                attention_mask = attention_mask.unsqueeze(1)
            return attention_mask, False
        if past == 0:
            return None, True
        if seqlen == 1:
            return None, False  # one new token may see everything cached
        # SDPA's is_causal aligns to the top left, which is wrong when keys include cached tokens.
        mask = torch.ones(seqlen, past + seqlen, dtype=torch.bool, device=device).tril(diagonal=past)
        return mask, False


def build_model(
    cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Build on the meta device, allocate on `device` in `dtype`, and initialise (RoPE tables stay fp32)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return materialize(model, device, dtype)


def materialize(model: Transformer, device: str | torch.device, dtype: torch.dtype) -> Transformer:
    """Allocate a meta-device model on `device` in `dtype` and initialise its weights."""
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype=dtype)
    model.init_weights()
    return model
