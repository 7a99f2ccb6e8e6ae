"""Hugging Face import and export: logits equal transformers' both ways, sharded files, clear errors."""

import importlib
import json
from pathlib import Path

import pytest
import torch

from shardwise.errors import CheckpointError, ConfigError
from shardwise.models import ModelConfig, build_model
from shardwise.models.hf import from_hf, load_hf_config, load_hf_weights, save_hf

transformers = pytest.importorskip("transformers")

_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager")
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **_SMALL, num_key_value_heads=2, tie_word_embeddings=False, rope_parameters=_LLAMA3))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_SMALL, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _mistral():  # every block slides over 5 tokens (the test sequences are 16 long)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **_SMALL, num_key_value_heads=1, head_dim=8, sliding_window=5))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **_SMALL, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True))


def _qwen3_moe():  # block 0 routed over 4 experts (top 2, weights normalised), block 1 dense (mlp_only_layers)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_SMALL, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**_SMALL, "intermediate_size": 24}, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def _deepseek_v3():
    """MLA with a query bottleneck, YaRN, interleaved RoPE; block 0 dense, block 1 routed over 8 experts in 4
    groups (2 chosen) with a shared expert, sigmoid scores, a correction bias and routed scaling."""
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**_SMALL, "max_position_embeddings": 256}, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1,
        routed_scaling_factor=2.5, rope_parameters=_YARN, pad_token_id=0))


def _glm4():  # sandwich norms, fused gate/up, q/k/v biases, interleaved RoPE on half of each head
    return transformers.Glm4ForCausalLM(transformers.Glm4Config(
        **_SMALL, num_key_value_heads=2, head_dim=8, pad_token_id=0))


def _glm4_moe():  # half-head RoPE (halves), q/k norms, DeepSeek-style routing with groups, block 0 dense
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **_SMALL, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True,
        attention_bias=True, routed_scaling_factor=1.5, pad_token_id=0))


def _gemma3(tied: bool = True):  # sliding window of 4 in blocks 0 and 2, block 1 global with linear-scaled RoPE
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**_SMALL, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=12,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, pad_token_id=0,
        tie_word_embeddings=tied))


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "mistral": _mistral, "gpt2": _gpt2, "qwen3": _qwen3,
            "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3, "glm4": _glm4,
            "glm4_moe": _glm4_moe, "gemma3": _gemma3}
TIED = ("qwen2", "gpt2", "qwen3", "gemma3")


# Gemma's scaled, tied embeddings make a random model repeat its last token: untied for the generation test.
FOR_GENERATION = {**FAMILIES, "gemma3": lambda: _gemma3(tied=False)}


def _make(family: str, tmp_path, noise: float = 0.05, builders=FAMILIES, **save_kwargs):
    torch.manual_seed(0)
    hf = builders[family]().eval()
    with torch.no_grad():  # distinctive weights, norms included, so a wrong mapping cannot hide
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * noise)
    path = tmp_path / f"hf_{family}"
    hf.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return hf, path


def _tokens(length: int = 16):
    return torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(1))


