"""The trainer fed from the YAML data section: raw .jsonl prepared on the fly, a prepared directory,
and instruction data in each batching mode, with eval and an exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardwise.data import prepare_corpus, train_bpe_tokenizer
from shardwise.data.tokenizer import load_tokenizer
from shardwise.train.trainer import Trainer

from ..data.conftest import make_text
from .conftest import tiny_config, with_changes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A .jsonl pre-training corpus, chat-shaped instruction files and a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("data")
    texts = root / "texts.jsonl"
    texts.write_text("".join(json.dumps({"body": make_text(i, 8)}) + "\n" for i in range(60)))
    answers = ["yes", "no", "she did", "at the ball", "her sister", "in the morning"]
    for name, n in (("train.jsonl", 48), ("eval.jsonl", 8)):
        rows = [{"messages": [{"role": "user", "content": f"Who {i}?"},
                              {"role": "assistant", "content": answers[i % len(answers)]}]} for i in range(n)]
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_bpe_tokenizer([str(texts)], 300, root / "tok", text_field="body", show_progress=False)
    return {"root": root, "texts": texts, "tok": root / "tok"}


def _config(tmp_path: Path, data: dict, **train: object):  # noqa: ANN202
    cfg = tiny_config(tmp_path, **train)
    return with_changes(cfg, data={"cache_dir": str(tmp_path / "cache"), **data})


def test_raw_jsonl_is_prepared_and_trained_with_document_masks(tmp_path: Path, corpus: dict) -> None:
    cfg = _config(tmp_path, {"train_files": [str(corpus["texts"])], "text_field": "body",
                             "tokenizer": str(corpus["tok"]), "eval_fraction": 0.1}, max_steps=6)
    trainer = Trainer(cfg)
    result = trainer.train(overwrite=True)
    assert result.step == 6 and result.losses[6] < result.losses[1]
    assert result.eval is not None and math.isfinite(result.eval["loss"])
    sample = trainer.train_dataset[0]
    assert {"document_ids", "position_ids"} <= set(sample)
    # The cache holds exactly one prepared directory; a second run reuses it.
    prepared = sorted((tmp_path / "cache").glob("shards-*"))
    assert len(prepared) == 1
    Trainer(with_changes(cfg, train={"output_dir": str(tmp_path / "again")})).train()
    assert sorted((tmp_path / "cache").glob("shards-*")) == prepared


def test_prepared_directory_trains_like_raw_files(tmp_path: Path, corpus: dict) -> None:
    tok = load_tokenizer(corpus["tok"])
    prepare_corpus([str(corpus["texts"])], tok, tmp_path / "prepared", text_field="body", workers=1)
    raw = _config(tmp_path / "raw", {"train_files": [str(corpus["texts"])], "text_field": "body",
                                     "tokenizer": str(corpus["tok"])})
    prepared = _config(tmp_path / "pre", {"train_files": [str(tmp_path / "prepared")],
                                          "tokenizer": str(corpus["tok"])})
    assert Trainer(raw).train().losses == Trainer(prepared).train().losses


@pytest.mark.parametrize("packing", ["pack", "pad", "dynamic"])
def test_instruction_data_trains_evaluates_and_resumes(tmp_path: Path, corpus: dict, packing: str) -> None:
    data = {"kind": "instruction", "train_files": [str(corpus["root"] / "train.jsonl")],
            "eval_files": [str(corpus["root"] / "eval.jsonl")], "tokenizer": str(corpus["tok"]),
            "packing": packing}
    # A constant LR, so that a run cut short at step 3 has the weights of the full run's step 3.
    cfg = _config(tmp_path, data, max_steps=6, save_steps=3, micro_batch_size=2, decay_style="constant")
    full = Trainer(cfg).train(overwrite=True)
    assert full.step == 6 and all(math.isfinite(v) for v in full.losses.values())
    assert full.eval is not None and math.isfinite(full.eval["loss"])
    # Resuming from step 3 gives the uninterrupted run's losses for steps 4-6.
    resumed_cfg = with_changes(cfg, train={"output_dir": str(tmp_path / "resumed")})
    Trainer(with_changes(resumed_cfg, train={"max_steps": 3})).train()
    resumed = Trainer(resumed_cfg).train(resume="auto")
    assert [resumed.losses[s] for s in (4, 5, 6)] == pytest.approx([full.losses[s] for s in (4, 5, 6)], abs=1e-6)
