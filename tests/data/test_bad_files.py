"""Bad data files through the commands users run: `shardwise prepare` and `shardwise train`.

Binary files named .txt/.jsonl, empty files, gzip cut short, files named .parquet that are not (or
no longer) parquet, a directory named like a file, JSON lines with broken lines; for pre-training
and for instruction data. Each is exit 2 with one message naming the file (and the line), or, with
`on_bad_line: skip`, skipped and counted; and no command leaves a half-written output behind: no
prepared directory, no cache entry, no temp directory, no run files.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from shardwise.cli import main

from .conftest import make_text

GOOD_LINE = '{"text": "Elizabeth walked to the house in the evening."}\n'
SFT_LINE = '{"instruction": "Where did she walk?", "output": "To the house."}\n'


def _gzip_cut(keep: float) -> Callable[[Path], None]:
    """A .jsonl.gz whose compressed bytes are cut to `keep` of their length (a copy that stopped)."""
    def write(path: Path) -> None:
        body = "".join(json.dumps({"text": make_text(i, sentences=20)}) + "\n" for i in range(40)).encode()
        blob = gzip.compress(body)
        path.write_bytes(blob[: int(len(blob) * keep)])
    return write


def _bytes(content: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content)


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside.jsonl").write_text(GOOD_LINE)


BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4

# name -> (writer, what the message says besides the file's name); each is a pre-training input.
PRETRAIN_CASES = {
    "binary.txt": (_bytes(BINARY), "looks like a binary file, not txt text (a NUL byte at offset 8"),
    "binary.jsonl": (_bytes(BINARY), "looks like a binary file, not jsonl text"),
    "empty.txt": (_bytes(b""), ": 0 documents read; 1 empty files skipped"),
    "empty.jsonl": (_bytes(b""), ": 0 documents read; 1 empty files skipped"),
    "head_cut.jsonl.gz": (_gzip_cut(0.01), "it looks gzip-compressed but is not valid gzip"),
    "tail_cut.jsonl.gz": (_gzip_cut(0.9), "documents): Compressed file ended before the end-of-stream marker"),
    "cut.parquet": (_bytes(b"PAR1" + b"\x00" * 40 + b"PAR1"), "not a valid parquet file (cut short"),
    "renamed.parquet": (_bytes(b"text,id\nhello,1\n"), "is not a parquet file (it does not start with b'PAR1')"),
    "x.jsonl": (_directory, "matches only directories, not files"),
    "broken.jsonl": (_bytes((GOOD_LINE + '{"text": "cut here\n' + GOOD_LINE).encode()),
                     ":2: not valid JSON ("),
}


def run(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *needles: str) -> None:
    """Exit 2 with one `shardwise: error:` line holding every needle, and no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("shardwise: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def leftovers(directory: Path) -> list[str]:
    """Entries a failed command must not leave: temp dirs, prepared dirs, cache entries."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.startswith((".", "shards-", "sft-", "out")))


def train_config(tmp_path: Path, tokenizer: Path | None, files: list[Path], **data: object) -> Path:
    """A tiny run on `files` (2 steps), its cache in tmp_path/cache and its run in tmp_path/run."""
    cfg = {
        "model": {"preset": "tiny_llama"},
        "data": {"train_files": [str(f) for f in files], "tokenizer": str(tokenizer) if tokenizer else None,
                 "seq_length": 16, "cache_dir": str(tmp_path / "cache"), "prepare_workers": 1, **data},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "micro_batch_size": 1, "save_steps": 2,
                  "progress_bar": False, "tensorboard": False},
        "run": {"device": "cpu", "num_threads": 1},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def run_files(run_dir: Path) -> list[str]:
    """What a run has written into its directory (an empty directory is no run)."""
    return sorted(os.listdir(run_dir)) if run_dir.exists() else []


# --- pre-training inputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRETRAIN_CASES))
def test_prepare_names_the_bad_file_and_leaves_nothing(capsys, tmp_path, tiny_tokenizer_dir, name) -> None:
    """`shardwise prepare` on a bad file: exit 2 naming it; no out, no temp dir next to it."""
    write, needle = PRETRAIN_CASES[name]
    bad = tmp_path / "in" / name
    bad.parent.mkdir()
    write(bad)
    out = tmp_path / "prepared" / "out"
    code, _, err = run(capsys, "prepare", "--input", bad, "--tokenizer", tiny_tokenizer_dir, "--out", out,
                       "--workers", "1")
    assert_user_error(code, err, str(bad), needle)
    assert not out.exists() and leftovers(out.parent) == []


@pytest.mark.parametrize("name", ["binary.txt", "empty.jsonl", "tail_cut.jsonl.gz", "cut.parquet", "x.jsonl",
                                  "broken.jsonl"])
def test_train_names_the_bad_file_and_leaves_nothing(capsys, tmp_path, tiny_tokenizer_dir, name) -> None:
    """`shardwise train` on a bad pre-training file: exit 2 naming it, before any step; no prepared
    data in the cache, no temp dir, nothing of a run in its directory."""
    write, needle = PRETRAIN_CASES[name]
    bad = tmp_path / name
    write(bad)
    code, _, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [bad]))
    assert_user_error(code, err, str(bad), needle)
    assert leftovers(tmp_path / "cache") == [] and run_files(tmp_path / "run") == []


def test_broken_lines_skipped_are_counted_by_prepare(capsys, tmp_path, tiny_tokenizer_dir) -> None:
    """--on-bad-line skip: the good lines are prepared, and the manifest and the summary count the
    broken one."""
    bad = tmp_path / "broken.jsonl"
    PRETRAIN_CASES["broken.jsonl"][0](bad)
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "prepare", "--input", bad, "--tokenizer", tiny_tokenizer_dir, "--out", out,
                            "--workers", "1", "--on-bad-line", "skip", "--no-dedup")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_documents"] == 2 and manifest["counts"]["bad_lines"] == 1
    assert "1 bad lines skipped" in stdout and f"{bad}:2: not valid JSON" in err


def test_broken_lines_skipped_are_counted_by_train(capsys, tmp_path, tiny_tokenizer_dir) -> None:
    """data.on_bad_line: skip in a run: it trains on the good lines, logs the count, and the cached
    preparation's manifest holds it."""
    bad = tmp_path / "broken.jsonl"
    bad.write_text("".join(json.dumps({"text": make_text(i, 8)}) + "\n" for i in range(6)) + "{oops\n")
    code, out, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [bad], on_bad_line="skip"))
    assert code == 0, err
    assert "done: 2 steps" in out and "1 bad lines were skipped" in err
    (cache,) = (tmp_path / "cache").glob("shards-*")
    assert json.loads((cache / "manifest.json").read_text())["counts"]["bad_lines"] == 1


