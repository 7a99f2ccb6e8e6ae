"""The schedule on a rank: its pipeline stages and their layers (`Stage`), the order of the forwards and
backwards of one optimizer step (`rank_ops`; torch's own for the multi-stage schedules), the
micro-batches each stage holds at once (`in_flight`), and the buffers a pipeline adds (receive buffers,
what zero-bubble keeps from one step to the next). Without a pipeline: one stage, the accumulated
micro-batches one after another."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...parallel.pipeline import schedule_class, schedule_style, stage_indices, stage_rank
from .layout import Layout
from .parameters import Param


def rank_ops(lay: Layout, pp_rank: int, stages: list[int]) -> list[tuple[int, str, int]]:
    """(stage, kind, micro-batch) of one optimizer step on `pp_rank`, in execution order.

    kind: "F" forward, "B" full backward, "I" input-gradient backward and "W" weight-gradient step
    (zero-bubble keeps a micro-batch's activations until its "W"). Without a pipeline: forward and
    backward of each accumulated micro-batch. With one: torch's own per-rank action order
    (`_calculate_single_rank_operations` of the multi-stage schedules; GPipe all forwards then all
    backwards; 1F1B min(M, P - rank) warm-up forwards then one backward, one forward), once per
    pipeline step of the optimizer step.
    """
    if lay.pp == 1:
        return [op for mb in range(lay.accumulation) for op in ((stages[0], "F", mb), (stages[0], "B", mb))]
    m, p = lay.micro_batch_num, lay.pp
    if lay.schedule == "gpipe":
        one = [(stages[0], "F", i) for i in range(m)] + [(stages[0], "B", i) for i in range(m)]
    elif lay.schedule == "1f1b":
        warm = min(m, p - pp_rank)
        one = [(stages[0], "F", i) for i in range(warm)]
        for i in range(m):
            one.append((stages[0], "B", i))
            if warm + i < m:
                one.append((stages[0], "F", warm + i))
    else:
        one = [op for op in _torch_rank_ops(lay, pp_rank) if op[2] < m]
    return one * max(1, lay.accumulation // m)


def _torch_rank_ops(lay: Layout, pp_rank: int) -> list[tuple[int, str, int]]:
    """The multi-stage schedules' action order, from torch itself (its pipeline_order of one rank)."""
    cls = schedule_class(lay.schedule, lay.virtual_stages)
    rounds = max(1, lay.micro_batch_num // lay.pp)
    fake = SimpleNamespace(pp_group_size=lay.pp, n_local_stages=lay.virtual_stages, _n_microbatches=lay.micro_batch_num,
                           microbatches_per_round=lay.micro_batch_num // rounds, number_of_rounds=rounds,
                           num_stages=lay.pp * lay.virtual_stages, rank=pp_rank)
    try:
        actions = cls._calculate_single_rank_operations(fake, pp_rank)
    except Exception:  # noqa: BLE001 - a torch without this internal: a 1F1B-like order over the chunks
        stages = rank_stages(lay, pp_rank)
        return [(st, k, i) for i in range(lay.micro_batch_num) for k in ("F", "B") for st in
                (stages if k == "F" else stages[::-1])]
    out = []
    for a in actions:
        if a is None:
            continue
        kind = str(getattr(a.computation_type, "value", a.computation_type))
        if kind in ("F", "B", "I", "W"):
            out.append((a.stage_index, kind, a.microbatch_index or 0))
    return out


def rank_stages(lay: Layout, pp_rank: int) -> list[int]:
    if lay.pp == 1:
        return [0]
    return stage_indices(pp_rank, lay.pp, lay.virtual_stages, schedule_style(lay.schedule, lay.virtual_stages))


def stage_layers(lay: Layout, stage: int) -> list[int]:
    start = sum(lay.stage_counts[:stage])
    return list(range(start, start + lay.stage_counts[stage]))


def _stage_owner(lay: Layout, stage: int) -> int:
    return stage_rank(stage, lay.pp, lay.pp * lay.virtual_stages, schedule_style(lay.schedule, lay.virtual_stages))


@dataclass
class Stage:
    """One model part on a rank: its layers and what one micro-batch of it keeps and needs."""

    index: int
    layers: list[int]
    first: bool  # holds the embeddings
    last: bool  # holds the final norm, output projection and loss
    act: int = 0  # bytes one micro-batch keeps from its forward to its backward
    grads: int = 0  # bytes of its gradients once they exist


def in_flight(lay: Layout, pp_rank: int, stage_ids: list[int]) -> dict[int, int]:
    """Most micro-batches each stage of the rank holds at once (forward done, backward not)."""
    held = {s: 0 for s in stage_ids}
    peak = dict(held)
    for st, kind, _mb in rank_ops(lay, pp_rank, stage_ids):
        held[st] += 1 if kind == "F" else (-1 if kind in ("B", "W") else 0)
        peak = {s: max(peak[s], held[s]) for s in held}
    return peak


def param_stage(p: Param, st: Stage, num_stages: int) -> bool:
    """Whether parameter p lives in stage st."""
    if p.where == "layer":
        return p.layer in st.layers
    return st.first if p.where == "embedding" else st.last


def pipeline_buffers(lay: Layout, stage_ids: list[int], hidden: int) -> int:
    """PipelineStage's receive buffers, one per micro-batch: activations from the previous stage and
    gradients from the next, where that stage is on another rank."""
    if lay.pp == 1:
        return 0
    n = lay.pp * lay.virtual_stages
    count = 0
    for st in stage_ids:
        if st > 0 and _stage_owner(lay, st - 1) != _stage_owner(lay, st):
            count += lay.micro_batch_num
        if st < n - 1 and _stage_owner(lay, st + 1) != _stage_owner(lay, st):
            count += lay.micro_batch_num
    return count * hidden


def zero_bubble_leftovers(lay: Layout, stage_ids: list[int], hidden: int) -> int:
    """Tensors torch's zero-bubble stages keep from one step to the next: each non-first stage's input
    gradients, and the activations passed between two stages of the same rank (the V's turn)."""
    if lay.pp == 1 or lay.schedule != "zero_bubble":
        return 0
    count = sum(lay.micro_batch_num for st in stage_ids if st > 0)
    count += sum(lay.micro_batch_num for st in stage_ids
                 if st > 0 and _stage_owner(lay, st - 1) == _stage_owner(lay, st))
    return count * hidden
