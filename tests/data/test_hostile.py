"""Hostile data files: decompression bombs, symbolic-link loops under `**`, JSON lines that nest
without end or hold huge integers, lines of hundreds of megabytes, tokenizer side files of the wrong
size or type, a tokenizer regex that panics the Rust library, chat templates that build without
bound or never finish, damaged manifests and loader states.

Each hostile case runs under tests/capped.py (a memory and a time cap), so that a regression fails
here instead of taking the machine down; each must end as a DataError naming the file (exit 2 from
the CLI), never a traceback, a hang or a blow-up.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from tests.capped import assert_refused, run_capped

MEMORY = 1024
SECONDS = 30


def _outcome(fn, *args, **kwargs) -> str:  # noqa: ANN001
    """'ok ...' or 'ErrorName: message' for a ShardwiseError; anything else propagates (and fails the test)."""
    try:
        result = fn(*args, **kwargs)
    except ShardwiseError as e:
        return f"{type(e).__name__}: {e}"
    return f"ok {result!r}"[:500]


def _assert_refused(outcome: str, *needles: str) -> None:
    assert outcome.startswith("DataError: "), outcome
    for needle in needles:
        assert str(needle) in outcome, f"{needle!r} not in {outcome!r}"


# --- gzip -------------------------------------------------------------------------------------------------


def _gzip_bomb(path: Path, head: bytes = b"", megabytes: int = 300) -> Path:
    """A multi-member gzip of `head` and `megabytes` MB of 'a' (about 1 KB per MB: a ratio of about 1000)."""
    member = gzip.compress(b"a" * (1 << 20))
    path.write_bytes(gzip.compress(head) + member * megabytes)
    return path


def test_gzip_bomb_is_refused_by_every_reader(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A 300 KB gzip that inflates to 300 MB: prepare (a text file read whole, JSON lines), instruction
    data and tokenizer training stop with the file named, after inflating no more than 200x."""
    txt = _gzip_bomb(tmp_path / "bomb.txt.gz")
    jsonl = _gzip_bomb(tmp_path / "bomb.jsonl.gz", b'{"text": "')
    for bomb in (txt, jsonl):
        assert_refused(["prepare", "--input", bomb, "--tokenizer", tiny_tokenizer_dir, "--out", tmp_path / "out",
                        "--workers", "1"], bomb, "decompression bomb", "gunzip -k", memory_mib=MEMORY,
                       seconds=SECONDS)
    _assert_refused(run_capped(_instruction_outcome, [str(jsonl)], str(tiny_tokenizer_dir), memory_mib=MEMORY,
                               seconds=SECONDS), jsonl, "decompression bomb")
    assert_refused(["tokenizer", "train", "--input", txt, "--vocab-size", "300", "--out", tmp_path / "tok"], txt,
                   "gzip", memory_mib=MEMORY, seconds=SECONDS)


