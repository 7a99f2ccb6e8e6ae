"""metrics.jsonl survives a kill: `shardwise train` killed with SIGKILL after a checkpoint, then
`--resume auto`, leaves one whole JSON object per line, each step once, with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardwise.data import train_bpe_tokenizer
from tests.data.conftest import write_corpus

REPO = Path(__file__).resolve().parents[2]
KILL_AT = 5  # after the checkpoint of step 3, before the one of step 6

# Loaded by the killed process (its directory is put first on PYTHONPATH): once the record of step
# SHARDWISE_TEST_KILL_AT is written, it appends the start of the next record, as a write cut short
# would leave it, and kills its own process with SIGKILL.
_KILL_AFTER_RECORD = """
import os
at = os.environ.get("SHARDWISE_TEST_KILL_AT")
if at:
    import signal
    import shardwise.train.metrics as metrics
    original = metrics.MetricsWriter.write
    def write(self, record):
        original(self, record)
        if record.get("step") == int(at) and "loss" in record:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write('{"step": %d, "loss": 3.1' % (int(at) + 1))
            os.kill(os.getpid(), signal.SIGKILL)
    metrics.MetricsWriter.write = write
"""


def _config(root: Path, name: str) -> Path:
    files = write_corpus(root / "corpus", n_files=2)
    if not (root / "tok").exists():
        train_bpe_tokenizer(files, 300, root / "tok", show_progress=False)
    cfg = {
        "model": {"preset": "tiny_llama"},
        "data": {"train_files": [str(root / "corpus" / "*.txt")], "tokenizer": str(root / "tok"), "seq_length": 32,
                 "cache_dir": str(root / "cache")},
        "train": {"output_dir": str(root / name), "max_steps": 8, "micro_batch_size": 4, "lr": 1.0e-2,
                  "save_steps": 3, "log_steps": 1, "progress_bar": False, "tensorboard": False},
        "run": {"device": "cpu", "num_threads": 1},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _train(*argv: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(cwd / "hook"), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "shardwise", "train", *argv], capture_output=True, text=True,
                          timeout=240, cwd=cwd, env=dict(os.environ, PYTHONPATH=path, **env))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.timeout(600)
def test_a_killed_and_resumed_run_logs_one_curve(tmp_path) -> None:
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_KILL_AFTER_RECORD, encoding="utf-8")
    proc = _train(str(_config(tmp_path, "reference")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _losses(tmp_path / "reference")
    assert list(reference) == list(range(1, 9))

    killed = _config(tmp_path, "killed")
    proc = _train(str(killed), cwd=tmp_path, SHARDWISE_TEST_KILL_AT=str(KILL_AT))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[:-1]] == list(range(1, KILL_AT + 1))
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[-1])  # the torn last line
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("step_*")) == ["step_00000003"]

    proc = _train(str(killed), "--resume", "auto", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 3, "resumed": True} in records  # where the curve continues
    records = [r for r in records if "loss" in r]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, 9))  # every line whole, each step once, in order
    assert {r["step"]: r["loss"] for r in records} == pytest.approx(reference, abs=1e-6)
