"""Context parallelism (parallel.context_parallel, DeepSpeed-Ulysses all-to-all) against one process.

Every layout trains through the Trainer with plain SGD on the parity matrix's data and is compared
with one process strictly (test_trainer_parity's checks: first-step gradients, parameters after the
SGD steps, every step's loss on every rank and gradient norm). The data has uneven ignored labels
and padding (`PaddedDataset`), or packed documents with document masks and positions that restart
at each document (`document_dataset`), so a chunk that loses the label at its boundary, a wrong
position, a mask built from one chunk or a gradient not summed over the context-parallel ranks
shows. Deliberate faults run in the same launch and must fail those checks: positions counted from
0 in every chunk (RoPE at the wrong place) and the context-parallel ranks left out of the gradient
reduction (each rank steps its own chunk's gradient).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from shardwise.data.packing import ArrayTokens, PackedDataset
from shardwise.errors import ConfigError
from shardwise.hardware import get_hardware
from shardwise.memory.estimate import estimate_memory
from shardwise.parallel import context
from shardwise.parallel import dims as dims_module
from shardwise.plan import PlanRequest, format_plan, plan, workload_config
from shardwise.plan.search import CP_MIN_SEQ, enumerate_layouts
from shardwise.resolve import resolve_config as validate
from shardwise.step_time import all_to_all_time, predict_step
from shardwise.train.probe import measure_training
from shardwise.train.trainer import Trainer

from ..train.conftest import make_tokens
from .harness import run_distributed
from .test_trainer_parity import (
    MODEL,
    SEQ,
    Layout,
    Reference,
    dataset,
    layout_config,
    parity_failures,
    reference_run,
    train_once,
)

LOSS_RTOL = 1e-6  # per-step losses and gradient norms, relative, in fp32 (the bar)
LAYOUTS = {
    "cp2": Layout("cp2", 2, dict(context_parallel=2), 2, 4),
    "cp2_zero1": Layout("cp2_zero1", 2, dict(context_parallel=2, zero_stage=1), 4, 2),
    "cp2_dp2_zero3": Layout("cp2_dp2_zero3", 4, dict(context_parallel=2, data_parallel=2, zero_stage=3), 2, 2),
    "cp2_hsdp_zero2": Layout("cp2_hsdp_zero2", 4, dict(context_parallel=2, data_parallel=2, data_parallel_replicate=2,
                                                     zero_stage=2), 2, 2),
    "cp2_tp2": Layout("cp2_tp2", 4, dict(context_parallel=2, tensor_parallel=2), 4, 2),
}


def document_dataset() -> PackedDataset:
    """Packed samples with document boundaries every few tokens (some inside, some across the chunk
    boundary at SEQ / 2): document ids and restarting positions in every batch."""
    tokens = make_tokens(4000, vocab=MODEL["vocab_size"])
    starts = np.cumsum(np.resize(np.array([5, 9, 3, 12, 7]), 700))
    return PackedDataset(ArrayTokens(tokens, starts[starts < len(tokens)]), SEQ)


DATA = {"padded": dataset, "documents": document_dataset}


@contextlib.contextmanager
def local_positions(_trainer: Any) -> Iterator[None]:
    """Fault: every chunk's positions from 0 (its own, not the sequence's), when the batch has none."""
    original = context.ContextParallel.chunk

    def chunk(self: context.ContextParallel, t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == 1:  # the default positions 0..T-1, [1, T]
            return t[:, : t.shape[1] // self.size]
        return original(self, t)

    context.ContextParallel.chunk = chunk
    try:
        yield
    finally:
        context.ContextParallel.chunk = original


@contextlib.contextmanager
def gradients_over_dp_only(_trainer: Any) -> Iterator[None]:
    """Fault: gradients reduced over the data-parallel ranks alone, as if the cp ranks held replicas."""
    original = dims_module.Meshes.gradient_mesh
    dims_module.Meshes.gradient_mesh = lambda self, name: self[name]
    try:
        yield
    finally:
        dims_module.Meshes.gradient_mesh = original


FAULTS = {"local_positions": local_positions, "gradients_over_dp_only": gradients_over_dp_only}


def run_cases(rank: int, world: int, root: Path, cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Worker: each (layout, data, fault or "") case in root/<layout>_<data>_<fault>."""
    out = {}
    chunks: list[int] = []
    original = context.ContextParallel.chunk

    def chunk(self: context.ContextParallel, t: torch.Tensor) -> torch.Tensor:
        chunks.append(t.shape[1] // self.size)
        return original(self, t)

    context.ContextParallel.chunk = chunk  # records that the sequences really were split
    try:
        for name, data, fault in cases:
            tag = f"{name}_{data}_{fault}"
            cfg = layout_config(root / tag, LAYOUTS[name])
            # The fault wraps setup too: the gradient mesh is chosen when the model is wrapped.
            out[tag] = train_once(cfg, None, DATA[data]()) if not fault else _with_fault(cfg, fault, data)
            out[tag]["chunks"], chunks[:] = set(chunks), []
    finally:
        context.ContextParallel.chunk = original
    return out


def _with_fault(cfg: Any, fault: str, data: str) -> dict[str, Any]:
    with FAULTS[fault](None):
        return train_once(cfg, None, DATA[data]())


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Reference]]:
    root = tmp_path_factory.mktemp("cp")
    refs = {data: reference_run(layout_config(root / f"single_{data}"), make()) for data, make in DATA.items()}
    for ref in refs.values():
        assert ref.losses[-1] < ref.losses[0]
    return root, refs


