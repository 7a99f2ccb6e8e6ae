"""LoRA: adapters equal peft's both ways (llama, qwen2, mistral, gpt2), merging, targeting, init, errors."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shardwise.errors import CheckpointError, ConfigError
from shardwise.models import ModelConfig, Transformer, build_model
from shardwise.models.hf import from_hf
from shardwise.peft import (
    LoRALinear,
    apply_lora,
    from_peft_state,
    is_lora_name,
    load_adapter,
    lora_init,
    lora_parameter_names,
    lora_state_dict,
    merge_lora,
    reset_lora_parameters,
    save_adapter,
    to_peft_state,
)
from shardwise.peft.lora import ARCH_METADATA_KEY

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL, num_key_value_heads=2,
                                                                  tie_word_embeddings=False))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_SMALL, num_key_value_heads=2,
                                                                  tie_word_embeddings=True))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_SMALL, num_key_value_heads=1, head_dim=8,
                                                                      sliding_window=None))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def _deepseek_v3():  # latent attention; block 1 routed with a shared expert (adapters on its shared MLP)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **_SMALL, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16,
        first_k_dense_replace=1, n_shared_experts=1, pad_token_id=0))


def _glm4():  # gate and up in one gate_up_proj: one peft adapter over our w1 and w3
    return transformers.Glm4ForCausalLM(transformers.Glm4Config(**_SMALL, num_key_value_heads=2, head_dim=8,
                                                                pad_token_id=0))


def _gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **_SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False))


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "mistral": _mistral, "gpt2": _gpt2, "deepseek_v3": _deepseek_v3,
            "glm4": _glm4, "gemma3": _gemma3}
# Every adaptable linear, in the HF names peft users write.
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "v_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    # Latent attention only: peft (0.18+) reads any gate_proj/up_proj/down_proj target of a transformers-5 MoE
    # model as the routed experts' fused tensors (its v4 -> v5 conversion), so adapters on the dense and shared
    # MLPs are checked by merging instead (test_moe_shared_expert_adapters_merge_exactly).
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "glm4": ["q_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gemma3": ["q_proj", "k_proj", "o_proj", "up_proj"],
}
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def _base(family, tmp_path):
    """A tiny random HF model (eval mode) saved under tmp_path, and its directory."""
    torch.manual_seed(0)
    hf = FAMILIES[family]().eval()
    with torch.no_grad():  # distinctive weights, so a wrong mapping cannot hide
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path / f"hf_{family}"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@torch.no_grad()
def _randomize_lora(model, seed=3):
    """Non-zero lora_A and lora_B, so the adapters change the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _logits(model):
    with torch.no_grad():
        out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def _tiny_cfg(**overrides):
    fields = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                  max_position_embeddings=32)
    fields.update(overrides)
    return ModelConfig(**fields)


# ---- peft parity ----

