"""Mixed precision levels O0-O3 and dynamic loss scaling.

O0  fp32 everywhere.
O1  fp32 weights; the forward pass runs under autocast in bf16/fp16.
O2  16-bit weights and activations; the optimizer steps an fp32 master copy of every trainable
    weight and copies the result back (the usual "mixed precision" of Megatron and MindSpore).
O3  pure 16-bit: weights, gradients and optimizer state all in bf16/fp16.
fp16 at any level uses a loss scale so small gradients survive; an overflow skips the step and
lowers the scale.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ..parallel.dtensors import local_tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPlan:
    """What a precision level means for weights, the forward pass and the optimizer."""

    level: str
    dtype: torch.dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype the model's weights are stored in."""
        return self.dtype if self.level in ("O2", "O3") else torch.float32

    @property
    def uses_autocast(self) -> bool:
        """Whether the forward pass runs under autocast."""
        return self.level == "O1"

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 copies of the weights."""
        return self.level == "O2"

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16's narrow range needs a loss scale; bf16 and fp32 do not."""
        return self.dtype == torch.float16

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in."""
        if self.uses_autocast:
            return torch.autocast(device_type=device_type, dtype=self.dtype)
        return contextlib.nullcontext()


def precision_plan(mixed_precision: str, level: str) -> PrecisionPlan:
    """Build the plan for `optimize.mixed_precision` and the level in force."""
    dtype = DTYPES[mixed_precision]
    if dtype == torch.float32:
        level = "O0"
    return PrecisionPlan(level=level, dtype=dtype)


class MasterWeights:
    """fp32 copies of 16-bit trainable weights (level O2); the optimizer steps these copies.

    Gradients accumulate in fp32, as Megatron's `main_grad` does: as soon as autograd has added a
    micro-batch's gradient to a weight's 16-bit `.grad`, a hook adds it to the master's fp32 `.grad`
    and frees the 16-bit one. Summing many micro-batches in bf16 would round every partial sum to 8
    bits of mantissa; this way a run's numbers do not depend on whether FSDP2 (which reduces in fp32)
    is in the layout. Gradients written without autograd's accumulation (a zero-bubble pipeline's
    weight pass adds them by hand) are taken over by `grads_to_masters`.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.model_params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._absorb) for p in self.model_params]

    def named_masters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 master) pairs, named like the model parameters."""
        return zip(self.names, self.masters)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """Where a model parameter's gradient accumulates: its fp32 master (the parameter itself when
        it has none, being frozen)."""
        return self._master_of.get(id(param), param)

    @torch.no_grad()
    def _absorb(self, p: torch.Tensor) -> None:
        m = self._master_of[id(p)]
        if m.grad is None:
            m.grad = p.grad.float()
        else:
            m.grad.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """Add any 16-bit gradient still on the model into the fp32 master gradients (before the
        optimizer step, and after a pipeline's hand-written weight pass)."""
        for p in self.model_params:
            if p.grad is not None:
                self._absorb(p)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Copy the updated fp32 weights back into the 16-bit model."""
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)

    @torch.no_grad()
    def model_to_masters(self) -> None:
        """Refresh the masters from the model (after loading weights that carry no masters)."""
        for p, m in zip(self.model_params, self.masters):
            m.copy_(p)


class LossScaler:
    """Dynamic (or static) loss scaling for fp16: overflow skips the step and halves the scale.

    The scale and its counters live on the training device as 0-dim tensors, so scaling the loss,
    unscaling the gradients and updating the scale after a step never wait for the device; `scale`,
    `skipped_steps` and `state_dict()` read them (a host sync: log steps and checkpoints only).
    `update(found_inf)` takes the step's overflow flag as a tensor (1.0: overflowed) or a bool.
    """

    def __init__(self, init_scale: float = 2.0**16, dynamic: bool = True, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, min_scale: float = 1.0,
                 device: torch.device | str = "cpu") -> None:
        self.dynamic = dynamic
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.device = torch.device(device)
        self.scale_tensor = self._counter(float(init_scale))  # multiplies the loss before backward
        self._good = self._counter(0.0)  # clean steps since the last overflow
        self._skipped = self._counter(0.0)

    def _counter(self, value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32, device=self.device)

    @property
    def scale(self) -> float:
        """The current scale (reads the device)."""
        return float(self.scale_tensor)

    @property
    def good_steps(self) -> int:
        """Clean steps since the last overflow (reads the device)."""
        return int(self._good)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an overflow so far (reads the device)."""
        return int(self._skipped)

    @torch.no_grad()
    def unscale(self, params: list[torch.Tensor]) -> None:
        """Divide gradients by the scale in place (their norm then tells whether they overflowed);
        a sharded gradient's local part is divided, which is the same for every placement."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, (1.0 / self.scale_tensor).to(grads[0].device))

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor | bool) -> None:
        """Lower the scale after an overflow (not below `min_scale`); raise it after each
        `growth_interval` clean steps. On the device: no branch reads the flag."""
        found = torch.as_tensor(found_inf, dtype=torch.float32).to(self.device)
        clean = 1.0 - found
        self._skipped.add_(found)
        self._good.add_(1.0).mul_(clean)
        if not self.dynamic:
            return
        grow = clean * (torch.remainder(self._good, self.growth_interval) == 0)
        lowered = torch.clamp(self.scale_tensor * self.backoff_factor, min=self.min_scale)
        grown = self.scale_tensor * torch.where(grow > 0, self.growth_factor, 1.0)
        self.scale_tensor.copy_(torch.where(found > 0, lowered, grown))

    def state_dict(self) -> dict:
        """JSON-serialisable state."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()` (a scale that is not a finite positive number is a ValueError)."""
        scale = float(state["scale"])
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"loss scale {scale!r} is not a finite positive number")
        self.scale_tensor.fill_(scale)
        self._good.fill_(int(state["good_steps"]))
        self._skipped.fill_(int(state.get("skipped_steps", 0)))


