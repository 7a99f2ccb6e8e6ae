"""Preemption (issue 15, item 3): SIGTERM and SIGUSR1 stop a run after a step with a checkpoint and exit 0,
in one process and under torchrun (the signal sent to the launcher, or to one rank only), and `--resume
auto` then trains exactly the losses of an uninterrupted run; `train.save_minutes` saves when due.

Signals are sent from outside, mid-run, without racing the run: a hook (`_HOLD`, loaded through
sitecustomize) makes every rank wait before a given step until the test has sent its signal, seen it
recorded by the ranks it was meant for, and written a marker file, so the step at which each run stops
is known. Every wait is bounded and every
process is killed in a `finally`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.elastic.multiprocessing.api import SignalException

from shardwise.data.build import run_data
from shardwise.errors import ConfigError
from shardwise.parallel import launch
from shardwise.parallel.collectives import all_reduce
from shardwise.resolve import load_run_config
from shardwise.train import stop_signals
from shardwise.train.stop_signals import StopSignals, StopVote
from shardwise.train.trainer import Trainer
from tests.data.conftest import write_corpus
from tests.parallel.harness import run_distributed

from .conftest import tiny_config as trainer_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
WAIT_S = 120.0  # the bound of every wait on a run

# In every Python process started with the hook directory on PYTHONPATH (a rank, or the one process):
# before 0-based step K, wait until the marker file exists (at most WAIT_S); and when the trainer records
# a stop signal, write MARKER.signal.RANK, so that the test releases the run only once it has the signal.
_HOLD = """
import os
spec = os.environ.get("SHARDWISE_TEST_HOLD")
if spec:
    import time
    import shardwise.train.stop_signals as stop_module
    import shardwise.train.trainer as trainer_module
    at, marker = spec.split(":", 1)
    original = trainer_module.Trainer.train_step
    def train_step(self, micro_batches, step):
        if step == int(at):
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
        return original(self, micro_batches, step)
    trainer_module.Trainer.train_step = train_step
    record = stop_module.StopSignals._record
    def noted(self, signum, frame):
        record(self, signum, frame)
        open(marker + ".signal." + os.environ.get("RANK", "0"), "w").close()
    stop_module.StopSignals._record = noted
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two small text files, a vocab-300 tokenizer, their token shards in the cache, and the hook directory."""
    from shardwise.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("preempt_data")
    files = write_corpus(root / "corpus", n_files=2)
    train_bpe_tokenizer(files, 300, root / "tok", show_progress=False)
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(_HOLD)
    data = {"root": root, "glob": root / "corpus" / "*.txt", "tokenizer": root / "tok", "hook": root / "hook"}
    # Prepared here: the forked gloo workers of a reference run may not start preparation's worker processes.
    run_data(load_run_config(_config(data, root, "prepare")))
    return data


def _config(data: dict[str, Path], tmp_path: Path, name: str, **parallel: int) -> Path:
    cfg = {
        "model": {"preset": "tiny_llama"},
        "data": {"train_files": [str(data["glob"])], "tokenizer": str(data["tokenizer"]), "seq_length": 32,
                 "cache_dir": str(data["root"] / "cache")},
        "train": {"output_dir": str(tmp_path / name), "max_steps": STEPS, "micro_batch_size": 2, "lr": 1.0e-2,
                  "decay_style": "constant", "log_steps": 1, "progress_bar": False, "tensorboard": False,
                  "peak_tflops": 1.0},
        "run": {"device": "cpu", "num_threads": 1},
    }
    if parallel:
        cfg["parallel"] = parallel
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def _start(data: dict[str, Path], cfg: Path, *argv: str, hold: str | None = None) -> subprocess.Popen:
    path = os.pathsep.join([str(data["hook"]), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    if hold:
        env["SHARDWISE_TEST_HOLD"] = hold
    return subprocess.Popen([sys.executable, "-m", "shardwise", "train", str(cfg), *argv], cwd=cfg.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, out, err


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a run that is still going, and its ranks (each leads its own session under torchrun)."""
    if proc.poll() is None:
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate(timeout=30)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    """Until metrics.jsonl shows `step` (the run then waits in the hold hook), at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if max(_losses(run_dir), default=0) >= step:
                return
        except (OSError, ValueError):  # not written yet, or a line half-read
            pass
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {step}:\n{err[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no step {step} in {run_dir / 'metrics.jsonl'} within {WAIT_S:.0f} s")


def _wait_for_files(paths: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            pytest.fail(f"the signal was not recorded within {WAIT_S:.0f} s: no {missing}")
        time.sleep(0.01)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a launcher's ranks)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(name))
    return found


def _rank_pid(launcher: int, rank: int) -> int:
    for pid in _children(launcher):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    pytest.fail(f"no process of rank {rank} under the launcher {launcher}")


def _stop_run(data, cfg: Path, run_dir: Path, hold_step: int, send, receivers: tuple[int, ...], *argv: str,  # noqa: ANN001
              tmp_path: Path) -> tuple[str, str]:
    """Start a run that waits before 0-based step `hold_step`, call `send(proc)` once the step before is
    logged, release the run once the ranks `receivers` have recorded the signal, and return its output
    (exit 0 asserted)."""
    marker = tmp_path / f"released-{run_dir.name}-{hold_step}"
    proc = _start(data, cfg, *argv, hold=f"{hold_step}:{marker}")
    try:
        _wait_for_step(proc, run_dir, hold_step)
        send(proc)
        _wait_for_files([Path(f"{marker}.signal.{rank}") for rank in receivers])
        marker.touch()
        code, out, err = _finish(proc)
    finally:
        _kill(proc)
    assert code == 0, err[-3000:]
    return out, err


def _trained_losses(rank: int, world: int, cfg: Path) -> dict[int, float]:
    """The per-step losses of an uninterrupted run of `cfg`, trained in this process (a rank of `world`)."""
    threads = torch.get_num_threads()  # run.num_threads sets it process-wide
    try:
        return Trainer(load_run_config(cfg)).train().losses
    finally:
        torch.set_num_threads(threads)


def _run(data, cfg: Path, *argv: str) -> str:  # noqa: ANN001
    proc = _start(data, cfg, *argv)
    try:
        code, out, err = _finish(proc)
    finally:
        _kill(proc)
    assert code == 0, err[-3000:]
    return out


@pytest.mark.timeout(300)
def test_sigterm_and_sigusr1_stop_with_a_checkpoint_and_resume_loses_nothing(data, tmp_path) -> None:
    """One process: SIGTERM before step 3 ends -> stops after step 3 with its checkpoint, exit 0; resumed,
    SIGUSR1 before step 5 ends -> stops after step 5; resumed again it finishes, and every step's loss
    equals the uninterrupted run's."""
    expected = _trained_losses(0, 1, _config(data, tmp_path, "reference"))
    assert sorted(expected) == list(range(1, STEPS + 1))

    cfg, run_dir = _config(data, tmp_path, "stopped"), tmp_path / "stopped"
    out, err = _stop_run(data, cfg, run_dir, 2, lambda p: p.send_signal(signal.SIGTERM), (0,), tmp_path=tmp_path)
    assert "stopped by SIGTERM after step 3" in out and "--resume auto" in out, out
    assert "stopped by SIGTERM after step 3: checkpoint step_" in err
    assert _checkpoints(run_dir) == [3]
    assert sorted(_losses(run_dir)) == [1, 2, 3]

    out, _ = _stop_run(data, cfg, run_dir, 4, lambda p: p.send_signal(signal.SIGUSR1), (0,), "--resume", "auto",
                       tmp_path=tmp_path)
    assert "stopped by SIGUSR1 after step 5" in out, out
    assert _checkpoints(run_dir) == [3, 5]

    out = _run(data, cfg, "--resume", "auto")
    assert f"done: {STEPS} steps" in out
    got = _losses(run_dir)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