def test_skip_reaches_the_tokenizer_trained_for_the_run(capsys, tmp_path) -> None:
    """Without data.tokenizer the run trains one on the same files: on_bad_line: skip skips the broken
    lines there too (it used to stop on them with a hint about another command's flag)."""
    bad = tmp_path / "broken.jsonl"
    bad.write_text("".join(json.dumps({"text": make_text(i, 20)}) + "\n" for i in range(20)) + "{oops\n")
    code, _, err = run(capsys, "train", train_config(tmp_path, None, [bad], on_bad_line="skip"))
    assert code == 0, err
    assert "skipped 1 bad .jsonl lines while training the tokenizer" in err
    shutil.rmtree(tmp_path / "cache")  # without skip, a tokenizer trained afresh stops on the line
    code, _, err = run(capsys, "train", train_config(tmp_path, None, [bad]), "--overwrite")
    assert_user_error(code, err, f"{bad}:21: not valid JSON", "data.on_bad_line: skip")


# --- instruction data ----------------------------------------------------------------------------------------

SFT_CASES = {
    "binary.jsonl": (_bytes(BINARY), "looks like a binary file, not jsonl text"),
    "empty.jsonl": (_bytes(b""), "is empty; it needs one JSON object per line"),
    "blank.jsonl": (_bytes(b"\n \n"), "is empty; it needs one JSON object per line"),
    "head_cut.jsonl.gz": (_bytes(gzip.compress(SFT_LINE.encode() * 50)[:12]), "is not valid gzip"),
    "x.jsonl": (_directory, "matches only directories, not files"),
    "notes.txt": (_bytes(b"Where did she walk? To the house.\n"), "is not JSON lines"),
    "broken.jsonl": (_bytes((SFT_LINE + "{oops\n" + SFT_LINE).encode()), ":2: is not JSON (Expecting property name"),
}


