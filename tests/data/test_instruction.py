"""Instruction data: alpaca and chat records, labels on the assistant turns only, packing / padding /
dynamic batches, bad records named by file and line, the token cache, the seed usage."""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardwise.data.instruction as instruction
from shardwise.data import Tokenizer, create_dataset, load_tokenizer
from shardwise.data.chat import encode_conversation
from shardwise.data.instruction import InstructionDataset, batch_by_budget, pack_best_fit
from shardwise.errors import DataError

from .test_chat import CHAT_TEMPLATE, SYSTEM, TWO_TURNS, expected_chat_template_labels, write_jsonl

IGNORE = -100


def alpaca(i: int, words: int = 3) -> dict[str, str]:
    """A deterministic alpaca record whose answer grows with `words`."""
    return {
        "instruction": f"Tell me of the ball {i}.",
        "input": "She was at the house." if i % 2 else "",
        "output": " ".join(["the evening walk"] * words) + f" {i}.",
    }


def rows_of(ds: InstructionDataset) -> list[dict[str, torch.Tensor]]:
    """Every item of a pack/pad dataset as a [T] dict."""
    return [ds[i] for i in range(len(ds))]


def labelled(row: dict[str, torch.Tensor]) -> list[int]:
    """Target ids of a row, in order."""
    lab = row["labels"]
    return lab[lab != IGNORE].tolist()


def assert_labels_are_next_tokens(row: dict[str, torch.Tensor]) -> None:
    """Every target is the next input token of the same document: nothing crosses samples."""
    ids, lab, doc = row["input_ids"], row["labels"], row["document_ids"]
    where = (lab != IGNORE).nonzero().flatten()
    assert len(where) > 0
    assert int(where.max()) < ids.shape[-1] - 1
    assert torch.equal(lab[where], ids[where + 1])
    assert torch.equal(doc[where], doc[where + 1])


