"""Sharded checkpoints across real processes: save under one layout, load under another.

One launch of two forked gloo workers runs every distributed phase (each launch costs seconds on
this machine); the workers write what they hold (gathered to full tensors) into files, and the test
process compares. Layouts: one process, DP2 FSDP2 (ZeRO-3, recompute-wrapped blocks), TP2
(DTensor via parallelize_module) and a two-stage pipeline-like split (each rank owns half the layers).
"""

from __future__ import annotations

import io
import json
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.checkpoint import format as ckpt_format
from shardwise.checkpoint import storage as ckpt
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.weights import load_model
from shardwise.config import to_yaml
from shardwise.errors import CheckpointError
from shardwise.models import build_model
from shardwise.resolve import resolve_config as validate

MODEL = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
             max_position_embeddings=64)
RUN = validate({"model": MODEL, "train": {"max_steps": 2}})
TOL = dict(atol=1e-6, rtol=0)
STATE = {"loader": {"consumed": 8}, "scaler": None}


class _Loader:
    """A data position, as the checkpointer saves and restores a loader's."""

    def __init__(self, state: dict) -> None:
        self.state = dict(state)

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _parts(model):  # noqa: ANN001, ANN202
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _save(run_dir: Path, step: int, model, opt, keep: int = 3) -> Path:  # noqa: ANN001
    """A checkpoint of `model` (one module or a list of parts) and `opt` through the trainer's checkpointer."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(RUN), encoding="utf-8")
    opt = opt[0] if isinstance(opt, list) else opt
    return Checkpointer(run_dir, _parts(model), opt, loader=_Loader(STATE["loader"]), keep=keep).save(step)


def _load(path: Path, model, opt) -> dict:  # noqa: ANN001
    """Load a checkpoint into `model` and `opt`; return its step and data position."""
    loader = _Loader({})
    opt = opt[0] if isinstance(opt, list) else opt
    step = Checkpointer(Path(path).parent / "loading", _parts(model), opt, loader=loader).load(str(path))
    return {"step": step, "loader": loader.state}


# --- Helpers shared by the workers and the test process ---------------------------------------------------


def _model(seed: int, **changes):  # noqa: ANN202
    torch.manual_seed(seed)
    cfg = RUN.model.model_copy(update=changes) if changes else RUN.model
    return build_model(cfg)


def _optimizer(model, foreach=None):  # noqa: ANN001, ANN202
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                             foreach=foreach)


def _train(model, opt, steps: int, seed: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, MODEL["vocab_size"], (2, 16), generator=g)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, MODEL["vocab_size"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _canon(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _dump(model, opt) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every parameter and optimizer state tensor, full (gathered), by canonical name; independent of
    the checkpoint module's own naming."""
    out = {}
    for n, p in model.named_parameters():
        out[f"model.{_canon(n)}"] = _full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.{_canon(n)}.{k}"] = _full(v)
    return out


def _split(rank: int, seed: int, layers_per_rank: tuple = ((0, 1), (2, 3)), **changes):  # noqa: ANN202
    """A pipeline-like stage: the model with the other stage's layers, embeddings or head removed."""
    model = _model(seed, **changes)
    for name in list(model.layers.keys()):
        if int(name) not in layers_per_rank[rank]:
            del model.layers[name]
    if rank != 0:
        model.tok_embeddings = None
    if rank != len(layers_per_rank) - 1:
        model.norm = None
        model.output = None
    return model


def _fake_steps(model, opt, seed: int, steps: int = 2) -> None:  # noqa: ANN001
    torch.manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()


def _save_dump(d: dict, path: Path) -> None:
    torch.save(d, path)  # the test's own comparison files, read back weights-only


def _load_dump(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _assert_same(got: dict, want: dict, keys=None) -> None:  # noqa: ANN001
    keys = sorted(want) if keys is None else keys
    assert keys, "nothing to compare"
    for k in keys:
        assert k in got, f"{k} missing"
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


# --- The workers ------------------------------------------------------------------------------------------


def _fsdp(model, mesh):  # noqa: ANN001, ANN202
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def _tp(model, mesh):  # noqa: ANN001, ANN202
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, mesh, plan)
    return model


