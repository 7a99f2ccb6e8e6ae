"""Pipeline parallelism on `torch.distributed.pipelining`: split a model into stages, schedule them, step.

The order of use (torchtitan's): `split_model` -> tensor parallel -> recompute -> compile -> data
parallel, each applied to every chunk, then `build_schedule` and, once per optimizer step,
`pipeline_step`. The trainer does exactly that: `parallelize.parallelize_parts` splits and
parallelises, `Trainer` runs `pipeline_step` once per `micro_batch_num` micro-batches (several times
per optimizer step when the accumulation is a multiple of it) and clips with the norm over all
stages, `data_parallel.clip_grad_norm(reduce_group=<pp group>, exclude=Pipeline.norm_exclusions())`.

How a model becomes stages. The model is cut into `pipeline_parallel x virtual_stages` stages of
consecutive layers; stage 0 also owns the embeddings, the last stage the final norm and output
projection. A rank owns `virtual_stages` stages ("chunks"): stage `rank + k * pp` for looped
schedules (gpipe, 1f1b, interleaved_1f1b, zero_bubble except below), or the V pair
(`rank`, `2 * pp - 1 - rank`) for ZBV, so that rank 0 holds the first and the last stage. Each chunk
is the model with the other stages' layers deleted and `tok_embeddings` / `pos_embeddings` /
`norm` / `output` set to None where the stage does not own them. Layers keep their keys ("2", "3",
...), so parameter names are those of the whole model and checkpoints reshard between layouts.

Schedules. `gpipe` -> ScheduleGPipe, `1f1b` -> Schedule1F1B (virtual_stages 1),
`interleaved_1f1b` -> ScheduleInterleaved1F1B (virtual_stages >= 2), `zero_bubble` ->
ScheduleZBVZeroBubble when virtual_stages is 2 (the V-shaped ZB-V of the zero-bubble paper: two
chunks per rank, the bubble filled with weight-gradient work) and ScheduleInterleavedZeroBubble
(ZB1P) for any other virtual_stages, including 1.

Per-micro-batch inputs. `position_ids`, `document_ids` and `attention_mask` are not activations:
they are given to the schedule as keyword arguments on every rank; the schedule splits them into
micro-batches along dim 0 and hands micro-batch i's slice to every stage's forward together with the
hidden states it receives (kwargs need no gradient and are never sent between stages).

Loss. The schedule's loss function returns, per micro-batch, the sum of its token losses divided by
the number of target tokens of the whole step (`global_tokens`, all micro-batches and, with data
parallel, all replicas), and the schedule does not rescale gradients, so the gradients are those of
one process computing sum(token losses) / global_tokens. `pipeline_step` returns that step loss on
every pipeline rank (broadcast from the rank that holds the last stage). Preference tuning gives its own
`row_loss`: the last stage returns each row's token-loss sum, and the function makes the micro-batch's
pair losses from them and the schedule's target (the labels, and the reference's log-probabilities).

Tied embeddings (`tie_embeddings`). The first stage's embedding and the last stage's output
projection are separate copies of the shared matrix (on different ranks, or both on rank 0 for a V
schedule): `pipeline_step` adds the two gradients (point to point between the two ranks, or locally)
so both copies get the one-process gradient and stay equal under the optimizer, and
`Pipeline.norm_exclusions()` names the copy that the gradient norm must not count twice.

Evaluation. `pipeline_eval_batches` runs micro-batches forward only, outside the schedule: a GPipe
fill in lock-step ticks (stage s on micro-batch m while stage s + 1 is on m - 1) with batched
non-blocking sends and receives, for every placement (looped, interleaved, V) and any batch shapes.

Batch shapes. The stages infer the activation shapes from the first step (a forward and backward
of one micro-batch) and keep them; when a later step's batch has another shape (dynamic batching),
`pipeline_step` rebuilds the stages and schedule, paying that inference again.

Known limits (torch 2.13): the zero-bubble schedules refuse `torch.compile`d submodules
(`module.compile()` in place passes the check); with FSDP2 they need `reshard_after_forward=False`
(per block or per stage root alike): with True some stages' gradients come out None or wrong,
silently. The schedule still reshards at the end of each step, so between steps the parameters are
sharded as with ZeRO-3 (torchtitan's default under PP too).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from ..errors import ConfigError
from ..loss import IGNORE_INDEX, row_token_loss_sums, token_loss_sum
from ..models.moe import routing_uncounted
from ..models.transformer import materialize
from .collectives import broadcast_, exchange
from .dtensors import local_tensor

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
_MODEL_EXTRAS = ("position_ids", "document_ids", "attention_mask")


# --- the layout: which stage owns which layers, which rank owns which stage --------------------------


def schedule_style(schedule: str, virtual_stages: int = 1) -> str:
    """"v" when the schedule places its two chunks per rank in a V (ZBV), else "loop"."""
    return "v" if schedule == "zero_bubble" and virtual_stages == 2 else "loop"


def schedule_class(schedule: str, virtual_stages: int = 1) -> type:
    """The torch.distributed.pipelining schedule class for one of our schedule names."""
    if schedule == "gpipe":
        return ScheduleGPipe
    if schedule == "1f1b":
        return Schedule1F1B
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B
    if schedule == "zero_bubble":
        return ScheduleZBVZeroBubble if virtual_stages == 2 else ScheduleInterleavedZeroBubble
    raise ConfigError(f"parallel.schedule {schedule!r} is not known; use one of {', '.join(SCHEDULES)}")


def check_pipeline(num_layers: int, pp_size: int, virtual_stages: int = 1, schedule: str = "1f1b",
                   stage_layers: Optional[list[int]] = None, micro_batch_num: Optional[int] = None) -> list[int]:
    """Validate a pipeline layout before any process starts; return the layer count of every stage.

    Raises ConfigError naming the setting to change.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule {schedule!r} is not known; use one of {', '.join(SCHEDULES)}")
    if pp_size < 1 or virtual_stages < 1:
        raise ConfigError(
            f"parallel.pipeline_parallel ({pp_size}) and parallel.virtual_stages ({virtual_stages}) must be >= 1")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ConfigError(
            f"parallel.schedule {schedule} runs one stage per rank, but virtual_stages is {virtual_stages}; "
            "set virtual_stages: 1, or use schedule interleaved_1f1b or zero_bubble for several chunks per rank")
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise ConfigError(
            "parallel.schedule interleaved_1f1b needs virtual_stages >= 2 (model chunks per rank); "
            "set virtual_stages: 2, or use schedule 1f1b for one stage per rank")
    num_stages = pp_size * virtual_stages
    counts = stage_layer_counts(num_layers, num_stages, stage_layers)
    if micro_batch_num is not None:
        _check_micro_batches(micro_batch_num, pp_size, num_stages, schedule, virtual_stages)
    return counts