@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_adapter_loads_in_peft(family, tmp_path):
    hf, path = _base(family, tmp_path)
    base_logits = _logits(hf)
    model = from_hf(path).eval()
    drop = 0.1
    names = apply_lora(model, r=4, alpha=8, dropout=drop, target_modules=TARGETS[family])
    _randomize_lora(model)
    ours = _logits(model)
    adapter = save_adapter(lora_state_dict(model), model.cfg, r=4, alpha=8, dropout=drop,
                           target_modules=TARGETS[family], out_dir=tmp_path / "adapter",
                           base_model_name_or_path=str(path))

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == ("LORA", 4, 8, drop)
    assert sorted(config["target_modules"]) == sorted(TARGETS[family])
    assert config["fan_in_fan_out"] == (family == "gpt2")
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert json.loads(f.metadata()["shardwise_architecture"])["hidden_size"] == 32
    if family == "gpt2":
        assert "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight" in keys
        assert len(names) == 2 * 6 and len(keys) == 2 * 4 * 2  # c_attn, attn/mlp c_proj, c_fc per layer
    elif family == "deepseek_v3":  # every latent-attention projection
        assert "base_model.model.model.layers.1.self_attn.kv_b_proj.lora_A.weight" in keys
        assert len(keys) == 2 * len(names) == 2 * 2 * 5
    elif family == "glm4":  # w1 and w3 share one lora_A: one gate_up_proj adapter per layer
        assert "base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight" in keys
        assert len(keys) == 2 * (len(names) - 2)
    else:
        assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
        assert len(keys) == 2 * len(names)

    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    theirs = _logits(peft_model)
    assert (ours - base_logits).abs().max() > 0.05  # the adapter matters
    assert (theirs - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapter_loads_in_shardwise(family, tmp_path):
    hf, path = _base(family, tmp_path)
    base_logits = _logits(hf)
    rslora = family == "qwen2"  # alpha / sqrt(r) scaling
    drop = 0.05
    config = peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=drop, target_modules=TARGETS[family],
                             use_rslora=rslora, fan_in_fan_out=family == "gpt2")
    peft_model = peft.get_peft_model(hf, config).eval()
    _randomize_lora(peft_model, seed=5)
    theirs = _logits(peft_model)
    peft_model.save_pretrained(tmp_path / "peft_adapter")

    model = from_hf(path).eval()
    names = load_adapter(model, tmp_path / "peft_adapter")
    ours = _logits(model)
    assert (theirs - base_logits).abs().max() > 0.05
    assert (ours - theirs).abs().max() <= 1e-4
    module = model.get_submodule(names[0])
    assert module.scaling == pytest.approx(16 / math.sqrt(4) if rslora else 16 / 4)
    assert isinstance(module.lora_dropout, nn.Dropout) and module.lora_dropout.p == drop
    # Saving again gives peft's own tensors back (GPT-2's q/k/v re-fused exactly).
    again = save_adapter(lora_state_dict(model), model.cfg, r=4, alpha=16, dropout=drop, target_modules=None,
                         out_dir=tmp_path / "again", use_rslora=rslora)
    assert json.loads((again / "adapter_config.json").read_text())["use_rslora"] == rslora
    with safe_open(str(tmp_path / "peft_adapter" / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(again / "adapter_model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_partial_targets_export_exactly_those_modules(tmp_path):
    hf, path = _base("llama", tmp_path)
    model = from_hf(path).eval()
    names = apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=r"model\.layers\.1\.self_attn\.(q|v)_proj")
    assert names == ["layers.1.attention.wq", "layers.1.attention.wv"]
    _randomize_lora(model)
    adapter = save_adapter(lora_state_dict(model), model.cfg, 2, 4, 0.0, None, tmp_path / "adapter")
    # Not every layer has them, so the config names the full modules (a regex peft fullmatches).
    target = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(target, str)
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    wrapped = [n for n, m in peft_model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert wrapped == ["base_model.model.model.layers.1.self_attn.q_proj",
                       "base_model.model.model.layers.1.self_attn.v_proj"]
    assert (_logits(peft_model) - _logits(model)).abs().max() <= 1e-4


def test_gpt2_q_only_exports_zero_k_v_blocks(tmp_path):
    hf, path = _base("gpt2", tmp_path)
    model = from_hf(path).eval()
    assert apply_lora(model, r=2, alpha=2, dropout=0.0, target_modules=["attention.wq"]) == [
        "layers.0.attention.wq", "layers.1.attention.wq"]
    _randomize_lora(model)
    adapter = save_adapter(lora_state_dict(model), model.cfg, 2, 2, 0.0, ["attention.wq"], tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["c_attn"]
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        b = f.get_tensor("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight")
    assert b.shape == (96, 2) and b[:32].abs().sum() > 0 and torch.equal(b[32:], torch.zeros(64, 2))
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    assert (_logits(peft_model) - _logits(model)).abs().max() <= 1e-4


def _qwen3_moe():  # every block a mixture of 4 experts, no shared expert
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_SMALL, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None))


@pytest.mark.parametrize("family, targets", [("qwen3_moe", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
                                             ("mixtral", ["q_proj", "w1", "w3", "w2"])])
def test_routed_expert_adapters_load_in_peft(family, targets, tmp_path):
    """LoRA on the routed experts, one adapter per expert's gate, up and down projection: saved per expert
    (as peft saves LoRA on transformers 4's expert linears), which peft converts for transformers 5's fused
    experts, with our logits; it loads back exactly, and merges into the stacked weights."""
    FAMILIES[family] = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral}[family]
    try:
        hf, path = _base(family, tmp_path)
    finally:
        del FAMILIES[family]
    base_logits = _logits(hf)
    model = from_hf(path).eval()
    names = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=targets)
    assert {"layers.0.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2"} <= set(names)
    assert model.layers["1"].feed_forward.experts.lora["w3"].lora_A.weight.shape == (4, 4, 32)  # [experts, r, in]
    _randomize_lora(model)
    ours = _logits(model)
    adapter = save_adapter(lora_state_dict(model), model.cfg, r=4, alpha=8, dropout=0.0, target_modules=targets,
                           out_dir=tmp_path / "adapter")
    assert sorted(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == sorted(targets)
    experts = "mlp.experts" if family == "qwen3_moe" else "block_sparse_moe.experts"
    down = "down_proj" if family == "qwen3_moe" else "w2"
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert tuple(f.get_slice(f"base_model.model.model.layers.1.{experts}.3.{down}.lora_A.weight").get_shape()) \
            == (4, model.cfg.moe_intermediate_size)
    theirs = _logits(peft.PeftModel.from_pretrained(hf, adapter).eval())
    assert (ours - base_logits).abs().max() > 0.05
    assert (theirs - ours).abs().max() <= 1e-4
    again = from_hf(path).eval()
    assert load_adapter(again, adapter) == names
    assert torch.equal(_logits(again), ours)
    merge_lora(again)
    assert (_logits(again) - ours).abs().max() <= 1e-4


def test_routed_expert_adapters_need_every_expert_and_no_dropout(tmp_path):
    cfg = _tiny_cfg(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True,
                    model_type="qwen3_moe")
    with pytest.raises(ConfigError, match=r"lora.dropout 0.1 with LoRA on the routed experts.*set lora.dropout: 0"):
        apply_lora(build_model(cfg), r=2, alpha=2, dropout=0.1, target_modules=["experts.w1"])
    model = build_model(cfg)
    apply_lora(model, r=2, alpha=2, dropout=0.0, target_modules=["gate_proj", "up_proj"])
    adapter = save_adapter(lora_state_dict(model), cfg, 2, 2, 0.0, None, tmp_path / "adapter")
    path = adapter / "adapter_model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if ".experts.2." not in k}
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"lora_A for 3 of the 4 experts of model\.layers\.0\.mlp\.experts\.2\."
                                              r"gate_proj \(none for expert 2\)"):
        load_adapter(build_model(cfg), adapter)


# ---- merging ----

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merge_lora_equals_unmerged(family, tmp_path):
    _, path = _base(family, tmp_path)
    model = from_hf(path).eval()
    base_names = [n for n, _ in model.named_parameters()]
    wq = model.layers["0"].attention.wq.weight
    apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    _randomize_lora(model)
    unmerged = _logits(model)
    merge_lora(model)
    assert [n for n, _ in model.named_parameters()] == base_names
    assert type(model.layers["0"].attention.wq) is nn.Linear and model.layers["0"].attention.wq.weight is wq
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert (_logits(model) - unmerged).abs().max() <= 1e-4


def test_moe_adapters_merge_exactly(tmp_path):
    """Adapters on a MoE model's attention, dense MLP, shared and routed experts (DeepSeek-V3, all-linear):
    they change the logits, merging them gives the same logits, and the adapter saves and loads back exactly."""
    _, path = _base("deepseek_v3", tmp_path)
    model = from_hf(path).eval()
    names = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    assert {"layers.1.feed_forward.shared.w3", "layers.0.feed_forward.w1", "layers.1.feed_forward.experts.w1",
            "layers.1.feed_forward.experts.w2"} <= set(names)
    assert not any("router" in n for n in names)  # the router stays frozen
    base = _logits(from_hf(path).eval())
    _randomize_lora(model)
    unmerged = _logits(model)
    assert (unmerged - base).abs().max() > 0.05
    adapter = save_adapter(lora_state_dict(model), model.cfg, 4, 8, 0.0, "all-linear", tmp_path / "adapter")
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert {"base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight",
                "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight"} <= set(f.keys())
    again = from_hf(path).eval()
    load_adapter(again, adapter)
    assert torch.equal(_logits(again), unmerged)
    base_names = [n for n, _ in from_hf(path).named_parameters()]
    merge_lora(model)
    assert [n for n, _ in model.named_parameters()] == base_names
    assert (_logits(model) - unmerged).abs().max() <= 1e-4


# ---- targeting ----

@pytest.mark.parametrize("targets, expected", [
    (["q_proj"], ["layers.0.attention.wq", "layers.1.attention.wq"]),                 # HF leaf name
    (["mlp.down_proj"], ["layers.0.feed_forward.w2", "layers.1.feed_forward.w2"]),    # HF suffix
    (["wk", "attention.wv"], ["layers.0.attention.wk", "layers.0.attention.wv",
                              "layers.1.attention.wk", "layers.1.attention.wv"]),      # our names
    (["layers.1.feed_forward.w3"], ["layers.1.feed_forward.w3"]),                       # our full name
    ([r"layers\.0\.attention\.w[qo]"], ["layers.0.attention.wq", "layers.0.attention.wo"]),  # regex, ours
    (r"model\.layers\.1\.mlp\.(gate|up)_proj", ["layers.1.feed_forward.w1", "layers.1.feed_forward.w3"]),  # str
])
def test_target_matching(targets, expected):
    model = build_model(_tiny_cfg())
    assert apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=targets) == expected
    assert sorted({n.rsplit(".", 2)[0] for n in lora_parameter_names(model)}) == sorted(expected)


