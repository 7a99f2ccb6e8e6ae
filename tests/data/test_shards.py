"""TokenShards: reads across shard boundaries, document starts, pickling, refusing damaged directories;
the token dtype."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardwise.data import Tokenizer, load_tokenizer, train_bpe_tokenizer
from shardwise.data.prepare import prepare_corpus
from shardwise.data.shards import MANIFEST_FILE, TokenShards, token_dtype
from shardwise.errors import DataError

SHARD_TOKENS = 500


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, corpus_files: list[str], tiny_tokenizer_dir: Path):
    """(directory, reference tokens, reference document starts) of the corpus in 500-token shards."""
    tok = load_tokenizer(tiny_tokenizer_dir)
    out = tmp_path_factory.mktemp("prep") / "shards"
    prepare_corpus(corpus_files, tok, out, txt_documents="paragraph", shard_tokens=SHARD_TOKENS, workers=1)
    tokens: list[int] = []
    starts: list[int] = []
    for f in corpus_files:
        for para in Path(f).read_text(encoding="utf-8").split("\n\n"):
            para = para.strip("\n")
            if para.strip():
                starts.append(len(tokens))
                tokens += tok.encode(para) + [tok.eos_id]
    return out, np.array(tokens), np.array(starts)


@pytest.fixture()
def copy_of(prepared, tmp_path: Path) -> Path:
    """A private copy of the prepared directory, for tests that damage it."""
    dst = tmp_path / "copy"
    shutil.copytree(prepared[0], dst)
    return dst


def test_counts_and_many_shards(prepared, tiny_tokenizer: Tokenizer) -> None:
    out, ref, starts = prepared
    s = TokenShards(out, tiny_tokenizer)
    assert s.num_tokens == len(s) == len(ref)
    assert s.num_documents == len(starts)
    assert s.num_shards == -(-len(ref) // SHARD_TOKENS) and s.num_shards >= 4
    assert s.dtype == np.dtype("<u2")
    assert s.eos_id == tiny_tokenizer.eos_id


def test_read_matches_the_reference_across_boundaries(prepared) -> None:
    out, ref, _ = prepared
    s = TokenShards(out)
    n = len(ref)
    rng = np.random.default_rng(0)
    ranges = [(0, n), (0, 0), (n, n), (SHARD_TOKENS - 1, SHARD_TOKENS + 1), (SHARD_TOKENS, 2 * SHARD_TOKENS),
              (SHARD_TOKENS - 3, 3 * SHARD_TOKENS + 7), (n - 5, n)]
    ranges += [tuple(sorted(rng.integers(0, n + 1, size=2))) for _ in range(50)]
    for a, b in ranges:
        got = s.read(a, b)
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(got, ref[a:b], err_msg=f"read({a}, {b})")


def test_read_out_of_range(prepared) -> None:
    s = TokenShards(prepared[0])
    for a, b in ((-1, 3), (5, 2), (0, s.num_tokens + 1)):
        with pytest.raises(IndexError):
            s.read(a, b)


def test_read_within_a_shard_is_read_only(prepared) -> None:
    got = TokenShards(prepared[0]).read(3, 10)
    with pytest.raises(ValueError):
        got[0] = 1


def test_document_starts_match_the_reference(prepared) -> None:
    out, ref, starts = prepared
    s = TokenShards(out)
    n = len(ref)
    np.testing.assert_array_equal(s.document_starts(0, n), starts)
    assert s.document_starts(0, 1).tolist() == [0]
    rng = np.random.default_rng(1)
    for a, b in [(1, 1), (SHARD_TOKENS, 2 * SHARD_TOKENS)] + [
        tuple(sorted(rng.integers(0, n + 1, size=2))) for _ in range(50)
    ]:
        want = starts[(starts >= a) & (starts < b)]
        got = s.document_starts(a, b)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want, err_msg=f"document_starts({a}, {b})")
    # Every document starts right after an EOS (or at 0).
    assert (ref[starts[1:] - 1] == s.eos_id).all()


def test_a_document_spans_shards(prepared) -> None:
    out, _, starts = prepared
    m = TokenShards(out).manifest
    shard_firsts = [sh["first_token"] for sh in m["shards"][1:]]
    # Some shard begins in the middle of a document: documents are not kept whole per shard.
    assert any(first not in set(starts.tolist()) for first in shard_firsts)


def test_pickles_cheaply_and_maps_lazily(prepared) -> None:
    out, ref, _ = prepared
    s = TokenShards(out)
    s.read(0, len(ref))
    s.document_starts(0, len(ref))
    blob = pickle.dumps(s)
    assert len(blob) < len(json.dumps(s.manifest)) + 4096  # no token data travels
    t = pickle.loads(blob)
    assert all(x is None for x in t._tokens) and all(x is None for x in t._index)
    np.testing.assert_array_equal(t.read(100, 1700), ref[100:1700])
    assert sum(x is not None for x in t._tokens) == 4  # only the shards that were read


def test_missing_manifest_says_not_prepared_or_interrupted(copy_of: Path) -> None:
    (copy_of / MANIFEST_FILE).unlink()
    with pytest.raises(DataError, match="no manifest.json: it is not a prepared corpus, or its preparation was"):
        TokenShards(copy_of)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist; prepare one with `shardwise prepare"):
        TokenShards(tmp_path / "nope")


def test_truncated_shard_is_damaged(copy_of: Path) -> None:
    shard = copy_of / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"shard-00001.bin is 998 bytes but the manifest says 1000: the directory is"):
        TokenShards(copy_of)


def test_missing_shard_and_index(copy_of: Path) -> None:
    (copy_of / "shard-00002.idx").unlink()
    with pytest.raises(DataError, match="shard-00002.idx listed in the manifest is missing"):
        TokenShards(copy_of)


def test_manifest_version_and_format(copy_of: Path) -> None:
    path = copy_of / MANIFEST_FILE
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(DataError, match="format version 99"):
        TokenShards(copy_of)
    path.write_text(json.dumps({"something": "else"}))
    with pytest.raises(DataError, match="not a shardwise token-shard manifest"):
        TokenShards(copy_of)
    path.write_text("{truncated")
    with pytest.raises(DataError, match="is not valid JSON"):
        TokenShards(copy_of)
    del m["shards"][0]["num_tokens"]
    path.write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"\(shard 0\): has no 'num_tokens'"):
        TokenShards(copy_of)


def test_inconsistent_manifest(copy_of: Path) -> None:
    path = copy_of / MANIFEST_FILE
    m = json.loads(path.read_text())
    m["num_tokens"] += 1
    path.write_text(json.dumps(m))
    with pytest.raises(DataError, match="inconsistent"):
        TokenShards(copy_of)


def test_verify_detects_changed_content(copy_of: Path) -> None:
    TokenShards(copy_of).verify()
    shard = copy_of / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    s = TokenShards(copy_of)  # same size: opening does not notice
    with pytest.raises(DataError, match="shard-00000.bin does not match the digest"):
        s.verify()


def test_tokenizer_mismatch_names_both_fingerprints(
    prepared, tmp_path: Path, corpus_files: list[str]
) -> None:
    other_dir = tmp_path / "other_tok"
    other = train_bpe_tokenizer(corpus_files[:1], 280, other_dir, show_progress=False)
    s = TokenShards(prepared[0])
    with pytest.raises(DataError) as e:
        TokenShards(prepared[0], other)
    msg = str(e.value)
    assert s.fingerprint in msg and other.fingerprint in msg and s.fingerprint != other.fingerprint
    assert "Prepare it again with this tokenizer" in msg and "--overwrite" in msg
    assert "use the tokenizer it was prepared with" in msg
    assert s.manifest["tokenizer"]["source"] in msg  # where that tokenizer came from


def test_token_dtype() -> None:
    assert token_dtype(300) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


def test_positions_past_four_billion_tokens(tmp_path: Path) -> None:
    """Offsets, document starts and samples stay exact past 2^32 tokens (a sparse 8 GiB shard, no disk used),
    with a vocabulary above 65,535 (uint32 ids)."""
    from shardwise.data.packing import PackedDataset

    big = (1 << 32) + 3
    tail = np.array([70_000, 5, 99_999, 7, 1], dtype="<u4")
    out = tmp_path / "wide"
    out.mkdir()
    with open(out / "shard-00000.bin", "wb") as f:
        f.truncate(big * 4)  # sparse: reads as zeros
        f.seek((big - 2) * 4)
        f.write(np.array([65_536, 99_998], dtype="<u4").tobytes())
    np.array([0, big - 2], dtype="<i8").tofile(out / "shard-00000.idx")  # a document starts 2 before the end
    tail.tofile(out / "shard-00001.bin")
    np.array([2], dtype="<i8").tofile(out / "shard-00001.idx")
    shards = [
        {"file": "shard-00000.bin", "index": "shard-00000.idx", "first_token": 0, "num_tokens": big,
         "num_documents": 2},
        {"file": "shard-00001.bin", "index": "shard-00001.idx", "first_token": big, "num_tokens": 5,
         "num_documents": 1},
    ]
    manifest = {"format": "shardwise-token-shards", "version": 1, "dtype": "uint32", "num_tokens": big + 5,
                "num_documents": 3, "tokenizer": {"fingerprint": "x", "vocab_size": 100_000, "eos_id": 1},
                "shards": shards}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    s = TokenShards(out)
    assert s.num_tokens == big + 5 > 1 << 32
    assert s.read(big - 2, big + 3).tolist() == [65_536, 99_998, 70_000, 5, 99_999]
    assert s.document_starts(big - 10, big + 5).tolist() == [big - 2, big + 2]
    data = PackedDataset(s, 4)
    last = len(data) - 1
    sample = data[last]
    begin = last * 4
    assert begin >= 1 << 32
    assert sample["input_ids"].tolist() == s.read(begin, begin + 4).astype(np.int64).tolist()
    assert sample["labels"].tolist() == s.read(begin + 1, begin + 5).astype(np.int64).tolist()
    assert sample["input_ids"].tolist()[1:] == [65_536, 99_998, 70_000]  # ids past uint16
    # the document that starts at big - 2 = begin + 1 restarts positions there
    assert sample["position_ids"].tolist()[1:] == [0, 1, 2]
    assert sample["document_ids"][0] != sample["document_ids"][1]
