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


class RopeScaling(BaseModel):
    """RoPE frequency scaling as in Hugging Face configs (`linear` or LLaMA-3's `llama3`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["linear", "llama3"] = "linear"
    factor: float = Field(1.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)


class ModelConfig(BaseModel):
    """Architecture of one decoder. Missing sizes are derived (kv heads, head dim, FFN width)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    preset: Optional[str] = Field(None, description="named preset whose values fill unset fields")
    init_from: Optional[str] = Field(
        None, description="start from these weights: a Hugging Face model dir or a shardwise checkpoint/run "
        "dir (the architecture comes from it)"
    )
    model_type: Literal["llama", "qwen2", "gpt2", "mistral", "baichuan", "gpt"] = Field(
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
    position: Literal["rope", "learned"] = Field("rope", description="rotary or learned absolute positions")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    rope_scaling: Optional[RopeScaling] = Field(None, description="{type: linear|llama3, factor, ...}")
    qkv_bias: bool = Field(False, description="bias on q/k/v projections (Qwen2, GPT-2)")
    out_bias: bool = Field(False, description="bias on the attention output projection")
    mlp_bias: bool = Field(False, description="bias on MLP projections (GPT-2)")
    norm_bias: bool = Field(True, description="LayerNorm bias (ignored for RMSNorm)")
    tie_embeddings: bool = Field(False, description="output projection shares the embedding matrix")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on embeddings, attention and residuals")
    initializer_range: float = Field(0.02, gt=0, description="std of the normal weight init")
    use_flash_attention: bool = Field(True, description="fused attention kernels where the device has them")

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
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size, self.mlp, self.multiple_of)
        return self


def default_intermediate_size(hidden_size: int, mlp: str, multiple_of: int = 256) -> int:
    """LLaMA's rule (2/3 of 4h, rounded up to `multiple_of`) for gated MLPs, else 4h."""
    if mlp == "plain":
        return 4 * hidden_size
    width = int(2 * (4 * hidden_size) / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)