@pytest.mark.timeout(420)
def test_torchrun_ranks_stop_together_on_a_signal_to_the_launcher_or_to_one_rank(data, tmp_path) -> None:
    """--nproc 2 (data parallel): SIGTERM to the launcher (torchrun's agent) is passed on to the ranks, which
    stop after the same step with a complete checkpoint, exit 0; resumed, SIGUSR1 to rank 1 only stops both
    ranks after the same step (the ranks agree one step later); the losses equal an uninterrupted run's."""
    expected = run_distributed(_trained_losses, 2, _config(data, tmp_path, "reference", data_parallel=2))[0]

    cfg, run_dir = _config(data, tmp_path, "stopped", data_parallel=2), tmp_path / "stopped"
    # Both ranks have the signal before step 3 ends; they agree on it after step 4.
    out, err = _stop_run(data, cfg, run_dir, 2, lambda p: p.send_signal(signal.SIGTERM), (0, 1), "--nproc", "2",
                         tmp_path=tmp_path)
    assert "stopped by SIGTERM after step 4" in out, (out, err[-3000:])
    assert "passed on to the ranks" in err
    assert _checkpoints(run_dir) == [4]

    # Only rank 1 has the signal, before step 6 ends; both ranks stop after step 7.
    out, err = _stop_run(data, cfg, run_dir, 5, lambda p: os.kill(_rank_pid(p.pid, 1), signal.SIGUSR1), (1,),
                         "--nproc", "2", "--resume", "auto", tmp_path=tmp_path)
    assert "stopped by SIGUSR1 after step 7" in out, (out, err[-3000:])
    assert _checkpoints(run_dir) == [4, 7]
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, 8))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


# --- save_minutes, and the vote ------------------------------------------------------------------------------


class _Clock:
    """A monotonic clock that moves only when told: `seconds_per_step` at each optimizer step."""

    def __init__(self, seconds_per_step: float) -> None:
        self.now, self.per_step = 1000.0, seconds_per_step

    def __call__(self) -> float:
        return self.now

    def on_phase(self, phase: str) -> None:
        if phase == "optimizer step":
            self.now += self.per_step


