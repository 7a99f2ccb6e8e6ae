"""The `shardwise` command: help, dry runs of the seed configs, user mistakes (exit 2, no traceback),
overrides, run-directory protection, and train -> generate on a tiny model."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from shardwise.cli import main
from shardwise.resolve import load_run_config as load_config
from tests.data.conftest import write_corpus

REPO = Path(__file__).resolve().parents[1]
SEED_000 = REPO / "configs" / "seed_train_config.yaml"
SEED_002 = REPO / "configs" / "seed_llm_pretrain.yaml"


@contextlib.contextmanager
def logging_restored():
    """main() points the `shardwise` logger at the console and stops propagation: undo that afterwards,
    so that later tests' caplog still sees shardwise's records."""
    logger = logging.getLogger("shardwise")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:
        yield
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr); argparse's exits count as statuses."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *needles: str) -> None:
    """Exit 2, one `shardwise: error:` line naming each needle, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    assert "shardwise: error:" in err
    for needle in needles:
        assert needle in err, (needle, err)


# --- inputs for real runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two small text files and a vocab-300 tokenizer trained on them."""
    from shardwise.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("cli_data")
    files = write_corpus(root / "corpus", n_files=2)
    train_bpe_tokenizer(files, 300, root / "tok", show_progress=False)
    return {"root": root, "glob": root / "corpus" / "*.txt", "tokenizer": root / "tok"}


