"""Preference tuning's part of a run: each micro-batch's pair losses, the reference model, the step's
figures and held-out evaluation.

A preference batch holds B pairs as 2B rows (data/preference.py). `PreferenceTuning.micro_loss` runs the
policy on them, takes each row's answer log-probability (`forward_logps`), gets the reference's (below)
and returns the sum of the pairs' losses (`preference.pair_losses`); the trainer divides by the step's
pairs over all data-parallel ranks (`pairs`), so every layout gives one process's loss.

Each row's log-probability comes, with the chunked loss (optimize.chunked_loss, the default), from the
model's forward itself (`loss_per_row`): chunk by chunk, never the whole [rows, T, vocab] logits, and
under context parallelism summed over the ranks that hold the row's parts, each keeping its own part's
gradient. Without it, from the whole logits (`preference.row_logps`).

Under pipeline parallelism (`pipeline_step`) the schedule's loss function on the last stage makes each
micro-batch's pair losses from its rows' sums; the reference's log-probabilities reach it inside the
schedule's target (`_with_reference`), and the step's figures are sent from the last stage to every
pipeline rank (`take_figures`). The reference there is precomputed, or the pipeline run forward only
before each step (`pipeline.pipeline_row_losses`): with LoRA's adapters off, or on the frozen copy's
chunks. The stages keep one activation shape, so every row is padded to data.seq_length there
(`width`, `pipeline.concat_micro_batches`: the padding carries no label, and causal attention keeps it
out of the answers).

The reference model is the run's starting weights (`RunConfig.reference_mode`):
- `precompute`: before the first step the model, untouched yet, computes every pair's log-probabilities
  once (`precompute_reference`, the data-parallel ranks sharing the pairs), kept in the run directory
  for a resume (`reference_logps.npz`) and carried by the batches: no second model in memory;
- `adapters_off`: with LoRA, the same model with its adapters switched off (`peft.lora.adapters_off`),
  forward only, in every micro-batch: no second model either;
- `frozen_copy`: a frozen copy of the starting model in the run's layout (its parts sharded, split and
  hooked as the policy's: `keep_frozen_parts`), holding the starting weights (`copy_starting_weights`, also
  before a resume's checkpoint replaces the policy's), forward only.

A step's figures (summed over its micro-batches, then over the data-parallel ranks by the trainer) are
[loss sum, reward margin sum, pairs ranked right, chosen reward sum, rejected reward sum, pairs]; the step
record shows their means (`figures_record`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ..config import RunConfig
from ..errors import TrainingError
from ..files import write_bytes_atomic
from ..models.moe import routing_uncounted
from ..parallel.collectives import all_reduce
from ..parallel.pipeline import broadcast_from_last, pipeline_row_losses, pipeline_step
from ..peft.lora import adapters_off
from ..preference import PreferenceObjective, answer_tokens, pair_losses, row_logps
from .evaluation import model_inputs

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.npz"
FIGURES = ("loss", "reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected")


class PreferenceTuning:
    """The objective, the reference and the figures of a preference-tuning run."""

    def __init__(self, cfg: RunConfig) -> None:
        """From the config's `preference` section and data (data.kind must be preference)."""
        p = cfg.preference
        self.objective = PreferenceObjective(p.loss, p.beta, p.label_smoothing, p.simpo_gamma, p.orpo_lambda)
        self.mode = cfg.reference_mode()
        self.chunk = cfg.optimize.loss_chunk()  # None: the whole logits
        self.width = cfg.data.seq_length or cfg.model.max_position_embeddings  # the rows' width under a pipeline
        self.frozen: Optional[list[nn.Module]] = None  # frozen_copy: the reference's parts
        self._figures: Optional[torch.Tensor] = None

    # --- the reference --------------------------------------------------------------------------

    def keep_frozen_parts(self, parts: list[nn.Module]) -> None:
        """reference frozen_copy: the reference's `parts` (built and parallelised as the policy's), frozen,
        for forward passes only; their weights come from `copy_starting_weights`."""
        self.frozen = parts
        for part in parts:
            part.eval()
            for p in part.parameters():
                p.requires_grad_(False)

    @torch.no_grad()
    def copy_starting_weights(self, policy: list[nn.Module]) -> None:
        """The frozen parts take the `policy` parts' weights and buffers as they are now (the starting ones)."""
        assert self.frozen is not None, "keep_frozen_parts was not called"
        for mine, theirs in zip(self.frozen, policy):
            for (name, a), (other, b) in zip([*mine.named_parameters(), *mine.named_buffers()],
                                             [*theirs.named_parameters(), *theirs.named_buffers()]):
                assert name == other, (name, other)
                a.copy_(b)

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, mb: dict[str, torch.Tensor], ids: torch.Tensor,
                        labels: torch.Tensor, device: torch.device, pipeline: Any = None) -> Optional[torch.Tensor]:
        """The reference's log-probability of each row's answer [2B], or None (simpo, orpo); with a
        `pipeline`, through its stages (every pipeline rank gets them)."""
        if self.mode is None:
            return None
        if self.mode == "precompute":
            if "reference_logps" not in mb:
                raise TrainingError("the batch carries no reference log-probabilities: they were not precomputed")
            return mb["reference_logps"].to(device, non_blocking=True)
        if self.mode == "adapters_off":  # the policy's modules: their routing is not the step's expert load
            parts = pipeline.chunks if pipeline is not None else [model]
            with adapters_off(*parts), routing_uncounted(*parts):
                return self.logps(model, mb, ids, labels, device, pipeline)
        assert self.frozen is not None, "keep_frozen_parts was not called"
        if pipeline is not None:  # the frozen chunks in the pipeline's places
            return self.logps(None, mb, ids, labels, device, dataclasses.replace(pipeline, chunks=self.frozen))
        return forward_logps(self.frozen[0], mb, ids, labels, device, self.chunk)

    def logps(self, model: nn.Module, mb: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor,
              device: torch.device, pipeline: Any = None) -> torch.Tensor:
        """Each row's answer log-probability under `model` (`forward_logps`), or with a `pipeline` its
        stages, forward only (every pipeline rank gets them)."""
        if pipeline is None:
            return forward_logps(model, mb, ids, labels, device, self.chunk)
        return -pipeline_row_losses(pipeline, {**mb, "input_ids": ids, "labels": labels}, self.chunk)

    @torch.no_grad()
    def precompute_reference(self, model: nn.Module, dataset: Any, *, batch_size: int, device: torch.device,
                             plan: Any, dp_mesh: Any = None, pipeline: Any = None) -> np.ndarray:
        """Every pair's (chosen, rejected) answer log-probability under `model` as it is (through the
        `pipeline`'s stages when given): [pairs, 2], float64; the data-parallel ranks share the pairs and every
        rank gets all of them."""
        out = torch.zeros(2 * len(dataset), dtype=torch.float64, device=device)
        for pairs, counted, mb, ids, labels in _batches_in_eval_mode(model, dataset, batch_size, None, device,
                                                                     dp_mesh):
            with plan.autocast(device.type):
                logps = self.logps(model, mb, ids, labels, device, pipeline)
            if counted:
                rows = torch.from_numpy(np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)).to(device)
                out[rows] = logps.double()
        if dp_mesh is not None and dp_mesh.size() > 1:
            out = all_reduce(out, dp_mesh)
        return out.cpu().numpy().reshape(-1, 2)

    # --- a step ---------------------------------------------------------------------------------

    @staticmethod
    def pairs(micro_batches: list[dict[str, torch.Tensor]], dp: int) -> int:
        """The step's pairs over all data-parallel ranks (each rank reads as many)."""
        return dp * sum(int(mb["input_ids"].shape[0]) // 2 for mb in micro_batches)

    def micro_loss(self, model: nn.Module, mb: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor,
                   device: torch.device) -> torch.Tensor:
        """The sum of the micro-batch's pair losses (its figures added to the step's). The reference's forward
        (no gradient) runs first, so its logits are gone before the policy's activations build up."""
        reference = self.reference_logps(model, mb, ids, labels, device)
        policy = forward_logps(model, mb, ids, labels, device, self.chunk)
        return self._pair_loss_sum(policy, answer_tokens(labels), reference)

    def _pair_loss_sum(self, policy: torch.Tensor, counts: torch.Tensor,
                       reference: Optional[torch.Tensor]) -> torch.Tensor:
        """The pairs' loss sum from their rows' log-probabilities; their figures added to the step's."""
        losses, chosen, rejected = pair_losses(self.objective, policy, counts, reference)
        figures = _figures(losses.detach(), chosen, rejected)
        self._figures = figures if self._figures is None else self._figures + figures
        return losses.sum()

    def pipeline_step(self, pipe: Any, batch: dict[str, torch.Tensor], global_pairs: Any, finish_step: bool,
                      device: torch.device) -> torch.Tensor:
        """One pipeline step over `batch` (micro_batch_num micro-batches' rows, concatenated): the pairs'
        losses over `global_pairs`, summed, on every pipeline rank (`parallel.pipeline.pipeline_step`)."""
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        reference = self.reference_logps(None, batch, ids, labels, device, pipe)
        return pipeline_step(pipe, ids, labels, global_tokens=global_pairs, finish_step=finish_step,
                             loss_chunk_tokens=self.chunk, row_loss=self._schedule_loss,
                             target=_with_reference(labels, reference), **model_inputs(batch, device))

    def _schedule_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The pipeline schedule's loss of a micro-batch on the last stage: its pairs' loss sum from its
        rows' token-loss sums (chunked loss) or logits, and its target (`_with_reference`)."""
        labels, reference = (target[:, :-1], target[:, -1].contiguous().view(torch.float64)
                             ) if self.mode is not None else (target, None)
        policy = -output.float() if self.chunk is not None else row_logps(output, labels)[0]
        return self._pair_loss_sum(policy, answer_tokens(labels), reference)

    def take_figures(self, pipe: Any = None) -> torch.Tensor:
        """The step's figures so far (float64, on the device), and a fresh start for the next step; under
        pipeline parallelism the last stage's, on every pipeline rank."""
        figures, self._figures = self._figures, None
        if pipe is not None:
            return broadcast_from_last(pipe, figures if pipe.has_last else
                                       torch.zeros(len(FIGURES) + 1, dtype=torch.float64, device=pipe.device))
        assert figures is not None, "no micro-batch ran this step"
        return figures

    # --- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dataset: Any, *, batch_size: int, limit: Optional[int],
                 device: torch.device, plan: Any, dp_mesh: Any = None, pipeline: Any = None) -> dict[str, float]:
        """Mean pair loss, reward accuracy and margin over the held-out pairs (the first `limit` batches),
        the data-parallel ranks sharing the batches (through the `pipeline`'s stages when given); every
        rank gets the same result."""
        totals = torch.zeros(len(FIGURES) + 1, dtype=torch.float64, device=device)
        for _, counted, mb, ids, labels in _batches_in_eval_mode(model, dataset, batch_size, limit, device, dp_mesh):
            with plan.autocast(device.type):
                policy = self.logps(model, mb, ids, labels, device, pipeline)
                reference = self.reference_logps(model, mb, ids, labels, device, pipeline)
            losses, chosen, rejected = pair_losses(self.objective, policy, answer_tokens(labels), reference)
            if counted:  # a padding forward only keeps the collectives in step
                totals += _figures(losses, chosen, rejected)
        if dp_mesh is not None and dp_mesh.size() > 1:
            totals = all_reduce(totals, dp_mesh)
        return {**figures_record(totals), "pairs": int(totals[-1])}