def _check_micro_batches(n: int, pp_size: int, num_stages: int, schedule: str, virtual_stages: int) -> None:
    if n < 1:
        raise ConfigError(f"parallel.micro_batch_num must be >= 1, got {n}")
    if schedule == "gpipe" or pp_size == 1:
        return
    if n < pp_size:
        raise ConfigError(
            f"parallel.micro_batch_num {n} is below pipeline_parallel {pp_size}: schedule {schedule} needs at "
            f"least one micro-batch per stage in flight; set micro_batch_num >= {pp_size} (more shrinks the bubble)")
    if schedule in ("interleaved_1f1b", "zero_bubble") and schedule_style(schedule, virtual_stages) == "loop":
        rounds = max(1, n // pp_size)
        if n % rounds:
            raise ConfigError(
                f"parallel.micro_batch_num {n} does not suit schedule {schedule} with pipeline_parallel "
                f"{pp_size}: it must be a multiple of micro_batch_num // pipeline_parallel = {rounds}; "
                f"use a multiple of {pp_size}")


def stage_layer_counts(num_layers: int, num_stages: int, stage_layers: Optional[list[int]] = None) -> list[int]:
    """Layers of each stage: `stage_layers` when given (validated), else as even as possible.

    The default gives the extra layers to the earliest stages (the last stage also runs the output
    projection and the loss, usually the heaviest part of a step).
    """
    if stage_layers is None:
        if num_stages > num_layers:
            raise ConfigError(
                f"pipeline_parallel x virtual_stages = {num_stages} stages exceeds model.num_layers {num_layers}; "
                "every stage needs at least one layer: lower pipeline_parallel or virtual_stages")
        base, extra = divmod(num_layers, num_stages)
        return [base + (1 if s < extra else 0) for s in range(num_stages)]
    counts = list(stage_layers)
    if len(counts) != num_stages:
        raise ConfigError(
            f"parallel.stage_layers has {len(counts)} entries but the pipeline has pipeline_parallel x "
            f"virtual_stages = {num_stages} stages; give one layer count per stage (in stage order)")
    if any(not isinstance(c, int) or c < 0 for c in counts):
        raise ConfigError(f"parallel.stage_layers {counts} must be non-negative integers")
    if sum(counts) != num_layers:
        raise ConfigError(
            f"parallel.stage_layers {counts} sums to {sum(counts)}, not model.num_layers {num_layers}")
    empty_middle = [s for s in range(1, num_stages - 1) if counts[s] == 0]
    if empty_middle or (num_stages == 1 and num_layers == 0):
        raise ConfigError(
            f"parallel.stage_layers {counts} leaves stage(s) {empty_middle} without layers; only the first "
            "stage (embeddings) and the last (norm and output) may have 0 layers")
    return counts


def stage_indices(pp_rank: int, pp_size: int, virtual_stages: int = 1, style: str = "loop") -> list[int]:
    """The stages that pipeline rank `pp_rank` owns, in the order its chunks are returned."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp_size - 1}")
    if style == "v":
        if virtual_stages != 2:
            raise ConfigError(
                f"a V-shaped schedule needs exactly 2 chunks per rank, got virtual_stages {virtual_stages}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def stage_rank(stage: int, pp_size: int, num_stages: int, style: str) -> int:
    """The pipeline rank that owns `stage`."""
    if style == "v":
        return stage if stage < pp_size else num_stages - 1 - stage
    return stage % pp_size


# --- splitting the model ------------------------------------------------------------------------------


def split_model(model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                stage_layers: Optional[list[int]] = None, schedule: str = "1f1b") -> list[nn.Module]:
    """This pipeline rank's model chunks, in stage order of `stage_indices`.

    Each chunk is a shallow copy of `model` that keeps only its stage's layers (and the embeddings on
    the first stage, final norm and output on the last); the chunks share their submodules and
    parameters with `model`, which must not be used afterwards (drop it: the other stages' layers are
    freed with it). Build the whole model with the same seed on every rank for weights identical to
    one process, or split a meta-device model and call `materialize_chunks`. Each chunk carries
    `pp_stage_index`, `pp_num_stages`, `pp_style` and `pp_layers` (the original layer indices it holds).
    """
    num_layers = len(model.layers)
    counts = check_pipeline(num_layers, pp_size, virtual_stages, schedule, stage_layers)
    style = schedule_style(schedule, virtual_stages)
    num_stages = pp_size * virtual_stages
    starts = [sum(counts[:s]) for s in range(num_stages)]
    keys = list(model.layers.keys())
    tied = bool(getattr(getattr(model, "cfg", None), "tie_embeddings", False))
    chunks = []
    for stage in stage_indices(pp_rank, pp_size, virtual_stages, style):
        keep = keys[starts[stage]:starts[stage] + counts[stage]]
        chunk = _shallow_chunk(model)
        for key in keys:
            if key not in keep:
                del chunk.layers[key]
        if stage != 0:
            chunk.tok_embeddings = None
            if getattr(chunk, "pos_embeddings", None) is not None:
                chunk.pos_embeddings = None
        if stage != num_stages - 1:
            chunk.norm = None
            chunk.output = None
        chunk.pp_stage_index = stage
        chunk.pp_num_stages = num_stages
        chunk.pp_style = style
        chunk.pp_layers = [int(k) for k in keep]
        chunk.pp_tied = tied and num_stages > 1
        # A GPipe-like schedule runs several forwards before their backwards: the chunked loss recomputes its
        # logits in backward rather than hold one output-weight gradient per micro-batch in flight.
        chunk.loss_gradients_in_forward = False
        chunks.append(chunk)
    by_stage = {c.pp_stage_index: c for c in chunks}
    if tied and num_stages > 1 and 0 in by_stage and num_stages - 1 in by_stage:
        # A V rank holds both stages: the last one gets its own copy of the tied matrix, as on
        # another rank, so that each chunk can be wrapped (FSDP2) on its own; the copies are kept
        # equal by summing their gradients.
        last = by_stage[num_stages - 1]
        last.output.weight = nn.Parameter(last.output.weight.detach().clone())
    return chunks


def materialize_chunks(chunks: list[nn.Module], device: torch.device | str, dtype: torch.dtype) -> list[nn.Module]:
    """Allocate and initialise the chunks of a meta-device model split by `split_model`.

    Each chunk is initialised from the global RNG in stage order, so the weights differ from a whole
    model built with the same seed (for identical weights build the whole model and split it); the
    last stage's copy of a tied matrix gets the first stage's values in `build_schedule`.
    """
    for chunk in chunks:
        materialize(chunk, device, dtype)
    return chunks


def _shallow_chunk(model: nn.Module) -> nn.Module:
    """A copy of `model` and of its `layers` container that shares every other module and tensor."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        if m is not model and m is not model.layers:
            memo[id(m)] = m
    for t in list(model.parameters()) + list(model.buffers()):
        memo[id(t)] = t
    return copy.deepcopy(model, memo)


