"""Held-out evaluation: the token-weighted loss over the eval data, as one process computes it, in
any layout, with every rank doing only its share.

The eval batches are those of `sequential_batches` (train.micro_batch_size samples each, at most
train.eval_batches of them), shared out over the data-parallel ranks: rank r of dp evaluates
batches r, r + dp, r + 2 dp, ...; the tensor-parallel and pipeline ranks of a replica see the same
batches. Each rank sums its token losses (float64, on the device) and counts its target tokens
(on the host, from the labels), and one all-reduce of [loss sum, tokens] in float64 over the
data-parallel group gives every rank the totals: one process's sums, in another order.

Every rank runs the same number of forwards: when the batch count is not a multiple of dp, the
ranks with one batch fewer run a padding forward (the first batch again) whose result is dropped,
because under ZeRO-3 / FSDP2 and HSDP each forward all-gathers parameters collectively.

Under pipeline parallelism each replica runs its batches through `pipeline_eval_batches` in groups
of PIPELINE_GROUP, forward only, the stages overlapping; every pipeline rank gets the per-batch
sums, so the reduction is the same as without a pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch
from torch import nn

from ..data.loader import sequential_batch_count, sequential_batches
from ..loss import IGNORE_INDEX, token_loss_sum
from ..parallel.collectives import all_reduce
from ..parallel.pipeline import pipeline_eval_batches

# Eval batches per pipeline pass: the fill and drain cost (segments - 1) ticks of PIPELINE_GROUP +
# segments - 1; only the CPU batches of a group are held, not their activations.
PIPELINE_GROUP = 32
_MODEL_EXTRAS = ("position_ids", "document_ids", "attention_mask")

Batch = dict[str, torch.Tensor]


def shard_batches(dataset: Any, batch_size: int, limit: Optional[int], rank: int = 0,
                  world: int = 1) -> Iterator[tuple[Batch, bool]]:
    """Data-parallel rank `rank`'s eval batches, each with whether it counts: batches rank,
    rank + world, ..., then uncounted padding (the first batch again) up to ceil(batches / world),
    the number every rank runs."""
    rounds = -(-sequential_batch_count(dataset, batch_size, limit) // world)
    taken = 0
    for mb in sequential_batches(dataset, batch_size, limit, rank, world):
        taken += 1
        yield mb, True
    if taken < rounds:
        padding = next(sequential_batches(dataset, batch_size, limit))
        for _ in range(rounds - taken):
            yield padding, False


def model_inputs(mb: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """Document-aware position ids and masks of a batch, when the data provides them."""
    return {k: mb[k].to(device, non_blocking=True) for k in _MODEL_EXTRAS if k in mb}


def target_tokens(mb: Batch) -> int:
    """Label positions of a batch that carry a loss."""
    return int((mb["labels"] != IGNORE_INDEX).sum())


@torch.no_grad()
def evaluate_held_out(model: nn.Module, dataset: Any, *, batch_size: int, limit: Optional[int],
                      device: torch.device, plan: Any, loss_chunk: Optional[int] = None, pipeline: Any = None,
                      dp_mesh: Any = None) -> dict[str, float]:
    """Token-weighted loss, perplexity and target tokens over the eval batches of `dataset`.

    `plan`: the run's precision plan (its autocast); `loss_chunk`: optimize.loss_chunk() (the model
    returns the token-loss sum itself); `pipeline`: this rank's parallel.pipeline.Pipeline (then
    `model` is not used); `dp_mesh`: the data-parallel mesh to share the batches over (None: this
    process evaluates every batch). Every rank of the layout calls it and gets the same result.
    """
    rank, world = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    batches = shard_batches(dataset, batch_size, limit, rank, world)
    if pipeline is not None:
        loss_sum, tokens = _pipeline_sums(pipeline, batches, device, plan, loss_chunk)
    else:
        loss_sum, tokens = _model_sums(model, batches, device, plan, loss_chunk)
    totals = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64, device=device)])
    if world > 1:
        totals = all_reduce(totals, dp_mesh)
    loss_sum, tokens = totals.tolist()
    loss = loss_sum / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(tokens)}


def evaluate_sources(model: nn.Module, held_out: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
    """`evaluate_held_out` over each source's held-out data (a mixture's, by source name): the loss over all
    of them, token-weighted, and `loss_by_source`."""
    results = {name: evaluate_held_out(model, dataset, **kwargs) for name, dataset in held_out.items()}
    tokens = sum(r["tokens"] for r in results.values())
    loss = sum(r["loss"] * r["tokens"] for r in results.values()) / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens,
            "loss_by_source": {name: r["loss"] for name, r in results.items()}}


def batch_loss_sum(model: nn.Module, mb: Batch, device: torch.device, plan: Any,
                   loss_chunk: Optional[int] = None) -> torch.Tensor:
    """The sum of a batch's token losses under `model` (forward only)."""
    ids = mb["input_ids"].to(device, non_blocking=True)
    labels = mb["labels"].to(device, non_blocking=True)
    with plan.autocast(device.type):
        if loss_chunk is not None:  # the model's forward returns the sum: no logits
            return model(ids, labels=labels, loss_chunk_tokens=loss_chunk, **model_inputs(mb, device))
        return token_loss_sum(model(ids, **model_inputs(mb, device)), labels)


def _model_sums(model: nn.Module, batches: Iterator[tuple[Batch, bool]], device: torch.device, plan: Any,
                loss_chunk: Optional[int]) -> tuple[torch.Tensor, int]:
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        for mb, counted in batches:
            value = batch_loss_sum(model, mb, device, plan, loss_chunk)
            if counted:  # a padding forward only keeps the collectives in step
                loss_sum += value.double()
                tokens += target_tokens(mb)
    finally:
        model.train(was_training)
    return loss_sum, tokens


def _pipeline_sums(pipe: Any, batches: Iterator[tuple[Batch, bool]], device: torch.device, plan: Any,
                   loss_chunk: Optional[int]) -> tuple[torch.Tensor, int]:
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for group in _groups(batches, PIPELINE_GROUP):
        with plan.autocast(device.type):
            sums = pipeline_eval_batches(pipe, [mb for mb, _ in group], loss_chunk_tokens=loss_chunk)
        counted = [i for i, (_, c) in enumerate(group) if c]
        if counted:
            loss_sum += sums[counted].double().sum()
            tokens += sum(target_tokens(group[i][0]) for i in counted)
    return loss_sum, tokens


def _groups(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    group: list[Any] = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
