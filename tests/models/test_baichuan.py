"""Baichuan-7B (RoPE) and Baichuan-13B (ALiBi) in and out of their Hugging Face layout (q, k and v fused in
W_pack). Their modelling code is not in transformers (it needs trust_remote_code, which shardwise never
runs), so the references are transformers' LLaMA for the 7B (the same maths with q/k/v apart) and, for the
13B, its forward written out below from Baichuan-13B's modeling_baichuan.py, op for op."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwise.errors import ConfigError
from shardwise.models import generate
from shardwise.models.hf import from_hf, save_hf

transformers = pytest.importorskip("transformers")

H, HEADS, LAYERS, FFN, VOCAB = 40, 5, 2, 48, 96  # five heads: ALiBi's slopes for a non-power of two


def _their_slopes(n: int) -> list[float]:
    """Baichuan-13B's _get_interleave."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _their_slopes(2 * closest)[0::2][: n - closest]


def _reference_13b(w: dict, tokens: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Baichuan-13B's forward: key-position ALiBi mask with an upper -inf triangle, W_pack, eager attention
    clamped at the dtype's minimum, RMSNorm, SwiGLU."""
    def rms(x, weight):  # noqa: ANN001, ANN202
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + eps)).to(x.dtype)

    b, t = tokens.shape
    slopes = torch.tensor(_their_slopes(HEADS))
    alibi = slopes[:, None, None] * torch.arange(t)[None, None, :].expand(HEADS, -1, -1)
    mask = torch.triu(torch.full((t, t), float("-inf")), 1)[None] + alibi.view(HEADS, 1, t)
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        proj = (x @ w[p + "self_attn.W_pack.weight"].T).unflatten(-1, (3, H)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        q, k, v = (proj[j].view(b, t, HEADS, H // HEADS).transpose(1, 2) for j in range(3))
        scores = q @ k.transpose(2, 3) / math.sqrt(H // HEADS) + mask.unsqueeze(0)
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, H)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def _baichuan_13b_dir(tmp_path):
    torch.manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.W_pack.weight": (3 * H, H), p + "self_attn.o_proj.weight": (H, H),
                       p + "mlp.gate_proj.weight": (FFN, H), p + "mlp.up_proj.weight": (FFN, H),
                       p + "mlp.down_proj.weight": (H, FFN)})
    weights = {n: (1.0 + 0.1 * torch.randn(s)) if len(s) == 1 else 0.3 * torch.randn(s) for n, s in shapes.items()}
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "hidden_size": H, "num_attention_heads":
        HEADS, "num_hidden_layers": LAYERS, "intermediate_size": FFN, "vocab_size": VOCAB, "model_max_length": 64,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}))
    return weights


def test_baichuan_13b_gives_its_own_codes_logits_and_continues_prompts_alike(tmp_path):
    weights = _baichuan_13b_dir(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    assert model.cfg.position == "alibi" and model.cfg.max_position_embeddings == 64
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _reference_13b(weights, tokens)
        assert expected.std() > 0.5
        assert (model(tokens) - expected).abs().max() <= 1e-4
        prompt = [5, 17, 3, 42]
        theirs = list(prompt)
        for _ in range(8):  # greedy, the whole sequence each step (no cache)
            theirs.append(int(_reference_13b(weights, torch.tensor([theirs]))[0, -1].argmax()))
    assert generate(model, [prompt], max_new_tokens=8)[0] == theirs[4:]  # ours decodes with a KV cache
    assert len(set(theirs[4:])) > 2

    out = save_hf(model, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BaichuanForCausalLM"] and config["model_max_length"] == 64
    assert "rope_theta" not in config
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(weights) and all(torch.equal(saved[n], weights[n]) for n in weights)


def test_baichuan_7b_is_llama_with_fused_qkv(tmp_path):
    """Baichuan-7B's layout of a LLaMA model (W_pack = q, k, v stacked; BaiChuanForCausalLM) gives
    transformers' LLaMA logits, and exports back to that layout."""
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {n: t.clone() for n, t in llama.state_dict().items()}
    for i in range(LAYERS):
        p = f"model.layers.{i}.self_attn."
        state[p + "W_pack.weight"] = torch.cat([state.pop(p + f"{x}_proj.weight") for x in "qkv"])
    (tmp_path / "hf").mkdir()
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "architectures": ["BaiChuanForCausalLM"], "model_type": "baichuan", "hidden_size": 32,
        "num_attention_heads": 4, "num_hidden_layers": LAYERS, "intermediate_size": FFN, "vocab_size": VOCAB,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    model = from_hf(tmp_path / "hf").eval()
    assert model.cfg.position == "rope"
    tokens = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - llama(input_ids=tokens).logits).abs().max() <= 1e-4
    out = save_hf(model, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BaiChuanForCausalLM"]
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(state) and all(torch.equal(saved[n], state[n]) for n in state)


def test_baichuan_2_is_refused_by_name(tmp_path):
    _baichuan_13b_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "z_loss_weight": 0}))
    with pytest.raises(ConfigError, match="Baichuan 2 model, whose output head normalises"):
        from_hf(tmp_path)


def test_alibi_keeps_packed_documents_apart():
    """ALiBi with packed documents: each document's logits as if it were alone (the biases are distances
    within a row, so a document's own positions need no restart)."""
    from shardwise.models import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=H, num_layers=LAYERS, num_heads=HEADS, intermediate_size=FFN,
                      position="alibi", max_position_embeddings=64)
    model = build_model(cfg).eval()
    tokens = torch.randint(0, VOCAB, (1, 30))
    docs = torch.tensor([[0] * 12 + [1] * 18])
    with torch.no_grad():
        packed = model(tokens, document_ids=docs)
        assert torch.allclose(packed[:, :12], model(tokens[:, :12]), atol=1e-5)
        assert torch.allclose(packed[:, 12:], model(tokens[:, 12:]), atol=1e-5)
