"""Shared test settings: small thread counts so tests behave the same on a busy 2-core machine."""

import os

import pytest
import torch

torch.set_num_threads(1)  # tiny models run fastest on one thread; the other core runs the next test

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep each test session's caches out of the user's home directory."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache))
    yield
