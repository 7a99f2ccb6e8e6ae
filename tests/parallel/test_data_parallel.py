"""Data parallelism, ZeRO 0-3: loss and gradient parity with one process, on forked gloo ranks.

Every variant trains the tiny model for 5 steps on fixed batches and must match one process
strictly (harness.assert_records_close, fp32): every parameter's first-step gradient within a
relative error of 1e-5 per tensor (measured <= 1.6e-7), the loss and the (clipped) gradient norm of
every step within 5e-6 relative (measured <= 1.4e-7, AdamW and clipping included). Gradients are
normalised by the GLOBAL token count, so parity of the gradients also proves the data-parallel
reduction is a SUM (a mean would halve them).
Many variants run inside one launch per rank count (a launch costs seconds here).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

from shardwise.errors import ConfigError
from shardwise.parallel.data_parallel import (
    ZeroOneOptimizer,
    apply_data_parallel,
    clip_grad_norm,
    grad_sync,
    optimizer_state_numel,
    shard_optimizer,
    zero1_buckets,
    zero1_split,
)
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.dtensors import full_value, local_tensor
from shardwise.parallel.recompute import apply_recompute

from .harness import (
    LoopRecord,
    WorkerError,
    assert_records_close,
    assert_tensors_close,
    assert_values_close,
    build_tiny_model,
    local_rows,
    make_optimizer,
    make_steps,
    run_distributed,
    tiny_config,
    train_loop,
)

MAX_NORM = 0.5  # small enough that clipping changes the update on most steps
CFG = tiny_config()
STEPS = make_steps(num_steps=5, micro_batches=1)
STEPS_ACC = make_steps(num_steps=5, micro_batches=2, seed=99)

# name: (zero_stage, steps, options)
DP2_VARIANTS = {
    "zero0": (0, STEPS, {}),
    "zero1": (1, STEPS, {}),
    "zero2": (2, STEPS, {}),
    "zero3": (3, STEPS, {}),
    "zero1_accumulate": (1, STEPS_ACC, {"accumulate": True}),
    # ZeRO-1's all-gather in buckets of 300 elements: tensors split across buckets
    "zero1_small_buckets": (1, STEPS, {"bucket_elements": 300}),
    "zero3_accumulate": (3, STEPS_ACC, {"accumulate": True}),
    # parallel.reduce_gradients every_micro_batch: reduce-scatter each micro-batch (no unsharded buffer)
    "zero2_accumulate_every": (2, STEPS_ACC, {"accumulate": True, "every": True}),
    "zero3_accumulate_every": (3, STEPS_ACC, {"accumulate": True, "every": True}),
    "zero3_recompute": (3, STEPS, {"recompute": "full"}),
    "zero3_offload": (3, STEPS, {"offload": True}),
    "zero1_frozen_embedding": (1, STEPS, {"frozen": True}),
    "zero3_frozen_embedding": (3, STEPS, {"frozen": True}),
    # bf16 compute (FSDP2 MixedPrecisionPolicy), fp32 master shards: compared with looser bounds.
    "zero1_bf16": (1, STEPS, {"param_dtype": torch.bfloat16}),
    "zero3_bf16": (3, STEPS, {"param_dtype": torch.bfloat16}),
}


def _build(opts: dict) -> torch.nn.Module:
    model = build_tiny_model(CFG)
    if opts.get("frozen"):
        model.tok_embeddings.weight.requires_grad_(False)
    if opts.get("recompute"):
        apply_recompute(model, opts["recompute"])
    return model


def _reference(steps: list, opts: dict) -> LoopRecord:
    """One process, no data parallelism, torch's own clip_grad_norm_."""
    model = _build(opts)
    return train_loop(model, make_optimizer(model), steps,
                      clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))


