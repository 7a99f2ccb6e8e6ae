#!/usr/bin/env python
"""Document-masked attention: flex block mask vs explicit SDPA mask vs plain causal, same model.

    python bench/document_attention.py [--preset bench_llama] [--seq-length 2048] [--batch 4]
                                       [--dtype bf16] [--steps 5] [--doc-length 300]

Packs documents of random lengths (mean --doc-length tokens) into each sample, then times forward +
backward of the whole model with each way of masking and checks that the flex path gives the same
logits and gradients as the explicit mask (the explicit mask is the reference; plain causal attention
is the speed a mask-free run would have). Flex attention needs CUDA for the backward pass, so on CPU
only the explicit mask and plain causal are timed, and the forward of flex is compared.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.models import build_model, resolve_model_config  # noqa: E402
from shardwise.models.attention import flex_available  # noqa: E402
from shardwise.models.flops import flops_per_token  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def packed_documents(batch: int, seq_length: int, mean_len: int,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """document_ids and restarting position_ids for `batch` samples of random-length documents."""
    docs, positions = [], []
    for _ in range(batch):
        ids, pos, doc = [], [], 0
        while len(ids) < seq_length:
            n = int(torch.randint(max(1, mean_len // 4), 2 * mean_len, (1,), generator=gen))
            n = min(n, seq_length - len(ids))
            ids += [doc] * n
            pos += list(range(n))
            doc += 1
        docs.append(torch.tensor(ids))
        positions.append(torch.tensor(pos))
    return torch.stack(docs), torch.stack(positions)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(model, tokens, extras, steps: int, device: torch.device, backward: bool) -> tuple[float, torch.Tensor]:
    """Median seconds of forward (+ backward) over `steps` runs after one warm-up; and the last logits."""
    times = []
    logits = None
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            logits = model(tokens, **extras)
            if backward:
                logits.float().pow(2).mean().backward()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], logits.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench_llama")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--doc-length", type=int, default=300)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = resolve_model_config({"preset": args.preset, "max_position_embeddings": max(args.seq_length, 2048),
                                "dropout": 0.0})
    torch.manual_seed(0)
    model = build_model(cfg, device=device, dtype=DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_length), generator=gen).to(device)
    doc, pos = packed_documents(args.batch, args.seq_length, args.doc_length, gen)
    doc, pos = doc.to(device), pos.to(device)
    backward_flex = device.type == "cuda"
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "batch": args.batch,
        "seq_length": args.seq_length, "documents_per_sample": float((doc.max(1).values + 1).float().mean()),
    }
    tokens_per_step = args.batch * args.seq_length
    flops = flops_per_token(cfg, args.seq_length) * tokens_per_step  # causal-attention FLOPs, for scale

    model.document_attention = "mask"
    t_mask, logits_mask = time_step(model, tokens, {"document_ids": doc, "position_ids": pos}, args.steps, device, True)
    grads_mask = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    t_causal, _ = time_step(model, tokens, {}, args.steps, device, True)
    result["explicit_mask_s"] = t_mask
    result["causal_s"] = t_causal
    if flex_available():
        model.document_attention = "flex"
        t_flex, logits_flex = time_step(model, tokens, {"document_ids": doc, "position_ids": pos}, args.steps,
                                        device, backward_flex)
        result["flex_s" if backward_flex else "flex_forward_only_s"] = t_flex
        result["flex_vs_mask_max_abs_logit_diff"] = float((logits_flex.float() - logits_mask.float()).abs().max())
        result["logit_scale"] = float(logits_mask.float().abs().max())
        if backward_flex:
            worst = 0.0
            for n, p in model.named_parameters():
                if p.grad is not None:
                    ref = grads_mask[n].float()
                    rel = float((p.grad.float() - ref).norm() / ref.norm().clamp_min(1e-12))
                    worst = max(worst, rel)
            result["flex_vs_mask_worst_relative_grad_diff"] = worst
    for key in ("explicit_mask_s", "causal_s", "flex_s"):
        if key in result:
            result[key.replace("_s", "_tokens_per_s")] = tokens_per_step / result[key]
            result[key.replace("_s", "_tflops")] = flops / result[key] / 1e12
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result))


if __name__ == "__main__":
    main()
