"""Preference tuning (DPO) through the Trainer under data parallelism with ZeRO-3, tensor parallelism,
LoRA under ZeRO-1, pipeline parallelism (with and without LoRA) and context parallelism, against one
process, with the parity matrix's strict checks (test_trainer_parity.py): first-step gradients,
parameters after the steps with plain SGD, every step's loss and gradient norm.

The reference log-probabilities are precomputed by the ranks together (each data-parallel rank a share
of the pairs; under a pipeline through its stages), come from the base with adapters off (LoRA; under a
pipeline a forward-only pass through the stages before each step), or from a frozen copy (context
parallelism: each rank's part of a row summed over the ranks). The loss is a mean over the step's pairs
on every rank, so a normalisation by a rank's own pairs, a row's log-probability from one rank's part of
it, or a reference of the wrong weights, shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.data import load_tokenizer, train_bpe_tokenizer
from shardwise.data.preference import PreferenceDataset
from shardwise.resolve import resolve_config as validate

from ..train.test_preference import COLOURS, THINGS, _pairs, _write
from .harness import run_distributed
from .test_trainer_parity import parity_failures, reference_run, train_once

SEQ = 48
PAIRS = 4  # pairs per optimizer step over all data-parallel ranks
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
LAYOUTS = {  # name: (dp, zero, tp, lora, other parallel settings, preference settings)
    "dp2_zero3": (2, 3, 1, None, {}, {}),
    "tp2": (1, 0, 2, None, {}, {}),
    "dp2_zero1_lora": (2, 1, 1, LORA, {}, {}),
    "pp2": (1, 0, 1, None, {"pipeline_parallel": 2, "schedule": "1f1b", "micro_batch_num": 2}, {}),
    "pp2_frozen": (1, 0, 1, None, {"pipeline_parallel": 2, "schedule": "zero_bubble", "micro_batch_num": 2},
                   {"precompute_reference": False}),
    "pp2_lora": (1, 0, 1, LORA, {"pipeline_parallel": 2, "schedule": "gpipe", "micro_batch_num": 2}, {}),
    "cp2_frozen": (1, 0, 1, None, {"context_parallel": 2}, {"precompute_reference": False}),
}


def _config(run_dir: Path, files: dict[str, str], dp: int = 1, zero: int = 0, tp: int = 1, lora: dict | None = None,
            parallel: dict | None = None, preference: dict | None = None):  # noqa: ANN202
    section = {"output_dir": str(run_dir), "max_steps": 3, "micro_batch_size": PAIRS // dp // 2,
               "optimizer": "sgd", "beta1": 0.0, "lr": 0.5, "weight_decay": 0.0, "decay_style": "constant",
               "max_grad_norm": None, "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7,
               "peak_tflops": 1.0}
    if (parallel or {}).get("pipeline_parallel", 1) > 1:  # the step's pairs in micro_batch_num micro-batches
        section.update(micro_batch_size=PAIRS // 2 // parallel["micro_batch_num"])
    raw = {"model": {"preset": "tiny_llama"}, "train": section, "run": {"num_threads": 1},
           "data": {"kind": "preference", "train_files": [files["train"]], "tokenizer": files["tokenizer"],
                    "template": "default", "seq_length": SEQ},
           "parallel": {"data_parallel": dp, "zero_stage": zero, "tensor_parallel": tp, **(parallel or {})},
           "preference": {"beta": 0.5, **(preference or {})}}
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
    refs = {lora is not None: reference_run(_config(tmp_path / f"one_{lora is not None}", files, lora=lora),
                                            data=_dataset(files)) for lora in (None, LORA)}
    for ref in refs.values():
        assert ref.losses[0] == pytest.approx(0.6931471805599453, abs=1e-6)  # step 1: the policy is the reference
        assert ref.losses[-1] < ref.losses[0]
    results = run_distributed(_ranks, 2, tmp_path, files, timeout=500)
    failures = []
    for name, (_, _, _, lora, _, _) in LAYOUTS.items():
        # tp2 and cp2: the vocabulary shards' exp-sums (shardwise.loss), or a row's parts, add in another order,
        # and DPO, a sigmoid of differences of sums over whole answers, magnifies that as its loss shrinks: at
        # step 3 tp2's grad norm is 5.7e-6 off one process's, cp2's loss (0.145) 6.6e-6 (measured), over the
        # 5e-6 bar of the others.
        rtol = {"scalar_rtol": 2e-5} if name in ("tp2", "cp2_frozen") else {}
        checks = parity_failures(name, [r[name] for r in results], tmp_path / name, refs[lora is not None], **rtol)
        failures += [f"{name} [{what}] {why}" for what, why in checks.items() if why]
    assert not failures, "\n\n".join(failures)
