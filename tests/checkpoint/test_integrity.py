"""A checkpoint is written once and whole or not at all, never through a link, and loads only as it was
saved (issue 24): a directory in a save's way is moved aside and kept, never skipped; messages never
advise a flag that deletes what the user still needs, and --overwrite names what it deletes; every file
is checked against the SHA-256 checksums saved with it (a flipped bit ends as exit 2 naming the file),
unless train.verify_checkpoints is false, which says what it skips; a LoRA run stops when the base
model at init_from changed; hostile side files (trainer state, random state, checksums) end as one
CheckpointError naming the file, under a memory and time cap."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from shardwise.checkpoint import rng
from shardwise.checkpoint.format import METADATA_FILE, SafeCheckpointReader
from shardwise.checkpoint.storage import (
    CHECKSUMS_FILE,
    STATE_FILE,
    list_checkpoints,
    read_rank_state,
    read_trainer_state,
    verify_checkpoint,
)
from shardwise.checkpoint.weights import load_model
from shardwise.cli import main
from shardwise.data import train_bpe_tokenizer
from shardwise.errors import CheckpointError, ConfigError
from shardwise.train.run_dir import check_run_dir
from tests.capped import assert_refused, run_capped
from tests.data.conftest import write_corpus
from tests.test_cli import logging_restored, run_cli

SHARD = "__0_0.distcp"


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


def _config(data: dict, path: Path, output_dir: Path, max_steps: int = 4, model: dict | None = None,
            **extra: dict) -> Path:
    """A tiny CPU run: a checkpoint every 2 steps."""
    cfg = {
        "model": model or {"preset": "tiny_llama"},
        "data": {"train_files": [str(data["glob"])], "tokenizer": str(data["tokenizer"]), "seq_length": 32,
                 "cache_dir": str(data["root"] / "cache")},
        "train": {"output_dir": str(output_dir), "max_steps": max_steps, "micro_batch_size": 4, "lr": 1.0e-2,
                  "save_steps": 2, "log_steps": 1, "progress_bar": False, "tensorboard": False, "peak_tflops": 1.0},
        "run": {"device": "cpu", "num_threads": 1},
    }
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _cli(capsys, *argv) -> tuple[int, str, str]:  # noqa: ANN001
    threads = torch.get_num_threads()  # run.num_threads: 1 sets it process-wide
    try:
        return run_cli(capsys, *argv)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("integrity_data")
    files = write_corpus(root / "corpus", n_files=2)
    train_bpe_tokenizer(files, 300, root / "tok", show_progress=False)
    return {"root": root, "glob": root / "corpus" / "*.txt", "tokenizer": root / "tok"}


@pytest.fixture(scope="module")
def original(data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of 4 steps: checkpoints step_2 and step_4 (config.yaml and tokenizer/ inside)."""
    root = tmp_path_factory.mktemp("integrity_run")
    threads = torch.get_num_threads()
    try:
        with logging_restored():
            assert main(["train", str(_config(data, root / "cfg.yaml", root / "run"))]) == 0
    finally:
        torch.set_num_threads(threads)
    return root / "run"


