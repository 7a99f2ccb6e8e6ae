"""The mixture-of-experts layer (models/moe.py) against token-by-token references written from the maths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import ModelConfig
from shardwise.models import moe as moe_module
from shardwise.models.moe import MoE, set_aux_loss_scale, take_expert_load, update_expert_bias
from shardwise.peft.lora import LoRAExperts

H, E, FFN = 16, 8, 12


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=32, hidden_size=H, num_layers=1, num_heads=2, intermediate_size=24, num_experts=E,
                num_experts_per_tok=2, moe_intermediate_size=FFN, max_position_embeddings=32)
    return ModelConfig(**{**base, **kw})


def _layer(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(cfg, None)
    layer.init_weights(0.3, 0.3)
    return layer


def _expert(layer: MoE, j: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return (F.silu(x @ ex.w1[j].t()) * (x @ ex.w3[j].t())) @ ex.w2[j].t()


def _reference(layer: MoE, x: torch.Tensor, expert=_expert) -> torch.Tensor:
    """Token by token: scores, the choice (plain sorting; groups and bias as DeepSeek-V3 describes them), the
    weights and the weighted sum of the chosen experts."""
    c = layer.cfg
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = layer.router.gate.weight @ token
        scores = torch.sigmoid(logits) if c.router_score == "sigmoid" else torch.softmax(logits, dim=0)
        choice = scores + layer.router.expert_bias if c.router_bias else scores.clone()
        allowed = list(range(E))
        if c.n_group > 1:
            size = E // c.n_group
            group_score = [sum(sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True)[:2])
                           for g in range(c.n_group)]
            best = sorted(range(c.n_group), key=lambda g: -group_score[g])[:c.topk_group]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: -float(choice[e].detach()))[:c.num_experts_per_tok]
        w = torch.stack([scores[e] for e in chosen])
        if c.norm_topk_prob:
            w = w / w.sum()
        w = w * c.routed_scaling_factor
        out.append(sum(w[i] * expert(layer, e, token) for i, e in enumerate(chosen)))
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("routing", [
    {},  # softmax, top-2, normalised (Mixtral, Qwen3-MoE)
    {"norm_topk_prob": False},
    {"router_score": "sigmoid", "router_bias": True, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
], ids=["softmax", "unnormalised", "deepseek"])
def test_the_layer_equals_a_token_by_token_reference(routing):
    layer = _layer(_cfg(**routing))
    if routing.get("router_bias"):
        layer.router.expert_bias = torch.linspace(-0.2, 0.2, E)  # moves the choice, not the weights
    x = torch.randn(2, 5, H, requires_grad=True)
    got = layer(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(layer, ref_x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(got)
    got.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded"])
def test_lora_on_the_routed_experts_equals_each_experts_own_update(grouped, monkeypatch):
    """LoRA on the gate and down projections of every expert: outputs and the gradients of the input and of
    every adapter equal the token-by-token reference whose expert e multiplies by W_e + scaling B_e A_e."""
    if not grouped:
        monkeypatch.setattr(moe_module, "_grouped_mm_runs", lambda *_: False)
    layer = _layer(_cfg())
    layer.experts = LoRAExperts(layer.experts, ["w1", "w2"], r=3, alpha=6)
    for adapter in layer.experts.lora.values():
        for factor in (adapter.lora_A, adapter.lora_B):
            factor.weight.data = torch.randn(factor.weight.shape) * 0.3
    scaling = 2.0

    def adapted(lay: MoE, j: int, token: torch.Tensor) -> torch.Tensor:
        ex = lay.experts
        w = {name: getattr(ex, name)[j] + (scaling * ex.lora[name].lora_B.weight[j] @ ex.lora[name].lora_A.weight[j]
                                           if name in ex.lora else 0) for name in ("w1", "w3", "w2")}
        return (F.silu(token @ w["w1"].t()) * (token @ w["w3"].t())) @ w["w2"].t()

    x = torch.randn(2, 5, H, requires_grad=True)
    got = layer(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(layer, ref_x, adapted)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(got)
    got.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    assert {n for n in grads if "lora" in n} == {f"experts.lora.{w}.lora_{k}.weight" for w in ("w1", "w2")
                                                  for k in "AB"}
    for name, p in layer.named_parameters():
        if "lora" in name:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_padded_fallback_gives_the_grouped_matmul_results(monkeypatch):
    layer = _layer(_cfg(num_experts_per_tok=3))
    x = torch.randn(3, 7, H, requires_grad=True)
    grouped = layer(x)
    grouped.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    monkeypatch.setattr(moe_module, "_grouped_mm_runs", lambda *_: False)
    padded = layer(x)
    padded.square().sum().backward()
    torch.testing.assert_close(padded, grouped, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, [x.grad] + [p.grad for p in layer.parameters()]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_balance_losses_reach_the_router_and_leave_the_output_alone():
    """The sequence-wise auxiliary loss (alpha * sum_i f_i P_i per sequence, f_i the share of the sequence's
    routed copies that chose i over the even share k/E, P_i the mean normalised score) and the z-loss
    (mean squared logsumexp of the logits per sequence), each a mean over the step's sequences: the router's
    gradient equals the gradient of the output's loss plus these, computed here sequence by sequence."""
    alpha, z_coef, sequences_per_step = 0.1, 0.01, 4
    cfg = _cfg(moe_aux_loss_coef=alpha, router_z_loss_coef=z_coef)
    layer = _layer(cfg)
    set_aux_loss_scale(layer, sequences_per_step)
    x = torch.randn(2, 6, H)
    out = layer(x)
    plain = _layer(cfg.model_copy(update={"moe_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}))
    plain_out = plain(x)
    torch.testing.assert_close(out, plain_out)  # the same weights (same seed): the output is unchanged
    plain_out.sum().backward()
    out.sum().backward()
    got = layer.router.gate.weight.grad.clone()

    layer.zero_grad()
    layer.eval()  # the reference adds the losses itself
    total = layer(x).sum()
    k = cfg.num_experts_per_tok
    for seq in x:
        logits = seq @ layer.router.gate.weight.t()
        scores = logits.softmax(-1)
        chosen = scores.topk(k, dim=-1).indices
        f = torch.stack([(chosen == i).sum() for i in range(E)]).float() * E / (k * seq.shape[0])
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        aux = alpha * (f * p).sum()
        z = z_coef * torch.stack([torch.logsumexp(row, 0) ** 2 for row in logits]).mean()
        total = total + (aux + z) / sequences_per_step
    total.backward()
    torch.testing.assert_close(got, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(got, plain.router.gate.weight.grad)  # the losses did reach the router


def test_the_load_is_counted_and_the_bias_moves_towards_balance():
    cfg = _cfg(router_score="sigmoid", router_bias=True, moe_bias_update_rate=1e-3)
    layer = _layer(cfg)
    x = torch.randn(4, 8, H)
    with torch.no_grad():
        layer(x)
        chosen = layer.router(x.reshape(-1, H))[1]
    counts = torch.bincount(chosen.reshape(-1), minlength=E).float()
    assert torch.equal(layer.tokens_per_expert, counts) and counts.sum() == 4 * 8 * 2
    taken = take_expert_load(_Holder(layer))
    assert torch.equal(taken["0"], counts) and not layer.tokens_per_expert.any()
    update_expert_bias(_Holder(layer), taken, 1e-3)
    expected = 1e-3 * torch.sign(counts.mean() - counts)
    assert torch.equal(layer.router.expert_bias, expected) and layer.router.expert_bias.dtype == torch.float32
    assert math.isclose(float(expected[counts.argmax()]), -1e-3, rel_tol=1e-6)


class _Holder(torch.nn.Module):
    """A model-shaped holder: block "0" whose feed-forward is the layer."""

    def __init__(self, layer: MoE) -> None:
        super().__init__()
        block = torch.nn.Module()
        block.feed_forward = layer
        self.layers = torch.nn.ModuleDict({"0": block})


def test_routing_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is more than num_experts 8"):
        _cfg(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="n_group"):
        _cfg(n_group=3)
    with pytest.raises(ValueError, match="set router_bias: true"):
        _cfg(moe_bias_update_rate=1e-3)
    cfg = _cfg(num_layers=4, first_k_dense=1, dense_layers=[2])
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_parameters_total_and_active_and_the_flops_of_a_token():
    """Counted from the config: the model's own parameters in total; a token's (router, k experts, shared
    experts) against a hand count; training FLOPs 6 per active matmul weight plus PaLM's attention term."""
    from shardwise.models import build_model, count_active_parameters, count_parameters, flops_per_token

    cfg = _cfg(num_layers=3, first_k_dense=1, num_shared_experts=1, qk_norm=True, num_kv_heads=1)
    model = build_model(cfg, device="meta")
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    h, q, kv = H, 2 * cfg.head_dim, cfg.head_dim
    attention = h * (q + 2 * kv) + q * h
    dense, moe_active = 3 * h * 24, h * E + 3 * h * FFN * (2 + 1)
    norms = (2 * 3 + 1) * h + 3 * 2 * cfg.head_dim
    active = 32 * h * 2 + 3 * attention + dense + 2 * moe_active + norms
    assert count_active_parameters(cfg) == active
    seq = 16
    matmuls = 3 * attention + dense + 2 * moe_active + 32 * h  # the output head counts, as PaLM's rule does
    assert flops_per_token(cfg, seq) == 6 * matmuls + 12 * 3 * 2 * cfg.head_dim * seq


def test_presets_have_the_published_totals_and_match_transformers_own_count():
    """Total and active parameters of the MoE presets: transformers' models on the meta device (their
    own count) for the totals, the model cards' figures (Qwen3-30B-A3B: 30.5B total, 3.3B active;
    Qwen3-235B-A22B: 235B / 22B; Mixtral-8x7B: 46.7B / 12.9B) for both."""
    transformers = pytest.importorskip("transformers")
    from shardwise.models import count_active_parameters, count_parameters, resolve_model_config

    published = {"qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9), "mixtral_8x7b": (46.7e9, 12.9e9)}
    for name, (total, active) in published.items():
        cfg = resolve_model_config({"preset": name})
        assert count_parameters(cfg) == pytest.approx(total, rel=0.01), name
        assert count_active_parameters(cfg) == pytest.approx(active, rel=0.03), name
    small = resolve_model_config({"preset": "qwen3_30b_a3b", "num_layers": 2})
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=small.vocab_size, hidden_size=small.hidden_size, intermediate_size=small.intermediate_size,
            moe_intermediate_size=small.moe_intermediate_size, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8))
    assert count_parameters(small) == hf.num_parameters()
    q3 = resolve_model_config({"preset": "qwen3_8b"})
    with torch.device("meta"):
        hf8 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=q3.vocab_size, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False))
    assert count_parameters(q3) == hf8.num_parameters()
