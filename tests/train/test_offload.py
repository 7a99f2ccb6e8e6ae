"""CPU offload (issue 13, item 5): the offloaded optimizer (masters and state in host memory, the step on
the CPU) and offloaded activations must give the plain path's losses and weights, clip and skip alike,
and checkpoint the host masters so that a run resumes in either engine. On this machine the device is
the host, so the copies are real but land in the same memory."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.memory.offload import ActivationOffload, HostMasters
from shardwise.memory.precision import MasterWeights
from shardwise.parallel.data_parallel import check_offload
from shardwise.parallel.dims import ParallelDims
from shardwise.train.trainer import Trainer

from .conftest import tiny_config, with_changes

OFFLOAD = {"offload_optimizer": True}
BF16 = {"mixed_precision": "bf16"}


def _train(cfg, ds, resume=None):  # noqa: ANN001, ANN202
    trainer = Trainer(cfg, train_dataset=ds)
    result = trainer.train(resume=resume, overwrite=resume is None)
    return result, trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}


def _assert_same_run(a, b, rel: float = 1e-6) -> None:  # noqa: ANN001
    (ra, ta), (rb, tb) = a, b
    assert sorted(ra.losses) == sorted(rb.losses)
    for step, loss in ra.losses.items():
        assert rb.losses[step] == pytest.approx(loss, rel=rel, abs=0), step
    wa, wb = _weights(ta), _weights(tb)
    for name, w in wa.items():
        torch.testing.assert_close(wb[name], w, rtol=rel, atol=rel * float(w.abs().max()), msg=name)


@pytest.mark.parametrize("optimize", [{}, {"gradient_accumulation_steps": 2}], ids=["one", "accumulation"])
def test_offloaded_optimizer_gives_the_plain_losses_and_weights_fp32(tmp_path, dataset, optimize):
    # max_grad_norm 0.05 clips every step: the norm must come from the host gradients, whole.
    plain = with_changes(tiny_config(tmp_path / "plain", max_grad_norm=0.05), optimize=optimize)
    off = with_changes(tiny_config(tmp_path / "off", max_grad_norm=0.05), optimize={**optimize, **OFFLOAD})
    a, b = _train(plain, dataset), _train(off, dataset)
    _assert_same_run(a, b)
    s = b[1].state
    assert isinstance(s.masters, HostMasters)
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in s.masters.masters)
    assert all(p.grad is None for p in b[1].model.parameters())  # freed as they went to the host


def test_offloaded_optimizer_at_bf16_o2_steps_fp32_masters_like_the_device_path(tmp_path, dataset):
    a = _train(with_changes(tiny_config(tmp_path / "plain"), optimize=BF16), dataset)
    b = _train(with_changes(tiny_config(tmp_path / "off"), optimize={**BF16, **OFFLOAD}), dataset)
    assert isinstance(a[1].state.masters, MasterWeights) and isinstance(b[1].state.masters, HostMasters)
    _assert_same_run(a, b)
    for ma, mb in zip(a[1].state.masters.masters, b[1].state.masters.masters):
        assert mb.dtype == torch.float32
        torch.testing.assert_close(mb, ma, rtol=1e-6, atol=1e-7)
    assert all(p.dtype == torch.bfloat16 for p in b[1].model.parameters())


def test_a_non_finite_gradient_leaves_masters_state_and_weights_untouched(tmp_path, dataset):
    cfg = with_changes(tiny_config(tmp_path, nan_policy="skip"), optimize=OFFLOAD)
    trainer = Trainer(cfg, train_dataset=dataset)
    s = trainer.setup(overwrite=True)
    trainer.state = s
    assert not trainer.train_step(s.loader.next_step(), 0).skipped
    before = _weights(trainer)
    masters = [m.detach().clone() for m in s.masters.masters]
    states = {k: v.clone() for st in s.optimizer.state.values() for k, v in st.items()}
    param = trainer.model.layers["0"].attention.wq.weight
    handle = param.register_hook(lambda g: g * float("inf"))
    out = trainer.train_step(s.loader.next_step(), 1)
    handle.remove()
    assert out.skipped and not torch.isfinite(torch.tensor(out.grad_norm))
    for name, w in _weights(trainer).items():
        assert torch.equal(w, before[name]), name
    for m, kept in zip(s.masters.masters, masters):
        assert torch.equal(m, kept)
    assert all(m.grad is None for m in s.masters.masters)
    after = {k: v for st in s.optimizer.state.values() for k, v in st.items()}
    assert all(torch.equal(after[k], v) for k, v in states.items())
    assert not trainer.train_step(s.loader.next_step(), 2).skipped  # and the run goes on


def test_offloaded_run_resumes_exactly_in_either_engine(tmp_path, dataset):
    def cfg(root, steps, optimize):  # noqa: ANN001, ANN202
        return with_changes(tiny_config(root, max_steps=steps, decay_style="constant"), optimize=optimize)

    full = _train(cfg(tmp_path / "full", 4, {**BF16, **OFFLOAD}), dataset)[0]
    for name, optimize in (("offloaded", {**BF16, **OFFLOAD}), ("plain", BF16)):
        _train(cfg(tmp_path / name, 2, {**BF16, **OFFLOAD}), dataset)  # saves step 2 with its host masters
        resumed = _train(cfg(tmp_path / name, 4, optimize), dataset, resume="auto")[0]
        assert sorted(resumed.losses) == [3, 4]
        for step in (3, 4):
            assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-6, abs=0), (name, step)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_offloaded_activations_give_the_same_gradients(tmp_path, dataset, recompute):
    plain = with_changes(tiny_config(tmp_path / "plain", max_steps=2), optimize={"recompute": recompute})
    off = with_changes(tiny_config(tmp_path / "off", max_steps=2),
                       optimize={"recompute": recompute, "offload_activations": True})
    _assert_same_run(_train(plain, dataset), _train(off, dataset), rel=1e-7)


def test_activation_offload_copies_each_saved_storage_once_and_keeps_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    packed = []

    class Counting(ActivationOffload):
        def _pack(self, t):  # noqa: ANN001, ANN202
            packed.append(super()._pack(t))
            return packed[-1]

    with Counting(torch.device("cpu")):
        h = torch.tanh(x)
        y = (lin(h) * lin(h).detach()).sum() + h.sum()
    y.backward()
    copies = {id(p[0]) for p in packed if isinstance(p, tuple)}
    shared = [p[0] for p in packed if isinstance(p, tuple)]
    assert len(copies) < len(shared)  # h is saved by tanh's backward and both linears: one copy
    kept = [p for p in packed if isinstance(p, torch.Tensor)]  # a parameter (or linear's weight.t()) stays
    assert kept and all(t.untyped_storage().data_ptr() == lin.weight.untyped_storage().data_ptr() for t in kept)
    ref_x = x.detach().clone().requires_grad_(True)
    hr = torch.tanh(ref_x)
    ((lin(hr) * lin(hr).detach()).sum() + hr.sum()).backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)


def test_layouts_that_cannot_offload_are_refused_naming_the_fix(tmp_path):
    def check(dims: ParallelDims, parallel: dict | None = None, train: dict | None = None, **optimize) -> None:
        cfg = with_changes(tiny_config(tmp_path, **(train or {})), optimize=optimize, parallel=parallel or {})
        check_offload(cfg, torch.device("cuda"), dims)

    check(ParallelDims(), offload_optimizer=True)  # one device: the point of it
    check(ParallelDims(dp_shard=2), {"data_parallel": 2, "zero_stage": 3}, offload_optimizer=True)
    with pytest.raises(ConfigError, match="zero_stage 2 or 3"):
        check(ParallelDims(dp_replicate=2), {"data_parallel": 2, "zero_stage": 1}, offload_optimizer=True)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        check(ParallelDims(tp=2), offload_optimizer=True)
    with pytest.raises(ConfigError, match="optimizer_in_backward"):
        check(ParallelDims(), train={"optimizer_in_backward": True, "max_grad_norm": None}, offload_optimizer=True)
    with pytest.raises(ConfigError, match="offload_activations"):
        check(ParallelDims(pp=2), offload_activations=True)
    check(ParallelDims(), offload_params=True)  # one device: FSDP2 alone (test_offload_params_one_device.py)
    with pytest.raises(ConfigError, match="offload_params"):
        check(ParallelDims(tp=2), offload_params=True)