def test_all_linear_and_suffix_boundaries():
    model = build_model(_tiny_cfg())
    assert len(apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules="all-linear")) == 14
    # "proj" is not a '.'-separated suffix of "q_proj", nor "q" of "wq".
    for targets in (["proj"], ["q"]):
        with pytest.raises(ConfigError):
            apply_lora(build_model(_tiny_cfg()), r=2, alpha=4, dropout=0.0, target_modules=targets)


def test_gpt2_c_attn_shares_lora_a_and_c_proj_matches_both():
    cfg = ModelConfig(model_type="gpt2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                      max_position_embeddings=32, norm="layernorm", mlp="plain", activation="gelu_tanh",
                      position="learned", qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True)
    model = build_model(cfg)
    names = apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=["c_attn", "c_proj"])
    assert names[:4] == ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                         "layers.0.attention.wo"] and names[4] == "layers.0.feed_forward.w2"
    attn = model.layers["0"].attention
    assert attn.wq.lora_A is attn.wk.lora_A is attn.wv.lora_A
    assert attn.wq.lora_B is not attn.wk.lora_B
    params = lora_parameter_names(model)
    assert "layers.0.attention.wq.lora_A.weight" in params and "layers.0.attention.wk.lora_A.weight" not in params
    # Round trip through peft's names: one c_attn pair per layer.
    _randomize_lora(model)
    peft_state = to_peft_state(lora_state_dict(model), cfg)
    assert peft_state["base_model.model.transformer.h.1.attn.c_attn.lora_B.weight"].shape == (96, 2)
    back = from_peft_state(peft_state, cfg)
    for name, tensor in lora_state_dict(model).items():
        assert torch.equal(back[name], tensor)
    assert torch.equal(back["layers.0.attention.wk.lora_B.weight"], attn.wk.lora_B.weight)


