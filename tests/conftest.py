"""Shared test settings: small thread counts so tests behave the same on a busy 2-core machine."""

import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a busy 2-core machine two threads make tiny-model steps ~30x slower
    (OpenMP threads wait on each other), and one is as fast as two for models this small. Restored
    after each test, since a run with run.num_threads changes it for the whole process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep each test session's caches out of the user's home directory."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache))
    yield


@pytest.fixture(autouse=True)
def _restore_shardwise_logging():
    """The CLI's main() points the `shardwise` logger at the console and stops its propagation; undo
    that after every test, so that a later test's caplog still sees shardwise's records."""
    import logging

    logger = logging.getLogger("shardwise")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
