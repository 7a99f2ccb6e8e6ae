"""Near-duplicate removal (data/duplicates.py) against the maths (exact Jaccard similarity of shingle sets,
the LSH collision probability), on the bundled real corpora with edited copies injected; boilerplate lines
(data/boilerplate.py) against exact counts; and preparation by parts (data/prepare_parts.py) against one
process over the same inputs."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from shardwise.data import prepare_corpus
from shardwise.data.boilerplate import BoilerplateLines, sketch_width
from shardwise.data.duplicates import NEAR_DEFAULTS, DuplicateIndex, band_keys, document_keys, minhash
from shardwise.data.prepare_parts import merge_parts, part_files, part_path, prepare_part
from shardwise.data.shards import MANIFEST_FILE, TokenShards
from shardwise.errors import DataError
from tests.data.test_quality import _chinese_passages, _english_passages

HASHES = NEAR_DEFAULTS["bands"] * NEAR_DEFAULTS["rows"]


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Word 5-grams, words found independently of the code under test (ASCII letters and digits; a CJK
    character is a word)."""
    words = re.findall(r"[\u4e00-\u9fff]|[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(max(len(words) - n + 1, 1))}


def _jaccard(a: str, b: str) -> float:
    x, y = _shingles(a), _shingles(b)
    return len(x & y) / len(x | y)


def _edited(text: str, rng: random.Random, share: float) -> str:
    """`text` with `share` of its words replaced by a word it does not contain (in Chinese, characters)."""
    chinese = bool(re.search(r"[\u4e00-\u9fff]", text))
    words = list(text) if chinese else text.split(" ")
    for _ in range(max(1, int(len(words) * share))):
        words[rng.randrange(len(words))] = "乙" if chinese else f"qz{rng.randrange(10**6)}"
    return "".join(words) if chinese else " ".join(words)


@pytest.fixture(scope="module")
def english() -> list[str]:
    return [p for p in _english_passages() if p.isascii()]


@pytest.fixture(scope="module")
def pairs(english: list[str]) -> list[tuple[str, str, float]]:
    """Passages and edited copies over the whole range of similarity, with their exact Jaccard similarity."""
    rng = random.Random(0)
    out = []
    for i, text in enumerate(english[:400]):
        copy = _edited(text, rng, rng.uniform(0.0, 0.12))
        out.append((text, copy, _jaccard(text, copy)))
    return out


def test_minhash_estimates_the_jaccard_similarity(pairs: list[tuple[str, str, float]]) -> None:
    z = []
    for a, b, j in pairs:
        sig = minhash([a, b], 5, HASHES)
        estimate = float((sig[0] == sig[1]).mean())
        sd = max(np.sqrt(j * (1 - j) / HASHES), 1e-3)
        z.append((estimate - j) / sd)
    z = np.array(z)
    # Unbiased, with the binomial spread of HASHES independent permutations.
    assert abs(z.mean()) < 4 / np.sqrt(len(z)), z.mean()
    assert 0.7 < z.std() < 1.3, z.std()
    assert {j for *_, j in pairs} and min(j for *_, j in pairs) < 0.5 < 0.9 < max(j for *_, j in pairs)


def test_band_collisions_follow_the_lsh_formula(pairs: list[tuple[str, str, float]]) -> None:
    bands, rows = NEAR_DEFAULTS["bands"], NEAR_DEFAULTS["rows"]
    expected = observed = variance = 0.0
    for a, b, j in pairs:
        keys = band_keys(minhash([a, b], 5, HASHES), bands, rows)
        p = 1 - (1 - j**rows) ** bands
        expected += p
        variance += p * (1 - p)
        observed += bool((keys[0] == keys[1]).any())
    assert abs(observed - expected) < 4 * np.sqrt(variance) + 1, (observed, expected)
    # and the rows of a band are not mixed up: 8 rows in one band need all 8 to agree
    sig = np.arange(2 * HASHES, dtype=np.uint64).reshape(2, HASHES)
    other = sig.copy()
    other[:, 0] += 1  # one value differs in band 0 only
    assert (band_keys(sig, bands, rows)[:, 1:] == band_keys(other, bands, rows)[:, 1:]).all()
    assert (band_keys(sig, bands, rows)[:, 0] != band_keys(other, bands, rows)[:, 0]).all()


def _injected(passages: list[str], share: float, seed: int) -> tuple[list[str], list[int]]:
    """The passages with an edited copy of every 10th inserted somewhere after it; the copies' positions."""
    rng = random.Random(seed)
    docs = list(passages)
    copies = []
    for i in range(0, len(passages), 10):
        docs.append(_edited(passages[i], rng, share))
        copies.append(len(docs) - 1)
    return docs, copies


@pytest.mark.parametrize("language", ["english", "chinese"])
def test_edited_copies_are_removed_and_real_passages_kept(english: list[str], language: str) -> None:
    passages = english if language == "english" else _chinese_passages()[::2]
    # a word in 100 changed, a character in 200 in Chinese (each change breaks five 5-grams)
    docs, copies = _injected(passages, 0.01 if language == "english" else 0.005, seed=1)
    assert all(_jaccard(docs[c], passages[10 * k]) > 0.9 for k, c in enumerate(copies))
    exact, near = DuplicateIndex(1 + NEAR_DEFAULTS["bands"]).add(document_keys(docs, NEAR_DEFAULTS))
    removed = set(np.flatnonzero(exact | near))
    assert set(copies) <= removed  # each copy comes after its original: the copy goes, the original stays
    real_removed = removed - set(copies)
    # Measured: no real passage goes (0 of 2,612 English, 0 of 3,582 Chinese); verse that repeats might.
    assert len(real_removed) <= 0.005 * len(passages), (language, len(real_removed), len(passages))
    for i in real_removed:  # and those that go have a real near twin earlier
        assert max(_jaccard(docs[i], docs[k]) for k in range(i)) > 0.5


def _write_jsonl(directory: Path, docs: list[str], files: int) -> list[str]:
    directory.mkdir()
    paths = []
    for k in range(files):
        path = directory / f"part{k:02d}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[k::files]), encoding="utf-8")
        paths.append(str(path))
    return paths


def test_parts_then_merge_equal_one_process(tmp_path: Path, english: list[str], tiny_tokenizer) -> None:
    docs, _ = _injected(english[:600], 0.01, seed=2)
    docs += docs[:5]  # exact duplicates, in the last files
    random.Random(3).shuffle(docs)
    files = _write_jsonl(tmp_path / "in", docs, 7)
    options = {"dedup": "near", "quality": "default", "shard_tokens": 50_000, "max_length": 1200}
    one = prepare_corpus(files, tiny_tokenizer, tmp_path / "one", workers=1, **options)
    for i in range(3):
        prepare_part(files, tiny_tokenizer, tmp_path / "merged", f"{i}/3", workers=2 if i == 1 else 1, **options)
    merged = merge_parts(tmp_path / "merged", tiny_tokenizer)
    assert len(one["shards"]) > 2
    assert [(s["blake2b"], s["index_blake2b"]) for s in merged["shards"]] == \
        [(s["blake2b"], s["index_blake2b"]) for s in one["shards"]]
    assert merged["counts"] == one["counts"]
    assert one["counts"]["near_duplicates"] >= 60 and one["counts"]["duplicates"] == 5
    assert 0 < one["counts"]["truncated"] < one["num_documents"]
    assert [f["path"] for f in merged["inputs"]] == files
    samples = [json.loads(line) for line in (tmp_path / "merged" / "removed_samples.jsonl").open()]
    assert sum(s["rule"] == "near_duplicate" for s in samples) == 20
    # duplicates across parts are found: each part alone keeps more
    assert sum(TokenShards(part_path(tmp_path / "merged", i, 3), part_ok=True).num_documents for i in range(3)) \
        == one["num_documents"] + one["counts"]["near_duplicates"] + one["counts"]["duplicates"]


def test_parts_cut_the_inputs_into_runs_of_whole_files(tmp_path: Path, english: list[str]) -> None:
    from shardwise.data.files import resolve_inputs

    files = resolve_inputs(_write_jsonl(tmp_path / "in", english[:300], 10))
    for n in (1, 3, 4, 10, 13):
        runs = [part_files(files, i, n) for i in range(n)]
        assert [f for run in runs for f in run] == files
        sizes = [sum(f.bytes for f in run) for run in runs]
        if n <= 4:
            assert max(sizes) - min(sizes) <= max(f.bytes for f in files) * 1.01


def test_a_part_is_not_training_data_and_the_merge_checks_the_parts(
    tmp_path: Path, english: list[str], tiny_tokenizer
) -> None:
    files = _write_jsonl(tmp_path / "in", english[:200], 4)
    out = tmp_path / "corpus"
    prepare_part(files, tiny_tokenizer, out, "0/2", dedup="near", workers=1)
    with pytest.raises(DataError, match=r"lacks 1 of 2 parts \(1\)"):
        merge_parts(out, tiny_tokenizer)
    with pytest.raises(DataError, match="one part of a preparation.*--merge"):
        TokenShards(part_path(out, 0, 2))
    prepare_part(files, tiny_tokenizer, out, "1/2", dedup="exact", workers=1)
    with pytest.raises(DataError, match="part part-00001-of-00002 was prepared with other options"):
        merge_parts(out, tiny_tokenizer)
    prepare_part(files, tiny_tokenizer, out, "1/2", dedup="near", workers=1, overwrite=True)
    keys = part_path(out, 1, 2) / "document_keys.bin"
    data = bytearray(keys.read_bytes())
    data[8] ^= 1
    keys.write_bytes(bytes(data))
    with pytest.raises(DataError, match="document_keys.bin changed after preparation"):
        merge_parts(out, tiny_tokenizer)
    prepare_part(files, tiny_tokenizer, out, "1/2", dedup="near", workers=1, overwrite=True)
    manifest = merge_parts(out, tiny_tokenizer)
    assert TokenShards(out, tiny_tokenizer).num_documents == manifest["num_documents"] > 150
    assert "part" not in json.loads((out / MANIFEST_FILE).read_text())
    with pytest.raises(DataError, match="part 3/2"):
        prepare_part(files, tiny_tokenizer, out, "3/2")


def test_exact_dedup_is_still_the_default(tmp_path: Path, corpus_files: list[str], tiny_tokenizer) -> None:
    copy = tmp_path / "copy.txt"
    copy.write_text(Path(corpus_files[0]).read_text(encoding="utf-8"), encoding="utf-8")
    manifest = prepare_corpus(corpus_files + [str(copy)], tiny_tokenizer, tmp_path / "out", workers=1)
    assert manifest["options"]["dedup"] is True and "near_dedup" not in manifest["options"]
    assert manifest["counts"]["duplicates"] == 1 and "near_duplicates" not in manifest["counts"]
    with pytest.raises(DataError, match="dedup must be one of"):
        prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "bad", dedup="fuzzy")
    with pytest.raises(DataError, match="near-duplicate option bands must be a positive integer"):
        prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "bad", dedup="near", near_dedup={"bands": 0})


