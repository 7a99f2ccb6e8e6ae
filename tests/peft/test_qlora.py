"""QLoRA (lora.quantize_base): torchao's NF4 / int8 storage counted exactly, its dequantisation against
the maths, training equal to LoRA on the dequantised base, a falling loss, exact resume without the
base in checkpoints, DP2 ZeRO-0 like one process, the adapter in peft, and the config's errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.storage import read_trainer_state
from shardwise.data.packing import PackedDataset
from shardwise.errors import ConfigError
from shardwise.memory.measure import MemoryTracker
from shardwise.models import build_model, resolve_model_config
from shardwise.models.hf import from_hf, save_hf
from shardwise.models.moe import GroupedExperts
from shardwise.parallel.dims import layout_for
from shardwise.peft.lora import LoRALinear, apply_lora, is_lora_name, merge_lora
from shardwise.peft.qlora import check_quantize_base, quantize_base
from shardwise.peft.quantize import (
    dequant_chunks,
    dequantize,
    dequantized_transient,
    lora_linear,
    quantize_tensor,
    quantized_bytes,
)
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer

from ..parallel.harness import run_distributed
from ..train.conftest import make_tokens

pytest.importorskip("torchao")

SEQ = 32
# SmolLM2's proportions, small: 64-wide heads, 3 query heads to 1 key/value head (SmolLM2-135M: 9 to 3), so
# the projections' NF4 blocks (576 here) are not a multiple of 256 and double quantisation uses 64 a factor.
SMOL = dict(model_type="llama", vocab_size=256, hidden_size=192, num_layers=2, num_heads=3, num_kv_heads=1,
            intermediate_size=384, max_position_embeddings=64, tie_embeddings=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _cfg(out: Path, kind: str, init_from: Path | None = None, steps: int = 3, precision: str = "fp32",
         dp: int = 1, r: int = 4, **train: object):  # noqa: ANN202
    raw = {"model": {"init_from": str(init_from)} if init_from else dict(SMOL),
           "data": {"seq_length": SEQ},
           "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 4 // dp, "lr": 1e-2,
                     "weight_decay": 0.0, "decay_style": "constant", "warmup_steps": 0, "log_steps": 1,
                     "progress_bar": False, "tensorboard": False, "seed": 7, **train},
           "optimize": {"mixed_precision": precision},
           "parallel": {"data_parallel": dp, "zero_stage": 0},
           "run": {"num_threads": 1, "device": "cpu"},
           "lora": {"r": r, "alpha": 2 * r, "target_modules": ALL, "quantize_base": kind}}
    return validate(raw)


def _data(cfg) -> PackedDataset:  # noqa: ANN001
    return PackedDataset(make_tokens(vocab=cfg.model.vocab_size), SEQ)


def _train(cfg) -> tuple[Trainer, dict[int, float]]:  # noqa: ANN001
    trainer = Trainer(cfg, train_dataset=_data(cfg))
    return trainer, trainer.train(overwrite=True).losses


def _hf_base(root: Path) -> Path:
    """A Hugging Face directory with a random SmolLM2-shaped model: the 'published weights'."""
    torch.manual_seed(123)
    out = root / "hf_base"
    save_hf(build_model(resolve_model_config(SMOL)), out)
    return out


# ---- the maths: an independent dequantisation from the stored parts ----

def nf4_reference(q: torch.Tensor) -> torch.Tensor:
    """NF4 by its definition: each byte holds two 4-bit codes (high nibble first); a value is the NF4
    table entry of its code times its block's absmax scale; each scale is stored as int8 / (its scaler
    block's factor) + the mean of all scales."""
    codes = torch.stack([q.quantized_data >> 4, q.quantized_data & 0b1111], dim=-1).flatten().long()
    factors = q.quantization_factor.repeat_interleave(q.scaler_block_size)
    scales = q.quantized_scalers.to(q.quantization_factor.dtype) / factors + q.scaler_mean
    values = q.nf4[codes].view(-1, q.block_size) * scales.view(-1, 1)
    return values.reshape(q.shape)


