"""Parameter counts (against our model and Hugging Face's) and training FLOPs per token (by hand, and
against the matmuls autograd runs with frozen weights)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardwise.errors import ConfigError
from shardwise.models import ModelConfig, Transformer, count_parameters, flops_per_token, resolve_model_config
from shardwise.models.flops import count_parameters_by_kind, training_flops
from shardwise.peft.freeze import freeze_parameters
from shardwise.peft.lora import apply_lora

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


# --- training FLOPs with frozen weights: hand counts, and autograd's own matmuls ------------------------

SEQ = 32
# tiny_llama: hidden 64, 4 heads of 16, 2 kv heads, gated MLP 160 wide, vocab 512, 2 layers, untied.
WQ, WK, WV, WO, MLP = 64 * 64, 32 * 64, 32 * 64, 64 * 64, 3 * 64 * 160
LAYER = WQ + WK + WV + WO + MLP  # 43,008 weights per block
HEAD = 512 * 64
SCORES = 4 * 4 * 16 * SEQ  # QK^T and AV forward per layer; x3 with their backward


def _model(preset: str = "tiny_llama", lora: dict | None = None, freeze: dict | None = None, **changes) -> Transformer:
    """A small real model with LoRA or freezing applied, as the trainer applies them."""
    torch.manual_seed(0)
    model = Transformer(resolve_model_config({"preset": preset, **changes}))
    if lora is not None:
        apply_lora(model, lora.get("r", 4), 8.0, 0.0, lora["targets"])
    if freeze is not None:
        freeze_parameters(model, **freeze)
    return model


def _trainable(model: Transformer) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def test_full_training_costs_six_per_weight():
    flops = training_flops(_model().cfg, SEQ)
    assert flops.layers == (6 * LAYER + 3 * SCORES,) * 2 and flops.head == 6 * HEAD
    assert flops.total == 6 * (2 * LAYER + HEAD) + 2 * 3 * SCORES == 761_856
    assert flops.layers_forward == (2 * LAYER + SCORES,) * 2
    model = _model()
    assert training_flops(model.cfg, SEQ, _trainable(model)) == flops  # the table of a full model: the same


def test_frozen_layers_cost_four_or_two():
    # Embeddings and layer 0 frozen: nothing below layer 0 trains, so it runs forward only (2 per
    # weight, attention once); layer 1 and the head train (6).
    model = _model(freeze={"embeddings": True, "layers": 1})
    flops = training_flops(model.cfg, SEQ, _trainable(model))
    assert flops.layers == (2 * LAYER + SCORES, 6 * LAYER + 3 * SCORES) and flops.head == 6 * HEAD
    assert flops.total == 573_440
    # Layer 0 frozen but the embeddings train: its input needs a gradient, so 4 per weight.
    model = _model(freeze={"layers": 1})
    flops = training_flops(model.cfg, SEQ, _trainable(model))
    assert flops.layers == (4 * LAYER + 3 * SCORES, 6 * LAYER + 3 * SCORES) and flops.total == 675_840
    # Frozen embeddings freeze a tied output projection with them; it still passes gradients down (4).
    model = _model(freeze={"embeddings": True}, tie_embeddings=True)
    flops = training_flops(model.cfg, SEQ, _trainable(model))
    assert flops.head == 4 * HEAD and flops.total == 6 * 2 * LAYER + 2 * 3 * SCORES + 4 * HEAD == 696_320


def test_lora_base_weights_cost_four_and_adapters_six():
    model = _model(lora={"r": 4, "targets": ["q_proj", "v_proj"]})
    flops = training_flops(model.cfg, SEQ, _trainable(model))
    a_q, b_q, a_v, b_v = 4 * 64, 64 * 4, 4 * 64, 32 * 4  # lora_A [r, in], lora_B [out, r]
    # Layer 0 reads the frozen embedding through a frozen norm: the q/k/v base weights run forward
    # only (2) and the A adapters skip their input gradient (4); o and the MLP pass gradients down (4).
    first = 2 * (WQ + WK + WV) + 4 * (a_q + a_v) + 6 * (b_q + b_v) + 4 * (WO + MLP) + 3 * SCORES
    later = 4 * LAYER + 6 * (a_q + b_q + a_v + b_v) + 3 * SCORES
    assert flops.layers == (first, later) and flops.head == 4 * HEAD
    assert flops.total == 184_576 + 201_984 + 131_072 == 517_632
    assert flops.total < flops_per_token(model.cfg, SEQ) == 761_856


def _autograd_matmul_flops(model: Transformer) -> float:
    """Matmul FLOPs per token that forward + backward of `model` really run (torch's FlopCounterMode)."""
    tokens = torch.randint(0, model.cfg.vocab_size, (2, SEQ))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm")) / tokens.numel()


@pytest.mark.parametrize("preset, setup, attention_passes", [
    ("tiny_llama", {}, (3, 3)),
    ("tiny_llama", {"freeze": {"embeddings": True, "layers": 1}}, (1, 3)),
    ("tiny_llama", {"freeze": {"layers": 1}}, (3, 3)),
    ("tiny_llama", {"lora": {"targets": ["q_proj", "v_proj"]}}, (3, 3)),
    ("tiny_llama", {"lora": {"targets": "all-linear"}}, (3, 3)),
    ("tiny_llama", {"lora": {"targets": r"layers\.1\.attention\.wv"}}, (1, 3)),  # nothing trains in layer 0
    ("tiny_gpt2", {}, (3, 3)),
    ("tiny_gpt2", {"lora": {"targets": "all-linear"}}, (3, 3)),  # q/k/v share one lora_A per layer
    ("tiny_gpt2", {"freeze": {"embeddings": True}}, (3, 3)),  # the tied head is frozen with them
])
def test_weight_flops_equal_what_autograd_computes(preset, setup, attention_passes):
    """The rule, checked against the matmuls autograd runs (only tensors that need a gradient get one);
    the attention scores (SDPA, not counted by FlopCounterMode on CPU) are left out of both sides."""
    model = _model(preset, **setup)
    flops = training_flops(model.cfg, SEQ, _trainable(model))
    scores = 4 * model.cfg.num_heads * model.cfg.head_dim * SEQ
    assert flops.total - scores * sum(attention_passes) == _autograd_matmul_flops(model)
