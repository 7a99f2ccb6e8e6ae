"""Exact parameter counts and training FLOPs per token, computed from a config without building a model.

A mixture-of-experts block (`ModelConfig.is_moe_layer`) holds a router ([experts, hidden]), every
expert's three matrices and the shared experts' MLP, but a token runs through the router, its
`num_experts_per_tok` experts and the shared MLP only: FLOPs count those (`count_active_parameters` is
the parameters a token uses)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.errors import ConfigError
from shardwise.models.config import ModelConfig


def _attention_weights(cfg: ModelConfig) -> int:
    """Weight elements of one layer's attention projections."""
    return sum(d_in * d_out for d_in, d_out in attention_dims(cfg).values())


def attention_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(input, output) width of each attention linear: q, k, v and output, or latent attention's
    (`models.latent_attention`: the query bottleneck or one query projection, the key/value latent with the
    shared rotary key, its expansion into each head's key and value, the output)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    if not cfg.latent_attention:
        q, kv = heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {"attention.wq": (h, q), "attention.wk": (h, kv), "attention.wv": (h, kv), "attention.wo": (q, h)}
    query = {"attention.wq": (h, heads * cfg.head_dim)} if cfg.q_lora_rank is None else \
        {"attention.wq_a": (h, cfg.q_lora_rank), "attention.wq_b": (cfg.q_lora_rank, heads * cfg.head_dim)}
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    return {**query, "attention.wkv_a": (h, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "attention.wkv_b": (cfg.kv_lora_rank, heads * (nope + cfg.v_head_dim)),
            "attention.wo": (heads * cfg.v_head_dim, h)}


def _attention_extras(cfg: ModelConfig) -> tuple[int, int]:
    """(bias elements, norm elements) of one layer's attention."""
    h = cfg.hidden_size
    if cfg.latent_attention:  # attention_bias covers the bottleneck's and the latent's down projections
        downs = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return downs * cfg.qkv_bias + h * cfg.out_bias, (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (q_dim + 2 * kv_dim) * cfg.qkv_bias + h * cfg.out_bias, 2 * cfg.head_dim * cfg.qk_norm


def _mlp_weights(cfg: ModelConfig) -> int:
    """Weight elements of one layer's MLP (three matrices if gated, two if plain)."""
    matrices = 3 if cfg.mlp == "gated" else 2
    return matrices * cfg.hidden_size * cfg.intermediate_size


def _moe_weights(cfg: ModelConfig, experts: int) -> int:
    """Weight elements of one MoE block's feed-forward with `experts` routed experts counted: the router,
    their gated MLPs and the shared experts' MLP."""
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    return h * cfg.num_experts + 3 * h * f * (experts + cfg.num_shared_experts)


def feed_forward_weights(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Weight elements of block `layer`'s feed-forward: every expert's, or with `active` a token's."""
    if not cfg.is_moe_layer(layer):
        return _mlp_weights(cfg)
    return _moe_weights(cfg, cfg.num_experts_per_tok if active else cfg.num_experts)


def count_parameters_by_kind(cfg: ModelConfig) -> dict[str, int]:
    """Parameters split into embedding, attention, mlp, norm and output (0 when tied); they sum to the total."""
    h, n_layers = cfg.hidden_size, cfg.num_layers

    embedding = cfg.vocab_size * h
    if cfg.position == "learned":
        embedding += cfg.max_position_embeddings * h

    biases, attention_norms = _attention_extras(cfg)
    attention = _attention_weights(cfg) + biases

    dense_bias = (2 if cfg.mlp == "gated" else 1) * cfg.intermediate_size + h if cfg.mlp_bias else 0
    mlp = sum(feed_forward_weights(cfg, i) + (0 if cfg.is_moe_layer(i) else dense_bias) for i in range(n_layers))

    per_norm = 2 * h if cfg.norm == "layernorm" and cfg.norm_bias else h
    block_norms = 4 if cfg.sandwich_norm else 2
    norm = (block_norms * n_layers + 1) * per_norm + n_layers * attention_norms  # the blocks' and the final one

    output = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return {
        "embedding": embedding,
        "attention": n_layers * attention,
        "mlp": mlp,
        "norm": norm,
        "output": output,
    }


def count_parameters(cfg: ModelConfig) -> int:
    """Exact number of parameters of `Transformer(cfg)` (tied embeddings counted once)."""
    return sum(count_parameters_by_kind(cfg).values())


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of a dense model's; in MoE blocks the router, the token's
    `num_experts_per_tok` experts and the shared experts (Qwen3-30B-A3B: about 3.3 of 30.5 billion)."""
    inactive = sum(feed_forward_weights(cfg, i) - feed_forward_weights(cfg, i, active=True)
                   for i in range(cfg.num_layers))
    return count_parameters(cfg) - inactive


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weight elements a token multiplies by: its blocks' linears (a MoE block's router and active experts)
    plus the output head."""
    return sum(_attention_weights(cfg) + feed_forward_weights(cfg, i, active=True) for i in range(cfg.num_layers)) \
        + cfg.vocab_size * cfg.hidden_size


def flops_per_token(cfg: ModelConfig, seq_length: int, trainable: Mapping[str, Sequence[int]] | None = None) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B convention; see `training_flops`.

    With every parameter trainable (`trainable` None): FLOPs = 6 * N + 12 * num_layers * num_heads *
    head_dim * seq_length, where N counts the weights of every matrix multiply: the q/k/v/output and
    MLP projections of each layer and the output (logits) projection, which is counted even when it
    shares its weight with the embedding. Embedding and position lookups, biases, norms, softmax and
    activations are left out (they are not matmuls or are negligible). The factor 6 is 2
    (multiply-add) x 3 (forward, input grad, weight grad); the second term is the attention scores
    and their weighted sum (QK^T and AV, 2 x 2 x 3 per element) over the full, unmasked sequence, as
    PaLM counts it. With frozen weights (LoRA, freezing) fewer FLOPs are computed, and counted. This
    is the number MFU is measured against.
    """
    return training_flops(cfg, seq_length, trainable).total


# --- training FLOPs that account for what trains ---------------------------------------------------

# The block linears that read the normed residual stream (names under layers.{i}), in forward order.
_ATTENTION_INPUTS = ("attention.wq", "attention.wk", "attention.wv")
_MLP_INPUTS = ("feed_forward.w1", "feed_forward.w3")


@dataclass(frozen=True)
class TrainingFlops:
    """FLOPs per token of one training step (forward + the backward autograd runs), by where they are spent."""

    layers: tuple[float, ...]  # per block, forward + backward, attention scores included
    layers_forward: tuple[float, ...]  # per block, the forward alone (what recompute runs again)
    head: float  # the output projection, forward + backward
    routed: tuple[float, ...] = ()  # per block, the part of `layers` in a MoE block's router and routed experts
    # per block, the part of `layers` in latent attention's down projections (every tensor-parallel rank runs
    # them whole, as it does the routed experts)
    latent_down: tuple[float, ...] = ()

    @property
    def total(self) -> float:
        """FLOPs per token of the whole model: what MFU divides by the peak."""
        return sum(self.layers) + self.head


def _linear_dims(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
    """(input, output) width of each linear of block `layer` (w3 only in gated MLPs). A MoE block's
    experts count as one linear per projection as wide as the token's experts together (k x F); the
    router and the shared experts' MLP as linears."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    dims = attention_dims(cfg)
    if cfg.is_moe_layer(layer):
        routed = cfg.num_experts_per_tok * cfg.moe_intermediate_size
        dims.update({"feed_forward.router.gate": (h, cfg.num_experts), "feed_forward.experts.w1": (h, routed),
                     "feed_forward.experts.w3": (h, routed), "feed_forward.experts.w2": (routed, h)})
        if cfg.num_shared_experts:
            shared = cfg.num_shared_experts * cfg.moe_intermediate_size
            dims.update({"feed_forward.shared.w1": (h, shared), "feed_forward.shared.w3": (h, shared),
                         "feed_forward.shared.w2": (shared, h)})
        return dims
    dims.update({"feed_forward.w1": (h, i), "feed_forward.w2": (i, h)})
    if cfg.mlp == "gated":
        dims["feed_forward.w3"] = (h, i)
    return dims


def _weight_name(linear: str) -> str:
    """The parameter holding a linear's weight: "{linear}.weight", or the stacked experts' tensor itself."""
    return linear if ".experts." in linear else f"{linear}.weight"


def _modules_of(name: str) -> list[str]:
    """The modules a parameter name lies in: "a.b.weight" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


class _Walk:
    """The FLOP rule applied along the forward pass, knowing which parameters train.

    A weight matrix W used as y = x W costs, per token and weight: 2 for the forward, 2 more for its
    weight gradient when W trains, and 2 more for the input gradient when x depends on any trainable
    parameter (autograd computes a gradient only for tensors that need one). So a trainable weight
    costs 6, a frozen weight with something trainable below it 4, and a frozen weight whose input
    depends on nothing trainable 2: the bottom layers of a model frozen from the embeddings up, the
    layers below a LoRA model's first adapter, and the q/k/v base weights of its first adapted layer
    (their input is the frozen embedding, normed by a frozen norm). An adapter's A trains and reads the
    layer input; its B trains and reads A's output, which needs a gradient: 6.
    """

    def __init__(self, trainable: Mapping[str, Sequence[int]] | None) -> None:
        self.trainable = trainable
        self.flops = 0.0
        # Every module (dotted prefix) that holds a trainable parameter, for constant-time lookups.
        self._training_modules = {module for name in trainable or () for module in _modules_of(name)}

    def trains(self, module: str) -> bool:
        """Whether any parameter of `module` ("layers.0.attention.wq") trains (all do without a table)."""
        return self.trainable is None or module in self._training_modules

    def linear(self, name: str, dims: tuple[int, int], input_grad: bool) -> bool:
        """Count one linear (and its LoRA adapter); returns whether its output needs a gradient."""
        d_in, d_out = dims
        weight_trains = self.trainable is None or _weight_name(name) in self.trainable
        self.flops += d_in * d_out * (2 + 2 * weight_trains + 2 * input_grad)
        adapter = None if self.trainable is None else self.trainable.get(f"{name}.lora_B.weight")
        if adapter is not None:
            r = int(adapter[1])  # lora_B is [out, r]; lora_A is [r, in], trains, and may be shared (GPT-2 q/k/v)
            self.flops += r * d_in * (4 + 2 * input_grad) + d_out * r * 6
        return input_grad or self.trains(name)


def training_flops(cfg: ModelConfig, seq_length: int,
                   trainable: Mapping[str, Sequence[int]] | None = None) -> TrainingFlops:
    """Training FLOPs per token of `Transformer(cfg)`, counting what a step computes.

    `trainable` maps the name of every parameter that trains to its shape, as `named_parameters()` of
    the model with LoRA / freezing applied gives them (a tied output projection is listed as
    `tok_embeddings.weight`); None means every parameter trains. Weight matrices follow the rule of
    `_Walk`: 6 FLOPs per trainable weight, 4 per frozen weight whose input needs a gradient, 2 per
    frozen weight with nothing trainable below it; LoRA adapters count like weights (A: [r, in],
    B: [out, r]). The attention scores (QK^T and AV over the full, unmasked sequence, PaLM's
    convention) cost 4 * num_heads * head_dim * seq_length per layer forward (2 * num_heads * (query/key head
    + value head) * seq_length under latent attention, whose heads differ), and three times that
    when q, k or v needs a gradient. Embedding lookups, norms, biases and activations are left out.
    With everything trainable this is PaLM's 6 N + 12 L H d s (`flops_per_token`).
    """
    if seq_length <= 0:
        raise ConfigError(f"seq_length must be a positive number of tokens, got {seq_length}")
    walk = _Walk(trainable)
    scores = 2 * cfg.num_heads * (cfg.head_dim + cfg.value_dim) * seq_length
    grad = walk.trains("tok_embeddings") or walk.trains("pos_embeddings")  # the residual stream needs one
    layers, forward, routed, latent_down = [], [], [], []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        dims = _linear_dims(cfg, i)
        before = walk.flops
        x = grad or walk.trains(p + "attention_norm")
        attended, down = _attention_walk(walk, p, dims, x)
        walk.flops += scores * (3 if attended else 1)
        grad = walk.linear(p + "attention.wo", dims["attention.wo"], attended) or grad
        x = grad or walk.trains(p + "ffn_norm")
        routed_here = 0.0
        if cfg.is_moe_layer(i):
            out, routed_here = _moe_walk(walk, p, dims, x)
            grad = out or grad
        else:
            hidden = any([walk.linear(p + n, dims[n], x) for n in _MLP_INPUTS if n in dims])
            grad = walk.linear(p + "feed_forward.w2", dims["feed_forward.w2"], hidden) or grad
        layers.append(walk.flops - before)
        routed.append(routed_here)
        latent_down.append(down)
        forward.append(_forward_flops(cfg, trainable, p, dims, scores))
    head_trains = walk.trains("output") or (cfg.tie_embeddings and walk.trains("tok_embeddings"))
    x = grad or walk.trains("norm")
    head = cfg.vocab_size * cfg.hidden_size * (2 + 2 * head_trains + 2 * x)
    return TrainingFlops(layers=tuple(float(f) for f in layers), layers_forward=tuple(forward), head=float(head),
                         routed=tuple(routed), latent_down=tuple(latent_down))


def _attention_walk(walk: _Walk, p: str, dims: dict[str, tuple[int, int]], x: bool) -> tuple[bool, float]:
    """The attention's projections along `walk` (its input needs a gradient: `x`): whether the queries, keys
    or values need one, and the FLOPs of latent attention's down projections (0 for standard attention).
    Latent attention's up projections read its down projections' outputs."""
    if "attention.wk" in dims:
        return any([walk.linear(p + n, dims[n], x) for n in _ATTENTION_INPUTS]), 0.0
    start = walk.flops
    down = walk.linear(p + "attention.wq_a", dims["attention.wq_a"], x) if "attention.wq_a" in dims else False
    latent = walk.linear(p + "attention.wkv_a", dims["attention.wkv_a"], x)
    down_flops = walk.flops - start
    if "attention.wq" in dims:
        query = walk.linear(p + "attention.wq", dims["attention.wq"], x)
    else:
        query = walk.linear(p + "attention.wq_b", dims["attention.wq_b"], down)
    return walk.linear(p + "attention.wkv_b", dims["attention.wkv_b"], latent) or latent or query, down_flops


def _moe_walk(walk: _Walk, p: str, dims: dict[str, tuple[int, int]], x: bool) -> tuple[bool, float]:
    """A MoE block's feed-forward along `walk` (its input needs a gradient: `x`): whether its output does, and
    the FLOPs of its router and routed experts (what every tensor-parallel rank runs whole). The router's
    output weights the experts' outputs, so it needs a gradient when they train."""
    start = walk.flops
    routed = any([walk.linear(p + n, dims[n], x) for n in ("feed_forward.experts.w1", "feed_forward.experts.w3")])
    out = walk.linear(p + "feed_forward.experts.w2", dims["feed_forward.experts.w2"], routed)
    out = walk.linear(p + "feed_forward.router.gate", dims["feed_forward.router.gate"], x) or out
    routed_flops = walk.flops - start
    if "feed_forward.shared.w1" in dims:
        shared = any([walk.linear(p + n, dims[n], x) for n in ("feed_forward.shared.w1", "feed_forward.shared.w3")])
        out = walk.linear(p + "feed_forward.shared.w2", dims["feed_forward.shared.w2"], shared) or out
    return out, routed_flops


def _forward_flops(cfg: ModelConfig, trainable: Mapping[str, Sequence[int]] | None, prefix: str,
                   dims: dict[str, tuple[int, int]], scores: int) -> float:
    """Forward FLOPs per token of one block: 2 per weight (adapters included) plus the attention scores."""
    weights = 0
    for name, (d_in, d_out) in dims.items():
        weights += d_in * d_out
        adapter = None if trainable is None else trainable.get(f"{prefix}{name}.lora_B.weight")
        if adapter is not None:
            weights += int(adapter[1]) * (d_in + d_out)
    return float(2 * weights + scores)