def test_zstd_bomb_and_broken_zstd_are_refused(tmp_path: Path) -> None:
    """A 10 KB zstd that inflates to 300 MB stops with the file named after inflating no more than 200x; a
    zstd file cut short, or with damaged bytes in a frame that carries its checksum (the zstd tool writes
    one by default), stops naming the file."""
    import zstandard

    bomb = tmp_path / "bomb.jsonl.zst"
    bomb.write_bytes(zstandard.ZstdCompressor(level=19).compress(b'{"text": "' + b"a" * (300 << 20)))
    _assert_refused(run_capped(_read_all, str(bomb), memory_mib=MEMORY, seconds=SECONDS), bomb,
                    "decompression bomb", "zstd -d")
    good = zstandard.ZstdCompressor(write_checksum=True).compress(
        b"".join(b'{"text": "line %d"}\n' % i for i in range(20000)))
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(good[: len(good) // 2])
    damaged = tmp_path / "damaged.jsonl.zst"
    damaged.write_bytes(good[:200] + bytes(b ^ 0xFF for b in good[200:400]) + good[400:])
    for path in (cut, damaged):
        _assert_refused(_read_all(str(path)), path)


def _read_all(path: str) -> str:
    from shardwise.data.files import resolve_inputs
    from shardwise.data.sources import read_documents

    return _outcome(lambda: sum(len(d) for d in read_documents(resolve_inputs(path))))


def test_parquet_that_repeats_one_long_value_is_refused(tmp_path: Path) -> None:
    """A 500-byte parquet whose dictionary-encoded column repeats one 1 MB value in 1,000 rows (1 GB of text,
    about 1 GB per batch of 1,024 rows once decoded): refused as it is counted, within 1 GiB."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": ["a" * (1 << 20)] * 1000}), path, compression="zstd")
    _assert_refused(run_capped(_read_all, str(path), memory_mib=MEMORY, seconds=SECONDS), path,
                    "(a decompression bomb)")


def test_repetitive_small_gzip_is_still_read(tmp_path: Path) -> None:
    """Below the floor (16 MiB inflated) a gzip of very repetitive text is read, whatever its ratio."""
    from shardwise.data.files import resolve_inputs
    from shardwise.data.sources import read_documents

    path = tmp_path / "rep.txt.gz"
    path.write_bytes(gzip.compress(b"hello world\n" * 200_000))  # 2.4 MB, ratio above 200
    assert [len(d) for d in read_documents(resolve_inputs(str(path)))] == [2_400_000]


# --- globs ------------------------------------------------------------------------------------------------


def _glob_outcomes(root: str) -> dict[str, str]:
    from shardwise.data.files import expand_files

    return {
        "loop": _outcome(expand_files, f"{root}/loop/**/*.txt"),
        "loop_stars": _outcome(expand_files, f"{root}/loop/*/*/*/*/*/*.txt"),
        "deep": _outcome(expand_files, f"{root}/deep/**/*.txt"),
    }


def test_glob_symlink_loops_and_depth_are_bounded(tmp_path: Path) -> None:
    """`**` over `a -> .` and `b -> .` (2^40 paths to glob.glob, which never finishes) gives each real file
    once; a tree 40 levels deep stops naming the pattern."""
    loop = tmp_path / "loop"
    (loop / "sub").mkdir(parents=True)
    (loop / "x.txt").write_text("x")
    (loop / "sub" / "y.txt").write_text("y")
    os.symlink(".", loop / "a")
    os.symlink(".", loop / "b")
    os.symlink("..", loop / "sub" / "up")
    deep = tmp_path / "deep"
    level = deep
    for i in range(40):
        level = level / f"d{i}"
    level.mkdir(parents=True)
    (level / "z.txt").write_text("z")
    got = run_capped(_glob_outcomes, str(tmp_path), memory_mib=MEMORY, seconds=20)
    assert got["loop"] == f"ok {[str(loop / 'sub' / 'y.txt'), str(loop / 'x.txt')]!r}"
    assert got["loop_stars"].startswith("ok ["), got["loop_stars"]
    _assert_refused(got["deep"], "deep/**/*.txt", "more than 32 directories deep", "symbolic-link loop")


def test_glob_walk_matches_glob_glob(tmp_path: Path) -> None:
    """Without links the bounded walk finds what glob.glob(recursive=True) finds: hidden names only when
    the pattern says so, `**` as zero or more directories, magic in any component."""
    from shardwise.data.files import glob_files

    for name in ("a.txt", "b.md", "s/c.txt", "s/t/d.txt", "s/.h/e.txt", ".top/f.txt", "s/.g.txt", "u/v/w/g.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    for pattern in ("**/*.txt", "**", "s/**", "*/*.txt", "s/.*/*.txt", ".*/*.txt", "**/t/*.txt", "s/**/*.t?t",
                    "[as]*/**/*.txt", "u/**/w/*.txt", "*/", "nothing/**/*.txt"):
        want = sorted(glob.glob(str(tmp_path / pattern), recursive=True))
        assert sorted(glob_files(str(tmp_path / pattern))) == want, pattern


# --- JSON lines and long lines ----------------------------------------------------------------------------


def _json_line_cases(tmp: Path) -> dict[str, Path]:
    good = '{"text": "Elizabeth walked to the house."}\n'
    cases = {
        "deep": '{"text": "x", "a": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        "bigint": '{"text": "x", "id": ' + "9" * 5000 + "}\n",
        "int41": '{"text": "x", "id": ' + "1" * 41 + "}\n",
    }
    paths = {}
    for name, line in cases.items():
        path = tmp / f"{name}.jsonl"
        path.write_text(good + line + good)
        paths[name] = path
    return paths


def _long_line(path: Path, size: int = 300 << 20) -> Path:
    """A file of one line of `size` bytes: text first (so it is not taken for binary), then a hole of zeros."""
    with open(path, "wb") as f:
        f.write(b'{"text": "' + b"a" * 10_000)
        f.truncate(size)
    return path


def test_hostile_json_lines_are_bad_lines_with_file_and_line(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Nesting 100,000 deep, a 5,000-digit integer, a 41-digit one: prepare reports file:line (or skips and
    counts with --on-bad-line skip); instruction data and tokenizer training the same."""
    paths = _json_line_cases(tmp_path)
    needles = {"deep": "JSON nested too deeply", "bigint": "a JSON integer of 5,000 digits",
               "int41": "a JSON integer of 41 digits"}
    for name, path in paths.items():
        assert_refused(["prepare", "--input", path, "--tokenizer", tiny_tokenizer_dir, "--out", tmp_path / "o",
                        "--workers", "1"], f"{path}:2: {needles[name]}", "--on-bad-line skip", memory_mib=MEMORY,
                       seconds=SECONDS)
    got = run_capped(_json_line_outcomes, {k: str(v) for k, v in paths.items()}, str(tiny_tokenizer_dir),
                     str(tmp_path), memory_mib=MEMORY, seconds=SECONDS)
    for name, path in paths.items():
        assert got[f"skip-{name}"] == "ok (2, 1)", got
        _assert_refused(got[f"sft-{name}"], f"{str(path)[:-6]}-sft.jsonl:2: is {needles[name]}")
        _assert_refused(got[f"tok-{name}"], f"{path}:2: {needles[name]}", "skip_bad_lines=True")


def _json_line_outcomes(paths: dict[str, str], tok_dir: str, tmp: str) -> dict[str, str]:
    from shardwise.data.files import resolve_inputs
    from shardwise.data.sources import ReadStats, read_documents
    from shardwise.data.tokenizer import train_bpe_tokenizer

    def skipped(path: str) -> tuple[int, int]:
        stats = ReadStats()
        docs = list(read_documents(resolve_inputs(path), on_bad_line="skip", stats=stats))
        return len(docs), stats.bad_lines

    out = {}
    for name, path in paths.items():
        out[f"skip-{name}"] = _outcome(skipped, path)
        out[f"sft-{name}"] = _instruction_outcome([path.replace(".jsonl", "-sft.jsonl")], tok_dir, convert=path)
        out[f"tok-{name}"] = _outcome(train_bpe_tokenizer, [path], 300, f"{tmp}/tok-{name}", show_progress=False)
    return out


def _instruction_outcome(files: list[str], tok_dir: str, convert: str | None = None, **kwargs) -> str:  # noqa: ANN003
    """InstructionDataset over `files` ('text' lines of `convert` made SFT records first)."""
    from shardwise.data import load_tokenizer
    from shardwise.data.instruction import InstructionDataset

    if convert is not None:
        lines = Path(convert).read_text().splitlines(keepends=True)
        good = '{"instruction": "Where?", "output": "To the house."}\n'
        Path(files[0]).write_text(good + lines[1] + good)
    return _outcome(lambda: len(InstructionDataset(files, load_tokenizer(tok_dir), 64, **kwargs)))


def _long_line_outcomes(tmp: str, tok_dir: str) -> dict[str, str]:
    from shardwise.data.files import resolve_inputs
    from shardwise.data.sources import read_documents

    line = _long_line(Path(tmp) / "long.jsonl")
    text = Path(tmp) / "long.txt"
    os.link(line, text)
    return {
        "jsonl": _outcome(lambda: sum(1 for _ in read_documents(resolve_inputs(str(line))))),
        "txt-file": _outcome(lambda: sum(1 for _ in read_documents(resolve_inputs(str(text))))),
        "txt-paragraph": _outcome(lambda: sum(1 for _ in read_documents(resolve_inputs(str(text)),
                                                                         txt_documents="paragraph"))),
        "txt-line": _outcome(lambda: sum(1 for _ in read_documents(resolve_inputs(str(text)), txt_documents="line"))),
        "sft": _instruction_outcome([str(line)], tok_dir),
    }


def test_a_300_mb_line_is_refused_without_reading_it_whole(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A line (or a whole-file document) past 256 MiB is refused naming the file (and line) under a 1 GiB
    cap: readers stop at the bound instead of holding the whole line."""
    got = run_capped(_long_line_outcomes, str(tmp_path), str(tiny_tokenizer_dir), memory_mib=MEMORY,
                     seconds=SECONDS)
    line = tmp_path / "long.jsonl"
    text = tmp_path / "long.txt"
    _assert_refused(got["jsonl"], f"{line}:1: the line is longer than 268,435,456 bytes")
    _assert_refused(got["txt-file"], f"{text}: one document of more than", "txt_documents='paragraph'")
    _assert_refused(got["txt-paragraph"], f"{text}:1: the line is longer")
    _assert_refused(got["txt-line"], f"{text}:1: the line is longer")
    _assert_refused(got["sft"], f"{line}:1: the line is longer")


def _json_array_outcomes(tmp: str, tok_dir: str) -> dict[str, str]:
    from shardwise.data import instruction

    deep = Path(tmp) / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    big = Path(tmp) / "big.json"
    big.write_text(json.dumps([{"instruction": "Where?", "output": "Home."}] * 50))
    out = {"deep": _instruction_outcome([str(deep)], tok_dir)}
    instruction.MAX_JSON_ARRAY_BYTES = 1000  # the bound, made small enough to reach here
    out["big"] = _instruction_outcome([str(big)], tok_dir)
    return out


def test_hostile_json_array_files(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    got = run_capped(_json_array_outcomes, str(tmp_path), str(tiny_tokenizer_dir), memory_mib=MEMORY,
                     seconds=SECONDS)
    _assert_refused(got["deep"], "deep.json", "JSON nested too deeply")
    _assert_refused(got["big"], "big.json", "is a JSON array of more than 1,000 bytes", "jq -c")


# --- tokenizers -------------------------------------------------------------------------------------------


def _copy_tokenizer(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of the tokenizer directory `src` with some files replaced: a name -> text, bytes, or a dict
    (written as JSON over the original's keys for tokenizer_config.json, whole otherwise)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    for name, content in changes.items():
        name = name.replace("__", ".")
        if isinstance(content, dict) and name == "tokenizer_config.json":
            content = json.dumps({**json.loads((src / name).read_text()), **content})
        elif isinstance(content, dict):
            content = json.dumps(content)
        (dst / name).write_bytes(content if isinstance(content, bytes) else str(content).encode())
    return dst


def _panicking_tokenizer(src: Path, dst: Path, pattern: str) -> Path:
    """The tokenizer with a Split pre-tokenizer on `pattern` put in front (Oniguruma runs it)."""
    doc = json.loads((src / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, doc["pre_tokenizer"]]}
    return _copy_tokenizer(src, dst, tokenizer__json=json.dumps(doc))


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(b"{")
        f.truncate(size)
    return path


def _tokenizer_outcomes(dirs: dict[str, str]) -> dict[str, str]:
    from shardwise.data import load_tokenizer

    out = {name: _outcome(load_tokenizer, d) for name, d in dirs.items() if name != "panic"}
    tok = load_tokenizer(dirs["panic"])  # the regex compiles; it fails on text that makes it backtrack
    out["panic-encode"] = _outcome(tok.encode, "a" * 40 + "b")
    out["panic-batch"] = _outcome(tok.encode_batch, ["a" * 40 + "b"] * 4)
    return out


def test_hostile_tokenizer_files(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Side files of the wrong size, nesting or type, and a pre-tokenizer regex that panics the Rust library
    (pyo3_runtime.PanicException, a BaseException): each a DataError naming the file."""
    src = tiny_tokenizer_dir
    cases = {
        "eos-number": dict(tokenizer_config__json={"eos_token": 5}),
        "eos-content": dict(tokenizer_config__json={"eos_token": {"content": ["x"]}}),
        "template-number": dict(tokenizer_config__json={"chat_template": 5}),
        "template-list": dict(tokenizer_config__json={"chat_template": [{"name": "default", "template": 1}]}),
        "max-length": dict(tokenizer_config__json={"model_max_length": "a lot"}),
        "token-id": dict(tokenizer_config__json={"eos_token_id": "1"}),
        "config-list": dict(tokenizer_config__json="[1, 2]"),
        "config-deep": dict(tokenizer_config__json="[" * 5000 + "]" * 5000),
        "config-bigint": dict(tokenizer_config__json='{"model_max_length": ' + "9" * 5000 + "}"),
        "special-map": dict(special_tokens_map__json={"pad_token": True}),
        "template-huge": dict(chat_template__jinja="{{ x }}" * 200_000),
        "template-binary": dict(chat_template__jinja=b"\xff\xfe{{ x }}"),
        "bad-regex": None,
        "huge-id": None,
    }
    dirs = {name: str(_copy_tokenizer(src, tmp_path / name, **kw)) for name, kw in cases.items() if kw}
    big = _copy_tokenizer(src, tmp_path / "big")
    _sparse(big / "tokenizer_config.json", 65 << 20)
    dirs["config-huge"] = str(big)
    huge_model = _copy_tokenizer(src, tmp_path / "huge-model")
    _sparse(huge_model / "tokenizer.json", 513 << 20)
    dirs["model-huge"] = str(huge_model)
    dirs["bad-regex"] = str(_panicking_tokenizer(src, tmp_path / "bad-regex", "(unclosed"))
    dirs["panic"] = str(_panicking_tokenizer(src, tmp_path / "panic", "(a+)+$"))
    doc = json.loads((src / "tokenizer.json").read_text())
    doc["model"]["vocab"]["<huge>"] = 2**31  # an embedding table of 2**31 rows
    dirs["huge-id"] = str(_copy_tokenizer(src, tmp_path / "huge-id", tokenizer__json=json.dumps(doc)))
    got = run_capped(_tokenizer_outcomes, dirs, memory_mib=MEMORY, seconds=SECONDS)
    config = "tokenizer_config.json"
    expect = {
        "eos-number": (config, "'eos_token' is a number, not a token"),
        "eos-content": (config, "'eos_token' is {'content': a list}"),
        "template-number": (config, "chat_template of", "got a number"),
        "template-list": (config, "chat_template of", "got a list"),
        "max-length": (config, "'model_max_length' is a string, not a number"),
        "token-id": (config, "'eos_token_id' is a string, not a token id"),
        "config-list": (config, "holds a list, not a JSON object"),
        "config-deep": (config, "nests 5000 levels deep"),
        "config-bigint": (config, "holds an integer of 5,000 digits"),
        "special-map": ("special_tokens_map.json", "'pad_token' is a boolean"),
        "template-huge": ("chat_template.jinja", "more than the 1,048,576 such a file can be"),
        "template-binary": ("chat_template.jinja", "UTF-8"),
        "config-huge": (config, "is 68,157,440 bytes, more than the 67,108,864"),
        "model-huge": ("tokenizer.json", "is 537,919,488 bytes, more than the 536,870,912"),
        "bad-regex": ("tokenizer.json", "is not a valid Hugging Face tokenizer file"),
        "huge-id": ("huge-id", "token ids up to 2,147,483,648", "damaged"),
        "panic-encode": ("panic", "PanicException", "retry-limit-in-match", "backtracks without end"),
        "panic-batch": ("panic", "PanicException", "backtracks without end"),
    }
    for name, needles in expect.items():
        _assert_refused(got[name], *needles)
    # The panic reaches the commands as exit 2 too: prepare encodes in a worker process.
    text = tmp_path / "a.txt"
    text.write_text("a" * 40 + "b\n")
    assert_refused(["prepare", "--input", text, "--tokenizer", dirs["panic"], "--out", tmp_path / "out",
                    "--workers", "1"], dirs["panic"], "PanicException", memory_mib=MEMORY, seconds=SECONDS)


# --- chat templates ---------------------------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    "range": ("{% for i in range(10**9) %}x{% endfor %}", "the number 1,000,000,000"),
    "multiply": ("{{ 'a' * 10**10 }}", "a repeated string or list (*)"),
    "power": ("{{ 2 ** 100000000 }}", "a power (**)"),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
                 "an integer product"),
    "doubling-tilde": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}", "a concatenation (~)"),
    "doubling-plus": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "a concatenation (+)"),
    "output": ("{% for i in range(100000) %}{% for j in range(100000) %}abcdefgh{% endfor %}{% endfor %}",
               "its output would be more than"),
    "nested-loops": ("{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
                     "s of CPU to render one conversation"),
    "macro-tree": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                   "s of CPU to render one conversation"),
    "center": ("{{ 'a'|center(10**9) }}", "the filter center with the number 1,000,000,000"),
    "format-filter": ("{{ '%999999999s'|format('a') }}", "the %-format '%999999999s'"),
    "percent": ("{{ '%*s' % (10**8, 'a') }}", "a %-format with a '*' width"),
    "str-format": ("{{ '{:>999999999}'.format('a') }}", "the format string"),
    "ljust": ("{{ 'a'.ljust(999999999) }}", "a call with the number 999,999,999"),
    "replace": ("{% set s = 'a' * 1000000 %}{{ s|replace('a', s) }}", "a replace"),
    "shared-list": ("{% set s = 'a' * 1000000 %}{% set l = [s,s,s,s,s,s,s,s,s,s] %}{% set l = [l,l,l,l,l,l,l,l,l,l] %}"
                    "{{ [l,l,l,l,l,l,l,l,l,l] }}", "a printed value"),
    "shared-join": ("{% set s = 'a' * 1000000 %}{{ [s,s,s,s,s,s,s,s,s,s,s,s,s,s,s,s,s,s]|join }}", "a join"),
    "shared-tojson": ("{% set s = 'a' * 1000000 %}{{ [s,s,s,s,s,s,s,s,s,s,s,s,s,s,s,s,s,s]|tojson }}", "the value"),
    "indent": ("{% set s = 'a\n' * 1000000 %}{{ s|indent('x' * 1000) }}", "an indent"),
    "batch": ("{{ [1]|batch(10**7, 'x')|list|length }}", "a batch or slice of 10,000,000"),
}


