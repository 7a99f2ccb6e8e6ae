"""The steady-state step never waits for the device (issue 14, item 1; issue 25, item 5), and a non-finite
step still never touches the weights.

On this CPU the device is the host, so a sync cannot be seen as an idle GPU. What can be seen is every
read of a tensor's value by Python and every op that would make the host wait on an accelerator:
`HostReads` records them, with the functions they came from, while the trainer runs steps, backward
hooks included (the optimizer in backward). The only reads allowed are the token counts of the step's
batches, which are host tensors before they are copied to the device, and the figures of the step
before (`StepResult.values`: on an accelerator a pinned copy whose event marks the end of that step,
while this one is still queued).

What it records:
- Python reads of a value: `item`, `tolist`, `numpy`, `bool`, `float`, `int`, `__index__`, formatting
  (patched on `torch.Tensor` for the duration: a TorchFunctionMode does not reach backward hooks);
- copies to the host: `.cpu()` always, and `.to()` with a CPU target when the tensor is elsewhere or the
  target is spelled "cpu". On this CPU every tensor is a host tensor, so a `.to(torch.device("cpu"))` of
  the run's device cannot be told from a copy to the host, and goes unrecorded here; on an accelerator
  the dispatch-level check below sees every such copy;
- at the dispatch level (a TorchDispatchMode, which reaches backward hooks): ops whose output's shape
  depends on values (`nonzero` and what lowers to it: `argwhere`, one-argument `where`; `masked_select`,
  `unique`, `bincount`, `repeat_interleave` without `output_size`, indexing or index-putting with a
  boolean mask), ops that give the host a value (`equal`, and `_local_scalar_dense`, what `item` runs),
  and copies between the host and a device that are not `non_blocking` (on an accelerator each waits
  for the device's queue).
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.errors import TrainingError
from shardwise.train.optim import lowbit_available
from shardwise.train.step_result import StepResult
from shardwise.train.trainer import Trainer

from .conftest import tiny_config, with_changes

PYTHON_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__", "__repr__",
                "cpu", "to")
SHAPE_FROM_VALUES = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                     "unique_dim_consecutive", "bincount", "equal", "_local_scalar_dense"}
MASKED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
COPIES = {"_to_copy", "copy_"}
ALLOWED = {"count_target_tokens", "count_real_tokens", "padding_mask", "values"}
_MISSING = object()


def _frames(frame) -> list[str]:  # noqa: ANN001
    names = []
    while frame is not None and len(names) < 30:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _to_the_host(t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether `t.to(*args, **kwargs)` copies to the host (see the module's docstring)."""
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    if device is None or device.type != "cpu":
        return False
    spelled = any(isinstance(a, str) and a.startswith("cpu") for a in (*args, *kwargs.values()))
    return t.device.type != "cpu" or spelled


def _crosses(src: torch.Tensor, device: torch.device, non_blocking: bool) -> bool:
    """A copy between the host and a device that the host waits for."""
    return not non_blocking and (src.device.type == "cpu") != (device.type == "cpu")


def _dispatched_read(func, args: tuple, kwargs: dict) -> bool:  # noqa: ANN001
    name = func._overloadpacket.__name__
    if name in SHAPE_FROM_VALUES:
        return True
    if name == "repeat_interleave":
        return func._overloadpacket.Tensor is func and kwargs.get("output_size") is None
    if name in MASKED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "_to_copy" and kwargs.get("device") is not None:
        return _crosses(args[0], torch.device(kwargs["device"]), bool(kwargs.get("non_blocking")))
    if name == "copy_":
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return _crosses(args[1], args[0].device, non_blocking)
    return False


class _Dispatched(TorchDispatchMode):
    def __init__(self, reads: "HostReads") -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if not self.reads.inside() and _dispatched_read(func, args, kwargs):
            self.reads.note(func._overloadpacket.__name__, sys._getframe(1))
        return func(*args, **kwargs)