@pytest.mark.parametrize("name", sorted(SFT_CASES))
def test_instruction_data_names_the_bad_file(capsys, tmp_path, tiny_tokenizer_dir, name) -> None:
    """data.kind instruction on a bad file: exit 2 naming it; no tokenized cache written, no run files."""
    write, needle = SFT_CASES[name]
    bad = tmp_path / name
    write(bad)
    code, _, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [bad], kind="instruction",
                                                       seq_length=64))
    assert_user_error(code, err, str(bad), needle)
    assert leftovers(tmp_path / "cache") == [] and run_files(tmp_path / "run") == []


def test_instruction_broken_lines_skipped_and_counted(capsys, tmp_path, tiny_tokenizer_dir) -> None:
    """on_bad_line: skip for instruction data: the run trains on the good records and logs the count."""
    bad = tmp_path / "chat.jsonl"
    bad.write_text(SFT_LINE * 3 + "{oops\n" + SFT_LINE + '{"instruction": "no answer"}\n')
    code, out, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [bad], kind="instruction",
                                                       seq_length=64, on_bad_line="skip", template="default"))
    assert code == 0, err
    assert "done: 2 steps" in out
    assert f"skipping {bad}:4: is not JSON" in err and "bad_lines 2" in err


def test_gzipped_instruction_data_is_read(capsys, tmp_path, tiny_tokenizer_dir) -> None:
    """.jsonl.gz instruction data reads like pre-training data does (and gzip cut short is named)."""
    good = tmp_path / "chat.jsonl.gz"
    good.write_bytes(gzip.compress(SFT_LINE.encode() * 4))
    code, out, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [good], kind="instruction",
                                                       seq_length=64, template="default"))
    assert code == 0, err
    assert "done: 2 steps" in out


# --- nothing of a previous output is lost ---------------------------------------------------------------------


def test_overwrite_with_bad_data_keeps_the_previous_output(capsys, tmp_path, tiny_tokenizer_dir) -> None:
    """--overwrite replaces a previous output only with a complete new one: a bad input fails first,
    for `prepare` (the old prepared directory stays) and for `train` (the old run stays)."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": make_text(i, 8)}) + "\n" for i in range(6)))
    bad = tmp_path / "binary.txt"
    bad.write_bytes(BINARY)
    out = tmp_path / "out"
    code, _, err = run(capsys, "prepare", "--input", good, "--tokenizer", tiny_tokenizer_dir, "--out", out,
                       "--workers", "1")
    assert code == 0, err
    before = (out / "manifest.json").read_text()
    code, _, err = run(capsys, "prepare", "--input", bad, "--tokenizer", tiny_tokenizer_dir, "--out", out,
                       "--workers", "1", "--overwrite")
    assert_user_error(code, err, str(bad))
    assert (out / "manifest.json").read_text() == before and leftovers(tmp_path) == ["out"]

    code, _, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [good]))
    assert code == 0, err
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    code, _, err = run(capsys, "train", train_config(tmp_path, tiny_tokenizer_dir, [bad]), "--overwrite")
    assert_user_error(code, err, str(bad), "looks like a binary file")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    assert "checkpoints" in run_files(tmp_path / "run")