def _positions():
    # Far positions exercise llama3's scaled low frequencies.
    return torch.arange(40, 56).expand(2, 16)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_and_save_hf_match_transformers(family, tmp_path):
    hf, path = _make(family, tmp_path)
    model = from_hf(path).eval()
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens, position_ids=_positions()).logits
        got = model(tokens, position_ids=_positions())
    assert expected.std() > 0.1
    assert (got - expected).abs().max() <= 1e-4
    assert (model.output.weight is model.tok_embeddings.weight) == (family in TIED)

    out = save_hf(model, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        again = back(input_ids=tokens, position_ids=_positions()).logits
    assert (again - expected).abs().max() <= 1e-4
    assert (out / "generation_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(hf).__name__]


def test_config_fields(tmp_path):
    _, path = _make("llama", tmp_path)
    cfg = load_hf_config(path)
    assert (cfg.model_type, cfg.num_kv_heads, cfg.tie_embeddings, cfg.norm_eps) == ("llama", 2, False, 1e-6)
    assert cfg.rope_scaling.type == "llama3" and cfg.rope_scaling.original_max_position_embeddings == 64
    _, path = _make("qwen2", tmp_path)
    cfg = load_hf_config(path)
    assert cfg.qkv_bias and not cfg.out_bias and cfg.tie_embeddings and cfg.rope_theta == 1e6
    _, path = _make("gpt2", tmp_path)
    cfg = load_hf_config(path)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.activation) == (128, 64, "gelu_tanh")
    # Pre-5 transformers spelling of RoPE settings.
    legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    cfg = load_hf_config(tmp_path / "legacy")
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.type == "linear" and cfg.rope_scaling.factor == 2.0


def test_sharded_checkpoints_load_and_save(tmp_path):
    hf, path = _make("llama", tmp_path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    model = from_hf(path).eval()
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (model(tokens) - expected).abs().max() <= 1e-4
    out = save_hf(model, tmp_path / "export", max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (back(input_ids=tokens).logits - expected).abs().max() <= 1e-4
    assert (from_hf(out)(tokens) - expected).abs().max() <= 1e-4


def test_save_hf_writes_tokenizer_and_generation_config(tmp_path):
    class FakeTokenizer:
        bos_id, eos_id, pad_id = 1, 2, 2

        def save(self, directory):
            (directory / "tokenizer.json").write_text("{}")

    model = build_model(ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=48,
                                    max_position_embeddings=64))
    out = save_hf(model, tmp_path / "out", tokenizer=FakeTokenizer())
    assert (out / "tokenizer.json").is_file()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2


# ---- bad input ----

def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ConfigError, match="FalconForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                          "Qwen3MoeForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
                                          "DeepseekV3ForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, "
                                          "Gemma3ForCausalLM, BaiChuanForCausalLM, BaichuanForCausalLM, "
                                          "GPT2LMHeadModel"):
        load_hf_config(tmp_path)


def test_missing_shard_is_named(tmp_path):
    _, path = _make("llama", tmp_path, max_shard_size="20KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        from_hf(path)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    _, path = _make("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(cfg))
    shapes = r"mlp\.\w+_proj\.weight.*shape \((48, 32|32, 48)\).*expects \((40, 32|32, 40)\)"
    with pytest.raises(CheckpointError, match=shapes):
        from_hf(path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    _, path = _make("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.2\.attention\.wq\.weight"):
        from_hf(path)
    cfg["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        from_hf(path)
    model = build_model(load_hf_config(path))
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_weights(model, path)


def test_pickle_weights_are_refused_with_how_to_convert(tmp_path, monkeypatch):
    """A directory with its weights as pytorch_model.bin (what transformers wrote before safetensors) is
    refused unread (torch.load never runs), and the message says how to convert it."""
    hf, path = _make("llama", tmp_path)
    (path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), path / "pytorch_model.bin")

    def no_unpickling(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("torch.load was called on a model directory")
    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin, a pickle.*safetensors only.*"
                                              r"AutoModelForCausalLM\.from_pretrained\(.*\)\.save_pretrained\("
                                              r"'OUT', safe_serialization=True\)"):
        from_hf(path)


@pytest.mark.parametrize("where", ["../outside.safetensors", "/abs/model.safetensors", "sub/model.safetensors",
                                   "model-00001-of-00002.bin"])
def test_index_naming_a_file_elsewhere_is_refused(tmp_path, where):
    """The shard index may name plain .safetensors files of the directory only."""
    _, path = _make("llama", tmp_path, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = where
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"maps {name} to '{where}', which is not a \.safetensors file name"):
        from_hf(path)


def test_unreadable_weights_and_config_are_named(tmp_path):
    _, path = _make("llama", tmp_path)
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        from_hf(path)
    (path / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"config\.json: holds a list, not a JSON object"):
        load_hf_config(path)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4", "glm4_moe", "gemma3"])
def test_greedy_generation_follows_transformers(family, tmp_path):
    """Imported weights continue a prompt token for token as transformers' greedy generate does (the MoE
    families route every new token through the cached decoding path too)."""
    from shardwise.models import generate

    # Peaked logits: no near-ties, no one-token loop (GLM-4.5's tiny model loops at 0.5).
    hf, path = _make(family, tmp_path, noise=0.8 if family == "glm4_moe" else 0.5, builders=FOR_GENERATION)
    model = from_hf(path).eval()
    prompt = [5, 17, 3, 42, 8]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=10, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, [prompt], max_new_tokens=10)[0] == theirs
    assert len(set(theirs)) > 2  # not one token repeated


def test_the_real_weights_check_holds_a_directory_to_transformers(tmp_path, monkeypatch):
    """scripts/check_hf_logits.py, which users run on published weights (this machine cannot download them),
    passes a directory shardwise reads right and fails one whose weights it would read wrong."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    check_hf_logits = importlib.import_module("check_hf_logits")
    _, path = _make("qwen3_moe", tmp_path, noise=0.5, builders=FOR_GENERATION)  # peaked logits, as trained ones
    assert check_hf_logits.main([str(path), "--tokens", "16", "--new", "4"]) == 0
    result = check_hf_logits.check(path, tokens=16, new=4)
    assert result["within_bar"] and result["greedy_equal"] and result["max_logit_diff"] <= 1e-4
    monkeypatch.setattr(check_hf_logits, "from_hf", lambda d: _shifted(from_hf(d)))
    assert check_hf_logits.main([str(path), "--tokens", "16", "--new", "4"]) == 1


def _shifted(model):
    """`model` with one weight nudged: what a wrong import would give."""
    with torch.no_grad():
        model.layers["0"].attention.wq.weight.add_(0.05)
    return model