class HostReads:
    """Records each read of a tensor's value, copy to the host and op whose output's shape depends on
    values (see the module's docstring), outside the host-side counting of a batch's tokens (ALLOWED).
    `reads`: (what, the names of the functions it came from, innermost first)."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, list[str]]] = []
        self._local = threading.local()  # inside a recorded Python read: its own ops are not recorded again
        self._saved: dict[str, object] = {}
        self._mode = _Dispatched(self)

    def inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def note(self, name: str, frame) -> None:  # noqa: ANN001
        frames = _frames(frame)
        if not ALLOWED & set(frames):
            self.reads.append((name, frames[:8]))

    def _patched(self, name: str, original):  # noqa: ANN001, ANN202
        reads = self

        def read(t, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if not reads.inside() and (name != "to" or _to_the_host(t, args, kwargs)):
                reads.note(name, sys._getframe(1))
            reads._local.depth = getattr(reads._local, "depth", 0) + 1
            try:
                return original(t, *args, **kwargs)
            finally:
                reads._local.depth -= 1
        return read

    def __enter__(self) -> "HostReads":
        for name in PYTHON_READS:
            self._saved[name] = vars(torch.Tensor).get(name, _MISSING)
            setattr(torch.Tensor, name, self._patched(name, getattr(torch.Tensor, name)))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self._mode.__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


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


IN_BACKWARD = {"optimizer_in_backward": True, "max_grad_norm": None}
needs_torchao = pytest.mark.skipif(not lowbit_available(), reason="torchao (the lowbit extra) is not installed")
SETTINGS = {
    "fp32": {},
    "accumulation": {"optimize": {"gradient_accumulation_steps": 2}},
    "bf16 O2 masters": {"optimize": {"mixed_precision": "bf16"}},
    "fp16 O1 loss scale": {"optimize": {"mixed_precision": "fp16", "precision_level": "O1"}},
    "chunked bf16 moments": {"train": {"optimizer_state_dtype": "bf16"}},
    "in backward": {"train": IN_BACKWARD},
    "in backward bf16 moments O2": {"train": {**IN_BACKWARD, "optimizer_state_dtype": "bf16"},
                                    "optimize": {"mixed_precision": "bf16"}},
    "in backward 8-bit AdamW": {"train": {**IN_BACKWARD, "optimizer": "adamw_8bit"}},
}
MARKS = {"in backward 8-bit AdamW": [needs_torchao]}


@pytest.mark.parametrize("setting", [pytest.param(s, marks=MARKS.get(s, [])) for s in SETTINGS], ids=list(SETTINGS))
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
    # torchao's update is compiled outside a dispatch mode and eager inside one; eager throughout saves the compile
    with torch.compiler.set_stance("force_eager"):
        trainer.train_step(s.loader.next_step(), 0)  # the first step builds optimizer state
        with HostReads() as mode:
            results = []
            for step in (1, 2):
                running.append(step)
                results.append(trainer.train_step(s.loader.next_step(), step))
    assert mode.reads == []
    assert read_steps == [(0, 1), (1, 2)]  # each step read only the figures of the step before
    assert all(not r.skipped and r.loss > 0 for r in results)  # reading them afterwards is fine


@pytest.mark.parametrize("train, flag_reads", [({"optimizer_impl": "foreach"}, 1),
                                               ({"optimizer_impl": "foreach", **IN_BACKWARD}, 0)],
                         ids=["plain step", "in backward"])
def test_the_foreach_kernel_reads_one_flag_a_step_and_none_in_backward(tmp_path, dataset, train, flag_reads):
    # foreach has no device-side skip: step_unless reads the non-finite flag before stepping; the optimizer in
    # backward undoes an update on the device instead (torch's foreach Adam also reads its step counters, which
    # it keeps on the host: no sync on an accelerator).
    trainer = _started(tiny_config(tmp_path, **train), dataset)
    s = trainer.state
    trainer.train_step(s.loader.next_step(), 0)
    with HostReads() as mode:
        trainer.train_step(s.loader.next_step(), 1)
    sources = [(name, frames[0]) for name, frames in mode.reads]
    assert sources.count(("__bool__", "step_unless")) == flag_reads
    assert {source for _, source in sources} == ({"step_unless", "_get_value"} if flag_reads else {"_get_value"})


def _each_read(x: torch.Tensor) -> dict[str, object]:
    """One of each kind of read HostReads records, named as it records them."""
    mask = x > 0
    return {
        "item": lambda: x.sum().item(), "tolist": lambda: x.tolist(), "numpy": lambda: x.numpy(),
        "__bool__": lambda: bool(mask.any()), "__float__": lambda: float(x.sum()), "__int__": lambda: int(x.sum()),
        "__index__": lambda: [0, 1, 2][x.argmax()], "__format__": lambda: f"{x.sum():.3f}", "__repr__": lambda: repr(x),
        "cpu": lambda: x.cpu(), "to": lambda: x.to("cpu"), "nonzero": lambda: torch.nonzero(x),
        "masked_select": lambda: x.masked_select(mask), "index": lambda: x[mask],
        "index_put_": lambda: x.clone().__setitem__(mask, 0.0), "_unique2": lambda: torch.unique(x),
        "repeat_interleave": lambda: torch.repeat_interleave(mask.long()),
        "bincount": lambda: torch.bincount(mask.long()),
        "equal": lambda: torch.equal(x, x), "where": lambda: torch.where(mask), "argwhere": lambda: x.argwhere(),
    }


RECORDED_AS = {"where": "nonzero", "argwhere": "nonzero"}


def _not_reads(x: torch.Tensor) -> list:
    """Ops of the same families that read nothing: static shapes, no copy to the host."""
    mask = x > 0
    return [lambda: x.to(torch.float64), lambda: x.to(x.device), lambda: x[0], lambda: x[torch.tensor([0, 2])],
            lambda: torch.where(mask, x, 0.0), lambda: torch.repeat_interleave(mask.long(), output_size=2),
            lambda: x.masked_fill(mask, 0.0), lambda: x.sum() * 2]


def _calling(read):  # noqa: ANN001, ANN202
    """A post-accumulate-grad hook that makes `read`."""
    def hook(_p: torch.Tensor) -> None:
        read()
    return hook


@pytest.mark.parametrize("in_backward", [False, True], ids=["in the step", "in a backward hook"])
def test_host_reads_records_every_kind_of_read(in_backward):
    x = torch.tensor([1.0, -2.0, 3.0])
    for name, read in _each_read(x).items():
        with HostReads() as mode:
            if in_backward:
                p = torch.nn.Parameter(torch.ones(2))
                p.register_post_accumulate_grad_hook(_calling(read))
                p.sum().backward()
            else:
                read()
        assert [what for what, _ in mode.reads] == [RECORDED_AS.get(name, name)], name
    before = {name: vars(torch.Tensor).get(name) for name in PYTHON_READS}
    with HostReads() as mode:
        for harmless in _not_reads(x):
            harmless()
    assert mode.reads == []
    assert {name: vars(torch.Tensor).get(name) for name in PYTHON_READS} == before  # torch.Tensor as it was


@pytest.mark.parametrize("where", ["forward_backward", "backward hook"])
def test_a_read_added_to_the_step_is_caught(tmp_path, dataset, monkeypatch, where):
    trainer = _started(tiny_config(tmp_path, **IN_BACKWARD), dataset)
    s = trainer.state
    trainer.train_step(s.loader.next_step(), 0)
    if where == "forward_backward":
        forward_backward = Trainer.forward_backward
        monkeypatch.setattr(Trainer, "forward_backward", lambda self, *a: forward_backward(self, *a).cpu())
    else:
        def read(grad: torch.Tensor) -> None:
            grad.sum().tolist()

        trainer.model.norm.weight.register_hook(read)
    with HostReads() as mode:
        trainer.train_step(s.loader.next_step(), 1)
    assert [what for what, _ in mode.reads] == ["cpu" if where == "forward_backward" else "tolist"]


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
