import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data.packing import PackedDataset
from shardwise.errors import CheckpointError, ConfigError, TrainingError
from shardwise.memory.estimate import estimate_memory
from shardwise.memory.measure import MemoryTracker
from shardwise.resolve import resolve_config as validate
from shardwise.train import optim as optim_module
from shardwise.train.optim import (
    ChunkedAdamW,
    LRSchedule,
    OptimizerInBackward,
    build_optimizer,
    chunks,
    decay_groups,
    lowbit_available,
)
from shardwise.train.probe import measure_training
from shardwise.train.trainer import Trainer

from .conftest import SEQ, make_tokens, read_metrics, tiny_config, with_changes

BETAS = (0.9, 0.95)
needs_torchao = pytest.mark.skipif(not lowbit_available(), reason="torchao (the lowbit extra) is not installed")


def test_decay_groups_exclude_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = decay_groups(model.named_parameters(), 0.1)
    by_name = {g["name"]: g for g in groups}
    assert [p.shape for p in by_name["decay"]["params"]] == [torch.Size([4, 4])]
    assert len(by_name["no_decay"]["params"]) == 3 and by_name["no_decay"]["weight_decay"] == 0.0
    opt = build_optimizer(model.named_parameters(), "adamw", 1e-3, 0.1, BETAS, 1e-8)
    assert isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize("style", ["cosine", "linear", "wsd"])
def test_schedules_warm_up_then_reach_min_lr(style):
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=100, decay_style=style, wsd_decay_ratio=0.2)
    assert [s.lr_at(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert s.lr_at(99) == pytest.approx(0.1)
    lrs = [s.lr_at(i) for i in range(4, 100)]
    assert all(a >= b - 1e-12 for a, b in zip(lrs, lrs[1:]))


def test_cosine_midpoint_wsd_plateau_and_constant():
    cos = LRSchedule(1.0, 0.0, 0, 101, "cosine")
    assert cos.lr_at(49) == pytest.approx(0.5, abs=0.02)
    wsd = LRSchedule(1.0, 0.0, 0, 100, "wsd", wsd_decay_ratio=0.2)
    assert wsd.lr_at(79) == 1.0 and wsd.lr_at(80) < 1.0
    assert LRSchedule(1.0, 0.0, 2, 100, "constant").lr_at(90) == 1.0


def test_a_tensor_learning_rate_is_filled_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(1.0))
    lr = opt.param_groups[0]["lr"]
    LRSchedule(0.5, 0.0, 0, 10, "constant").apply(opt, 3)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 0.5


# --- the kernels -----------------------------------------------------------------------------------


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)).to(dtype)


def _steps(name: str, steps: int = 3, dtype: torch.dtype = torch.float32, **kw) -> tuple[list[torch.Tensor], object]:
    model = _model(dtype)
    opt = build_optimizer(model.named_parameters(), name, 1e-2, 0.1, BETAS, 1e-8, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


def test_chunks_are_bounded_and_keep_a_large_tensor_alone():
    ts = [torch.empty(n) for n in (3, 4, 10, 2, 2, 1)]
    got = [[t.numel() for t in c] for c in chunks(ts, 7)]
    assert got == [[3, 4], [10], [2, 2, 1]]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_the_chunked_update_is_foreach_bitwise(name):
    ref, _ = _steps(name, kernel="foreach")
    got, opt = _steps(name, kernel="chunked", chunk_elements=100)  # the 16x32 matrix alone, then the rest
    assert type(opt).__name__.startswith("Chunked")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_fused_agrees_with_foreach_within_1e_7(name):
    ref, _ = _steps(name, kernel="foreach")
    got, opt = _steps(name, kernel="fused")
    assert opt.defaults["fused"]
    assert max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref)) < 1e-7


