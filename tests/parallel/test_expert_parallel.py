"""Expert parallelism (parallel/expert.py): a MoE block whose experts live on two ranks gives what the whole
block gives in one process, for every rank's own tokens, forward and backward.

Each rank routes different tokens (uneven: some experts get none from a rank, others many), so dispatch
and combine move different numbers of copies each way. The reference is the unsharded block run here
on each rank's tokens: outputs and input gradients for the rank's own tokens, router gradients from its
own tokens, and each rank's experts' gradients summed over both ranks' tokens (what the experts saw).
A dispatch or combine that sends a copy to the wrong expert or back to the wrong place fails it
(`test_a_wrong_exchange_fails_the_comparison`).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from shardwise.models import ModelConfig
from shardwise.models.moe import MoE
from shardwise.models.transformer import FeedForward
from shardwise.parallel import expert as expert_module
from shardwise.parallel.expert import apply_expert_parallel

from .harness import run_distributed

H, E = 16, 8
CASES = {"softmax_top2": dict(num_experts_per_tok=2), "sigmoid_top3_shared": dict(
    num_experts_per_tok=3, router_score="sigmoid", router_bias=True, num_shared_experts=1)}


def _layer(**routing) -> MoE:
    cfg = ModelConfig(vocab_size=32, hidden_size=H, num_layers=1, num_heads=2, intermediate_size=24, num_experts=E,
                      moe_intermediate_size=12, max_position_embeddings=32, **routing)
    torch.manual_seed(0)
    shared = FeedForward(cfg, cfg.num_shared_experts * cfg.moe_intermediate_size) if cfg.num_shared_experts else None
    layer = MoE(cfg, shared)
    layer.init_weights(0.3, 0.3)
    return layer


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    tokens = 5 + 4 * rank  # ranks route different numbers of tokens
    return torch.randn(1, tokens, H, generator=g), torch.randn(1, tokens, H, generator=g)


def _run(rank: int, world: int, wrong: bool) -> dict:
    if wrong:  # combine sends each result back to the place of the copy before it
        original = expert_module._by_expert
        expert_module._by_expert = lambda received, total: original(received, total).roll(1)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, routing in CASES.items():
        ref = _layer(**routing)
        expected, grads = {}, {}
        for r in range(world):  # the whole block on every rank's tokens
            x, g = _inputs(r)
            x.requires_grad_(True)
            ref.zero_grad()
            y = ref(x)
            y.backward(g)
            expected[r] = (y.detach(), x.grad.clone())
            grads[r] = {n: p.grad.clone() for n, p in ref.named_parameters()}
        layer = apply_expert_parallel(_layer(**routing), mesh)
        x, g = _inputs(rank)
        x.requires_grad_(True)
        y = layer(x)
        y.backward(g)
        own = grads[rank]
        experts = {n: sum(grads[r][n] for r in range(world)) for n in own if ".experts." in f".{n}"}
        share = E // world
        got = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in layer.named_parameters()}
        out[name] = {
            "out": (y.detach(), expected[rank][0]), "x_grad": (x.grad, expected[rank][1]),
            "experts": {n: (got[n], experts[n][rank * share:(rank + 1) * share]) for n in experts},
            "others": {n: (got[n], own[n]) for n in own if n not in experts},
        }
    return out


def _assert_close(results: list[dict]) -> None:
    for rank, cases in enumerate(results):
        for name, got in cases.items():
            assert sorted(got["experts"]) == ["experts.w1", "experts.w2", "experts.w3"], name
            for what in ("out", "x_grad"):
                torch.testing.assert_close(*got[what], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name} {what}")
            for group in ("experts", "others"):
                for param, pair in got[group].items():
                    torch.testing.assert_close(*pair, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name} {param}")


@pytest.mark.timeout(300)
def test_two_ranks_of_experts_give_the_whole_blocks_outputs_and_gradients():
    results = run_distributed(_run, 2, False)
    _assert_close(results)
    assert results[0]["softmax_top2"]["out"][0].shape != results[1]["softmax_top2"]["out"][0].shape  # uneven


@pytest.mark.timeout(300)
def test_a_wrong_exchange_fails_the_comparison():
    with pytest.raises(AssertionError):
        _assert_close(run_distributed(_run, 2, True))