def test_nothing_matched_lists_eligible_names():
    model = build_model(_tiny_cfg())
    with pytest.raises(ConfigError, match=r"matches no linear.*layers\.0\.attention\.wq "
                                          r"\(model\.layers\.0\.self_attn\.q_proj\).*feed_forward\.w2"):
        apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=["qproj"])
    with pytest.raises(ConfigError, match=r"a single string is a regex.*\[q_proj\]"):
        apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules="q_proj")
    with pytest.raises(ConfigError, match=r"lora\.target_modules: holds 'layers\.\(0', which is not a regular "
                                          r"expression"):
        apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=["layers.(0"])
    with pytest.raises(ConfigError, match="lora.r must be a positive integer"):
        apply_lora(model, r=0, alpha=4, dropout=0.0, target_modules=["q_proj"])
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


# ---- parameters, gradients, init ----

def test_only_lora_trains():
    model = build_model(_tiny_cfg())
    before = {n: p for n, p in model.named_parameters()}
    apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    params = dict(model.named_parameters())
    # Base parameters keep their names and are the very same objects.
    assert all(params[n] is p for n, p in before.items())
    assert set(params) - set(before) == set(lora_parameter_names(model))
    assert len(lora_parameter_names(model)) == 2 * 3 * 2
    assert {n for n, p in params.items() if p.requires_grad} == set(lora_parameter_names(model))
    _randomize_lora(model)
    logits = model(TOKENS % 64)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS.flatten() % 64).backward()
    for name, p in params.items():
        if is_lora_name(name):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_lora_init_is_a_function_of_name_and_seed():
    a = lora_init("layers.0.attention.wq.lora_A.weight", (4, 32), seed=7)
    assert torch.equal(a, lora_init("layers.0.attention.wq.lora_A.weight", (4, 32), seed=7))
    assert not torch.equal(a, lora_init("layers.1.attention.wq.lora_A.weight", (4, 32), seed=7))
    assert not torch.equal(a, lora_init("layers.0.attention.wq.lora_A.weight", (4, 32), seed=8))
    bound = 1 / math.sqrt(32)  # kaiming_uniform_(a=sqrt(5)) on fan_in 32
    assert a.dtype == torch.float32 and a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert torch.equal(lora_init("layers.0.attention.wq.lora_B.weight", (32, 4), seed=7), torch.zeros(32, 4))