def test_auto_is_fused_on_cpu_and_cuda_chunked_elsewhere(tmp_path):
    t = tiny_config(tmp_path).train
    assert [t.optimizer_kernel(d) for d in ("cpu", "cuda", "npu")] == ["fused", "fused", "chunked"]
    sgd = tiny_config(tmp_path, optimizer="sgd").train
    assert sgd.optimizer_kernel("cpu") == "foreach"
    assert tiny_config(tmp_path, optimizer_impl="foreach").train.optimizer_kernel("cuda") == "foreach"


def _update_extra_bytes(kernel: str, **kw) -> tuple[int, int]:
    """(bytes the third step allocates above parameters, gradients and state; the decayed group's elements)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = build_optimizer(model.named_parameters(), "adamw", 1e-2, 0.1, BETAS, 1e-8, kernel=kernel, **kw)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if opt.state:
            break
        opt.step()
    with MemoryTracker() as tracker:
        tracker.track_existing([list(model.parameters()), [p.grad for p in model.parameters()],
                                [v for st in opt.state.values() for v in st.values()]])
        tracker.start_recording()
        base = tracker.live
        opt.step()
    return tracker.peak - base, 4 * 64 * 64


def test_fused_and_chunked_updates_keep_no_group_sized_temporary():
    foreach, group = _update_extra_bytes("foreach")
    assert foreach >= group * 4  # the square root of the second moment, for the whole decayed group
    chunked, _ = _update_extra_bytes("chunked", chunk_elements=64 * 64)
    assert chunked <= 64 * 64 * 4 + 1024  # one matrix at a time
    fused, _ = _update_extra_bytes("fused")
    assert fused <= 1024


# --- 16-bit moments --------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["fused", "chunked"])
def test_bf16_moments_are_bf16_and_close_to_fp32(kernel):
    ref, _ = _steps("adamw", kernel="foreach")
    got, opt = _steps("adamw", kernel=kernel, state_dtype=torch.bfloat16)
    for st in opt.state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 and st["step"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in got)
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
    assert 0 < rel < 1e-2  # rounded moments: close to, not equal to, fp32's


def test_bf16_moments_survive_load_state_dict():
    _, opt = _steps("adamw", kernel="chunked", state_dtype=torch.bfloat16)
    state = opt.state_dict()
    model = _model()
    again = build_optimizer(model.named_parameters(), "adamw", 1e-2, 0.1, BETAS, 1e-8, kernel="chunked",
                            state_dtype=torch.bfloat16)
    again.load_state_dict(state)  # torch casts floating state to the parameter's dtype; ours goes back
    assert isinstance(again, ChunkedAdamW)
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in again.state.values())


def test_bf16_moments_with_bf16_weights_are_torch_own_optimizer():
    _, opt = _steps("adamw", dtype=torch.bfloat16, kernel="fused", state_dtype=torch.bfloat16)
    assert type(opt) is torch.optim.AdamW  # O3: the moments are the weights' dtype already


def _dataset() -> PackedDataset:
    return PackedDataset(make_tokens(), SEQ)


def _train(cfg, resume=None):  # noqa: ANN001, ANN202
    trainer = Trainer(cfg, train_dataset=_dataset())
    result = trainer.train(resume=resume, overwrite=resume is None)
    return result, trainer


def _rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


def test_trainer_kernels_give_todays_foreach_losses(tmp_path):
    ref, _ = _train(tiny_config(tmp_path / "foreach", optimizer_impl="foreach"))
    auto, t = _train(tiny_config(tmp_path / "auto"))
    assert t.state.optimizer.defaults["fused"]  # auto is fused on the CPU
    chunked, t = _train(tiny_config(tmp_path / "chunked", optimizer_impl="chunked"))
    assert isinstance(t.state.optimizer, ChunkedAdamW)
    assert chunked.losses == ref.losses  # bitwise
    assert _rel(auto.losses, ref.losses) < 1e-6


def test_bf16_moments_train_comparably_and_resume_exactly(tmp_path):
    steps, constant = 12, {"decay_style": "constant"}  # a run cut short has the longer run's rates
    fp32, _ = _train(tiny_config(tmp_path / "fp32", max_steps=steps, **constant))
    bf16, t = _train(tiny_config(tmp_path / "bf16", max_steps=steps, optimizer_state_dtype="bf16", **constant))
    assert all(v.dtype == torch.bfloat16 for st in t.state.optimizer.state.values()
               for k, v in st.items() if k != "step")
    assert bf16.losses[steps] < bf16.losses[1] - 0.5  # it learns
    assert abs(bf16.losses[steps] - fp32.losses[steps]) < 0.02 * fp32.losses[steps]  # as fp32 does
    assert bf16.losses != fp32.losses
    # Saved as bf16, restored as bf16: the resumed run continues exactly.
    cut = tiny_config(tmp_path / "cut", max_steps=6, optimizer_state_dtype="bf16", **constant)
    _train(cut)
    resumed, t = _train(with_changes(cut, train={"max_steps": steps}), resume="auto")
    assert all(v.dtype == torch.bfloat16 for st in t.state.optimizer.state.values()
               for k, v in st.items() if k != "step")
    assert {s: resumed.losses[s] for s in range(7, steps + 1)} == {s: bf16.losses[s] for s in range(7, steps + 1)}


def test_bf16_moments_with_o2_masters_keep_fp32_masters(tmp_path):
    cfg = with_changes(tiny_config(tmp_path, max_steps=2, optimizer_state_dtype="bf16"),
                       optimize={"mixed_precision": "bf16", "precision_level": "O2"})
    _, t = _train(cfg)
    assert all(m.dtype == torch.float32 for m in t.state.masters.masters)
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in t.state.optimizer.state.values())


def test_state_dtype_settings_that_do_not_fit_o3_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="optimizer_state_dtype fp32 at precision O3"):
        with_changes(tiny_config(tmp_path, optimizer_state_dtype="fp32"),
                     optimize={"mixed_precision": "bf16", "precision_level": "O3"})
    with pytest.raises(ConfigError, match="bf16 with fp16 weights at O3"):
        validate({"model": {"preset": "tiny_llama"}, "train": {"max_steps": 1, "optimizer_state_dtype": "bf16",
                                                               "eps": 1e-4},
                  "optimize": {"mixed_precision": "fp16", "precision_level": "O3"}})


# --- the optimizer in backward ---------------------------------------------------------------------


def test_in_backward_trains_exactly_like_the_step(tmp_path):
    plain, _ = _train(tiny_config(tmp_path / "plain", optimizer_impl="foreach", max_grad_norm=None))
    hooked, t = _train(tiny_config(tmp_path / "hooked", optimizer_impl="foreach", max_grad_norm=None,
                                   optimizer_in_backward=True))
    assert hooked.losses == plain.losses  # the same arithmetic, one parameter at a time
    assert all(p.grad is None for p in t.model.parameters())  # every gradient freed as it was used
    norms = [[r["grad_norm"] for r in _metrics(tmp_path / n)] for n in ("plain", "hooked")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    fused, _ = _train(tiny_config(tmp_path / "fused", max_grad_norm=None, optimizer_in_backward=True))
    assert _rel(fused.losses, plain.losses) < 1e-6


def _metrics(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "run") if "grad_norm" in r]


def test_in_backward_with_o2_masters_and_bf16_moments_trains(tmp_path):
    base = dict(max_grad_norm=None, optimizer_impl="foreach")
    o2 = {"mixed_precision": "bf16", "precision_level": "O2"}
    plain, _ = _train(with_changes(tiny_config(tmp_path / "plain", **base), optimize=o2))
    hooked, t = _train(with_changes(tiny_config(tmp_path / "hooked", optimizer_in_backward=True, **base), optimize=o2))
    assert hooked.losses == plain.losses
    assert all(m.grad is None for m in t.state.masters.masters)


@pytest.mark.parametrize("change, message", [
    ({"train": {"max_grad_norm": 1.0}}, "set train.max_grad_norm: null"),
    ({"train": {"nan_policy": "skip"}}, "nan_policy skip with optimizer_in_backward"),
    ({"optimize": {"gradient_accumulation_steps": 2}}, "gradient_accumulation_steps 2"),
    ({"optimize": {"mixed_precision": "fp16"}}, "fp16"),
    ({"parallel": {"pipeline_parallel": 2}}, "pipeline_parallel > 1"),
    ({"parallel": {"data_parallel": 2, "zero_stage": 1}}, "zero_stage 1"),
])
def test_in_backward_is_refused_where_it_is_not_correct(tmp_path, change, message):
    raw = {"model": {"preset": "tiny_llama"}, "train": {"max_steps": 1, "optimizer_in_backward": True,
                                                        "max_grad_norm": None}}
    for section, values in change.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_in_backward_refuses_an_accumulation_from_the_global_batch(tmp_path):
    cfg = tiny_config(tmp_path, optimizer_in_backward=True, max_grad_norm=None, micro_batch_size=2,
                      global_batch_size=4)
    with pytest.raises(ConfigError, match="2 micro-batches per step"):
        _train(cfg)


def _stopped(cfg, poison: bool) -> tuple[dict, dict]:  # noqa: ANN001
    """Train until the step stops (the third step's forward poisoned with NaN when `poison`); the
    parameters as that step began, and after."""
    trainer = Trainer(cfg, train_dataset=_dataset())
    before: dict = {}
    calls = []

    def keep(phase: str) -> None:
        if phase == "forward" and trainer.state is not None:
            before.clear()
            before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
            calls.append(phase)
            if poison and len(calls) == 3:
                trainer.model.register_forward_hook(lambda _m, _i, out: out * math.nan)

    trainer.add_phase_hook(keep)
    with pytest.raises(TrainingError, match=r"optimizer_in_backward") as info:
        trainer.train(overwrite=True)
    return before, {n: p.detach() for n, p in trainer.model.named_parameters()}, str(info.value)


def test_in_backward_stops_on_a_nan_loss_before_touching_the_weights(tmp_path):
    cfg = tiny_config(tmp_path / "nan", max_grad_norm=None, optimizer_in_backward=True)
    before, after, message = _stopped(cfg, poison=True)
    assert "no weight was touched" in message
    assert all(torch.equal(before[n], after[n]) for n in before)
    # Gradients that overflow in the middle of the backward: those that came first were applied.
    cfg = tiny_config(tmp_path / "overflow", lr=1e30, warmup_steps=0, max_grad_norm=None, optimizer_in_backward=True)
    before, after, message = _stopped(cfg, poison=False)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert "were updated, the others not" in message and changed and changed != set(before)


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_in_backward_hooks_stop_at_the_first_non_finite_gradient(kernel):
    # foreach: each gradient's finiteness is read as it comes; fused: a flag on the device skips the updates
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([("a", a), ("b", b)], "sgd", 0.1, 0.0, (0.0, 0.0), 1e-8, kernel=kernel,
                          in_backward=True)
    hooks = OptimizerInBackward(opt, [a, b])
    assert hooks.on_device == (kernel == "fused")
    hooks.begin()
    (a * torch.tensor([1.0, math.inf, 1.0])).sum().backward()  # a's gradient is not finite
    (b * 2).sum().backward()
    assert not hooks.finite and torch.equal(a.detach(), torch.ones(3)) and torch.equal(b.detach(), torch.ones(3))
    hooks.begin()
    (b * 2).sum().backward()
    assert hooks.finite and torch.allclose(b.detach(), torch.full((3,), 0.8))
    assert float(hooks.finish()) == pytest.approx(math.sqrt(12))


# --- 8-bit AdamW -----------------------------------------------------------------------------------


def test_8bit_without_torchao_is_refused_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(optim_module, "lowbit_available", lambda: False)
    with pytest.raises(ConfigError, match=r"shardwise\[lowbit\]"):
        _train(tiny_config(tmp_path, optimizer="adamw_8bit"))


def test_8bit_settings_that_do_not_apply_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="optimizer_impl fused with adamw_8bit"):
        tiny_config(tmp_path, optimizer="adamw_8bit", optimizer_impl="fused")
    with pytest.raises(ConfigError, match="optimizer_state_dtype bf16 with adamw_8bit"):
        tiny_config(tmp_path, optimizer="adamw_8bit", optimizer_state_dtype="bf16")


@needs_torchao
@pytest.mark.timeout(600)
def test_8bit_adamw_trains_comparably_and_resumes_in_its_layout(tmp_path):
    big = {"hidden_size": 256, "intermediate_size": 512}  # tensors of >= 4096 elements get 8-bit moments
    def cfg(name: str, **train):  # noqa: ANN202
        return with_changes(tiny_config(tmp_path / name, decay_style="constant", **train), model=big)

    steps = 10
    fp32, _ = _train(cfg("fp32", max_steps=steps))
    q8, t = _train(cfg("q8", max_steps=steps, optimizer="adamw_8bit"))
    codes = [st["exp_avg"].codes for st in t.state.optimizer.state.values() if hasattr(st["exp_avg"], "codes")]
    assert codes and all(c.dtype == torch.uint8 for c in codes)
    assert q8.losses[steps] < q8.losses[1] - 0.5
    assert abs(q8.losses[steps] - fp32.losses[steps]) < 0.03 * fp32.losses[steps]
    cut = cfg("cut", max_steps=5, optimizer="adamw_8bit")
    _train(cut)
    resumed, _ = _train(with_changes(cut, train={"max_steps": steps}), resume="auto")
    assert {s: resumed.losses[s] for s in range(6, steps + 1)} == {s: q8.losses[s] for s in range(6, steps + 1)}
    with pytest.raises(CheckpointError, match="8-bit optimizer state of train.optimizer adamw_8bit"):
        _train(with_changes(cut, train={"max_steps": steps, "optimizer": "adamw"}), resume="auto")


# --- counted by the estimator ----------------------------------------------------------------------


OPTIONS = {
    "foreach": {"optimizer_impl": "foreach"},
    "fused": {},
    "chunked": {"optimizer_impl": "chunked"},
    "bf16 moments": {"optimizer_state_dtype": "bf16"},
    "in backward": {"optimizer_in_backward": True, "max_grad_norm": None},
    "bf16 moments in backward": {"optimizer_in_backward": True, "max_grad_norm": None,
                                 "optimizer_state_dtype": "bf16"},
}


def _memory_config(tmp: Path, **train):  # noqa: ANN202
    return validate({"model": {"preset": "tiny_llama", "vocab_size": 128}, "data": {"seq_length": 64},
                     "train": {"output_dir": str(tmp), "max_steps": 2, "micro_batch_size": 4, "progress_bar": False,
                               "tensorboard": False, "peak_tflops": 1.0, **train},
                     "run": {"device": "cpu", "num_threads": 1}})


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_is_counted_by_the_estimate(tmp_path, name):
    cfg = _memory_config(tmp_path, **OPTIONS[name])
    rng = np.random.default_rng(0)
    data = PackedDataset(rng.integers(0, 128, size=64 * 4 * 16 + 1).astype(np.int64), 64)
    measured = measure_training(cfg, data).as_dict()
    est = estimate_memory(cfg, 1, "cpu")
    for phase in ("backward", "optimizer"):
        got, want = est.phases[phase], measured["phases"][phase]
        assert abs(got - want) <= 0.02 * want, (name, phase, got, want)
    assert abs(est.detail["tensor_peak"] - measured["peak"]) <= 0.02 * measured["peak"], name