def tiny_config(data: dict[str, Path], path: Path, output_dir: Path, **sections: dict) -> Path:
    """Write a tiny canonical config (tiny_llama, 32-token samples, a few steps on CPU) to `path`."""
    cfg = {
        "model": {"preset": "tiny_llama"},
        "data": {"train_files": [str(data["glob"])], "tokenizer": str(data["tokenizer"]), "seq_length": 32,
                 "cache_dir": str(data["root"] / "cache")},
        "train": {"output_dir": str(output_dir), "max_steps": 4, "micro_batch_size": 4, "lr": 1.0e-2,
                  "save_steps": 2, "log_steps": 1, "progress_bar": False, "tensorboard": False},
        "run": {"device": "cpu", "num_threads": 1},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def metrics(run_dir: Path) -> list[dict]:
    """The training records of metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the checkpoints in a run directory."""
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def trained_run(data, tmp_path_factory) -> Path:
    """A finished 4-step CLI run (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("cli_run")
    cfg = tiny_config(data, root / "cfg.yaml", root / "run")
    threads = torch.get_num_threads()  # run.num_threads: 1 sets it process-wide
    try:
        with logging_restored():
            code = main(["train", str(cfg)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return root / "run"


# --- help ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    ((), ("train", "generate", "--verbose", "--help")),
    (("train",), ("config", "--set", "--dry-run", "--resume", "--overwrite", "--nproc")),
    (("generate",), ("checkpoint", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                     "--tokenizer", "--no-stream")),
])
def test_help(capsys, argv, expected) -> None:
    """--help of the command and of each sub-command exits 0 and names its options."""
    code, out, err = run_cli(capsys, *argv, "--help")
    assert code == 0, err
    assert out.startswith("usage: shardwise")
    for option in expected:
        assert option in out, option


@pytest.mark.parametrize("command, text", [
    ("train", "--overwrite replace a previous run in train.output_dir; with --resume, allow replacing "
              "checkpoints newer than the one resumed from"),
    ("generate", "it is prefixed with EOS, as a new document starts after EOS in pre-training"),
])
def test_help_describes_overwrite_and_prompt(capsys, command, text) -> None:
    """What --overwrite does with --resume, and how a prompt is fed, are in the help."""
    code, out, err = run_cli(capsys, command, "--help")
    assert code == 0, err
    assert "".join(text.split()) in "".join(out.split())  # argparse wraps lines, also at hyphens


# --- dry runs of the two seed configs ----------------------------------------------------------------------


def _printed_flops(out: str) -> float:
    match = re.search(r"per step\s+([\d,]+) tokens, ([\d.]+e[+-]\d+) FLOPs", out)
    assert match, out
    return float(match.group(2))


def test_dry_run_seed_000_config(capsys) -> None:
    """train_config.yaml of seed 000: LLaMA-7B, 8-way data parallel, 256 x 2048 tokens per step."""
    code, out, err = run_cli(capsys, "train", SEED_000, "--dry-run")
    assert code == 0, err
    assert "6,738,415,616 parameters" in out
    assert "8 device(s) = data 8 x tensor 1 x pipeline 1" in out
    assert "micro-batch 8 x accumulation 4 x data parallel 8 = 256 samples of 2048 tokens" in out
    assert "524,288 tokens" in out
    # PaLM's count, written out here on its own: 6 x matmul weights + attention scores, per token.
    h, layers, ffn, vocab, seq = 4096, 32, 11008, 32000, 2048
    matmul = layers * (4 * h * h + 3 * h * ffn) + vocab * h
    per_token = 6 * matmul + 12 * layers * h * seq
    assert _printed_flops(out) == pytest.approx(per_token * 524_288, rel=1e-3)
    assert "compiled (torch.compile)" in out  # mode: graph
    assert "bf16" in out and "recompute full" in out
    assert "Traceback" not in err


def test_dry_run_seed_002_config(capsys) -> None:
    """llm_pretrain.yaml of seed 002: the ~65B model (not 100B), TP 8 x PP 4, DP from --nproc."""
    code, out, err = run_cli(capsys, "train", SEED_002, "--dry-run")
    assert code == 0, err
    h, layers, ffn, vocab, seq = 8192, 80, 22016, 32000, 4096
    params = 2 * vocab * h + layers * (4 * h * h + 3 * h * ffn + 2 * h) + h
    assert f"{params:,} parameters" in out
    assert "32 device(s) = data 1 x tensor 8 x pipeline 4" in out
    assert "ZeRO stage 3" in out
    assert "micro-batch 1 x accumulation 512 x data parallel 1 = 512 samples of 4096 tokens" in out
    assert "2,097,152 tokens" in out
    per_token = 6 * (layers * (4 * h * h + 3 * h * ffn) + vocab * h) + 12 * layers * h * seq
    assert _printed_flops(out) == pytest.approx(per_token * 2_097_152, rel=1e-3)

    code, out, err = run_cli(capsys, "train", SEED_002, "--dry-run", "--nproc", "64")
    assert code == 0, err
    assert "64 device(s) = data 2 x tensor 8 x pipeline 4" in out
    assert "accumulation 256 x data parallel 2 = 512 samples" in out

    code, out, err = run_cli(capsys, "train", SEED_002, "--dry-run", "--nproc", "48")
    assert_user_error(code, err, "48 devices", "32")  # not a multiple of TP x PP


def test_mode_graph_sets_compile() -> None:
    """Seed mode: graph (or run.mode: 0) compiles; pynative (or 1) runs eagerly."""
    assert load_config(SEED_000).run.compile is True
    assert load_config(SEED_000, ["mode=pynative"]).run.compile is False
    assert load_config(SEED_002).run.compile is True
    assert load_config(SEED_002, ["run.compile=false"]).run.compile is False
    assert load_config(SEED_000).run.device == "npu"  # device_target: Ascend


# --- user mistakes ---------------------------------------------------------------------------------------------


def test_unknown_key_names_path_and_closest_key(capsys, tmp_path) -> None:
    """A misspelt key: exit 2, its dotted path, and the valid key it was probably meant to be."""
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("model: {preset: tiny_llama}\ntrain: {max_step: 3}\noptimize: {recomptue: full}\n")
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert_user_error(code, err, "train.max_step", "train.max_steps", "optimize.recomptue", "optimize.recompute")


def test_seed_file_mistakes_are_named_in_its_own_spelling(capsys, tmp_path) -> None:
    """Seed 000's file with a misspelt key and a wrong value: exit 2, both named as the file writes
    them (learning_rate, not train.lr), the closest key in the seed's spelling, and what is allowed."""
    text = SEED_000.read_text(encoding="utf-8")
    cfg = tmp_path / "seed.yaml"
    cfg.write_text(text.replace("batch_size: 8", "batch_sze: 8").replace("learning_rate: 2e-5", "learning_rate: fast"))
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert_user_error(code, err, "unknown key batch_sze; did you mean batch_size?",
                      "learning_rate = 'fast': input should be a valid number", "expected a number > 0")
    assert "train.lr" not in err and "micro_batch_size" not in err


def test_missing_config_file(capsys, tmp_path) -> None:
    """A config path that does not exist: exit 2 naming the file."""
    missing = tmp_path / "nope" / "cfg.yaml"
    code, _, err = run_cli(capsys, "train", missing, "--dry-run")
    assert_user_error(code, err, str(missing), "does not exist")


def test_subprocess_user_error_exits_2_without_traceback(tmp_path) -> None:
    """`python -m shardwise` as users run it: a user mistake is one line on stderr and exit status 2."""
    missing = tmp_path / "missing.yaml"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", str(missing)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(missing) in proc.stderr and proc.stdout == ""


def test_nproc_with_a_layout_that_does_not_fit_fails_before_launching(capsys, data, tmp_path) -> None:
    """data_parallel 2 on 3 processes: refused with the layouts that fit, before any process starts."""
    cfg = tiny_config(data, tmp_path / "cfg.yaml", tmp_path / "run", parallel={"data_parallel": 2})
    code, _, err = run_cli(capsys, "train", cfg, "--nproc", "3")
    assert_user_error(code, err, "2 processes", "3 are running", "dp 3 x tp 1 x pp 1")
    assert not (tmp_path / "run").exists()


def _cli(*argv: str, cwd: Path, pythonpath: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*pythonpath, str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, PYTHONPATH=path, **env), cwd=cwd)


