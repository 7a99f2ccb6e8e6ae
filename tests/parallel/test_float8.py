"""optimize.float8 (parallel/float8.py): refusals, the conversion, its numerics against fp32, FSDP2's
float8 all-gather against per-forward casts, the trainer with the device check passed, and what the
estimator, the step-time model and the planner make of it.

float8 is refused on a CPU run (it would be emulated), but torch 2.13's `torch._scaled_mm` runs on the
CPU, so torchao's Float8Linear computes here the same float8 products a GPU would (not as fast): the
numerics and the wiring can be tested, the speed and the memory of CUDA kernels cannot.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.data.packing import PackedDataset
from shardwise.errors import ConfigError
from shardwise.hardware import get_hardware
from shardwise.memory.estimate import estimate_memory
from shardwise.models import build_model, resolve_model_config
from shardwise.models.flops import count_parameters_by_kind
from shardwise.parallel import float8 as float8_module
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.float8 import (
    after_optimizer_step,
    apply_float8,
    check_float8,
    float8_device_problem,
    float8_layout_problem,
)
from shardwise.parallel.parallelize import parallelize_model
from shardwise.parallel.recompute import canonical_name
from shardwise.plan import PlanRequest, plan, workload_config
from shardwise.resolve import resolve_config
from shardwise.step_time import predict_step
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, tiny_config, with_changes
from .harness import local_rows, run_distributed

Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

CPU = torch.device("cpu")


def _cfg(model: dict | None = None, dp: int = 1, zero: int = 0, level: str = "O2", **optimize: object):  # noqa: ANN202
    return resolve_config({
        "model": model or {"preset": "tiny_llama"}, "data": {"seq_length": 16},
        "optimize": {"mixed_precision": "bf16", "precision_level": level, "float8": True, **optimize},
        "parallel": {"data_parallel": dp, "zero_stage": zero}, "run": {"device": "cpu"},
        "train": {"max_steps": 1, "micro_batch_size": 4 // dp}})


# --- refusals ---------------------------------------------------------------------------------------


def test_refusals_name_the_field_and_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match=r"optimize\.float8 .*this run is on the CPU.*optimize\.float8: false"):
        check_float8(_cfg(), CPU, ParallelDims())
    check_float8(_cfg(float8=False), CPU, ParallelDims())  # off: nothing to check
    assert "no Ascend NPU path" in float8_device_problem(SimpleNamespace(type="npu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    for capability, refused in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        problem = float8_device_problem(SimpleNamespace(type="cuda"))
        assert (problem is not None) == refused, capability
        if refused:
            assert f"{capability[0]}.{capability[1]}" in problem and "8.9 or later" in problem
    dims = ParallelDims()
    assert "mixed_precision bf16, got fp16" in float8_layout_problem(_cfg(mixed_precision="fp16", level=None), dims)
    assert "mixed_precision bf16, got fp32" in float8_layout_problem(_cfg(mixed_precision="fp32", level=None), dims)
    lora = resolve_config({**_cfg().model_dump(mode="json"), "lora": {"r": 16}})
    assert "does not run with LoRA" in float8_layout_problem(lora, dims)
    assert "tensor_parallel 2" in float8_layout_problem(_cfg(), ParallelDims(tp=2))
    assert float8_layout_problem(_cfg(), ParallelDims(dp_shard=4)) is None  # data parallelism is fine
    # With the device passed, a missing torchao points at the extra that installs it.
    monkeypatch.setattr(float8_module, "float8_device_problem", lambda device: None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"optimize\.float8 needs torchao: pip install 'shardwise\[lowbit\]'"):
        check_float8(_cfg(), CPU, dims)


def test_the_trainer_refuses_before_touching_the_run_directory(tmp_path):
    cfg = with_changes(tiny_config(tmp_path), optimize={"mixed_precision": "bf16", "float8": True})
    with pytest.raises(ConfigError, match=r"optimize\.float8 runs on NVIDIA GPUs"):
        Trainer(cfg, train_dataset=None).train()
    assert not (tmp_path / "run").exists()


# --- the conversion ---------------------------------------------------------------------------------


def _linears(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_apply_float8_converts_the_block_linears_but_not_the_head():
    torch.manual_seed(0)
    model = build_model(resolve_model_config({"preset": "tiny_llama"}))
    names = list(model.state_dict())
    converted = apply_float8(model, _cfg(), ParallelDims())
    kinds = _linears(model)
    assert kinds.pop("output") is nn.Linear
    assert sorted(converted) == sorted(kinds) and len(kinds) == 2 * 7  # q, k, v, o, gate, up, down per block
    assert set(kinds.values()) == {Float8Linear}
    assert list(model.state_dict()) == names  # checkpoints name the weights as before
    assert not getattr(model, "_shardwise_float8_all_gather")  # one process: nothing is gathered

    # An MLP width that is not a multiple of 16 (`_scaled_mm` needs both dimensions so) and a frozen
    # layer (a frozen weight would still pay the weight-gradient matmul) stay bf16.
    odd = build_model(resolve_model_config({"preset": "tiny_llama", "intermediate_size": 168}))
    odd.layers["0"].requires_grad_(False)
    converted = apply_float8(odd, _cfg(), ParallelDims())
    assert converted == [f"layers.1.attention.{w}" for w in ("wq", "wk", "wv", "wo")]
    assert apply_float8(build_model(resolve_model_config({"preset": "tiny_llama"})), _cfg(float8=False),
                        ParallelDims()) == []
    # FSDP2 gathers in float8 under ZeRO 2/3, but not under its CPU offload (the scales' all-reduce needs
    # the shards on the device) nor under ZeRO 0/1, which gather nothing.
    for zero, offload, gathers in ((3, False, True), (2, False, True), (3, True, False), (1, False, False)):
        model = build_model(resolve_model_config({"preset": "tiny_llama"}))
        apply_float8(model, _cfg(dp=2, zero=zero, offload_params=offload), ParallelDims(dp_shard=2))
        assert getattr(model, "_shardwise_float8_all_gather") is gathers
        weight = type(model.layers["0"].attention.wq.weight.data).__name__
        assert (weight == "WeightWithDynamicFloat8CastTensor") is gathers


def test_float8_forward_and_backward_stay_close_to_fp32():
    """The loss and every gradient of a converted bf16 model against the fp32 model (the maths).

    Tolerances: the float8 products carry e4m3 rounding of inputs and weights (3 mantissa bits: up to
    1/16 relative per element) and e5m2 rounding of the output gradients (2 bits: up to 1/8), so a
    gradient tensor's relative error is several percent (measured worst: 11%, bf16 alone: 1.1%); 0.25
    leaves room while a wrong gradient (transposed, unscaled, missing) is off by 1 or more. The loss
    is a mean over 256 tokens and moves far less (measured 2e-6; 1e-3 allowed)."""
    torch.manual_seed(0)
    ref = build_model(resolve_model_config({"preset": "tiny_llama"}))
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    f8 = copy.deepcopy(bf16)
    apply_float8(f8, _cfg(), ParallelDims())
    g = torch.Generator().manual_seed(2)
    tokens, labels = (torch.randint(0, 512, (4, 64), generator=g) for _ in range(2))

    def run(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(tokens).float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach(), logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    (loss0, _, grads0), (_, logits_bf16, _), (loss8, logits8, grads8) = run(ref), run(bf16), run(f8)
    assert not torch.equal(logits8, logits_bf16)  # the float8 path really ran
    assert abs(loss8 - loss0) / loss0 < 1e-3
    for name, want in grads0.items():
        error = ((grads8[name] - want).norm() / want.norm()).item()
        assert error < 0.25, f"{name}: relative error {error:.3f}"


def _train_float8(rank: int, world: int, zero: int, steps: int = 3) -> dict:
    """Three SGD steps of tiny_llama in float8 (bf16 O3) through parallelize_model, this rank's rows of
    fixed batches; the global loss per step, and under ZeRO-3 the first weight's precomputed scale."""
    torch.manual_seed(0)
    model = build_model(resolve_model_config({"preset": "tiny_llama"})).to(torch.bfloat16)
    dims = ParallelDims(dp_shard=world)
    meshes = dims.build_meshes("cpu") if world > 1 else None
    model = parallelize_model(model, _cfg(dp=world, zero=zero, level="O3"), dims, meshes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(2)
    batches = [{k: torch.randint(0, 512, (4, 16), generator=g) for k in ("input_ids", "labels")}
               for _ in range(steps)]
    losses = []
    for batch in batches:
        mb = local_rows(batch, rank, world)
        loss = F.cross_entropy(model(mb["input_ids"]).float().flatten(0, 1), mb["labels"].flatten(),
                               reduction="sum") / 64
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after_optimizer_step([model])
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    weight = model.layers["0"].attention.wq.weight
    out = {"losses": losses, "linear": type(model.layers["0"].attention.wq).__name__}
    if zero == 3:
        full = weight.full_tensor().float()
        local = weight._local_tensor  # to_local() would detach it, without the scale
        out["weight"] = type(local).__name__
        out["scale"] = local._precomputed_scale.item()
        out["scale_of_weight"] = (torch.finfo(torch.float8_e4m3fn).max / full.abs().max().double()).float().item()
    return out


def _zero3_and_zero0(rank: int, world: int) -> tuple[dict, dict]:
    return _train_float8(rank, world, zero=3), _train_float8(rank, world, zero=0)


@pytest.mark.timeout(300)
def test_zero3_gathers_in_float8_and_matches_per_forward_casts():
    """ZeRO-3 all-gathers the bf16 shards cast to float8 with one scale per weight (computed after each
    step by `after_optimizer_step` in one all-reduce); ZeRO-0 (`replicate`) casts the whole bf16 weight
    in every forward. The float8 weights are then the same bits, and so is every loss."""
    for zero3, zero0 in run_distributed(_zero3_and_zero0, 2, timeout=240):
        assert zero3["weight"] == "WeightWithDynamicFloat8CastTensor"
        assert zero3["linear"] == zero0["linear"] == "Float8Linear"
        assert zero3["scale"] == zero3["scale_of_weight"]  # for the weights the last step left
        assert zero3["losses"] == zero0["losses"]


# --- the trainer ------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_trainer_trains_in_float8(tmp_path, monkeypatch):
    """With the device check passed (the CPU runs the float8 products), a bf16 O2 run in float8 trains
    like the bf16 run (losses within 5e-3 relative: float8 rounding, see above; measured 3e-4 by step 4)."""
    monkeypatch.setattr(float8_module, "float8_device_problem", lambda device: None)

    def run(name: str, float8: bool) -> dict[int, float]:
        cfg = with_changes(tiny_config(tmp_path / name, decay_style="constant"),
                           optimize={"mixed_precision": "bf16", "float8": float8})
        return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train().losses

    bf16, f8 = run("bf16", False), run("f8", True)
    assert sorted(f8) == [1, 2, 3, 4] and f8 != bf16
    assert all(math.isclose(f8[s], bf16[s], rel_tol=5e-3) for s in f8)
    assert f8[4] < f8[1]


def _dp2_config(root: Path, name: str, zero: int, dp: int = 2, **train: object):  # noqa: ANN202
    cfg = with_changes(tiny_config(root / name, decay_style="constant", micro_batch_size=4 // dp, **train),
                       optimize={"mixed_precision": "bf16", "float8": True})
    return with_changes(cfg, parallel={"data_parallel": dp, "zero_stage": zero})


def _dp2_runs(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    float8_module.float8_device_problem = lambda device: None  # this worker's copy of the module (forked)

    def run(name: str, zero: int, resume: str | None = None, **train: object) -> dict[int, float]:
        cfg = _dp2_config(root, name, zero, **train)
        return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume=resume).losses

    out = {"zero3": run("zero3", 3, save_steps=2), "zero0": run("zero0", 0)}
    run("resumed", 3, max_steps=2, save_steps=2)
    out["resumed"] = run("resumed", 3, resume="auto", save_steps=2)
    return out


@pytest.mark.timeout(300)
def test_the_trainer_saves_and_resumes_zero3_float8_checkpoints(tmp_path, monkeypatch):
    """DP2 ZeRO-3 in float8: checkpoints hold plain tensors (the float8 all-gather weights unwrapped), so
    they load back (the run resumes exactly) and into one process; ZeRO-0, which casts each whole weight
    in the forward, trains alike (1e-3: at O2 the gathered weight goes fp32 -> float8, not fp32 -> bf16 ->
    float8; measured 4e-4)."""
    results = run_distributed(_dp2_runs, 2, tmp_path, timeout=280)
    for rank_result in results:
        zero3 = rank_result["zero3"]
        assert sorted(zero3) == [1, 2, 3, 4] and zero3 != rank_result["zero0"]
        assert all(math.isclose(zero3[s], rank_result["zero0"][s], rel_tol=1e-3) for s in zero3)
        assert rank_result["resumed"] == {3: zero3[3], 4: zero3[4]}
    monkeypatch.setattr(float8_module, "float8_device_problem", lambda device: None)
    one = Trainer(_dp2_config(tmp_path, "zero3", 0, dp=1, max_steps=6),
                  train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume="auto").losses
    assert sorted(one) == [5, 6] and all(math.isfinite(v) for v in one.values())


# --- estimator, step time, planner ------------------------------------------------------------------


def _llama_1b(float8: bool, compile: bool = True, zero: int = 2, dp: int = 8, vocab: int = 128256) -> object:
    """A LLaMA-3.2-1B-sized run at sequence 4096 in bf16 O2."""
    model = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
             "num_kv_heads": 8, "intermediate_size": 8192, "max_position_embeddings": 4096, "tie_embeddings": True}
    return resolve_config({"model": model, "data": {"seq_length": 4096},
                           "optimize": {"mixed_precision": "bf16", "float8": float8},
                           "parallel": {"data_parallel": dp, "zero_stage": zero}, "run": {"compile": compile},
                           "train": {"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 2 * dp}})


def _block_weights(cfg) -> int:  # noqa: ANN001
    kinds = count_parameters_by_kind(cfg.model)
    return kinds["attention"] + kinds["mlp"]  # LLaMA's block linears have no biases


def test_estimate_gathers_float8_weights_in_one_byte_and_saves_the_same():
    bf16, f8 = (estimate_memory(_llama_1b(on), 8, "cuda") for on in (False, True))
    # ZeRO-2 keeps every block gathered from its forward to its backward: 2 bytes per weight in bf16, 1 in float8.
    saved = bf16.detail["gathered_parameter_bytes"] - f8.detail["gathered_parameter_bytes"]
    assert saved == _block_weights(_llama_1b(False))
    assert f8.detail["layer_activation_bytes"] == bf16.detail["layer_activation_bytes"]  # torchao saves bf16 inputs
    assert f8.params == bf16.params and f8.optimizer == bf16.optimizer
    # One device, a vocabulary small enough that a block's backward is the peak: eager casts hold more
    # than compiled ones (a transient: never less memory than bf16).
    one = {name: estimate_memory(cfg, 1, "cuda").phases["backward"] for name, cfg in (
        ("bf16", _llama_1b(False, dp=1, zero=0, vocab=8192)), ("compiled", _llama_1b(True, dp=1, zero=0, vocab=8192)),
        ("eager", _llama_1b(True, compile=False, dp=1, zero=0, vocab=8192)))}
    assert one["bf16"] < one["compiled"] < one["eager"]


def test_step_time_runs_the_block_linears_at_the_float8_peak():
    h100 = get_hardware("H100")
    bf16, f8 = (predict_step(_llama_1b(on), 8, h100) for on in (False, True))
    cfg = _llama_1b(True)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_length
    rate, rate8 = (peak * 1e12 * h100.compute_efficiency for peak in (h100.tflops_16, h100.tflops_8))
    flops8 = 6 * _block_weights(cfg)  # per token: forward, input gradient, weight gradient
    # Each converted linear casts its input and its output gradient twice per token, its weight twice per
    # micro-batch, 5 bytes per element compiled (FLOAT8_CAST_BYTES), at the memory bandwidth.
    widths = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]
    elements = tokens * 16 * sum(2 * (i + o) for i, o in widths) + 2 * _block_weights(cfg)
    casts = elements * 5 / (h100.memory_bandwidth_gbps * 1e9)
    assert f8.compute == pytest.approx(bf16.compute - tokens * flops8 * (1 / rate - 1 / rate8) + casts, rel=1e-9)
    assert f8.detail["float8"] and f8.tokens_per_s > bf16.tokens_per_s  # 1.26x: the 128k-vocabulary head stays bf16
    # ZeRO-2 all-gathers the block weights in 1 byte: less data-parallel traffic.
    assert f8.detail["dp_comm_total"] < bf16.detail["dp_comm_total"]
    # Eager casts cost more than compiled ones; hardware without float8 times the bf16 step.
    assert predict_step(_llama_1b(True, compile=False), 8, h100).compute > f8.compute
    a100 = get_hardware("A100-80GB")
    assert predict_step(_llama_1b(True), 8, a100).total == predict_step(_llama_1b(False), 8, a100).total


def test_planner_refuses_float8_without_float8_cores_and_skips_tensor_parallel():
    cfg = workload_config(config=_llama_1b(True, dp=1, zero=0), devices=4, global_batch=16)
    with pytest.raises(ConfigError, match=r"optimize\.float8 needs float8 tensor cores, which A100-80GB has not"):
        plan(PlanRequest(cfg=cfg, devices=4, hardware=get_hardware("A100-80GB"), top=3))
    result = plan(PlanRequest(cfg=cfg, devices=4, hardware=get_hardware("H100"), top=50))
    assert result.ranked and all(c.layout.tp == 1 for c in result.ranked)
    assert result.limit["float8_tokens_per_s_per_device"] > result.limit["tokens_per_s_per_device"]
    plain = plan(PlanRequest(cfg=workload_config(config=_llama_1b(False, dp=1, zero=0), devices=4, global_batch=16),
                             devices=4,
                             hardware=get_hardware("H100"), top=50))
    assert any(c.layout.tp > 1 for c in plain.ranked)
    assert result.best.step.total < plain.best.step.total


def _float8_grads(recompute: str) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(resolve_model_config({"preset": "tiny_llama"})).to(torch.bfloat16)
    model = parallelize_model(model, _cfg(recompute=recompute), ParallelDims(), None)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return loss.item(), {canonical_name(n): p.grad.float() for n, p in model.named_parameters()}


def test_recomputed_float8_blocks_give_the_same_gradients():
    """parallelize_model converts before recompute wraps the blocks; a recomputed block (full, or
    selective, whose policy keeps every other matmul's output) casts its inputs again in the same way,
    so the loss and the gradients are the ones without recompute."""
    loss, grads = _float8_grads("none")
    for mode in ("full", "selective"):
        got_loss, got = _float8_grads(mode)
        assert got_loss == loss
        assert got.keys() == grads.keys()
        for name, want in grads.items():
            assert torch.equal(got[name], want), f"recompute {mode}: {name}"