def named_parameters(chunks: Iterable[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) over all chunks of a rank with the whole model's names, each parameter once."""
    seen: set[int] = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


# --- the schedule -------------------------------------------------------------------------------------


class _StepLoss:
    """The schedule's loss: a micro-batch's token-loss sum over the step's global target-token count
    (`global_tokens`, set by `pipeline_step` before each schedule step). The sum is `loss_sum(logits,
    labels)`, or, with the chunked loss (`in_stage`, also set by `pipeline_step`), the last stage's
    own output: its forward got the labels and returned the sum without ever holding the logits.
    With a `row_loss` (set by `pipeline_step` for the step), that function of the last stage's output
    (its rows' token-loss sums, or the logits) and the target makes the micro-batch's sum instead."""

    def __init__(self, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_sum = loss_sum
        self.global_tokens: Any = 1.0
        self.in_stage = False
        self.row_loss: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.row_loss is not None:
            return self.row_loss(output, target) / self.global_tokens
        return (output if self.in_stage else self.loss_sum(output, target)) / self.global_tokens


class _Stage(PipelineStage):
    """torch's PipelineStage, reporting each weight pass: a zero-bubble schedule's weight pass adds the
    micro-batch's weight gradients to `.grad` by hand, past autograd's post-accumulate hooks (which
    move 16-bit gradients into fp32 masters), so `on_weight_grads` does that job there. It also
    steps around three limits of torch 2.11 that 2.13 lifted (see the comments below)."""

    on_weight_grads: Optional[Callable[[], None]] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loss_nodes: dict[int, Any] = {}  # micro-batch -> its loss's autograd node, until its weight pass

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Optional[torch.Tensor] = None,  # noqa: D102
                           full_backward: bool = True, last_backward: bool = False) -> None:
        # The input pass of a zero-bubble schedule detaches the loss, and in torch 2.11 the autograd nodes of
        # custom Functions under it (the chunked loss, the final RMSNorm) die with it: the weight pass would
        # find them gone. Holding the loss's node until then keeps them (torch 2.13 keeps them anyway).
        if loss is not None and not full_backward:
            self._loss_nodes[bwd_chunk_id] = loss.grad_fn
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                   last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:  # noqa: D102
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._loss_nodes.pop(bwd_chunk_id, None)
        if self.on_weight_grads is not None:
            self.on_weight_grads()

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # torch 2.11 warms up every neighbour link with a send and a receive, also to a neighbour on
        # this rank (the middle of a V), which gloo cannot do; activations between stages of one rank
        # never travel by point to point, so those links need no warm-up (torch 2.13 skips them).
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,  # noqa: D102
                                   last_backward: bool = False) -> tuple:
        # The stage inputs include the keyword arguments, and an int among them (loss_chunk_tokens) breaks
        # torch 2.11's input-gradient pass (zero bubble), which takes every input for a tensor; torch 2.13
        # skips non-tensors. They get no gradient, and the gradients sent back are the leading (positional)
        # inputs', so dropping them changes nothing else.
        if "input_values" in bwd_kwargs:
            tensors = [v for v in bwd_kwargs["input_values"] if isinstance(v, torch.Tensor)]
            bwd_kwargs = {**bwd_kwargs, "input_values": tensors}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # The stage learns its shapes by running a micro-batch forward (the first step's, or an uninitialised
        # one on a later stage) outside the schedule. Its routing must not count in the experts' load, which
        # moves the routers' correction bias (model.moe_bias_update_rate): the counters are put back.
        with routing_uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)


