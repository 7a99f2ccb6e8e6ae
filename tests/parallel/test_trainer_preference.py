"""Preference tuning (DPO) through the Trainer under data parallelism with ZeRO-3, tensor parallelism and
LoRA under ZeRO-1, against one process, with the parity matrix's strict checks (test_trainer_parity.py):
first-step gradients, parameters after the steps with plain SGD, every step's loss and gradient norm.

The reference log-probabilities are precomputed by the ranks together (each data-parallel rank a share
of the pairs) or, with LoRA, come from the base with adapters off; the loss is a mean over the step's pairs
on every rank, so a normalisation by a rank's own pairs, or a reference of the wrong weights, shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.data import load_tokenizer, train_bpe_tokenizer
from shardwise.data.preference import PreferenceDataset
from shardwise.resolve import resolve_config as validate

from ..train.test_preference import COLOURS, THINGS, _pairs, _write
from .harness import run_distributed
from .test_trainer_parity import assert_run_matches, reference_run, train_once

SEQ = 32
PAIRS = 4  # pairs per optimizer step over all data-parallel ranks
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
LAYOUTS = {  # name: (dp, zero, tp, lora)
    "dp2_zero3": (2, 3, 1, None),
    "tp2": (1, 0, 2, None),
    "dp2_zero1_lora": (2, 1, 1, LORA),
}


def _config(run_dir: Path, files: dict[str, str], dp: int = 1, zero: int = 0, tp: int = 1, lora: dict | None = None):  # noqa: ANN202
    section = {"output_dir": str(run_dir), "max_steps": 3, "micro_batch_size": PAIRS // dp // 2,
               "optimizer": "sgd", "beta1": 0.0, "lr": 0.5, "weight_decay": 0.0, "decay_style": "constant",
               "max_grad_norm": None, "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7,
               "peak_tflops": 1.0}
    raw = {"model": {"preset": "tiny_llama"}, "train": section, "run": {"num_threads": 1},
           "data": {"kind": "preference", "train_files": [files["train"]], "tokenizer": files["tokenizer"],
                    "template": "default", "seq_length": SEQ},
           "parallel": {"data_parallel": dp, "zero_stage": zero, "tensor_parallel": tp},
           "preference": {"beta": 0.5}}
    if lora:
        raw["lora"] = lora
    return validate(raw)


def _dataset(files: dict[str, str]) -> PreferenceDataset:
    return PreferenceDataset(files["train"], load_tokenizer(files["tokenizer"]), SEQ, template="default",
                             pad_to_multiple_of=8)  # rows split evenly over the sequence-parallel ranks


def _ranks(rank: int, world: int, root: Path, files: dict[str, str]) -> dict:
    return {name: train_once(_config(root / name, files, *layout), data=_dataset(files))
            for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pref_parity")
    text = root / "text.txt"
    text.write_text(" ".join(f"What colour is the {t}? The {t} is {c}." for t in THINGS for c in COLOURS) * 4,
                    encoding="utf-8")
    train_bpe_tokenizer([str(text)], 400, root / "tok", show_progress=False)
    return {"train": _write(root / "train.jsonl", _pairs(24)), "tokenizer": str(root / "tok")}


def test_preference_layouts_match_one_process(tmp_path: Path, files: dict[str, str]) -> None:
    refs = {lora: reference_run(_config(tmp_path / f"one_{lora is not None}", files, lora=lora), data=_dataset(files))
            for lora in (None,)}
    refs[True] = reference_run(_config(tmp_path / "one_lora", files, lora=LORA), data=_dataset(files))
    results = run_distributed(_ranks, 2, tmp_path, files, timeout=400)
    for name, (dp, zero, tp, lora) in LAYOUTS.items():
        ref = refs[True] if lora else refs[None]
        assert ref.losses[0] == pytest.approx(0.6931471805599453, abs=1e-6)  # step 1: the policy is the reference
        assert ref.losses[-1] < ref.losses[0]
        assert_run_matches(name, [r[name] for r in results], tmp_path / name, ref)