def _copy(original: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(original, run, symlinks=True)
    return run


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _flip(file: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 1 << bit
    file.write_bytes(bytes(data))


# --- 2. written once and whole, or not at all --------------------------------------------------------------


def test_resume_past_an_incomplete_newest_checkpoint_keeps_the_resumed_steps(capsys, data, original, tmp_path):
    """The newest checkpoint lost its trainer state (a save killed midway, before shardwise published
    atomically, or a copy cut short): --resume auto continues from step 2, and the checkpoint of step 4
    it then writes is saved, with the incomplete one moved aside and kept, not silently skipped."""
    run = _copy(original, tmp_path)
    (_step(run, 4) / STATE_FILE).unlink()
    code, _, err = _cli(capsys, "train", _config(data, tmp_path / "cfg.yaml", run), "--resume", "auto")
    assert code == 0, err
    assert "resumed from" in err and "step_00000002" in err
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002", "step_00000004"]
    assert read_trainer_state(_step(run, 4))["step"] == 4
    verify_checkpoint(_step(run, 4))  # the new one, whole
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_00000004.incomplete-")]
    assert len(aside) == 1 and (aside[0] / METADATA_FILE).is_file() and (aside[0] / SHARD).is_file()
    assert "incomplete checkpoint" in err and str(aside[0]) in err  # the warning says where it went


def test_a_step_mismatch_is_refused_without_advising_overwrite(capsys, data, original, tmp_path):
    """A checkpoint whose trainer state records another step than its directory's name (renamed, or its
    files replaced): refused, naming both, without advising --overwrite (which would delete it)."""
    run = _copy(original, tmp_path)
    shutil.copytree(_step(run, 2), _step(run, 6))
    code, _, err = _cli(capsys, "train", _config(data, tmp_path / "cfg.yaml", run, max_steps=8), "--resume", "auto")
    assert code == 2 and "Traceback" not in err, err
    assert "records step 2" in err and "step_00000006" in err and "--overwrite" not in err, err
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002", "step_00000004", "step_00000006"]


def test_overwrite_names_what_it_deletes(capsys, data, original, tmp_path):
    run = _copy(original, tmp_path)
    with pytest.raises(ConfigError) as info:  # a new run into a run directory
        check_run_dir(run, None, overwrite=False)
    message = str(info.value)
    assert f"{run / 'checkpoints'}/ (with step_00000002, step_00000004)" in message, message
    assert str(run / "metrics.jsonl") in message and "deletes" in message
    # Resuming from an older checkpoint: the newer ones are named, with their paths, before and when deleted.
    cfg = _config(data, tmp_path / "cfg.yaml", run)
    code, _, err = _cli(capsys, "train", cfg, "--resume", _step(run, 2))
    assert code == 2 and f"to delete them ({_step(run, 4)})" in err, err
    code, _, err = _cli(capsys, "train", cfg, "--resume", _step(run, 2), "--overwrite")
    assert code == 0, err
    assert f"deleted the checkpoints newer than step 2: {_step(run, 4)}" in err, err


def test_links_in_the_run_directory_are_not_written_through(capsys, data, original, tmp_path):
    """config.yaml and metrics.jsonl linked to the user's own files: the run writes copies of its own, the
    user's files stay as they were; a linked checkpoints/ is refused, the directory it points to untouched."""
    run = _copy(original, tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copyfile(run / name, mine / name)
        (run / name).unlink()
        (run / name).symlink_to(mine / name)
    before = {name: (mine / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    code, _, err = _cli(capsys, "train", _config(data, tmp_path / "cfg.yaml", run, max_steps=6), "--resume", "auto")
    assert code == 0, err
    assert {name: (mine / name).read_bytes() for name in before} == before
    for name in before:
        assert not (run / name).is_symlink() and "symbolic link" in err
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 6 in steps and 1 in steps  # the run's curve goes on in its own file

    linked = _copy(original, tmp_path / "linked")
    elsewhere = tmp_path / "elsewhere"
    (linked / "checkpoints").rename(elsewhere)
    (linked / "checkpoints").symlink_to(elsewhere)
    listing = sorted(p.name for p in elsewhere.iterdir())
    code, _, err = _cli(capsys, "train", _config(data, tmp_path / "cfg2.yaml", linked, max_steps=6),
                        "--resume", "auto")
    assert code == 2 and "Traceback" not in err and f"{linked / 'checkpoints'} is a symbolic link" in err, err
    assert sorted(p.name for p in elsewhere.iterdir()) == listing


# --- 3. checksums ------------------------------------------------------------------------------------------


def test_the_manifest_lists_every_file(original):
    ckpt = _step(original, 4)
    listed = set(json.loads((ckpt / CHECKSUMS_FILE).read_text())["files"])
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {CHECKSUMS_FILE}
    assert listed == on_disk
    assert {SHARD, METADATA_FILE, STATE_FILE, "rng_rank0.json", "config.yaml", "tokenizer/tokenizer.json"} <= listed
    assert not any(name.startswith(".checksums_rank") for name in on_disk)


def _flip_shard(ckpt: Path) -> str:
    size = (ckpt / SHARD).stat().st_size
    _flip(ckpt / SHARD, size // 2, bit=3)  # inside a tensor's bytes: the load alone would not notice
    return SHARD


def _flip_state(ckpt: Path) -> str:
    text = (ckpt / STATE_FILE).read_bytes()
    _flip(ckpt / STATE_FILE, text.index(b'"step": 4') + len(b'"step": '))  # 4 -> 5: still valid JSON
    return STATE_FILE


def _flip_config(ckpt: Path) -> str:
    text = (ckpt / "config.yaml").read_bytes()
    _flip(ckpt / "config.yaml", text.index(b"max_steps: 4") + len(b"max_steps: "))  # 4 -> 5: still valid YAML
    return "config.yaml"


@pytest.mark.parametrize("command, flip", [("generate", _flip_shard), ("train", _flip_shard),
                                           ("train", _flip_state), ("train", _flip_config)],
                         ids=["generate-shard", "resume-shard", "resume-trainer_state", "resume-config"])
def test_a_flipped_bit_is_caught(data, original, tmp_path, command, flip):
    run = _copy(original, tmp_path)
    ckpt = _step(run, 4)
    name = flip(ckpt)
    if command == "generate":
        argv = ["generate", ckpt, "--prompt", "Elizabeth", "--max-new-tokens", "2"]
    else:
        argv = ["train", _config(data, tmp_path / "cfg.yaml", run, max_steps=6), "--resume", "auto"]
    text = assert_refused(argv, f"{ckpt} cannot be loaded: {name} changed since it was saved", "copy fault")
    assert "Traceback" not in text
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002", "step_00000004"]  # nothing written


def test_a_checkpoint_without_checksums_loads_with_a_warning(capsys, data, original, tmp_path, caplog):
    run = _copy(original, tmp_path)
    (_step(run, 4) / CHECKSUMS_FILE).unlink()
    code, _, err = _cli(capsys, "train", _config(data, tmp_path / "cfg.yaml", run, max_steps=6), "--resume", "auto")
    assert code == 0, err
    assert f"{_step(run, 4)} has no {CHECKSUMS_FILE}" in err and "without checking" in err, err
    with caplog.at_level("WARNING", logger="shardwise"):
        load_model(_step(run, 2))  # and the one this shardwise wrote on its own loads silently
    assert "no checksums" not in caplog.text


def test_verification_switched_off_loads_and_says_what_it_skips(capsys, data, original, tmp_path):
    run = _copy(original, tmp_path)
    _flip_config(_step(run, 4))
    cfg = _config(data, tmp_path / "cfg.yaml", run, max_steps=6, train={"verify_checkpoints": False})
    code, _, err = _cli(capsys, "train", cfg, "--resume", "auto")
    assert code == 0, err
    assert "train.verify_checkpoints is false" in err and "flipped bit" in err and "not checked" in err, err


def test_a_lora_resume_with_a_changed_base_is_refused(capsys, data, original, tmp_path):
    """The base a LoRA run trains on (init_from) is fingerprinted into its checkpoints; a resume onto other
    base weights stops naming init_from (and goes on, with a warning, when verification is off). The
    adapter is written into the checkpoint before it is published, so the checksums cover it."""
    base = tmp_path / "base" / "step_00000002"
    shutil.copytree(_step(original, 2), base)
    run = tmp_path / "lora"
    lora = {"lora": {"r": 4, "alpha": 8.0}}
    cfg = _config(data, tmp_path / "cfg.yaml", run, max_steps=2, model={"init_from": str(base)}, **lora)
    code, _, err = _cli(capsys, "train", cfg)
    assert code == 0, err
    ckpt = _step(run, 2)
    assert read_trainer_state(ckpt)["base"]["files"][SHARD]["size"] > 0
    assert "adapter/adapter_model.safetensors" in json.loads((ckpt / CHECKSUMS_FILE).read_text())["files"]
    verify_checkpoint(ckpt)
    shutil.rmtree(base)
    shutil.copytree(_step(original, 4), base)  # other weights of the same model at the same path
    cfg = _config(data, tmp_path / "cfg.yaml", run, max_steps=4, model={"init_from": str(base)}, **lora)
    code, _, err = _cli(capsys, "train", cfg, "--resume", "auto")
    assert code == 2 and "Traceback" not in err, err
    assert f"model.init_from {base} is not the base model" in err and "holds other bytes" in err, err
    cfg = _config(data, tmp_path / "cfg.yaml", run, max_steps=4, model={"init_from": str(base)},
                  train={"verify_checkpoints": False}, **lora)
    code, _, err = _cli(capsys, "train", cfg, "--resume", "auto")
    assert code == 0 and "is not the base model" in err, err


# --- hostile side files -----------------------------------------------------------------------------------

_BIG = 70 << 20  # past the 64 MiB bound of a side file


def _hostile_cases(step_dir: str, work: str) -> list[tuple[str, str, str]]:
    """In a capped worker: each hostile file in a fresh copy of the checkpoint, read as a resume reads it.
    Returns (case, the error's class, its message) for each."""
    original, work = Path(step_dir), Path(work)
    python = json.loads((original / "rng_rank0.json").read_text())["python"]
    state = json.loads((original / STATE_FILE).read_text())
    cases = {
        # trainer_state.json
        "state: too big": (STATE_FILE, b" " * _BIG),
        "state: nested": (STATE_FILE, b"[" * 200_000),
        "state: not UTF-8": (STATE_FILE, b'{"step": "\xff\xfe"}'),
        "state: huge integer": (STATE_FILE, b'{"step": 1' + b"0" * 100_000 + b"}"),
        "state: NaN step": (STATE_FILE, b'{"step": NaN}'),
        "state: absurd step": (STATE_FILE, json.dumps({**state, "step": 10**30}).encode()),
        "state: layout a list": (STATE_FILE, json.dumps({**state, "layout": [1] * 10}).encode()),
        "state: base a string": (STATE_FILE, json.dumps({**state, "base": "x"}).encode()),
        # rng_rank0.json
        "rng: too big": ("rng_rank0.json", b'{"cpu": "' + b"A" * (2 << 20) + b'"}'),
        "rng: cpu too short": ("rng_rank0.json", json.dumps({"format": 2, "cpu": "AAAA", "python": python}).encode()),
        "rng: cpu not base64": ("rng_rank0.json", json.dumps(
            {"format": 2, "cpu": "%" * 6744, "python": python}).encode()),
        "rng: cpu a list": ("rng_rank0.json", json.dumps({"format": 2, "cpu": [0] * 5056, "python": python}).encode()),
        "rng: python of 100k items": ("rng_rank0.json", json.dumps(
            {"format": 2, "cpu": rng._b64(torch.get_rng_state()), "python": [3, [0] * 100_000, None]}).encode()),
        "rng: python word too big": ("rng_rank0.json", json.dumps(
            {"format": 2, "cpu": rng._b64(torch.get_rng_state()), "python": [3, [2**40] * 624 + [0], None]}).encode()),
        "rng: streams a list": ("rng_rank0.json", json.dumps(
            {"format": 2, "cpu": rng._b64(torch.get_rng_state()), "python": python, "streams": []}).encode()),
        "rng: format 99": ("rng_rank0.json", json.dumps({"format": 99}).encode()),
        # checksums.json
        "checksums: files a list": (CHECKSUMS_FILE, b'{"format": 1, "algorithm": "sha256", "files": []}'),
        "checksums: a path out": (CHECKSUMS_FILE, json.dumps({"format": 1, "algorithm": "sha256", "files": {
            "../x": {"size": 1, "sha256": "0" * 64}}}).encode()),
        "checksums: a bad digest": (CHECKSUMS_FILE, json.dumps({"format": 1, "algorithm": "sha256", "files": {
            SHARD: {"size": 1, "sha256": "zz"}}}).encode()),
        "checksums: another hash": (CHECKSUMS_FILE, b'{"format": 1, "algorithm": "md5", "files": {}}'),
        # .metadata.json
        "metadata: nested": (METADATA_FILE, b"{" * 200_000),
    }
    out = []
    for i, (case, (name, content)) in enumerate(cases.items()):
        ckpt = work / str(i) / "step_00000004"
        shutil.copytree(original, ckpt)
        if name != CHECKSUMS_FILE:  # the file's own checks, not its checksum, are what is tested here
            (ckpt / CHECKSUMS_FILE).unlink()
        (ckpt / name).write_bytes(content)
        try:
            if name == STATE_FILE:
                read_trainer_state(ckpt)
            elif name == "rng_rank0.json":
                rng.restore(read_rank_state(ckpt, 0), torch.device("cpu"), source=str(ckpt / name))
            elif name == CHECKSUMS_FILE:
                verify_checkpoint(ckpt)
            else:
                SafeCheckpointReader(ckpt).read_metadata()
            out.append((case, "no error", ""))
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            out.append((case, type(e).__name__, f"{name}|{e}"))
        shutil.rmtree(ckpt.parent)
    return out


def test_hostile_side_files_end_as_checkpoint_errors_naming_the_file(original, tmp_path):
    results = run_capped(_hostile_cases, str(_step(original, 4)), str(tmp_path), memory_mib=1024, seconds=60)
    assert len(results) == 21
    for case, kind, text in results:
        name, _, message = text.partition("|")
        assert kind == "CheckpointError", (case, kind, message)
        assert name in message and "\n" not in message and len(message) < 2000, (case, message)


def test_missing_and_added_files(original, tmp_path, caplog):
    """A file gone from the checkpoint, or added to it, stops a load naming it; a whole tokenizer/ left out
    of a copy only warns (what needs a tokenizer asks for --tokenizer)."""
    run = _copy(original, tmp_path)
    ckpt = _step(run, 4)
    (ckpt / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer/tokenizer.json changed since it was saved \(it is missing"):
        verify_checkpoint(ckpt)
    shutil.rmtree(ckpt / "tokenizer")
    with caplog.at_level("WARNING", logger="shardwise"):
        assert verify_checkpoint(ckpt)
    assert "tokenizer/ was saved with the checkpoint" in caplog.text
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="notes.txt was not saved with it"):
        verify_checkpoint(ckpt)
    (ckpt / "notes.txt").unlink()
    (ckpt / "notes.txt").symlink_to(ckpt / SHARD)
    with pytest.raises(CheckpointError, match="notes.txt is a symbolic link"):
        verify_checkpoint(ckpt)