# Loaded by every Python process started with this directory on PYTHONPATH: in a rank (RANK is set)
# it makes the checkpoint save of step K kill rank R with SIGKILL once, after the save completed.
_KILL_AFTER_SAVE = """
import os
spec = os.environ.get("SHARDWISE_TEST_KILL")
if spec and "RANK" in os.environ:
    import signal
    import shardwise.checkpoint.checkpointer as ckpt
    step, rank, marker = spec.split(":", 2)
    original = ckpt.save_checkpoint
    def save_checkpoint(run_dir, at_step, *args, **kwargs):
        path = original(run_dir, at_step, *args, **kwargs)
        if at_step == int(step) and os.environ["RANK"] == rank and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    ckpt.save_checkpoint = save_checkpoint
"""


@pytest.mark.timeout(300)
def test_nproc_trains_with_data_parallel_and_restarts_a_killed_rank(data, tmp_path) -> None:
    """`--nproc 2` through torchrun: the same losses as one process; with --max-restarts a rank that
    is killed after the step-2 checkpoint is restarted with the group, which resumes and ends with the
    uninterrupted run's losses."""
    constant = {"decay_style": "constant", "micro_batch_size": 2}
    single = tiny_config(data, tmp_path / "single.yaml", tmp_path / "single", train={**constant, "micro_batch_size": 4})
    proc = _cli("train", str(single), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layout = {"data_parallel": 2, "zero_stage": 3}
    dp2 = tiny_config(data, tmp_path / "dp2.yaml", tmp_path / "dp2", parallel=layout, train=constant)
    proc = _cli("train", str(dp2), "--nproc", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: 4 steps") == 1  # rank 0 reports
    reference = {r["step"]: r["loss"] for r in metrics(tmp_path / "dp2")}
    assert list(reference.values()) == pytest.approx([r["loss"] for r in metrics(tmp_path / "single")], abs=1e-4)

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_AFTER_SAVE)
    marker = tmp_path / "killed-once"
    killed = tiny_config(data, tmp_path / "killed.yaml", tmp_path / "killed", parallel=layout, train=constant)
    proc = _cli("train", str(killed), "--nproc", "2", "--max-restarts", "1", cwd=tmp_path,
                pythonpath=(str(hook),), SHARDWISE_TEST_KILL=f"2:1:{marker}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "rank 1 was never killed"
    assert "restart 1" in proc.stderr
    final = {r["step"]: r["loss"] for r in metrics(tmp_path / "killed")}
    assert final[3] == pytest.approx(reference[3], abs=1e-6) and final[4] == pytest.approx(reference[4], abs=1e-6)


# --- real runs -----------------------------------------------------------------------------------------------


def test_npu_run_fails_clearly_and_set_overrides_reach_the_run(capsys, data, tmp_path) -> None:
    """device npu without torch_npu: exit 2 saying how to pick another device; --set does that."""
    from shardwise.parallel.launch import npu_available

    if npu_available():
        pytest.skip("an Ascend NPU is present")
    run_dir = tmp_path / "run"
    cfg = tiny_config(data, tmp_path / "cfg.yaml", run_dir, run={"device": "npu"})
    code, _, err = run_cli(capsys, "train", cfg)
    assert_user_error(code, err, "npu", "run.device", "--set run.device=cpu")
    assert not (run_dir / "checkpoints").exists()

    # The seed spelling fails the same way.
    seed_cfg = tmp_path / "seed.yaml"
    raw = yaml.safe_load(cfg.read_text())
    del raw["run"]
    raw.update(device_target="Ascend", mode="pynative")
    seed_cfg.write_text(yaml.safe_dump(raw))
    code, _, err = run_cli(capsys, "train", seed_cfg)
    assert_user_error(code, err, "device_target", "--set run.device=cpu")

    # The advice works, and the other overrides reach the run too.
    code, out, err = run_cli(capsys, "train", cfg, "--set", "run.device=cpu", "--set", "train.max_steps=2",
                             "--set", "train.lr=0.02", "--set", "train.save_steps=1")
    assert code == 0, err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run"]["device"] == "cpu" and saved["train"]["lr"] == 0.02 and saved["train"]["max_steps"] == 2
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert metrics(run_dir)[0]["lr"] == pytest.approx(0.01)  # cosine, step 1 of 2: half of train.lr 0.02
    assert checkpoint_steps(run_dir) == [1, 2]
    assert "done: 2 steps" in out


def test_existing_run_is_refused_and_overwrite_replaces_it(capsys, data, trained_run, tmp_path) -> None:
    """A directory holding a run: exit 2 without --resume/--overwrite; --overwrite starts afresh."""
    cfg = tiny_config(data, tmp_path / "cfg.yaml", trained_run)
    before = (trained_run / "metrics.jsonl").read_text()
    code, _, err = run_cli(capsys, "train", cfg)
    assert_user_error(code, err, str(trained_run), "--resume", "--overwrite")
    assert (trained_run / "metrics.jsonl").read_text() == before  # untouched

    # --overwrite with a config this process cannot run fails before it removes anything.
    code, _, err = run_cli(capsys, "train", cfg, "--overwrite", "--set", "parallel.tensor_parallel=2")
    assert_user_error(code, err, "2 processes", "--nproc 2", "tensor_parallel")
    from shardwise.parallel.launch import npu_available

    if not npu_available():
        code, _, err = run_cli(capsys, "train", cfg, "--overwrite", "--set", "run.device=npu")
        assert_user_error(code, err, "--set run.device=cpu")
    assert (trained_run / "metrics.jsonl").read_text() == before
    assert checkpoint_steps(trained_run) == [2, 4]

    copy = tmp_path / "copy"
    shutil.copytree(trained_run, copy)
    assert checkpoint_steps(copy) == [2, 4]
    code, out, err = run_cli(capsys, "train", cfg, "--overwrite", "--set", f"train.output_dir={copy}",
                             "--set", "train.max_steps=1", "--set", "train.save_steps=1")
    assert code == 0, err
    assert checkpoint_steps(copy) == [1]
    assert [r["step"] for r in metrics(copy)] == [1]


def test_resuming_a_finished_run_says_so(capsys, data, trained_run, tmp_path) -> None:
    """--resume auto at the last step trains nothing and says which checkpoint holds the result."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    cfg = tiny_config(data, tmp_path / "cfg.yaml", run_dir)
    code, out, err = run_cli(capsys, "train", cfg, "--resume", "auto")
    assert code == 0, err
    final = run_dir / "checkpoints" / "step_00000004"
    assert out == f"already finished at step 4 (nothing to train); checkpoint {final}\n"
    assert "nan" not in out
    assert checkpoint_steps(run_dir) == [2, 4]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert (run_dir / "metrics.jsonl").read_text() == before


def _expected_generation(run_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """What greedy generation from the run's newest checkpoint gives, computed in this process.

    The prompt follows EOS, as a document does in pre-training (no BOS is ever trained on)."""
    from shardwise.checkpoint.storage import find_checkpoint
    from shardwise.checkpoint.weights import load_model
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.models import generate

    path = find_checkpoint(run_dir)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path / "tokenizer")
    (out,) = generate(model, [[tokenizer.eos_id, *tokenizer.encode(prompt)]], max_new_tokens=max_new_tokens,
                      eos_id=tokenizer.eos_id)
    assert 1 <= len(out) <= max_new_tokens
    return prompt + tokenizer.decode(out)


def test_train_then_generate(capsys, trained_run) -> None:
    """generate RUN_DIR prints the prompt and its greedy continuation, the same on every call."""
    assert checkpoint_steps(trained_run) == [2, 4]
    losses = [r["loss"] for r in metrics(trained_run)]
    assert len(losses) == 4 and losses[-1] < losses[0]

    prompt = "Elizabeth walked to the"
    code, first, err = run_cli(capsys, "generate", trained_run, "--prompt", prompt, "--max-new-tokens", "5")
    assert code == 0, err
    code, second, err = run_cli(capsys, "generate", trained_run, "--prompt", prompt, "--max-new-tokens", "5")
    assert code == 0, err
    assert first == second
    assert first.startswith(prompt) and len(first.rstrip("\n")) > len(prompt)
    assert first == _expected_generation(trained_run, prompt, 5) + "\n"

    code, batch, err = run_cli(capsys, "generate", trained_run / "checkpoints" / "step_00000004", "--prompt",
                               prompt, "--prompt", "Jane", "--max-new-tokens", "5", "--no-stream")
    assert code == 0, err
    assert batch.startswith(first.rstrip("\n") + "\n---\nJane")


def test_generate_mistakes(capsys, trained_run, data, tmp_path) -> None:
    """A missing run, or a checkpoint without a tokenizer, are user errors; --tokenizer fixes the latter."""
    code, _, err = run_cli(capsys, "generate", tmp_path / "nothing", "--prompt", "x")
    assert_user_error(code, err, str(tmp_path / "nothing"))

    bare = tmp_path / "bare"
    shutil.copytree(trained_run / "checkpoints" / "step_00000004", bare / "checkpoints" / "step_00000004")
    shutil.rmtree(bare / "checkpoints" / "step_00000004" / "tokenizer")
    code, _, err = run_cli(capsys, "generate", bare, "--prompt", "Jane", "--max-new-tokens", "3")
    assert_user_error(code, err, "--tokenizer")
    code, out, err = run_cli(capsys, "generate", bare, "--prompt", "Jane", "--max-new-tokens", "3",
                             "--tokenizer", data["tokenizer"])
    assert code == 0, err
    assert out == _expected_generation(trained_run, "Jane", 3) + "\n"
