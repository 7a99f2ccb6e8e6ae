"""prepare_corpus / prepare_cached: output, cleaning counts, determinism, safety of `out`, memory."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

import shardwise.data.prepare as prepare
from shardwise.data import Tokenizer
from shardwise.data.duplicates import DigestSet
from shardwise.data.prepare import prepare_cached, prepare_corpus
from shardwise.data.shards import MANIFEST_FILE, TokenShards
from shardwise.errors import DataError
from tests.data.conftest import make_text


def reference(texts: list[str], tok: Tokenizer, max_length: int | None = None) -> np.ndarray:
    """Each text's ids (cut to max_length) followed by EOS."""
    out: list[int] = []
    for t in texts:
        out += tok.encode(t)[:max_length] + [tok.eos_id]
    return np.array(out)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != MANIFEST_FILE}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_round_trip_files_as_documents(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "out"
    m = prepare_corpus(corpus_files, tiny_tokenizer, out, shard_tokens=700, workers=1)
    texts = [Path(f).read_text(encoding="utf-8") for f in corpus_files]
    ref = reference(texts, tiny_tokenizer)
    s = TokenShards(out, tiny_tokenizer)
    np.testing.assert_array_equal(s.read(0, s.num_tokens), ref)
    lengths = [len(tiny_tokenizer.encode(t)) + 1 for t in texts]
    np.testing.assert_array_equal(s.document_starts(0, s.num_tokens), np.cumsum([0] + lengths[:-1]))
    # The manifest on disk is the one returned, and holds what the contract lists.
    assert json.loads((out / MANIFEST_FILE).read_text()) == m
    assert m["dtype"] == "uint16" and m["num_tokens"] == len(ref) and m["num_documents"] == 3
    assert m["tokenizer"] == {
        "fingerprint": tiny_tokenizer.fingerprint, "vocab_size": 300, "eos_id": tiny_tokenizer.eos_id,
        "bos_id": tiny_tokenizer.bos_id, "source": m["tokenizer"]["source"],
    }
    assert m["counts"] == {
        "documents_read": 3, "documents": 3, "tokens": len(ref), "dropped_short": 0, "duplicates": 0,
        "truncated": 0, "invalid_utf8_documents": 0, "replaced_chars": 0, "bad_lines": 0, "empty_files": 0,
    }
    assert m["options"]["shard_tokens"] == 700 and m["options"]["txt_documents"] == "file"
    assert [i["path"] for i in m["inputs"]] == corpus_files
    assert [i["bytes"] for i in m["inputs"]] == [os.path.getsize(f) for f in corpus_files]
    assert [i["documents"] for i in m["inputs"]] == [1, 1, 1]
    sizes = [sh["num_tokens"] for sh in m["shards"]]
    assert sizes[:-1] == [700] * (len(sizes) - 1) and sum(sizes) == len(ref) and len(sizes) >= 3
    for sh in m["shards"]:
        assert (out / sh["file"]).stat().st_size == sh["bytes"] == 2 * sh["num_tokens"]
        assert (out / sh["index"]).stat().st_size == sh["index_bytes"] == 8 * sh["num_documents"]
    assert leftovers(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not private like a mkdtemp directory


def test_same_output_for_any_worker_count(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "_CHUNK_DOCS", 4)  # many chunks, so the workers really interleave
    one = prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "w1", txt_documents="paragraph",
                         shard_tokens=333, workers=1)
    two = prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "w2", txt_documents="paragraph",
                         shard_tokens=333, workers=2)
    assert one["num_documents"] > 20
    assert shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w2")
    for key in ("created", "seconds", "workers"):
        one.pop(key), two.pop(key)
    assert one == two