def test_apply_lora_on_meta_then_allocate():
    cfg = _tiny_cfg()
    with torch.device("meta"):
        model = Transformer(cfg)
    rng = torch.random.get_rng_state()
    names = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["wq", "w2"], seed=11)
    assert names == ["layers.0.attention.wq", "layers.0.feed_forward.w2", "layers.1.attention.wq",
                     "layers.1.feed_forward.w2"]
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())  # wrapping draws no random numbers
    model.to_empty(device="cpu")
    model.init_weights()
    reset_lora_parameters(model, seed=11)
    for name, p in model.named_parameters():
        if is_lora_name(name):
            assert torch.equal(p, lora_init(name, p.shape, seed=11)), name
    # The same as apply_lora on an allocated model with that seed.
    eager = build_model(cfg)
    apply_lora(eager, r=4, alpha=8, dropout=0.0, target_modules=["wq", "w2"], seed=11)
    for name, p in lora_state_dict(eager).items():
        assert torch.equal(p, dict(model.named_parameters())[name])
    assert model.layers["0"].attention.wq.lora_A.weight.abs().sum() > 0


# ---- adapters of another base, unsupported adapters ----

def _saved_adapter(tmp_path, cfg, targets=("q_proj", "down_proj"), name="adapter"):
    model = build_model(cfg)
    apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=list(targets))
    _randomize_lora(model)
    return save_adapter(lora_state_dict(model), cfg, 2, 4, 0.0, list(targets), tmp_path / name), model


