"""Preference losses on chosen/rejected pairs: DPO (sigmoid), IPO, SimPO and ORPO.

Every function takes the rows of a preference batch (data/preference.py): pair i's chosen answer in row
2i, its rejected one in row 2i + 1. `row_logps(logits, labels)` gives each row's summed log-probability
of its answer tokens and their count; `pair_losses` turns the policy's (and, for DPO and IPO, the
reference model's) into one loss per pair and each answer's implicit reward. The trainer sums the pairs'
losses and divides by the step's pair count over all ranks, so every layout and micro-batch split gives
one process's loss.

With s = log pi(answer | prompt) summed over the answer's tokens, a = s / tokens its average, r the
reference's s, beta, label smoothing e and d = (s_c - r_c) - (s_r - r_r):

- `dpo`: -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d) (Rafailov et al.; e > 0 is conservative
  DPO); rewards beta (s - r).
- `ipo`: (d' - 1 / (2 beta))^2 with d' as d on the averages a (Azar et al., as TRL computes it); rewards
  beta (a - a_ref).
- `simpo`: -(1 - e) log sigmoid(beta (a_c - a_r) - gamma) - e log sigmoid(-(...)) (Meng et al.; no
  reference); rewards beta a.
- `orpo`: -a_c + lambda (-log sigmoid(log odds(a_c) - log odds(a_r))), odds(a) = e^a / (1 - e^a) (Hong
  et al.; no reference; the supervised term is each pair's mean token loss on the chosen answer, where
  TRL takes the mean over the batch's tokens: the same when the chosen answers are equally long);
  rewards lambda a.

At the first step of a run whose reference is its starting weights, d = 0 and the DPO loss is ln 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .loss import IGNORE_INDEX, row_token_loss_sums

LOSSES = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")


@dataclass(frozen=True)
class PreferenceObjective:
    """A preference loss and its parameters (the `preference` section, checked)."""

    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (DPO, IPO)."""
        return self.loss in NEEDS_REFERENCE


def row_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its labelled tokens [R] (fp32) and their count [R].

    `logits` [R, T, V] (a plain tensor or a DTensor, gathered whole), `labels` [R, T] with IGNORE_INDEX where
    a position carries no label (the prompt, padding)."""
    return -row_token_loss_sums(logits, labels), answer_tokens(labels)


def answer_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's count of labelled tokens [R] (`labels` [R, T], a plain tensor or a DTensor)."""
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    return (labels != IGNORE_INDEX).sum(dim=1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate at both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _smoothed(logits: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)


def pair_losses(
    objective: PreferenceObjective,
    policy: torch.Tensor,
    counts: torch.Tensor,
    reference: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [B], chosen reward [B], rejected reward [B]) of B pairs from the rows' summed policy
    log-probabilities `policy` [2B], their answer token counts `counts` [2B] and, for DPO and IPO, the
    reference's `reference` [2B]."""
    o = objective
    policy = policy.float()
    if o.needs_reference and reference is None:
        raise ValueError(f"preference loss {o.loss} needs the reference model's log-probabilities")
    n = counts.to(policy.dtype).clamp_min(1)
    chosen, rejected = policy[0::2], policy[1::2]
    if o.loss == "dpo":
        ref = reference.to(policy.dtype)
        reward_c, reward_r = o.beta * (chosen - ref[0::2]), o.beta * (rejected - ref[1::2])
        return _smoothed(reward_c - reward_r, o.label_smoothing), reward_c.detach(), reward_r.detach()
    average = policy / n
    if o.loss == "ipo":
        ref = reference.to(policy.dtype) / n
        d = (average[0::2] - ref[0::2]) - (average[1::2] - ref[1::2])
        reward_c, reward_r = o.beta * (average[0::2] - ref[0::2]), o.beta * (average[1::2] - ref[1::2])
        return (d - 1 / (2 * o.beta)) ** 2, reward_c.detach(), reward_r.detach()
    a_c, a_r = average[0::2], average[1::2]
    if o.loss == "simpo":
        loss = _smoothed(o.beta * (a_c - a_r) - o.simpo_gamma, o.label_smoothing)
        return loss, (o.beta * a_c).detach(), (o.beta * a_r).detach()
    if o.loss == "orpo":
        log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
        loss = -a_c - o.orpo_lambda * F.logsigmoid(log_odds)
        return loss, (o.orpo_lambda * a_c).detach(), (o.orpo_lambda * a_r).detach()
    raise ValueError(f"unknown preference loss {o.loss!r}; expected one of {', '.join(LOSSES)}")


__all__ = ["LOSSES", "NEEDS_REFERENCE", "PreferenceObjective", "answer_tokens", "pair_losses", "row_logps"]
