"""The steady-state step never waits for the device (issue 14, item 1), and a non-finite step still never
touches the weights.

On this CPU the device is the host, so a sync cannot be seen as an idle GPU. What can be seen is every
read of a tensor's value by Python (`item`, `tolist`, `bool`, `float`, ...): on an accelerator each one
is a host sync. `HostReads` records them, with the functions they came from, while the trainer runs
steps. The only reads allowed are the token counts of the step's batches, which are host tensors
before they are copied to the device, and the figures of the step before (`StepResult.values`: on an
accelerator a pinned copy whose event marks the end of that step, while this one is still queued)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from shardwise.errors import TrainingError
from shardwise.train.step_result import StepResult
from shardwise.train.trainer import Trainer

from .conftest import tiny_config, with_changes

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__format__", "__repr__"}
ALLOWED = {"count_target_tokens", "count_real_tokens", "padding_mask", "values"}


class HostReads(TorchFunctionMode):
    """Records each read of a tensor's value outside the host-side counting of a batch's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, list[str]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in READS:
            frames, frame = [], sys._getframe(1)
            while frame is not None and len(frames) < 30:
                frames.append(frame.f_code.co_name)
                frame = frame.f_back
            if not ALLOWED & set(frames):
                self.reads.append((name, frames[:8]))
        return func(*args, **(kwargs or {}))


def _started(cfg, ds) -> Trainer:  # noqa: ANN001
    trainer = Trainer(cfg, train_dataset=ds)
    trainer.state = trainer.setup(overwrite=True)
    return trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _optimizer_state(trainer: Trainer) -> list[torch.Tensor]:
    return [v.clone() for st in trainer.state.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]


def _poison_next_gradient(trainer: Trainer):  # noqa: ANN202
    """An infinite gradient in one weight for the next backward (the loss itself stays finite)."""
    param = trainer.model.layers["0"].attention.wq.weight
    return param.register_hook(lambda g: g * float("inf"))


SETTINGS = {
    "fp32": {},
    "accumulation": {"optimize": {"gradient_accumulation_steps": 2}},
    "bf16 O2 masters": {"optimize": {"mixed_precision": "bf16"}},
    "fp16 O1 loss scale": {"optimize": {"mixed_precision": "fp16", "precision_level": "O1"}},
    "chunked bf16 moments": {"train": {"optimizer_state_dtype": "bf16"}},
}


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_a_step_reads_no_tensor_value(tmp_path, dataset, setting, monkeypatch):
    extra = SETTINGS[setting]
    cfg = with_changes(tiny_config(tmp_path, max_grad_norm=0.5), **extra)
    trainer = _started(cfg, dataset)
    s = trainer.state
    read_steps, running = [], []
    values = StepResult.values

    def recorded(self):  # noqa: ANN001, ANN202
        read_steps.append((self.step, running[-1] if running else None))
        return values(self)

    monkeypatch.setattr(StepResult, "values", recorded)
    trainer.train_step(s.loader.next_step(), 0)  # the first step builds optimizer state
    with HostReads() as mode:
        results = []
        for step in (1, 2):
            running.append(step)
            results.append(trainer.train_step(s.loader.next_step(), step))
    assert mode.reads == []
    assert read_steps == [(0, 1), (1, 2)]  # each step read only the figures of the step before
    assert all(not r.skipped and r.loss > 0 for r in results)  # reading them afterwards is fine


def test_the_foreach_kernel_reads_one_flag_a_step(tmp_path, dataset):
    # foreach has no device-side skip: step_unless reads the non-finite flag before stepping (torch's foreach
    # Adam also reads its step counters, which it keeps on the host: no sync).
    trainer = _started(tiny_config(tmp_path, optimizer_impl="foreach"), dataset)
    s = trainer.state
    trainer.train_step(s.loader.next_step(), 0)
    with HostReads() as mode:
        trainer.train_step(s.loader.next_step(), 1)
    sources = [(name, frames[0]) for name, frames in mode.reads]
    assert sources.count(("__bool__", "step_unless")) == 1
    assert {source for _, source in sources} == {"step_unless", "_get_value"}


