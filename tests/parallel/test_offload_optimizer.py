"""optimize.offload_optimizer (cpu, and stream: issue 25) under data parallelism (issue 13, item 5): on 2
ranks with ZeRO 2/3 each rank keeps the host masters and state of its own shards; losses, clipping and the
weights must be one process's, and a checkpoint must resume in one process without offload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.data.packing import PackedDataset
from shardwise.memory.offload import HostMasters
from shardwise.memory.streamed_optimizer import StreamedAdam
from shardwise.parallel.dtensors import local_tensor
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens
from .harness import full_tensor, run_distributed

ROWS = 4  # samples per step over all ranks
STEPS = 3


def _config(run_dir: Path, dp: int, zero: int = 3, steps: int = STEPS, **optimize: Any):  # noqa: ANN202
    parallel = {"data_parallel": dp, "zero_stage": zero} if dp > 1 else {}
    return validate({
        "model": {"preset": "tiny_llama"}, "data": {"seq_length": SEQ},
        "train": {"output_dir": str(run_dir), "max_steps": steps, "micro_batch_size": ROWS // dp // 2,
                  "lr": 3e-3, "decay_style": "constant", "warmup_steps": 0, "max_grad_norm": 0.05, "log_steps": 1,
                  "progress_bar": False, "tensorboard": False, "seed": 7, "peak_tflops": 1.0},
        "optimize": {"gradient_accumulation_steps": 2, **optimize}, "parallel": parallel, "run": {"num_threads": 1}})


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p).detach().float().clone() for n, p in trainer.model.named_parameters()}


def _ranked(rank: int, world: int, root: Path, zero: int, mode: str) -> dict[str, Any]:
    trainer = Trainer(_config(root, world, zero, offload_optimizer=mode), train_dataset=PackedDataset(make_tokens(),
                                                                                                      SEQ))
    result = trainer.train(overwrite=True)
    if mode == "cpu":
        masters = trainer.state.masters
        assert isinstance(masters, HostMasters)
        assert all(local_tensor(m).device.type == "cpu" for m in masters.masters)
        local_numel = sum(local_tensor(m).numel() for m in masters.masters)
    else:  # stream, fp32 weights: no masters; the moments of this rank's shards in host memory
        optimizer = trainer.state.optimizer
        assert isinstance(optimizer, StreamedAdam)
        moments = [local_tensor(st["exp_avg"]) for st in optimizer.state.values()]
        assert all(m.device.type == "cpu" for m in moments)
        local_numel = sum(m.numel() for m in moments)
    return {"losses": result.losses, "params": _params(trainer), "local_numel": local_numel}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero, mode", [(2, "cpu"), (3, "cpu"), (3, "stream")])
def test_offloaded_optimizer_on_2_ranks_trains_like_one_process(tmp_path, zero, mode):
    ref = Trainer(_config(tmp_path / "one", 1), train_dataset=PackedDataset(make_tokens(), SEQ))
    expected = ref.train(overwrite=True)
    ranks = run_distributed(_ranked, 2, tmp_path / "dp", zero, mode, timeout=240)
    total = sum(p.numel() for p in ref.model.parameters())
    assert sum(r["local_numel"] for r in ranks) == total  # each rank offloads its own shards only
    for r in ranks:
        for step, loss in expected.losses.items():
            assert r["losses"][step] == pytest.approx(loss, rel=1e-6, abs=0), step
        for name, w in _params(ref).items():
            torch.testing.assert_close(r["params"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    # The 2-rank checkpoint (sharded host masters and state) resumes in one process without offload.
    resumed = Trainer(_config(tmp_path / "dp", 1, steps=STEPS + 1),
                      train_dataset=PackedDataset(make_tokens(), SEQ)).train(resume="auto")
    longer = Trainer(_config(tmp_path / "one4", 1, steps=STEPS + 1),
                     train_dataset=PackedDataset(make_tokens(), SEQ)).train(overwrite=True)
    assert resumed.losses[STEPS + 1] == pytest.approx(longer.losses[STEPS + 1], rel=1e-5, abs=0)
