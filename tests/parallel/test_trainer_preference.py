"""Preference tuning (DPO) through the Trainer under data parallelism with ZeRO-3, tensor parallelism,
LoRA under ZeRO-1, pipeline parallelism (with and without LoRA), context parallelism and expert parallelism
(a mixture of experts with adapters on its experts), against one process, with the parity matrix's strict
checks (test_trainer_parity.py): first-step gradients, parameters after the steps with plain SGD, every
step's loss and gradient norm.

The reference log-probabilities are precomputed by the ranks together (each data-parallel rank a share
of the pairs; under a pipeline through its stages), come from the base with adapters off (LoRA; under a
pipeline a forward-only pass through the stages before each step), or from a frozen copy in the run's
layout (under a pipeline its own chunks; under context parallelism each rank's part of a row summed over
the ranks). The loss is a mean over the step's pairs on every rank, so a normalisation by a rank's own
pairs, a row's log-probability from one rank's part of it, or a reference of the wrong weights, shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.data import load_tokenizer, train_bpe_tokenizer
from shardwise.data.preference import PreferenceDataset
from shardwise.resolve import resolve_config as validate

from ..train.test_preference import COLOURS, THINGS, _pairs, _write
from .harness import run_distributed
from .test_trainer_parity import MOE as PARITY_MOE
from .test_trainer_parity import parity_failures, reference_run, train_once

SEQ = 48
PAIRS = 4  # pairs per optimizer step over all data-parallel ranks
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
# A mixture of experts in block 1 (block 0 dense), its adapters on every routed expert, the correction bias moved
# by each step's load and the balance losses on: the test_trainer_parity matrix's.
MOE = {"model": {"preset": "tiny_llama", **PARITY_MOE},
       "lora": {**LORA, "target_modules": ["q_proj", "experts.w1", "experts.w3", "experts.w2"]}}
PP = {"pipeline_parallel": 2, "micro_batch_num": 2}
LAYOUTS = {  # name: (the one-process run it matches, its settings: _config's keywords)
    "dp2_zero3": ("full", dict(parallel={"data_parallel": 2, "zero_stage": 3})),
    "tp2": ("full", dict(parallel={"tensor_parallel": 2})),
    "dp2_zero1_lora": ("lora", dict(parallel={"data_parallel": 2, "zero_stage": 1}, lora=LORA)),
    "pp2": ("full", dict(parallel={**PP, "schedule": "1f1b"})),
    "pp2_frozen": ("full", dict(parallel={**PP, "schedule": "zero_bubble"},
                                preference={"precompute_reference": False})),
    "pp2_lora": ("lora", dict(parallel={**PP, "schedule": "gpipe"}, lora=LORA)),
    "cp2_frozen": ("full", dict(parallel={"context_parallel": 2}, preference={"precompute_reference": False})),
    "moe_lora_ep2_zero1": ("moe_lora", dict(parallel={"data_parallel": 2, "zero_stage": 1, "expert_parallel": 2},
                                            **MOE)),
}
REFERENCES = {"full": {}, "lora": dict(lora=LORA), "moe_lora": MOE}


def _config(run_dir: Path, files: dict[str, str], parallel: dict | None = None, lora: dict | None = None,
            preference: dict | None = None, model: dict | None = None):  # noqa: ANN202
    parallel = parallel or {}
    dp = parallel.get("data_parallel", 1)
    section = {"output_dir": str(run_dir), "max_steps": 3, "micro_batch_size": PAIRS // dp // 2,
               "optimizer": "sgd", "beta1": 0.0, "lr": 0.5, "weight_decay": 0.0, "decay_style": "constant",
               "max_grad_norm": None, "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7,
               "peak_tflops": 1.0}
    if parallel.get("pipeline_parallel", 1) > 1:  # the step's pairs in micro_batch_num micro-batches
        section.update(micro_batch_size=PAIRS // 2 // parallel["micro_batch_num"])
    raw = {"model": model or {"preset": "tiny_llama"}, "train": section, "run": {"num_threads": 1},
           "data": {"kind": "preference", "train_files": [files["train"]], "tokenizer": files["tokenizer"],
                    "template": "default", "seq_length": SEQ},
           "parallel": parallel, "preference": {"beta": 0.5, **(preference or {})}}
    if lora:
        raw["lora"] = lora
    return validate(raw)


def _dataset(files: dict[str, str], kind: str = "full") -> PreferenceDataset:
    """The pairs, each batch as wide as its longest row rounded up to 8 (split evenly over the sequence- and
    context-parallel ranks). MoE: every batch SEQ wide, since padding tokens are routed and count in the
    balance losses, which then depend on how the pairs are grouped into micro-batches (a known limit)."""
    return PreferenceDataset(files["train"], load_tokenizer(files["tokenizer"]), SEQ, template="default",
                             pad_to_multiple_of=SEQ if kind.startswith("moe") else 8)


def _ranks(rank: int, world: int, root: Path, files: dict[str, str]) -> dict:
    return {name: train_once(_config(root / name, files, **settings), data=_dataset(files, kind))
            for name, (kind, settings) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pref_parity")
    text = root / "text.txt"
    text.write_text(" ".join(f"What colour is the {t}? The {t} is {c}." for t in THINGS for c in COLOURS) * 4,
                    encoding="utf-8")
    train_bpe_tokenizer([str(text)], 400, root / "tok", show_progress=False)
    return {"train": _write(root / "train.jsonl", _pairs(24)), "tokenizer": str(root / "tok")}


def test_preference_layouts_match_one_process(tmp_path: Path, files: dict[str, str]) -> None:
    refs = {kind: reference_run(_config(tmp_path / f"one_{kind}", files, **settings), data=_dataset(files, kind))
            for kind, settings in REFERENCES.items()}
    for ref in refs.values():
        assert ref.losses[0] == pytest.approx(0.6931471805599453, abs=1e-6)  # step 1: the policy is the reference
        assert ref.losses[-1] < ref.losses[0]
    results = run_distributed(_ranks, 2, tmp_path, files, timeout=500)
    failures = []
    for name, (kind, _) in LAYOUTS.items():
        # tp2 and cp2: the vocabulary shards' exp-sums (shardwise.loss), or a row's parts, add in another order,
        # and DPO, a sigmoid of differences of sums over whole answers, magnifies that as its loss shrinks: at
        # step 3 tp2's grad norm is 5.7e-6 off one process's, cp2's loss (0.145) 6.6e-6 (measured), over the
        # 5e-6 bar of the others.
        rtol = {"scalar_rtol": 2e-5} if name in ("tp2", "cp2_frozen") else {}
        checks = parity_failures(name, [r[name] for r in results], tmp_path / name, refs[kind], **rtol)
        failures += [f"{name} [{what}] {why}" for what, why in checks.items() if why]
    assert not failures, "\n\n".join(failures)
