"""bench/gpu_checks.sh is ready for a lent GPU before one is lent (issue 14: "leave the script ready").

A GPU is lent now and then, for minutes, and a typo in the script or a configuration that no longer loads
would cost the whole lease. So, on the CPU: the script is valid bash, stops at once when shardwise does not
import, and fits one ten-minute device call; every step runs a file that exists, with options its parser
takes; every configuration it trains (the throughput rows, the profile, gpu_memory.py's rows) loads and has
an estimate for CUDA; the eager throughput row runs end to end at a small size; the two CUDA checks that have
a CPU mode pass it; and step_profile's summary counts the host's waits per recorded step.

The steps are read by running the script itself with stand-ins on PATH: `timeout` records each step's limit
and command and runs nothing, `nvidia-smi` prints a line, `python3` is this interpreter."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from shardwise.config import load_config
from shardwise.memory.estimate import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_checks.sh"
DEVICE_CALL_S = 600  # the longest one device call may run
SETUP_S = 30  # the script's own work before its steps: wheels, the import check, nvidia-smi
CPU_MODE = ("tests/models/input_shapes_cuda.py", "tests/train/offload_params_cuda.py")  # run the same checks on a CPU
SMALL = ["--set", "model.preset=tiny_llama", "--set", "data.seq_length=128", "--set", "train.micro_batch_size=2",
         "--rounds", "1", "--steps", "1", "--warmup", "1"]


def _stand_ins(bin_dir: Path, log: Path, python: str = sys.executable) -> None:
    bin_dir.mkdir()
    files = {
        "timeout": f"#!{sys.executable}\nimport json, sys\n"
                   f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n",
        "nvidia-smi": "#!/bin/sh\necho 'no GPU here: a CPU rehearsal'\n",
        "python3": f"#!/bin/sh\nexec {python} \"$@\"\n",
    }
    for name, text in files.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def _rehearse(tmp: Path, python: str = sys.executable) -> tuple[subprocess.CompletedProcess, list[list[str]], Path]:
    """Run gpu_checks.sh with the stand-ins: its output, each step's [limit, command...], and its OUT_DIR."""
    log, out = tmp / "steps.jsonl", tmp / "out"
    _stand_ins(tmp / "bin", log, python)
    (tmp / "no-wheels").mkdir()
    env = {**os.environ, "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "SHARDWISE_WHEELS": str(tmp / "no-wheels")}
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    steps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, steps, out


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, list[list[str]], Path]:
    return _rehearse(tmp_path_factory.mktemp("gpu_checks"))


class Parsed(Exception):
    """Raised by the patched parse_args with what the script's own parser made of its command line."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


@contextmanager
def _script_imports():
    """Undo what running a script does to the import state: its folder on sys.path, and the modules it
    imports from there under top-level names (`train_throughput`, the tests' `conftest`)."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name in ("conftest", "train_throughput"):
                del sys.modules[name]


def _parse(script: Path, args: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The options `script` makes of `args` with its own parser, stopping before it does anything else."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        raise Parsed(original(self, args, namespace))

    with monkeypatch.context() as m, _script_imports():
        m.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        m.setattr(sys, "argv", [str(script), *args])
        with pytest.raises(Parsed) as got:
            runpy.run_path(str(script), run_name="__main__")
    return got.value.namespace


def _loads_with_an_estimate(config: str, overrides: list[str]) -> None:
    cfg = load_config(config, overrides + ["run.device=cuda"])
    assert estimate_memory(cfg, 1, "cuda").peak > 0


def test_the_script_is_valid_bash_and_fits_one_device_call(rehearsal) -> None:  # noqa: ANN001
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    proc, steps, out = rehearsal
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== done" in proc.stdout
    names = sorted(p.stem for p in out.glob("*.json"))  # each step's stdout file, named after it
    assert len(names) == len(steps) >= 9, (names, steps)
    total = sum(int(step[0]) for step in steps)
    assert total + SETUP_S <= DEVICE_CALL_S, f"the steps' limits add up to {total} s"


def test_the_script_stops_at_once_when_shardwise_does_not_import(tmp_path: Path) -> None:
    bare = tmp_path / "python-without-site-packages"  # a python3 that has no torch, pydantic, ... (-S: no site)
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    proc, steps, _ = _rehearse(tmp_path, str(bare))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ModuleNotFoundError" in proc.stderr and "bench/gpu_wheels.sh" in proc.stdout and steps == []


def test_every_step_runs_a_file_with_options_it_takes(rehearsal, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(ROOT)
    _, steps, _ = rehearsal
    configs = 0
    for _limit, python, script, *args in steps:
        assert python == "python3"
        path = ROOT / script
        assert path.is_file(), script
        if "ArgumentParser" not in path.read_text():
            continue  # takes a folder as its one argument (async_save_cuda.py, profile_cuda.py)
        ns = _parse(path, args, monkeypatch)
        if getattr(ns, "config", None):  # the Trainer's config with the step's overrides, as the GPU will load it
            _loads_with_an_estimate(ns.config, ns.overrides)
            configs += 1
    assert configs >= 4  # the three throughput rows and the profile


def test_every_gpu_memory_configuration_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    with _script_imports():
        module = runpy.run_path(str(ROOT / "bench" / "gpu_memory.py"))
    assert len(module["CONFIGS"]) >= 9
    for overrides in module["CONFIGS"].values():
        _loads_with_an_estimate(module["BASE"], overrides + ["train.max_steps=3", "train.save_steps=null"])


def test_the_eager_throughput_row_runs_at_a_small_size(rehearsal) -> None:  # noqa: ANN001
    _, steps, _ = rehearsal
    (row,) = [s for s in steps if s[2] == "bench/train_throughput.py" and "run.compile=false" in s]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, *row[2:], *SMALL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["precision"].startswith("bf16") and result["seq_length"] == 128 and result["model"] == "tiny_llama"
    assert result["shardwise"]["tokens_per_s_median"] > 0 and result["plain"]["tokens_per_s_median"] > 0
    assert result["max_abs_loss_diff"] < 1e-2  # the same model, batches and optimizer on both sides (bf16)


@pytest.mark.parametrize("script", CPU_MODE)
def test_a_cuda_check_passes_its_cpu_run(rehearsal, script: str) -> None:  # noqa: ANN001
    _, steps, _ = rehearsal
    (row,) = [s for s in steps if s[2] == script]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, *row[2:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and result["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]


def test_step_profile_counts_the_waits_of_the_recorded_steps() -> None:
    with _script_imports():
        summarize = runpy.run_path(str(ROOT / "bench" / "step_profile.py"))["summarize"]
    x = torch.randn(64, 64)
    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=1))
    with prof:
        for step in range(6):
            for _ in range(2 if step in (2, 3, 4) else 5):  # the recorded steps read twice, the others five times
                float((x @ x).sum().item())
            prof.step()
    out = summarize(prof, 3)
    assert out["waits_per_step"]["aten::_local_scalar_dense"] == 2.0
    assert out["waits_per_step"]["cudaStreamSynchronize"] == 0.0
    assert out["top_device_ops"] == [] and out["device_busy_share"] is None  # no device: nothing claimed for one
