#!/usr/bin/env python
"""The memory estimator against measurement: estimate vs measured peak tensor memory per rank.

    python bench/memory_check.py [--only NAME,...] [--list] [--threads T]

For each configuration below (tiny to bench size; recompute none/full/selective; fp32, bf16 O1/O2/O3;
ZeRO 0-3 and CPU offload on 2 ranks; gradient accumulation under ZeRO 2/3 with gradients reduced
every micro-batch or once per step, on 2 ranks and HSDP 2 x 2; ZeRO-1's even state on DP2, DP4 with a
32k vocabulary and DP2 x TP2; TP2 with and without sequence parallelism; PP2 with each
schedule; LoRA; frozen layers; packed documents), the Trainer runs 2 optimizer steps and saves a
checkpoint under `shardwise.memory.measure.MemoryTracker` (a TorchDispatchMode that counts the bytes
of every live tensor storage on the rank exactly, from the first step on), and
`shardwise.memory.estimate.estimate_all_ranks(cfg, world, device="cpu")` predicts the same quantity
for the same rank. Distributed configurations run as forked gloo processes (tests/parallel/harness.py).

Prints one JSON line per configuration and rank on stdout, then a Markdown table (estimate, measured,
error, the phase of each peak) and the largest error. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.parallel.harness
try:
    import shardwise  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

from shardwise.data.packing import ArrayTokens, PackedDataset  # noqa: E402
from shardwise.memory.estimate import estimate_all_ranks  # noqa: E402
from shardwise.resolve import resolve_config as validate  # noqa: E402
from shardwise.train.probe import measure_training  # noqa: E402

TINY = {"preset": "tiny_llama"}
DEMO = {"preset": "demo_llama"}
SMALL_VOCAB = {"preset": "demo_llama", "vocab_size": 1024}  # activations, not logits, dominate
LARGE_VOCAB = {"preset": "tiny_llama", "vocab_size": 16384}  # the logits dominate (2,048 tokens x 16,384)
PLAIN_LOSS = {"chunked_loss": False}  # the full [tokens, vocab] logits, then the loss
BENCH = {"preset": "bench_llama"}
SEQ = {"seq_length": 256}


def _run(model: dict, mbs: int = 4, seq: dict | None = None, **sections: Any) -> dict[str, Any]:
    return {"model": model, "data": seq or SEQ, "train": {"micro_batch_size": mbs}, **sections}


def _train(mbs: int = 8, **train: Any) -> dict[str, Any]:
    return {"micro_batch_size": mbs, **train}


IN_BACKWARD = {"optimizer_in_backward": True, "max_grad_norm": None}
BF16 = {"mixed_precision": "bf16"}
LORA = {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
QLORA = {"r": 8, "target_modules": "all-linear", "quantize_base": "nf4"}
FROZEN = {"layers": 2, "embeddings": True}
DP2 = {"data_parallel": 2}
HSDP = {"data_parallel": 4, "data_parallel_replicate": 2}
ONCE = {"reduce_gradients": "once_per_step"}
PP2 = {"pipeline_parallel": 2, "micro_batch_num": 4}
OFFLOAD = {"offload_optimizer": True}
STREAM = {"offload_optimizer": "stream"}

# name -> (processes, config sections). Every run: 2 optimizer steps, then a checkpoint.
CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "tiny fp32": (1, _run(TINY, seq={"seq_length": 64})),
    "tiny gpt2 fp32": (1, _run({"preset": "tiny_gpt2"}, seq={"seq_length": 64})),
    "tiny bf16 O3": (1, _run(TINY, seq={"seq_length": 64}, optimize={**BF16, "precision_level": "O3"})),
    "demo fp32": (1, _run(DEMO)),
    "demo bf16 O1": (1, _run(DEMO, optimize={**BF16, "precision_level": "O1"})),
    "demo bf16 O2": (1, _run(DEMO, optimize=BF16)),
    "demo packed documents": (1, _run(DEMO, seq={**SEQ, "train_files": ["synthetic"]})),
    "small-vocab fp32": (1, _run(SMALL_VOCAB, 8)),
    "small-vocab recompute full": (1, _run(SMALL_VOCAB, 8, optimize={"recompute": "full"})),
    "small-vocab recompute full every 2": (1, _run(SMALL_VOCAB, 8, optimize={"recompute": "full",
                                                                             "recompute_every": 2})),
    "small-vocab recompute selective": (1, _run(SMALL_VOCAB, 8, optimize={"recompute": "selective"})),
    "small-vocab bf16 O2 selective": (1, _run(SMALL_VOCAB, 8, optimize={**BF16, "recompute": "selective"})),
    # Selective recompute (issue 13): attention and every other matmul kept; LoRA's matmuls recomputed;
    # a per-layer plan as recompute: auto chooses one (none, then selective, then full).
    "small-vocab LoRA selective": (1, _run(SMALL_VOCAB, 8, optimize={"recompute": "selective"}, lora=LORA)),
    "small-vocab mixed recompute plan": (1, _run(SMALL_VOCAB, 8, optimize={
        "recompute": "auto", "recompute_layers": ["full", "selective", "selective", "none"]})),
    "TP2 SP selective": (2, _run(SMALL_VOCAB, parallel={"tensor_parallel": 2}, optimize={"recompute": "selective"})),
    "PP2 1F1B selective": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "1f1b"},
                                   optimize={"recompute": "selective"})),
    "PP2 1F1B mixed recompute plan": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "1f1b"}, optimize={
        "recompute": "auto", "recompute_layers": ["full", "selective", "selective", "none"]})),
    "small-vocab accumulation 2": (1, _run(SMALL_VOCAB, 4, optimize={"gradient_accumulation_steps": 2})),
    "small-vocab bf16 O2 accumulation 4": (1, _run(SMALL_VOCAB, 2,
                                                   optimize={**BF16, "gradient_accumulation_steps": 4})),
    "small-vocab LoRA": (1, _run(SMALL_VOCAB, 8, lora={"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                    "o_proj"]})),
    "small-vocab frozen 2 layers + embeddings": (1, _run(SMALL_VOCAB, 8, freeze={"layers": 2, "embeddings": True})),
    "bench fp32": (1, _run(BENCH, 8, {"seq_length": 512})),
    "bench recompute full": (1, _run(BENCH, 8, {"seq_length": 512}, optimize={"recompute": "full"})),
    "bench recompute selective": (1, _run(BENCH, 8, {"seq_length": 512}, optimize={"recompute": "selective"})),
    "bench bf16 O2": (1, _run(BENCH, 8, {"seq_length": 512}, optimize=BF16)),
    "DP2 ZeRO-0": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 0})),
    "DP2 ZeRO-1": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 1})),
    # ZeRO-1 splits every tensor over the ranks: the 32k-token embedding and output projection (73% of
    # the parameters) no longer sit whole on two of the four ranks.
    "DP4 ZeRO-1 32k vocabulary": (4, _run({"preset": "demo_llama", "vocab_size": 32768}, 1, {"seq_length": 64},
                                          parallel={"data_parallel": 4, "zero_stage": 1})),
    "DP2 ZeRO-1 bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 1}, optimize=BF16)),
    "DP2 TP2 ZeRO-1": (4, _run(SMALL_VOCAB, parallel={**DP2, "tensor_parallel": 2, "zero_stage": 1})),
    "DP2 ZeRO-2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 2})),
    "DP2 ZeRO-3": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3})),
    "DP2 ZeRO-3 bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3}, optimize=BF16)),
    "DP2 ZeRO-3 offload": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3},
                                   optimize={"offload_params": True, "offload_optimizer": True})),
    # Gradient accumulation under ZeRO 2/3: reduce-scattered every micro-batch (the default), or
    # accumulated full size and reduced once per step (parallel.reduce_gradients: once_per_step).
    "DP2 ZeRO-2 accumulation 2": (2, _run(SMALL_VOCAB, 2, parallel={**DP2, "zero_stage": 2},
                                          optimize={"gradient_accumulation_steps": 2})),
    "DP2 ZeRO-3 accumulation 2": (2, _run(SMALL_VOCAB, 2, parallel={**DP2, "zero_stage": 3},
                                          optimize={"gradient_accumulation_steps": 2})),
    "DP2 ZeRO-3 accumulation 4": (2, _run(SMALL_VOCAB, 1, parallel={**DP2, "zero_stage": 3},
                                          optimize={"gradient_accumulation_steps": 4})),
    "DP2 ZeRO-3 bf16 O2 accumulation 2": (2, _run(SMALL_VOCAB, 2, parallel={**DP2, "zero_stage": 3},
                                                  optimize={**BF16, "gradient_accumulation_steps": 2})),
    "DP2 ZeRO-2 accumulation 2 once per step": (2, _run(SMALL_VOCAB, 2, parallel={**DP2, "zero_stage": 2, **ONCE},
                                                        optimize={"gradient_accumulation_steps": 2})),
    "DP2 ZeRO-3 accumulation 4 once per step": (2, _run(SMALL_VOCAB, 1, parallel={**DP2, "zero_stage": 3, **ONCE},
                                                        optimize={"gradient_accumulation_steps": 4})),
    "DP2 ZeRO-3 bf16 O2 accumulation 2 once per step": (2, _run(SMALL_VOCAB, 2,
                                                                parallel={**DP2, "zero_stage": 3, **ONCE},
                                                                optimize={**BF16, "gradient_accumulation_steps": 2})),
    "HSDP 2x2 ZeRO-3 accumulation 2": (4, _run(SMALL_VOCAB, 2, parallel={**HSDP, "zero_stage": 3},
                                               optimize={"gradient_accumulation_steps": 2})),
    "HSDP 2x2 ZeRO-3 accumulation 2 once per step": (4, _run(SMALL_VOCAB, 2,
                                                             parallel={**HSDP, "zero_stage": 3, **ONCE},
                                                             optimize={"gradient_accumulation_steps": 2})),
    "TP2 SP": (2, _run(SMALL_VOCAB, parallel={"tensor_parallel": 2})),
    "TP2 no SP": (2, _run(SMALL_VOCAB, parallel={"tensor_parallel": 2, "sequence_parallel": False})),
    "TP2 SP bf16 O2 accumulation 2": (2, _run(SMALL_VOCAB, 2, parallel={"tensor_parallel": 2},
                                              optimize={**BF16, "gradient_accumulation_steps": 2})),
    # Frozen weights in the compute dtype (issue 13): a bf16 base, no fp32 shard, no replicate copy.
    "DP2 ZeRO-0 LoRA bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 0}, optimize=BF16, lora=LORA)),
    "DP2 ZeRO-1 LoRA bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 1}, optimize=BF16, lora=LORA)),
    "DP2 ZeRO-0 LoRA bf16 O3": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 0},
                                        optimize={**BF16, "precision_level": "O3"}, lora=LORA)),
    "DP2 ZeRO-3 LoRA bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3}, optimize=BF16, lora=LORA)),
    "TP2 LoRA bf16 O2": (2, _run(SMALL_VOCAB, parallel={"tensor_parallel": 2}, optimize=BF16, lora=LORA)),
    "DP2 ZeRO-0 frozen 2 layers + embeddings bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 0},
                                                                optimize=BF16, freeze=FROZEN)),
    "DP2 ZeRO-3 frozen 2 layers + embeddings bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3},
                                                                optimize=BF16, freeze=FROZEN)),
    "PP2 1F1B": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "1f1b"})),
    "PP2 GPipe": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "gpipe"})),
    "PP2 1F1B bf16 O2": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "1f1b"}, optimize=BF16)),
    "PP2 interleaved 1F1B": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "interleaved_1f1b",
                                                                  "virtual_stages": 2})),
    "PP2 zero-bubble V": (2, _run(SMALL_VOCAB, 2, parallel={**PP2, "schedule": "zero_bubble", "virtual_stages": 2})),
    # The loss without full logits (issue 13; optimize.chunked_loss, on above): against the plain
    # path, on a model whose logits dominate, one process, TP2 and PP2, chunks of 1,024 and 256 tokens.
    "demo fp32 plain loss": (1, _run(DEMO, optimize=PLAIN_LOSS)),
    "large-vocab fp32 plain loss": (1, _run(LARGE_VOCAB, 8, optimize=PLAIN_LOSS)),
    "large-vocab fp32": (1, _run(LARGE_VOCAB, 8)),
    "large-vocab fp32 chunk 256": (1, _run(LARGE_VOCAB, 8, optimize={"loss_chunk_tokens": 256})),
    "large-vocab bf16 O2": (1, _run(LARGE_VOCAB, 8, optimize=BF16)),
    "large-vocab bf16 O1": (1, _run(LARGE_VOCAB, 8, optimize={**BF16, "precision_level": "O1"})),
    "large-vocab tied gpt2": (1, _run({"preset": "tiny_gpt2", "vocab_size": 16384}, 8)),
    "large-vocab TP2 SP": (2, _run(LARGE_VOCAB, 8, parallel={"tensor_parallel": 2})),
    "large-vocab TP2 SP plain loss": (2, _run(LARGE_VOCAB, 8, parallel={"tensor_parallel": 2}, optimize=PLAIN_LOSS)),
    "large-vocab PP2 1F1B chunk 256": (2, _run(LARGE_VOCAB, 4, parallel={**PP2, "schedule": "1f1b"},
                                               optimize={"loss_chunk_tokens": 256})),
    "large-vocab PP2 1F1B plain loss": (2, _run(LARGE_VOCAB, 4, parallel={**PP2, "schedule": "1f1b"},
                                                optimize=PLAIN_LOSS)),
    "large-vocab DP2 ZeRO-3 bf16 O2": (2, _run(LARGE_VOCAB, 4, parallel={**DP2, "zero_stage": 3}, optimize=BF16)),
    # The optimizer step (issue 13): foreach's group-size temporary, the chunked update, 16-bit and
    # 8-bit moments, the update in backward (no full set of gradients). The default kernel is fused.
    "bench optimizer foreach": (1, _run(BENCH, 8, {"seq_length": 512}, train=_train(optimizer_impl="foreach"))),
    "bench optimizer chunked": (1, _run(BENCH, 8, {"seq_length": 512}, train=_train(optimizer_impl="chunked"))),
    "bench bf16 moments": (1, _run(BENCH, 8, {"seq_length": 512}, train=_train(optimizer_state_dtype="bf16"))),
    # optimize.offload_optimizer: stream (issue 25) on the bench model: host state, the update on the "device".
    "bench stream optimizer": (1, _run(BENCH, 8, {"seq_length": 512}, optimize=STREAM)),
    "bench stream optimizer bf16 state": (1, _run(BENCH, 8, {"seq_length": 512}, optimize=STREAM,
                                                  train=_train(optimizer_state_dtype="bf16"))),
    "bench stream optimizer in backward": (1, _run(BENCH, 8, {"seq_length": 512}, optimize=STREAM,
                                                   train=_train(**IN_BACKWARD))),
    "bench 8-bit AdamW": (1, _run(BENCH, 8, {"seq_length": 512}, train=_train(optimizer="adamw_8bit"))),
    "bench optimizer in backward": (1, _run(BENCH, 8, {"seq_length": 512}, train=_train(**IN_BACKWARD))),
    # One sample of 512 tokens and full recompute: gradients, not activations, make the peak.
    "bench batch 1 recompute full": (1, _run(BENCH, 1, {"seq_length": 512}, optimize={"recompute": "full"},
                                             train=_train(1, max_grad_norm=None))),
    "bench batch 1 recompute full in backward": (1, _run(BENCH, 1, {"seq_length": 512}, optimize={"recompute": "full"},
                                                         train=_train(1, **IN_BACKWARD))),
    "small-vocab bf16 O2 bf16 moments in backward": (1, _run(SMALL_VOCAB, 8, optimize=BF16, train=_train(
        optimizer_state_dtype="bf16", **IN_BACKWARD))),
    "small-vocab chunked bf16 moments": (1, _run(SMALL_VOCAB, 8, train=_train(optimizer_impl="chunked",
                                                                               optimizer_state_dtype="bf16"))),
    "DP2 ZeRO-1 bf16 moments": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 1},
                                        train=_train(4, optimizer_state_dtype="bf16"))),
    "DP2 ZeRO-3 in backward": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3}, train=_train(4, **IN_BACKWARD))),
    "DP2 ZeRO-3 8-bit AdamW": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3},
                                       train=_train(4, optimizer="adamw_8bit"))),
    "TP2 SP foreach bf16 moments": (2, _run(SMALL_VOCAB, parallel={"tensor_parallel": 2},
                                            train=_train(4, optimizer_impl="foreach", optimizer_state_dtype="bf16"))),
    # Offload (issue 13): the optimizer's masters, gradients and state on the host (the step on the CPU),
    # the saved activations on the host. Host memory is this CPU's too: the estimate's device and host
    # figures together against the count.
    "demo offload optimizer fp32": (1, _run(DEMO, optimize=OFFLOAD)),
    "demo offload optimizer bf16 O2": (1, _run(DEMO, optimize={**BF16, **OFFLOAD})),
    "small-vocab offload optimizer accumulation 2": (1, _run(SMALL_VOCAB, 4, optimize={
        **OFFLOAD, "gradient_accumulation_steps": 2})),
    "DP2 ZeRO-3 offload optimizer": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3}, optimize=OFFLOAD)),
    "DP2 ZeRO-3 offload optimizer bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3},
                                                     optimize={**BF16, **OFFLOAD})),
    "demo stream optimizer fp32": (1, _run(DEMO, optimize=STREAM)),
    "demo stream optimizer bf16 O2": (1, _run(DEMO, optimize={**BF16, **STREAM})),
    "demo stream optimizer bf16 state": (1, _run(DEMO, optimize=STREAM, train=_train(4, optimizer_state_dtype="bf16"))),
    "demo stream optimizer in backward bf16 O2": (1, _run(DEMO, optimize={**BF16, **STREAM},
                                                          train=_train(4, **IN_BACKWARD))),
    "demo stream optimizer 8-bit": (1, _run(DEMO, optimize=STREAM, train=_train(4, optimizer="adamw_8bit"))),
    "demo stream optimizer 8-bit in backward bf16 O3": (1, _run(
        DEMO, optimize={**BF16, **STREAM, "precision_level": "O3"},
        train=_train(4, optimizer="adamw_8bit", **IN_BACKWARD))),
    "DP2 ZeRO-3 stream optimizer bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 3},
                                                     optimize={**BF16, **STREAM})),
    "small-vocab offload activations": (1, _run(SMALL_VOCAB, 8, optimize={"offload_activations": True})),
    "small-vocab offload activations recompute full": (1, _run(SMALL_VOCAB, 8, optimize={
        "offload_activations": True, "recompute": "full"})),
    # QLoRA (issue 13): every block linear's base in 4 bits (torchao NF4) or 8 bits, adapters on top; the
    # dequantisation of one weight at a time in forward and backward.
    "small-vocab QLoRA nf4 fp32": (1, _run(SMALL_VOCAB, 8, lora=QLORA)),
    "small-vocab QLoRA nf4 bf16 O2": (1, _run(SMALL_VOCAB, 8, optimize=BF16, lora=QLORA)),
    "small-vocab QLoRA int8 fp32": (1, _run(SMALL_VOCAB, 8, lora={**QLORA, "quantize_base": "int8"})),
    "bench QLoRA nf4 bf16 O2 batch 2": (1, _run(BENCH, 2, {"seq_length": 512}, optimize=BF16, lora=QLORA)),
    # Short sequences: one weight's dequantisation, not the activations, sets the peak.
    "bench QLoRA nf4 fp32 batch 1 seq 32": (1, _run(BENCH, 1, {"seq_length": 32}, lora=QLORA)),
    "bench QLoRA int8 bf16 O2 batch 1 seq 32": (1, _run(BENCH, 1, {"seq_length": 32}, optimize=BF16,
                                                        lora={**QLORA, "quantize_base": "int8"})),
    "DP2 ZeRO-0 QLoRA nf4 bf16 O2": (2, _run(SMALL_VOCAB, parallel={**DP2, "zero_stage": 0}, optimize=BF16,
                                             lora=QLORA)),
}


def log(msg: str) -> None:
    print(f"[memory_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_config(sections: dict[str, Any], output_dir: str, threads: int) -> Any:
    """A validated RunConfig: the sections on top of quiet 2-step training defaults on the CPU."""
    raw: dict[str, Any] = {"train": {"output_dir": output_dir, "max_steps": 2, "lr": 1e-3, "progress_bar": False,
                                     "tensorboard": False, "log_steps": 1},
                           "run": {"device": "cpu", "num_threads": threads}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return validate(raw)


def dataset(cfg: Any) -> PackedDataset:
    """Random tokens; with data.train_files set, documents of 40-200 tokens packed into the samples."""
    rng = np.random.default_rng(0)
    n = cfg.data.seq_length * cfg.train.micro_batch_size * 64 + 1
    tokens = rng.integers(0, cfg.model.vocab_size, size=n).astype(np.int64)
    if cfg.data.train_files:
        starts = np.cumsum(rng.integers(40, 200, size=n // 40))
        return PackedDataset(ArrayTokens(tokens, np.concatenate([[0], starts[starts < n]])), cfg.data.seq_length)
    return PackedDataset(tokens, cfg.data.seq_length)


def _measure_rank(rank: int, world: int, sections: dict[str, Any], root: str, threads: int) -> dict[str, Any]:
    cfg = build_config(sections, root, threads)
    return measure_training(cfg, dataset(cfg)).as_dict()


def run_one(name: str, world: int, sections: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    """Measure and estimate one configuration; one record per rank."""
    with tempfile.TemporaryDirectory(prefix="shardwise-memcheck-") as tmp:
        cfg = build_config(sections, tmp, threads)
        estimates = estimate_all_ranks(cfg, world, device="cpu")
        start = time.perf_counter()
        if world == 1:
            measured = [_measure_rank(0, 1, sections, tmp, threads)]
        else:
            from tests.parallel.harness import run_distributed

            measured = run_distributed(_measure_rank, world, sections, tmp, 1, timeout=900)
        seconds = time.perf_counter() - start
    per_stage = world // cfg.parallel.pipeline_parallel
    records = []
    for rank, meas in enumerate(measured):
        est = estimates[rank // per_stage]
        # All of it is this CPU's memory: the device's figure and the host's (CPU offload) together.
        totals = {p: est.detail["device_phases"][p] + est.host_phases.get(p, 0) for p in est.phases}
        predicted = max(totals.values())
        records.append({
            "config": name, "rank": rank, "processes": world, "estimate": predicted, "measured": meas["peak"],
            "error": (predicted - meas["peak"]) / meas["peak"], "estimate_phase": est.peak_phase,
            "measured_phase": meas["peak_phase"], "estimate_phases": totals, "estimate_host": est.host,
            "measured_phases": meas["phases"],
            "measure_s": round(seconds, 1),
        })
    return records


def markdown(records: list[dict[str, Any]]) -> str:
    """The table of estimates against measurements (the largest per-phase error in the last column)."""
    mib = 2**20
    lines = ["| configuration | rank | estimate (MiB) | measured (MiB) | error | peak phase (est. / meas.) | "
             "worst phase error |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in records:
        phase_errors = {p: (r["estimate_phases"][p] - m) / m for p, m in r["measured_phases"].items() if m}
        worst = max(phase_errors, key=lambda p: abs(phase_errors[p]))
        lines.append(f"| {r['config']} | {r['rank']} | {r['estimate'] / mib:.1f} | {r['measured'] / mib:.1f} | "
                     f"{r['error'] * 100:+.1f}% | {r['estimate_phase']} / {r['measured_phase']} | "
                     f"{phase_errors[worst] * 100:+.1f}% ({worst}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated configuration names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of a one-process run")
    args = parser.parse_args(argv)
    if args.list:
        for name, (world, _) in CONFIGS.items():
            print(f"{name} ({world} process{'es' if world > 1 else ''})")
        return 0
    names = list(CONFIGS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configuration(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    records = []
    start = time.perf_counter()
    for name in names:
        world, sections = CONFIGS[name]
        log(f"{name} ({world} process{'es' if world > 1 else ''})")
        for rec in run_one(name, world, sections, args.threads):
            print(json.dumps(rec), flush=True)
            records.append(rec)
    print()
    print(markdown(records))
    worst = max(records, key=lambda r: abs(r["error"]))
    print(f"\n{len(names)} configurations, {len(records)} ranks; largest error {worst['error'] * 100:+.1f}% "
          f"({worst['config']}, rank {worst['rank']}); {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
