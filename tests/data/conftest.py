"""Shared fixtures for the data tests: tiny text files and a tiny BPE tokenizer trained on them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shardwise.data import Tokenizer, train_bpe_tokenizer

_WORDS = (
    "the a of and to in was her she he it that with for as had his not be is at my on all by "
    "Elizabeth Darcy Bennet Jane sister mother letter house ball walk evening morning"
).split()


def make_text(seed: int, sentences: int = 60) -> str:
    """Deterministic English-like text: sentences of common words, in paragraphs."""
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        out.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
        out.append("\n\n" if i % 5 == 4 else " ")
    return "".join(out)


def write_corpus(directory: Path, n_files: int = 3, sentences: int = 60) -> list[str]:
    """Write n_files small text files into `directory` and return their paths, sorted."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        p = directory / f"doc{i}.txt"
        p.write_text(make_text(i, sentences), encoding="utf-8")
        paths.append(str(p))
    return sorted(paths)


@pytest.fixture()
def unseen_text() -> str:
    """Text like the corpus but not part of it."""
    return make_text(seed=99)


@pytest.fixture(scope="session")
def corpus_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three small text files shared by the tests (do not modify them)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, corpus_files: list[str]) -> Path:
    """Directory of a vocab-300 byte-level BPE tokenizer trained on `corpus_files`."""
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(corpus_files, 300, out, show_progress=False)
    return out


@pytest.fixture()
def tiny_tokenizer(tiny_tokenizer_dir: Path) -> Tokenizer:
    """A fresh Tokenizer loaded from `tiny_tokenizer_dir` (tests may change its pad token)."""
    from shardwise.data import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)