def _expect_error(fn, results: dict, key: str) -> None:  # noqa: ANN001
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        results[key] = {"type": type(e).__name__, "message": str(e)}
    else:
        results[key] = None


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.parallel.recompute import apply_recompute

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    tmp = Path(tmp)
    results: dict = {}
    try:
        mesh = init_device_mesh("cpu", (world,))

        # 1. DP2 FSDP2 (ZeRO-3, recompute-wrapped blocks): train 2 steps on rank-specific data, save.
        dp = _model(seed=1)
        apply_recompute(dp, "full")
        _fsdp(dp, mesh)
        dp_opt = _optimizer(dp)
        _train(dp, dp_opt, steps=2, seed=10 + rank)
        _save(tmp / "run_dp", 2, dp, dp_opt, keep=2)
        ref = _dump(dp, dp_opt)
        if rank == 0:
            _save_dump(ref, tmp / "ref_dp.pt")

        # 2. Pipeline-like split: rank 0 holds layers 0-1 and the embeddings, rank 1 layers 2-3 and the head.
        pp = _split(rank, seed=2)
        pp_opt = _optimizer(pp)
        _fake_steps(pp, pp_opt, seed=20 + rank)
        _save(tmp / "run_pp", 2, [pp], [pp_opt])
        _save_dump(_dump(pp, pp_opt), tmp / f"ref_pp_rank{rank}.pt")

        # 3. Failures inside a distributed save leave the previous checkpoint the newest good one.
        crash = tmp / "run_crash"
        _save(crash, 1, dp, dp_opt)
        original_rng, original_write = ckpt.write_json_atomic, ckpt_format.JsonMetadataWriter.write_data
        if rank == 1:  # after DCP wrote every rank's tensors, before the rename: the rank's own state file
            def boom(path, obj) -> None:  # noqa: ANN001
                raise OSError("disk full (test)")
            ckpt.write_json_atomic = boom
        _expect_error(lambda: _save(crash, 2, dp, dp_opt), results, "crash_rng")
        ckpt.write_json_atomic = original_rng
        dist.barrier()
        results["after_rng_crash"] = sorted(p.name for p in (crash / "checkpoints").iterdir())
        if rank == 1:  # inside DCP's write stage
            def fail_write(self, plan, planner):  # noqa: ANN001, ANN202
                raise OSError("write failed (test)")
            ckpt_format.JsonMetadataWriter.write_data = fail_write
        _expect_error(lambda: _save(crash, 3, dp, dp_opt), results, "crash_dcp")
        ckpt_format.JsonMetadataWriter.write_data = original_write
        dist.barrier()
        results["after_dcp_crash"] = sorted(p.name for p in (crash / "checkpoints").iterdir())
        results["newest_after_crashes"] = ckpt.resolve_resume("auto", crash).name
        _save(crash, 4, dp, dp_opt)
        results["after_good_save"] = sorted(p.name for p in (crash / "checkpoints").iterdir())

        # 4. One process -> DP2 FSDP2 (the test process wrote run_single before the launch).
        single = ckpt.resolve_resume("auto", tmp / "run_single")
        dp2 = _fsdp(_model(seed=3), mesh)
        dp2_opt = _optimizer(dp2)
        results["state_dp_from_single"] = _load(single, dp2, dp2_opt)
        d = _dump(dp2, dp2_opt)
        if rank == 0:
            _save_dump(d, tmp / "got_single_to_dp.pt")
        _train(dp2, dp2_opt, steps=1, seed=30 + rank)  # the loaded state trains on

        # 5. DP2 FSDP2 -> TP2 (DTensor shards of another kind).
        tp = _tp(_model(seed=4), mesh)
        tp_opt = _optimizer(tp, foreach=False)  # plain TP leaves norms plain: no foreach on mixed lists
        _load(ckpt.resolve_resume("auto", tmp / "run_dp"), tp, tp_opt)
        d = _dump(tp, tp_opt)
        if rank == 0:
            _save_dump(d, tmp / "got_dp_to_tp.pt")
        _save(tmp / "run_tp", 2, tp, tp_opt)

        # 6. One process -> pipeline-like split: each rank reads only its layers.
        pp2 = _split(rank, seed=5)
        pp2_opt = _optimizer(pp2)
        _load(single, [pp2], pp2_opt)
        _save_dump(_dump(pp2, pp2_opt), tmp / f"got_single_to_pp_rank{rank}.pt")
        # ... TP2 -> pipeline-like split
        pp3 = _split(rank, seed=6)
        pp3_opt = _optimizer(pp3)
        _load(ckpt.resolve_resume("auto", tmp / "run_tp"), [pp3], pp3_opt)
        _save_dump(_dump(pp3, pp3_opt), tmp / f"got_tp_to_pp_rank{rank}.pt")
        # ... and pipeline-like split -> DP2 FSDP2
        dp3 = _fsdp(_model(seed=7), mesh)
        dp3_opt = _optimizer(dp3)
        _load(ckpt.resolve_resume("auto", tmp / "run_pp"), dp3, dp3_opt)
        d = _dump(dp3, dp3_opt)
        if rank == 0:
            _save_dump(d, tmp / "got_pp_to_dp.pt")

        # 7. Checkpoints of another model fail on every rank, naming the tensor.
        wrong = _fsdp(_model(seed=6, intermediate_size=40), mesh)
        _expect_error(lambda: _load(single, wrong, _optimizer(wrong)), results,
                      "mismatch_dp")
        # ... also when only one rank holds the mismatching layers
        one_side = _split(rank, seed=7, **({"intermediate_size": 40} if rank == 1 else {}))
        _expect_error(lambda: _load(single, one_side, _optimizer(one_side)), results,
                      "mismatch_one_rank")
        # ... and when no rank holds some saved layers (a 3-layer run, a 4-layer checkpoint)
        short = _split(rank, seed=8, layers_per_rank=((0, 1), (2,)), num_layers=3)
        _expect_error(lambda: _load(single, short, _optimizer(short)), results,
                      "lacking_layers")
        dist.barrier()
    except Exception:
        results["worker_error"] = traceback.format_exc()
        raise
    finally:
        (tmp / f"results_rank{rank}.json").write_text(json.dumps(results, default=str))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- The launch and the checks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory):  # noqa: ANN001, ANN201
    """Write a one-process checkpoint, then run all distributed phases in one 2-rank launch."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dist_ckpt")
    (tmp / "config.yaml").write_text(to_yaml(RUN), encoding="utf-8")
    model = _model(seed=0)
    opt = _optimizer(model)
    _train(model, opt, steps=2, seed=0)
    _save(tmp / "run_single", 2, model, opt)
    single_ref = _dump(model, opt)
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp)), nprocs=2, start_method="fork", join=True)
    results = [json.loads((tmp / f"results_rank{r}.json").read_text()) for r in range(2)]
    return tmp, single_ref, results


def _plain_load(path: Path, seed: int = 9):  # noqa: ANN202
    model = _model(seed=seed)
    opt = _optimizer(model)
    state = _load(path, model, opt)
    return _dump(model, opt), state


@pytest.mark.timeout(300)
def test_dp2_zero3_checkpoint_loads_into_one_process(launched):
    tmp, _, _ = launched
    ref = _load_dump(tmp / "ref_dp.pt")
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in ref)
    got, state = _plain_load(tmp / "run_dp" / "checkpoints" / "step_00000002")
    _assert_same(got, ref)
    assert state["step"] == 2 and state["loader"] == STATE["loader"]
    # `shardwise generate`'s loader reads it too, in a plain process
    model, _ = load_model(tmp / "run_dp")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[f"model.{n}"], **TOL)


@pytest.mark.timeout(300)
def test_one_process_checkpoint_loads_into_dp2_zero3(launched):
    tmp, single_ref, results = launched
    _assert_same(_load_dump(tmp / "got_single_to_dp.pt"), single_ref)
    assert results[0]["state_dp_from_single"]["step"] == 2


@pytest.mark.timeout(300)
def test_dp2_zero3_checkpoint_loads_into_tp2(launched):
    tmp, _, _ = launched
    _assert_same(_load_dump(tmp / "got_dp_to_tp.pt"), _load_dump(tmp / "ref_dp.pt"))


@pytest.mark.timeout(300)
def test_pipeline_stages_save_and_one_process_loads(launched):
    tmp, _, _ = launched
    ref = {**_load_dump(tmp / "ref_pp_rank0.pt"), **_load_dump(tmp / "ref_pp_rank1.pt")}
    assert "model.tok_embeddings.weight" in ref and "model.layers.3.attention.wq.weight" in ref
    got, _ = _plain_load(tmp / "run_pp" / "checkpoints" / "step_00000002")
    _assert_same(got, ref)
    assert set(got) == set(ref)  # every parameter and every state tensor of the whole model
    model, _ = load_model(tmp / "run_pp")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[f"model.{n}"], **TOL)


@pytest.mark.timeout(300)
def test_one_process_checkpoint_loads_into_pipeline_stages(launched):
    tmp, single_ref, _ = launched
    for rank in range(2):
        got = _load_dump(tmp / f"got_single_to_pp_rank{rank}.pt")
        _assert_same(got, single_ref, keys=sorted(got))
        assert (f"model.layers.{2 * rank}.attention.wq.weight" in got
                and f"model.layers.{2 - 2 * rank}.attention.wq.weight" not in got)


@pytest.mark.timeout(300)
def test_tp2_checkpoint_loads_into_pipeline_stages_and_stages_into_dp2(launched):
    tmp, _, _ = launched
    ref_dp = _load_dump(tmp / "ref_dp.pt")  # run_tp was saved right after loading run_dp
    for rank in range(2):
        got = _load_dump(tmp / f"got_tp_to_pp_rank{rank}.pt")
        _assert_same(got, ref_dp, keys=sorted(got))
    ref_pp = {**_load_dump(tmp / "ref_pp_rank0.pt"), **_load_dump(tmp / "ref_pp_rank1.pt")}
    got = _load_dump(tmp / "got_pp_to_dp.pt")
    _assert_same(got, ref_pp)
    assert set(got) == set(ref_pp)


@pytest.mark.timeout(300)
def test_a_failed_distributed_save_keeps_the_previous_checkpoint(launched):
    _, _, results = launched
    for rank, r in enumerate(results):
        assert r["crash_rng"] is not None and r["crash_dcp"] is not None, r
        # every rank stops; the others name the failing rank and its error
        if rank == 0:
            assert r["crash_rng"]["type"] == "CheckpointError"
            assert "rank 1" in r["crash_rng"]["message"] and "disk full (test)" in r["crash_rng"]["message"]
        else:
            assert r["crash_rng"]["type"] == "OSError"
        assert "write failed (test)" in r["crash_dcp"]["message"]
        assert r["after_rng_crash"] == [".step_00000002.tmp", "step_00000001"]
        assert r["after_dcp_crash"] == [".step_00000003.tmp", "step_00000001"]
        assert r["newest_after_crashes"] == "step_00000001"
        assert r["after_good_save"] == ["step_00000001", "step_00000004"]


@pytest.mark.timeout(300)
def test_mismatched_checkpoints_fail_on_every_rank_naming_the_tensor(launched):
    _, _, results = launched
    for r in results:
        assert r["mismatch_dp"]["type"] == "CheckpointError"
        assert "model.layers.0.feed_forward.w1.weight" in r["mismatch_dp"]["message"]
        assert "[48, 32]" in r["mismatch_dp"]["message"] and "[40, 32]" in r["mismatch_dp"]["message"]
        # only rank 1 holds the mismatching layers; rank 0 reports the same message
        assert r["mismatch_one_rank"]["type"] == "CheckpointError"
        assert "model.layers.2.feed_forward.w1.weight" in r["mismatch_one_rank"]["message"]
        assert r["lacking_layers"]["type"] == "CheckpointError"
        assert "model.layers.3." in r["lacking_layers"]["message"]
        assert "lacks" in r["lacking_layers"]["message"]
    assert results[0]["mismatch_one_rank"]["message"] == results[1]["mismatch_one_rank"]["message"]


@pytest.mark.timeout(300)
def test_distributed_checkpoints_hold_no_pickle_and_canonical_names(launched):
    tmp, _, _ = launched
    for run in ("run_dp", "run_pp", "run_tp", "run_crash"):
        path = ckpt.resolve_resume("auto", tmp / run)
        names = {p.name for p in path.iterdir()}
        assert ".metadata" not in names and ckpt.METADATA_FILE in names
        assert {"rng_rank0.json", "rng_rank1.json", ckpt.STATE_FILE} <= names
        assert {n for n in names if n.endswith(".distcp")} <= {"__0_0.distcp", "__1_0.distcp"}
        # Every file's checksum (each rank hashed its own shards), and nothing of that hashing left behind.
        listed = set(json.loads((path / ckpt.CHECKSUMS_FILE).read_text())["files"])
        on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
        assert listed == on_disk - {ckpt.CHECKSUMS_FILE}
        assert {"rng_rank1.json", "__1_0.distcp"} <= listed and not [n for n in names if n.startswith(".checksums")]
        assert ckpt.verify_checkpoint(path)
        doc = json.loads((path / ckpt.METADATA_FILE).read_text())
        assert all(item["kind"] == "tensor" for item in doc["state_dict"].values())  # no pickled objects
        assert not [k for k in doc["state_dict"] if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]
        shapes = ckpt.read_trainer_state(path)["shapes"]
        saved_model = {k.removeprefix("model.") for k in doc["state_dict"] if k.startswith("model.")}
        assert set(shapes["model"]) == saved_model
        # every stored tensor reads back with the weights-only unpickler
        for item in doc["storage"]:
            with open(path / item["path"], "rb") as f:
                f.seek(item["byte_offset"])
                torch.load(io.BytesIO(f.read(item["length"])), weights_only=True)


def test_single_process_sharded_api_round_trip(tmp_path):
    """Without torch.distributed the model/optimizer API is a one-process save and load."""
    from shardwise.parallel.recompute import apply_recompute

    model = _model(seed=0)
    apply_recompute(model, "selective")
    opt = _optimizer(model)
    _train(model, opt, steps=1, seed=0)
    path = _save(tmp_path, 1, [model], opt, keep=1)
    got, state = _plain_load(path)
    _assert_same(got, _dump(model, opt))
    assert state["step"] == 1
    wrong = _model(seed=0, hidden_size=48)
    with pytest.raises(CheckpointError, match="model.tok_embeddings.weight has shape"):
        _load(path, wrong, _optimizer(wrong))