def test_cleaning_counts(tmp_path: Path, tiny_tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    long_text = make_text(5, sentences=30)
    rows = [
        {"text": "Elizabeth walked to the house."},
        {"text": "Elizabeth walked to the house."},  # duplicate
        {"text": "  "},  # shorter than min_chars once stripped
        {"text": "ok"},  # shorter than min_chars=3
        {"text": long_text},  # truncated
        {"text": "The ball was in the evening."},
    ]
    p = tmp_path / "d.jsonl"
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    p.write_bytes(body + b'{"text": "bad \xff byte here"}\n{"text": "Elizabeth walked to the house."}\n')
    (tmp_path / "empty.jsonl").write_text("")
    with caplog.at_level(logging.INFO, logger="shardwise.data"):
        m = prepare_corpus([str(tmp_path / "*.jsonl")], tiny_tokenizer, tmp_path / "out", min_chars=3,
                           max_length=20, workers=1)
    kept = [rows[0]["text"], long_text, rows[5]["text"], "bad \ufffd byte here"]
    assert m["counts"] == {
        "documents_read": 8, "documents": 4, "tokens": m["num_tokens"], "dropped_short": 2, "duplicates": 2,
        "truncated": 1, "invalid_utf8_documents": 1, "replaced_chars": 1, "bad_lines": 0, "empty_files": 1,
    }
    assert len(tiny_tokenizer.encode(long_text)) > 20
    s = TokenShards(tmp_path / "out")
    np.testing.assert_array_equal(s.read(0, s.num_tokens), reference(kept, tiny_tokenizer, max_length=20))
    log = " ".join(r.getMessage() for r in caplog.records)
    assert "2 duplicates" in log and "1 truncated" in log and "1 documents had invalid UTF-8" in log
    assert "1 empty files were skipped" in log


def test_dedup_can_be_disabled(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    p = tmp_path / "d.txt"
    p.write_text("same\n\nsame\n\nother\n")
    m = prepare_corpus(
        [str(p)], tiny_tokenizer, tmp_path / "out", txt_documents="paragraph", dedup=False, workers=1
    )
    assert (m["num_documents"], m["counts"]["duplicates"]) == (3, 0)


def test_bad_lines_skipped_are_in_the_manifest(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a house"}\nnot json\n{"text": "a ball"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        prepare_corpus([str(p)], tiny_tokenizer, tmp_path / "stop", workers=1)
    assert not (tmp_path / "stop").exists() and leftovers(tmp_path) == []
    m = prepare_corpus([str(p)], tiny_tokenizer, tmp_path / "skip", on_bad_line="skip", workers=1)
    assert (m["num_documents"], m["counts"]["bad_lines"]) == (2, 1)


def test_no_documents_left_explains_why(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"body": "a"}\n{"body": "b"}\n')
    with pytest.raises(DataError) as e:
        prepare_corpus([str(p)], tiny_tokenizer, tmp_path / "out", on_bad_line="skip", workers=1)
    msg = str(e.value)
    assert "no documents to prepare" in msg and "2 bad lines skipped" in msg and "no field 'text'" in msg
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_parquet_end_to_end(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [make_text(i, sentences=3) for i in range(30)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=7)
    prepare_corpus([str(tmp_path / "d.parquet")], tiny_tokenizer, tmp_path / "out", workers=1)
    s = TokenShards(tmp_path / "out")
    np.testing.assert_array_equal(s.read(0, s.num_tokens), reference(texts, tiny_tokenizer))


def test_uint32_for_large_vocabularies(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "<|eos|>": 70_000, "hello": 1, "world": 66_000}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(backend, eos_token="<|eos|>")
    p = tmp_path / "d.txt"
    p.write_text("hello world\n\nworld other\n")
    m = prepare_corpus([str(p)], tok, tmp_path / "out", txt_documents="paragraph", workers=1)
    s = TokenShards(tmp_path / "out", tok)
    assert m["dtype"] == "uint32" and s.dtype == np.dtype("<u4")
    assert s.read(0, s.num_tokens).tolist() == [1, 66_000, 70_000, 66_000, 0, 70_000]


def test_existing_out_is_refused_then_replaced_with_overwrite(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "out"
    prepare_corpus(corpus_files[:1], tiny_tokenizer, out, workers=1)
    before = shard_bytes(out)
    with pytest.raises(DataError, match="already exists and is not empty; pass overwrite=True"):
        prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1)
    assert shard_bytes(out) == before
    m = prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1, overwrite=True)
    assert m["num_documents"] == 3 and TokenShards(out).num_documents == 3
    assert leftovers(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_corpus(corpus_files[:1], tiny_tokenizer, empty, workers=1)  # an empty directory is fine
    assert TokenShards(empty).num_documents == 1


def test_overwrite_never_deletes_a_directory_that_is_not_prepared_data(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(DataError, match="not a prepared corpus .* not replaced even with overwrite"):
        prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1, overwrite=True)
    assert (out / "thesis.tex").read_text() == "years of work"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DataError, match="is a file, not a directory"):
        prepare_corpus(corpus_files, tiny_tokenizer, f, workers=1)


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_run_leaves_nothing_and_keeps_the_old_out(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    out = tmp_path / "out"
    prepare_corpus(corpus_files[:1], tiny_tokenizer, out, workers=1)
    before = shard_bytes(out), (out / MANIFEST_FILE).read_text()
    real = prepare._encode_texts
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # after some shards are already written
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "_encode_texts", failing)  # forked workers inherit the patch
    monkeypatch.setattr(prepare, "_CHUNK_DOCS", 2)
    with pytest.raises(BaseException) as e:
        prepare_corpus(corpus_files, tiny_tokenizer, out, txt_documents="paragraph", shard_tokens=50,
                       workers=workers, overwrite=True)
    assert isinstance(e.value, KeyboardInterrupt) or "KeyboardInterrupt" in repr(e.value)
    assert (shard_bytes(out), (out / MANIFEST_FILE).read_text()) == before
    assert TokenShards(out, tiny_tokenizer).num_documents == 1
    assert leftovers(tmp_path) == []
    with pytest.raises(BaseException):
        prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "new", workers=workers,
                       txt_documents="paragraph", shard_tokens=50)
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def test_a_dying_worker_is_an_error_not_a_hang(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def die(*args, **kwargs):
        os._exit(3)  # as if the out-of-memory killer took the worker

    monkeypatch.setattr(prepare, "_encode_texts", die)  # only ever called in the forked workers here
    with pytest.raises(DataError, match="a tokenising worker process died"):
        prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "out", workers=2)
    assert list(tmp_path.iterdir()) == []


def test_temp_dirs_of_dead_runs_are_removed(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    host = prepare._host()
    dead = tmp_path / f".out.tmp-{host}-{proc.pid}-abc"
    (dead / "shard-00000.bin").parent.mkdir()
    (dead / "shard-00000.bin").write_bytes(b"\0" * 10)
    alive = tmp_path / f".out.tmp-{host}-{os.getpid()}-abc"  # a run in progress
    alive.mkdir()
    with pytest.raises(DataError, match="no manifest.json"):
        TokenShards(dead)  # a killed run's half-written shards are never read
    prepare_corpus(corpus_files[:1], tiny_tokenizer, tmp_path / "out", workers=1)
    assert not dead.exists() and alive.exists()


def test_old_out_moved_aside_by_a_dead_run_is_restored(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "out"
    prepare_corpus(corpus_files[:1], tiny_tokenizer, out, workers=1)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    # As if a run with --overwrite was killed between its two renames.
    out.rename(tmp_path / f".out.old-{prepare._host()}-{proc.pid}-xyz")
    prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "other", workers=1)  # a different out: untouched
    assert not out.exists()
    with pytest.raises(DataError, match="already exists"):  # the next run for `out` restores it first
        prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1)
    assert TokenShards(out).num_documents == 1 and leftovers(tmp_path) == []


def test_option_errors(tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer) -> None:
    for kw, match in [
        ({"txt_documents": "line"}, "txt_documents must be one of 'file', 'paragraph'"),
        ({"on_bad_line": "ignore"}, "on_bad_line must be one of"),
        ({"max_length": 0}, "max_length must be at least 1"),
        ({"shard_tokens": 0}, "shard_tokens must be at least 1"),
        ({"min_chars": -1}, "min_chars must be 0 or more"),
        ({"workers": 0}, "workers must be at least 1"),
        ({"fmt": "xml"}, "format must be one of"),
    ]:
        with pytest.raises(DataError, match=match):
            prepare_corpus(corpus_files, tiny_tokenizer, tmp_path / "out", **kw)
    with pytest.raises(DataError, match="matches no file"):
        prepare_corpus([str(tmp_path / "none*.txt")], tiny_tokenizer, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_digest_set_matches_a_python_set() -> None:
    rng = np.random.default_rng(0)
    seen_py: set[int] = set()
    ds = DigestSet()
    for _ in range(40):
        batch = rng.integers(0, 300, size=rng.integers(0, 30)).astype(np.uint64)
        want = []
        for d in batch.tolist():
            want.append(d not in seen_py)
            seen_py.add(d)
        assert ds.add_new(batch).tolist() == want
    assert len(ds) == len(seen_py)
    assert len(ds._runs) <= 2 * int(np.log2(len(seen_py)) + 1)  # runs merge: a few, not one per batch


# --- prepare_cached -------------------------------------------------------------------------------


def test_prepare_cached_reuses_and_rekeys(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in corpus_files:
        (src / Path(f).name).write_text(Path(f).read_text())
    cache = tmp_path / "cache"
    first = prepare_cached([str(src / "*.txt")], tiny_tokenizer, cache, workers=1, shard_tokens=500)
    assert TokenShards(first, tiny_tokenizer).num_documents == 3

    real = prepare._write_corpus
    calls = []
    monkeypatch.setattr(prepare, "_write_corpus", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert prepare_cached([str(src / "*.txt")], tiny_tokenizer, cache, workers=2, shard_tokens=500) == first
    assert calls == []  # reused: workers do not change the output, so they are not in the key

    other = prepare_cached([str(src / "*.txt")], tiny_tokenizer, cache, workers=1, shard_tokens=500,
                           txt_documents="paragraph")
    assert other != first and len(calls) == 1

    (src / "doc0.txt").write_text("changed text")
    changed = prepare_cached([str(src / "*.txt")], tiny_tokenizer, cache, workers=1, shard_tokens=500)
    assert changed not in (first, other) and len(calls) == 2
    assert TokenShards(changed).read(0, 3).tolist() == tiny_tokenizer.encode("changed text")[:3]

    # A damaged entry is prepared again, in place.
    shard = changed / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    assert prepare_cached([str(src / "*.txt")], tiny_tokenizer, cache, workers=1, shard_tokens=500) == changed
    assert len(calls) == 3 and TokenShards(changed).num_documents == 3
    assert leftovers(cache) == []


def test_cached_preparation_keeps_the_one_finished_first(
    tmp_path: Path, corpus_files: list[str], tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    real = prepare._write_corpus
    state = {"raced": False}

    def racing(*args):
        manifest = real(*args)
        if not state["raced"]:  # another process finishes the same entry while this one works
            state["raced"] = True
            prepare_cached(corpus_files, args[1], cache, workers=1)
        return manifest

    monkeypatch.setattr(prepare, "_write_corpus", racing)
    out = prepare_cached(corpus_files, tiny_tokenizer, cache, workers=1)
    theirs = (out / MANIFEST_FILE).read_text()
    assert TokenShards(out, tiny_tokenizer).num_documents == 3
    assert json.loads(theirs)["num_documents"] == 3
    assert [p.name for p in cache.iterdir()] == [out.name]  # no temp directories left


# --- memory ---------------------------------------------------------------------------------------


# Runs in a fresh interpreter, so that memory freed by earlier tests cannot hide growth. Peak RSS is
# reset before each run via /proc/self/clear_refs, so what importing torch costs is not counted.
_MEMORY_SCRIPT = r"""
import json, os, re, sys
from pathlib import Path
src, tok_dir, small, large, work = sys.argv[1:]
sys.path.insert(0, src)
import shardwise.data.prepare as prepare
from shardwise.data.tokenizer import load_tokenizer
prepare._CHUNK_CHARS = 1 << 15  # small chunks: the pipeline's own, constant, memory stays small
tok = load_tokenizer(tok_dir)

def kb(field):
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))

def growth(path, out, workers):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    start = kb("VmRSS")
    prepare.prepare_corpus([path], tok, os.path.join(work, out), shard_tokens=50_000, workers=workers)
    return (kb("VmHWM") - start) * 1024

result = {}
for workers in (1, 2):
    growth(small, f"warm{workers}", workers)  # first-use allocations are not the corpus
    result[workers] = [growth(small, f"1x{workers}", workers), growth(large, f"10x{workers}", workers)]
print(json.dumps(result))
"""


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """With workers=1 the measured process does everything; with 2 it reads, cleans, holds the chunks in
    flight and writes (a worker holds one chunk at a time, whatever the corpus)."""
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    texts = [make_text(i, sentences=40) for i in range(1600)]  # ~2.5 MB of distinct documents

    def write(name: str, n: int) -> str:
        p = tmp_path / name
        p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:n]), encoding="utf-8")
        return str(p)

    small, large = write("small.jsonl", 160), write("large.jsonl", 1600)
    size = os.path.getsize(large)
    src = str(Path(prepare.__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, src, str(tiny_tokenizer_dir), small, large, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for workers, (grow_1x, grow_10x) in result.items():
        # Holding the text of the large input would add about its size, its tokens about half of it.
        assert grow_10x < 1.3 * grow_1x + 0.25 * size, (workers, grow_1x, grow_10x, size)
    assert TokenShards(tmp_path / "10x2").num_documents == 1600
