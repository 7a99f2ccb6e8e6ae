"""Frozen weights stay small (issue 13): parameters that do not train (LoRA bases, frozen layers) are
stored in the compute dtype in every layout, with no fp32 copy.

At precision O2 under data parallelism FSDP2's sharded fp32 parameters are the master weights of what
trains; a frozen weight needs no master, so `apply_data_parallel` stores it in bf16 (the values its
mixed-precision policy used to cast it to every forward) and ZeRO 0/1 leave it out of `replicate`,
whose unsharded compute copy would double it. Without data parallelism (one device, TP, PP) the
model is bf16 already. Checked here for LoRA and frozen layers, bf16 at O2:

- storage: every frozen parameter's local tensor is bf16, every trainable one fp32 under data
  parallelism (bf16 beside fp32 masters without); a replica holds exactly the one-device bytes of
  frozen weights (ZeRO 0/1), a shard half of them (ZeRO 2/3);
- memory: the MemoryTracker's peak of LoRA at DP2 ZeRO-0 is the one-device peak (the same micro-batch
  per rank), where the old storage (fp32 base + replicate's bf16 copy) was far above it, and the
  estimator predicts these peaks (and Llama-3-8B's at DP8: the one-GPU figure);
- parity: each layout's losses are bit for bit those of the same layout with the old storage (the
  frozen weights' bf16 values are exactly FSDP2's per-forward cast), and agree with one process
  within bf16's rounding;
- checkpoints: the base is saved in bf16, resumes exactly (its values bit for bit, the losses of an
  uninterrupted run), loads under another layout, into one process, and a checkpoint that holds the
  old fp32 base holds the same values once cast.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from shardwise.checkpoint import storage as ckpt
from shardwise.checkpoint.weights import load_model
from shardwise.data.packing import PackedDataset
from shardwise.memory.estimate import estimate_all_ranks, estimate_memory
from shardwise.memory.measure import MemoryTracker
from shardwise.models import build_model, resolve_model_config
from shardwise.models.hf import save_hf
from shardwise.parallel import data_parallel
from shardwise.resolve import resolve_config as validate
from shardwise.train.probe import measure_training
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens
from .harness import full_tensor, run_distributed

STEPS = 3
ROWS = 4  # samples per step over all data-parallel ranks
LORA = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}}
FREEZE = {"freeze": {"embeddings": True, "layers": 1}}
PP2 = {"pipeline_parallel": 2, "micro_batch_num": 2, "schedule": "1f1b"}
# name -> (processes, parallel section, fine-tuning section and any other sections)
LAYOUTS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "lora_zero0": (2, {"data_parallel": 2, "zero_stage": 0}, LORA),
    "lora_zero1": (2, {"data_parallel": 2, "zero_stage": 1}, LORA),
    "lora_zero2": (2, {"data_parallel": 2, "zero_stage": 2}, LORA),
    "lora_zero3": (2, {"data_parallel": 2, "zero_stage": 3}, LORA),
    "lora_hsdp": (2, {"data_parallel": 2, "data_parallel_replicate": 2, "zero_stage": 3}, LORA),
    "lora_zero3_offload": (2, {"data_parallel": 2, "zero_stage": 3},
                           {**LORA, "optimize": {"mixed_precision": "bf16", "offload_optimizer": True}}),
    "freeze_zero0": (2, {"data_parallel": 2, "zero_stage": 0}, FREEZE),
    "freeze_zero3": (2, {"data_parallel": 2, "zero_stage": 3}, FREEZE),
    "lora_tp2": (2, {"tensor_parallel": 2}, LORA),
    "lora_pp2": (2, PP2, LORA),
    "lora_dp2_tp2_zero0": (4, {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 0}, LORA),
    "lora_pp2_dp2_zero3": (4, {"data_parallel": 2, "zero_stage": 3, **PP2}, LORA),
}
# bf16 matmuls over another split of the batch round differently (seen: up to 8e-5 here).
BF16_LOSS_RTOL = 1e-3


def _hf_dir(root: Path) -> Path:
    """A Hugging Face directory with a (random) tiny model in fp32: the base to fine-tune."""
    out = root / "hf"
    if not out.exists():
        torch.manual_seed(123)
        save_hf(build_model(resolve_model_config({"preset": "tiny_llama"})), out)
    return out


def _config(run_dir: Path, hf: Path, parallel: dict | None = None, finetune: dict | None = None,
            micro_batch: int | None = None, **train: Any):  # noqa: ANN202
    parallel = parallel or {}
    rows = ROWS // parallel.get("data_parallel", 1) // parallel.get("micro_batch_num", 1)
    section = {"output_dir": str(run_dir), "max_steps": STEPS, "micro_batch_size": micro_batch or rows,
               "lr": 2e-2, "weight_decay": 0.0, "decay_style": "constant", "warmup_steps": 0, "log_steps": 1,
               "progress_bar": False, "tensorboard": False, "seed": 7, "peak_tflops": 1.0,
               "check_replicas_steps": 1, **train}  # replicas (the plain bf16 frozen tensors too) agree
    return validate({"model": {"init_from": str(hf)}, "data": {"seq_length": SEQ}, "train": section,
                     "run": {"num_threads": 1}, "optimize": {"mixed_precision": "bf16"}, "parallel": parallel,
                     **(finetune or LORA)})


def _layout_config(root: Path, hf: Path, name: str, tag: str = "", **train: Any):  # noqa: ANN202
    _, parallel, finetune = LAYOUTS[name]
    return _config(root / f"{name}{tag}", hf, parallel, finetune, **train)


@contextlib.contextmanager
def old_storage() -> Iterator[None]:
    """The storage before issue 13: frozen weights kept in the build dtype (fp32 under FSDP2 at O2)
    and managed by `replicate` like the others."""
    cast, apart = data_parallel.store_frozen_in, data_parallel.frozen_16_bit
    data_parallel.store_frozen_in = lambda model, dtype: None
    data_parallel.frozen_16_bit = lambda model: set()
    try:
        yield
    finally:
        data_parallel.store_frozen_in, data_parallel.frozen_16_bit = cast, apart


def _saved_dtypes(path: Path) -> dict[str, str]:
    """Every tensor of a checkpoint with the dtype it is saved in (from its .metadata.json)."""
    doc = json.loads((path / ".metadata.json").read_text())
    return {fqn: item["dtype"] for fqn, item in doc["state_dict"].items()}


def _data() -> PackedDataset:
    return PackedDataset(make_tokens(), SEQ)


def _storage(parts: list[torch.nn.Module]) -> dict[str, Any]:
    """Dtypes and bytes of this rank's parameter storage, frozen and trainable apart."""
    seen: dict[int, torch.nn.Parameter] = {}
    for part in parts:
        for p in part.parameters():
            seen.setdefault(id(p), p)
    out: dict[str, Any] = {}
    for kind, params in (("frozen", [p for p in seen.values() if not p.requires_grad]),
                         ("trainable", [p for p in seen.values() if p.requires_grad])):
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        out[kind] = {"dtypes": sorted({str(t.dtype) for t in local}),
                     "bytes": sum(t.untyped_storage().nbytes() for t in local),
                     "numel": sum(p.numel() for p in params)}
    return out