def int8_reference(q: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 by row: the code times the row's scale (the zero point is 0)."""
    assert not q.zero_point.any()
    return (q.qdata.float() * q.scale.float()).to(q.dtype)


REFERENCE = {"nf4": nf4_reference, "int8": int8_reference}


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(192, 192), (64, 192), (384, 192), (576, 576)])
def test_storage_is_counted_exactly_and_dequantises_as_the_maths_says(kind, dtype, shape):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    q = quantize_tensor(w, kind)
    parts = [getattr(q, name) for name in q.__tensor_flatten__()[0]]
    assert quantized_bytes(kind, shape, w.element_size()) == sum(p.untyped_storage().nbytes() for p in parts)
    full = dequantize(q)
    assert full.dtype == dtype and full.shape == w.shape
    if dtype == torch.float32:  # the reference computes in fp32; torchao's bf16 path rounds in between
        assert torch.equal(full, REFERENCE[kind](q))
    # Within half the largest gap of the code book (NF4: 0.139 of the block's absmax, plus the error of its
    # 8-bit scale; int8: 1/254 of the row's absmax).
    blocks = w.float().reshape(-1, 64) if kind == "nf4" else w.float()
    bound = blocks.abs().amax(dim=1, keepdim=True) * (0.16 if kind == "nf4" else 0.5 / 127 + 0.01)
    assert ((full.float().reshape(blocks.shape) - blocks).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 1024), (688, 256), (192, 192)])  # 16, 1 (NF4; int8 16) and 1 blocks
