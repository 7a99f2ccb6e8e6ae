"""Optimizers with weight-decay groups, and learning-rate schedules (warmup, then a decay)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..errors import ConfigError


def decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Split trainable parameters into decayed (matrices) and not decayed (biases, norms)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: Iterable[tuple[str, torch.Tensor]], name: str, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """The optimizer named in `train.optimizer`, over weight-decay groups, with the fastest kernel."""
    groups = decay_groups(named_params, weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters; check the freeze / LoRA settings")
    # foreach kernels batch the per-parameter update into a few big ops: the fastest choice that
    # works on every device (fused AdamW is CUDA/CPU only and not for every dtype).
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
    if name == "adam":
        for g in groups:
            g["weight_decay"] = 0.0
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=betas[0], foreach=True)
    raise ConfigError(f"train.optimizer {name!r} is not known; use adamw, adam or sgd")


class LRSchedule:
    """Linear warmup to `lr`, then cosine, linear, constant or WSD decay to `min_lr` at `total_steps`.

    `lr_at(step)` is the rate for the update made at 0-based optimizer step `step`.
    """

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
                 decay_style: str, wsd_decay_ratio: float = 0.1) -> None:
        self.lr, self.min_lr = lr, min_lr
        self.warmup_steps, self.total_steps = warmup_steps, max(total_steps, 1)
        self.decay_style, self.wsd_decay_ratio = decay_style, wsd_decay_ratio

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based step `step`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if self.decay_style == "wsd":
            decay_start = max(self.warmup_steps, int(self.total_steps * (1 - self.wsd_decay_ratio)))
            if step < decay_start:
                return self.lr
            span = max(self.total_steps - decay_start, 1)
            return self.lr - (self.lr - self.min_lr) * min((step - decay_start + 1) / span, 1.0)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps + 1) / span, 1.0)
        if self.decay_style == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the rate of every param group for `step`; return it."""
        lr = self.lr_at(step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr
