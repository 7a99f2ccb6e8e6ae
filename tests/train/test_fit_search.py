"""The search behind the out-of-memory help: combinations that fit, ranked by the step-time model."""

from __future__ import annotations

import itertools
from pathlib import Path

from shardwise.config import apply_overrides
from shardwise.hardware import CATALOGUE
from shardwise.memory.estimate import estimate_all_ranks
from shardwise.step_time import predict_step
from shardwise.train import fit_search
from shardwise.train.fit_search import combinations, find_fits, hardware_for, setting, usable_bytes

from .conftest import tiny_config, validate, with_changes

CPU = CATALOGUE["cpu"]
# The settings that can lower the tiny fp32 run's memory on one CPU process, written out by hand
# (ZeRO, offload and O3 need data parallelism, a GPU or 16 bits; the chunked loss is on already).
BY_HAND = {
    "micro-batch": [["train.micro_batch_size=4", "optimize.gradient_accumulation_steps=2"],
                    ["train.micro_batch_size=2", "optimize.gradient_accumulation_steps=4"],
                    ["train.micro_batch_size=1", "optimize.gradient_accumulation_steps=8"]],
    "recompute": [["optimize.recompute=selective"], ["optimize.recompute=full"]],
    "state": [["train.optimizer_state_dtype=bf16"], ["train.optimizer=adamw_8bit"]],
    "in backward": [["train.optimizer_in_backward=true", "train.max_grad_norm=null"]],
}


def _peak(cfg) -> int:  # noqa: ANN001
    return max(e.peak for e in estimate_all_ranks(cfg, 1, "cpu"))


def _base(tmp_path: Path):  # noqa: ANN202
    return with_changes(tiny_config(tmp_path), train={"micro_batch_size": 8})


def _by_hand(cfg, max_levers: int) -> list[tuple[list[str], object]]:  # noqa: ANN001
    """Every combination of up to `max_levers` hand-written levers that validates, with its config."""
    raw = cfg.model_dump()
    out = []
    for n in range(1, max_levers + 1):
        for levers in itertools.combinations(BY_HAND.values(), n):
            for picks in itertools.product(*levers):
                sets = [s for pick in picks for s in pick]
                try:
                    variant = validate(apply_overrides(raw, sets))
                    variant.gradient_accumulation(1)
                except Exception:  # noqa: BLE001 - e.g. the update in backward with accumulation
                    continue
                if variant.train.optimizer_in_backward and variant.gradient_accumulation(1) > 1:
                    continue
                out.append((sets, variant))
    return out


def test_the_search_offers_what_the_hand_written_levers_offer(tmp_path: Path) -> None:
    cfg = _base(tmp_path)
    found = {frozenset(sets) for _, sets in combinations(cfg, 1, "cpu", max_changes=2)}
    expected = {frozenset(sets) for sets, _ in _by_hand(cfg, 2)}
    assert expected <= found, expected - found


def test_two_changes_when_no_single_one_fits_cheapest_by_the_step_time_model(tmp_path: Path) -> None:
    """Memory just under every single change's estimate: the search returns combinations of two or more
    levers that fit by the estimator, and the first is as cheap (predict_step, to 1%) as the cheapest
    fitting combination of the hand-written levers, which are not all equally cheap."""
    cfg = _base(tmp_path)
    base_time = predict_step(cfg, 1, CPU).total
    singles = [_peak(variant) for _, variant in _by_hand(cfg, 1)]
    usable = min(singles) - 1
    pairs = [(sets, variant, _peak(variant), predict_step(variant, 1, CPU).total / base_time)
             for sets, variant in _by_hand(cfg, 2)]
    fitting = [(sets, cost) for sets, _, peak, cost in pairs if peak <= usable]
    assert fitting and len({round(cost, 2) for _, cost in fitting}) > 1  # a ranking that can go wrong
    result = find_fits(cfg, 1, "cpu", CPU, usable)
    assert result.current_peak == _peak(cfg) > usable
    assert result.fits, result
    for fit in result.fits:
        assert len(fit.levers) >= 2
        assert fit.peak == _peak(fit.cfg) <= usable
        assert abs(fit.cost - predict_step(fit.cfg, 1, CPU).total / base_time) < 1e-12
        assert fit.cfg == validate(apply_overrides(cfg.model_dump(), list(fit.sets)))  # the line makes it
        assert fit.cfg.global_batch_size(1) == cfg.global_batch_size(1)
    assert round(result.fits[0].cost, 2) == min(round(cost, 2) for _, cost in fitting)
    assert [round(f.cost, 2) for f in result.fits] == sorted(round(f.cost, 2) for f in result.fits)


def test_a_search_on_an_8b_config_takes_under_a_few_seconds(tmp_path: Path) -> None:
    import time

    cfg = validate({"model": {"preset": "llama3_8b"}, "data": {"seq_length": 4096},
                    "train": {"max_steps": 1, "micro_batch_size": 8, "global_batch_size": 64},
                    "parallel": {"data_parallel": 8, "zero_stage": 1}, "optimize": {"mixed_precision": "bf16"}})
    hw = CATALOGUE["H100"]
    start = time.perf_counter()
    result = find_fits(cfg, 8, "cuda", hw, usable_bytes(80 * 2**30, hw))
    assert time.perf_counter() - start < 10  # about 1 s undisturbed; a shared machine is slower
    assert result.estimated <= fit_search.MAX_ESTIMATES
    assert result.fits and result.current_peak > result.usable
    assert all(f.peak <= result.usable == result.target for f in result.fits)


def test_settings_read_back_as_written() -> None:
    assert setting("train.optimizer_in_backward", True) == "train.optimizer_in_backward=true"
    assert setting("train.max_grad_norm", None) == "train.max_grad_norm=null"
    assert setting("train.micro_batch_size", 4) == "train.micro_batch_size=4"
    assert setting("optimize.precision_level", "O3") == "optimize.precision_level=O3"


def test_the_hardware_of_a_running_device() -> None:
    assert hardware_for("cpu") is CATALOGUE["cpu"]
    assert hardware_for("cuda", "NVIDIA H200", 141 * 2**30).name == "H200"
    assert hardware_for("cuda", "NVIDIA A100-SXM4-40GB", 40 * 2**30).name == "A100-40GB"
    assert hardware_for("cuda", "NVIDIA A100-SXM4-80GB", 80 * 2**30).name == "A100-80GB"
    assert hardware_for("cuda", "Some Future GPU", 96 * 2**30).name == "H100"
    gpu = CATALOGUE["H100"]
    assert usable_bytes(80 * 2**30, gpu) == int((80 * 0.9 - gpu.reserved_gib) * 2**30)
    assert usable_bytes(20 * 2**30, CATALOGUE["cpu"], processes_here=2) == int(20 * 0.9 / 2 * 2**30)