def copy_with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of a tokenizer directory whose tokenizer_config.json holds `template`."""
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return dst


# --- labels -----------------------------------------------------------------------------------------


def test_chat_labels_exactly_on_both_assistant_turns(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    ds = InstructionDataset(f, tok, 128, template="default", packing="pad")
    (row,) = rows_of(ds)
    assert_labels_are_next_tokens(row)
    answer1, answer2 = tok.encode(" Her sister, at the house."), tok.encode(" It was for Darcy.")
    assert labelled(row) == [*answer1, tok.eos_id, *answer2, tok.eos_id]
    lab = row["labels"]
    spans = tok.decode(lab[lab != IGNORE].tolist(), skip_special_tokens=False).split(tok.eos_token)
    assert [s.strip() for s in spans] == ["Her sister, at the house.", "It was for Darcy.", ""]
    assert ds.stats["target_tokens"] == len(answer1) + len(answer2) + 2


def test_alpaca_labels_exactly_on_output(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    records = [alpaca(0), alpaca(1), {**alpaca(2), "system": SYSTEM}]
    f = write_jsonl(tmp_path / "alpaca.jsonl", records)
    ds = InstructionDataset(f, tok, 96, template="default", packing="pad", shuffle=False)
    assert len(ds) == 3 and ds.stats["samples"] == 3
    got = sorted(rows_of(ds), key=lambda r: r["input_ids"].tolist())
    want = []
    for r in records:
        user = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
        if "system" in r:
            user = f"{r['system']}\n\n{user}"
        prompt = [tok.bos_id, *tok.encode(f"[INST] {user} [/INST]")]
        answer = [*tok.encode(" " + r["output"]), tok.eos_id]
        want.append((prompt + answer, answer))
    want.sort()
    for row, (ids, answer) in zip(got, want):
        n = len(ids)
        assert row["input_ids"][:n].tolist() == ids
        assert labelled(row) == answer
        assert_labels_are_next_tokens(row)
        assert tok.decode(labelled(row)).strip() in {r["output"] for r in records}


def test_tokenizer_chat_template_from_config_labels_assistant_content(
    tmp_path: Path, tiny_tokenizer_dir: Path
) -> None:
    tok = load_tokenizer(copy_with_chat_template(tiny_tokenizer_dir, tmp_path / "tok", CHAT_TEMPLATE))
    assert getattr(tok, "chat_template", None) == CHAT_TEMPLATE
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    ds = InstructionDataset(f, tok, 160, packing="pad")  # template="auto" picks the tokenizer's
    assert ds.template_name.startswith("jinja")
    (row,) = rows_of(ds)
    assert_labels_are_next_tokens(row)
    answers = ["Her sister, at the house.", "It was for Darcy."]
    assert labelled(row) == expected_chat_template_labels(tok, answers)
    n = int((row["document_ids"] == 0).sum())
    text = tok.decode(row["input_ids"][:n].tolist(), skip_special_tokens=False)
    assert text == (
        f"<|bos|><|system|>\n{SYSTEM}<|eos|>\n<|user|>\nWho is Jane?<|eos|>\n"
        "<|assistant|>\nHer sister, at the house.<|eos|>\n<|user|>\nAnd the letter?<|eos|>\n"
        "<|assistant|>\nIt was for Darcy.<|eos|>\n"
    )


# --- packing modes ----------------------------------------------------------------------------------


def sample_multiset(ds: InstructionDataset) -> Counter:
    return Counter(tuple(ds.sample(i)[0].tolist()) for i in range(ds.stats["samples"]))


def test_pack_mode_keeps_samples_apart(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    records = [alpaca(i, words=1 + i % 4) for i in range(12)] + [{"messages": TWO_TURNS}]
    f = write_jsonl(tmp_path / "mix.jsonl", records)
    T = 96
    ds = InstructionDataset(f, tiny_tokenizer, T, packing="pack", template="default")
    assert ds.stats["samples"] == 13 and ds.stats["truncated"] == 0
    assert len(ds) < 13  # several samples share rows
    seen: Counter = Counter()
    total_docs = 0
    for row in rows_of(ds):
        ids, doc, pos, lab = row["input_ids"], row["document_ids"], row["position_ids"], row["labels"]
        assert ids.shape == (T,) and ids.dtype == torch.int64
        assert bool((doc[1:] >= doc[:-1]).all())
        assert_labels_are_next_tokens(row)
        n_real = int((doc < doc.max()).sum()) if ids[-1] == tiny_tokenizer.pad_id else T
        for d in doc.unique().tolist():
            at = (doc == d).nonzero().flatten()
            assert pos[at].tolist() == list(range(len(at)))  # positions restart per document
            # The last token of a document never has a target (it would be the next document's first).
            assert lab[at[-1]] == IGNORE
            if at[0] < n_real:
                seen[tuple(ids[at].tolist())] += 1
                total_docs += 1
                assert ids[at[0]] == tiny_tokenizer.bos_id
        assert bool((lab[n_real:] == IGNORE).all()) and bool((ids[n_real:] == tiny_tokenizer.pad_id).all())
    assert total_docs == 13
    assert seen == sample_multiset(ds)
    batch = ds.get_batch([0, len(ds) - 1])
    assert torch.equal(batch["document_ids"][1], ds[len(ds) - 1]["document_ids"])


def test_pack_best_fit_beats_next_fit_and_places_every_sample_once() -> None:
    lengths = np.array([6, 5, 4, 3, 2])
    rows = pack_best_fit(lengths, 10)
    assert len(rows) == 2
    assert sorted(np.concatenate(rows).tolist()) == [0, 1, 2, 3, 4]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 51, size=400)
    rows = pack_best_fit(lengths, 50, seed=3)
    assert sorted(np.concatenate(rows).tolist()) == list(range(400))
    assert max(int(lengths[r].sum()) for r in rows) <= 50
    next_fit, free = 0, 0
    for n in lengths.tolist():
        if n > free:
            next_fit, free = next_fit + 1, 50
        free -= n
    lower_bound = int(np.ceil(lengths.sum() / 50))
    assert lower_bound <= len(rows) < next_fit
    assert len(rows) <= 11 / 9 * lower_bound + 1  # the best-fit-decreasing guarantee


def test_pad_mode_one_sample_per_row(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    f = write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(5)])
    T = 80
    ds = InstructionDataset(f, tok, T, packing="pad", template="default")
    assert len(ds) == 5
    for i, row in enumerate(rows_of(ds)):
        ids, _ = ds.sample(i)
        n = len(ids)
        assert row["input_ids"][:n].tolist() == ids.tolist()
        assert bool((row["input_ids"][n:] == tok.pad_id).all())
        assert row["document_ids"].tolist() == [0] * n + [1] * (T - n)
        assert row["position_ids"].tolist() == list(range(n)) + list(range(T - n))
        assert bool((row["labels"][n - 1 :] == IGNORE).all())
        assert_labels_are_next_tokens(row)
    assert ds.stats["padding_tokens"] == 5 * T - ds.stats["tokens"]


def test_dynamic_batches_respect_the_budget_and_cover_every_sample_once(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    f = write_jsonl(tmp_path / "a.jsonl", [alpaca(i, words=1 + (i * 7) % 9) for i in range(30)])
    T, budget = 96, 200
    ds = InstructionDataset(f, tiny_tokenizer, T, packing="dynamic", token_budget=budget, template="default")
    assert ds.items_are_batches is True
    assert ds.stats["samples"] == 30
    seen: Counter = Counter()
    for k in range(len(ds)):
        b = ds[k]
        rows, width = b["input_ids"].shape
        assert rows * width <= budget
        lengths = [int((doc == 0).sum()) for doc in b["document_ids"]]
        assert max(lengths) == width  # padded to the longest of the batch, not to T
        for r in range(rows):
            seen[tuple(b["input_ids"][r, : lengths[r]].tolist())] += 1
            assert_labels_are_next_tokens({key: v[r] for key, v in b.items()})
    assert seen == sample_multiset(ds)
    assert sum(seen.values()) == 30
    loader = create_dataset(ds, batch_size=1)
    (mb,) = next(iter(loader))
    assert mb["input_ids"].shape[0] * mb["input_ids"].shape[1] <= budget
    with pytest.raises(DataError, match="token_budget 50 is below max_seq_len 96"):
        InstructionDataset(f, tiny_tokenizer, T, packing="dynamic", token_budget=50)


def test_batch_by_budget_is_deterministic_and_sorted() -> None:
    lengths = np.random.default_rng(1).integers(2, 40, size=100)
    a, b = batch_by_budget(lengths, 120, seed=5), batch_by_budget(lengths, 120, seed=5)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert sorted(np.concatenate(a).tolist()) == list(range(100))
    assert all(len(x) * lengths[x].max() <= 120 for x in a)


def test_truncate_and_drop_counts(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    short = [alpaca(i, words=1) for i in range(4)]
    long = [alpaca(10 + i, words=12) for i in range(3)]
    long_prompt = [{"instruction": "the house " * 60, "output": "yes"}]  # its answer is beyond any cut
    f = write_jsonl(tmp_path / "a.jsonl", short + long + long_prompt)
    def length(r: dict[str, str]) -> int:
        user = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]
        return len(encode_conversation(messages, tok, "default")[0])

    lengths = [length(r) for r in short + long + long_prompt]
    T = 64
    assert max(lengths[:4]) <= T and min(lengths[4:]) > T
    cut = InstructionDataset(f, tok, T, truncation="truncate", packing="pad", template="default")
    assert cut.stats["truncated"] == 4 and cut.stats["dropped_too_long"] == 0
    assert cut.stats["dropped_no_target"] == 1 and cut.stats["samples"] == 7
    assert max(cut.sample(i)[0].size for i in range(7)) == T
    for row in rows_of(cut):
        assert_labels_are_next_tokens(row)
    drop = InstructionDataset(f, tok, T, truncation="drop", packing="pad", template="default")
    assert drop.stats["dropped_too_long"] == 4 and drop.stats["truncated"] == 0
    assert drop.stats["dropped_no_target"] == 0 and drop.stats["samples"] == 4
    with pytest.raises(DataError, match="no instruction sample is left"):
        InstructionDataset(str(tmp_path / "a.jsonl"), tok, 8, truncation="drop")


# --- bad records ------------------------------------------------------------------------------------


GOOD = {"instruction": "Tell me of the ball.", "output": "It was in the evening."}


def test_bad_lines_stop_or_skip_with_file_and_line(
    tmp_path: Path, tiny_tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    f = write_jsonl(tmp_path / "bad.jsonl", [
        GOOD,
        "{not json",
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"instruction": "no answer here"},
        "",
        {"text": "a pretraining line"},
        {"messages": TWO_TURNS},
    ])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: is not JSON .*on_bad_line='skip'"):
        InstructionDataset(f, tiny_tokenizer, 128)
    with caplog.at_level(logging.WARNING, logger="shardwise.data.instruction"):
        ds = InstructionDataset(f, tiny_tokenizer, 128, on_bad_line="skip", template="default")
    assert ds.stats["bad_lines"] == 4 and ds.stats["records"] == 2 and ds.stats["samples"] == 2
    text = caplog.text
    assert f"{f}:2: is not JSON" in text
    assert f"{f}:3: message 0 has role 'narrator'" in text
    assert f"{f}:4: missing field 'output'" in text
    assert f"{f}:6: matches neither shape" in text


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"output": "x"}, "missing field 'instruction'"),
        ({"instruction": "x", "output": 3}, "field 'output' is a int"),
        ({"instruction": "", "input": "", "output": "x"}, "both empty"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "message 0 \\(user\\) has no 'content'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "'user' was expected"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
         "message 1 is 'system' where 'assistant' was expected"),
        ([1, 2], "is a JSON list, not an object"),
    ],
)
def test_bad_records_are_named(tmp_path: Path, tiny_tokenizer: Tokenizer, record: Any, match: str) -> None:
    f = write_jsonl(tmp_path / "one.jsonl", [GOOD, record])
    with pytest.raises(DataError, match=rf"one\.jsonl:2: .*{match}"):
        InstructionDataset(f, tiny_tokenizer, 64)


def test_empty_binary_and_missing_inputs(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty.jsonl' is empty"):
        InstructionDataset(str(empty), tiny_tokenizer, 64)
    with pytest.raises(DataError, match="matches no file"):
        InstructionDataset(str(tmp_path / "nothing" / "*.jsonl"), tiny_tokenizer, 64)
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    # A binary file is refused whole, as for pre-training, also when bad lines are skipped.
    for mode in ("stop", "skip"):
        with pytest.raises(DataError, match=r"blob\.jsonl looks like a binary file.*NUL byte at offset 8"):
            InstructionDataset(str(binary), tiny_tokenizer, 64, on_bad_line=mode)
    latin = tmp_path / "latin1.jsonl"  # text in another encoding: one bad line, not a binary file
    latin.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"instruction": "caf\xe9", "output": "x"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: is not valid UTF-8"):
        InstructionDataset(str(latin), tiny_tokenizer, 64)
    txt = tmp_path / "notes.txt"
    txt.write_text("hello\n", encoding="utf-8")
    with pytest.raises(DataError, match="is not JSON lines"):
        InstructionDataset(str(txt), tiny_tokenizer, 64)
    with pytest.raises(DataError, match="packing='packed' is not one of pack, pad, dynamic"):
        InstructionDataset(str(empty), tiny_tokenizer, 64, packing="packed")


def test_json_array_file_and_unanswered_last_turn(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    arr = tmp_path / "alpaca_data.json"
    arr.write_text(json.dumps([alpaca(0), alpaca(1)]), encoding="utf-8")
    assert InstructionDataset(str(arr), tiny_tokenizer, 96).stats["samples"] == 2
    arr.write_text(json.dumps([alpaca(0), {"instruction": "x"}]), encoding="utf-8")
    with pytest.raises(DataError, match=r"alpaca_data\.json item 1: missing field 'output'"):
        InstructionDataset(str(arr), tiny_tokenizer, 96)
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS + [{"role": "user", "content": "More?"}]}])
    ds = InstructionDataset(f, tiny_tokenizer, 160, packing="pad", template="default")
    assert ds.stats["unanswered_dropped"] == 1
    full, _ = encode_conversation(TWO_TURNS, tiny_tokenizer, "default")
    assert ds.sample(0)[0].tolist() == full


# --- caching and the seed usage ---------------------------------------------------------------------


def test_cache_is_reused_and_keyed_by_file_and_template(
    tmp_path: Path, tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(4)])
    cache = tmp_path / "cache"
    first = InstructionDataset(f, tiny_tokenizer, 96, cache_dir=str(cache), template="default")
    assert len(list(cache.glob("sft-*.npz"))) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp file left

    def no_tokenizing(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tokenized again instead of using the cache")

    monkeypatch.setattr(instruction, "_tokenize_records", no_tokenizing)
    again = InstructionDataset(f, tiny_tokenizer, 96, cache_dir=str(cache), template="default", packing="pad")
    assert [again.sample(i)[0].tolist() for i in range(4)] == [
        first.sample(i)[0].tolist() for i in range(4)
    ]
    monkeypatch.undo()
    other = {"user": "{content}", "assistant": "{content}"}
    InstructionDataset(f, tiny_tokenizer, 96, cache_dir=str(cache), template=other)
    write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(5)])
    changed = InstructionDataset(f, tiny_tokenizer, 96, cache_dir=str(cache), template="default")
    assert changed.stats["samples"] == 5
    assert len(list(cache.glob("sft-*.npz"))) == 3


def test_seed_usage_with_create_dataset(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    path = write_jsonl(tmp_path / "sft.jsonl", [alpaca(i) for i in range(10)] + [{"messages": TWO_TURNS}] * 2)
    dataset = InstructionDataset(
        data_files=str(tmp_path / "*.jsonl"), tokenizer=tiny_tokenizer, max_seq_len=64
    )
    assert dataset.files == [path]
    dataloader = create_dataset(dataset, batch_size=2, distributed=True)
    steps = list(iter(dataloader))
    assert len(steps) == math.ceil(len(dataset) / 2) >= 2
    for (mb,) in steps:
        assert set(mb) == {"input_ids", "labels", "position_ids", "document_ids"}
        assert mb["input_ids"].shape == (2, 64) and mb["labels"].dtype == torch.int64
        assert int((mb["labels"] != IGNORE).sum()) > 0


def test_ignore_index_matches_the_trainer() -> None:
    from shardwise.loss import IGNORE_INDEX

    assert instruction.IGNORE_INDEX == IGNORE_INDEX
