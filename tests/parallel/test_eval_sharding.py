"""Evaluation in every layout equals one process's, with each rank doing only its share (issue 14, 6b/6c).

Each layout's `Trainer.evaluate` (after `setup`, on the run's initial weights, which every layout
builds alike from the seed) is held against one process's, which is held against a plain loop:
`token_loss_sum` over all eval batches of the whole model, summed in float64. The eval data has 9
samples of uneven target counts: 5 batches of 2 rows (the last one row), an odd count, so that under
DP2 one rank runs a padding forward, and a dropped, doubled or padding-counted batch changes the
token count. Tolerances: data parallelism alone adds the same fp32 per-batch sums in another order
(1e-9 relative); tensor and pipeline parallelism split the arithmetic (1e-6 relative, fp32).

Two launches: 2 ranks (DP2 ZeRO-0 with forward counts, DP2 ZeRO-3, PP2 under every schedule: 1F1B,
interleaved 1F1B, ZB-V, GPipe, ZB1P), 4 ranks (DP2 x TP2, HSDP 2 x 2 under ZeRO-3, PP2 x DP2
ZeRO-3, PP4 with 4 stages, and with 8 under ZB-V and interleaved 1F1B). Some variants shrink the
pipeline's evaluation groups to 2 batches, so that padding and several groups go through it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.data.loader import sequential_batches
from shardwise.loss import IGNORE_INDEX, token_loss_sum
from shardwise.train import evaluation
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, MaskedDataset, make_tokens, tiny_config, with_changes
from .harness import run_distributed

ROWS = 2  # samples per eval batch (train.micro_batch_size)
SAMPLES = 9  # -> 5 eval batches, the last of one row
DP_RTOL = 1e-9
SPLIT_RTOL = 1e-6


def _eval_data() -> MaskedDataset:
    ds = MaskedDataset(make_tokens(SAMPLES * SEQ + 1, seed=1), SEQ)
    assert len(ds) == SAMPLES
    return ds


def _config(run_dir: Path, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, replicate: int = 1,
            schedule: str = "1f1b", virtual_stages: int = 1, layers: int = 4):  # noqa: ANN202
    base = with_changes(tiny_config(run_dir.parent, output_dir=str(run_dir), max_steps=1, micro_batch_size=ROWS,
                                    decay_style="constant"), model={"num_layers": layers})
    parallel = {"data_parallel": dp, "tensor_parallel": tp, "zero_stage": zero, "data_parallel_replicate": replicate}
    if pp > 1:
        parallel.update(pipeline_parallel=pp, micro_batch_num=max(2, pp), schedule=schedule,
                        virtual_stages=virtual_stages)
    return with_changes(base, parallel=parallel)


def _trainer(cfg) -> Trainer:  # noqa: ANN001
    trainer = Trainer(cfg, train_dataset=MaskedDataset(make_tokens(), SEQ), eval_dataset=_eval_data())
    trainer.state = trainer.setup()
    return trainer


def _plain_eval(model: torch.nn.Module) -> dict[str, float]:
    """The maths: every batch through the whole model in this process, float64 sums."""
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for mb in sequential_batches(_eval_data(), ROWS):
            loss_sum += float(token_loss_sum(model(mb["input_ids"]), mb["labels"]).double())
            tokens += int((mb["labels"] != IGNORE_INDEX).sum())
    return {"loss": loss_sum / tokens, "tokens": tokens}


def _fingerprint(ids: torch.Tensor) -> tuple[int, ...]:
    return tuple(ids[:, :4].flatten().tolist())


def _counted_evaluate(trainer: Trainer) -> tuple[dict[str, float], list[tuple[int, ...]]]:
    """evaluate(), and the batches (by their first tokens) this rank's model ran a forward on."""
    seen: list[tuple[int, ...]] = []
    handle = trainer.model.register_forward_pre_hook(lambda _module, args: seen.append(_fingerprint(args[0])))
    try:
        return trainer.evaluate(), seen
    finally:
        handle.remove()


def _two_rank_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    out["zero0"], out["zero0_forwards"] = _counted_evaluate(_trainer(_config(root / "zero0", dp=2)))
    out["zero3"] = _trainer(_config(root / "zero3", dp=2, zero=3)).evaluate()
    evaluation.PIPELINE_GROUP = 2  # groups of 2, 2, 1 batches
    out["pp2_1f1b"] = _trainer(_config(root / "pp2_1f1b", pp=2)).evaluate()
    evaluation.PIPELINE_GROUP = 32  # one group of 5
    out["pp2_interleaved"] = _trainer(_config(root / "pp2_int", pp=2, schedule="interleaved_1f1b",
                                              virtual_stages=2)).evaluate()
    out["pp2_zbv"] = _trainer(_config(root / "pp2_zbv", pp=2, schedule="zero_bubble", virtual_stages=2)).evaluate()
    out["pp2_gpipe"] = _trainer(_config(root / "pp2_gpipe", pp=2, schedule="gpipe")).evaluate()
    out["pp2_zb1p"] = _trainer(_config(root / "pp2_zb1p", pp=2, schedule="zero_bubble")).evaluate()
    return out


