#!/usr/bin/env python
"""The MoE layer's experts: grouped matrix multiplies against a per-expert Python loop, in one process.

    python bench/moe_grouped_mm.py [bench/bench_moe.yaml] [--set k=v ...] [--tokens N] [--rounds R]
                                   [--threads T] [--dtype fp32|bf16]

One MoE block of the config's shape (router, experts) runs forward and backward on N tokens three ways,
interleaved round by round on the same weights and routing: shardwise's `GroupedExperts` (the copies
sorted by expert, `torch._grouped_mm` where the device has it), its padded fallback (one batched matmul
over the copies padded to the largest expert's count), and the loop transformers' Qwen3-MoE and
Mixtral blocks run (per expert present: gather its tokens, its MLP, a weighted index_add). Outputs and
input gradients are checked equal first. Reports the median milliseconds of each and the ratios;
prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.config import load_config
from shardwise.models import moe as moe_module
from shardwise.models.moe import MoE


def loop_experts(layer: MoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """transformers' expert loop (Qwen3MoeExperts.forward): for each expert that got tokens, its MLP on them."""
    ex = layer.experts
    out = torch.zeros_like(x)
    hit = torch.bincount(experts.reshape(-1), minlength=ex.num_experts).nonzero().flatten().tolist()
    for e in hit:
        token, slot = torch.where(experts == e)
        h = F.silu(x[token] @ ex.w1[e].t()) * (x[token] @ ex.w3[e].t())
        out.index_add_(0, token, (h @ ex.w2[e].t()) * weights[token, slot, None])
    return out


def timed(fn, x: torch.Tensor, grad: torch.Tensor) -> float:  # noqa: ANN001
    """Milliseconds of one forward and backward."""
    start = time.perf_counter()
    out = fn(x)
    out.backward(grad)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("config", nargs="?", default=str(Path(__file__).with_name("bench_moe.yaml")))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="the block's dtype (bf16: what torch._grouped_mm takes on a CUDA GPU)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens through the block (default 4096)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides).model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    layer = MoE(cfg, None).to(device)
    layer.init_weights(0.02, 0.02)
    layer.to(dtype)
    x = torch.randn(1, args.tokens, cfg.hidden_size, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    with torch.no_grad():
        weights, experts, _, _ = layer.router(x.view(-1, cfg.hidden_size))

    def grouped(inp: torch.Tensor) -> torch.Tensor:
        return layer.experts(inp.view(-1, cfg.hidden_size), experts, weights)

    def padded(inp: torch.Tensor) -> torch.Tensor:
        runs = moe_module._grouped_mm_runs
        moe_module._grouped_mm_runs = lambda *_: False
        try:
            return grouped(inp)
        finally:
            moe_module._grouped_mm_runs = runs

    def loop(inp: torch.Tensor) -> torch.Tensor:
        return loop_experts(layer, inp.view(-1, cfg.hidden_size), experts, weights)

    ways = {"grouped": grouped, "padded": padded, "loop": loop}
    reference = None
    for name, fn in ways.items():  # the same numbers three ways, before timing them
        inp = x.clone().requires_grad_(True)
        out = fn(inp)
        out.backward(grad.view_as(out))
        if reference is None:
            reference = (out.detach(), inp.grad)
        else:
            tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
            torch.testing.assert_close(out.detach(), reference[0], msg=name, **tol)
            torch.testing.assert_close(inp.grad, reference[1], msg=name, **tol)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            inp = x.clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            times[name].append(timed(fn, inp, grad.view(-1, cfg.hidden_size)))
    med = {name: statistics.median(t[1:] if len(t) > 2 else t) for name, t in times.items()}
    out = {"device": device.type, "dtype": args.dtype, "tokens": args.tokens, "experts": cfg.num_experts,
           "top_k": cfg.num_experts_per_tok,
           "hidden": cfg.hidden_size, "expert_width": cfg.moe_intermediate_size,
           "grouped_mm_used": moe_module._grouped_mm_runs(x.view(-1, cfg.hidden_size), layer.experts.w1),
           "ms": {k: round(v, 2) for k, v in med.items()},
           "loop_over_grouped": round(med["loop"] / med["grouped"], 2),
           "padded_over_grouped": round(med["padded"] / med["grouped"], 2)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