def _exact_boilerplate(docs: list[str], min_docs: int) -> list[str]:
    """The rule of data/boilerplate.py with exact counts (a dict), as the reference."""
    seen: dict[str, int] = {}
    out = []
    for text in docs:
        lines = text.split("\n")
        keys = {line.strip() for line in lines if len(line.strip()) >= 20}
        out.append("\n".join(line for line in lines if not (line.strip() in keys and seen.get(line.strip(), 0)
                                                             >= min_docs)))
        for k in keys:
            seen[k] = seen.get(k, 0) + 1
    return out


def test_boilerplate_lines_are_removed_and_real_lines_kept(tmp_path: Path, english: list[str], tiny_tokenizer) -> None:
    rng = random.Random(4)
    footer = ["Share this article on Facebook and Twitter", "Copyright 2026 Example Media. All rights reserved.",
              "Accept cookies to continue reading this page"]
    docs = []
    for i, text in enumerate(english[:1500]):
        lines = text.split("\n")
        if i % 4 == 0:  # a quarter of the pages carry the site's chrome, at random places
            for line in footer:
                lines.insert(rng.randrange(len(lines) + 1), line)
        docs.append("\n".join(lines))
    cleaner = BoilerplateLines(5, sketch_width(sum(len(d) for d in docs)))
    cleaned = [cleaner.clean(d) for d in docs]
    assert cleaned == _exact_boilerplate(docs, 5)  # the sketch's counts are exact here
    assert sum(any(f in c for f in footer) for c in cleaned) == 5  # the first five pages keep it
    for d, c in zip(english[:1500], cleaned):
        assert c == d or set(d.split("\n")) - set(c.split("\n")) == set()  # only chrome went
    assert cleaner.lines_removed == 3 * (375 - 5)
    # a sketch far too small for its lines overcounts, and so removes real lines: the width matters
    tiny = BoilerplateLines(5, 64)
    assert sum(c != d for c, d in zip((tiny.clean(d) for d in english[:1500]), english[:1500])) > 100
    files = _write_jsonl(tmp_path / "in", docs, 3)
    manifest = prepare_corpus(files, tiny_tokenizer, tmp_path / "out", boilerplate_lines=5, workers=1)
    assert manifest["counts"]["boilerplate_lines"] == 3 * (375 - 5)
    samples = [json.loads(line) for line in (tmp_path / "out" / "removed_samples.jsonl").open()]
    assert {s["text"] for s in samples if s["rule"] == "boilerplate_line"} == set(footer)
    with pytest.raises(DataError, match="boilerplate_lines must be 0"):
        prepare_corpus(files, tiny_tokenizer, tmp_path / "bad", boilerplate_lines=-1)


def test_parts_without_deduplication_merge(tmp_path: Path, english: list[str], tiny_tokenizer) -> None:
    """dedup none: the parts keep no keys, and the merge keeps every document, as one process does."""
    files = _write_jsonl(tmp_path / "in", english[:60] + english[:5], 3)
    one = prepare_corpus(files, tiny_tokenizer, tmp_path / "one", dedup="none", workers=1)
    for i in range(2):
        prepare_part(files, tiny_tokenizer, tmp_path / "merged", f"{i}/2", dedup="none", workers=1)
    merged = merge_parts(tmp_path / "merged", tiny_tokenizer)
    assert merged["num_documents"] == one["num_documents"] == 65
    assert [s["blake2b"] for s in merged["shards"]] == [s["blake2b"] for s in one["shards"]]
