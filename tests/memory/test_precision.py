import pytest
import torch

from shardwise.memory.precision import LossScaler, MasterWeights, precision_plan
from shardwise.train.trainer import Trainer
from tests.train.conftest import SEQ, make_tokens, read_metrics, tiny_config, with_changes


def _dataset():
    from shardwise.data.packing import PackedDataset

    return PackedDataset(make_tokens(), SEQ)


def test_levels_mean_what_seed_003_says():
    assert precision_plan("fp32", "O2").level == "O0"
    o1, o2, o3 = (precision_plan("bf16", lvl) for lvl in ("O1", "O2", "O3"))
    assert o1.param_dtype == torch.float32 and o1.uses_autocast and not o1.master_weights
    assert o2.param_dtype == torch.bfloat16 and o2.master_weights and not o2.uses_autocast
    assert o3.param_dtype == torch.bfloat16 and not o3.master_weights
    assert precision_plan("fp16", "O1").needs_loss_scaling and not o2.needs_loss_scaling


@pytest.mark.parametrize("dtype,level", [("bf16", "O1"), ("bf16", "O2"), ("bf16", "O3"), ("fp16", "O2")])
def test_16_bit_levels_train_close_to_fp32(tmp_path, dtype, level):
    ds = _dataset()
    ref = Trainer(tiny_config(tmp_path / "ref", max_steps=6), train_dataset=ds).train()
    cfg = with_changes(tiny_config(tmp_path / "mp", max_steps=6),
                       optimize={"mixed_precision": dtype, "precision_level": level})
    trainer = Trainer(cfg, train_dataset=ds)
    result = trainer.train()
    assert result.losses[1] == pytest.approx(ref.losses[1], abs=0.02)
    assert result.losses[6] < result.losses[1] - 0.3
    assert abs(result.losses[6] - ref.losses[6]) < 0.25
    expected = torch.float32 if level == "O1" else {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert trainer.model.layers["0"].attention.wq.weight.dtype == expected
    assert trainer.model.rope_cos.dtype == torch.float32


def test_o2_resumes_from_its_fp32_masters(tmp_path):
    ds = _dataset()
    cfg = with_changes(tiny_config(tmp_path, max_steps=4, save_steps=2),
                       optimize={"mixed_precision": "bf16", "precision_level": "O2"})
    full = Trainer(cfg, train_dataset=ds).train(overwrite=True).losses
    part = with_changes(cfg, train={"output_dir": str(tmp_path / "part")})
    Trainer(with_changes(part, train={"max_steps": 4}), train_dataset=ds).train()
    import shutil

    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step_00000004")
    resumed = Trainer(part, train_dataset=ds).train(resume="auto").losses
    assert resumed[3] == full[3] and resumed[4] == full[4]


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path):
    cfg = with_changes(tiny_config(tmp_path, max_steps=12),
                       optimize={"mixed_precision": "fp16", "precision_level": "O1", "initial_loss_scale": 2.0**20})
    result = Trainer(cfg, train_dataset=_dataset()).train()
    records = [r for r in read_metrics(tmp_path / "run") if "loss_scale" in r]
    assert records[0]["skipped_steps"] == 1 and records[0]["loss_scale"] == 2.0**19
    skipped = sum(r["skipped_steps"] for r in records)
    assert 1 <= skipped < 10  # it lowers the scale until gradients fit, then trains
    assert records[-1]["loss_scale"] == 2.0 ** (20 - skipped)
    assert result.losses[12] < result.losses[1]


def test_loss_scaler_grows_after_clean_steps_and_round_trips():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert s.scale == 16.0
    s.update(found_inf=True)
    assert s.scale == 8.0 and s.skipped_steps == 1
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([8.0, float("inf"), 1.0])
    s.unscale([p])
    assert p.grad[0] == 1.0 and p.grad[2] == 0.125 and torch.isinf(p.grad[1])


