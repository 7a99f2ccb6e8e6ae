#!/usr/bin/env python
"""The model's lean operations against their op-by-op versions: speed of a training step's forward and
backward, and the exact peak, in one process.

    python bench/lean_ops_speed.py [bench/bench_llama.yaml] [--ops norm,gated,rope,loss_head]
                                   [--rounds R] [--steps N] [--threads T]

Both sides are the same model and batch; the op-by-op side replaces the operations `--ops` names
(default: norm,gated): `norm` patches `RMSNorm.forward` back to the plain autograd version, `gated`
`FeedForward.forward`, `rope` the lean RoPE (`lean_ops.rotary`) with Hugging Face's
`x * cos + rotate_half(x) * sin`, and `loss_head` makes the chunked loss recompute its logits in
backward instead of making its gradients in forward (`Transformer.loss_gradients_in_forward`).
Rounds interleave the sides step by step (lean, plain, lean, plain, ...) so that machine noise hits both
alike; the result is the ratio of median step times (lean / plain: below 1 is faster) and each side's
peak of live tensor storage made during one extra step (memory.measure.MemoryTracker: activations,
gradients, temporaries; the weights are the same on both sides). The loss is the model's own (labels
given: the chunked loss). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import shardwise  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

from shardwise.config import load_config  # noqa: E402
from shardwise.memory.measure import MemoryTracker  # noqa: E402
from shardwise.models import transformer  # noqa: E402
from shardwise.models.transformer import build_model  # noqa: E402


def plain_rms_norm_forward(self: transformer.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * x.to(dtype)


def plain_feed_forward(self: transformer.FeedForward, x: torch.Tensor) -> torch.Tensor:
    h = self.act(self.w1(x))
    if self.w3 is not None:
        h = h * self.w3(x)
    return self.dropout(self.w2(h))


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


OPS = {"norm": (transformer.RMSNorm, "forward", plain_rms_norm_forward),
       "gated": (transformer.FeedForward, "forward", plain_feed_forward),
       "rope": (transformer, "rotary", plain_rope),
       "loss_head": (None, "loss_gradients_in_forward", False)}  # an attribute of the model


@contextlib.contextmanager
def op_by_op(model: torch.nn.Module, ops: list[str]):
    """The operations `ops` as plain autograd code for the duration."""
    saved = []
    for op in ops:
        owner, name, plain = OPS[op]
        owner = model if owner is None else owner
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, plain)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> None:
    loss = model(ids, labels=labels)
    loss.backward()
    for p in model.parameters():
        p.grad = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "bench" / "bench_llama.yaml"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per side and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", default="norm,gated", help=f"comma-separated, of {', '.join(OPS)}")
    args = ap.parse_args()
    ops = args.ops.split(",")
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        ap.error(f"unknown --ops {', '.join(unknown)}; choose from {', '.join(OPS)}")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.train()
    b, t = cfg.train.micro_batch_size, cfg.data.seq_length
    ids = torch.randint(0, cfg.model.vocab_size, (b, t), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    times: dict[str, list[float]] = {"lean": [], "plain": []}
    for side in ("lean", "plain"):  # warm-up
        with op_by_op(model, ops) if side == "plain" else contextlib.nullcontext():
            step(model, ids, labels)
    for _ in range(args.rounds):
        for _ in range(args.steps):
            for side in ("lean", "plain"):
                with op_by_op(model, ops) if side == "plain" else contextlib.nullcontext():
                    start = time.perf_counter()
                    step(model, ids, labels)
                    times[side].append(time.perf_counter() - start)
    peaks = {}
    for side in ("lean", "plain"):
        with op_by_op(model, ops) if side == "plain" else contextlib.nullcontext(), MemoryTracker() as tracker:
            tracker.start_recording()
            step(model, ids, labels)
        peaks[side] = tracker.peak
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"config": args.config, "ops": ops, "batch": [b, t], "steps_per_side": len(times["lean"]),
                      "median_s": med, "ratio_lean_over_plain": med["lean"] / med["plain"],
                      "peak_mib": {k: round(v / 2**20, 1) for k, v in peaks.items()},
                      "note": "forward + backward of the model's loss; no optimizer (the same on both sides)"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
