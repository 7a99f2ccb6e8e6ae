"""The chunked loss (optimize.chunked_loss, the default) against the plain one (full logits, then
the loss) through the Trainer, in every layout where the head lives somewhere else: one process,
TP2 (vocabulary-parallel, with and without sequence parallelism), PP2 (1F1B and both zero-bubble
schedules: the loss on the last stage, the labels through the schedule), DP2 ZeRO-3 (FSDP2 gathers
the output weight inside the model's forward), GPT-2's tied embeddings in each, LoRA and frozen
embeddings (no output-weight gradient), and 16-bit precisions (fp16 with its loss scale).

Plain SGD and the uneven data of test_trainer_parity.py: per layout, the chunked run must equal the
plain run of the same layout (loss per step within 1e-6 relative, first-step gradients per tensor
1e-5, parameters after SGD, gradient norms, evaluation loss), and one process's plain run with the
parity matrix's strict tolerances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from shardwise.checkpoint.checkpointer import TIED_COPY, TIED_NAME
from shardwise.config import RunConfig
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer

from ..train.conftest import PaddedDataset, make_tokens
from .harness import (
    GRAD_RTOL,
    PARAM_RTOL,
    ParityError,
    assert_params_close,
    assert_tensors_close,
    assert_values_close,
    full_tensor,
    run_distributed,
)
from .test_trainer_parity import (
    MODEL,
    SEQ,
    STEPS,
    Layout,
    Reference,
    _pp,
    dataset,
    first_step_grads,
    grad_norms,
    layout_config,
    named_params,
    parity_failures,
    reference_run,
)

LOSS_RTOL = 1e-6  # chunked against plain, the same maths in fp32
MODELS = {"llama": {"preset": "tiny_llama", **MODEL},
          "gpt2": {"preset": "tiny_gpt2", **MODEL, "num_kv_heads": MODEL["num_heads"]}}  # tied embeddings
CHUNK = 7  # tokens per chunk: several chunks a micro-batch, the last one short

LAYOUTS = {
    "tp2_sp": Layout("tp2_sp", 2, dict(tensor_parallel=2), 2, 4),
    "tp2_no_sp": Layout("tp2_no_sp", 2, dict(tensor_parallel=2, sequence_parallel=False), 4, 2),
    "pp2_1f1b": Layout("pp2_1f1b", 2, _pp("1f1b"), 4, 2),
    "pp2_zero_bubble": Layout("pp2_zero_bubble", 2, _pp("zero_bubble"), 4, 2),
    "pp2_zero_bubble_v": Layout("pp2_zero_bubble_v", 2, _pp("zero_bubble", 2, 2), 2, 4),
    "zero3": Layout("zero3", 2, dict(data_parallel=2, zero_stage=3), 1, 4),
}
# (model, layout) pairs of the 2-rank launch
RUNS = [("llama", name) for name in LAYOUTS] + [("gpt2", "tp2_sp"), ("gpt2", "pp2_1f1b"), ("gpt2", "zero3")]


def run_config(run_dir: Path, model: str, layout: Optional[Layout], chunked: bool, finetune: str = "full",
               optimize: Optional[dict[str, Any]] = None) -> RunConfig:
    """test_trainer_parity's run (plain SGD, uneven data) of `model`, with or without the chunked loss."""
    raw = layout_config(run_dir, layout, finetune).model_dump(mode="json")
    raw["model"] = dict(MODELS[model])
    raw["optimize"].update(chunked_loss=chunked, loss_chunk_tokens=CHUNK, **(optimize or {}))
    return validate(raw)


def eval_dataset() -> PaddedDataset:
    return PaddedDataset(make_tokens(600, vocab=MODEL["vocab_size"], seed=3), SEQ)


def train(cfg: RunConfig) -> dict[str, Any]:
    """Train `cfg` on this rank (evaluating after the last step); what the comparisons read."""
    trainer = Trainer(cfg, train_dataset=dataset(), eval_dataset=eval_dataset())
    grads: dict[str, Optional[torch.Tensor]] = {}
    with first_step_grads(trainer, grads):
        result = trainer.train()
    params = {n: full_tensor(p) for n, p in named_params(trainer.model_parts)}
    if cfg.model.tie_embeddings and TIED_COPY in params:  # a pipeline's last-stage copy of the tied matrix
        params[TIED_NAME], grads[TIED_NAME] = params.pop(TIED_COPY), grads.pop(TIED_COPY)
    return {"grads": grads, "params": params, "losses": [result.losses[s] for s in sorted(result.losses)],
            "eval": result.eval["loss"], "scale": trainer.state.scaler.scale if trainer.state.scaler else None}