def test_dequantisation_in_row_blocks_is_exact_and_its_transient_counted(kind, dtype, shape):
    q = quantize_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype), kind)
    tracker = MemoryTracker()
    with tracker:
        tracker.start_recording()
        full = dequantize(q)
    whole = q.get_original_weight() if kind == "nf4" else q.dequantize()  # torchao's, in one piece
    assert torch.equal(full, whole)
    # The tracker sees the quantised parts when the dequantisation reads them, and what it allocates.
    size = full.element_size()
    assert tracker.peak == dequantized_transient(kind, shape, size) + quantized_bytes(kind, shape, size)
    if dequant_chunks(kind, shape) > 1:  # the row blocks keep torchao's temporaries to a 16th
        assert dequantized_transient(kind, shape, size) < 4 * full.numel() * size

    # Backward of a LoRA layer on it: the weight dequantised whole again, the input gradient summed in fp32.
    x = torch.randn(3, 5, shape[1], generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_(True)
    weight = torch.nn.Parameter(q, requires_grad=False)
    a, b = (torch.randn(s, generator=torch.Generator().manual_seed(4)).mul(0.1).to(dtype).requires_grad_(True)
            for s in ((4, shape[1]), (shape[0], 4)))
    y = lora_linear(x, weight, None, a, b, 2.0, 0.0)
    F = torch.nn.functional
    assert torch.equal(y, F.linear(x.detach(), whole) + F.linear(F.linear(x.detach(), a.detach()), b.detach()) * 2)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    tracker = MemoryTracker()
    with tracker:
        tracker.start_recording()
        y.backward(grad)
    reference = grad.double() @ whole.double() + (grad.double() * 2) @ b.double() @ a.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (x.grad.double() - reference).abs().max() <= tol * reference.abs().max()
    # The peak: the dequantised weight and the fp32 sums; beside them what backward reads (x, the output
    # gradient, A, B, A's output) and makes (their gradients, the scaled output gradient); in 16 bits on a
    # CPU the matmuls' fp32 operands too.
    tokens = x.shape[0] * x.shape[1]
    backward = dequantized_transient(kind, shape, size, backward=True, tokens=tokens)
    assert backward + quantized_bytes(kind, shape, size) <= tracker.peak
    beside = 2 * (x.numel() + grad.numel() + a.numel() + b.numel() + 4 * tokens) * size
    widened = 0 if dtype == torch.float32 else (full.numel() + grad.numel() + a.numel() + 4 * tokens) * 4
    assert tracker.peak <= backward + quantized_bytes(kind, shape, size) + beside + widened


def _lora_layer(kind: str, shape: tuple[int, int], dtype: torch.dtype, dropout: float = 0.0,
                bias: bool = False) -> LoRALinear:
    """A LoRA layer (r 8, scaling 2) with a random, non-zero adapter on a base quantised as `kind`
    ("none": plain)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.nn.Linear(shape[1], shape[0], bias=bias)
    with torch.no_grad():
        for param in base.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    layer = LoRALinear(base.to(dtype), 8, 16, dropout)
    with torch.no_grad():
        for param in (layer.lora_A.weight, layer.lora_B.weight):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    if kind != "none":
        quantize_base(torch.nn.ModuleList([layer]), kind)
    return layer


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_input_gradient_is_summed_in_fp32_and_rounded_once(kind):
    # 16 row blocks of the base, and LoRA's part beside them: summed in bf16 piece by piece they were
    # rounded 17 times (3 times the error of one rounding); summed in fp32 they are rounded once.
    layer = _lora_layer(kind, (256, 1024), torch.bfloat16)
    x = torch.randn(2, 64, 1024, generator=torch.Generator().manual_seed(6)).bfloat16().requires_grad_(True)
    y = layer(x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    y.backward(grad)
    w, a, b = (t.detach().double() for t in (dequantize(layer.weight), layer.lora_A.weight, layer.lora_B.weight))
    g = grad.double()
    reference = g @ w + (g * layer.scaling) @ b @ a  # the same bf16 operands, float64 maths
    once = reference.bfloat16().double()  # the best a bf16 gradient can be
    error, best = x.grad.double() - reference, once - reference
    assert error.norm() <= 1.1 * best.norm()
    assert error.abs().max() <= 1.5 * best.abs().max()


def test_dropout_and_bias_as_on_a_plain_base():
    # In training mode the quantised layer drops out the adapter's input as nn.Dropout does (the same
    # mask for the same seed) and its gradients are autograd's on the dequantised base; in eval mode
    # nothing is dropped.
    quantised = _lora_layer("nf4", (64, 128), torch.float32, dropout=0.3, bias=True)
    plain = _lora_layer("none", (64, 128), torch.float32, dropout=0.3, bias=True)
    with torch.no_grad():
        plain.weight.copy_(dequantize(quantised.weight))
    results = []
    for layer in (quantised, plain):
        x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(8)).requires_grad_(True)
        torch.manual_seed(9)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10)))
        results.append((y.detach(), x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad))
        layer.eval()
        results.append((layer(x).detach(),))
    (y, *grads), (y_eval,), (y_ref, *grads_ref), (y_eval_ref,) = results
    assert torch.equal(y, y_ref) and torch.equal(y_eval, y_eval_ref) and not torch.equal(y, y_eval)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_under_autocast_as_the_plain_layer():
    # Precision level O1: fp32 weights, the matmuls in autocast's bf16. The output and the adapter's
    # gradients are those of the plain layer on the dequantised base; the input gradient (fp32 like x) is
    # the same sum, rounded once instead of in bf16 piece by piece.
    quantised = _lora_layer("nf4", (64, 128), torch.float32, dropout=0.2, bias=True)
    plain = _lora_layer("none", (64, 128), torch.float32, dropout=0.2, bias=True)
    with torch.no_grad():
        plain.weight.copy_(dequantize(quantised.weight))
    results = []
    for layer in (quantised, plain):
        x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(8)).requires_grad_(True)
        torch.manual_seed(9)
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10)).bfloat16())
        results.append((y.detach(), layer.lora_A.weight.grad, layer.lora_B.weight.grad, x.grad))
    (y, *grads, x_grad), (y_ref, *grads_ref, x_grad_ref) = results
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    assert x_grad.dtype == torch.float32
    torch.testing.assert_close(x_grad, x_grad_ref, rtol=1e-2, atol=1e-2 * float(x_grad_ref.abs().max()))


# ---- training ----

def _dequantised_base(hf: Path, root: Path, kind: str) -> Path:
    """The base with every LoRA-targeted weight replaced by its quantised value, by the maths (a MoE block's
    expert stacks each quantised as one [experts x out, in] matrix)."""
    model = from_hf(hf)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.startswith("layers.") and isinstance(module, torch.nn.Linear) and "router" not in name:
                module.weight.copy_(REFERENCE[kind](quantize_tensor(module.weight, kind)))
            if isinstance(module, GroupedExperts):
                for w in (module.w1, module.w3, module.w2):
                    w.copy_(REFERENCE[kind](quantize_tensor(w.reshape(-1, w.shape[-1]), kind)).view_as(w))
    out = root / f"hf_dequantised_{kind}"
    save_hf(model, out)
    return out


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_training_equals_lora_on_the_dequantised_base_and_the_adapter_loads_in_peft(kind, tmp_path):
    hf = _hf_base(tmp_path)
    reference_base = _dequantised_base(hf, tmp_path, kind)
    qlora, got = _train(_cfg(tmp_path / "qlora", kind, init_from=hf))
    _, want = _train(_cfg(tmp_path / "lora", "none", init_from=reference_base))
    assert sorted(got) == [1, 2, 3]
    for step in got:  # the same maths: x @ dequant(W)^T + B(A(x)) * scale, step after step
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    quantized = [m for m in qlora.model.modules() if isinstance(m, LoRALinear)]
    assert len(quantized) == 14 and all(type(m.weight.data).__name__ != "Tensor" for m in quantized)

    # The adapter, in peft's format, on the full-precision (dequantised) base gives our logits.
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    adapter = tmp_path / "qlora" / "checkpoints" / "step_00000003" / "adapter"
    base = transformers.AutoModelForCausalLM.from_pretrained(reference_base, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
    tokens = torch.from_numpy(make_tokens(n=2 * SEQ, vocab=SMOL["vocab_size"]).astype("int64")).view(2, SEQ)
    model = qlora.model.eval()
    with torch.no_grad():
        ours, ref = model(tokens), theirs(tokens).logits
    assert (ours - ref).abs().max() <= 1e-4


# Qwen3-MoE's shape, small: every block a mixture of 4 experts, top 2.
SMOL_MOE = dict(SMOL, model_type="qwen3_moe", qk_norm=True, head_dim=64, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=128)


def test_moe_training_equals_lora_on_the_dequantised_experts(tmp_path):
    """QLoRA on a MoE model: the experts' stacks stored in NF4 (a quarter of their bytes and less), trained with
    adapters on every expert as LoRA trains on the dequantised stacks, step after step; a run that would
    leave the experts 16-bit, or spread them over ranks, stops first."""
    torch.manual_seed(123)
    hf = tmp_path / "hf_moe"
    save_hf(build_model(resolve_model_config(SMOL_MOE)), hf)
    reference_base = _dequantised_base(hf, tmp_path, "nf4")
    qlora, got = _train(_cfg(tmp_path / "qlora", "nf4", init_from=hf))
    _, want = _train(_cfg(tmp_path / "lora", "none", init_from=reference_base))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    experts = qlora.model.layers["1"].feed_forward.experts
    stack = experts.w2
    assert type(stack.data).__name__ == "NF4Tensor" and tuple(stack.shape) == (4 * 192, 128)
    held = sum(p.untyped_storage().nbytes() for p in (getattr(stack, n) for n in stack.__tensor_flatten__()[0]))
    assert held == quantized_bytes("nf4", (4 * 192, 128), 4) < 4 * 192 * 128 * 4 / 7
    assert "layers.1.feed_forward.experts.w2" not in qlora.model.state_dict()  # never saved quantised
    with pytest.raises(ConfigError, match="Merge the run's adapter"):
        merge_lora(qlora.model)
    attention_only = _with(_cfg(tmp_path / "bad", "nf4", init_from=hf), lora={"target_modules": ["q_proj"]})
    with pytest.raises(ConfigError, match=r"adapts no routed expert of layers\.0\.feed_forward\.experts.*add "
                                          r"gate_proj, up_proj and down_proj"):
        check_quantize_base(attention_only, layout_for(attention_only, 1))
    ep = _with(_cfg(tmp_path / "ep", "nf4", init_from=hf, precision="bf16"), parallel={
        "data_parallel": 2, "expert_parallel": 2})
    with pytest.raises(ConfigError, match="expert_parallel 2: the experts' quantised stacks"):
        check_quantize_base(ep, layout_for(ep, 2))


def test_adapter_on_a_4_bit_base_in_peft(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed here (its 4-bit layers need CUDA); "
                        "the same adapter on the full-precision base is checked above")
    if not torch.cuda.is_available():
        pytest.skip("bitsandbytes' 4-bit base needs a CUDA device")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = _hf_base(tmp_path)
    qlora, _ = _train(_cfg(tmp_path / "qlora", "nf4", init_from=hf))
    four_bit = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, quantization_config=four_bit, device_map="cuda",
                                                             attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "qlora" / "checkpoints" / "step_00000003" / "adapter")
    tokens = torch.from_numpy(make_tokens(n=2 * SEQ, vocab=SMOL["vocab_size"]).astype("int64")).view(2, SEQ)
    with torch.no_grad():
        ours = qlora.model.eval()(tokens)
        ref = theirs.eval()(tokens.cuda()).logits.float().cpu()
    # bitsandbytes quantises the same weights to NF4 with its own double quantisation: close, not equal.
    assert (ours - ref).abs().max() <= 0.05 * ours.abs().max()


def test_nf4_smollm2_shaped_loss_falls_in_bf16_as_lora_does(tmp_path):
    _, losses = _train(_cfg(tmp_path / "qlora", "nf4", steps=20, precision="bf16", r=16, lr=2e-2))
    _, lora = _train(_cfg(tmp_path / "lora", "none", steps=20, precision="bf16", r=16, lr=2e-2))
    first, last = losses[1], sum(losses[s] for s in range(16, 21)) / 5
    assert math.isfinite(last) and last < first - 0.3, losses
    # 4 bits cost little here. The bound is above the trajectories' own noise: at lr 2e-2 in bf16 the
    # last bits of the gradient norm (fp32 sums against float64 ones) move each run's mean by 0.04.
    assert last == pytest.approx(sum(lora[s] for s in range(16, 21)) / 5, abs=0.1)


def test_resume_requantises_the_same_base_and_checkpoints_leave_it_out(tmp_path):
    hf = _hf_base(tmp_path)
    _, whole = _train(_cfg(tmp_path / "whole", "nf4", init_from=hf, steps=4))
    _train(_cfg(tmp_path / "split", "nf4", init_from=hf, steps=2))
    resumed = Trainer(_cfg(tmp_path / "split", "nf4", init_from=hf, steps=4), train_dataset=_data(
        _cfg(tmp_path / "split", "nf4", init_from=hf))).train(resume="auto").losses
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == [whole[3], whole[4]]  # exact: the base is rebuilt, not re-quantised
    saved = read_trainer_state(tmp_path / "split" / "checkpoints" / "step_00000002")["shapes"]["model"]
    assert "layers.0.attention.wq.lora_A.weight" in saved and "tok_embeddings.weight" in saved
    assert [n for n in saved if n.startswith("layers.") and not is_lora_name(n)] == [
        f"layers.{i}.{norm}.weight" for i in range(2) for norm in ("attention_norm", "ffn_norm")]


def _dp_losses(rank: int, world: int, root: str, hf: str) -> list[dict[int, float]]:
    out = []
    for zero in (0, 1):
        cfg = _cfg(Path(root) / f"dp_zero{zero}", "nf4", init_from=Path(hf), precision="bf16", dp=world)
        cfg.parallel.zero_stage = zero
        out.append(Trainer(cfg, train_dataset=_data(cfg)).train(overwrite=True).losses)
    return out


def test_dp2_zero0_and_zero1_train_like_one_process(tmp_path):
    hf = _hf_base(tmp_path)
    _, one = _train(_cfg(tmp_path / "one", "nf4", init_from=hf, precision="bf16"))
    ranks = run_distributed(_dp_losses, 2, str(tmp_path), str(hf))
    assert ranks[0] == ranks[1]
    for losses in ranks[0]:
        for step in one:  # bf16, the loss summed in another order over two ranks
            assert losses[step] == pytest.approx(one[step], rel=2e-3), step


# ---- errors ----

def _with(cfg, **sections):  # noqa: ANN001, ANN202
    """`cfg` with some sections' keys changed, validated again."""
    raw = cfg.model_dump(mode="json", exclude_none=True)
    for key, value in sections.items():
        raw[key] = {k: v for k, v in {**raw.get(key, {}), **value}.items() if v is not None}
    if "model" in sections:
        raw["model"] = dict(sections["model"])
    return validate(raw)


def test_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="lora.quantize_base alone"):
        validate({"model": dict(SMOL), "train": {"output_dir": str(tmp_path)}, "lora": {"quantize_base": "nf4"}})
    cfg = _cfg(tmp_path, "nf4")
    check_quantize_base(cfg, layout_for(cfg, 1))  # one device: fine
    four_heads = {**SMOL, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}
    for parallel, match in (({"tensor_parallel": 2}, "tensor_parallel 2"),
                            ({"pipeline_parallel": 2}, "pipeline_parallel 2"),
                            ({"data_parallel": 2, "zero_stage": 3}, "zero_stage 3")):
        bad = _with(cfg, model=four_heads, parallel={"data_parallel": None, **parallel})
        with pytest.raises(ConfigError, match=match):
            check_quantize_base(bad, layout_for(bad, 2))
    fp32_dp = _with(cfg, parallel={"data_parallel": 2})
    with pytest.raises(ConfigError, match="needs a 16-bit frozen base"):
        check_quantize_base(fp32_dp, layout_for(fp32_dp, 2))
    with pytest.raises(ConfigError, match="run.compile"):
        check_quantize_base(_with(cfg, run={"compile": True}), layout_for(cfg, 1))
    odd = _with(cfg, model={**SMOL, "hidden_size": 36, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 48})
    with pytest.raises(ConfigError, match=r"layers.0.attention.wq.weight: 1,296 elements"):
        check_quantize_base(odd, layout_for(odd, 1))
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if torchao were not installed
    with pytest.raises(ConfigError, match=r"pip install 'shardwise\[lowbit\]'"):
        check_quantize_base(cfg, layout_for(cfg, 1))


def test_merge_into_a_quantised_base_is_refused():
    model = build_model(resolve_model_config(SMOL))
    apply_lora(model, 4, 8, 0.0, ["q_proj"])
    assert len(quantize_base(model, "nf4")) == 2
    assert "layers.0.attention.wq.weight" not in model.state_dict()  # never saved quantised
    with pytest.raises(ConfigError, match="Merge the run's adapter"):
        merge_lora(model)

