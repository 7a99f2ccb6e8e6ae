"""Fuzzing the readers of files from elsewhere (issue 24): seeded random damage to the files of a real
checkpoint, a Hugging Face directory, a peft adapter, a run directory and data files, each read back by
the command a user would run on it (`generate`, `report`, the data readers).

Damage: the file cut short at a random byte, a few bits flipped, and, for JSON and YAML, one value
swapped for another type, a huge or negative number, NaN, a long string or a deep nest. Every outcome
must be success, or exit 2 with a message that names the damaged file: never a traceback, a hang or a
blow-up. Each kind runs in one worker under a memory and a time cap (tests/capped.py), so that a
regression fails here instead of taking the machine down. The seed is fixed: a failure replays.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from shardwise.checkpoint.storage import find_checkpoint
from shardwise.data.packing import PackedDataset
from shardwise.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from shardwise.errors import ShardwiseError
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer
from tests.capped import _cli, run_capped
from tests.data.conftest import write_corpus
from tests.test_cli import logging_restored
from tests.train.conftest import SEQ, make_tokens

SEED = 20261206
CASES = 20  # per kind of directory
REPORT_CASES = 10  # a report draws its plots: the slowest reader

HUGE_VALUES: list[Any] = [None, True, False, -1, 0, 10**30, -(10**30), 1e308, math.nan, "x" * 5000, "", [], {},
                          [1, 2, 3], {"a": 1}, "../../etc/passwd", 2**63]


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The valid originals: a LoRA run (its checkpoint and run directory), that run converted to a
    Hugging Face directory with the adapter beside it, and small data files."""
    root = tmp_path_factory.mktemp("reader_fuzz")
    train_bpe_tokenizer(write_corpus(root / "corpus", n_files=2), 300, root / "tok", show_progress=False)
    raw = {"model": {"preset": "tiny_llama"}, "data": {"seq_length": SEQ},
           "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
           "train": {"output_dir": str(root / "run"), "max_steps": 2, "micro_batch_size": 4, "lr": 3e-3,
                     "warmup_steps": 1, "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7},
           "run": {"num_threads": 1}}
    threads = torch.get_num_threads()
    try:
        Trainer(validate(raw), train_dataset=PackedDataset(make_tokens(), SEQ),
                tokenizer=load_tokenizer(root / "tok")).train()
    finally:
        torch.set_num_threads(threads)
    with logging_restored():  # a module fixture: the per-test restore runs after it, and would keep main()'s setup
        code, text = _cli(["convert", str(root / "run"), "--to", "hf", str(root / "hf")])
    assert code == 0, text
    data = root / "data"
    data.mkdir()
    (data / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    chats = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(20)]
    (data / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    shutil.copytree(root / "tok", data / "tok")
    checkpoint = find_checkpoint(root / "run")
    return {"checkpoint": checkpoint, "unverified": checkpoint, "hf": root / "hf", "adapter": root / "hf" / "adapter",
            "run": root / "run", "data": data, "tokenizer": root / "tok"}


# --- damage ------------------------------------------------------------------------------------------------


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON / YAML document."""
    found = [prefix]
    if isinstance(doc, dict):
        for k, v in list(doc.items())[:200]:
            found += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:50]):
            found += _paths(v, prefix + (i,))
    return found


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    doc[path[0]] = _replace(doc[path[0]], path[1:], value)
    return doc


def _structured(data: bytes, suffix: str, rng: random.Random) -> tuple[bytes, str] | None:
    """One value of a JSON / YAML / JSON Lines file swapped for something odd; None when it does not parse."""
    try:
        if suffix in (".json", ".jsonl"):
            lines = data.decode().splitlines() if suffix == ".jsonl" else [data.decode()]
            i = rng.randrange(len(lines))
            doc = json.loads(lines[i])
        else:
            doc = yaml.safe_load(data)
    except (ValueError, yaml.YAMLError):
        return None
    path = rng.choice(_paths(doc))
    value = rng.choice(HUGE_VALUES + ["deep"])
    if value == "deep":
        value = json.loads("[" * 300 + "]" * 300)
    doc = _replace(doc, path, value)
    if suffix == ".yaml":
        return yaml.safe_dump(doc).encode(), f"{'.'.join(map(str, path))} = {str(value)[:20]}"
    text = json.dumps(doc)
    if suffix == ".jsonl":
        lines[i] = text
        text = "\n".join(lines) + "\n"
    return text.encode(), f"{'.'.join(map(str, path))} = {str(value)[:20]}"


def damage(data: bytes, suffix: str, rng: random.Random) -> tuple[bytes, str]:
    """`data` damaged one way, and how."""
    how = rng.choice(["truncate", "bits", "value", "value"] if suffix in (".json", ".jsonl", ".yaml")
                     else ["truncate", "bits"])
    if how == "value":
        changed = _structured(data, suffix, rng)
        if changed is not None:
            return changed
        how = "bits"
    if how == "truncate" and data:
        cut = rng.randrange(len(data))
        return data[:cut], f"cut at byte {cut} of {len(data)}"
    out = bytearray(data)
    flips = []
    for _ in range(rng.choice([1, 1, 2, 8])):
        if out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
            flips.append(i)
    return bytes(out), f"bits flipped at bytes {flips}"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


# --- what reads each kind ------------------------------------------------------------------------------


def _generate(target: Path, original: Path) -> tuple[int, str]:
    return _cli(["generate", str(target), "--prompt", "It was", "--max-new-tokens", "2", "--temperature", "0"])


def _generate_unverified(target: Path, original: Path) -> tuple[int, str]:
    """Past the checksums (which catch any change to a checkpoint's files): the readers behind them."""
    return _cli(["generate", str(target), "--prompt", "It was", "--max-new-tokens", "2", "--temperature", "0",
                 "--no-verify"])


def _generate_adapter(target: Path, original: Path) -> tuple[int, str]:
    """The damaged adapter on its base (the Hugging Face directory the original lies in)."""
    base = {"base_model_name_or_path": str(original.parent)}
    return _cli(["generate", base["base_model_name_or_path"], "--adapter", str(target), "--prompt", "It was",
                 "--max-new-tokens", "2", "--temperature", "0"])


def _report(target: Path, original: Path) -> tuple[int, str]:
    return _cli(["report", str(target), "--out", str(target.parent / "report_out")])


def _data(target: Path, original: Path) -> tuple[int, str]:
    """`shardwise prepare` over docs.jsonl, then the instruction data of chat.jsonl as a run builds it."""
    from shardwise.data.build import build_data

    code, text = _cli(["prepare", "--input", str(target / "docs.jsonl"), "--tokenizer", str(target / "tok"),
                       "--out", str(target / "prepared"), "--workers", "1"])
    if code != 0:
        return code, text
    raw = {"model": {"preset": "tiny_llama"},
           "data": {"kind": "instruction", "train_files": [str(target / "chat.jsonl")], "seq_length": SEQ,
                    "tokenizer": str(target / "tok"), "cache_dir": str(target / "cache")},
           "train": {"max_steps": 1}}
    try:
        build_data(validate(raw).data, 512)
    except ShardwiseError as e:
        return 2, f"shardwise: error: {e}"
    return 0, ""


READERS = {"checkpoint": _generate, "unverified": _generate_unverified, "hf": _generate,
           "adapter": _generate_adapter, "run": _report, "data": _data}


def fuzz_kind(kind: str, original: Path, work: Path, seed: int, cases: int) -> list[str]:
    """Damage one file of a copy of `original` per case and read it with `kind`'s reader; the outcomes,
    as lines 'outcome | file | damage'. Runs in a capped worker."""
    rng = random.Random(f"{seed}-{kind}")
    lines = []
    for case in range(cases):
        copy = work / f"{kind}-{case}"
        target = copy / original.name  # an adapter's config names its base by absolute path: still there
        shutil.copytree(original, target, symlinks=True)
        file = rng.choice(_files(target))
        damaged, how = damage(file.read_bytes(), file.suffix, rng)
        file.write_bytes(damaged)
        code, text = READERS[kind](target, original)
        if code == 0:
            outcome = "ok"
        elif code == 2 and _names(text, file, target) and "Traceback" not in text:
            outcome = "refused"
        else:
            outcome = f"BAD exit {code}: {text.strip()[-1500:]}"
        lines.append(f"{outcome} | {file.relative_to(target)} | {how}")
        shutil.rmtree(copy, ignore_errors=True)
    return lines


def _names(message: str, file: Path, target: Path) -> bool:
    """Whether an error message names the damaged file: by name, or, for a file of a tokenizer's or
    adapter's own directory (whose files are read as one), by that directory's path."""
    return file.name in message or (file.parent != target and str(file.parent) in message)


@pytest.mark.parametrize("kind", list(READERS))
def test_damaged_files_end_cleanly(kind: str, sources: dict[str, Path], tmp_path: Path) -> None:
    """Every damaged file is read or refused naming it (exit 2), within 1.5 GiB and 120 s for the kind."""
    cases = REPORT_CASES if kind == "run" else CASES
    lines = run_capped(fuzz_kind, kind, sources[kind], tmp_path, SEED, cases, memory_mib=1536, seconds=120)
    counts = Counter(line.split(" |")[0] if not line.startswith("BAD") else "BAD" for line in lines)
    print(f"{kind}: {dict(counts)}")
    bad = [line for line in lines if line.startswith("BAD")]
    assert not bad, "\n\n".join(bad)
    if kind != "run":  # the report reads what it can of a damaged run and notes the rest on its page
        assert counts["refused"] > 0  # the damage is real: some of it must be caught
