"""Issue 13 item 5 on a CUDA GPU: optimize.offload_params on one device (FSDP2's CPU offload on a one-process
group). One plain run saves step 2; it is resumed to step 4 twice, plainly and with offload_params, and:

- losses: steps 3 and 4 of the offloaded run equal the plain run's (fp32: 1e-5 relative, bf16 O2: 6e-4);
- placement: every parameter is a DTensor whose local tensor is in pinned host memory, fp32 at O2 (FSDP2's
  host shards are the masters), and the optimizer state is in host memory too;
- memory: torch.cuda.max_memory_allocated of each resumed run beside `shardwise estimate`'s figure (peak less
  its allocator allowance), and the offloaded run's below the plain one's.

    python3 tests/train/offload_params_cuda.py [--model bench_llama] [--precision fp32,bf16]   # one JSON line

On a machine without CUDA it runs the same on the CPU through `Trainer(fsdp_offload_on_cpu=True)` (a smoke run,
no memory figures).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from shardwise.data.packing import PackedDataset
from shardwise.memory.estimate import estimate_memory
from shardwise.parallel.launch import shutdown
from shardwise.resolve import resolve_config
from shardwise.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_tokens  # noqa: E402 - the trainer tests' learnable token stream

CUDA = torch.cuda.is_available()
KIND = "cuda" if CUDA else "cpu"
SEQ = 256
LOSS_RTOL = {"fp32": 1e-5, "bf16": 6e-4}


def config(out: Path, model: str, precision: str, steps: int, offload: bool):  # noqa: ANN201 - a RunConfig
    return resolve_config({
        "model": {"preset": model}, "data": {"seq_length": SEQ},
        "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 1,
                  "decay_style": "constant", "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7,
                  "peak_tflops": 1.0},
        "optimize": {"mixed_precision": precision, "recompute": "full", "offload_params": offload},
        "run": {"device": KIND}})


def train(cfg, ds, resume: str | None = None) -> tuple[dict, Trainer, int]:  # noqa: ANN001
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, train_dataset=ds, fsdp_offload_on_cpu=not CUDA)
    result = trainer.train(resume=resume, overwrite=resume is None)
    peak = torch.cuda.max_memory_allocated() if CUDA else 0
    return result.losses, trainer, peak


def placement_problem(trainer: Trainer, precision: str) -> str | None:
    for name, p in trainer.model.named_parameters():
        if not isinstance(p, DTensor) or p.to_local().device.type != "cpu":
            return f"{name} is not a host shard"
        if CUDA and not p.to_local().is_pinned():
            return f"{name}'s host shard is not pinned"
        if p.requires_grad and precision == "bf16" and p.dtype != torch.float32:
            return f"{name} is {p.dtype}, not an fp32 master"
    for st in trainer.state.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() and (v.to_local() if isinstance(v, DTensor) else v).device.type != "cpu":
                return "optimizer state on the device"
    return None


def check(model: str, precision: str, root: Path) -> dict:
    ds = PackedDataset(make_tokens(), SEQ)
    first = root / f"{precision}_first"
    train(config(first, model, precision, 2, False), ds)
    shutdown()
    out: dict = {"precision": precision}
    runs = {}
    for name, offload in (("plain", False), ("offload_params", True)):
        run_dir = root / f"{precision}_{name}"
        shutil.copytree(first, run_dir)
        cfg = config(run_dir, model, precision, 4, offload)
        losses, trainer, peak = train(cfg, ds, resume="auto")
        est = estimate_memory(cfg, 1, KIND)
        runs[name] = losses
        out[name] = {"losses": {int(k): v for k, v in losses.items()}, "max_allocated_gib": round(peak / 2**30, 4),
                     "estimate_gib": round((est.peak - est.overhead) / 2**30, 4),
                     "estimate_host_gib": round(est.host / 2**30, 4)}
        if offload:
            out["placement_problem"] = placement_problem(trainer, precision)
        del trainer
        shutdown()
    rel = max(abs(runs["offload_params"][s] / runs["plain"][s] - 1) for s in (3, 4))
    out["loss_rel_diff"] = rel
    out["ok"] = (sorted(runs["plain"]) == sorted(runs["offload_params"]) == [3, 4] and rel <= LOSS_RTOL[precision]
                 and out["placement_problem"] is None
                 and (not CUDA or out["offload_params"]["max_allocated_gib"] < out["plain"]["max_allocated_gib"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench_llama" if CUDA else "tiny_llama")
    ap.add_argument("--precision", default="fp32,bf16")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardwise-offload-params-"))
    try:
        results = [check(args.model, p, root) for p in args.precision.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = all(r["ok"] for r in results)
    print(json.dumps({"check": "offload_params_one_device", "device": KIND, "model": args.model, "ok": ok,
                      "results": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
