"""The trainer's own collectives: sums over a mesh, rank 0 first, and the replica check that stops
a run whose data-parallel copies drift apart (seed 003, 5.3)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.data.packing import PackedDataset
from shardwise.errors import ShardwiseError
from shardwise.parallel import collectives
from shardwise.parallel.collectives import max_over, rank0_first, replica_mismatch, sum_over
from shardwise.parallel.dims import ParallelDims
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, with_changes
from ..train.conftest import tiny_config as run_config
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


# --- groups that serve no CPU tensors (HCCL on Ascend) ------------------------------------------------
#
# This machine has no accelerator, so a device-only group is simulated: the groups claim to serve
# only "npu", a tensor moved there by `collectives._move` is a CPU tensor of the `OnGroupDevice`
# subclass, and every collective that shardwise code issues refuses a tensor that is not of it. A
# collective whose tensor did not go through `to_group_device` (a CPU counter, say) then fails as it
# would on HCCL. Collectives issued inside torch (FSDP2, DTensor, DCP) place their own tensors and
# are not checked.

_TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
                       "reduce", "gather", "scatter", "send", "recv", "all_to_all_single")
_CHECKED: list[str] = []  # call sites of the checked collectives, in this process


class OnGroupDevice(torch.Tensor):
    """A CPU tensor standing for one on a device-only group's accelerator."""


def _refusing(name: str, real):  # noqa: ANN001, ANN202 - wraps a torch.distributed function
    def collective(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("shardwise."):
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, list) for t in a if torch.is_tensor(t)]
            plain = [t for t in tensors if not isinstance(t, OnGroupDevice)]
            if plain:
                raise RuntimeError(f"{caller} called {name} with a {plain[0].device} tensor on a group without a "
                                   "CPU backend (as HCCL)")
            _CHECKED.append(f"{caller}.{name}")
        return real(*args, **kwargs)

    return collective


def _device_only_groups(patch: pytest.MonkeyPatch) -> None:
    patch.setattr(collectives, "group_device_types", lambda group=None: ("npu",))
    patch.setattr(collectives, "_move", lambda t, kind: t.detach().clone().as_subclass(OnGroupDevice))
    for name in _TENSOR_COLLECTIVES:
        patch.setattr(dist, name, _refusing(name, getattr(dist, name)))


def _trainer_collectives(rank: int, world: int, root: Path) -> dict:
    with pytest.MonkeyPatch.context() as patch:  # in this rank's process (the workers are not forks of the test)
        _device_only_groups(patch)
        return _trainer_runs(root)


def _trainer_runs(root: Path) -> dict:
    def run(name: str, steps: int = 3, resume: str | None = None, **sections: dict) -> dict[int, float]:
        train = {"output_dir": str(root / name), "max_steps": steps, "save_steps": 2, "micro_batch_size": 2,
                 "check_replicas_steps": 1, "eval_steps": 3, "eval_batches": 1, "decay_style": "constant"}
        cfg = with_changes(run_config(root, **train), **sections)
        return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ),
                       eval_dataset=PackedDataset(make_tokens(2000, seed=1), SEQ)).train(resume=resume).losses

    zero1 = {"parallel": {"data_parallel": 2, "zero_stage": 1}}
    out = {"zero1": run("zero1", **zero1), "zero3": run("zero3", parallel={"data_parallel": 2, "zero_stage": 3})}
    # Steps 1-2, then step 3 resumed from the step-2 checkpoint: the checkpoint's own collectives
    # (shape checks across ranks, agreement on failures) run under the refusing groups too.
    run("zero1_resumed", steps=2, **zero1)
    out["zero1_resumed"] = run("zero1_resumed", resume="auto", **zero1)
    out["pp2"] = run("pp2", parallel={"pipeline_parallel": 2, "micro_batch_num": 2, "schedule": "1f1b"},
                     model={"num_layers": 4}, optimize={"gradient_accumulation_steps": 2})
    out["checked"] = sorted(set(_CHECKED))
    return out


@pytest.mark.timeout(400)
def test_trainer_collectives_run_on_groups_without_a_cpu_backend(tmp_path: Path) -> None:
    results = run_distributed(_trainer_collectives, 2, tmp_path, timeout=360)
    for res in results:
        assert sorted(res["zero1"]) == [1, 2, 3] and sorted(res["zero1_resumed"]) == [3]
        assert res["zero1_resumed"][3] == pytest.approx(res["zero1"][3], rel=1e-6)
        assert sorted(res["pp2"]) == [1, 2, 3]
    # The check was not vacuous: the trainer's counters, the step loss, the replica check, the
    # checkpoint agreement and the pipeline's loss broadcast all went through it.
    checked = set(results[0]["checked"]) | set(results[1]["checked"])
    for site in ("shardwise.parallel.collectives.all_reduce", "shardwise.parallel.collectives.all_gather",
                 "shardwise.parallel.collectives.broadcast"):
        assert site in checked, sorted(checked)


def test_tensors_go_where_the_group_serves(monkeypatch) -> None:  # noqa: ANN001
    """CPU tensors stay on the CPU where the group has a CPU backend (gloo, CUDA's cpu:gloo side) and
    move to the accelerator where it has none (HCCL)."""
    moved: list[str] = []
    monkeypatch.setattr(collectives, "_move", lambda t, kind: moved.append(kind) or t)
    t = torch.zeros(2)
    for kinds, expected in ((("cpu",), []), (("cuda", "cpu"), []), (("npu",), ["npu"]), (("cuda",), ["cuda"])):
        moved.clear()
        monkeypatch.setattr(collectives, "group_device_types", lambda group=None, k=kinds: k)
        assert collectives.to_group_device(t) is t
        assert moved == expected, kinds