def _check(root: Path, refs: dict[str, Reference], world: int, cases: list[tuple[str, str, str]]) -> None:
    results = run_distributed(run_cases, world, root, cases, timeout=540)
    failures = []
    for name, data, fault in cases:
        tag = f"{name}_{data}_{fault}"
        ranks = [r[tag] for r in results]
        assert all(r["chunks"] == {SEQ // 2} for r in ranks), (tag, [r["chunks"] for r in ranks])
        if fault:
            failed = [k for k, v in parity_failures(tag, ranks, root / tag, refs[data]).items() if v]
            assert "loss per step" in failed and "parameters after SGD" in failed, (tag, failed)
            continue
        failed = {k: v for k, v in parity_failures(tag, ranks, root / tag, refs[data], scalar_rtol=LOSS_RTOL).items()
                  if v}
        failures += [f"{tag} [{k}] {v}" for k, v in failed.items()]
    assert not failures, "\n\n".join(failures)


@pytest.mark.timeout(600)
def test_cp2_trains_like_one_process(references) -> None:
    """CP 2 (ZeRO 0 and 1) on padded data and on packed documents equals one process; the faults do not."""
    root, refs = references
    _check(root, refs, 2, [("cp2", "padded", ""), ("cp2", "documents", ""), ("cp2_zero1", "documents", ""),
                           ("cp2", "padded", "local_positions"), ("cp2", "documents", "gradients_over_dp_only")])


@pytest.mark.timeout(600)
def test_cp2_with_fsdp_and_tensor_parallel_trains_like_one_process(references) -> None:
    """CP 2 x DP 2 at ZeRO-3 (FSDP2 over dp_shard_cp), HSDP (2 replicas x dp_shard_cp) and CP 2 x TP 2 (one key/value
    head per TP rank, repeated for the exchange) equal one process."""
    root, refs = references
    _check(root, refs, 4, [("cp2_dp2_zero3", "documents", ""), ("cp2_tp2", "documents", ""),
                           ("cp2_dp2_zero3", "padded", ""), ("cp2_hsdp_zero2", "documents", "")])


def _evaluate(rank: int, world: int, root: Path, name: str) -> dict[str, float]:
    """Worker (or one process with name ""): train on packed documents, then the held-out loss."""
    cfg = layout_config(root / f"eval_{name or 'single'}", LAYOUTS[name] if name else None, max_steps=1)
    return Trainer(cfg, train_dataset=document_dataset(), eval_dataset=document_dataset()).train().eval


@pytest.mark.timeout(300)
def test_cp2_evaluation_equals_one_process(tmp_path: Path) -> None:
    """The held-out loss (the model's loss sum over the cp ranks, tokens counted once) equals one process's."""
    ref = _evaluate(0, 1, tmp_path, "")
    for got in run_distributed(_evaluate, 2, tmp_path, "cp2", timeout=280):
        assert got["tokens"] == ref["tokens"]
        assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)


def _raw(parallel: dict, **sections: Any) -> dict:
    raw = {"model": {"preset": "tiny_llama", **MODEL}, "data": {"seq_length": SEQ}, "parallel": parallel,
           "train": {"max_steps": 1}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


@pytest.mark.parametrize("parallel, sections, words", [
    (dict(context_parallel=2, pipeline_parallel=2), {}, "pipeline_parallel"),
    (dict(context_parallel=2), {"optimize": {"chunked_loss": False}}, "chunked_loss"),
    (dict(context_parallel=3), {"data": {"seq_length": 16}}, "data.seq_length to a multiple of 3"),
    (dict(context_parallel=8), {"data": {"seq_length": 16}}, "model.num_heads"),
    (dict(context_parallel=2, tensor_parallel=4), {"model": {"num_kv_heads": 4}}, "model.num_heads"),
    (dict(context_parallel=2, tensor_parallel=2), {"data": {"seq_length": 18}}, "multiple of 4"),
    (dict(context_parallel=2, zero_stage=1), {"train": {"optimizer_in_backward": True, "max_grad_norm": None}},
     "zero_stage 0, 2 or 3"),
    # The cp ranks share one random stream: their chunks of a sequence would get the same dropout masks.
    (dict(context_parallel=2), {"model": {"dropout": 0.1}}, "set model.dropout: 0, or context_parallel: 1"),
    (dict(context_parallel=2), {"lora": {"r": 4, "dropout": 0.05}}, "set lora.dropout: 0, or context_parallel: 1"),
    (dict(context_parallel=2), {"lora": {"r": 4, "quantize_base": "nf4"}}, "lora.quantize_base: none"),
])
def test_unsupported_settings_are_refused_before_any_process(parallel: dict, sections: dict, words: str) -> None:
    with pytest.raises((ConfigError, ValueError), match="context_parallel") as info:
        validate(_raw(parallel, **sections))
    assert words in str(info.value)


def test_lora_without_dropout_or_a_quantised_base_is_accepted() -> None:
    cfg = validate(_raw(dict(context_parallel=2), lora={"r": 4}))
    assert cfg.lora.quantize_base == "none" and cfg.parallel.context_parallel == 2


def test_layout_counts_context_parallel_ranks() -> None:
    cfg = validate(_raw(dict(context_parallel=2, data_parallel=-1)))
    dims = dims_module.layout_for(cfg, 8)
    assert (dims.dp, dims.cp, dims.dp_cp, dims.world_size) == (4, 2, 8, 8)
    assert cfg.parallel.world_size(8) == 8 and cfg.parallel.dp_degree(8) == 4
    with pytest.raises(ConfigError, match="context_parallel 2"):
        dims_module.layout_for(validate(_raw(dict(context_parallel=2, data_parallel=2))), 2)


# --- the estimator, the step-time model and the planner -------------------------------------------------------

MEASURED = {"cp2": {"context_parallel": 2}, "cp2_zero3": {"context_parallel": 2, "zero_stage": 3}}


def _memory_config(root: Path, name: str) -> Any:
    raw = {"model": {"preset": "tiny_llama", "vocab_size": 128}, "data": {"seq_length": 256},
           "train": {"output_dir": str(root / name), "max_steps": 2, "micro_batch_size": 2, "progress_bar": False,
                     "tensorboard": False},
           "run": {"device": "cpu", "num_threads": 1}, "parallel": MEASURED[name]}
    return validate(raw)


def _measure(rank: int, world: int, root: Path) -> dict[str, dict]:
    torch.manual_seed(0)
    out = {}
    for name in MEASURED:
        cfg = _memory_config(root, name)
        tokens = np.random.default_rng(0).integers(0, 128, size=256 * 64 + 1).astype(np.int64)
        out[name] = measure_training(cfg, PackedDataset(tokens, 256)).as_dict()
    return out


@pytest.mark.timeout(300)
def test_estimate_of_a_context_parallel_run_is_within_ten_percent_of_measured(tmp_path: Path) -> None:
    """The estimator's peak for CP 2 (ZeRO 0 and 3) against the exact live-tensor count of two real ranks."""
    results = run_distributed(_measure, 2, tmp_path, timeout=280)
    for rank, per_run in enumerate(results):
        for name, measured in per_run.items():
            est = estimate_memory(_memory_config(tmp_path, name), 2, "cpu")
            error = (est.detail["tensor_peak"] - measured["peak"]) / measured["peak"]
            assert abs(error) <= 0.10, (name, rank, est.detail["tensor_peak"], measured["peak"], error)
            assert est.detail["context_parallel_exchange_bytes"] > 0


def _preset_config(parallel: dict, seq: int = 8192, **data: Any) -> Any:
    return validate({"model": {"preset": "llama2_7b", "max_position_embeddings": seq},
                     "data": {"seq_length": seq, **data}, "train": {"max_steps": 1, "micro_batch_size": 1},
                     "optimize": {"mixed_precision": "bf16"}, "parallel": parallel})


def test_estimator_splits_per_token_activations_and_keeps_the_mask_whole() -> None:
    one = estimate_memory(_preset_config({"data_parallel": 4, "zero_stage": 3}), 4, "cuda").detail
    cp = estimate_memory(_preset_config({"data_parallel": 2, "context_parallel": 2, "zero_stage": 3}), 4,
                         "cuda").detail
    # Every saved tensor of a block is per token (no mask): half the tokens, half the bytes.
    assert 2 * cp["layer_activation_bytes"] == one["layer_activation_bytes"]
    assert cp["layout"]["cp"] == 2 and cp["layout"]["dp"] == 2 and one["context_parallel_exchange_bytes"] == 0
    # ZeRO-3 shards over dp x cp = 4 ranks in both.
    assert cp["gathered_parameter_bytes"] == one["gathered_parameter_bytes"]
    # An explicit document mask ([B, 1, T, T], per layer) stays whole on every cp rank.
    docs = {"train_files": ["corpus.txt"], "reset_attention_mask": True}
    one_m = estimate_memory(_preset_config({"data_parallel": 4, "zero_stage": 3}, **docs), 4, "cpu").detail
    cp_m = estimate_memory(_preset_config({"data_parallel": 2, "context_parallel": 2, "zero_stage": 3}, **docs), 4,
                           "cpu").detail
    one_c = estimate_memory(_preset_config({"data_parallel": 4, "zero_stage": 3}), 4, "cpu").detail
    cp_c = estimate_memory(_preset_config({"data_parallel": 2, "context_parallel": 2, "zero_stage": 3}), 4,
                           "cpu").detail
    mask = 8192 * 8192 * 2  # bf16
    assert one_m["layer_activation_bytes"] - one_c["layer_activation_bytes"] == mask
    assert cp_m["layer_activation_bytes"] - cp_c["layer_activation_bytes"] == mask


def test_step_time_counts_the_all_to_alls_and_the_wider_gradient_group() -> None:
    hw = get_hardware("H100")
    dp = predict_step(_preset_config({"data_parallel": 2, "zero_stage": 3}), 2, hw)
    cp = predict_step(_preset_config({"context_parallel": 2, "zero_stage": 3}), 2, hw)
    # Two devices and one sequence per data-parallel rank: dp 2 computes 8192 tokens a device, cp 2 4096.
    assert cp.compute == pytest.approx(dp.compute / 2)
    assert dp.cp_comm == 0 and cp.cp_comm > 0
    # Per layer and micro-batch: q, k, v and the output exchanged forward and backward, 32 heads of 128.
    link = (hw.intra_bandwidth_gbps * 1e9 * hw.comm_efficiency, hw.intra_latency_us * 1e-6)
    one = all_to_all_time(8192 // 2 * 128 * 2 * (2 * 32 + 2 * 32), 2, link)
    assert cp.cp_comm == pytest.approx(32 * 2 * one)
    assert cp.dp_comm > 0  # ZeRO-3 over the two cp ranks: gathers and reduce-scatters as for dp 2


def _cp_memory(cp_needed: bool):  # noqa: ANN202
    """A memory model: 100 GiB without context parallelism, 50 GiB with (cp_needed), else 50 for all."""
    def fn(cfg, devices, device):  # noqa: ANN001, ANN202
        peak = int((100 if cp_needed and cfg.parallel.context_parallel == 1 else 50) * 2**30)
        return SimpleNamespace(peak=peak, params=peak // 4, grads=peak // 4, optimizer=peak // 2, activations=0,
                               buffers=0)
    return fn


def _request(seq: int) -> PlanRequest:
    hw = get_hardware("H100")
    cfg = workload_config(model="llama2_7b", seq_length=seq, global_batch=8, devices=8, hardware=hw)
    return PlanRequest(cfg=cfg, devices=8, hardware=hw, pins={"zero": [3], "recompute": ["none"]}, offload=False,
                       top=3)


def test_planner_tries_context_parallelism_for_long_sequences_or_when_nothing_fits_without() -> None:
    short = _request(4096)
    assert {lay.cp for lay, _ in enumerate_layouts(short)} == {1}
    layouts = enumerate_layouts(_request(CP_MIN_SEQ))
    assert {lay.cp for lay, _ in layouts} == {1, 2, 4, 8}
    for lay, cfg in layouts:
        assert lay.dp * lay.tp * lay.pp * lay.cp == 8 and cfg.parallel.world_size(8) == 8
        assert cfg.parallel.context_parallel == lay.cp and cfg.global_batch_size(8) == 8
        assert lay.cp == 1 or lay.pp == 1
    # Fits without: no CP proposed at 4k tokens. Fits only with it: the search tries it.
    assert plan(short, memory_fn=_cp_memory(False)).best.layout.cp == 1
    result = plan(short, memory_fn=_cp_memory(True))
    assert result.best is not None and result.best.layout.cp > 1
    text = format_plan(result)
    assert "CP" in text and "Context parallelism splits each 4096-token sequence" in text
