"""Training today's families through the trainer: a DeepSeek-V3-shaped model (latent attention, YaRN, group-
limited sigmoid routing with the bias update) and a Gemma-3-shaped one (sliding windows, sandwich norms)
train; a DeepSeek-V3 directory fine-tunes from its own router biases; layouts they lack are refused."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.models import resolve_model_config
from shardwise.models.moe import moe_layers
from shardwise.train.trainer import Trainer

from .conftest import read_metrics, tiny_config, validate

transformers = pytest.importorskip("transformers")


def _family_config(root, preset: str, steps: int = 4, **model):  # noqa: ANN001, ANN202
    raw = tiny_config(root, max_steps=steps, decay_style="constant").model_dump()
    raw["model"] = {**resolve_model_config({"preset": preset}).model_dump(), **model}
    return validate(raw)


@pytest.mark.parametrize("preset, extra", [("tiny_deepseek_v3", {"moe_bias_update_rate": 0.01}),
                                           ("tiny_gemma3", {}), ("tiny_baichuan_13b", {})])
def test_the_family_trains(tmp_path, dataset, preset, extra):
    trainer = Trainer(_family_config(tmp_path, preset, steps=5, **extra), train_dataset=dataset)
    losses = trainer.train().losses
    assert losses[5] < losses[1]
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    if preset == "tiny_deepseek_v3":  # block 0 dense, block 1 routed: its load logged, its biases moved
        assert all(set(r["expert_load"]) == {"1"} for r in records)
        assert moe_layers(trainer.model)["1"].router.expert_bias.abs().max() > 0


def test_fine_tuning_a_deepseek_v3_directory_keeps_its_router_biases(tmp_path, dataset):
    """init_from a Hugging Face DeepSeek-V3 directory: the correction biases (buffers, not parameters) come
    with the weights, and the model the trainer builds gives transformers' logits."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256, pad_token_id=0,
        attn_implementation="eager")).eval()
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    hf.save_pretrained(tmp_path / "hf")
    raw = tiny_config(tmp_path, max_steps=1).model_dump()
    raw["model"] = {"init_from": str(tmp_path / "hf")}
    cfg = validate(raw)
    trainer = Trainer(cfg, train_dataset=dataset)
    trainer.setup()
    bias = moe_layers(trainer.model)["1"].router.expert_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.linspace(-0.3, 0.3, 8))
    assert not moe_layers(trainer.model)["1"].tokens_per_expert.any()  # allocated, not initialised: zeroed
    tokens = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        assert (trainer.model.eval()(tokens) - hf(input_ids=tokens).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("preset, parallel, message", [
    ("tiny_deepseek_v3", {"context_parallel": 2}, "parallel.context_parallel 2 with multi-head latent attention"),
    ("tiny_gemma3", {"context_parallel": 2}, "parallel.context_parallel 2 with sliding-window attention"),
    ("tiny_baichuan_13b", {"tensor_parallel": 2}, "parallel.tensor_parallel 2 with ALiBi"),
])
def test_layouts_the_family_lacks_are_refused_before_any_work(tmp_path, preset, parallel, message):
    raw = _family_config(tmp_path, preset).model_dump()
    raw["parallel"] = {**raw["parallel"], **parallel}
    with pytest.raises((ConfigError, ValueError), match=message):
        validate(raw)