def loss_scaler_for(plan: PrecisionPlan, loss_scale: str | float, initial_scale: float,
                    device: torch.device | str = "cpu") -> LossScaler | None:
    """fp16's loss scaler ("dynamic", from `initial_scale`, or a fixed scale) on `device`; None for bf16 and fp32."""
    if not plan.needs_loss_scaling:
        return None
    dynamic = loss_scale == "dynamic"
    return LossScaler(initial_scale if dynamic else float(loss_scale), dynamic=dynamic, device=device)


ROUND_PIECE = 1 << 22  # elements `round_into` draws for at a time (three int32 temporaries: 48 MiB)
# Odd 32-bit constants of the integer hash that picks each rounding (as signed int32 values).
_GOLDEN = 0x9E3779B1 - 2**32
_MIX_1, _MIX_2 = 0x7FEB352D, 0x846CA68B - 2**32


def round_into(stored: torch.Tensor, work: torch.Tensor, salt: torch.Tensor | int) -> None:
    """Write fp32 `work` into bf16 `stored` with stochastic rounding; `work` is spent (its bits are changed).

    Round to nearest keeps a bf16 moment where it is whenever one step changes it by less than half the
    spacing of bf16 values there (0.2% to 0.4% of it): the second moment at beta2 = 0.999 moves by 0.1%
    of itself a step, so once the gradients shrink it stops decaying and the updates stay too small.
    Here each element goes to the bf16 value above or below with the probabilities that make its
    expected value `work`'s, so the moments follow fp32's on average (`tests/train/test_bf16_moments.py`).
    A value bf16 holds exactly stays exact (a skipped update leaves the moments as they were).

    How: 16 pseudo-random bits an element, added to `work`'s bit pattern below bf16's cut-off, carry
    into the bf16 part with the probability of the bits cut off, which are then cleared, so the copy
    into bf16 is exact. The bits are a hash of the element's bf16 part (its upper 16 bits) and `salt`
    (the update's step count: a different draw every step), not a random generator's: the rounding of
    an element depends only on its value and the step, so layouts that split a tensor differently round
    it alike (a gradient that differs in its last bit between layouts moves the cut-off bits by that bit,
    and flips a rounding with probability 2^-16 per unit of difference), and no random stream (dropout's)
    is consumed. The draw is made ROUND_PIECE elements at a time: three int32 temporaries of a piece.
    """
    s, w = local_tensor(stored), local_tensor(work)
    if s.dtype != torch.bfloat16 or w.dtype != torch.float32:
        s.copy_(w)
        return
    key = salt.to(device=w.device, dtype=torch.int32) * _GOLDEN if torch.is_tensor(salt) else \
        (int(salt) * _GOLDEN + 2**31) % 2**32 - 2**31
    for bits in w.view(-1).view(torch.int32).split(ROUND_PIECE):
        noise = bits >> 16  # the bf16 part (sign-extended): equal values draw equal bits at one step
        noise ^= key
        noise ^= (noise >> 16) & 0xFFFF  # a 32-bit integer mix (shifts made logical by the masks)
        noise *= _MIX_1
        noise ^= (noise >> 15) & 0x1FFFF
        noise *= _MIX_2
        noise ^= (noise >> 16) & 0xFFFF
        bits.add_(noise.bitwise_and_(0xFFFF)).bitwise_and_(-(2**16))
        del noise
    s.copy_(w)
