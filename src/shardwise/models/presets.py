"""The built-in model presets as plain data: name -> `ModelConfig` fields (`registry.py` registers them).

Sizes are the published ones (the Hugging Face `config.json` of each official checkpoint unless a
comment says otherwise), so `count_parameters` gives the well-known totals (LLaMA-7B 6,738,415,616).
Each entry starts a line with its quoted name, so that an error about a built-in name can point to
its line here.
"""

from __future__ import annotations

from typing import Any

# Family defaults; each preset below lists only its sizes on top of one of these.
_LLAMA = dict(model_type="llama", norm="rmsnorm", mlp="gated", activation="silu", position="rope")
_LLAMA3 = dict(_LLAMA, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, norm_eps=1e-5)
_QWEN2 = dict(_LLAMA, model_type="qwen2", vocab_size=151936, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6,
              # Qwen2 was trained at 32K; the 131072 in its config.json needs YaRN, which we do not have.
              max_position_embeddings=32768)
# Qwen3: no biases, each head's queries and keys RMS-normalised, head_dim 128 whatever the width.
_QWEN3 = dict(_LLAMA, model_type="qwen3", vocab_size=151936, qk_norm=True, head_dim=128, rope_theta=1000000.0,
              norm_eps=1e-6, max_position_embeddings=40960)
# Qwen3-MoE: every block a mixture of 128 experts, 8 per token, the chosen weights normalised.
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
# DeepSeek-V3: multi-head latent attention with YaRN (4K pretraining context x 40), interleaved RoPE
# pairs; after the first dense blocks, 256 routed experts in 8 groups (4 chosen, 8 experts per token) scored
# by sigmoid with a correction bias, one shared expert, routed weights scaled by 2.5.
_DEEPSEEK_V3 = dict(_LLAMA, model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61,
                    num_heads=128, intermediate_size=18432, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                    head_dim=192, v_head_dim=128, rope_interleave=True, rope_theta=10000.0,
                    rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                    max_position_embeddings=163840, norm_eps=1e-6, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=2048, num_shared_experts=1, first_k_dense=3, router_score="sigmoid",
                    router_bias=True, norm_topk_prob=True, n_group=8, topk_group=4, routed_scaling_factor=2.5)
# GLM-4 (the 0414 release, Glm4ForCausalLM): norms after attention and MLP too, q/k/v biases, RoPE on the
# first half of each head in interleaved pairs.
_GLM4 = dict(_LLAMA, model_type="glm4", vocab_size=151552, head_dim=128, qkv_bias=True, partial_rotary_factor=0.5,
             rope_interleave=True, sandwich_norm=True, norm_eps=1e-5, max_position_embeddings=32768)
# GLM-4.5: DeepSeek-V3-style routing (sigmoid, correction bias, shared expert), half-head RoPE in halves.
_GLM45 = dict(_LLAMA, model_type="glm4_moe", vocab_size=151552, head_dim=128, qkv_bias=True,
              partial_rotary_factor=0.5, rope_theta=1000000.0, max_position_embeddings=131072, norm_eps=1e-5,
              num_experts_per_tok=8, num_shared_experts=1, router_score="sigmoid", router_bias=True,
              norm_topk_prob=True)
# Gemma 3 (text): five sliding-window blocks (1024 tokens, RoPE base 10K) per global one (base 1M, linear x8
# from 4B up), norms after attention and MLP, norms scale by 1 + weight, embeddings x sqrt(hidden), tied.
_GEMMA3 = dict(_LLAMA, model_type="gemma3", vocab_size=262208, activation="gelu_tanh", head_dim=256, qk_norm=True,
               sandwich_norm=True, norm_unit_offset=True, scale_embeddings=True, attention_scale=256 ** -0.5,
               sliding_window=1024, full_attention_every=6, rope_theta=1000000.0, rope_local_theta=10000.0,
               rope_scaling=dict(type="linear", factor=8.0), max_position_embeddings=131072, norm_eps=1e-6,
               tie_embeddings=True)
_GPT2 = dict(
    model_type="gpt2", norm="layernorm", norm_eps=1e-5, mlp="plain", activation="gelu_tanh", position="learned",
    qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True, tie_embeddings=True,
    vocab_size=50257, max_position_embeddings=1024,
)

