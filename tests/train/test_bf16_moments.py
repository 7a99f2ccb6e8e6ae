"""bf16 Adam moments keep decaying at beta2 = 0.999 (issue 25, item 6).

The second moment moves by 0.1% of itself a step at beta2 = 0.999, under half the spacing of bf16 values
(0.2% to 0.4%): rounded to nearest it stops decaying once the gradients shrink. The moments are rounded
back stochastically (`memory.precision.round_into`), so they follow fp32's on average. The reference is the
recurrence itself in float64.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.memory.precision import round_into
from shardwise.memory.streamed_optimizer import StreamedAdam
from shardwise.train.optim import build_optimizer

N, STEPS, LOUD = 4096, 300, 10  # gradient 1 (times a per-element scale) for LOUD steps, then 0.01


def _scale() -> torch.Tensor:
    return torch.linspace(0.5, 2.0, N)  # elements over three binades


def _gradient(step: int) -> torch.Tensor:
    return _scale() * (1.0 if step < LOUD else 0.01)


def _moments(kernel: str, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) moments after `steps` AdamW steps with bf16 moments, as float64. Kernel "streamed":
    optimize.offload_optimizer stream's update, its bf16 state in host memory."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(N))
    if kernel == "streamed":
        opt = StreamedAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True,
                           device=torch.device("cpu"), state_dtype=torch.bfloat16)
    else:
        opt = build_optimizer([("w", p)], "adamw", 1e-3, 0.0, (0.9, 0.999), 1e-8, kernel=kernel,
                              state_dtype=torch.bfloat16)
    for step in range(steps):
        p.grad = _gradient(step)
        opt.step()
    state = opt.state[p]
    assert state["exp_avg_sq"].dtype == torch.bfloat16
    return state["exp_avg"].double(), state["exp_avg_sq"].double()


def _exact(steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    m = v = torch.zeros(N, dtype=torch.float64)
    for step in range(steps):
        g = _gradient(step).double()
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    return m, v


@pytest.mark.parametrize("kernel", ["fused", "chunked", "streamed"])
def test_bf16_second_moments_keep_decaying_with_fp32s(kernel):
    m, v = _moments(kernel)
    m_exact, v_exact = _exact()
    _, v_loud = _exact(LOUD)
    assert float(v_exact.mean()) < 0.8 * float(v_loud.mean())  # it decays by a quarter over the quiet steps
    # Rounded to nearest they stay where the loud steps left them: 33% above, every element.
    assert abs(float(v.mean() / v_exact.mean()) - 1) < 0.01  # measured 0.04%
    assert float(((v - v_exact).abs() / v_exact).median()) < 0.05  # each element within its rounding noise: 2.4%
    assert float(((m - m_exact).abs() / m_exact).max()) < 0.01


def test_stochastic_rounding_is_unbiased_over_steps_exact_where_it_can_be_and_layout_free():
    """Each step (salt) draws afresh, so an element's roundings average to its value; the draw depends on
    the element's value and the step only, so a tensor rounded whole or in pieces, in any order, rounds
    alike (what keeps layouts in parity); values bf16 holds stay put."""
    values = torch.tensor([1.0 + 2**-9, -3.3e-7, 0.00995, 1e30, 1.0 + 2**-12])
    rounded = torch.empty(20_000, len(values), dtype=torch.bfloat16)
    for step in range(len(rounded)):
        round_into(rounded[step], values.clone(), torch.tensor(float(step)))
    for column, want in zip(rounded.float().t(), values):
        assert len(column.unique()) == 2, float(want)  # the bf16 values either side of it, nothing else
        assert abs(float(column.double().mean() / want) - 1) < 1e-4, float(want)  # on average, the value
    held = values.bfloat16().float()
    stored = torch.empty(len(values), dtype=torch.bfloat16)
    round_into(stored, held.clone(), 3)
    assert torch.equal(stored.float(), held)  # values bf16 holds stay put
    many = torch.randn(10_000) * 1e-3
    whole = torch.empty(10_000, dtype=torch.bfloat16)
    round_into(whole, many.clone(), 5)
    pieces = torch.empty_like(whole)
    for start in reversed(range(0, 10_000, 700)):  # other pieces, another order: a sharded layout
        round_into(pieces[start:start + 700], many[start:start + 700].clone(), 5)
    assert torch.equal(whole, pieces)
    other_step = torch.empty_like(whole)
    round_into(other_step, many.clone(), 6)
    assert not torch.equal(whole, other_step)  # the next step draws again
