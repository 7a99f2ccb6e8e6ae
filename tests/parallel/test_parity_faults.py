"""The parity tests bite (issue 11): realistic faults injected into the runs of test_trainer_parity.py
make its strict checks fail, on one layout of each mechanism of the matrix (`FAULT_LAYOUTS`) where the fault
makes sense.

The faults, each installed in the workers around one Trainer run:
(a) halved_gradient: one tensor's gradient is halved before the optimizer uses it (a tensor whose
    largest first-step gradient is ~1e-4: attention q, its LoRA B under LoRA);
(b) normaliser_twice: the loss divides each micro-batch's token-loss sum by its own target count
    before the trainer divides by the step's global count (cross-entropy's mean, then the global
    normalisation: the classic double normalisation);
(c) dropped_replica_gradient: data-parallel rank 1 contributes no gradient (its loss keeps its value
    but is cut from the graph, as if its backward or its share of the reduction were lost);
(d) missed_tp_partial_sum: the first row-parallel projection of every TP group returns its own
    partial sum instead of the sum over the TP ranks (a forgotten all-reduce / reduce-scatter).
The same checks that test_trainer_parity.py runs (`parity_failures`) must fail, and this file
records which of them do (the first-step gradients, the parameters after SGD, the losses, the
gradient norms).

It also shows what the checks these tests used before issue 11 missed: fault (a) passes both the
old layout check (first-step gradients and losses within an absolute 1e-4, `old_records_check`)
and the old trainer check (AdamW losses within an absolute 1e-4), and fails the strict ones.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import RowwiseParallel

import shardwise.train.trainer as trainer_module
from shardwise.loss import IGNORE_INDEX
from shardwise.parallel.data_parallel import apply_data_parallel, clip_grad_norm, shard_optimizer
from shardwise.parallel.dims import ParallelDims
from shardwise.train.trainer import Trainer

from .harness import (
    LoopRecord,
    ParityError,
    assert_records_close,
    build_tiny_model,
    make_optimizer,
    make_steps,
    run_distributed,
    tiny_config,
    train_loop,
)
from .test_trainer_parity import (
    BY_NAME,
    FINETUNE,
    HALVED,
    LAYOUTS,
    Layout,
    Reference,
    layout_config,
    named_params,
    outer_optimizer_hook,
    parity_failures,
    reference,
    step_pre_hook,
    train_once,
)

Installer = Callable[[Trainer], contextlib.AbstractContextManager]


@contextlib.contextmanager
def _patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """owner.name replaced by make(original) for the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


# --- the faults: fault(layout, rank) -> an installer for this rank's run, or None ------------------------

def halved_gradient(layout: Layout, rank: int) -> Optional[Installer]:
    """(a) One tensor's gradient halved, on every rank that holds it, right before each optimizer step."""
    target = HALVED[layout.finetune]

    def install(trainer: Trainer) -> contextlib.AbstractContextManager:
        def halve(_optimizer: torch.optim.Optimizer) -> None:
            masters = trainer.state.masters  # what the optimizer steps (host masters under offload_optimizer)
            for name, p in named_params(trainer.model_parts):
                stepped = masters.master_of(p) if masters is not None else p
                if name == target and stepped.grad is not None:
                    stepped.grad.mul_(0.5)  # a DTensor's local shard, in place

        return step_pre_hook(outer_optimizer_hook(halve))

    return install


