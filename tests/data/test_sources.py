"""Reading inspected inputs: txt (file / paragraph / line), jsonl (bad lines), parquet, gzip, UTF-8 repair."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from shardwise.data.files import inspect_input, resolve_inputs
from shardwise.data.sources import ReadStats, read_documents
from shardwise.errors import DataError


def read(inputs: list[str] | str, **kw) -> tuple[list[str], ReadStats]:
    """All documents of the inputs, and the stats."""
    fmt = kw.pop("fmt", "auto")
    stats = ReadStats()
    docs = list(read_documents(resolve_inputs(inputs, fmt), stats=stats, **kw))
    return docs, stats


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_txt_a_document_per_file_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second file\n\nstill second\n")
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbffirst file")  # a UTF-8 BOM is not text
    docs, stats = read(str(tmp_path / "*.txt"))
    assert docs == ["first file", "second file\n\nstill second\n"]
    assert stats.documents == 2
    assert stats.per_file == {str(tmp_path / "a.txt"): 1, str(tmp_path / "b.txt"): 1}


def test_txt_paragraphs_split_on_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "p.txt"
    p.write_bytes(b"\n\nOne line\nand two\n\n\n  \t\nSecond\r\n\r\nThird, last\n")
    docs, stats = read(str(p), txt_documents="paragraph")
    assert docs == ["One line\nand two", "Second", "Third, last"]
    assert stats.documents == 3


def test_txt_lines_as_a_text_mode_file_reads_them(tmp_path: Path) -> None:
    p = tmp_path / "l.txt"
    p.write_bytes(b"\xef\xbb\xbfone\r\ntwo\rthree\n\nfour")
    docs, stats = read(str(p), txt_documents="line")
    assert docs == ["one\n", "two\n", "three\n", "\n", "four"]
    assert stats.documents == 5


def test_jsonl_text_field_and_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "alpha", "id": 1}\n\n{"text": "beta"}\n', encoding="utf-8")
    assert read(str(p))[0] == ["alpha", "beta"]
    q = write_jsonl(tmp_path / "e.jsonl", [{"content": "gamma"}, {"content": "delta"}])
    assert read(q, text_field="content")[0] == ["gamma", "delta"]


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "not valid JSON"),
        ('["text"]', "a JSON list, not an object"),
        ('{"body": "x"}', "no field 'text' (fields: 'body')"),
        ('{"text": null}', "field 'text' is null, not a string"),
        ('{"text": 3}', "field 'text' is a number"),
    ],
)
def test_jsonl_bad_line_stops_with_file_and_line(tmp_path: Path, line: str, why: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(f'{{"text": "ok"}}\n{line}\n{{"text": "ok2"}}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        read(str(p))
    assert f"{p}:2: {why}" in str(e.value)
    assert "--on-bad-line skip" in str(e.value)


def test_jsonl_bad_lines_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "bad.jsonl"
    lines = ['{"text": "a"}', "{oops", '{"text": "b"}'] + ['{"txt": "c"}'] * 7 + ['{"text": "d"}']
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="shardwise.data.sources"):
        docs, stats = read(str(p), on_bad_line="skip")
    assert docs == ["a", "b", "d"]
    assert stats.bad_lines == 8
    assert stats.first_bad_line is not None and stats.first_bad_line.startswith(f"{p}:2: not valid JSON")
    warned = [r.getMessage() for r in caplog.records]
    assert sum("skipping" in m for m in warned) == 5  # the first few, then one summary line
    assert any("without a warning" in m for m in warned)


def test_invalid_utf8_repaired_and_counted(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"ab\xffcd\xfe\xfe ok")  # 3 bad bytes
    (tmp_path / "b.txt").write_bytes("real \ufffd is kept".encode())  # a genuine U+FFFD: no repair
    (tmp_path / "c.txt").write_bytes(b"clean")
    docs, stats = read(str(tmp_path / "*.txt"))
    assert docs[0] == "ab\ufffdcd\ufffd\ufffd ok"
    assert docs[1] == "real \ufffd is kept"
    assert (stats.invalid_utf8_documents, stats.replaced_chars) == (1, 3)


def test_jsonl_invalid_utf8_and_lone_surrogates_repaired(tmp_path: Path) -> None:
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"text": "x\xff y"}\n{"text": "lone \\ud800 here"}\n{"text": "pair \\ud83d\\ude00"}\n')
    docs, stats = read(str(p))
    assert docs[0] == "x\ufffd y"
    assert "\ud800" not in docs[1] and "\ufffd" in docs[1]
    docs[1].encode("utf-8")  # encodable now
    assert docs[2] == "pair \U0001f600"
    assert stats.invalid_utf8_documents == 2
    assert stats.replaced_chars >= 2


def test_gzip_text_and_jsonl(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write("para one\n\npara two\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"text": "from gz"}\n')
    docs, _ = read([str(tmp_path / "a.txt.gz"), str(tmp_path / "b.jsonl.gz")], txt_documents="paragraph")
    assert docs == ["para one", "para two", "from gz"]
    assert inspect_input(str(tmp_path / "b.jsonl.gz")).format == "jsonl"


def test_zstd_text_and_jsonl(tmp_path: Path) -> None:
    """.zst input (web corpora's usual compression), told by its magic bytes, several frames read as one."""
    import zstandard

    compressor = zstandard.ZstdCompressor()
    (tmp_path / "a.txt.zst").write_bytes(compressor.compress(b"para one\n\n") + compressor.compress(b"para two\n"))
    (tmp_path / "b.jsonl.zst").write_bytes(compressor.compress('{"text": "from zst \u00e9"}\n'.encode()))
    docs, _ = read([str(tmp_path / "a.txt.zst"), str(tmp_path / "b.jsonl.zst")], txt_documents="paragraph")
    assert docs == ["para one", "para two", "from zst \u00e9"]
    found = inspect_input(str(tmp_path / "b.jsonl.zst"))
    assert (found.format, found.zstd, found.gzip) == ("jsonl", True, False)


def test_empty_file_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("text")
    with caplog.at_level(logging.WARNING, logger="shardwise.data.sources"):
        docs, stats = read(str(tmp_path / "*.txt"))
    assert docs == ["text"]
    assert stats.empty_files == 1
    assert any("skipping empty file" in r.getMessage() and "a.txt" in r.getMessage() for r in caplog.records)


def test_format_option_overrides_the_extension(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "rows.txt", [{"text": "as json"}])
    assert read(p, fmt="jsonl")[0] == ["as json"]
    assert read(p)[0] == ['{"text": "as json"}\n']
    with pytest.raises(DataError, match="format must be one of"):
        resolve_inputs(p, "csv")


def test_parquet_rows_in_batches(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    texts = [f"row {i}" for i in range(2500)]
    pq.write_table(pa.table({"text": texts, "n": list(range(2500))}), p, row_group_size=1000)
    docs, stats = read(str(p))
    assert docs == texts
    assert stats.per_file == {str(p): 2500}

    q = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": pa.array([b"a\xffb", None, b"c"], type=pa.binary())}), q)
    with pytest.raises(DataError, match=r"b.parquet: row 2: column 'body' is null"):
        read(str(q), text_field="body")
    docs, stats = read(str(q), text_field="body", on_bad_line="skip")
    assert docs == ["a\ufffdb", "c"]
    assert (stats.bad_lines, stats.invalid_utf8_documents, stats.replaced_chars) == (1, 1, 1)


def test_parquet_missing_or_wrong_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["x"], "n": [1]}), p)
    with pytest.raises(DataError, match=r"no column 'text' \(columns: 'content', 'n'\).*--text-field"):
        read(str(p))
    with pytest.raises(DataError, match="column 'n' .* has type int64, not string"):
        read(str(p), text_field="n")