PRESETS: dict[str, dict[str, Any]] = {
    # LLaMA 1 (Touvron et al. 2023). HF's converted configs use rms_norm_eps 1e-6 for 7B/13B, 1e-5 for 65B.
    "llama_7b": dict(_LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                     intermediate_size=11008, max_position_embeddings=2048, norm_eps=1e-6),
    "llama_13b": dict(_LLAMA, vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40,
                      intermediate_size=13824, max_position_embeddings=2048, norm_eps=1e-6),
    "llama_65b": dict(_LLAMA, vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64,
                      intermediate_size=22016, max_position_embeddings=2048, norm_eps=1e-5),

    # LLaMA 2: same shapes as LLaMA 1 at 7B/13B, 4K context; 70B adds grouped-query attention.
    "llama2_7b": dict(_LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      intermediate_size=11008, max_position_embeddings=4096, norm_eps=1e-5),
    "llama2_13b": dict(_LLAMA, vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40,
                       intermediate_size=13824, max_position_embeddings=4096, norm_eps=1e-5),
    "llama2_70b": dict(_LLAMA, vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, intermediate_size=28672, max_position_embeddings=4096, norm_eps=1e-5),

    # LLaMA 3 / 3.1: 128K vocabulary, GQA everywhere; 3.1 stretches RoPE to 128K positions.
    "llama3_8b": dict(_LLAMA3, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336),
    "llama3_70b": dict(_LLAMA3, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672),
    "llama3.1_8b": dict(_LLAMA3, max_position_embeddings=131072, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, intermediate_size=14336,
                        rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),

    # Qwen2: LLaMA plus bias on q/k/v. The small ones tie embeddings; 7B has a padded 152064 vocabulary.
    "qwen2_0.5b": dict(_QWEN2, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                       intermediate_size=4864, tie_embeddings=True),
    "qwen2_1.5b": dict(_QWEN2, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                       intermediate_size=8960, tie_embeddings=True),
    "qwen2_7b": dict(_QWEN2, vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                     num_kv_heads=4, intermediate_size=18944),

    # Qwen3 dense (the 0.6B-4B tie their embeddings).
    "qwen3_0.6b": dict(_QWEN3, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       intermediate_size=3072, tie_embeddings=True),
    "qwen3_1.7b": dict(_QWEN3, hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                       intermediate_size=6144, tie_embeddings=True),
    "qwen3_4b": dict(_QWEN3, hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8,
                     intermediate_size=9728, tie_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                     intermediate_size=12288),
    "qwen3_14b": dict(_QWEN3, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=8,
                      intermediate_size=17408),
    "qwen3_32b": dict(_QWEN3, hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8,
                      intermediate_size=25600),
    # Qwen3 mixtures of experts (intermediate_size is the dense width mlp_only_layers would use: none here).
    "qwen3_30b_a3b": dict(_QWEN3_MOE, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                          intermediate_size=6144, moe_intermediate_size=768),
    "qwen3_235b_a22b": dict(_QWEN3_MOE, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                            intermediate_size=12288, moe_intermediate_size=1536),
    # Mixtral-8x7B-v0.1: Mistral-7B's attention, 8 experts of Mistral's MLP, 2 per token.
    "mixtral_8x7b": dict(_LLAMA, model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32,
                         num_heads=32, num_kv_heads=8, intermediate_size=14336, moe_intermediate_size=14336,
                         num_experts=8, num_experts_per_tok=2, rope_theta=1000000.0,
                         max_position_embeddings=32768, norm_eps=1e-5),

    # DeepSeek-V3 (671B total, 37B active; its multi-token-prediction layer is not modelled).
    "deepseek_v3_671b": dict(_DEEPSEEK_V3),
    # Kimi-K2 (Moonshot AI, 2025): DeepSeek-V3's architecture at 1.04T parameters (32B active): 384 experts in
    # one group, one dense block, 64 heads; the source documents' "beyond a trillion parameters" at today's shape.
    "kimi_k2_1t": dict(_DEEPSEEK_V3, vocab_size=163840, num_heads=64, num_experts=384, first_k_dense=1, n_group=1,
                       topk_group=1, routed_scaling_factor=2.827, rope_theta=50000.0, max_position_embeddings=131072,
                       rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                         beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    "glm4_9b": dict(_GLM4, hidden_size=4096, num_layers=40, num_heads=32, num_kv_heads=2, intermediate_size=13696),
    # GLM-4.5-Air (106B total, 12B active) and GLM-4.5 (355B, 32B); their multi-token-prediction layer is not
    # modelled.
    "glm4.5_air": dict(_GLM45, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
                       intermediate_size=10944, moe_intermediate_size=1408, num_experts=128, first_k_dense=1),
    "glm4.5": dict(_GLM45, hidden_size=5120, num_layers=92, num_heads=96, num_kv_heads=8, intermediate_size=12288,
                   moe_intermediate_size=1536, num_experts=160, first_k_dense=3, routed_scaling_factor=2.5,
                   qk_norm=True),
    # Gemma 3; the 1B has its own vocabulary, a 512-token window, a 32K context and no RoPE scaling; the 27B
    # heads are 128 wide with query_pre_attn_scalar 168.
    "gemma3_1b": dict(_GEMMA3, vocab_size=262144, hidden_size=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                      intermediate_size=6912, sliding_window=512, rope_scaling=None, max_position_embeddings=32768),
    "gemma3_4b": dict(_GEMMA3, hidden_size=2560, num_layers=34, num_heads=8, num_kv_heads=4,
                      intermediate_size=10240),
    "gemma3_12b": dict(_GEMMA3, hidden_size=3840, num_layers=48, num_heads=16, num_kv_heads=8,
                       intermediate_size=15360),
    "gemma3_27b": dict(_GEMMA3, hidden_size=5376, num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
                       intermediate_size=21504, attention_scale=168 ** -0.5),

    # Mistral-7B-v0.1: every block attends through a 4096-token sliding window.
    "mistral_7b": dict(_LLAMA, model_type="mistral", vocab_size=32000, hidden_size=4096,
                       num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                       max_position_embeddings=32768, norm_eps=1e-5, sliding_window=4096),

    # Baichuan: LLaMA shapes with a 64K vocabulary (its fused W_pack q/k/v is only a storage layout).
    "baichuan_7b": dict(_LLAMA, model_type="baichuan", vocab_size=64000, hidden_size=4096,
                        num_layers=32, num_heads=32, intermediate_size=11008, max_position_embeddings=4096,
                        norm_eps=1e-6),
    # Baichuan-13B: ALiBi position biases instead of RoPE.
    "baichuan_13b": dict(_LLAMA, model_type="baichuan", position="alibi", vocab_size=64000, hidden_size=5120,
                         num_layers=40, num_heads=40, intermediate_size=13696, max_position_embeddings=4096,
                         norm_eps=1e-6),

    # GPT-2 (Radford et al. 2019), the four released sizes.
    "gpt2": dict(_GPT2, hidden_size=768, num_layers=12, num_heads=12),
    "gpt2_medium": dict(_GPT2, hidden_size=1024, num_layers=24, num_heads=16),
    "gpt2_large": dict(_GPT2, hidden_size=1280, num_layers=36, num_heads=20),
    "gpt2_xl": dict(_GPT2, hidden_size=1600, num_layers=48, num_heads=25),

    # GPT-3 13B (Brown et al. 2020, table 2.1): d_model 5140 with 40 heads of 128 (so q/k/v are 5140 -> 5120),
    # 2048 context, GPT-2 style blocks. GPT-3's alternating locally-banded sparse attention is not modelled.
    "gpt_13b": dict(_GPT2, model_type="gpt", max_position_embeddings=2048, hidden_size=5140,
                    num_layers=40, num_heads=40, head_dim=128, intermediate_size=4 * 5140),

    # The model section of seed 002's llm_pretrain.yaml (FFN width by the LLaMA rule: 22016). With those
    # sizes it has about 65B parameters, not 100B; the name follows the document.
    "llm_100b": dict(_LLAMA, vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64,
                     max_position_embeddings=4096, use_flash_attention=True),

    # Small models for tests, demos and benchmarks.
    "tiny_llama": dict(_LLAMA, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=160, max_position_embeddings=256),
    "tiny_gpt2": dict(_GPT2, vocab_size=512, max_position_embeddings=256, hidden_size=64,
                      num_layers=2, num_heads=4, intermediate_size=256),
    "demo_llama": dict(_LLAMA, vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4,
                       intermediate_size=688, max_position_embeddings=512),
    # Qwen3-30B-A3B's shape scaled down (2 of 48 blocks, widths / 16): 16 experts, 4 per token.
    "tiny_qwen3_moe": dict(_QWEN3_MOE, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16, intermediate_size=160, moe_intermediate_size=48, num_experts=16,
                           num_experts_per_tok=4, max_position_embeddings=256),
    # DeepSeek-V3's shape scaled down: latent attention, one dense block then 16 experts in 4 groups.
    "tiny_deepseek_v3": dict(_DEEPSEEK_V3, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                             intermediate_size=160, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, head_dim=24,
                             v_head_dim=16, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                             first_k_dense=1, n_group=4, topk_group=2, max_position_embeddings=256,
                             rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                               mscale=1.0, mscale_all_dim=1.0)),
    "tiny_baichuan_13b": dict(_LLAMA, model_type="baichuan", position="alibi", vocab_size=512, hidden_size=64,
                              num_layers=2, num_heads=4, intermediate_size=160, max_position_embeddings=256),
    "tiny_gemma3": dict(_GEMMA3, vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=160, sliding_window=32, full_attention_every=3,
                        max_position_embeddings=256, attention_scale=16 ** -0.5),
    "bench_llama": dict(_LLAMA, vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8,
                        intermediate_size=1408, max_position_embeddings=512),
}
