"""Issue 14 items 2 (flex half) and 4 on a CUDA GPU: the pinned prefetching loader, and compiled flex attention
(inductor, forward and backward) over changing SFT batch shapes, alone and inside compiled blocks.

    python3 tests/models/input_shapes_cuda.py [--parts loader,kernels,blocks]   # one JSON line; "ok" when all hold

- loader: the prefetch thread's steps equal the plain loader's, in pinned memory; batches_to_device gives the
  same tensors on the GPU; data.num_workers auto resolves for CUDA and its workers' batches are pinned too.
- kernels: flex_kernels() (the model's compiled block-mask builder and flex attention) over ten SFT-like shapes,
  with gradients, then two without (evaluation): graphs compiled per function (torch._dynamo counters) and the
  largest difference from the explicit-mask SDPA path, outputs and input gradients (fp32, TF32 off).
- blocks: a small model with each block compiled (as run.compile does) trained forward + backward over six shapes
  with flex attention inside the blocks: graphs compiled, and the loss and gradients against the explicit mask.
On a machine without CUDA it runs the same checks on the CPU without gradients and without inductor (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from shardwise.data import PackedDataset, StatefulLoader
from shardwise.data.loader import batches_to_device, resolve_num_workers
from shardwise.loss import token_loss_sum
from shardwise.models import ModelConfig, build_model
from shardwise.models.attention import document_mask, flex_kernels

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BACKEND = "inductor" if CUDA else "eager"
SCALE = 1 if CUDA else 8  # the CPU smoke run: shapes 8 times smaller
BUDGET = 4096 // SCALE  # tokens of a dynamic SFT batch (rows x width)
# Widths in multiples of 64 as the loader rounds them, rows = BUDGET // width.
WIDTHS = [w // SCALE for w in (512, 128, 1024, 256, 2048, 768, 512, 4096, 1024, 192)]
SHAPES = [(BUDGET // w, w) for w in WIDTHS]
EVAL_SHAPES = [(3, 1024 // SCALE), (1, 640 // SCALE)]


def documents(rows: int, width: int, seed: int) -> torch.Tensor:
    """document_ids [rows, width]: one sample and its padding per row (a packed row would have more)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=gen)
    return (torch.arange(width)[None, :] >= lengths[:, None]).long().to(DEVICE)


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def check_loader() -> dict:
    ds = PackedDataset(np.arange(22 * 64 + 1, dtype=np.int64), 64)
    plain = StatefulLoader(ds, 2, 3, seed=3, dp_rank=1, dp_size=2)
    ahead = StatefulLoader(ds, 2, 3, seed=3, dp_rank=1, dp_size=2, prefetch=True, pin_memory=CUDA)
    same = pinned = True
    waits = []
    try:
        for _ in range(5):
            time.sleep(0.02)  # the step's compute, during which the thread reads the next step
            start = time.perf_counter()
            got = ahead.next_step()
            waits.append(time.perf_counter() - start)
            want = plain.next_step()
            on_device = batches_to_device(got, DEVICE)
            for g, w, d in zip(got, want, on_device, strict=True):
                same &= all(torch.equal(g[k], w[k]) and torch.equal(d[k].cpu(), w[k]) for k in w)
                pinned &= all(t.is_pinned() for t in g.values()) if CUDA else True
    finally:
        ahead.close()
    workers = resolve_num_workers("auto", DEVICE.type)
    worker_pinned = None
    if workers:
        wl = StatefulLoader(ds, 2, 3, seed=3, num_workers=workers, pin_memory=True)
        try:
            worker_pinned = all(t.is_pinned() for mb in wl.next_step() for t in mb.values())
        finally:
            wl.close()
    return {"same_steps": bool(same), "pinned": bool(pinned), "auto_workers": workers,
            "worker_batches_pinned": worker_pinned, "max_next_step_ms": round(1e3 * max(waits[1:]), 3),
            "ok": bool(same and pinned and worker_pinned is not False)}


def check_kernels() -> dict:
    build, flex = flex_kernels(BACKEND)
    heads, kv_heads, dim = 8, 2, 64
    start = graphs()
    worst_out = worst_grad = 0.0
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for grad, shapes in ((CUDA, SHAPES), (False, EVAL_SHAPES)):
        for k, (rows, width) in enumerate(shapes):
            doc = documents(rows, width, k)
            q = torch.randn(rows, heads, width, dim, device=DEVICE, generator=gen).requires_grad_(grad)
            kv = [torch.randn(rows, kv_heads, width, dim, device=DEVICE, generator=gen).requires_grad_(grad)
                  for _ in range(2)]
            with torch.set_grad_enabled(grad):
                out = flex(q, kv[0], kv[1], block_mask=build(doc), enable_gqa=True)
                rep = [t.repeat_interleave(heads // kv_heads, 1) for t in kv]
                ref = F.scaled_dot_product_attention(q, rep[0], rep[1], attn_mask=document_mask(doc))
            worst_out = max(worst_out, (out - ref).abs().max().item())
            if grad:
                probe = torch.randn_like(out)
                got = torch.autograd.grad((out * probe).sum(), [q, *kv])
                want = torch.autograd.grad((ref * probe).sum(), [q, *kv])
                worst_grad = max(worst_grad, max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)))
    compiled = graphs() - start
    return {"shapes": len(SHAPES) + len(EVAL_SHAPES), "graphs_mask_and_flex": compiled, "max_out_diff": worst_out,
            "max_grad_diff": worst_grad, "ok": compiled <= 10 and worst_out < 1e-4 and worst_grad < 1e-3}


def check_blocks() -> dict:
    cfg = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                      intermediate_size=512, max_position_embeddings=BUDGET)
    torch.manual_seed(0)
    flex_model = build_model(cfg, device=DEVICE)
    mask_model = build_model(cfg, device=DEVICE)
    mask_model.load_state_dict(flex_model.state_dict())
    flex_model.document_attention, mask_model.document_attention = "flex", "mask"
    for block in flex_model.layers.values():
        block.compile(backend=BACKEND)
    start = graphs()
    worst_loss = worst_grad = 0.0
    for k, (rows, width) in enumerate(SHAPES[:6]):
        doc = documents(rows, width, k)
        ids = torch.randint(0, cfg.vocab_size, (rows, width), device=DEVICE)
        labels = torch.roll(ids, -1, 1)
        losses, grads = [], []
        for model in (flex_model, mask_model):
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(CUDA):
                loss = token_loss_sum(model(ids, document_ids=doc), labels) / labels.numel()
            if CUDA:
                loss.backward()
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            losses.append(loss.item())
        worst_loss = max(worst_loss, abs(losses[0] - losses[1]) / abs(losses[1]))
        if grads:
            worst_grad = max(worst_grad, ((grads[0] - grads[1]).abs().max() / grads[1].abs().max()).item())
    compiled = graphs() - start
    return {"graphs_blocks": compiled, "max_loss_rel_diff": worst_loss, "max_grad_rel_diff": worst_grad,
            "ok": compiled <= 6 and worst_loss < 1e-5 and worst_grad < 1e-3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="loader,kernels,blocks")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    checks = {"loader": check_loader, "kernels": check_kernels, "blocks": check_blocks}
    result: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu (smoke run)", "torch": torch.__version__}
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            result[part] = checks[part]()
        except Exception as exc:  # report and go on with the other parts
            result[part] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
        result[part]["seconds"] = round(time.perf_counter() - start, 1)
    result["ok"] = all(result[p]["ok"] for p in args.parts.split(","))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