def _dp_run(rank: int, world: int, dims: ParallelDims, meshes, zero: int, steps: list, opts: dict) -> dict:
    """One data-parallel variant on this rank: its loop record and what it kept where."""
    model = _build(opts)
    full_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_name = "tok_embeddings.weight"
    model = apply_data_parallel(model, meshes, dims, zero, offload=opts.get("offload", False),
                                param_dtype=opts.get("param_dtype"), reduce_every_micro_batch=opts.get("every", False))
    if "bucket_elements" in opts:
        optimizer = ZeroOneOptimizer(make_optimizer(model), meshes["dp"].get_group(), opts["bucket_elements"])
    else:
        optimizer = shard_optimizer(make_optimizer(model), model, zero, meshes)
    sync = (lambda enabled: grad_sync(model, enabled)) if opts.get("accumulate") else None
    rec = train_loop(model, optimizer, steps, rank=meshes["dp"].get_local_rank(), world=dims.dp,
                     group=meshes["dp"].get_group(), sync=sync, clip=lambda ps: clip_grad_norm(ps, MAX_NORM))
    params = dict(model.named_parameters())
    frozen = params[frozen_name]
    state = optimizer.state  # ZeRO-1's: every parameter's state, as DTensors of this rank's parts
    return {
        "record": rec,
        "state_numel": optimizer_state_numel(optimizer),
        "full_state_numel": 2 * full_numel,  # AdamW: exp_avg and exp_avg_sq
        "frozen_has_state": frozen in state,
        # per parameter: the elements of its tensor states held here, and its own elements
        "state_by_param": {n: (sum(local_tensor(v).numel() for v in state[p].values() if v.dim() > 0), p.numel())
                           for n, p in params.items() if p in state},
        "frozen_grad": frozen.grad is not None,
        "param_type": type(frozen).__name__,
        "dtypes": {str(p.dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()
                                                                 if p.grad is not None},
        "optimizer_type": type(optimizer).__name__,
    }


def _zero1_resume(rank: int, world: int, dims: ParallelDims, meshes) -> dict:
    """ZeRO-1 state through DCP's get_state_dict / set_state_dict mid-run, then the rest of the run."""
    def fresh():
        model = apply_data_parallel(build_tiny_model(CFG, seed=7), meshes, dims, 1)
        return model, shard_optimizer(make_optimizer(model), model)  # stage and mesh recorded on the model

    kw = dict(rank=meshes["dp"].get_local_rank(), world=dims.dp, group=meshes["dp"].get_group(),
              clip=lambda ps: clip_grad_norm(ps, MAX_NORM))
    model, optimizer = fresh()
    first = train_loop(model, optimizer, STEPS[:2], **kw)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model2, optimizer2 = fresh()  # initial weights and no state: the load must replace both
    set_state_dict(model2, optimizer2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    rest = train_loop(model2, optimizer2, STEPS[2:], **kw)
    # The same through the optimizer's own state dict with every tensor made whole (full_tensor):
    # load_state_dict keeps each rank's part of full tensors too.
    own = optimizer.state_dict()
    whole = {"param_groups": own["param_groups"],
             "state": {i: {k: full_value(v) for k, v in st.items()} for i, st in own["state"].items()}}
    model3, optimizer3 = fresh()
    set_model_state_dict(model3, model_sd)
    optimizer3.load_state_dict(whole)
    again = train_loop(model3, optimizer3, STEPS[2:], **kw)
    return {"losses": first.losses + rest.losses, "state_numel": optimizer_state_numel(optimizer2),
            "losses_whole": first.losses + again.losses, "state_numel_whole": optimizer_state_numel(optimizer3)}


def _grads_between_micro_batches(dims: ParallelDims, meshes, zero: int, every: bool) -> dict:
    """After a non-last micro-batch: the local elements of each parameter's (sharded) gradient, or None
    where FSDP2 holds the accumulating gradient unsharded and has not set it yet."""
    model = apply_data_parallel(build_tiny_model(CFG), meshes, dims, zero, reduce_every_micro_batch=every)
    first, last = STEPS_ACC[0]
    rank = meshes["dp"].get_local_rank()
    with grad_sync(model, False):
        model(local_rows(first, rank, dims.dp)["input_ids"]).float().pow(2).mean().backward()
    between = {n: None if p.grad is None else p.grad.to_local().numel() for n, p in model.named_parameters()}
    with grad_sync(model, True):
        model(local_rows(last, rank, dims.dp)["input_ids"]).float().pow(2).mean().backward()
    return {"between": between, "shards": {n: p.to_local().numel() for n, p in model.named_parameters()}}


def _dp2_worker(rank: int, world: int) -> dict:
    dims = ParallelDims(dp_shard=world)
    meshes = dims.build_meshes("cpu")
    out = {name: _dp_run(rank, world, dims, meshes, zero, steps, opts)
           for name, (zero, steps, opts) in DP2_VARIANTS.items()}
    out["zero1_resume"] = _zero1_resume(rank, world, dims, meshes)
    out["between"] = {(zero, every): _grads_between_micro_batches(dims, meshes, zero, every)
                      for zero in (2, 3) for every in (False, True)}
    return out


def _assert_bf16_close(rec: LoopRecord, ref: LoopRecord, label: str) -> None:
    """bf16 compute against fp32, within bf16's rounding (8 mantissa bits): losses within 1.5e-3
    relative (measured 1.5e-4), each first-step gradient within 5e-2 relative (measured 1.0e-2)."""
    assert_values_close(rec.losses, ref.losses, rtol=1.5e-3, what="bf16 loss", label=label)
    assert_tensors_close(rec.first_grads, ref.first_grads, rtol=5e-2, what="bf16 gradient", label=label)


@pytest.mark.timeout(300)
def test_dp2_zero_stages_match_one_process():
    """DP2 x ZeRO 0-3, accumulation, recompute, offload, frozen embedding, bf16: parity, sharded state;
    ZeRO-1 optimizer state through DCP state dicts mid-run."""
    refs = {name: _reference(steps, opts) for name, (_, steps, opts) in DP2_VARIANTS.items()}
    results = run_distributed(_dp2_worker, 2)
    for name, (zero, _, opts) in DP2_VARIANTS.items():
        ref = refs[name]
        for rank, res in enumerate(results):
            got = res[name]
            rec = got["record"]
            if "param_dtype" in opts:
                _assert_bf16_close(rec, ref, f"{name} rank {rank}")
                assert got["dtypes"] == {"torch.float32"}, f"{name}: sharded params and grads stay fp32"
            else:
                assert_records_close(rec, ref, label=f"{name} rank {rank}")  # losses, norms, gradients
            assert got["param_type"] == "DTensor", name
            assert got["optimizer_type"] == ("ZeroOneOptimizer" if zero == 1 else "AdamW"), name
            if opts.get("frozen"):
                assert not got["frozen_grad"] and not got["frozen_has_state"], name
                assert rec.first_grads["tok_embeddings.weight"] is None
            # Optimizer state: full on every rank for zero 0, about half for zero 1-3 (sums to full).
            share = got["state_numel"] / got["full_state_numel"]
            if zero == 0:
                assert share == 1.0, f"{name}: zero 0 keeps the full state, got {share:.2f}"
            else:
                assert 0.4 <= share <= 0.6, f"{name} rank {rank}: optimizer state share {share:.2f}, expected ~1/2"
        if zero > 0:
            total = sum(r[name]["state_numel"] for r in results)
            assert total == results[0][name]["full_state_numel"], f"{name}: shards do not add up to the full state"
    # Between micro-batches, reduce_every_micro_batch leaves only sharded gradients (each rank's half);
    # without it FSDP2 accumulates unsharded ones internally and sets no sharded gradient until the last.
    for rank, res in enumerate(results):
        for (zero, every), got in res["between"].items():
            if every:
                assert got["between"] == got["shards"], (zero, rank, got)
            else:
                assert set(got["between"].values()) == {None}, (zero, rank, got)
    # ZeRO-1 through DCP state dicts mid-run: the same losses as the uninterrupted run from that init.
    model = build_tiny_model(CFG, seed=7)
    ref = train_loop(model, make_optimizer(model), STEPS, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))
    for rank, res in enumerate(results):
        assert_values_close(res["zero1_resume"]["losses"], ref.losses, label=f"zero1 resumed, rank {rank}")
        assert 0.4 <= res["zero1_resume"]["state_numel"] / results[0]["zero1"]["full_state_numel"] <= 0.6
        assert_values_close(res["zero1_resume"]["losses_whole"], ref.losses, label=f"zero1 whole state, rank {rank}")
        assert res["zero1_resume"]["state_numel_whole"] == res["zero1_resume"]["state_numel"]
    # ZeRO-1 splits every tensor evenly (torch.chunk along its first dimension): each rank holds half
    # of every parameter's state, the largest tensor's (the embedding's) included.
    for name in ("zero1", "zero1_small_buckets", "zero1_accumulate"):
        per_rank = [res[name]["state_by_param"] for res in results]
        assert set(per_rank[0]) == set(per_rank[1]) and "tok_embeddings.weight" in per_rank[0], name
        for param, (held, numel) in per_rank[0].items():
            both = [r[param][0] for r in per_rank]
            assert sum(both) == 2 * numel and max(both) <= 2 * -(-numel // 2), (name, param, both)


HSDP_VARIANTS = {
    "hsdp_zero3": (3, STEPS, {}),
    "hsdp_zero2_accumulate": (2, STEPS_ACC, {"accumulate": True}),
    # only the all-reduce across replicas deferred to the last micro-batch
    "hsdp_zero2_accumulate_every": (2, STEPS_ACC, {"accumulate": True, "every": True}),
    "hsdp_zero3_accumulate_every": (3, STEPS_ACC, {"accumulate": True, "every": True}),
}


def _hsdp_worker(rank: int, world: int) -> dict:
    dims = ParallelDims(dp_replicate=2, dp_shard=2)
    meshes = dims.build_meshes("cpu")
    out = {name: _dp_run(rank, world, dims, meshes, zero, steps, opts)
           for name, (zero, steps, opts) in HSDP_VARIANTS.items()}
    out["placements"] = [str(p.placements) for p in apply_data_parallel(
        build_tiny_model(CFG), meshes, dims, 3).parameters()][:1]
    return out


@pytest.mark.timeout(300)
def test_hsdp_replicate2_shard2_matches_one_process():
    """HSDP on 4 ranks (2 replicas x 2 shards): parity, and state sharded over the shard dimension only."""
    refs = {name: _reference(steps, opts) for name, (_, steps, opts) in HSDP_VARIANTS.items()}
    results = run_distributed(_hsdp_worker, 4)
    for name in HSDP_VARIANTS:
        for rank, res in enumerate(results):
            got = res[name]
            assert_records_close(got["record"], refs[name], label=f"{name} rank {rank}")
            share = got["state_numel"] / got["full_state_numel"]
            assert 0.4 <= share <= 0.6, f"{name} rank {rank}: state share {share:.2f}, expected 1/2 (2 shards)"
    assert results[0]["placements"] == ["(Replicate(), Shard(dim=0))"]


def _dp2_tp2_worker(rank: int, world: int) -> dict:
    from shardwise.parallel.tensor import apply_tensor_parallel

    dims = ParallelDims(dp_shard=2, tp=2)
    meshes = dims.build_meshes("cpu")
    out = {}
    for zero in (0, 1, 2, 3):
        model = build_tiny_model(CFG)
        apply_tensor_parallel(model, meshes["tp"], sequence_parallel=True)
        model = apply_data_parallel(model, meshes, dims, zero)
        opt = shard_optimizer(make_optimizer(model), model, zero, meshes)
        out[zero] = train_loop(model, opt, STEPS_ACC, rank=meshes["dp"].get_local_rank(), world=2,
                               group=meshes["dp"].get_group(), sync=lambda enabled, m=model: grad_sync(m, enabled),
                               clip=lambda params: clip_grad_norm(params, MAX_NORM))
    return out


@pytest.mark.timeout(300)
def test_dp2_x_tp2_matches_one_process_for_every_zero_stage():
    """DP2 x TP2 with sequence parallel on 4 ranks, gradient accumulation and clipping: the loss at
    every step and every parameter's first-step gradient equal one process's, for ZeRO 0-3."""
    ref = _reference(STEPS_ACC, {})
    results = run_distributed(_dp2_tp2_worker, 4)
    for rank, res in enumerate(results):
        for zero, record in res.items():
            assert_records_close(record, ref, label=f"dp2 x tp2 zero {zero} rank {rank}")


# --- without processes -------------------------------------------------------------------------------

def test_bad_settings_are_refused_clearly():
    dims = ParallelDims(dp_shard=2)
    for zero in (0, 1):
        with pytest.raises(ConfigError, match="offload needs zero_stage 2 or 3"):
            apply_data_parallel(torch.nn.Linear(2, 2), None, dims, zero, offload=True)
    with pytest.raises(ConfigError, match="zero_stage must be one of"):
        apply_data_parallel(torch.nn.Linear(2, 2), None, dims, 4)


def test_zero1_splits_every_tensor_and_buckets_its_all_gather():
    # The first dimension tensor parallelism leaves free, torch.chunk style; none left: stepped whole.
    assert zero1_split((64, 32), [], 2) == (0, 32)
    assert zero1_split((5, 3), [], 4) == (0, 2)  # parts of 2, 2, 1 and 0 rows
    assert zero1_split((16, 32), [0], 2) == (1, 16)  # a column-parallel weight: split along its rows' width
    assert zero1_split((16,), [0], 2) == (None, 0) and zero1_split((), [], 2) == (None, 0)
    # Buckets of at most 100 gathered elements (50 per rank), every index of every part exactly once,
    # a tensor split across buckets, one index wider than a bucket alone.
    shards = [(4, 10), (3, 20), (1, 80), (2, 5)]
    buckets = zero1_buckets(shards, 2, 100)
    per_rank = [sum((end - start) * shards[i][1] for i, start, end in b) for b in buckets]
    assert per_rank == [40, 40, 20, 80, 10]  # each within one index (of 10 or 20) of 50
    covered = sorted((i, k) for b in buckets for i, start, end in b for k in range(start, end))
    assert covered == [(i, k) for i, (chunk, _) in enumerate(shards) for k in range(chunk)]
    assert len(zero1_buckets(shards, 2)) == 1  # the default holds a small model in one bucket


def test_single_process_helpers_are_plain_torch():
    """dp 1: the model is untouched, grad_sync is a no-op and clip_grad_norm equals torch's."""
    model = build_tiny_model(CFG)
    assert apply_data_parallel(model, None, ParallelDims(), 3) is model
    optimizer = make_optimizer(model)
    assert shard_optimizer(optimizer, model, 1) is optimizer
    batch = STEPS[0][0]
    with grad_sync(model, False):
        model(batch["input_ids"]).float().pow(2).mean().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    want = torch.nn.utils.clip_grad_norm_(params, 0.1)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    got = clip_grad_norm(params, 0.1)
    assert torch.allclose(got, want)
    clipped = clip_grad_norm(params, None)  # max_norm None: measured only
    assert abs(float(clipped) - min(0.1, float(want))) < 1e-5


def _parameters(values: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in values]
    for p, v in zip(params, values):
        p.grad = v.clone()
    return params


def test_the_norm_is_summed_in_float64_so_layouts_agree():
    """The squares and their sums are float64: the same gradients as 96 whole tensors or cut into 1,536
    pieces (as shards cut them) give the float64 norm rounded to fp32 once; fp32 sums (torch's norm,
    per tensor then over tensors) drift by several fp32 steps, differently for each layout."""
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(40_000, generator=gen) * 10.0 ** (i % 5 - 2) for i in range(96)]
    pieces = [piece for g in whole for piece in g.split(2_500)]
    reference = math.sqrt(math.fsum(float(g.double().square().sum()) for g in whole))
    want = torch.tensor(reference, dtype=torch.float32)
    got_whole, got_pieces = clip_grad_norm(_parameters(whole), None), clip_grad_norm(_parameters(pieces), None)
    assert got_whole.dtype == torch.float32
    assert torch.equal(got_whole, want) and torch.equal(got_pieces, want)
    # the inf-norm and a 3-norm likewise
    assert float(clip_grad_norm(_parameters(pieces), None, math.inf)) == max(float(g.abs().max()) for g in whole)
    cubes = math.fsum(float(g.double().abs().pow(3).sum()) for g in whole)
    assert torch.equal(clip_grad_norm(_parameters(pieces), None, 3.0), torch.tensor(cubes ** (1 / 3)).float())


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


@pytest.mark.timeout(120)
def test_harness_names_the_failing_rank():
    with pytest.raises(WorkerError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank_one, 2)
