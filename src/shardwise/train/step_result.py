"""One optimizer step's figures, read without stalling the device.

A step ends with its loss, gradient norm, whether it was skipped (a non-finite loss or gradient) and,
under fp16, whether it overflowed and the loss scale after it, all as tensors on the training device.
Reading them at once would make the host wait for the whole step before it may queue the next one.
`StepResult` instead starts a copy of them into (pinned) host memory behind the step's work and
records an event; the trainer reads a step's figures one step later, while the device is busy with
the next step's forward and backward, or at log steps, where a sync is wanted anyway (the timing of
the log window then covers finished work). On the CPU the figures are there at once.

The token counts of a step are host integers in one process; under data parallelism they are summed
over the ranks by a collective on the device (int64), and travel with the figures, which are float64
for them: float32 counts every integer only up to 2^24 tokens, a step's count at 16 ranks x 1M tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from .metrics import StepTokens
from .preference_step import figures_record

LOSS, GRAD_NORM, SKIPPED, OVERFLOWED, SCALE = range(5)  # positions in the figures


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Event]]:
    """`values` on the host: a pinned copy queued behind the device's work and the event that marks it
    done, or the tensor itself when it is on the CPU."""
    if values.device.type == "cpu":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.Event(device=values.device)
    event.record()
    return host, event


class StepResult:
    """One optimizer step (0-based `step`): loss, gradient norm, skipped, tokens; read lazily.

    `figures` holds [loss, gradient norm, skipped, overflowed, loss scale] (`skipped` and
    `overflowed` as 0/1) and, under data parallelism, the summed [target, real] token counts after
    them, in float64 (exact for counts up to 2^53); `tokens` gives the counts instead when they are
    known on the host. Reading any property waits for the step (a host sync on an accelerator).
    `settled` is set by the trainer once it has acted on the figures (a stop, a warning), so that it
    does so once.
    """

    def __init__(self, step: int, figures: torch.Tensor, tokens: Optional[StepTokens] = None,
                 expert_load: Optional[tuple[list[str], torch.Tensor]] = None,
                 rewards: Optional[torch.Tensor] = None) -> None:
        self.step = step
        self._host, self._event = _to_host(figures.detach().double())
        self._tokens = tokens
        self._values: Optional[list[float]] = None
        self.settled = False
        # Mixture of experts: the MoE blocks' names and their routed copies per expert [blocks, experts]
        self._load_names = expert_load[0] if expert_load is not None else []
        self._load = _to_host(expert_load[1].detach().double()) if expert_load is not None else None
        # Preference tuning: the step's summed reward figures (train/preference_step.py), over all ranks
        self._rewards = _to_host(rewards.detach().double()) if rewards is not None else None

    def rewards(self) -> dict[str, float]:
        """Preference tuning: the step's mean reward margin, reward accuracy and chosen and rejected rewards
        over its pairs. Empty for other data."""
        if self._rewards is None:
            return {}
        host, event = self._rewards
        if event is not None:
            event.synchronize()
        record = figures_record(host)
        return {k: v for k, v in record.items() if k != "loss"}

    def expert_load(self) -> dict[str, float]:
        """Per MoE block: the busiest expert's routed copies over the mean (1.0 is an even load; a collapse
        onto few experts shows as a value near experts / top-k). Empty for a dense model."""
        if self._load is None:
            return {}
        host, event = self._load
        if event is not None:
            event.synchronize()
        return {name: round(float(row.max() / row.mean().clamp_min(1e-12)), 4)
                for name, row in zip(self._load_names, host)}

    @classmethod
    def known(cls, step: int, loss: float, grad_norm: float, skipped: bool, tokens: StepTokens) -> "StepResult":
        """A step whose figures the host has already read."""
        return cls(step, torch.tensor([loss, grad_norm, float(skipped), 0.0, 1.0], dtype=torch.float64), tokens)

    def values(self) -> list[float]:
        """The figures as floats (waits for the step once)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self._values

    @property
    def loss(self) -> float:
        """The step's loss (over all ranks)."""
        return self.values()[LOSS]

    @property
    def grad_norm(self) -> float:
        """The global gradient norm (before clipping)."""
        return self.values()[GRAD_NORM]

    @property
    def skipped(self) -> bool:
        """Whether the step left the weights untouched (a non-finite loss or gradient)."""
        return self.values()[SKIPPED] > 0

    @property
    def overflowed(self) -> bool:
        """Whether fp16 gradients overflowed with a finite loss (the loss scale was lowered)."""
        return self.values()[OVERFLOWED] > 0

    @property
    def scale(self) -> float:
        """The loss scale after the step (1 without fp16 loss scaling)."""
        return self.values()[SCALE]

    @property
    def tokens(self) -> StepTokens:
        """The step's real and target tokens over all ranks."""
        if self._tokens is not None:
            return self._tokens
        target, real = self.values()[SCALE + 1:SCALE + 3]
        return StepTokens(real=int(real), target=int(target))