def forward_logps(model: nn.Module, mb: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor,
                  device: torch.device, chunk: Optional[int]) -> torch.Tensor:
    """Each row's answer log-probability under `model` [rows], fp32, with a gradient where autograd records:
    with `chunk` (the chunked loss's tokens per chunk) from the model's forward (`loss_per_row`), never
    the whole logits; None: from the whole logits."""
    if chunk is None:
        return row_logps(model(ids, **model_inputs(mb, device)), labels)[0]
    return -model(ids, labels=labels, loss_chunk_tokens=chunk, loss_per_row=True, **model_inputs(mb, device)).float()


def _with_reference(labels: torch.Tensor, reference: Optional[torch.Tensor]) -> torch.Tensor:
    """The schedule's target under pipeline parallelism: the labels [R, T] and, when there is a reference,
    its log-probabilities' float64 bits as one more column [R, T + 1] (the schedule splits one tensor into
    micro-batches; `_schedule_loss` takes them apart bit for bit)."""
    if reference is None:
        return labels
    return torch.cat([labels, reference.to(labels.device, torch.float64).view(torch.int64).unsqueeze(1)], dim=1)


def _figures(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[loss sum, margin sum, right, chosen sum, rejected sum, pairs] of some pairs, float64."""
    margin = chosen - rejected
    return torch.stack([losses.sum(), margin.sum(), (margin > 0).sum(), chosen.sum(), rejected.sum(),
                        torch.tensor(float(losses.numel()), device=losses.device)]).double()


def figures_record(figures: torch.Tensor) -> dict[str, float]:
    """The means of summed figures: loss, reward_margin, reward_accuracy, reward_chosen, reward_rejected."""
    values = figures.tolist()
    pairs = max(values[-1], 1.0)
    return {name: round(v / pairs, 6) for name, v in zip(FIGURES, values)}


def _shared_batches(pairs: int, batch_size: int, limit: Optional[int], dp_mesh: Any = None):  # noqa: ANN202
    """(pair indices, counted) of data-parallel rank r's batches: r, r + dp, ..., then uncounted padding up
    to the number every rank runs (a forward under ZeRO-3 gathers parameters collectively)."""
    rank, world = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    batches = -(-pairs // batch_size)
    if limit is not None:
        batches = min(batches, limit)
    for j in range(-(-batches // world)):
        k = rank + j * world
        if k < batches:
            yield np.arange(k * batch_size, min((k + 1) * batch_size, pairs)), True
        else:
            yield np.arange(min(batch_size, pairs)), False


def _batches_in_eval_mode(model: nn.Module, dataset: Any, batch_size: int, limit: Optional[int],
                          device: torch.device, dp_mesh: Any):  # noqa: ANN202
    """(pair indices, counted, batch, input ids, labels) of this rank's share of the batches
    (`_shared_batches`), with `model` in eval mode until the last one is done."""
    was_training = model.training
    model.eval()
    try:
        for pairs, counted in _shared_batches(len(dataset), batch_size, limit, dp_mesh):
            mb = dataset.get_batch(pairs)
            ids, labels = (mb[k].to(device, non_blocking=True) for k in ("input_ids", "labels"))
            yield pairs, counted, mb, ids, labels
    finally:
        model.train(was_training)


def save_reference(run_dir: Path, train: np.ndarray, held_out: Optional[np.ndarray]) -> None:
    """The precomputed log-probabilities beside the checkpoints (npz, no pickles), for a resume."""
    buffer = io.BytesIO()
    arrays = {"train": train, **({"eval": held_out} if held_out is not None else {})}
    np.savez(buffer, **arrays)
    write_bytes_atomic(run_dir / REFERENCE_FILE, buffer.getvalue())


def load_reference(run_dir: Path) -> dict[str, np.ndarray]:
    """What `save_reference` wrote; TrainingError when it is missing or damaged."""
    path = run_dir / REFERENCE_FILE
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: np.asarray(z[k], dtype=np.float64) for k in z.files}
    except (OSError, ValueError, KeyError) as e:
        raise TrainingError(
            f"{path} cannot be read ({e}): a preference run resumed with a precomputed reference needs the "
            "log-probabilities its first start computed from the starting weights; start the run afresh"
        ) from e


__all__ = ["FIGURES", "REFERENCE_FILE", "PreferenceTuning", "figures_record", "load_reference",
           "save_reference"]
