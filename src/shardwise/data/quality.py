"""Document quality heuristics for pre-training text, in the spirit of Gopher's and C4's rules, for
languages written with spaces (English) and without (Chinese).

`quality_problem(text)` names the first rule a document breaks, or None. The source documents ask to
remove "repeated paragraphs, low-quality content, garbled text and very short fragments" and to keep code
from skewing a language corpus; the rules, in the order they are checked:

- `short`: fewer than 50 words (Gopher), a word being a run of letters or digits in spaced text and one
  CJK character in Chinese (a document is Chinese when CJK characters are at least 30% of its letters);
- `mojibake`: U+FFFD replacement characters, or UTF-8 read as Latin-1 ("Ã©", "â€™"), in more than 1 of
  every 1,000 characters;
- `garbled`: under 70% of the non-space characters are letters, digits, CJK or ordinary punctuation
  (symbol soup, binary read as text);
- `code`: over half of the lines look like program code (ending in ";", "{" or "}", or starting with
  a keyword such as def, class, import, #include, function, return).
- `word_length` (spaced text): mean word length outside 3-10 characters (Gopher);
- `symbols`: "#" and ellipses more than 1 per 10 words (Gopher);
- `bullets` / `ellipsis_lines`: over 90% of the lines start with a bullet, or over 30% end with an
  ellipsis (Gopher: lists and truncated snippets);
- `repeated_lines` / `repeated_paragraphs`: over 30% of the lines (or paragraphs) repeat another one of
  the document, or repeated ones hold over 20% of its characters (Gopher);
- `repeated_ngrams`: the most frequent word 2-, 3- or 4-gram covers over 20%, 18%, 16% of the characters,
  or repeated 5-grams over 15% (Gopher; in Chinese character n-grams twice as long, a word being about
  two characters);

Thresholds are Gopher's where Gopher has one; tests/data/test_quality.py measures each rule on the bundled
English and Chinese corpora (what share of real passages it removes) and on injected junk.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Optional

RULES = ("short", "mojibake", "garbled", "code", "word_length", "symbols", "bullets", "ellipsis_lines",
         "repeated_lines", "repeated_paragraphs", "repeated_ngrams")
MIN_WORDS = 50
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
_WORD = re.compile(r"[^\W_]+")
_NOT_LETTER = re.compile(r"[\W\d_]")
_MOJIBAKE = re.compile(r"[ÃÂ][\u0080-\u00bf]|â€|\ufffd")
_ORDINARY = re.compile(r"[\w\s.,;:!?'\"()\[\]\-\u2010-\u2027\u3000-\u303f\uff00-\uffef%&/@*+=<>$€£¥]")
_BULLET = re.compile(r"^\s*([-*•·‣◦▪►]|\d+[.)])\s")
_CODE = re.compile(r"^\s*(def |class |import |from \S+ import |#include|function\b|return\b|var |const |let |"
                   r"public |private |if \(|for \(|while \()|[;{}]\s*$")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _repeated_share(parts: list[str]) -> tuple[float, float]:
    """(share of the parts that repeat an earlier one, share of the characters in such repeats)."""
    seen: set[str] = set()
    repeats = chars = 0
    for part in parts:
        if part in seen:
            repeats += 1
            chars += len(part)
        seen.add(part)
    total = sum(len(p) for p in parts)
    return repeats / max(len(parts), 1), chars / max(total, 1)


def _ngram_problem(tokens: list[str], scale: int = 1) -> bool:
    """Gopher's n-gram repetition: the top 2-, 3-, 4-gram's share of the characters, and the share of
    characters in 5-grams seen more than once; n times `scale` (Chinese counts characters, about half a
    word each: 2)."""
    total = sum(map(len, tokens))
    if total == 0:
        return False
    for n, bar in ((2 * scale, 0.20), (3 * scale, 0.18), (4 * scale, 0.16)):
        if len(tokens) < n:
            return False
        gram, count = Counter(_ngrams(tokens, n)).most_common(1)[0]
        if count > 1 and count * sum(map(len, gram)) / total > bar:
            return True
    n = 5 * scale
    if len(tokens) >= n:
        grams = _ngrams(tokens, n)
        counts = Counter(grams)
        covered = bytearray(len(tokens))
        for i in [i for i, g in enumerate(grams) if counts[g] > 1]:
            covered[i:i + n] = b"\x01" * n
        if sum(len(t) for t, c in zip(tokens, covered) if c) / total > 0.15:
            return True
    return False


def _ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    """Every run of `n` consecutive tokens, in order."""
    return list(zip(*(tokens[k:] for k in range(n))))


def quality_problem(text: str) -> Optional[str]:
    """The first rule (of RULES) that `text` breaks, or None for a document to keep."""
    chars = "".join(text.split())  # the characters that are not white space
    if not chars:
        return "short"
    cjk = _CJK.findall(text)
    letters = len(chars) - len(_NOT_LETTER.findall(chars))
    chinese = len(cjk) >= 0.3 * max(letters, 1)
    words = _WORD.findall(text)
    tokens = cjk if chinese else words
    if len(tokens) < MIN_WORDS:
        return "short"
    if len(_MOJIBAKE.findall(text)) > len(text) / 1000:
        return "mojibake"
    if len(_ORDINARY.findall(chars)) < 0.7 * len(chars):
        return "garbled"
    lines = _lines(text)
    if len(lines) >= 3 and sum(bool(_CODE.search(line)) for line in lines) > 0.5 * len(lines):
        return "code"
    if not chinese:
        mean = sum(len(w) for w in words) / len(words)
        if not 3 <= mean <= 10:
            return "word_length"
    if (text.count("#") + text.count("...") + text.count("…")) > 0.1 * len(tokens):
        return "symbols"
    if len(lines) >= 3:
        if sum(bool(_BULLET.match(line)) for line in lines) > 0.9 * len(lines):
            return "bullets"
        if sum(line.endswith(("...", "…")) for line in lines) > 0.3 * len(lines):
            return "ellipsis_lines"
    share, chars_share = _repeated_share(lines)
    if share > 0.3 or chars_share > 0.2:
        return "repeated_lines"
    share, chars_share = _repeated_share(_paragraphs(text))
    if share > 0.3 or chars_share > 0.2:
        return "repeated_paragraphs"
    if _ngram_problem([t.lower() for t in tokens], 3 if chinese else 1):
        return "repeated_ngrams"
    return None