@pytest.mark.parametrize("train", [{}, {"optimizer_impl": "foreach"}, {"optimizer_state_dtype": "bf16"},
                                   {"optimizer": "sgd"}], ids=["fused", "foreach", "chunked bf16", "sgd fused"])
def test_a_non_finite_gradient_leaves_weights_and_state_untouched(tmp_path, dataset, train):
    trainer = _started(tiny_config(tmp_path, nan_policy="skip", **train), dataset)
    s = trainer.state
    assert not trainer.train_step(s.loader.next_step(), 0).skipped
    weights, state = _weights(trainer), _optimizer_state(trainer)
    handle = _poison_next_gradient(trainer)
    out = trainer.train_step(s.loader.next_step(), 1)
    handle.remove()
    assert out.skipped and out.grad_norm == float("inf")
    for name, w in _weights(trainer).items():
        assert torch.equal(w, weights[name]), name
    for before, after in zip(state, _optimizer_state(trainer)):
        assert torch.equal(before, after)  # moments and step counts (fused kernels count back)
    assert not trainer.train_step(s.loader.next_step(), 2).skipped  # and the run goes on
    if train.get("optimizer") != "sgd":
        steps = {float(st["step"]) for st in s.optimizer.state.values()}
        assert steps == {2.0}  # two updates made, the skipped one not counted


def test_fp16_overflow_lowers_the_scale_on_the_device_and_skips(tmp_path, dataset):
    cfg = with_changes(tiny_config(tmp_path), optimize={"mixed_precision": "fp16", "precision_level": "O1",
                                                        "initial_loss_scale": 1024.0})
    trainer = _started(cfg, dataset)
    s = trainer.state
    first = trainer.train_step(s.loader.next_step(), 0)
    weights = _weights(trainer)
    handle = _poison_next_gradient(trainer)
    out = trainer.train_step(s.loader.next_step(), 1)
    handle.remove()
    assert not first.skipped and first.scale == 1024.0
    assert out.skipped and out.overflowed and out.scale == 512.0
    assert s.scaler.scale == 512.0 and s.scaler.skipped_steps == 1 and s.scaler.good_steps == 0
    for name, w in _weights(trainer).items():
        assert torch.equal(w, weights[name]), name
    trainer.train_step(s.loader.next_step(), 2)
    trainer._settle_previous()  # the overflow is reported (a warning), not a stop
    assert s.scaler.good_steps == 1


@pytest.mark.parametrize("save_steps, backwards, saved", [(2, 4, [2]), (1, 3, [1, 2])],
                         ids=["read by the next step", "read before its checkpoint"])
def test_nan_policy_stop_stops_before_the_next_update(tmp_path, dataset, save_steps, backwards, saved):
    """Between log steps the stop comes one step late (the figures are read while the next step computes),
    but before the next update; a step that is saved or logged is read first. Either way the weights are
    those after the last finite step and no checkpoint holds a later one."""
    common = dict(warmup_steps=0, decay_style="constant", save_steps=save_steps, log_steps=4)
    reference = Trainer(tiny_config(tmp_path / "ref", max_steps=2, **common), train_dataset=dataset)
    reference.train()
    trainer = Trainer(tiny_config(tmp_path / "run", max_steps=4, **common), train_dataset=dataset)
    calls = []

    def poison_third_step(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad * float("inf") if len(calls) == 3 else grad

    original_setup = trainer.setup

    def setup(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        state = original_setup(*args, **kwargs)
        trainer.model.layers["0"].attention.wq.weight.register_hook(poison_third_step)
        return state

    trainer.setup = setup
    with pytest.raises(TrainingError, match=r"step 3: loss is .* gradient norm inf; training stopped before"):
        trainer.train()
    assert len(calls) == backwards
    want = _weights(reference)
    for name, w in _weights(trainer).items():
        assert torch.equal(w, want[name]), name
    checkpoints = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "run" / "checkpoints").glob("step_*"))
    assert checkpoints == saved
