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
