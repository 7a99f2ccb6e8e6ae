"""The optimizer in backward keeps the non-finite check on the device with every kernel (issue 25, item 5).

A fused kernel skips itself (`found_inf`); others (foreach, torchao's 8-bit AdamW) update and put the
parameter and its state back from copies where the flag is set. Either way, from the first non-finite
gradient on no update counts until the host reads the flag: the parameters whose gradients came before
it were updated, it and those after it are as they were, weights and optimizer state bit for bit, and
so is everything in the next step, which runs before the trainer has read the figures that stop the run.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.errors import TrainingError
from shardwise.parallel.dtensors import local_tensor
from shardwise.train import optim as optim_module
from shardwise.train.optim import OptimizerInBackward, build_optimizer, lowbit_available
from shardwise.train.trainer import Trainer

from .conftest import tiny_config

IN_BACKWARD = {"optimizer_in_backward": True, "max_grad_norm": None}
needs_torchao = pytest.mark.skipif(not lowbit_available(), reason="torchao (the lowbit extra) is not installed")
KERNELS = {
    "fused": {},
    "foreach": {"optimizer_impl": "foreach"},
    "fused bf16 moments": {"optimizer_state_dtype": "bf16"},
    "sgd": {"optimizer": "sgd"},
    "8-bit AdamW": {"optimizer": "adamw_8bit"},
}
MARKS = {"8-bit AdamW": [needs_torchao]}


def _values(t: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the plain tensors behind `t` (a DTensor's local part; torchao's 8-bit moments: codes, scales,
    map)."""
    t = local_tensor(t)
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [v for n in names for v in _values(getattr(t, n))]
    return [t.detach().clone()]


def _snapshot(trainer: Trainer) -> dict[str, list[torch.Tensor]]:
    """Each parameter's weight and optimizer state, by name."""
    state = trainer.state.optimizer.state
    return {n: _values(p) + [v for k in sorted(state[p]) for v in _values(state[p][k])]
            for n, p in trainer.model.named_parameters()}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("train", [pytest.param(KERNELS[k], marks=MARKS.get(k, [])) for k in KERNELS],
                         ids=list(KERNELS))
def test_a_non_finite_gradient_stops_every_later_update_on_the_device(tmp_path, dataset, train):
    trainer = Trainer(tiny_config(tmp_path, **IN_BACKWARD, **train), train_dataset=dataset)
    s = trainer.state = trainer.setup(overwrite=True)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    arrived: list[str] = []
    for p in trainer.model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: arrived.append(names[id(q)]))
    with torch.compiler.set_stance("force_eager"):  # torchao's update: the same arithmetic, no compile
        trainer.settle(trainer.train_step(s.loader.next_step(), 0))
        before = _snapshot(trainer)
        poisoned = trainer.model.layers["0"].attention.wq.weight
        handle = poisoned.register_hook(lambda g: g * math.inf)
        arrived.clear()
        bad = trainer.train_step(s.loader.next_step(), 1)  # returns without reading anything
        handle.remove()
        after = _snapshot(trainer)
        cut = arrived.index("layers.0.attention.wq.weight")
        assert 0 < cut < len(arrived) - 1
        for name in arrived[:cut]:  # their gradients came first: updated
            assert not torch.equal(after[name][0], before[name][0]), name
        for name in arrived[cut:]:  # the poisoned one and every later one: untouched, weights and state
            assert _same(after[name], before[name]), name
        # The next step runs before the stop is read (as between log steps), and updates nothing at all.
        with pytest.raises(TrainingError, match="were updated, the others not; no later update was made"):
            trainer.train_step(s.loader.next_step(), 2)
    assert bad.skipped and bad.grad_norm == math.inf
    final = _snapshot(trainer)
    assert all(_same(final[n], after[n]) for n in after)  # step counters in host memory included


@pytest.mark.parametrize("kernel", ["foreach", "chunked"])
def test_host_step_counters_are_put_back_when_the_flag_is_read(kernel, monkeypatch):
    # On an accelerator foreach's step counters live in host memory: `torch.where` on the device flag cannot
    # reach them without a sync, so they are noted and put back when the host reads the flag. Here every
    # tensor is a host tensor: treat the 0-dim counters as such to run that path.
    monkeypatch.setattr(optim_module, "_apart_from_flag", lambda t, flag: t.ndim == 0)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([("a", a), ("b", b)], "adamw", 0.1, 0.0, (0.9, 0.999), 1e-8, kernel=kernel,
                          in_backward=True)
    hooks = OptimizerInBackward(opt, [a, b])
    assert not hooks.on_device
    for _ in range(2):  # two good steps: both counters at 2
        hooks.begin()
        (a * 2).sum().backward()
        (b * 2).sum().backward()
    good = [t.clone() for p in (a, b) for t in (p, *opt.state[p].values())]
    hooks.begin()
    (a * 2).sum().backward()  # a is updated (its counter at 3), then b's gradient is not finite
    (b * torch.tensor([1.0, math.inf, 1.0])).sum().backward()
    hooks.begin()  # and a step more before the flag is read
    (a * 2).sum().backward()
    (b * 2).sum().backward()
    assert [float(opt.state[p]["step"]) for p in (a, b)] == [4.0, 4.0]  # counted, not put back yet
    assert torch.equal(b.detach(), good[4]) and not torch.equal(a.detach(), good[0])
    assert not hooks.read_finite()
    assert [float(opt.state[p]["step"]) for p in (a, b)] == [3.0, 2.0]  # as before their first undone update
    hooks.begin()
    (b * 2).sum().backward()  # read: updates count again
    assert hooks.read_finite() and float(opt.state[b]["step"]) == 3.0


def test_the_gradient_norm_is_summed_in_float64():
    # 1e20 squared overflows float32; the squares are summed in float64 and the norm comes back in float32
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([("a", a), ("b", b)], "sgd", 0.0, 0.0, (0.0, 0.0), 1e-8, kernel="foreach", in_backward=True)
    hooks = OptimizerInBackward(opt, [a, b])
    hooks.begin()
    (a * 3e19).sum().backward()
    (b * 4e19).sum().backward()
    norm = hooks.finish()
    assert hooks.finite and norm.dtype == torch.float32 and float(norm) == pytest.approx(5e19, rel=1e-7)
