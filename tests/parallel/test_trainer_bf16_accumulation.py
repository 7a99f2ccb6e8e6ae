"""bf16 at precision O2 accumulates gradients in fp32 in every layout.

Without FSDP2 (one device, tensor- or pipeline-parallel only) the model's weights are bf16 and the
optimizer steps fp32 masters; FSDP2 layouts keep fp32 parameters and reduce in fp32. If the first
kind summed micro-batches in the bf16 `.grad`, a run's gradients would depend on the layout: with 16
micro-batches bf16 accumulation is off by about 1e-3 (relative), fp32 accumulation by about 1e-7.

Every layout starts from the same bf16-representable weights (so the bf16 weights each computes with
are the same), takes one micro-batch of one sample at a time (so each micro-batch's bf16 gradient is
the same computation), and makes one SGD step with a large learning rate; the first step's gradient
is then (w0 - w1) / lr, read from the fp32 weights of its checkpoint (the masters, or FSDP2's fp32
parameters).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import storage as ckpt
from shardwise.data.packing import PackedDataset
from shardwise.memory import precision
from shardwise.models import build_model
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, tiny_config, with_changes
from .harness import run_distributed

SAMPLES = 32  # per optimizer step, over all ranks, one per micro-batch
LR = 100.0  # large, so that (w0 - w1) / lr keeps the gradient's digits in fp32


def _config(root: Path, name: str, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, schedule: str = "1f1b"):  # noqa: ANN202
    base = tiny_config(root, output_dir=str(root / name), max_steps=1, micro_batch_size=1, optimizer="sgd",
                       beta1=0.0, lr=LR, weight_decay=0.0, max_grad_norm=None, warmup_steps=0,
                       decay_style="constant")
    parallel = {"data_parallel": dp, "tensor_parallel": tp, "zero_stage": zero}
    if pp > 1:
        parallel.update(pipeline_parallel=pp, micro_batch_num=2, schedule=schedule)
    return with_changes(base, model={"num_layers": 4}, parallel=parallel,
                        optimize={"gradient_accumulation_steps": SAMPLES // dp, "mixed_precision": "bf16",
                                  "precision_level": "O2"})


def _start_weights(cfg) -> torch.nn.Module:  # noqa: ANN001
    """The model in fp32 with bf16-representable values: cast to bf16 (O2 without FSDP) or used as
    FSDP2's fp32 parameters, it computes with the same bf16 weights."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _first_gradient(cfg) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Train one step; return every weight's first-step gradient from the checkpoint's fp32 weights."""
    model = _start_weights(cfg)
    w0 = {n: p.detach().double() for n, p in model.named_parameters()}
    result = Trainer(cfg, model=copy.deepcopy(model), train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    shapes = ckpt.read_trainer_state(result.last_checkpoint)["shapes"]
    group = "master" if "master" in shapes else "model"  # FSDP2's parameters are the fp32 masters
    w1 = ckpt.read_saved_tensors(result.last_checkpoint, group, sorted(shapes[group]))
    return {n: (w0[n] - w1[n].double()) / LR for n in w1}


def _layouts(rank: int, world: int, root: Path) -> dict[str, dict[str, torch.Tensor]]:
    runs = {"pp2_1f1b": _config(root, "pp2_1f1b", pp=2), "pp2_zero_bubble": _config(root, "pp2_zb", pp=2,
                                                                                   schedule="zero_bubble"),
            "dp2_zero1": _config(root, "dp2_zero1", dp=2, zero=1),
            "dp2_zero3": _config(root, "dp2_zero3", dp=2, zero=3),
            "tp2": _config(root, "tp2", tp=2)}
    out = {name: _first_gradient(cfg) for name, cfg in runs.items()}
    return out if rank == 0 else {}


def _worst_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(got) == set(ref)
    errors = {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}
    name = max(errors, key=errors.get)
    return errors[name], name


@pytest.mark.timeout(600)
def test_bf16_gradients_accumulate_in_fp32_whatever_the_layout(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    single = _first_gradient(_config(tmp_path, "single"))
    layouts = run_distributed(_layouts, 2, tmp_path, timeout=540)[0]
    for name in ("pp2_1f1b", "pp2_zero_bubble", "dp2_zero1", "dp2_zero3"):
        # The same bf16 micro-batch gradients, summed in fp32 in another order (and over two ranks).
        error, where = _worst_relative_error(layouts[name], single)
        assert error < 1e-6, f"{name}: gradient of {where} off by {error:.2e} (relative) from one device"
    # Tensor parallelism splits each matmul, so its bf16 micro-batch gradients round differently
    # (about 1e-3): it agrees with one device within bf16's rounding, not fp32's.
    error, where = _worst_relative_error(layouts["tp2"], single)
    assert error < 2e-2, f"tp2: gradient of {where} off by {error:.2e} from one device"

    # The same one-device run with bf16 accumulation (the hooks removed) is far off the FSDP2 run,
    # which accumulates in fp32: this test tells the two apart.
    original = precision.MasterWeights.__init__

    def bf16_accumulation(self, named) -> None:  # noqa: ANN001
        original(self, named)
        for hook in self._hooks:
            hook.remove()

    monkeypatch.setattr(precision.MasterWeights, "__init__", bf16_accumulation)
    summed_in_bf16 = _first_gradient(_config(tmp_path, "single_bf16_accumulation"))
    error, _ = _worst_relative_error(summed_in_bf16, layouts["dp2_zero3"])
    assert error > 1e-4, error