def test_save_minutes_saves_when_due_counted_with_keep_checkpoints(tmp_path, dataset, monkeypatch) -> None:
    """save_minutes 1 at 25 s a step (a clock the steps move): saves after steps 3 (75 s) and 6 (75 s after
    the save at 3), and at the end; a save_steps save restarts the interval; keep_checkpoints applies."""
    clock = _Clock(25.0)
    monkeypatch.setattr(stop_signals, "monotonic", clock)

    def checkpoints(name: str, **train) -> list[int]:  # noqa: ANN003
        trainer = Trainer(trainer_config(tmp_path / name, max_steps=9, save_minutes=1.0, **train),
                          train_dataset=dataset)
        trainer.add_phase_hook(clock.on_phase)
        assert trainer.train().stopped_by is None
        return _checkpoints(tmp_path / name / "run")

    assert checkpoints("minutes") == [3, 6, 9]
    # save_steps 4 saves at 4 and 8: the minutes count from there (due at 7, not 6).
    assert checkpoints("with_steps", save_steps=4, keep_checkpoints=2) == [8, 9]
    assert checkpoints("with_steps_all", save_steps=4, keep_checkpoints=9) == [3, 4, 7, 8, 9]


def test_the_config_refuses_a_non_positive_save_minutes(tmp_path) -> None:
    with pytest.raises(ConfigError, match="train.save_minutes = 0: input should be greater than 0"):
        trainer_config(tmp_path, save_minutes=0)


def _votes(rank: int, world: int, signal_at: int, signal_rank: int, cpu_side: bool = True) -> list[tuple[int, bool]]:
    """Ten votes on every rank; `signal_rank` receives SIGUSR1, then SIGTERM (really, from itself) before
    vote `signal_at`; rank 0's save_minutes (0.5, 10 s a vote) fall due at vote 2 (a clock moved by hand).
    `cpu_side` False: the default group claims to serve no CPU tensors (as HCCL), so the vote makes a gloo
    group of its own."""
    clock, real, kinds = _Clock(0.0), stop_signals.monotonic, stop_signals.group_device_types
    stop_signals.monotonic = clock
    if not cpu_side:
        stop_signals.group_device_types = lambda group=None: ("npu",)
    signals = StopSignals().install()
    try:
        vote = StopVote(signals, save_minutes=0.5, is_main=rank == 0)
        assert (vote.group is None) == (cpu_side or world == 1)
        decisions = []
        for i in range(10):
            clock.now += 10.0
            if rank == signal_rank and i == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
            decision = vote.after_step()
            if decision.save_due:
                vote.saved()
            decisions.append((decision.signal, decision.save_due))
        vote.close()
        assert all_reduce(torch.ones(1)).item() == world  # nothing left in flight on the group
    finally:
        signals.restore()
        stop_signals.monotonic, stop_signals.group_device_types = real, kinds
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    return decisions


@pytest.mark.parametrize("cpu_side", [True, False], ids=["gloo side", "own gloo group"])
def test_every_rank_gets_the_same_decision_after_the_same_step(cpu_side: bool) -> None:
    """Two gloo ranks, SIGUSR1 to rank 1 only before vote 4: both see the stop at vote 5 (one step late);
    rank 0's save falls due at vote 2 (30 s of 0.5 min) and both see it at vote 3; the interval restarts at
    that save, so the next falls due at vote 6 and is seen at 7."""
    ranks = run_distributed(_votes, 2, 4, 1, cpu_side)
    assert ranks[0] == ranks[1]
    assert [i for i, (sig, _) in enumerate(ranks[0]) if sig][0] == 5
    assert all(sig == signal.SIGUSR1 for sig, _ in ranks[0][5:])
    assert [i for i, (_, save) in enumerate(ranks[0]) if save] == [3, 7]


def test_one_process_decides_at_once_and_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    decisions = _votes(0, 1, 4, 0)
    assert [i for i, (sig, _) in enumerate(decisions) if sig][0] == 4
    assert all(sig == signal.SIGUSR1 for sig, _ in decisions[4:])
    assert [i for i, (_, save) in enumerate(decisions) if save] == [2, 5, 8]
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_launcher_passes_the_signals_on_to_its_children_and_otherwise_stops(monkeypatch) -> None:
    """_forward_stop_signals: SIGTERM / SIGUSR1 reach this process's children (the ranks) and this process
    goes on; with no child running it stops as torch's agent handler would (SignalException); the previous
    handlers are back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr(launch, "_child_pids", lambda: [child.pid])
        with launch._forward_stop_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            assert child.wait(timeout=WAIT_S) == -signal.SIGTERM  # passed on; this process lives on
            monkeypatch.setattr(launch, "_child_pids", lambda: [])
            with pytest.raises(SignalException):
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(5)  # the handler raises at the next bytecode; this only bounds the wait
    finally:
        child.kill()
        child.wait(timeout=30)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_launcher_finds_its_children_in_proc() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in launch._child_pids()
        assert os.getpid() not in launch._child_pids()
    finally:
        child.kill()
        child.wait(timeout=30)
