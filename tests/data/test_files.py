"""Input files: globs, telling a file's kind before anything is read (binary, broken gzip, UTF-16,
.json, parquet), and the cache keys."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from shardwise.data.files import expand_files, file_stamps, files_key, resolve_inputs
from shardwise.errors import DataError


def test_expand_files_sorted_deduplicated(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", "c.md", "sub/d.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    got = expand_files([str(tmp_path / "*.txt"), str(tmp_path / "a.txt"), str(tmp_path / "**" / "*.txt")])
    assert got == [str(tmp_path / n) for n in ("a.txt", "b.txt", "sub/d.txt")]
    assert expand_files(str(tmp_path / "c.md")) == [str(tmp_path / "c.md")]


def test_expand_files_errors_name_the_pattern(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*\*\.json' matches no file"):
        expand_files([str(tmp_path / "*.json")])
    with pytest.raises(DataError, match="matches only directories"):
        expand_files([str(tmp_path)])
    with pytest.raises(DataError, match="data.train_files"):
        expand_files([])


def test_broken_gzip_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "x.txt.gz"
    p.write_bytes(b"\x1f\x8b\x08\x00garbage that is not deflate")
    with pytest.raises(DataError, match="not valid gzip"):
        resolve_inputs(str(p))


def test_binary_files_are_refused_before_reading(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(DataError) as e:
        resolve_inputs(str(tmp_path / "*"))
    msg = str(e.value)
    assert "model.bin looks like a binary file" in msg and "NUL byte at offset 0" in msg
    assert "not skipped" in msg and "narrow the glob" in msg


def test_utf16_gets_a_conversion_hint(tmp_path: Path) -> None:
    p = tmp_path / "w.txt"
    p.write_bytes("hello windows".encode("utf-16"))
    with pytest.raises(DataError, match="UTF-16.*iconv"):
        resolve_inputs(str(p))


def test_mostly_undecodable_without_nul_is_binary(tmp_path: Path) -> None:
    p = tmp_path / "latin.txt"
    p.write_bytes(bytes(range(0x80, 0x100)) * 4)
    with pytest.raises(DataError, match="not valid UTF-8"):
        resolve_inputs(str(p))


def test_empty_glob_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no file"):
        resolve_inputs(str(tmp_path / "nothing*.jsonl"))


def test_json_array_file_is_refused_with_a_hint(tmp_path: Path) -> None:
    p = tmp_path / "d.json"
    p.write_text('[{"text": "a"}]')
    with pytest.raises(DataError, match="only JSON Lines"):
        resolve_inputs(str(p))


def test_parquet_without_pyarrow_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1" + b"\x00" * 16 + b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(DataError, match="pip install pyarrow"):
        resolve_inputs(str(p))


def test_parquet_extension_without_parquet_content(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    p.write_text("just text")
    with pytest.raises(DataError, match="is not a parquet file"):
        resolve_inputs(str(p))


def test_files_key_changes_with_a_file_and_with_extra(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one")
    b.write_text("two")
    os.utime(a, ns=(1_000_000_000, 1_000_000_000))
    key = files_key([str(a), str(b)], "bpe", 300)
    assert len(key) == 20 and key == files_key([str(a), str(b)], "bpe", 300)
    assert file_stamps([str(a)]) == [[str(a), 3, 1_000_000_000]]
    assert files_key([str(a), str(b)], "bpe", 301) != key
    os.utime(a, ns=(2_000_000_000, 2_000_000_000))  # touched: the cache is stale
    assert files_key([str(a), str(b)], "bpe", 300) != key