def compare(label: str, chunked: list[dict[str, Any]], plain: list[dict[str, Any]], chunked_dir: Path,
            plain_dir: Path, initial: dict[str, torch.Tensor]) -> None:
    """Chunked against plain in one layout, rank by rank: losses and evaluation within LOSS_RTOL,
    first-step gradients and parameters after SGD strictly, gradient norms within LOSS_RTOL."""
    for rank, (got, want) in enumerate(zip(chunked, plain)):
        where = f"{label} rank {rank}"
        assert_values_close(got["losses"], want["losses"], rtol=LOSS_RTOL, what="loss", label=where)
        assert_values_close([got["eval"]], [want["eval"]], rtol=LOSS_RTOL, what="eval loss", label=where)
        assert_tensors_close(got["grads"], want["grads"], rtol=GRAD_RTOL, label=where)
        assert_params_close(got["params"], want["params"], {n: initial[n] for n in got["params"]}, STEPS,
                            rtol=PARAM_RTOL, label=where)
    assert_values_close(grad_norms(chunked_dir), grad_norms(plain_dir), rtol=LOSS_RTOL, what="grad norm", label=label)


def references(root: Path) -> dict[str, Reference]:
    """One process's plain runs, the parity matrix's references."""
    return {model: reference_run(run_config(root / f"single_{model}_plain", model, None, chunked=False))
            for model in MODELS}


def _layouts(rank: int, world: int, root: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for model, name in RUNS:
        for chunked in (False, True):
            key = f"{model}_{name}_{'chunked' if chunked else 'plain'}"
            out[key] = train(run_config(root / key, model, LAYOUTS[name], chunked))
    return out


@pytest.mark.timeout(600)
def test_chunked_loss_equals_the_plain_loss_in_every_layout(tmp_path: Path) -> None:
    refs = references(tmp_path)
    results = run_distributed(_layouts, 2, tmp_path, timeout=560)
    failures = []
    for model, name in RUNS:
        label = f"{model} {name}"
        key = f"{model}_{name}"
        chunked = [r[f"{key}_chunked"] for r in results]
        plain = [r[f"{key}_plain"] for r in results]
        try:
            compare(label, chunked, plain, tmp_path / f"{key}_chunked", tmp_path / f"{key}_plain",
                    refs[model].initial)
            failed = {k: v for k, v in parity_failures(label, chunked, tmp_path / f"{key}_chunked",
                                                       refs[model]).items() if v}
            if failed:
                raise ParityError(f"{label} against one process: " + "\n".join(failed.values()))
        except ParityError as exc:
            failures.append(str(exc))
    assert not failures, "\n\n".join(failures)


# --- one process -----------------------------------------------------------------------------------

SINGLE = {
    "llama": ("llama", "full", {}),
    "gpt2_tied": ("gpt2", "full", {}),
    "recompute_full": ("llama", "full", {"recompute": "full"}),
    "lora": ("llama", "lora", {}),  # the output weight is frozen: no gradient to accumulate
    "gpt2_frozen_tied_embeddings": ("gpt2", "freeze", {}),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_chunked_loss_equals_the_plain_loss_in_one_process(tmp_path: Path, name: str) -> None:
    model, finetune, optimize = SINGLE[name]
    runs = {chunked: train(run_config(tmp_path / str(chunked), model, None, chunked, finetune, optimize))
            for chunked in (False, True)}
    initial = reference_run(run_config(tmp_path / "ref", model, None, False, finetune, optimize)).initial
    compare(name, [runs[True]], [runs[False]], tmp_path / "True", tmp_path / "False", initial)
    assert runs[True]["losses"][-1] < runs[True]["losses"][0]  # it trains


@pytest.mark.parametrize("precision", [{"mixed_precision": "bf16"},
                                       {"mixed_precision": "bf16", "precision_level": "O1"},
                                       {"mixed_precision": "fp16"},
                                       {"mixed_precision": "bf16", "precision_level": "O3"}])
def test_16_bit_precisions_train_alike(tmp_path: Path, precision: dict[str, str]) -> None:
    """bf16 / fp16 (O1 autocast, O2 with fp32 masters, O3; fp16 with its dynamic loss scale): the first
    step's loss is the plain one (the same logits), the later ones and the gradients differ by 16-bit
    rounding only, and fp16's loss scale follows the same course."""
    runs = {chunked: train(run_config(tmp_path / str(chunked), "llama", None, chunked, optimize=precision))
            for chunked in (False, True)}
    got, want = runs[True], runs[False]
    assert_values_close(got["losses"][:1], want["losses"][:1], rtol=LOSS_RTOL, what="first loss", label=str(precision))
    assert_values_close(got["losses"], want["losses"], rtol=2e-2, what="loss", label=str(precision))
    assert_tensors_close(got["grads"], want["grads"], rtol=5e-2, label=str(precision))
    assert got["scale"] == want["scale"]
    if precision["mixed_precision"] == "fp16":
        assert got["scale"] is not None and got["scale"] > 1