def _template_outcomes(tok_dir: str, sft: str, templates: dict[str, str]) -> dict[str, str]:
    from shardwise.data import chat, load_tokenizer
    from shardwise.data.instruction import InstructionDataset

    chat.RENDER_SECONDS = 1.0  # 5 s in use; 1 s here keeps the test short
    tok = load_tokenizer(tok_dir)
    out = {}
    for name, template in templates.items():
        tok.chat_template = template
        out[name] = _outcome(lambda: len(InstructionDataset([sft], tok, 64, template="tokenizer")))
    tok.chat_template = "{{ lipsum(10**6) }}"
    out["lipsum"] = _outcome(lambda: len(InstructionDataset([sft], tok, 64, template="tokenizer",
                                                            on_bad_line="skip")))
    tok.chat_template = "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"
    out["parse-deep"] = _outcome(lambda: len(InstructionDataset([sft], tok, 64, template="tokenizer")))
    # Outside the main thread no signal can stop a render: a trace function watches the clock there.
    tok.chat_template = templates["nested-loops"]
    box: dict[str, str] = {}
    thread = threading.Thread(target=lambda: box.update(
        thread=_outcome(lambda: len(InstructionDataset([sft], tok, 64, template="tokenizer")))))
    thread.start()
    thread.join()
    out.update(box)
    return out


