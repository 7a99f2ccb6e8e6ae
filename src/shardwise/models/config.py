"""The architecture of a decoder-only causal LM: one config with family flags (LLaMA, Qwen2, GPT-2...)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The largest sizes a model config may give (no model is near them: 1024 layers, widths of a million, 16M
# tokens). They keep what is built before any weight is compared with a config from elsewhere (a model
# on the meta device, RoPE tables of max_position_embeddings rows) small, and a typo in a config clear.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 20  # hidden_size, intermediate_size, head_dim
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 22
MAX_EXPERTS = 1 << 12


class RopeScaling(BaseModel):
    """RoPE frequency scaling as in Hugging Face configs (`linear`, LLaMA-3's `llama3`, or `yarn` as
    DeepSeek-V3 and Kimi-K2 use it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["linear", "llama3", "yarn"] = "linear"
    factor: float = Field(1.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)
    # YaRN: the ramp between interpolated and kept frequencies, and the attention temperature.
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: Optional[float] = Field(None, ge=0)
    mscale_all_dim: Optional[float] = Field(None, ge=0)
    attention_factor: Optional[float] = Field(None, gt=0)
    truncate: bool = True


class ModelConfig(BaseModel):
    """Architecture of one decoder. Missing sizes are derived (kv heads, head dim, FFN width)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    preset: Optional[str] = Field(None, description="named preset whose values fill unset fields")
    init_from: Optional[str] = Field(
        None, description="start from these weights: a Hugging Face model dir or a shardwise checkpoint/run "
        "dir (the architecture comes from it)"
    )
    model_type: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4", "glm4_moe",
                        "gemma3", "gpt2", "mistral", "baichuan", "gpt"] = Field(
        "llama", description="family label (the flags below decide the architecture)"
    )
    vocab_size: int = Field(32000, gt=0, le=MAX_VOCAB, description="tokens in the vocabulary")
    hidden_size: int = Field(4096, gt=0, le=MAX_WIDTH, description="model width")
    num_layers: int = Field(32, gt=0, le=MAX_LAYERS, description="transformer blocks")
    num_heads: int = Field(32, gt=0, le=MAX_HEADS, description="attention (query) heads")
    num_kv_heads: Optional[int] = Field(None, gt=0, le=MAX_HEADS,
                                        description="grouped-query attention; default num_heads")
    head_dim: Optional[int] = Field(None, gt=0, le=MAX_WIDTH, description="default hidden_size // num_heads")
    intermediate_size: Optional[int] = Field(None, gt=0, le=MAX_WIDTH,
                                             description="FFN width; default LLaMA rule or 4x")
    multiple_of: int = Field(256, gt=0, description="FFN width rounding for the LLaMA rule")
    max_position_embeddings: int = Field(4096, gt=0, le=MAX_POSITIONS,
                                         description="longest sequence the model takes")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="RMSNorm (LLaMA) or LayerNorm (GPT-2)")
    norm_eps: float = Field(1e-5, gt=0, description="norm epsilon")
    mlp: Literal["gated", "plain"] = Field("gated", description="gated = SwiGLU-style, plain = GPT-2 style")
    activation: Literal["silu", "gelu", "gelu_tanh", "relu"] = Field("silu", description="MLP activation")
    position: Literal["rope", "learned", "alibi"] = Field("rope", description="rotary, learned absolute positions, "
                                                           "or ALiBi's per-head distance biases (Baichuan-13B)")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    rope_scaling: Optional[RopeScaling] = Field(None, description="{type: linear|llama3|yarn, factor, ...}")
    qkv_bias: bool = Field(False, description="bias on q/k/v projections (Qwen2, GPT-2)")
    out_bias: bool = Field(False, description="bias on the attention output projection")
    mlp_bias: bool = Field(False, description="bias on MLP projections (GPT-2)")
    norm_bias: bool = Field(True, description="LayerNorm bias (ignored for RMSNorm)")
    tie_embeddings: bool = Field(False, description="output projection shares the embedding matrix")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on embeddings, attention and residuals")
    initializer_range: float = Field(0.02, gt=0, description="std of the normal weight init")
    use_flash_attention: bool = Field(True, description="fused attention kernels where the device has them")
    qk_norm: bool = Field(False, description="RMSNorm over each head's queries and keys before RoPE (Qwen3)")
    partial_rotary_factor: float = Field(1.0, gt=0, le=1, description="share of each head's dims RoPE rotates, "
                                         "the first ones (GLM-4: 0.5)")
    rope_interleave: bool = Field(False, description="RoPE rotates neighbouring pairs (x0, x1), (x2, x3)... "
                                  "(DeepSeek-V3, GLM-4) instead of the two halves (LLaMA)")
    attention_scale: Optional[float] = Field(None, gt=0, description="softmax scale of the attention scores "
                                             "(default 1/sqrt(query head dim); Gemma 3: query_pre_attn_scalar^-0.5)")
    sliding_window: int = Field(0, ge=0, le=MAX_POSITIONS, description="attention looks back at most this many "
                                "tokens in sliding blocks (0: every block attends to the whole prefix)")
    full_attention_every: int = Field(0, ge=0, le=MAX_LAYERS, description="with a sliding window, every n-th "
                                      "block (n-1, 2n-1, ...) attends fully (Gemma 3: 6); 0: every block slides")
    rope_local_theta: Optional[float] = Field(None, gt=0, description="RoPE base of the sliding blocks, without "
                                              "scaling (Gemma 3: 10000); default rope_theta")
    sandwich_norm: bool = Field(False, description="also a norm on the attention's and the MLP's outputs before "
                                "each residual add (GLM-4, Gemma 3)")
    norm_unit_offset: bool = Field(False, description="RMSNorm scales by 1 + weight, all in fp32 (Gemma)")
    scale_embeddings: bool = Field(False, description="embeddings multiplied by sqrt(hidden_size) (Gemma)")
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; models/latent_attention.py): keys and values
    # come from a rank-kv_lora_rank latent, and one rotary key of qk_rope_head_dim dims is shared by every head.
    kv_lora_rank: Optional[int] = Field(None, gt=0, le=MAX_WIDTH, description="multi-head latent attention: "
                                        "width of the compressed key/value latent (None: standard attention)")
    q_lora_rank: Optional[int] = Field(None, gt=0, le=MAX_WIDTH, description="latent attention: queries through "
                                       "a rank-q_lora_rank bottleneck (None: one projection)")
    qk_rope_head_dim: int = Field(64, gt=0, le=MAX_WIDTH, description="latent attention: the rotary dims of "
                                  "each query/key head (head_dim counts them)")
    v_head_dim: Optional[int] = Field(None, gt=0, le=MAX_WIDTH, description="latent attention: value head "
                                      "width (default head_dim)")
    # Mixture of experts (models/moe.py): the blocks `is_moe_layer` names route each token to experts.
    num_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="routed experts per MoE block; 0: a dense model")
    num_experts_per_tok: int = Field(2, ge=1, le=MAX_EXPERTS, description="experts each token goes to (top-k)")
    moe_intermediate_size: Optional[int] = Field(None, gt=0, le=MAX_WIDTH,
                                                 description="each expert's FFN width (default intermediate_size)")
    num_shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="shared experts every token also goes "
                                    "through, as one gated MLP this many expert widths wide (DeepSeek-V3)")
    first_k_dense: int = Field(0, ge=0, le=MAX_LAYERS, description="the first k blocks keep a dense feed-forward "
                               "(DeepSeek-V3's first_k_dense_replace)")
    moe_every: int = Field(1, ge=1, le=MAX_LAYERS, description="block i is MoE when (i + 1) % moe_every == 0 "
                           "(Qwen's decoder_sparse_step)")
    dense_layers: list[int] = Field(default_factory=list, description="blocks that stay dense (Qwen3-MoE's "
                                    "mlp_only_layers)")
    router_score: Literal["softmax", "sigmoid"] = Field("softmax", description="router scores: softmax over the "
                                                        "experts (Qwen, Mixtral) or sigmoid (DeepSeek-V3)")
    router_bias: bool = Field(False, description="a per-expert bias added to the scores for the choice only "
                              "(DeepSeek-V3's e_score_correction_bias; moved by moe_bias_update_rate)")
    norm_topk_prob: bool = Field(True, description="normalise the chosen experts' weights to sum to one")
    n_group: int = Field(1, ge=1, le=MAX_EXPERTS, description="expert groups for group-limited routing")
    topk_group: int = Field(1, ge=1, le=MAX_EXPERTS, description="groups each token may choose experts from")
    routed_scaling_factor: float = Field(1.0, gt=0, description="scale of the routed experts' weights")
    moe_aux_loss: Literal["seq", "batch"] = Field("seq", description="auxiliary balance loss per sequence "
                                                  "(DeepSeek-V3) or over each micro-batch (Switch, Mixtral)")
    moe_aux_loss_coef: float = Field(0.0, ge=0, description="weight of the auxiliary balance loss (0: off)")
    router_z_loss_coef: float = Field(0.0, ge=0, description="weight of the router z-loss (0: off)")
    moe_bias_update_rate: float = Field(0.0, ge=0, description="auxiliary-loss-free balancing: after each step "
                                        "each expert's router bias moves this much towards an even load "
                                        "(needs router_bias)")

    @model_validator(mode="after")
    def _derive_and_check(self) -> "ModelConfig":
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                    "change one of them or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.kv_lora_rank is not None:
            self._check_latent_attention()
        if self.position == "rope" and self.rope_dim % 2:
            raise ValueError(f"RoPE needs an even number of rotary dims, got {self.rope_dim}")
        if self.position == "alibi" and (self.sliding_window or self.latent_attention):
            raise ValueError("ALiBi's biases are for full attention: no sliding_window or latent attention with it")
        if self.full_attention_every and not self.sliding_window:
            raise ValueError("full_attention_every picks the blocks that do not slide: set sliding_window too")
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size, self.mlp, self.multiple_of)
        if self.num_experts:
            self._check_experts()
        return self

    def _check_latent_attention(self) -> None:
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if self.head_dim <= self.qk_rope_head_dim:
            raise ValueError(f"latent attention: head_dim {self.head_dim} (the query/key head) must be more than "
                             f"qk_rope_head_dim {self.qk_rope_head_dim} (its rotary part)")
        if self.num_kv_heads != self.num_heads:
            raise ValueError("latent attention gives every head its own key and value: set num_kv_heads to "
                             f"num_heads ({self.num_heads}) or leave it out")
        if self.position != "rope" or self.partial_rotary_factor != 1.0 or self.qk_norm:
            raise ValueError("latent attention has its own rotary key (qk_rope_head_dim): it takes position: rope, "
                             "no partial_rotary_factor and no qk_norm")

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The dims of each query/key head RoPE rotates (the RoPE tables' width)."""
        if self.latent_attention:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def value_dim(self) -> int:
        """Each value head's width."""
        return self.v_head_dim if self.latent_attention else self.head_dim

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether block `layer` attends through the sliding window."""
        return bool(self.sliding_window) and not (self.full_attention_every
                                                  and (layer + 1) % self.full_attention_every == 0)

    def _check_experts(self) -> None:
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        e, k = self.num_experts, self.num_experts_per_tok
        if k > e:
            raise ValueError(f"num_experts_per_tok {k} is more than num_experts {e}")
        if e % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"group-limited routing needs n_group ({self.n_group}) to divide num_experts ({e}) "
                             f"and topk_group ({self.topk_group}) <= n_group")
        if self.n_group > 1 and self.topk_group * (e // self.n_group) < k:
            raise ValueError(f"topk_group {self.topk_group} groups of {e // self.n_group} experts hold fewer than "
                             f"num_experts_per_tok {k}")
        if self.moe_bias_update_rate and not self.router_bias:
            raise ValueError("moe_bias_update_rate moves the router's expert bias: set router_bias: true too")
        if self.mlp != "gated":
            raise ValueError("mixture-of-experts blocks have gated experts: set mlp: gated")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} are not blocks of a {self.num_layers}-layer model")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has a mixture of experts in place of its dense feed-forward."""
        return (self.num_experts > 0 and layer >= self.first_k_dense and layer not in self.dense_layers
                and (layer + 1) % self.moe_every == 0)


def default_intermediate_size(hidden_size: int, mlp: str, multiple_of: int = 256) -> int:
    """LLaMA's rule (2/3 of 4h, rounded up to `multiple_of`) for gated MLPs, else 4h."""
    if mlp == "plain":
        return 4 * hidden_size
    width = int(2 * (4 * hidden_size) / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)