def test_hugging_face_datasets_saved_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [f"document {i} " + "word " * (i % 7) for i in range(300)]
    ds = datasets.Dataset.from_dict({"text": rows, "id": list(range(300))})
    ds.save_to_disk(str(tmp_path / "ds"), max_shard_size="2KB")  # several .arrow shards, in order
    assert len(list((tmp_path / "ds").glob("*.arrow"))) > 2
    docs, stats = read(str(tmp_path / "ds"))
    assert docs == rows and stats.documents == 300
    # a selection not yet applied is refused rather than read wrong; flattened, it reads as selected
    shuffled = ds.shuffle(seed=0)
    shuffled.save_to_disk(str(tmp_path / "shuffled"))
    docs, _ = read(str(tmp_path / "shuffled"))
    assert docs == shuffled["text"]
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits test, train\); give one split's directory"):
        read(str(tmp_path / "dd"))
    assert read(str(tmp_path / "dd" / "test"))[0] == rows[:5]
    with pytest.raises(DataError, match="has no column 'content'"):
        read(str(tmp_path / "ds"), text_field="content")
    with pytest.raises(DataError, match="has type int64, not string"):
        read(str(tmp_path / "ds"), text_field="id")
    shard = sorted((tmp_path / "ds").glob("*.arrow"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # cut short
    with pytest.raises(DataError, match="Arrow file .*data-00000"):
        read(str(tmp_path / "ds"))
    (tmp_path / "ds" / "state.json").write_text('{"_data_files": [{"filename": "../elsewhere.arrow"}]}')
    with pytest.raises(DataError, match="not an .arrow file in the directory"):
        read(str(tmp_path / "ds"))
