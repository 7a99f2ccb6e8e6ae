"""Start-up that does not time out: data preparation may take longer than the process group's timeout.

Two forked gloo ranks whose process group times out after PG_TIMEOUT_S seconds prepare raw text whose
tokenising is made to take SLOW_S seconds (more than the timeout): the ranks wait for each other by
polling the store, so the run starts and trains; when rank 0's preparation fails, every rank stops with
its message. With the old `rank0_first` (a broadcast bounded by the timeout) rank 1 times out instead.
The cache lock: processes sharing a cache prepare an entry once.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.data import prepare
from shardwise.errors import DataError
from shardwise.parallel import collectives
from shardwise.train.trainer import Trainer

from ..parallel.harness import run_distributed
from ..train.conftest import tiny_config, with_changes
from .conftest import write_corpus

PG_TIMEOUT_S = 5.0
SLOW_S = 7.0  # longer than the process group's timeout


def _config(root: Path, corpus: list[str], tokenizer: Path, cache: Path):  # noqa: ANN202
    cfg = tiny_config(root, max_steps=2, micro_batch_size=2)
    return with_changes(cfg, data={"train_files": corpus, "tokenizer": str(tokenizer), "cache_dir": str(cache),
                                   "prepare_workers": 1},
                        parallel={"data_parallel": 2})


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_REAL_WRITE_CORPUS = prepare._write_corpus


def _slow_write_corpus(files, *args):  # noqa: ANN001, ANN002, ANN202
    """Tokenising that takes SLOW_S seconds, and fails on rank 0 for the "fails" corpus."""
    time.sleep(SLOW_S)
    if dist.get_rank() == 0 and any("/fails/" in f.path for f in files):
        raise DataError("the corpus is broken (on purpose)")
    return _REAL_WRITE_CORPUS(files, *args)


def _ranks(rank: int, world: int, root: Path, corpora: dict[str, list[str]], tokenizer: Path) -> dict:
    with pytest.MonkeyPatch.context() as patch:  # in this rank's process (the workers are not forks of the test)
        patch.setattr(prepare, "_write_corpus", _slow_write_corpus)
        patch.setattr(collectives, "PROGRESS_S", 2.0)
        return _slow_ranks(root, corpora, tokenizer)


def _slow_ranks(root: Path, corpora: dict[str, list[str]], tokenizer: Path) -> dict:
    rank = dist.get_rank()
    lines = _Lines()
    logging.getLogger("shardwise.parallel.collectives").addHandler(lines)
    logging.getLogger("shardwise.parallel.collectives").setLevel(logging.INFO)
    out: dict = {}
    # A cache of each rank's own (node-local disks): rank 0 prepares slowly while rank 1 waits for it, then
    # rank 1 prepares its own slowly while rank 0 waits for that.
    cfg = _config(root / "trains", corpora["trains"], tokenizer, root / f"cache_rank{rank}")
    out["losses"] = Trainer(cfg).train().losses
    out["progress"] = list(lines.lines)
    # Rank 0's preparation fails after SLOW_S: every rank stops with its message.
    try:
        Trainer(_config(root / "fails", corpora["fails"], tokenizer, root / "cache_shared")).train()
    except Exception as e:  # noqa: BLE001 - what each rank saw
        out["failure"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(300)
def test_slow_preparation_outlasts_the_collective_timeout(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    corpora = {name: write_corpus(tmp_path / name / "corpus", n_files=3, sentences=80) for name in ("trains", "fails")}
    results = run_distributed(_ranks, 2, tmp_path, corpora, tiny_tokenizer_dir, timeout=240, pg_timeout=PG_TIMEOUT_S)
    assert sorted(results[0]["losses"]) == [1, 2] and results[0]["losses"] == results[1]["losses"]
    for rank in (0, 1):  # each rank prepared its own cache
        assert len(list((tmp_path / f"cache_rank{rank}").glob("shards-*"))) == 1
    # Rank 0 said whom it waited for while rank 1 prepared its cache.
    assert any("rank 0 still waiting for rank(s) 1 to finish data preparation" in line
               for line in results[0]["progress"]), results[0]["progress"]
    assert results[0]["failure"] == "DataError: the corpus is broken (on purpose)"
    assert results[1]["failure"].startswith("ShardwiseError: rank 0 failed data preparation, so this rank stops too")
    assert "DataError: the corpus is broken (on purpose)" in results[1]["failure"]
    assert not (tmp_path / "fails" / "run" / "metrics.jsonl").exists()


# --- the cache lock: one preparation per file system ------------------------------------------------------


def _prepare_in_child(corpus: list[str], tokenizer_dir: Path, cache: Path) -> None:
    from shardwise.data.tokenizer import load_tokenizer

    prepare.prepare_cached(corpus, load_tokenizer(tokenizer_dir), cache, workers=1)


def test_processes_sharing_a_cache_prepare_it_once(tmp_path: Path, corpus_files: list[str], tiny_tokenizer_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache, calls = tmp_path / "cache", tmp_path / "calls"
    calls.mkdir()
    real = prepare._write_corpus

    def counted(*args):  # noqa: ANN002, ANN202
        (calls / str(os.getpid())).touch()
        time.sleep(1.0)  # long enough for the other process to come while this one prepares
        return real(*args)

    monkeypatch.setattr(prepare, "_write_corpus", counted)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_prepare_in_child, args=(corpus_files, tiny_tokenizer_dir, cache))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(list(calls.iterdir())) == 1  # one preparation; the others waited for it and used it
    assert [p.name for p in cache.iterdir()] == [next(cache.glob("shards-*")).name]  # no lock file left


def test_the_cache_lock_is_reentrant_and_removed(tmp_path: Path) -> None:
    target = tmp_path / "shards-x"
    with prepare.cache_lock(target):
        assert (tmp_path / ".shards-x.lock").is_file()
        with prepare.cache_lock(target):  # the same process again: no wait
            pass
        assert (tmp_path / ".shards-x.lock").is_file()
    assert list(tmp_path.iterdir()) == []


# --- the waiting helpers themselves ------------------------------------------------------------------------


def _in_turn(rank: int, world: int) -> dict:
    out = {"first": collectives.rank0_first(lambda: time.sleep(3.0) or "done", rank, "sleeping")}
    try:
        collectives.rank0_then_others(lambda: rank if rank != 1 else 1 / 0, rank, "the work")
    except Exception as e:  # noqa: BLE001 - what each rank saw
        out["second"] = f"{type(e).__name__}: {e}"
    out["third"] = collectives.rank0_then_others(lambda: rank * 10, rank, "the work")
    return out


def test_waits_in_turn_outlast_the_timeout_and_name_the_failing_rank() -> None:
    first, second = run_distributed(_in_turn, 2, timeout=120, pg_timeout=2.0)
    assert first["first"] == "done" and second["first"] is None  # rank 0 slept past the group's timeout
    assert first["second"] == ("ShardwiseError: the work failed on rank 1, so this rank stops too: "
                               "ZeroDivisionError: division by zero")
    assert second["second"] == "ZeroDivisionError: division by zero"
    assert (first["third"], second["third"]) == (0, 10)
