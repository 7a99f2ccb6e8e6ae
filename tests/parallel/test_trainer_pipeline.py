"""The Trainer under pipeline parallelism: evaluation through the pipeline matches one process (alone
and with tensor parallel), and checkpoints move between PP2 (alone and with DP2 ZeRO-3) and one
process in both directions (also with tied embeddings, whose two pipeline copies are stored as the
one matrix of one process). Whether every schedule and product layout trains like one process is
test_trainer_parity.py's matrix (plain SGD, strict per-tensor checks); the AdamW losses here are
compared with harness.assert_values_close (relative error <= 5e-6; measured <= 1.7e-7).

Under pipeline parallelism the micro-batches of a step are the pipeline's: a pipeline step runs
parallel.micro_batch_num of them, and the gradient accumulation (micro-batches per optimizer step)
is micro_batch_num or a multiple of it (several pipeline steps per optimizer step). The one-process
reference accumulates micro-batches of the same global batch. Two launches (2 and 4 ranks) run
every variant.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.data.packing import PackedDataset
from shardwise.errors import ConfigError
from shardwise.parallel.dims import layout_for
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, make_tokens, tiny_config, with_changes
from .harness import assert_values_close, run_distributed

STEPS = 5
MICRO = 2  # micro-batches per step: the pipeline's micro_batch_num, the reference's accumulation
ROWS = 4  # samples per step over all data-parallel ranks
EVAL_BATCHES = 2


def _config(run_dir: Path, pp: int = 1, dp: int = 1, tp: int = 1, zero: int = 0, schedule: str = "1f1b",
            virtual_stages: int = 1, stage_layers: list[int] | None = None, tied: bool = False,
            **train: object):  # noqa: ANN202
    # A constant LR, so that a run cut short has the weights of the longer run at the same step.
    # (a given peak skips measuring the CPU's for MFU, most of such a short run's time)
    fields = {"output_dir": str(run_dir), "max_steps": STEPS, "decay_style": "constant",
              "micro_batch_size": ROWS // (MICRO * dp), "peak_tflops": 1.0, **train}
    base = with_changes(tiny_config(run_dir.parent, **fields), model={"num_layers": 4, "tie_embeddings": tied})
    if pp == 1:
        return with_changes(base, parallel={"data_parallel": dp, "tensor_parallel": tp, "zero_stage": zero},
                            optimize={"gradient_accumulation_steps": MICRO})
    return with_changes(base, parallel={"data_parallel": dp, "tensor_parallel": tp, "zero_stage": zero,
                                        "pipeline_parallel": pp, "micro_batch_num": MICRO, "schedule": schedule,
                                        "virtual_stages": virtual_stages, "stage_layers": stage_layers})


def _train(cfg, resume: str | None = None, evaluate: bool = False):  # noqa: ANN001, ANN202
    eval_ds = PackedDataset(make_tokens(3000, seed=1), SEQ) if evaluate else None
    if evaluate:
        cfg = with_changes(cfg, train={"eval_batches": EVAL_BATCHES})
    return Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ), eval_dataset=eval_ds).train(resume=resume)


def _pp2_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    result = _train(_config(root / "1f1b", pp=2), evaluate=True)
    out["1f1b"], out["eval"] = result.losses, result.eval
    # PP2 -> 1 process: steps 1-3 here, continued by the parent.
    _train(_config(root / "pp_to_single", pp=2, max_steps=3))
    # 1 process -> PP2 (the parent wrote steps 1-2): steps 3-5 under 1F1B and under ZB-V.
    out["from_single"] = _train(_config(root / "from_single", pp=2), resume="auto").losses
    out["from_single_zbv"] = _train(_config(root / "from_single_zbv", pp=2, schedule="zero_bubble",
                                            virtual_stages=2), resume="auto").losses
    # Tied embeddings: 1 process -> ZB-V (rank 0 holds both copies of the matrix), and PP2 1F1B -> 1
    # process (steps 1-3 here).
    out["tied_from_single_zbv"] = _train(_config(root / "tied_from_single_zbv", pp=2, schedule="zero_bubble",
                                                 virtual_stages=2, tied=True), resume="auto").losses
    out["tied_pp_to_single"] = _train(_config(root / "tied_pp_to_single", pp=2, tied=True, max_steps=3)).losses
    return out


def _4d_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    tp = _train(_config(root / "pp2_tp2", pp=2, tp=2), evaluate=True)
    return {
        "pp2_dp2_zero3_zbv": _train(_config(root / "pp2_dp2_zbv", pp=2, dp=2, zero=3, schedule="zero_bubble",
                                            virtual_stages=2)).losses,
        "pp2_tp2_1f1b": tp.losses,
        "eval": tp.eval,
    }


def _assert_matches(got: dict[int, float], want: dict[int, float], steps: list[int], name: str) -> None:
    assert sorted(got) == steps, name
    assert_values_close([got[s] for s in steps], [want[s] for s in steps], what="loss", label=name)


def _assert_eval_matches(got: dict, want: dict, name: str) -> None:
    assert got["tokens"] == want["tokens"], name
    assert_values_close([got["loss"]], [want["loss"]], what="eval loss", label=name)


@pytest.mark.timeout(600)
def test_pipeline_trainer_evaluates_and_checkpoints_reshard(tmp_path: Path) -> None:
    single = _train(_config(tmp_path / "single"), evaluate=True)
    reference = single.losses
    tied_reference = _train(_config(tmp_path / "tied_single", tied=True)).losses
    for name in ("from_single", "from_single_zbv"):  # continued by the PP2 workers
        _train(_config(tmp_path / name, max_steps=2))
    _train(_config(tmp_path / "tied_from_single_zbv", max_steps=2, tied=True))
    results = run_distributed(_pp2_runs, 2, tmp_path, timeout=540)
    for rank, rank_result in enumerate(results):  # every pipeline rank reports the same, global loss
        _assert_matches(rank_result["1f1b"], reference, list(range(1, STEPS + 1)), f"1f1b rank {rank}")
        for name in ("from_single", "from_single_zbv"):
            _assert_matches(rank_result[name], reference, [3, 4, 5], f"{name} rank {rank}")
        _assert_matches(rank_result["tied_from_single_zbv"], tied_reference, [3, 4, 5], "tied_from_single_zbv")
        _assert_matches(rank_result["tied_pp_to_single"], tied_reference, [1, 2, 3], "tied_pp_to_single")
        # Evaluation runs through the pipeline on every rank and agrees with one process's.
        _assert_eval_matches(rank_result["eval"], single.eval, f"1f1b eval rank {rank}")
    # The PP2 checkpoints of step 3 continue in one process.
    continued = _train(_config(tmp_path / "pp_to_single"), resume="auto").losses
    _assert_matches(continued, reference, [4, 5], "pp_to_single")
    continued = _train(_config(tmp_path / "tied_pp_to_single", tied=True), resume="auto").losses
    _assert_matches(continued, tied_reference, [4, 5], "tied_pp_to_single -> single")


@pytest.mark.timeout(600)
def test_pipeline_with_data_and_tensor_parallel_evaluates_and_checkpoints(tmp_path: Path) -> None:
    reference = _train(_config(tmp_path / "single", max_steps=STEPS + 1)).losses
    single_eval = _train(_config(tmp_path / "single_eval"), evaluate=True).eval
    results = run_distributed(_4d_runs, 4, tmp_path, timeout=540)
    for rank, rank_result in enumerate(results):
        _assert_eval_matches(rank_result.pop("eval"), single_eval, f"pp2_tp2 eval rank {rank}")
        for name, got in rank_result.items():
            _assert_matches(got, reference, list(range(1, STEPS + 1)), f"{name} rank {rank}")
    # The PP2 x DP2 ZeRO-3 (zero-bubble) checkpoint continues in one process.
    continued = _train(_config(tmp_path / "pp2_dp2_zbv", max_steps=STEPS + 1), resume="auto").losses
    _assert_matches(continued, reference, [STEPS + 1], "pp2_dp2_zbv -> single")


def test_pipeline_settings_fail_before_training(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run", pp=2)
    assert cfg.gradient_accumulation() == MICRO  # by default one pipeline step per optimizer step
    # 4 devices with data_parallel -1: micro-batch 2 x dp 2 x micro_batch_num 2
    assert with_changes(cfg, parallel={"data_parallel": -1}).global_batch_size(4) == 8
    assert with_changes(cfg, optimize={"gradient_accumulation_steps": 4}).gradient_accumulation() == 4
    assert with_changes(cfg, train={"global_batch_size": 8}).gradient_accumulation() == 4
    assert layout_for(cfg, 2).pp == 2
    with pytest.raises(ConfigError, match="interleaved_1f1b needs virtual_stages >= 2"):
        with_changes(cfg, parallel={"schedule": "interleaved_1f1b"})
    with pytest.raises(ConfigError,
                       match="gradient_accumulation_steps 3 is not a multiple of parallel.micro_batch_num 2"):
        with_changes(cfg, optimize={"gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError,
                       match="x 3 micro-batches per step, which is not a multiple of parallel.micro_batch_num"):
        with_changes(cfg, train={"global_batch_size": 6}).gradient_accumulation()
    with pytest.raises((ConfigError, ValueError), match="stage_layers"):
        with_changes(cfg, parallel={"stage_layers": [1, 1]})
    with pytest.raises(ConfigError, match="stage_layers .* leaves stage"):
        with_changes(cfg, parallel={"stage_layers": [2, 0, 1, 1], "virtual_stages": 2, "schedule": "zero_bubble"})
    # The micro-batch count against the schedule: when a run starts (before any model is built), so
    # that seed configs written for other frameworks still load.
    few = with_changes(cfg, parallel={"micro_batch_num": 1})
    with pytest.raises(ConfigError, match="micro_batch_num 1 is below pipeline_parallel 2"):
        layout_for(few, 2)
