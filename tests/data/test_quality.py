"""The quality heuristics (data/quality.py) on the bundled real corpora (English novels, Chinese classics)
cut into passages, and on junk injected among them: each kind of junk removed by its rule, the real
passages kept."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from shardwise.config import DataConfig
from shardwise.data import build_data, prepare_corpus
from shardwise.data.quality import RULES, quality_problem
from shardwise.data.tokenizer import load_tokenizer

CORPORA = Path(__file__).resolve().parents[2] / "corpora"


def _english_passages() -> list[str]:
    """Austen's novels in passages of consecutive paragraphs, at least 200 words each."""
    out = []
    for path in sorted((CORPORA / "austen").glob("*.txt")):
        current: list[str] = []
        for paragraph in (p.strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))):
            if paragraph:
                current.append(paragraph)
            if sum(len(p.split()) for p in current) >= 200:
                out.append("\n\n".join(current))
                current = []
    return out


def _chinese_passages() -> list[str]:
    """The Chinese classics in passages of consecutive lines, at least 300 characters each."""
    out = []
    for path in sorted((CORPORA / "zh_classics").glob("*.txt")):
        current: list[str] = []
        for line in (x.strip() for x in path.read_text(encoding="utf-8").splitlines()):
            if line:
                current.append(line)
            if sum(len(x) for x in current) >= 300:
                out.append("\n".join(current))
                current = []
    return out


@pytest.fixture(scope="module")
def english() -> list[str]:
    return _english_passages()


@pytest.fixture(scope="module")
def chinese() -> list[str]:
    return _chinese_passages()[::3]  # a third of them: the whole set takes ~10 s on this CPU


def test_real_passages_are_kept(english: list[str], chinese: list[str]) -> None:
    """Measured on all of them: 2,613 Austen passages, 1 removed (0.04%: a page of riddles, repeated
    n-grams); 7,164 passages of the classics, 2.35% removed (2.28% repeated n-grams, 0.07% repeated lines:
    verse and parallel prose repeat phrases by design). Here every third Chinese passage."""
    en = Counter(quality_problem(p) for p in english)
    zh = Counter(quality_problem(p) for p in chinese)
    assert len(english) > 2000 and len(chinese) > 2000
    assert en[None] / len(english) >= 0.999, en
    assert zh[None] / len(chinese) >= 0.97, zh
    assert set(en) | set(zh) <= set(RULES) | {None}


def _mis_decoded(text: str) -> str:
    return text.encode("utf-8").decode("latin-1")


def _junk(english: list[str], chinese: list[str]) -> dict[str, list[str]]:
    """Kinds of junk a web crawl holds, each built from real text where it can be, by the rule that
    should catch it."""
    rng = random.Random(0)
    en, zh = english[10], chinese[10]
    accented = en.replace("'", "\u2019").replace("e ", "\u00e9 ")
    # text decoded with the wrong table: box drawing, shapes and control characters between the words
    soup = "".join(chr(rng.choice([rng.randrange(0x2500, 0x2600), rng.randrange(0x01, 0x09)])) for _ in range(600))
    snippet_lines = "\n".join(f"{' '.join(en.split()[i:i + 12])}..." for i in range(0, 240, 12))
    menu = "\n".join(f"- {w}" for w in en.split()[:80])
    code = "\n".join(line for i in range(10) for line in (
        f"def read_{i}(path_{i}):", f"    with open(path_{i}) as f{i}: {{", f"        data_{i} = f{i}.read({i});",
        f"        total_{i} += len(data_{i});", "    }", f"    return data_{i}[{i}:];"))
    return {
        "short": ["Home | About us | Contact", "点击这里", "Copyright 2024. All rights reserved."],
        "mojibake": [_mis_decoded(accented), _mis_decoded(zh),
                     "".join(c if rng.random() > 0.01 else "\ufffd" for c in en)],
        "garbled": [soup + " " + " ".join(en.split()[:60])],
        "word_length": [" ".join("a b c d e f g h".split() * 20), " ".join(["Pneumonoultramicroscopic"] * 60)],
        "symbols": [" ".join(f"#{w}" for w in en.split()[:80])],
        "bullets": [menu],
        "ellipsis_lines": [snippet_lines],
        "repeated_lines": ["\n".join([en.splitlines()[0]] * 12 + en.splitlines()[1:4])],
        "repeated_paragraphs": ["\n\n".join([" ".join(en.split()[:30])] * 5 + [" ".join(en.split()[30:60])]),
                                "\n\n".join(["\n".join(en.splitlines()[:3])] * 4 + en.split("\n\n")[1:3])],
        "repeated_ngrams": [" ".join(["buy cheap watches online"] * 40), "买便宜的手表" * 40],
        "code": [code],
    }


def test_injected_junk_is_removed_by_its_rule(english: list[str], chinese: list[str]) -> None:
    for rule, documents in _junk(english, chinese).items():
        for text in documents:
            # A repeated paragraph is made of repeated lines, which are checked first.
            expected = {rule, "repeated_lines"} if rule == "repeated_paragraphs" else {rule}
            assert quality_problem(text) in expected, (rule, quality_problem(text), text[:80])


def test_preparation_removes_counts_and_samples_by_rule(english: list[str], chinese: list[str], tmp_path: Path,
                                                        tiny_tokenizer_dir: Path) -> None:
    """`shardwise prepare --quality default` (and data.quality: default): the junk among real passages
    removed, counted by rule in the manifest, a sample of each rule's removals beside it; off by default."""
    junk = _junk(english, chinese)
    documents = english[:20] + chinese[:20] + [t for texts in junk.values() for t in texts]
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in documents),
                      encoding="utf-8")
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    manifest = prepare_corpus([str(corpus)], tokenizer, tmp_path / "clean", quality="default")
    removed = manifest["counts"]["removed_by_quality"]
    assert manifest["num_documents"] == 40 and sum(removed.values()) == len(documents) - 40
    assert removed["mojibake"] == 3 and removed["code"] == 1 and removed["short"] == 3
    samples = [json.loads(line) for line in (tmp_path / "clean" / "removed_samples.jsonl").read_text(
        encoding="utf-8").splitlines()]
    assert Counter(s["rule"] for s in samples) == Counter(removed) and all(s["text"] for s in samples)
    plain = prepare_corpus([str(corpus)], tokenizer, tmp_path / "plain")
    assert plain["num_documents"] == len(documents) and "removed_by_quality" not in plain["counts"]
    assert "quality" not in plain["options"]  # caches prepared before the option keep their keys
    data = DataConfig(train_files=[str(corpus)], tokenizer=str(tiny_tokenizer_dir), quality="default", seq_length=16,
                      cache_dir=str(tmp_path / "cache"), dedup="near", near_dedup={"bands": 20, "rows": 5},
                      boilerplate_lines=200)  # no line recurs 200 times here: the verdicts stay
    _, train, _ = build_data(data, vocab_size=400)
    manifest = train.source.manifest  # the automatic preparation applies every filter of the data section
    assert manifest["counts"]["removed_by_quality"] == removed
    assert manifest["options"]["near_dedup"] == {"ngram": 5, "bands": 20, "rows": 5}
    assert manifest["options"]["boilerplate_lines"] == 200 and "near_duplicates" in manifest["counts"]