def _own_grad(param: torch.Tensor) -> torch.Tensor:
    return param


@dataclass
class Pipeline:
    """A built schedule and what a step needs to know about this rank's part of the pipeline."""

    schedule: Any  # torch.distributed.pipelining schedule
    stages: list  # PipelineStage, one per chunk
    chunks: list[nn.Module]
    group: Any  # the pipeline process group
    pp_rank: int
    pp_size: int
    num_stages: int
    micro_batch_num: int
    schedule_name: str
    first_rank: int  # pipeline rank holding stage 0
    last_rank: int  # pipeline rank holding the last stage
    device: torch.device
    step_loss: _StepLoss  # the schedule's loss function; .loss_sum(logits, labels) sums token losses
    has_first: bool = False
    has_last: bool = False
    tied: bool = False  # the first and last stage hold copies of one tied embedding matrix
    step_kwargs: dict = field(default_factory=dict)  # extra arguments of schedule.step this torch accepts
    batch_shape: Optional[tuple] = None  # the input shape the stages were set up for
    p2p_ready: bool = False  # a collective has involved every rank of the group (pipeline_eval_batches)
    # Where a parameter's gradient accumulates (at precision O2 without FSDP: its fp32 master), and
    # what moves gradients there after a hand-written weight pass; set by the trainer.
    grad_holder: Callable[[torch.Tensor], torch.Tensor] = _own_grad
    on_weight_grads: Optional[Callable[[], None]] = None

    def rebuild(self) -> None:
        """(Re)create the PipelineStages and the schedule. The stages learn the activation shapes from
        the first step and keep them, so `pipeline_step` calls this when the batch shape changes."""
        self.stages = [_Stage(c, c.pp_stage_index, self.num_stages, self.device, group=self.group)
                       for c in self.chunks]
        for stage in self.stages:
            stage.on_weight_grads = self.on_weight_grads
        cls = schedule_class(self.schedule_name, self.num_stages // self.pp_size)
        single = len(self.stages) == 1 and self.schedule_name in ("gpipe", "1f1b")
        # scale_grads=False: the loss already carries the step's normalisation, micro-batch count included.
        self.schedule = cls(self.stages[0] if single else self.stages, n_microbatches=self.micro_batch_num,
                            loss_fn=self.step_loss, scale_grads=False)
        accepts = inspect.signature(self.schedule.step).parameters
        self.step_kwargs = {"return_outputs": False} if "return_outputs" in accepts else {}
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.batch_shape = None

    def norm_exclusions(self) -> list[nn.Parameter]:
        """Parameters whose gradient is already counted in the global norm (the last stage's copy of a
        tied embedding matrix); read at call time, so wrappers that replace parameters (FSDP2) are seen."""
        _, last = self._tied_params()
        return [last] if last is not None else []

    def _tied_params(self) -> tuple[Optional[nn.Parameter], Optional[nn.Parameter]]:
        """This rank's copies of a tied embedding matrix: (first stage's, last stage's), None where
        the rank does not hold the stage or the model does not tie."""
        if not self.tied:
            return None, None
        first = next((c.tok_embeddings.weight for c in self.chunks if c.pp_stage_index == 0), None)
        last = next((c.output.weight for c in self.chunks if c.pp_stage_index == self.num_stages - 1), None)
        return first, last

    def _combine(self, first: Optional[torch.Tensor], last: Optional[torch.Tensor], add: bool) -> None:
        """Make both copies `first + last` (add) or `first` (not add), locally or with the peer rank."""
        first, last = (local_tensor(t) if t is not None else None for t in (first, last))
        if first is not None and last is not None:  # both stages on this rank (V schedule)
            if add:
                first.add_(last)
            last.copy_(first)
            return
        mine = first if first is not None else last
        if mine is None or self.pp_size == 1:
            return
        peer = dist.get_global_rank(self.group, self.last_rank if first is not None else self.first_rank)
        other = torch.empty_like(mine)
        ops = [dist.P2POp(dist.isend, mine.contiguous(), peer, self.group),
               dist.P2POp(dist.irecv, other, peer, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if add:
            mine.add_(other)  # a + b on one rank, b + a on the other: the same bits
        elif last is not None:
            mine.copy_(other)

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Give the last stage's copy of a tied embedding matrix the first stage's values."""
        first, last = self._tied_params()
        self._combine(first, last, add=False)

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Give both copies of a tied matrix the sum of their gradients (after backward)."""
        holders = [self.grad_holder(p) if p is not None else None for p in self._tied_params()]
        for h in holders:
            if h is not None and h.grad is None:
                h.grad = torch.zeros_like(h)
        self._combine(*(h.grad if h is not None else None for h in holders), add=True)


def build_schedule(chunks: list[nn.Module], pp_mesh: Any, device: torch.device | str, micro_batch_num: int,
                   schedule_name: str,
                   loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                   grad_holder: Callable[[torch.Tensor], torch.Tensor] = _own_grad,
                   on_weight_grads: Optional[Callable[[], None]] = None) -> Pipeline:
    """Wrap this rank's (parallelised) chunks in PipelineStages and build the schedule.

    `pp_mesh` is the 1-D "pp" DeviceMesh (or a ProcessGroup). `loss_fn(logits, labels)` returns the
    SUM of token losses of a micro-batch (default: `token_loss_sum`); the schedule divides it by the
    step's global target-token count that `pipeline_step` passes. `grad_holder(param)`: the tensor
    whose `.grad` accumulates `param`'s gradient (its fp32 master at precision O2), and
    `on_weight_grads()`: called after each zero-bubble weight pass (see `_Stage`).
    """
    if not chunks:
        raise ValueError("build_schedule needs this rank's model chunks (from split_model)")
    group = pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    num_stages = chunks[0].pp_num_stages
    virtual_stages = num_stages // pp_size
    style = schedule_style(schedule_name, virtual_stages)
    if num_stages != pp_size * len(chunks):
        raise ConfigError(
            f"the chunks were split for {num_stages} stages but {pp_size} ranks x {len(chunks)} chunks "
            f"= {pp_size * len(chunks)}; split_model and build_schedule need the same layout")
    expected = stage_indices(pp_rank, pp_size, virtual_stages, style)
    got = [c.pp_stage_index for c in chunks]
    if got != expected or any(c.pp_style != style for c in chunks):
        raise ConfigError(
            f"pipeline rank {pp_rank} holds stages {got} but schedule {schedule_name} with virtual_stages "
            f"{virtual_stages} expects {expected}; pass the same schedule to split_model and build_schedule")
    _check_micro_batches(micro_batch_num, pp_size, num_stages, schedule_name, virtual_stages)
    step_loss = _StepLoss(loss_fn or token_loss_sum)
    pipe = Pipeline(
        schedule=None, stages=[], chunks=list(chunks), group=group, pp_rank=pp_rank, pp_size=pp_size,
        num_stages=num_stages, micro_batch_num=micro_batch_num, schedule_name=schedule_name,
        first_rank=stage_rank(0, pp_size, num_stages, style),
        last_rank=stage_rank(num_stages - 1, pp_size, num_stages, style), device=torch.device(device),
        step_loss=step_loss, tied=any(getattr(c, "pp_tied", False) for c in chunks), grad_holder=grad_holder,
        on_weight_grads=on_weight_grads)
    pipe.rebuild()
    pipe.sync_tied_weights()
    return pipe


def _extras(position_ids: Optional[torch.Tensor], document_ids: Optional[torch.Tensor],
            attention_mask: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    given = {"position_ids": position_ids, "document_ids": document_ids, "attention_mask": attention_mask}
    return {k: v for k, v in given.items() if v is not None}


def _check_batch(pipe: Pipeline, input_ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> None:
    rows = input_ids.shape[0]
    if rows % pipe.micro_batch_num:
        raise ConfigError(
            f"a pipeline step needs a batch divisible into micro_batch_num {pipe.micro_batch_num} micro-batches, "
            f"got {rows} samples; make the samples per step a multiple of micro_batch_num")
    for name, t in extras.items():
        if t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows but input_ids has {rows}; give one row per sample")


def _broadcast_loss(pipe: Pipeline, local: Optional[torch.Tensor]) -> torch.Tensor:
    value = local.detach().float().reshape(()) if local is not None else torch.zeros((), device=pipe.device)
    return broadcast_from_last(pipe, value)


def broadcast_from_last(pipe: Pipeline, value: torch.Tensor) -> torch.Tensor:
    """The last stage's `value` on every pipeline rank (the others pass a tensor of its shape and dtype)."""
    value = value.to(pipe.device).clone()
    if pipe.pp_size > 1:
        broadcast_(value, dist.get_global_rank(pipe.group, pipe.last_rank), pipe.group)
    return value


def concat_micro_batches(micro_batches: list[dict[str, torch.Tensor]],
                         pad_to: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Micro-batches as the one batch a pipeline step takes (the schedule splits it into them again).
    `pad_to` (rows of tokens and labels alone: preference pairs): every row padded on the right to that
    width, the tokens with 0, the labels with IGNORE_INDEX, so that every step has one shape (causal
    attention keeps the padding out of the earlier tokens)."""
    if pad_to is not None:
        micro_batches = [{**mb, "input_ids": _pad_right(mb["input_ids"], pad_to, 0),
                          "labels": _pad_right(mb["labels"], pad_to, IGNORE_INDEX)} for mb in micro_batches]
    shapes = sorted({tuple(mb["input_ids"].shape) for mb in micro_batches})
    if len(shapes) > 1:
        raise ConfigError(
            f"pipeline parallelism runs the micro-batches of a step as one batch of one shape, but this step's "
            f"micro-batches have shapes {shapes}; use data of fixed-size samples (data.packing pack or pad)"
        )
    return {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}


def _pad_right(rows: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return F.pad(rows, (0, width - rows.shape[1]), value=value) if rows.shape[1] < width else rows


def pipeline_step(pipe: Pipeline, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, global_tokens: Any = None,
                  finish_step: bool = True, loss_chunk_tokens: Optional[int] = None,
                  row_loss: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                  target: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward and backward of one step's batch ([micro_batch_num x micro-batch rows, T]) through the
    pipeline, accumulating gradients; return the step's loss on every pipeline rank.

    Call it on every rank of the pipeline with the same batch (only the first stage reads
    `input_ids`, only the last `labels`; the position/document ids reach every stage).
    `global_tokens` is the number of target tokens of the whole optimizer step over all data-parallel
    ranks (an int or a tensor); by default this batch's count, right without data parallelism or
    accumulation. The returned loss is sum(token losses of this batch) / global_tokens.
    To accumulate several pipeline steps into one optimizer step, pass `finish_step=False` to all but
    the last (the tied-embedding gradients are exchanged once, after the last).
    `loss_chunk_tokens`: the chunked loss (`shardwise.loss.chunked_token_loss_sum`): the labels go to
    the stages' forward with the other per-sample inputs, and the last stage returns the token-loss
    sum itself instead of logits. None: the last stage's logits go to the schedule's loss function.
    `row_loss(output, target)` (preference tuning): the micro-batch's loss sum from its rows' token-loss
    sums (with `loss_chunk_tokens`: the last stage returns them, `loss_per_row`) or from its logits, and
    its slice of `target` (rows first, as the batch; default `labels`); `global_tokens` then counts what
    that loss sums over.
    """
    extras = _extras(position_ids, document_ids, attention_mask)
    _check_batch(pipe, input_ids, extras)
    device = pipe.device
    labels = labels.to(device)
    if global_tokens is None:
        global_tokens = int((labels != IGNORE_INDEX).sum())
    extras = {k: v.to(device) for k, v in extras.items()}
    if loss_chunk_tokens is not None:  # split into micro-batches like the inputs; stages without the head ignore it
        extras.update(labels=labels, loss_chunk_tokens=loss_chunk_tokens)
        if row_loss is not None:
            extras.update(loss_per_row=True)
    args = (input_ids.to(device),) if pipe.has_first else ()
    shape = (tuple(input_ids.shape), tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                                           for k, v in sorted(extras.items())))
    if pipe.batch_shape is not None and shape != pipe.batch_shape:
        pipe.rebuild()  # new shapes: the next step infers them again (one extra forward and backward)
    pipe.batch_shape = shape
    losses: list[torch.Tensor] = []
    pipe.step_loss.global_tokens = global_tokens
    pipe.step_loss.in_stage = loss_chunk_tokens is not None
    pipe.step_loss.row_loss = row_loss
    target = (labels if target is None else target.to(device)) if pipe.has_last else None
    pipe.schedule.step(*args, target=target, losses=losses if pipe.has_last else None,
                       **pipe.step_kwargs, **extras)
    if finish_step:
        pipe.sync_tied_grads()
    local = torch.stack([loss.detach() for loss in losses]).sum() if losses else None
    return _broadcast_loss(pipe, local)


# --- evaluation: forward only, the stages overlapping ------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # an activation header: dtype index, number of dimensions, up to 6 sizes


def stage_segments(pipe: Pipeline) -> list[tuple[int, int]]:
    """The pipeline's stages as segments, in stage order: (first, last) runs of consecutive stages
    that one rank owns (under a V schedule the rank holding the middle two runs them as one)."""
    owner = [stage_rank(s, pipe.pp_size, pipe.num_stages, pipe.chunks[0].pp_style) for s in range(pipe.num_stages)]
    segments = [(0, 0)]
    for s in range(1, pipe.num_stages):
        first, _ = segments[-1]
        segments[-1:] = [(first, s)] if owner[s] == owner[first] else [(first, s - 1), (s, s)]
    return segments


def _header(t: torch.Tensor) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.long)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2:2 + t.dim()] = torch.tensor(t.shape)
    return header.to(t.device)


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    kind, ndim, *sizes = header.tolist()
    return torch.empty(sizes[:ndim], dtype=_DTYPES[kind], device=device)


@torch.no_grad()
def pipeline_eval_batches(pipe: Pipeline, batches: list[dict[str, torch.Tensor]],
                          loss_chunk_tokens: Optional[int] = None, per_row: bool = False) -> torch.Tensor:
    """Forward only over the micro-batches `batches` ({"input_ids", "labels"} and any of position_ids,
    document_ids, attention_mask; shapes may differ between them): each one's SUM of token losses,
    float32 [len(batches)], on every pipeline rank. With `loss_chunk_tokens` the last stage computes
    the sums chunk by chunk (see `pipeline_step`). Call it on every pipeline rank with the same batches.
    `per_row`: each row's sum instead, the batches' rows one after another (float32 [rows]).

    A GPipe fill in lock-step ticks over the pipeline's segments (`stage_segments`): at tick t,
    segment j runs micro-batch t - j, so stage s works on micro-batch m while the next works on m - 1,
    and then every rank exchanges its outputs with its neighbours (`collectives.exchange`: the
    non-blocking sends and receives of a tick posted together; a shape header first). It needs no
    shape inference and suits every placement (looped, interleaved, V), unlike torch's
    `schedule.eval`, which fails on V schedules (ZBV) in torch 2.13 and would re-run the schedule's
    shape inference when switched between evaluation and training. Only one activation per segment
    boundary is in flight at a time, so memory does not grow with the number of batches.
    """
    device, group, n = pipe.device, pipe.group, len(batches)
    style = pipe.chunks[0].pp_style
    by_stage = {c.pp_stage_index: c for c in pipe.chunks}
    segments = stage_segments(pipe)
    owner = [stage_rank(first, pipe.pp_size, pipe.num_stages, style) for first, _ in segments]
    mine = [j for j in range(len(segments)) if owner[j] == pipe.pp_rank]
    peer = [dist.get_global_rank(group, r) if pipe.pp_size > 1 else 0 for r in owner]
    sums: list[Optional[torch.Tensor]] = [None] * n
    inbox: dict[int, torch.Tensor] = {}  # segment -> its input for this tick
    if not pipe.p2p_ready and pipe.pp_size > 1:
        # NCCL: the first batched send/receive on a group must involve all its ranks; a broadcast
        # involves them first.
        broadcast_(torch.zeros(1, device=device), dist.get_global_rank(group, 0), group)
        pipe.p2p_ready = True
    was_training = [c.training for c in pipe.chunks]
    for c in pipe.chunks:
        c.eval()
    try:
        for tick in range(n + len(segments) - 1):
            outbox = []  # (segment, its output), in segment order
            for j in mine:
                m = tick - j
                if 0 <= m < n:
                    out = _run_segment(pipe, by_stage, segments[j], batches[m], inbox.pop(j, None), device,
                                       loss_chunk_tokens, per_row)
                    if j == len(segments) - 1:
                        sums[m] = out.detach().float().reshape(-1 if per_row else ())
                    else:
                        outbox.append((j, out))
            # Neighbouring segments have different owners: every output goes to another rank, and
            # segment k + 1 of this rank receives, for the next tick, micro-batch tick - k from segment k.
            sends = [(h, peer[j + 1]) for j, h in outbox]
            coming = [k + 1 for k in range(len(segments) - 1) if owner[k + 1] == pipe.pp_rank and 0 <= tick - k < n]
            headers = {k: torch.zeros(_HEADER, dtype=torch.long, device=device) for k in coming}
            exchange([(_header(h), dst) for h, dst in sends], [(headers[k], peer[k - 1]) for k in coming], group)
            inbox = {k: _empty_from(headers[k], device) for k in coming}
            exchange(sends, [(inbox[k], peer[k - 1]) for k in coming], group)
    finally:
        for c, mode in zip(pipe.chunks, was_training):
            c.train(mode)
    if pipe.has_last:
        local = torch.cat(sums) if per_row else torch.stack(sums)
    else:
        local = torch.zeros(sum(b["input_ids"].shape[0] for b in batches) if per_row else n, device=device)
    return broadcast_from_last(pipe, local)


def _run_segment(pipe: Pipeline, by_stage: dict[int, nn.Module], segment: tuple[int, int],
                 batch: dict[str, torch.Tensor], h: Optional[torch.Tensor], device: torch.device,
                 loss_chunk_tokens: Optional[int], per_row: bool = False) -> torch.Tensor:
    """One micro-batch through a segment's stages: its output activation, or at the end of the
    pipeline the micro-batch's token-loss sum (`per_row`: its rows'). `h`: the segment's input (None at
    stage 0)."""
    extras = {k: batch[k].to(device) for k in _MODEL_EXTRAS if k in batch}
    first, last = segment
    if first == 0:
        h = batch["input_ids"].to(device)
    for s in range(first, last + 1):
        if s < pipe.num_stages - 1:
            h = by_stage[s](h, **extras)
        elif loss_chunk_tokens is not None:
            return by_stage[s](h, labels=batch["labels"].to(device), loss_chunk_tokens=loss_chunk_tokens,
                               loss_per_row=per_row, **extras)
        elif per_row:
            return row_token_loss_sums(by_stage[s](h, **extras), batch["labels"].to(device))
        else:
            return pipe.step_loss.loss_sum(by_stage[s](h, **extras), batch["labels"].to(device))
    return h


def pipeline_row_losses(pipe: Pipeline, batch: dict[str, torch.Tensor],
                        loss_chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Forward only: each row's token-loss sum of `batch` (any number of rows) [rows], float32, on every
    pipeline rank, the batch split into up to `micro_batch_num` micro-batches (as `pipeline_eval`)."""
    return pipeline_eval_batches(pipe, _eval_pieces(pipe, batch), loss_chunk_tokens, per_row=True)


def _eval_pieces(pipe: Pipeline, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """`batch`'s model inputs and labels split by rows into up to `micro_batch_num` micro-batches."""
    keys = ("input_ids", "labels", *_MODEL_EXTRAS)
    given = {k: batch[k] for k in keys if batch.get(k) is not None}
    pieces = max(1, min(batch["input_ids"].shape[0], pipe.micro_batch_num))
    split = {k: torch.tensor_split(v, pieces) for k, v in given.items()}
    return [{k: parts[i] for k, parts in split.items()} for i in range(pieces)]


def pipeline_eval(pipe: Pipeline, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None,
                  loss_chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Forward only: the SUM of token losses of the batch (any number of rows), on every pipeline rank.

    The batch is split into up to `micro_batch_num` micro-batches of rows that go through
    `pipeline_eval_batches`, the stages overlapping. Call it on every pipeline rank with the same batch.
    """
    given = {"input_ids": input_ids, "labels": labels, **_extras(position_ids, document_ids, attention_mask)}
    return pipeline_eval_batches(pipe, _eval_pieces(pipe, given), loss_chunk_tokens).sum()
