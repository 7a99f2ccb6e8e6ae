"""bitsandbytes' paged AdamW (train.optimizer: paged_adamw_8bit / paged_adamw, issue 25 item 1): refused with
the fix where it cannot run (this CPU among them), and shardwise's wrapper keeps bitsandbytes' step counts
as tensors between steps, so a checkpoint (which saves tensors only) resumes Adam's bias correction where it
was. The paged classes need CUDA; the wrapper is exercised here around bitsandbytes' non-paged AdamW8bit
(the same update, its state in ordinary memory), against bitsandbytes' own optimizer."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.train import paged_optimizer
from shardwise.train.optim import build_optimizer, check_optimizer
from shardwise.train.paged_optimizer import paged_problem

from .conftest import tiny_config, with_changes


class _Dims:
    def __init__(self, dp: int = 1, pp: int = 1) -> None:
        self.dp, self.pp = dp, pp


@pytest.mark.parametrize("name", ["paged_adamw_8bit", "paged_adamw"])
def test_a_paged_optimizer_off_cuda_is_refused_with_the_alternative(tmp_path, name):
    cfg = with_changes(tiny_config(tmp_path), train={"optimizer": name})
    with pytest.raises(ConfigError) as err:
        check_optimizer(cfg, _Dims(), 1, torch.device("cpu"))
    assert name in str(err.value) and "CUDA" in str(err.value) and "offload_optimizer: stream" in str(err.value)


def test_layouts_a_paged_optimizer_cannot_run_are_named(monkeypatch):
    monkeypatch.setattr(paged_optimizer, "paged_available", lambda: True)
    assert "zero_stage 3" in paged_problem("paged_adamw_8bit", "cuda", 2, 3, False)
    assert "offload" in paged_problem("paged_adamw_8bit", "cuda", 1, 0, True)
    assert paged_problem("paged_adamw", "cuda", 2, 0, False) is None  # ZeRO-0 replicas: each steps its own
    monkeypatch.setattr(paged_optimizer, "paged_available", lambda: False)
    assert "pip install bitsandbytes" in paged_problem("paged_adamw", "cuda", 1, 0, False)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 96, generator=g)), torch.nn.Parameter(torch.randn(96, generator=g))]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_the_wrapper_keeps_step_counts_as_tensors_and_a_reload_continues_exactly(monkeypatch):
    bnb = pytest.importorskip("bitsandbytes.optim")
    monkeypatch.setitem(paged_optimizer.PAGED_OPTIMIZERS, "paged_adamw_8bit", "AdamW8bit")  # no CUDA here
    ours, ref = _params(), _params()
    opt = build_optimizer([(f"p{i}", p) for i, p in enumerate(ours)], "paged_adamw_8bit", 1e-2, 0.0, (0.9, 0.999),
                          1e-8)
    plain = bnb.AdamW8bit([{"params": [ref[0]], "weight_decay": 0.0}, {"params": [ref[1]], "weight_decay": 0.0}],
                          lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for seed in range(3):
        _step(opt, ours, seed)
        _step(plain, ref, seed)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    steps = [opt.state[p]["step"] for p in ours]
    assert all(torch.is_tensor(s) and s.device.type == "cpu" and int(s) == 3 for s in steps)
    # What the checkpointer saves (tensors) loaded into a new optimizer: the fourth step is the same.
    saved = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ours)}
    again = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    reloaded = build_optimizer([(f"p{i}", p) for i, p in enumerate(again)], "paged_adamw_8bit", 1e-2, 0.0,
                               (0.9, 0.999), 1e-8)
    for i, p in enumerate(again):
        reloaded.state[p] = saved[i]
    _step(opt, ours, 3)
    _step(reloaded, again, 3)
    for a, b in zip(ours, again):
        assert torch.equal(a, b)