def normaliser_twice(layout: Layout, rank: int) -> Optional[Installer]:
    """(b) The token normaliser applied twice: sum / (micro-batch targets), then / (global targets)."""
    def make(loss_sum: Callable) -> Callable:
        def mean_then_global(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return loss_sum(logits, labels) / (labels != IGNORE_INDEX).sum().clamp(min=1)

        return mean_then_global

    return lambda trainer: _patched(trainer_module, "token_loss_sum", make)


def dropped_replica_gradient(layout: Layout, rank: int) -> Optional[Installer]:
    """(c) Data-parallel rank 1 (all its TP and pipeline ranks) contributes no gradient; its loss
    value is unchanged, so the logged loss looks right."""
    if layout.dp == 1 or (rank // layout.tp) % layout.dp != 1:  # mesh (pp, dp_replicate, dp_shard, tp)
        return None

    def make(loss_sum: Callable) -> Callable:
        def no_gradient(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            value = loss_sum(logits, labels)
            return value.detach() + 0.0 * value  # same value, zero gradient; backward still runs

        return no_gradient

    return lambda trainer: _patched(trainer_module, "token_loss_sum", make)


@contextlib.contextmanager
def _skip_first_row_parallel_sum() -> Iterator[None]:
    """The first row-parallel Linear to run forward keeps its partial sum: torch's RowwiseParallel
    output hook (all-reduce, or reduce-scatter under SP) skipped for that module."""
    original = RowwiseParallel.__dict__["_prepare_output_fn"]
    target: list[nn.Module] = []

    def prepare(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor,
                device_mesh: Any) -> Any:
        if not target and isinstance(mod, nn.Linear):
            target.append(mod)
        if not target or mod is not target[0]:
            return original.__func__(output_layouts, use_local_output, mod, outputs, device_mesh)
        local = outputs.to_local()  # this rank's partial sum only
        placement = output_layouts[0]
        if isinstance(placement, Shard):  # sequence parallel: this rank's sequence shard of it
            local = local.chunk(device_mesh.size(), dim=placement.dim)[device_mesh.get_local_rank()]
        out = DTensor.from_local(local, device_mesh, output_layouts, run_check=False)
        return out.to_local() if use_local_output else out

    RowwiseParallel._prepare_output_fn = staticmethod(prepare)
    try:
        yield
    finally:
        RowwiseParallel._prepare_output_fn = original


def missed_tp_partial_sum(layout: Layout, rank: int) -> Optional[Installer]:
    """(d) One row-parallel projection's partial sums never added up across the TP group."""
    return (lambda trainer: _skip_first_row_parallel_sum()) if layout.tp > 1 else None


FAULTS: dict[str, Callable[[Layout, int], Optional[Installer]]] = {
    "halved_gradient": halved_gradient,
    "normaliser_twice": normaliser_twice,
    "dropped_replica_gradient": dropped_replica_gradient,
    "missed_tp_partial_sum": missed_tp_partial_sum,
}
# Faults that wrap the trainer's `token_loss_sum`: their runs take the plain loss (full logits, then
# token_loss_sum; optimize.chunked_loss false), which the default chunked loss does not call. The
# one-process references keep the default: the two paths agree far inside the tolerances.
PLAIN_LOSS_FAULTS = {"normaliser_twice", "dropped_replica_gradient"}
APPLIES = {
    "halved_gradient": lambda layout: True,
    "normaliser_twice": lambda layout: True,
    "dropped_replica_gradient": lambda layout: layout.dp > 1,
    "missed_tp_partial_sum": lambda layout: layout.tp > 1,
}
# What each fault must make fail, at the least. (Fault (a) cannot show in the gradient norm: halving a
# tensor of norm ~1e-3 moves the model's norm of ~1.2 by ~3e-7 relative; (c) keeps step 1's loss.)
MUST_CATCH = {
    "halved_gradient": {"first-step gradients", "parameters after SGD"},
    "normaliser_twice": {"first-step gradients", "parameters after SGD", "loss per step", "grad norm per step"},
    "dropped_replica_gradient": {"first-step gradients", "parameters after SGD", "grad norm per step"},
    "missed_tp_partial_sum": {"first-step gradients", "parameters after SGD", "loss per step", "grad norm per step"},
}
# The 8-rank launch costs ~8 s a run: it runs the two faults that concern its product layout most.
FAULTS_8 = ("halved_gradient", "missed_tp_partial_sum")
# One layout per mechanism the parity matrix covers (each ZeRO path, once-per-step reduction, offload, TP with
# and without SP, a plain and a zero-bubble pipeline, LoRA and freezing; HSDP, DP x TP, DP x PP, PP x TP): the
# faults are generic, so the other layouts of the matrix add run time, not evidence that the checks bite.
FAULT_LAYOUTS = {"zero0", "zero1", "zero3", "zero2_once_per_step", "zero3_offload", "tp2_sp", "tp2_no_sp",
                 "pp2_1f1b", "pp2_zero_bubble_v", "lora_tp2", "freeze_zero3", "hsdp_2x2_zero3", "dp2_tp2_zero1",
                 "pp2_dp2_zero3_zero_bubble_v", "pp2_tp2_interleaved_1f1b", "dp2_tp2_pp2_zero3"}


def _pairs(world: int) -> list[tuple[str, str]]:
    # The MoE layouts share the harness checks shown to bite here; their own exchange faults are in
    # test_expert_parallel.py.
    return [(fault, layout.name) for layout in LAYOUTS if layout.world == world and layout.name in FAULT_LAYOUTS
            for fault in FAULTS if APPLIES[fault](layout) and (world < 8 or fault in FAULTS_8)]


# --- the old checks, as they were before issue 11 ----------------------------------------------------

def old_records_check(got: LoopRecord, ref: LoopRecord, atol: float = 1e-4) -> None:
    """harness.assert_records_close before issue 11: losses and first-step gradients, abs 1e-4."""
    for a, b in zip(got.losses, ref.losses):
        assert abs(a - b) <= atol
    for name, g in ref.first_grads.items():
        if g is not None:
            assert float((got.first_grads[name] - g).abs().max()) <= atol, name


def old_trainer_check(got: list[float], want: list[float], atol: float = 1e-4) -> None:
    """The trainer-level tests before issue 11: AdamW losses, abs 1e-4."""
    assert got == pytest.approx(want, abs=atol)


ADAMW = dict(optimizer="adamw", lr=3e-3, beta1=0.9, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1,
             max_steps=5)
UNIT_HALVED = "layers.1.attention.wq.weight"  # harness model: its largest first-step gradient is ~1.2e-4


def _unit_loop(rank: int, world: int, halve: bool) -> LoopRecord:
    """harness's DP2 ZeRO-2 loop (as test_data_parallel.py), with fault (a) optionally."""
    dims = ParallelDims(dp_shard=world)
    meshes = dims.build_meshes("cpu")
    model = apply_data_parallel(build_tiny_model(tiny_config()), meshes, dims, 2)
    optimizer = shard_optimizer(make_optimizer(model), model, 2, meshes)
    target = dict(model.named_parameters())[UNIT_HALVED]

    @contextlib.contextmanager
    def after_backward(_enabled: bool) -> Iterator[None]:
        yield
        if halve:
            target.grad.mul_(0.5)

    return train_loop(model, optimizer, make_steps(num_steps=5), rank=meshes["dp"].get_local_rank(), world=world,
                      group=meshes["dp"].get_group(), sync=after_backward,
                      clip=lambda ps: clip_grad_norm(ps, 0.5))


def _fault_worker(rank: int, world: int, root: Path, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fault, name in pairs:
        layout = BY_NAME[name]
        if fault in PLAIN_LOSS_FAULTS:
            layout = replace(layout, optimize={**layout.optimize, "chunked_loss": False})
        out[f"{fault}/{name}"] = train_once(layout_config(root / fault / name, layout), FAULTS[fault](layout, rank))
    if world == 2:
        out["unit_halved"] = _unit_loop(rank, world, halve=True)
        out["unit_clean"] = _unit_loop(rank, world, halve=False)
        zero3 = BY_NAME["zero3"]
        for tag, fault in (("adamw_clean", None), ("adamw_halved", halved_gradient(zero3, rank))):
            out[tag] = train_once(layout_config(root / tag, zero3, **ADAMW), fault)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Reference]]:
    root = tmp_path_factory.mktemp("faults")
    refs = {kind: reference(root, kind) for kind in FINETUNE if kind != "moe"}
    refs["adamw"] = reference(root, "full", tag="_adamw", **ADAMW)
    return root, refs


def _record(entry: dict) -> None:
    path = os.environ.get("SHARDWISE_PARITY_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_injected_faults_fail_the_strict_parity_checks(references, world: int) -> None:
    root, refs = references
    pairs = _pairs(world)
    results = run_distributed(_fault_worker, world, root, pairs, timeout=540)
    missed = []
    for fault, name in pairs:
        layout = BY_NAME[name]
        ranks = [r[f"{fault}/{name}"] for r in results]
        failures = parity_failures(f"{fault}/{name}", ranks, root / fault / name, refs[layout.finetune])
        caught = sorted(k for k, v in failures.items() if v)
        _record({"fault": fault, "layout": name, "caught_by": caught})
        if not MUST_CATCH[fault] <= set(caught):
            missed.append(f"{fault} in {name}: caught only by {caught}, expected {sorted(MUST_CATCH[fault])}")
    assert not missed, "\n".join(missed)
    if world == 2:
        _assert_old_checks_missed_halved_gradient(results, refs, root)


def _assert_old_checks_missed_halved_gradient(results: list[dict], refs: dict[str, Reference],
                                              root: Path) -> None:
    """Fault (a) passes the pre-issue-11 checks, and fails the strict ones, at both levels."""
    model = build_tiny_model(tiny_config())
    ref = train_loop(model, make_optimizer(model), make_steps(num_steps=5),
                     clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.5))
    # the halved tensor's gradient is small enough that halving it moves it by less than 1e-4
    assert float(ref.first_grads[UNIT_HALVED].abs().max()) < 2e-4
    for rank_result in results:
        assert_records_close(rank_result["unit_clean"], ref, label="DP2 ZeRO-2 without a fault")
        old_records_check(rank_result["unit_halved"], ref)  # the old check passes...
        with pytest.raises(ParityError, match=UNIT_HALVED.replace(".", r"\.")):  # ...the strict one fails
            assert_records_close(rank_result["unit_halved"], ref, label="DP2 ZeRO-2, gradient halved")
    # Trainer level: under AdamW the losses barely notice (AdamW normalises each element's step), but
    # the first-step gradients do.
    adamw = refs["adamw"]
    for rank_result in results:
        old_trainer_check(rank_result["adamw_clean"]["losses"], adamw.losses)
        old_trainer_check(rank_result["adamw_halved"]["losses"], adamw.losses)
    _record({"old_trainer_check": "adamw_halved", "max_abs_loss_difference": max(
        abs(a - b) for r in results for a, b in zip(r["adamw_halved"]["losses"], adamw.losses))})
    for tag, caught in (("adamw_clean", False), ("adamw_halved", True)):
        failures = parity_failures(tag, [r[tag] for r in results], root / tag, adamw)
        assert (failures["first-step gradients"] is not None) == caught, (tag, failures["first-step gradients"])
        assert failures["loss per step"] is None or caught, failures["loss per step"]
    full = refs["full"]
    assert float(full.grads[HALVED["full"]].abs().max()) < 2e-4  # the trainer model's, too
