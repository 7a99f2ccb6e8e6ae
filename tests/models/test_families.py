"""DeepSeek-V3, GLM-4 / GLM-4.5 and Gemma 3 beyond the logit parity of test_hf.py: the presets' sizes against
transformers' own models and the published totals, the sliding window against separate runs, YaRN's tables
against transformers', and the multi-token-prediction layers skipped with a warning."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwise.models import build_model, count_active_parameters, count_parameters, resolve_model_config
from shardwise.models.hf import from_hf, model_config_to_hf
from shardwise.models.transformer import KVCache

transformers = pytest.importorskip("transformers")

# Published totals and active parameters (model cards; DeepSeek-V3 and GLM-4.5 without their multi-token-
# prediction layer; Gemma 3 4B-27B: the text model of the multimodal checkpoint).
PUBLISHED = {"deepseek_v3_671b": (671e9, 37e9), "kimi_k2_1t": (1.03e12, 32.5e9), "glm4.5_air": (106e9, 12e9 + 1.24e9),
             "glm4.5": (355e9, 32e9 + 1.55e9), "glm4_9b": (9.4e9, 9.4e9), "gemma3_1b": (1.0e9, 1.0e9),
             "gemma3_27b": (27e9, 27e9)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    total, active = PUBLISHED[name]
    cfg = resolve_model_config({"preset": name})
    assert count_parameters(cfg) == pytest.approx(total, rel=0.012)
    assert count_active_parameters(cfg) == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("name", ["deepseek_v3_671b", "kimi_k2_1t", "glm4_9b", "glm4.5_air", "glm4.5", "gemma3_1b",
                                  "gemma3_27b", "tiny_deepseek_v3", "tiny_gemma3"])
def test_counts_equal_transformers_on_its_own_model(name):
    """Our count of a preset (4 blocks: 3 dense and routed ones in DeepSeek-V3) equals transformers' count of
    the model its exported config.json describes, built by transformers itself on the meta device."""
    layers = min(4, resolve_model_config({"preset": name}).num_layers)
    cfg = resolve_model_config({"preset": name, "num_layers": layers})
    hf_cfg = model_config_to_hf(cfg)
    arch = getattr(transformers, hf_cfg.pop("architectures")[0])
    config_class = arch.config_class
    with torch.device("meta"):
        theirs = arch(config_class(**{k: v for k, v in hf_cfg.items() if k != "model_type"}))
    assert count_parameters(cfg) == theirs.num_parameters()
    assert count_parameters(cfg) == sum(p.numel() for p in build_model(cfg, device="meta").parameters())


def test_yarn_tables_equal_transformers():
    """DeepSeek-V3's YaRN frequencies and its softmax temperature against transformers' own functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from shardwise.models.rope import rope_inv_freq, softmax_scale

    cfg = resolve_model_config({"preset": "deepseek_v3_671b"})
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in model_config_to_hf(cfg).items()
                                              if k not in ("architectures", "model_type")})
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    assert torch.equal(rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling), theirs)
    assert factor == 1.0  # mscale == mscale_all_dim: the tables are not scaled
    assert softmax_scale(cfg) == pytest.approx(yarn_apply_mscale(hf_cfg.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert softmax_scale(cfg) != pytest.approx(192 ** -0.5)


def test_sliding_window_blocks_see_only_the_window_and_documents_stay_apart():
    """A Gemma-3-shaped model (window 32, block 2 global) on packed documents gives each document's logits
    as that document alone; a long document differs from full attention, so the window is in force."""
    torch.manual_seed(0)
    cfg = resolve_model_config({"preset": "tiny_gemma3"})
    model = build_model(cfg).eval()
    lengths = [70, 20, 38]
    tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)))
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, position_ids=positions, document_ids=document_ids)
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])
            assert torch.allclose(packed[:, start:start + n], alone, atol=1e-5)
            start += n
        full = build_model(cfg.model_copy(update={"sliding_window": cfg.max_position_embeddings})).eval()
        full.load_state_dict(model.state_dict())
        assert torch.allclose(full(tokens[:, :32]), model(tokens[:, :32]), atol=1e-6)  # inside the window: same
        assert not torch.allclose(full(tokens[:, :70]), model(tokens[:, :70]), atol=1e-3)


def _decoded_in_steps(model, tokens: torch.Tensor, prompt: int) -> tuple[torch.Tensor, KVCache]:
    """Logits of `tokens` from a KV cache: the first `prompt` at once, then one token at a time."""
    cache = KVCache.for_model(model, batch_size=tokens.shape[0], max_len=tokens.shape[1] + 4)
    with torch.no_grad():
        steps = [model(tokens[:, :prompt], kv_cache=cache)] + [model(tokens[:, i:i + 1], kv_cache=cache)
                                                               for i in range(prompt, tokens.shape[1])]
    return torch.cat(steps, dim=1), cache


@pytest.mark.parametrize("preset, batch, length, prompt", [("tiny_gemma3", 2, 50, 40),  # past the 32-token window
                                                           ("tiny_deepseek_v3", 1, 12, 8)])
def test_decoding_with_a_kv_cache_equals_the_full_forward(preset, batch, length, prompt):
    """Sliding windows and latent attention (whose cache holds keys and values of two widths) decode as
    the whole sequence's forward computes."""
    torch.manual_seed(0)
    cfg = resolve_model_config({"preset": preset})
    model = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (batch, length))
    with torch.no_grad():
        whole = model(tokens)
    steps, cache = _decoded_in_steps(model, tokens, prompt)
    assert torch.allclose(steps, whole, atol=1e-5)
    assert cache.k[0].shape[-1] == cfg.head_dim and cache.v[0].shape[-1] == cfg.value_dim
    if cfg.latent_attention:
        assert cfg.value_dim != cfg.head_dim


def test_multi_token_prediction_layers_are_skipped_with_a_warning(tmp_path):
    """DeepSeek-V3's files hold a multi-token-prediction layer after the last block (num_nextn_predict_layers):
    it is named in a warning and left out; the model loads and matches transformers, which ignores it too."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
        n_group=1, topk_group=1,
        n_shared_experts=1, pad_token_id=0, attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    extra.update({"model.layers.2.eh_proj.weight": torch.zeros(32, 64), "model.layers.2.enorm.weight": torch.ones(32)})
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with pytest.warns(UserWarning, match=r"skipping the 1 multi-token-prediction layer.*model\.layers\.2\."):
        model = from_hf(tmp_path).eval()
    assert model.cfg.latent_attention and model.cfg.q_lora_rank is None  # one query projection, no bottleneck
    tokens = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        assert (model(tokens) - hf(input_ids=tokens).logits).abs().max() <= 1e-4
