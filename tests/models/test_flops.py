"""Parameter counts (against our model and Hugging Face's) and training FLOPs per token."""

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.models import ModelConfig, Transformer, count_parameters, flops_per_token, resolve_model_config
from shardwise.models.flops import count_parameters_by_kind

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama": dict(preset="tiny_llama", num_kv_heads=4),
    "gqa": dict(preset="tiny_llama"),
    "gpt2_tied": dict(preset="tiny_gpt2"),
    "qwen2_bias_tied": dict(preset="qwen2_0.5b", vocab_size=300, hidden_size=48, num_layers=2, num_heads=6,
                            num_kv_heads=2, intermediate_size=80),
    "head_dim_not_hidden": dict(preset="gpt_13b", vocab_size=100, hidden_size=36, num_layers=3, num_heads=2,
                                head_dim=16, intermediate_size=144, max_position_embeddings=64),
    "everything_on": dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, qkv_bias=True, out_bias=True,
                          mlp_bias=True, norm="layernorm", position="learned", max_position_embeddings=40),
    "layernorm_no_bias": dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, norm="layernorm",
                              norm_bias=False, mlp="plain", mlp_bias=True),
}


def _meta_model_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


@pytest.mark.parametrize("name", list(CONFIGS))
def test_count_equals_the_built_model(name):
    cfg = resolve_model_config(CONFIGS[name])
    assert count_parameters(cfg) == _meta_model_params(cfg)
    kinds = count_parameters_by_kind(cfg)
    assert sum(kinds.values()) == count_parameters(cfg)
    assert (kinds["output"] == 0) == cfg.tie_embeddings


def test_published_totals():
    expected = {
        "llama_7b": 6_738_415_616,
        "llama2_70b": 68_976_648_192,
        "llama3_8b": 8_030_261_248,
        "llama3_70b": 70_553_706_496,
        "mistral_7b": 7_241_732_096,
        "qwen2_0.5b": 494_032_768,
        "qwen2_7b": 7_615_616_512,
        "gpt2": 124_439_808,
        "gpt2_xl": 1_557_611_200,
    }
    for name, total in expected.items():
        assert count_parameters(resolve_model_config({"preset": name})) == total, name


def _hf_llama(cfg: ModelConfig):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_embeddings,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(hf_cfg)


@pytest.mark.parametrize("preset", ["llama_7b", "llama2_70b", "llama3_8b", "tiny_llama"])
def test_llama_count_equals_hugging_face(preset):
    cfg = resolve_model_config({"preset": preset})
    assert count_parameters(cfg) == _hf_llama(cfg).num_parameters()


def test_qwen2_and_gpt2_counts_equal_hugging_face():
    q = resolve_model_config({"preset": "qwen2_0.5b"})
    gpt = resolve_model_config({"preset": "gpt2_medium"})
    with torch.device("meta"):
        hf_q = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=q.vocab_size, hidden_size=q.hidden_size, intermediate_size=q.intermediate_size,
            num_hidden_layers=q.num_layers, num_attention_heads=q.num_heads, num_key_value_heads=q.num_kv_heads,
            tie_word_embeddings=True))
        hf_gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=gpt.vocab_size, n_embd=gpt.hidden_size, n_layer=gpt.num_layers, n_head=gpt.num_heads,
            n_positions=gpt.max_position_embeddings))
    assert count_parameters(q) == hf_q.num_parameters() == 494_032_768
    assert count_parameters(gpt) == hf_gpt.num_parameters() == 354_823_168


def test_flops_per_token_llama_7b():
    cfg = resolve_model_config({"preset": "llama_7b"})
    # Matmul weights = total - embedding lookup (32000 * 4096) - 65 RMSNorms of 4096 = 6,607,077,376;
    # attention scores 12 * 32 layers * 32 heads * 128 * 2048 = 3,221,225,472.
    assert flops_per_token(cfg, 2048) == 6 * 6_607_077_376 + 3_221_225_472 == 42_863_689_728


def test_flops_per_token_counts_tied_output_projection():
    cfg = resolve_model_config({"preset": "gpt2"})
    # 12 * 4 * 768^2 (attention) + 12 * 2 * 768 * 3072 (mlp) + 50257 * 768 (logits, tied but still a matmul).
    matmul = 12 * 4 * 768 ** 2 + 12 * 2 * 768 * 3072 + 50257 * 768
    assert matmul == 123_532_032
    assert flops_per_token(cfg, 1024) == 6 * matmul + 12 * 12 * 12 * 64 * 1024 == 854_438_400
    # Longer sequences cost more only through the attention term.
    assert flops_per_token(cfg, 2048) - flops_per_token(cfg, 1024) == 12 * 12 * 12 * 64 * 1024


def test_flops_gqa_uses_smaller_kv_projections():
    cfg = resolve_model_config({"preset": "llama3_8b"})
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    expected = 6 * (32 * layer + 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(cfg, 8192) == expected


def test_flops_rejects_bad_sequence_length():
    with pytest.raises(ConfigError, match="seq_length"):
        flops_per_token(resolve_model_config({"preset": "tiny_llama"}), 0)
