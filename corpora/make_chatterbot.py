#!/usr/bin/env python3
"""Rebuild corpora/chatterbot/ from the PyPI package chatterbot-corpus 1.3.3.

    python3 corpora/make_chatterbot.py                    # downloads with `pip download`
    python3 corpora/make_chatterbot.py --wheel PATH.whl   # or uses a wheel already downloaded

Needs PyYAML (a shardwise dependency). The wheel is read in place (it is a zip file), from a
temporary folder that is removed afterwards; only the .jsonl files are written into the repository.

Each YAML conversation [s0, s1, s2, ...] becomes one chat record
{"messages": [{"role": "user", "content": s0}, {"role": "assistant", "content": s1}, ...]}: the
statements alternate user / assistant, starting with the user, as ChatterBot's own trainer reads
them (each statement answers the one before). A trailing statement with no answer is dropped.
Filter: conversations with any statement over MAX_CHARS characters, or with fewer than two
statements, are dropped, and so are exact repeats of an earlier conversation.
See corpora/README.md for the counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

PACKAGE = "chatterbot-corpus==1.3.3"
WHEEL_SHA256 = "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"
MAX_CHARS = 400
OUT = Path(__file__).resolve().parent / "chatterbot"
# language folder in the package -> output file
LANGUAGES = {"english": "chat_en.jsonl", "chinese": "chat_zh.jsonl"}


def download(tmp: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(tmp),
         PACKAGE],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (wheel,) = tmp.glob("chatterbot_corpus-*.whl")
    return wheel


def statement(x: str) -> str:
    # yaml.BaseLoader keeps every scalar a string ("Yes" stays "Yes", not True; '1963' stays a
    # string); statements written as YAML block scalars keep their inner line breaks.
    return x.strip()


def convert(wheel: zipfile.ZipFile, language: str) -> tuple[list[dict], dict]:
    folder = f"chatterbot_corpus/data/{language}/"
    names = sorted(n for n in wheel.namelist() if n.startswith(folder) and n.endswith(".yml"))
    records, seen = [], set()
    stats = dict.fromkeys(("conversations", "malformed", "too_long", "too_short", "duplicates", "kept", "turns"), 0)
    stats["files"] = len(names)
    for name in names:
        data = yaml.load(wheel.read(name).decode("utf-8"), Loader=yaml.BaseLoader)
        for conv in data.get("conversations", []):
            stats["conversations"] += 1
            if not isinstance(conv, list) or not all(isinstance(x, str) for x in conv):
                stats["malformed"] += 1  # e.g. a YAML slip that folds question and answer into one string
                continue
            turns = [statement(x) for x in conv]
            turns = [t for t in turns if t]
            if len(turns) % 2:
                turns = turns[:-1]  # a last user statement that nothing answers
            if len(turns) < 2:
                stats["too_short"] += 1
                continue
            if any(len(t) > MAX_CHARS for t in turns):
                stats["too_long"] += 1
                continue
            key = tuple(turns)
            if key in seen:
                stats["duplicates"] += 1
                continue
            seen.add(key)
            roles = ("user", "assistant")
            records.append({"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]})
            stats["kept"] += 1
            stats["turns"] += len(turns) // 2
    return records, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="the chatterbot_corpus-1.3.3 wheel, already downloaded")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.wheel or download(Path(tmp))
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"{path.name} sha256 {digest}")
        if digest != WHEEL_SHA256:
            print(f"warning: expected sha256 {WHEEL_SHA256}; the output may differ from the committed files")
        with zipfile.ZipFile(path) as wheel:
            for language, filename in LANGUAGES.items():
                records, stats = convert(wheel, language)
                text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
                (OUT / filename).write_text(text, encoding="utf-8")
                print(f"{filename}: {stats}, {len(text.encode('utf-8'))} bytes")


if __name__ == "__main__":
    main()