def _train(cfg, resume: str | None = None) -> dict[str, Any]:  # noqa: ANN001
    trainer = Trainer(cfg, train_dataset=_data())
    result = trainer.train(resume=resume)
    frozen = {n: full_tensor(p) for part in trainer.model_parts for n, p in part.named_parameters()
              if not p.requires_grad}
    return {"losses": [result.losses[s] for s in sorted(result.losses)], "storage": _storage(trainer.model_parts),
            "frozen": frozen, "checkpoint": str(result.last_checkpoint)}


def _workers(rank: int, world: int, root: Path, hf: Path, single_checkpoint: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (processes, _, _) in LAYOUTS.items():
        if processes != world:
            continue
        out[name] = _train(_layout_config(root, hf, name))
        with old_storage():
            out[f"{name} old"] = _train(_layout_config(root, hf, name, " old"))
    if world != 2:
        return out
    # Resume the ZeRO-0 run from its step-2 checkpoint, in its own layout and in ZeRO-3.
    two = _layout_config(root, hf, "lora_zero0", " to 2", max_steps=2)
    _train(two)
    for name, tag in (("lora_zero0", " resumed"), ("lora_zero3", " resumed from zero0")):
        cfg = _layout_config(root, hf, name, tag)
        out[f"{name}{tag}"] = _train(cfg, resume=str(ckpt.list_checkpoints(two.train.output_dir)[-1]))
    # DP2 resumes a one-process checkpoint (16-bit model and fp32 masters).
    out["lora_zero0 from single"] = _train(_layout_config(root, hf, "lora_zero0", " from single",
                                                          max_steps=STEPS + 1), resume=single_checkpoint)
    # The peaks of LoRA at DP2 with the micro-batch of one device.
    for zero, tag in ((0, ""), (0, " old"), (3, "")):
        cfg = _peak_config(root / f"peak zero{zero}{tag}", hf, zero)
        with old_storage() if tag else contextlib.nullcontext():
            out[f"peak zero{zero}{tag}"] = measure_training(cfg, _data(), save=False, tracker=MemoryTracker()).peak
    return out


def _peak_config(run_dir: Path, hf: Path, zero: int | None = None):  # noqa: ANN202
    """LoRA with ROWS samples per micro-batch, on one device (`zero` None) or at DP2."""
    parallel = None if zero is None else {"data_parallel": 2, "zero_stage": zero}
    return _config(run_dir, hf, parallel, micro_batch=ROWS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("frozen")
    hf = _hf_dir(root)
    single = {kind: _train(_config(root / f"single_{kind}", hf, finetune=section))
              for kind, section in (("lora", LORA), ("freeze", FREEZE))}
    # The same run with (next to) no learning: how far the updates move the losses.
    single["still"] = _train(_config(root / "single_still", hf, lr=1e-9))
    single["peak"] = measure_training(_peak_config(root / "single_peak", hf), _data(), save=False,
                                      tracker=MemoryTracker()).peak
    ranks = run_distributed(_workers, 2, root, hf, single["lora"]["checkpoint"], timeout=600)
    four = run_distributed(_workers, 4, root, hf, single["lora"]["checkpoint"], timeout=600)
    by_layout = {name: [r[name] for r in (ranks if world == 2 else four)] for name, (world, _, _) in LAYOUTS.items()}
    old = {name: [r[f"{name} old"] for r in (ranks if world == 2 else four)]
           for name, (world, _, _) in LAYOUTS.items()}
    return {"root": root, "hf": hf, "single": single, "ranks": ranks, "layouts": by_layout, "old": old}


def _kind(name: str) -> str:
    return name.split("_")[0]


@pytest.mark.timeout(900)
def test_frozen_weights_are_stored_in_bf16_in_every_layout(runs: dict[str, Any]) -> None:
    single = runs["single"]
    for name, (_, parallel, _) in LAYOUTS.items():
        one = single[_kind(name)]["storage"]
        assert one["frozen"]["dtypes"] == ["torch.bfloat16"], one  # one device at O2: already so
        assert one["frozen"]["bytes"] == 2 * one["frozen"]["numel"]
        dp, zero = parallel.get("data_parallel", 1), parallel.get("zero_stage", 0)
        for rank, (new, old) in enumerate(zip(runs["layouts"][name], runs["old"][name])):
            new, old = new["storage"], old["storage"]
            assert new["frozen"]["dtypes"] == ["torch.bfloat16"], (name, rank, new)
            if dp == 1:  # a 16-bit model beside fp32 masters, as before
                assert new == old, (name, rank)
                continue
            # FSDP2's fp32 shards are the masters; with offload_optimizer they are on the host, the shards bf16.
            masters_on_host = name.endswith("offload")
            assert new["trainable"]["dtypes"] == [f"torch.{'bfloat16' if masters_on_host else 'float32'}"], \
                (name, rank, new)
            if masters_on_host:  # the whole model is built in bf16 there, with or without the old storage
                continue
            assert old["frozen"]["dtypes"] == ["torch.float32"], (name, rank, old)  # what it was
            assert new["frozen"]["bytes"] * 2 == old["frozen"]["bytes"], (name, rank)
            if parallel.get("tensor_parallel", 1) > 1 or parallel.get("pipeline_parallel", 1) > 1:
                continue
            shards = dp // parallel.get("data_parallel_replicate", 1) if zero >= 2 else 1
            if shards == 1:  # a whole replica (ZeRO 0/1; this HSDP: 2 replicas of 1 shard): one device's
                assert new["frozen"]["bytes"] == one["frozen"]["bytes"], (name, rank)
                assert new["trainable"]["bytes"] == 4 * one["trainable"]["numel"], (name, rank)
            else:  # a shard (rows padded to a multiple of 2)
                assert one["frozen"]["bytes"] / 2 <= new["frozen"]["bytes"] < one["frozen"]["bytes"] * 0.52


@pytest.mark.timeout(900)
def test_lora_at_dp2_zero0_peaks_like_one_device_and_as_estimated(runs: dict[str, Any]) -> None:
    one = runs["single"]["peak"]
    for r in runs["ranks"]:
        # One device keeps bf16 adapters and their fp32 masters, a replica fp32 adapters and a bf16
        # copy for compute: the same bytes (seen: 8 bytes apart).
        assert r["peak zero0"] <= one * 1.01, (r["peak zero0"], one)
        assert r["peak zero0 old"] > one * 1.3, (r["peak zero0 old"], one)  # the fp32 base and its bf16 copy
    # The estimator counts the frozen base in bf16 too (seen: within 0.1%).
    root, hf = runs["root"], runs["hf"]
    for zero, measured in ((None, one), (0, runs["ranks"][0]["peak zero0"]), (3, runs["ranks"][0]["peak zero3"])):
        cfg = _peak_config(root / "estimate", hf, zero)
        predicted = estimate_all_ranks(cfg, 1 if zero is None else 2, device="cpu")[0].detail["tensor_peak"]
        assert abs(predicted - measured) <= 0.02 * measured, (zero, predicted, measured)


def test_estimate_of_lora_at_dp8_zero0_is_the_one_gpu_figure() -> None:
    """Issue 13's row: Llama-3-8B LoRA r=16, seq 2048, micro-batch 2, bf16, full recompute."""
    def peak(dp: int, zero: int) -> int:
        cfg = validate({"model": {"preset": "llama3_8b"}, "data": {"seq_length": 2048},
                        "train": {"micro_batch_size": 2, "max_steps": 1}, "lora": {"r": 16},
                        "optimize": {"mixed_precision": "bf16", "recompute": "full"},
                        "parallel": {"data_parallel": dp, "zero_stage": zero}})
        return estimate_memory(cfg, dp).peak

    one = peak(1, 0)
    assert peak(8, 0) <= 1.05 * one and peak(8, 1) <= 1.05 * one  # was 2.3x: an fp32 base and its bf16 copy
    assert peak(8, 3) < one


@pytest.mark.timeout(900)
def test_losses_are_those_of_the_old_storage_and_of_one_process(runs: dict[str, Any]) -> None:
    single = runs["single"]
    # The updates move the last loss far beyond the tolerance (LoRA: about 8 times it), so a layout
    # that trained its adapters wrongly would show.
    moved = abs(single["lora"]["losses"][-1] - single["still"]["losses"][-1]) / single["lora"]["losses"][-1]
    assert moved > 5 * BF16_LOSS_RTOL, moved
    for name in LAYOUTS:
        want = single[_kind(name)]["losses"]
        for rank, (new, old) in enumerate(zip(runs["layouts"][name], runs["old"][name])):
            assert new["losses"] == old["losses"], (name, rank)  # bit for bit
            assert new["losses"] == pytest.approx(want, rel=BF16_LOSS_RTOL), (name, rank, new["losses"], want)


@pytest.mark.timeout(900)
def test_checkpoints_keep_the_bf16_base_and_load_anywhere(runs: dict[str, Any], tmp_path: Path) -> None:
    layouts = runs["layouts"]
    for name in ("lora_zero0", "lora_zero3", "freeze_zero0", "lora_dp2_tp2_zero0", "lora_pp2_dp2_zero3"):
        path = Path(layouts[name][0]["checkpoint"])
        frozen = {n: v for r in layouts[name] for n, v in r["frozen"].items()}  # pipeline ranks hold parts
        saved = _saved_dtypes(path)
        assert {saved[f"model.{n}"] for n in frozen} == {"bfloat16"}, name  # the base as it computed
        assert {d for n, d in saved.items() if n.startswith("model.") and n[6:] not in frozen} == {"float32"}, name
        old = _saved_dtypes(Path(runs["old"][name][0]["checkpoint"]))
        assert {old[f"model.{n}"] for n in frozen} == {"float32"}, name
        model, _ = load_model(path)  # one process, fp32: the bf16 values, exactly
        params = dict(model.named_parameters())
        for n, value in frozen.items():
            assert torch.equal(params[n], value), (name, n)
    # A resumed run continues exactly: the losses of the uninterrupted run, the same frozen values.
    full = layouts["lora_zero0"][0]
    for key, rtol in (("lora_zero0 resumed", 0.0), ("lora_zero3 resumed from zero0", BF16_LOSS_RTOL)):
        got = runs["ranks"][0][key]
        assert got["losses"] == pytest.approx(full["losses"][-1:], rel=rtol, abs=0), key
        assert got["storage"]["frozen"]["dtypes"] == ["torch.bfloat16"], key
        for n, value in full["frozen"].items():
            assert torch.equal(got["frozen"][n], value), (key, n)
    # DP2 resumes a one-process checkpoint with its bf16 base, and one process a DP2 checkpoint.
    from_single = runs["ranks"][0]["lora_zero0 from single"]
    assert len(from_single["losses"]) == 1, from_single["losses"]
    for n, value in runs["single"]["lora"]["frozen"].items():
        assert torch.equal(from_single["frozen"][n], value), n
    cfg = _config(tmp_path / "single_from_dp", runs["hf"], max_steps=STEPS + 1)
    one = _train(cfg, resume=full["checkpoint"])
    assert len(one["losses"]) == 1 and one["storage"]["frozen"]["dtypes"] == ["torch.bfloat16"]
    for n, value in full["frozen"].items():
        assert torch.equal(one["frozen"][n], value), n
    # The old storage saved the fp32 base; cast, it is the base the new storage saves.
    old = ckpt.read_saved_tensors(Path(runs["old"]["lora_zero0"][0]["checkpoint"]), "model", sorted(full["frozen"]))
    for n, value in full["frozen"].items():
        assert torch.equal(old[n].bfloat16().float(), value), n