def test_hostile_chat_templates(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Templates that would build gigabytes or run for hours: each a DataError naming the tokenizer, within
    a 1 GiB cap and seconds; a template error on a record stays a bad line."""
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"instruction": "Where did she walk?", "output": "To the house."}\n')
    templates = {name: t for name, (t, _) in HOSTILE_TEMPLATES.items()}
    got = run_capped(_template_outcomes, str(tiny_tokenizer_dir), str(sft), templates, memory_mib=MEMORY,
                     seconds=SECONDS)
    for name, (_, needle) in HOSTILE_TEMPLATES.items():
        _assert_refused(got[name], f"the chat template of tokenizer {str(tiny_tokenizer_dir)!r} is refused", needle)
    _assert_refused(got["lipsum"], "no usable instruction records")
    _assert_refused(got["parse-deep"], "is not valid Jinja", "recursion")
    _assert_refused(got["thread"], "is refused", "s to render one conversation")


def test_sane_templates_render_as_before(tiny_tokenizer) -> None:  # noqa: ANN001
    """The bounds leave ordinary templates alone: loops, filters, tojson, string methods, %-formats."""
    from shardwise.data.chat import JinjaTemplate

    template = ("{% for m in messages %}{{ '<|%s|>' % m.role }}{{ m.content|trim|replace('  ', ' ') }}"
                "{{ {'n': loop.index}|tojson }}{{ ' '.join(['a', 'b']) }}{{ '{:>3}'.format(1) }}{{ 'x' * 3 }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' ~ '' }}{% endif %}")
    msgs = [{"role": "user", "content": "Hi  there"}, {"role": "assistant", "content": "Hello"}]
    rendered = JinjaTemplate(template, tiny_tokenizer)._render(msgs, True)
    assert rendered == ('<|user|>Hi there{"n": 1}a b  1xxx<|assistant|>Hello{"n": 2}a b  1xxx<|assistant|>')


# --- prepared shards, loader state, SFT token cache -------------------------------------------------------


def _manifest_outcomes(directory: str, manifests: dict[str, str]) -> dict[str, str]:
    from shardwise.data.shards import TokenShards

    out = {}
    path = Path(directory) / "manifest.json"
    for name, text in manifests.items():
        path.write_text(text)
        out[name] = _outcome(lambda: TokenShards(directory).num_tokens)
    _sparse(path, 257 << 20)
    out["huge"] = _outcome(lambda: TokenShards(directory).num_tokens)
    return out


def test_hostile_manifests(tmp_path: Path, tiny_tokenizer, corpus_files) -> None:  # noqa: ANN001
    from shardwise.data.prepare import prepare_corpus

    out = tmp_path / "prep"
    m = prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1)

    def shard(**kw: object) -> str:
        return json.dumps({**m, "shards": [{**m["shards"][0], **kw}, *m["shards"][1:]]})

    manifests = {
        "deep": '{"format": "shardwise-token-shards", "x": ' + "[" * 5000 + "]" * 5000 + "}",
        "bigint": json.dumps({**m, "num_tokens": 0})[:-1] + ', "n": ' + "9" * 5000 + "}",
        "shards-text": json.dumps({**m, "shards": "all of them"}),
        "outside": shard(file="../../../etc/passwd"),
        "tokens-text": shard(num_tokens="12"),
        "tokens-negative": shard(num_tokens=-5),
        "eos-past-vocab": json.dumps({**m, "tokenizer": {**m["tokenizer"], "eos_id": 10**6}}),
        "version-true": json.dumps({**m, "version": True}),
        "dtype": json.dumps({**m, "dtype": "float64"}),
    }
    got = run_capped(_manifest_outcomes, str(out), manifests, memory_mib=MEMORY, seconds=SECONDS)
    expect = {
        "deep": "nests 5001 levels deep",
        "bigint": "holds an integer of 5,000 digits",
        "shards-text": "'shards' is a string",
        "outside": "'file' is '../../../etc/passwd', not a shard file name",
        "tokens-text": "(shard 0): 'num_tokens' is a string",
        "tokens-negative": "(shard 0): 'num_tokens' is -5, outside 0..",
        "eos-past-vocab": "'eos_id' is 1,000,000, outside 0..299",
        "version-true": "format version True",
        "dtype": "'dtype' is 'float64'",
        "huge": "is 269,484,032 bytes, more than the 268,435,456",
    }
    for name, needle in expect.items():
        _assert_refused(got[name], "manifest.json", needle)


def test_hostile_loader_states() -> None:
    import torch

    from shardwise.data.loader import StatefulLoader

    ld = StatefulLoader(list(range(64)), 2, 1, 7)
    good = ld.state_dict()
    for state, needle in (
        ([1, 2], "is a list, not a mapping"),
        ({**good, "consumed": float("inf")}, "'consumed' is a number (inf), not a whole number"),
        ({**good, "seed": "7"}, "'seed' is a string"),
        ({**good, "version": 10**100}, "'version' is 1"),
        ({**good, "consumed": -1}, "negative 'consumed'"),
        ({"epoch": [0], "consumed": 0, "seed": 7}, "'epoch' is a list"),
        ({"nothing": 1, "x" * 10_000: 2}, "has neither 'version' nor 'epoch'"),
    ):
        with pytest.raises(ShardwiseError, match=re.escape(needle)) as e:
            ld.load_state_dict(state)  # type: ignore[arg-type]
        assert len(str(e.value)) < 600
    ld.load_state_dict({**good, "consumed": torch.tensor(4), "seed": np.int64(7)})
    assert ld.consumed == 4


def test_damaged_sft_cache_is_tokenized_again(tmp_path: Path, tiny_tokenizer, caplog) -> None:  # noqa: ANN001
    from shardwise.data.instruction import InstructionDataset

    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"instruction": "Where did she walk?", "output": "To the house."}\n' * 3)
    cache = tmp_path / "cache"
    first = InstructionDataset([str(sft)], tiny_tokenizer, 64, cache_dir=str(cache))
    (path,) = cache.glob("sft-*.npz")
    with np.load(path) as z:
        arrays = dict(z)
    for damage in ({"offsets": arrays["offsets"] * 1000}, {"tokens": arrays["tokens"] + 60000},
                   {"stats": np.array("[" * 5000)}, {"mask": arrays["mask"][:-1]}):
        np.savez(path, **{**arrays, **damage})
        caplog.clear()
        again = InstructionDataset([str(sft)], tiny_tokenizer, 64, cache_dir=str(cache))
        assert again.stats == first.stats and "unusable" in caplog.text


def test_shard_ids_past_the_vocabulary_are_refused_on_read(tmp_path: Path, tiny_tokenizer, corpus_files) -> None:  # noqa: ANN001
    """A shard whose bytes changed (same size) to ids past the vocabulary: the read naming the shard, not an
    embedding lookup out of range."""
    from shardwise.data.prepare import prepare_corpus
    from shardwise.data.shards import TokenShards

    out = tmp_path / "prep"
    prepare_corpus(corpus_files, tiny_tokenizer, out, workers=1)
    shards = TokenShards(out)
    assert int(shards.read(0, shards.num_tokens).max()) < shards.vocab_size
    path = out / "shard-00000.bin"
    data = bytearray(path.read_bytes())
    data[10:12] = b"\xff\xff"
    path.write_bytes(bytes(data))
    with pytest.raises(ShardwiseError, match=r"shard-00000.bin \(or the next\) holds token id 65,535"):
        TokenShards(out).read(0, 64)
    assert len(TokenShards(out).read(64, 128)) == 64
