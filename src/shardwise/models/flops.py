"""Exact parameter counts and training FLOPs per token, computed from a config without building a model."""

from __future__ import annotations

from shardwise.errors import ConfigError
from shardwise.models.config import ModelConfig


def _attention_weights(cfg: ModelConfig) -> int:
    """Weight elements of one layer's q, k, v and output projections."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (q_dim + 2 * kv_dim) + q_dim * cfg.hidden_size


def _mlp_weights(cfg: ModelConfig) -> int:
    """Weight elements of one layer's MLP (three matrices if gated, two if plain)."""
    matrices = 3 if cfg.mlp == "gated" else 2
    return matrices * cfg.hidden_size * cfg.intermediate_size


def count_parameters_by_kind(cfg: ModelConfig) -> dict[str, int]:
    """Parameters split into embedding, attention, mlp, norm and output (0 when tied); they sum to the total."""
    h, n_layers = cfg.hidden_size, cfg.num_layers
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    embedding = cfg.vocab_size * h
    if cfg.position == "learned":
        embedding += cfg.max_position_embeddings * h

    attention = _attention_weights(cfg)
    if cfg.qkv_bias:
        attention += q_dim + 2 * kv_dim
    if cfg.out_bias:
        attention += h

    mlp = _mlp_weights(cfg)
    if cfg.mlp_bias:
        up_matrices = 2 if cfg.mlp == "gated" else 1
        mlp += up_matrices * cfg.intermediate_size + h

    per_norm = 2 * h if cfg.norm == "layernorm" and cfg.norm_bias else h
    norm = (2 * n_layers + 1) * per_norm  # two per block plus the final one

    output = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return {
        "embedding": embedding,
        "attention": n_layers * attention,
        "mlp": n_layers * mlp,
        "norm": norm,
        "output": output,
    }


def count_parameters(cfg: ModelConfig) -> int:
    """Exact number of parameters of `Transformer(cfg)` (tied embeddings counted once)."""
    return sum(count_parameters_by_kind(cfg).values())


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weight elements that take part in a matrix multiply per token: all blocks' linears plus the output head."""
    return cfg.num_layers * (_attention_weights(cfg) + _mlp_weights(cfg)) + cfg.vocab_size * cfg.hidden_size


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B convention.

    FLOPs = 6 * N + 12 * num_layers * num_heads * head_dim * seq_length, where N counts the weights of
    every matrix multiply: the q/k/v/output and MLP projections of each layer and the output (logits)
    projection, which is counted even when it shares its weight with the embedding. Embedding and
    position lookups, biases, norms, softmax and activations are left out (they are not matmuls or are
    negligible). The factor 6 is 2 (multiply-add) x 3 (forward, input grad, weight grad); the second
    term is the attention scores and their weighted sum (QK^T and AV, 2 x 2 x 3 per element) over the
    full, unmasked sequence, as PaLM counts it. This is the number MFU is measured against.
    """
    if seq_length <= 0:
        raise ConfigError(f"seq_length must be a positive number of tokens, got {seq_length}")
    attention_scores = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_length
    return float(6 * matmul_parameters(cfg) + attention_scores)
