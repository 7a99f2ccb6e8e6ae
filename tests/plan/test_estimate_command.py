"""`shardwise estimate` and the memory part of `shardwise train --dry-run`."""

from __future__ import annotations

import json

from shardwise.cli import main
from shardwise.memory.estimate import estimate_memory
from shardwise.resolve import resolve_config as validate


def test_estimate_from_flags_matches_the_library(capsys) -> None:  # noqa: ANN001
    assert main(["estimate", "--model", "tiny_llama", "--seq-length", "64", "--micro-batch", "2", "--dp", "2",
                 "--zero", "3", "--precision", "fp32", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    cfg = validate({"model": {"preset": "tiny_llama"}, "data": {"seq_length": 64},
                    "train": {"max_steps": 1, "micro_batch_size": 2},
                    "parallel": {"data_parallel": 2, "zero_stage": 3}, "optimize": {"mixed_precision": "fp32"}})
    assert got["peak"] == estimate_memory(cfg, 2, "cuda").peak
    assert main(["estimate", "--model", "tiny_llama", "--seq-length", "64", "--pp", "2", "--lora-r", "4"]) == 0
    out = capsys.readouterr().out
    assert "memory estimate for cuda" in out and "the busiest device is pipeline rank" in out
    assert "LoRA r=4" in out


def test_dry_run_prints_the_estimate_and_errors_are_clear(tmp_path, capsys) -> None:  # noqa: ANN001
    config = tmp_path / "run.yaml"
    config.write_text("model: {preset: tiny_llama}\ntrain: {max_steps: 2}\ndata: {seq_length: 64}\n"
                      "run: {device: cpu}\n")
    assert main(["train", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory estimate for cpu" in out and "by phase: forward" in out
    assert main(["estimate", str(config), "--set", "optimize.recompute=full"]) == 0
    assert "full recompute" in capsys.readouterr().out
    assert main(["estimate"]) == 2
    assert "give a config file, or --model PRESET" in capsys.readouterr().err
    assert main(["estimate", "--model", "llama_99b"]) == 2
    assert "Known presets" in capsys.readouterr().err