def test_adapter_round_trip_and_overwrite(tmp_path):
    cfg = _tiny_cfg()
    adapter, trained = _saved_adapter(tmp_path, cfg)
    adapter, trained = _saved_adapter(tmp_path, cfg)  # replaces the first one
    assert sorted(p.name for p in adapter.parent.iterdir()) == ["adapter"]
    model = build_model(cfg)
    model.load_state_dict({k: v for k, v in trained.state_dict().items() if not is_lora_name(k)})
    load_adapter(model, adapter)
    assert torch.equal(model(TOKENS % 64), trained(TOKENS % 64))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not an adapter directory"):
        save_adapter(lora_state_dict(trained), cfg, 2, 4, 0.0, None, tmp_path / "other")
    with pytest.raises(CheckpointError, match="already has LoRA"):
        load_adapter(model, adapter)


def test_adapter_with_wrong_shapes_names_tensor_and_shapes(tmp_path):
    adapter, _ = _saved_adapter(tmp_path, _tiny_cfg(intermediate_size=40))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.lora_A\.weight.*shape \(2, 40\).*"
                                              r"needs \(2, 48\)"):
        load_adapter(build_model(_tiny_cfg()), adapter)


def test_adapter_of_another_architecture(tmp_path):
    # Same tensor shapes (q: 32 -> 32), different heads: only the fingerprint tells them apart.
    adapter, _ = _saved_adapter(tmp_path, _tiny_cfg(num_heads=2, num_kv_heads=2), targets=["q_proj"])
    model = build_model(_tiny_cfg(num_heads=4, num_kv_heads=2))
    with pytest.raises(CheckpointError, match=r"another architecture \(head_dim: adapter 16, model 8; "
                                              r"num_heads: adapter 2, model 4\)"):
        load_adapter(model, adapter)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing half-applied


def test_adapter_for_layers_the_model_lacks(tmp_path):
    adapter, _ = _saved_adapter(tmp_path, _tiny_cfg(num_layers=4))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\..* is for layer 2, but the model has 2 layers"):
        load_adapter(build_model(_tiny_cfg()), adapter)


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='none' only"),
    ({"init_lora_weights": "pissa"}, "changes the base weights"),
    ({"peft_type": "IA3"}, "LoRA adapters only"),
])
def test_unsupported_peft_options(tmp_path, change, message):
    adapter, _ = _saved_adapter(tmp_path, _tiny_cfg())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_adapter(build_model(_tiny_cfg()), adapter)


def test_missing_adapter_files(tmp_path):
    with pytest.raises(CheckpointError, match="adapter_config.json not found"):
        load_adapter(build_model(_tiny_cfg()), tmp_path)
    adapter, _ = _saved_adapter(tmp_path, _tiny_cfg())
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(CheckpointError, match=r"adapter_model\.bin .*safetensors only.*PeftModel\.from_pretrained"
                                              r".*save_pretrained\('OUT', safe_serialization=True\)"):
        load_adapter(build_model(_tiny_cfg()), adapter)


def test_unreadable_adapter_files_are_named(tmp_path):
    """A garbage adapter_model.safetensors, a config that is no JSON object, and a mangled architecture
    record fail naming the file (no traceback from safetensors or json)."""
    adapter, _ = _saved_adapter(tmp_path, _tiny_cfg())
    weights = adapter / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors is not a readable safetensors file"):
        load_adapter(build_model(_tiny_cfg()), adapter)
    weights.write_bytes(good)
    config = adapter / "adapter_config.json"
    settings = config.read_text()
    config.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"adapter_config\.json: holds a list, not a JSON object"):
        load_adapter(build_model(_tiny_cfg()), adapter)
    config.write_text(settings)
    with safe_open(str(weights), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(weights), metadata={**metadata, ARCH_METADATA_KEY: "{not json"})
    with pytest.raises(CheckpointError, match=rf"its {ARCH_METADATA_KEY} entry\): is not valid JSON"):
        load_adapter(build_model(_tiny_cfg()), adapter)
