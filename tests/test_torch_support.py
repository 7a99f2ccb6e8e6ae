"""An untested torch is refused when shardwise is imported, with the fix; the override lets it through with a
warning; the tested releases, local builds included, pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardwise.torch_support import OVERRIDE, check_torch


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.0a0+git1234"])
def test_the_tested_releases_and_newer_pass(version: str) -> None:
    check_torch(version)


def test_an_older_torch_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE, raising=False)
    with pytest.raises(ImportError) as e:
        check_torch("2.10.1+cu128")
    message = str(e.value)
    assert "torch >= 2.11" in message and "2.10.1+cu128" in message and f"{OVERRIDE}=1" in message


def test_the_override_lets_an_older_torch_through_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OVERRIDE, "1")
    with pytest.warns(UserWarning, match="not checked"):
        check_torch("2.9.0")


def test_importing_shardwise_runs_the_check() -> None:
    code = ("import torch; torch.__version__ = '2.8.0'\n"
            "try:\n    import shardwise\nexcept ImportError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"}).stdout
    assert out.startswith("refused: shardwise needs torch >= 2.11"), out
