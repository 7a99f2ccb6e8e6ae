"""The trainer's own collectives: sums over a mesh, rank 0 first, and the replica check that stops
a run whose data-parallel copies drift apart (seed 003, 5.3)."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.parallel.collectives import max_over, rank0_first, replica_mismatch, sum_over
from shardwise.parallel.dims import ParallelDims

from .harness import build_tiny_model, run_distributed, tiny_config


def _worker(rank: int, world: int) -> dict:
    meshes = ParallelDims(dp_shard=2).build_meshes("cpu")
    out = {"sums": sum_over([rank + 1.0, 10.0], meshes["dp"]), "max": max_over(float(rank * 3))}

    def fail_on_rank0() -> None:
        raise ValueError("the run directory is taken")

    try:
        rank0_first(fail_on_rank0, rank)
    except BaseException as e:  # noqa: BLE001 - what each rank saw
        out["rank0_first"] = f"{type(e).__name__}: {e}"
    model = build_tiny_model(tiny_config())
    out["same"] = replica_mismatch(model, meshes["dp"])
    if rank == 1:
        with torch.no_grad():
            model.layers["1"].feed_forward.w2.weight[0, 0] += 1e-3
    out["drifted"] = replica_mismatch(model, meshes["dp"])
    return out


@pytest.mark.timeout(300)
def test_collectives_and_the_replica_check() -> None:
    results = run_distributed(_worker, 2)
    for rank, res in enumerate(results):
        assert res["sums"] == [3.0, 20.0] and res["max"] == 3.0
        # Rank 0 raises its own error; the others learn of it instead of waiting for the timeout.
        expected = "ValueError" if rank == 0 else "ShardwiseError: rank 0 failed"
        assert res["rank0_first"].startswith(expected), res["rank0_first"]
        assert "the run directory is taken" in res["rank0_first"]
        assert res["same"] is None
        assert res["drifted"] is not None and "layers.1.feed_forward.w2.weight" in res["drifted"]
        assert "rank 0" in res["drifted"] and "rank 1" in res["drifted"]


def test_single_process_collectives_are_plain() -> None:
    assert sum_over([1.0, 2.0]) == [1.0, 2.0] and max_over(4.0) == 4.0
    assert rank0_first(lambda: 7, 0) == 7
    with pytest.raises(ShardwiseError):
        rank0_first(lambda: (_ for _ in ()).throw(ShardwiseError("boom")), 0)