def _four_rank_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    out["dp2_tp2"] = _trainer(_config(root / "dp2_tp2", dp=2, tp=2)).evaluate()
    out["hsdp"] = _trainer(_config(root / "hsdp", dp=4, zero=3, replicate=2)).evaluate()
    evaluation.PIPELINE_GROUP = 2  # 3 batches per replica (one rank's third is padding): groups of 2 and 1
    out["pp2_dp2_zero3"] = _trainer(_config(root / "pp2_dp2_zero3", pp=2, dp=2, zero=3)).evaluate()
    evaluation.PIPELINE_GROUP = 32
    out["pp4"] = _trainer(_config(root / "pp4", pp=4)).evaluate()  # middle ranks receive and send each tick
    # 8 stages of an 8-layer model: the V (rank 3 runs stages 3 and 4 as one segment) and interleaved.
    out["pp4_zbv"] = _trainer(_config(root / "pp4_zbv", pp=4, schedule="zero_bubble", virtual_stages=2,
                                      layers=8)).evaluate()
    out["pp4_interleaved"] = _trainer(_config(root / "pp4_int", pp=4, schedule="interleaved_1f1b",
                                              virtual_stages=2, layers=8)).evaluate()
    return out


def _assert_same(got: dict, want: dict, rtol: float, label: str) -> None:
    assert got["tokens"] == want["tokens"], f"{label}: {got['tokens']} target tokens, one process {want['tokens']}"
    err = abs(got["loss"] - want["loss"]) / abs(want["loss"])
    assert err <= rtol, f"{label}: loss {got['loss']!r} vs one process {want['loss']!r} (relative {err:.3g})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """One process's evaluation, which matches the plain loop (within SPLIT_RTOL: the run's default
    chunked loss sums in another order than the full logits' cross-entropy)."""
    return _reference(tmp_path_factory.mktemp("single") / "run", layers=4)


@pytest.fixture(scope="module")
def reference_8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The same for the 8-layer model."""
    return _reference(tmp_path_factory.mktemp("single_8") / "run", layers=8)


def _reference(run_dir: Path, layers: int) -> dict[str, float]:
    trainer = _trainer(_config(run_dir, layers=layers))
    want = trainer.evaluate()
    _assert_same(want, _plain_eval(trainer.model), SPLIT_RTOL, "one process")
    _assert_same(trainer.evaluate(model=trainer.model, plan=trainer.state.plan, device=torch.device("cpu")),
                 want, 0.0, "one process, model given")
    assert want["tokens"] < SAMPLES * SEQ  # masked labels: the batches' counts differ
    return want


@pytest.mark.timeout(300)
def test_data_parallel_and_pipeline_evaluation_equal_one_process(tmp_path: Path, reference: dict) -> None:
    results = run_distributed(_two_rank_runs, 2, tmp_path, timeout=280)
    batches = [_fingerprint(mb["input_ids"]) for mb in sequential_batches(_eval_data(), ROWS)]
    assert len(batches) == 5
    for rank, got in enumerate(results):
        for name in ("zero0", "zero3"):
            _assert_same(got[name], reference, DP_RTOL, f"{name} rank {rank}")
        for name in ("pp2_1f1b", "pp2_interleaved", "pp2_zbv", "pp2_gpipe", "pp2_zb1p"):
            _assert_same(got[name], reference, SPLIT_RTOL, f"{name} rank {rank}")
    # Each data-parallel rank ran a forward on its share only: batches 0, 2, 4 and 1, 3 (+ padding:
    # the first batch again), the same number of forwards on both.
    assert results[0]["zero0_forwards"] == [batches[0], batches[2], batches[4]]
    assert results[1]["zero0_forwards"] == [batches[1], batches[3], batches[0]]


@pytest.mark.timeout(400)
def test_tensor_hsdp_and_four_rank_pipelines_evaluation_equal_one_process(tmp_path: Path, reference: dict,
                                                                           reference_8: dict) -> None:
    results = run_distributed(_four_rank_runs, 4, tmp_path, timeout=380)
    for rank, got in enumerate(results):
        _assert_same(got["dp2_tp2"], reference, SPLIT_RTOL, f"dp2_tp2 rank {rank}")
        _assert_same(got["hsdp"], reference, DP_RTOL, f"hsdp rank {rank}")
        _assert_same(got["pp2_dp2_zero3"], reference, SPLIT_RTOL, f"pp2_dp2_zero3 rank {rank}")
        _assert_same(got["pp4"], reference, SPLIT_RTOL, f"pp4 rank {rank}")
        for name in ("pp4_zbv", "pp4_interleaved"):
            _assert_same(got[name], reference_8, SPLIT_RTOL, f"{name} rank {rank}")


def test_shard_batches_gives_every_rank_the_same_count() -> None:
    ds = _eval_data()
    shares = [list(evaluation.shard_batches(ds, ROWS, None, r, 3)) for r in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]  # 5 batches over 3 ranks: one padding forward
    assert [[c for _, c in s] for s in shares] == [[True, True], [True, True], [True, False]]
    tokens = sum(evaluation.target_tokens(mb) for s in shares for mb, counted in s if counted)
    assert tokens == sum(evaluation.target_tokens(mb) for mb in sequential_batches(ds, ROWS))
    assert [len(list(evaluation.shard_batches(ds, ROWS, 1, r, 2))) for r in range(2)] == [1, 1]  # eval_batches 1
