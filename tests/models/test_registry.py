"""Named presets: unique names, helpful errors, overlay of user keys on a preset."""

import inspect

import pytest

from shardwise.errors import ConfigError
from shardwise.models import (
    ModelConfig,
    get_preset,
    preset_names,
    register_preset,
    resolve_model_config,
)
from shardwise.models.registry import unregister_preset

REQUIRED = [
    "llama_7b", "llama_13b", "llama_65b", "llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b", "llama3_70b",
    "llama3.1_8b", "qwen2_0.5b", "qwen2_1.5b", "qwen2_7b", "mistral_7b", "baichuan_7b", "baichuan_13b",
    "gpt2", "gpt2_medium", "gpt2_large", "gpt2_xl", "gpt_13b", "llm_100b",
    "tiny_llama", "tiny_gpt2", "demo_llama", "bench_llama",
]


def test_builtin_presets_are_registered_and_valid():
    names = preset_names()
    assert names == sorted(names)
    for name in REQUIRED:
        assert name in names
        cfg = resolve_model_config({"preset": name})
        assert cfg.preset == name


def test_duplicate_registration_names_the_name_and_where_it_was_first_registered():
    register_preset("my_test_model", hidden_size=64, num_heads=4, num_layers=1, vocab_size=100)
    first_line = inspect.currentframe().f_lineno - 1
    try:
        with pytest.raises(ConfigError) as info:
            register_preset("my_test_model", hidden_size=128, num_heads=4)
        message = str(info.value)
        assert "'my_test_model'" in message
        assert f"{__file__}:{first_line}" in message
        assert "unregister_preset('my_test_model')" in message
        # The first registration is untouched.
        assert get_preset("my_test_model")["hidden_size"] == 64
    finally:
        unregister_preset("my_test_model")
    assert "my_test_model" not in preset_names()
    # After unregistering, the name is free again.
    register_preset("my_test_model", hidden_size=128, num_heads=4)
    unregister_preset("my_test_model")


def test_builtin_name_cannot_be_taken_and_points_to_presets_file():
    with pytest.raises(ConfigError, match=r"'llama_7b' is already registered .*presets\.py:\d+"):
        register_preset("llama_7b", hidden_size=64)


def test_unknown_preset_lists_known_names_and_closest_match():
    with pytest.raises(ConfigError) as info:
        get_preset("llama3_8")
    message = str(info.value)
    assert "Did you mean 'llama3_8b'?" in message
    assert "tiny_gpt2" in message and "qwen2_7b" in message
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        unregister_preset("nope")
    with pytest.raises(ConfigError, match="unknown model preset"):
        resolve_model_config({"preset": "lama_7b"})


def test_invalid_preset_fields_fail_at_registration():
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        register_preset("bad_one", num_layer=3)
    with pytest.raises(ConfigError, match="num_heads"):
        register_preset("bad_two", hidden_size=64, num_heads=5)
    assert "bad_one" not in preset_names() and "bad_two" not in preset_names()


def test_get_preset_returns_a_copy():
    fields = get_preset("llama3.1_8b")
    fields["rope_scaling"]["factor"] = 99.0
    fields["hidden_size"] = 1
    again = get_preset("llama3.1_8b")
    assert again["rope_scaling"]["factor"] == 8.0 and again["hidden_size"] == 4096


def test_resolve_overlays_user_keys_on_the_preset():
    cfg = resolve_model_config({"preset": "llama3_8b", "num_layers": 2, "dropout": 0.1})
    assert (cfg.num_layers, cfg.dropout) == (2, 0.1)
    assert (cfg.vocab_size, cfg.num_kv_heads, cfg.intermediate_size, cfg.rope_theta) == (128256, 8, 14336, 500000.0)
    assert cfg.preset == "llama3_8b"


def test_resolve_model_config_instance_keeps_preset_sizes_unless_given():
    # A ModelConfig validated elsewhere has derived kv heads / head dim / FFN from the default sizes;
    # those must not override the preset's.
    cfg = resolve_model_config(ModelConfig(preset="llama2_70b"))
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (8192, 64, 8, 28672)
    cfg = resolve_model_config(ModelConfig(preset="llama2_70b", num_kv_heads=16, num_heads=32))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (32, 16, 8192)
    plain = ModelConfig(hidden_size=64, num_heads=4)
    assert resolve_model_config(plain) is plain
    assert resolve_model_config(None) == ModelConfig()


def test_resolve_reports_bad_overrides_as_config_errors():
    with pytest.raises(ConfigError, match=r"num_layer: unknown field; did you mean 'num_layers'"):
        resolve_model_config({"preset": "tiny_llama", "num_layer": 3})
    with pytest.raises(ConfigError, match="norm"):
        resolve_model_config({"preset": "tiny_llama", "norm": "batchnorm"})
    with pytest.raises(ConfigError, match="mapping"):
        resolve_model_config(["tiny_llama"])


def test_presets_carry_the_published_architecture():
    l31 = resolve_model_config({"preset": "llama3.1_8b"})
    assert l31.max_position_embeddings == 131072
    assert l31.rope_scaling.type == "llama3" and l31.rope_scaling.factor == 8.0
    assert (l31.rope_scaling.low_freq_factor, l31.rope_scaling.high_freq_factor) == (1.0, 4.0)
    assert l31.rope_scaling.original_max_position_embeddings == 8192

    q = resolve_model_config({"preset": "qwen2_0.5b"})
    assert (q.qkv_bias, q.out_bias, q.tie_embeddings, q.vocab_size, q.rope_theta) == (True, False, True, 151936, 1e6)
    assert not resolve_model_config({"preset": "qwen2_7b"}).tie_embeddings

    g = resolve_model_config({"preset": "gpt2_xl"})
    assert (g.norm, g.position, g.mlp, g.activation) == ("layernorm", "learned", "plain", "gelu_tanh")
    assert (g.qkv_bias, g.out_bias, g.mlp_bias, g.tie_embeddings) == (True, True, True, True)
    assert (g.hidden_size, g.num_layers, g.num_heads, g.vocab_size, g.max_position_embeddings) == (
        1600, 48, 25, 50257, 1024)

    g3 = resolve_model_config({"preset": "gpt_13b"})
    assert (g3.hidden_size, g3.num_layers, g3.num_heads, g3.head_dim, g3.max_position_embeddings) == (
        5140, 40, 40, 128, 2048)

    big = resolve_model_config({"preset": "llm_100b"})
    assert (big.hidden_size, big.num_layers, big.num_heads, big.vocab_size, big.max_position_embeddings) == (
        8192, 80, 64, 32000, 4096)

    l70 = resolve_model_config({"preset": "llama2_70b"})
    assert (l70.num_kv_heads, l70.intermediate_size) == (8, 28672)
    tiny = resolve_model_config({"preset": "tiny_llama"})
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads,
            tiny.intermediate_size, tiny.max_position_embeddings) == (512, 64, 2, 4, 2, 160, 256)