def test_master_weights_step_in_fp32():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mw = MasterWeights([("w", p)])
    p.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)
    mw.grads_to_masters()
    assert p.grad is None and mw.masters[0].grad.dtype == torch.float32
    with torch.no_grad():
        mw.masters[0] -= mw.masters[0].grad  # 1 - 1e-3 is not representable in bf16 ...
    mw.masters_to_model()
    assert mw.masters[0][0].item() == pytest.approx(0.999, abs=1e-6)  # ... but the master keeps it


def test_resume_across_precision_levels(tmp_path):
    """O2 -> O0 starts from the exact fp32 master weights; O0 -> O2 builds masters from fp32 weights."""
    from shardwise.checkpoint.weights import load_model

    ds = _dataset()
    o2 = with_changes(tiny_config(tmp_path, max_steps=2),
                      optimize={"mixed_precision": "bf16", "precision_level": "O2"})
    Trainer(o2, train_dataset=ds).train()
    masters, _ = load_model(tmp_path / "run")  # the fp32 masters of the O2 run
    fp32 = with_changes(o2, optimize={"mixed_precision": "fp32", "precision_level": None})
    resumed = Trainer(fp32, train_dataset=ds)
    assert resumed.train(resume="auto").losses == {}  # step 2 of 2: loads and stops
    for (name, p), q in zip(resumed.model.named_parameters(), masters.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    # the masters carry more than bf16 precision, so they are not just the bf16 weights widened
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in resumed.model.parameters())

    more = Trainer(with_changes(fp32, train={"max_steps": 3}), train_dataset=ds).train(resume="auto")
    back = with_changes(o2, train={"max_steps": 4})
    again = Trainer(back, train_dataset=ds).train(resume="auto")  # O0 step-3 checkpoint -> O2
    assert sorted(again.losses) == [4] and abs(again.losses[4] - more.losses[3]) < 0.3


def test_fp16_o3_trains_with_an_fp16_safe_eps(tmp_path):
    cfg = with_changes(tiny_config(tmp_path, max_steps=4, eps=1e-4),
                       optimize={"mixed_precision": "fp16", "precision_level": "O3"})
    trainer = Trainer(cfg, train_dataset=_dataset())
    result = trainer.train()
    assert all(torch.isfinite(torch.tensor(list(result.losses.values()))))
    assert result.losses[4] < result.losses[1]
    state = trainer.model.layers["0"].attention.wq.weight
    assert state.dtype == torch.float16 and torch.isfinite(state).all()


def test_master_gradients_accumulate_in_fp32():
    """16 micro-batches' bf16 gradients sum in fp32 in the masters (the 16-bit .grad is freed after
    each): the result is the exact sum of the bf16 gradients, where bf16 accumulation loses bits."""
    torch.manual_seed(0)
    shape = (64,)
    p = torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16))
    mw = MasterWeights([("w", p)])
    coeffs = [torch.randn(shape).to(torch.bfloat16) * (1 + i) for i in range(16)]
    for c in coeffs:
        (p * c).sum().backward()  # d/dp = c, in bf16
        assert p.grad is None  # taken over at once: no 16-bit gradient lives across micro-batches
    exact = torch.stack([c.double() for c in coeffs]).sum(0)
    got = mw.masters[0].grad
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), exact, rtol=1e-7, atol=0)
    # The old behaviour: accumulation in the bf16 .grad, off by far more than fp32 rounding.
    q = torch.nn.Parameter(p.detach().clone())
    for c in coeffs:
        (q * c).sum().backward()
    assert ((q.grad.double() - exact).norm() / exact.norm()).item() > 1e-3


def test_hand_written_gradients_are_taken_over_before_the_step():
    """A zero-bubble pipeline's weight pass writes `.grad` without autograd's accumulation hooks:
    grads_to_masters adds it to what the hooks already accumulated."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mw = MasterWeights([("w", p)])
    (p * 2).sum().backward()  # through the hook
    p.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)  # by hand
    mw.grads_to_masters()
    assert p.grad is None and mw.masters[0].grad.tolist() == [2.5] * 4
    assert mw.master_of(p) is mw.masters[0]
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert mw.master_of(frozen) is frozen
