import pytest
import torch

from shardwise.train.optim import LRSchedule, build_optimizer, decay_groups


def test_decay_groups_exclude_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = decay_groups(model.named_parameters(), 0.1)
    by_name = {g["name"]: g for g in groups}
    assert [p.shape for p in by_name["decay"]["params"]] == [torch.Size([4, 4])]
    assert len(by_name["no_decay"]["params"]) == 3 and by_name["no_decay"]["weight_decay"] == 0.0
    opt = build_optimizer(model.named_parameters(), "adamw", 1e-3, 0.1, (0.9, 0.95), 1e-8)
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
