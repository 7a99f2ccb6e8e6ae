"""Fuzzing bad configs: seeded random mutations of the valid configs (configs/*.yaml pointed at tiny
data, and a tiny-model config) go through `shardwise train` in-process, under --dry-run and, for a
subset, as real runs of one or two steps. Every outcome must be exit 0, or exit 2 with one
`shardwise: error:` message: never a traceback, never a bare Python exception.

The mutations are what a new user's hands and editors do to a file: a value of another type, a
negative, zero, huge or non-finite number, a dropped, misspelt or wrongly nested key, a list or a
mapping where a scalar goes, an empty file, binary garbage, a file cut short, a key given twice.
The seed is fixed, so a failure reproduces; the counts are printed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardwise.cli import main
from shardwise.data import train_bpe_tokenizer
from shardwise.models import count_parameters
from shardwise.resolve import load_run_config as load_config
from tests.data.conftest import write_corpus
from tests.test_cli import logging_restored

REPO = Path(__file__).resolve().parents[1]
SEED = 20240611
DRY_RUNS = 400
REAL_RUNS = 16

# Keys whose huge values would make a real run huge (or start a process per unit): under a real run
# they get every mutation but that one. The dry run takes them all.
_SIZES = {"max_steps", "epochs", "micro_batch_size", "global_batch_size", "seq_length", "num_threads",
          "num_workers", "prepare_workers", "gradient_accumulation_steps", "eval_batches", "r",
          "max_position_embeddings", "vocab_size", "hidden_size", "num_layers", "intermediate_size"}

KeyPath = tuple[Any, ...]  # the keys from the top of a config down to one of its entries


# --- the valid configs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the fuzzing runs in: the configs' paths are relative to it, so that the files a
    seed makes are the same bytes in every session (a failure replays exactly)."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def bases(fuzz_root: Path) -> dict[str, dict]:
    """Name -> a valid config as a dict: the files of configs/ with their data, tokenizer and output
    pointed at tiny files in `fuzz_root`, and tiny-model configs for pre-training and (LoRA)
    instruction tuning."""
    corpus = write_corpus(fuzz_root / "corpus", n_files=2)
    train_bpe_tokenizer(corpus, 300, fuzz_root / "tok", show_progress=False)
    lines = (REPO / "corpora" / "chatterbot" / "chat_en.jsonl").read_text(encoding="utf-8").splitlines()
    (fuzz_root / "chat.jsonl").write_text("\n".join(lines[:40]) + "\n", encoding="utf-8")
    tiny = {
        "model": {"preset": "tiny_llama", "dropout": 0.0},
        "data": {"train_files": ["corpus/*.txt"], "tokenizer": "tok", "seq_length": 32, "cache_dir": "cache",
                 "eval_fraction": 0.1, "txt_documents": "paragraph", "min_chars": 1},
        "optimize": {"mixed_precision": "fp32", "recompute": "none"},
        "train": {"output_dir": "runs/tiny", "seed": 7, "max_steps": 2, "micro_batch_size": 2,
                  "lr": 1.0e-2, "min_lr": 1.0e-3, "warmup_steps": 1, "decay_style": "cosine", "weight_decay": 0.1,
                  "max_grad_norm": 1.0, "save_steps": 2, "keep_checkpoints": 1, "log_steps": 1, "eval_steps": 2,
                  "eval_batches": 1, "nan_policy": "stop", "progress_bar": False, "tensorboard": False},
        "run": {"device": "cpu", "num_threads": 1},
    }
    # The weights the fine-tuning configs start from: a one-step run of the tiny model.
    start = copy.deepcopy(tiny)
    start["train"].update(output_dir="start", max_steps=1, save_steps=1)
    (fuzz_root / "start.yaml").write_text(yaml.safe_dump(start), encoding="utf-8")
    with contextlib.chdir(fuzz_root), logging_restored():
        assert main(["train", "start.yaml"]) == 0

    found: dict[str, dict] = {"tiny": tiny}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        found[path.stem] = _pointed_at(yaml.safe_load(path.read_text(encoding="utf-8")), tiny)
    found["tiny_sft"] = _pointed_at(yaml.safe_load((REPO / "configs" / "sft_lora_demo.yaml").read_text()), tiny)
    found["tiny_sft"]["data"].update(seq_length=32)
    found["tiny_sft"]["train"].update(max_steps=2, micro_batch_size=2, save_steps=2, progress_bar=False,
                                      tensorboard=False)
    found["tiny_sft"]["run"] = {"device": "cpu", "num_threads": 1}
    for cfg in found.values():
        if cfg.get("model", {}).get("init_from"):
            cfg["model"]["init_from"] = "start"
            cfg["data"]["train_files"] = ["chat.jsonl"]
            cfg["data"]["seq_length"] = min(cfg["data"].get("seq_length", 32), 256)
    return found


def _pointed_at(cfg: dict, tiny: dict) -> dict:
    """A config of configs/ with the tiny config's data and cache, and its output under runs/."""
    cfg = copy.deepcopy(cfg)
    if isinstance(cfg.get("data"), dict):
        cfg["data"]["train_files"] = tiny["data"]["train_files"]
        cfg["data"]["cache_dir"] = tiny["data"]["cache_dir"]
    if isinstance(cfg.get("train"), dict):
        cfg["train"]["output_dir"] = "runs/base"
    if "save_ckpt" in cfg:
        cfg["save_ckpt"] = "runs/ckpt"
    return cfg


# --- mutations -----------------------------------------------------------------------------------------------


def _paths(node: Any, prefix: KeyPath = ()) -> list[KeyPath]:
    """Every key path of a nested dict (sections and leaves)."""
    out: list[KeyPath] = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(doc: dict, path: KeyPath) -> dict:
    node = doc
    for key in path[:-1]:
        node = node[key]
    return node


def _typo(rng: random.Random, name: str) -> str:
    """`name` with one letter dropped, doubled, swapped or replaced."""
    name = str(name)
    i = rng.randrange(max(1, len(name)))
    how = rng.choice(["drop", "double", "swap", "replace"])
    if how == "drop" and len(name) > 1:
        return name[:i] + name[i + 1:]
    if how == "double":
        return name[:i] + name[i:i + 1] * 2 + name[i + 1:]
    if how == "swap" and i + 1 < len(name):
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return name[:i] + rng.choice("aeiouxz_") + name[i + 1:]


_OTHER_VALUES = ["fast", True, False, 7, 0.5, None, "1e-3", "", [1, 2], {"a": 1}, "auto", "yes"]


def _value_mutation(kind: str) -> Callable[[random.Random, Any], Any]:
    """The new value of a leaf for a value mutation `kind`."""
    def other_type(rng: random.Random, v: Any) -> Any:
        return rng.choice([x for x in _OTHER_VALUES if type(x) is not type(v)])

    table: dict[str, Callable[[random.Random, Any], Any]] = {
        "other_type": other_type,
        "negative": lambda rng, v: -abs(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v else
        rng.choice([-1, -2.5]),
        "zero": lambda rng, v: rng.choice([0, 0.0]),
        "huge": lambda rng, v: rng.choice([10**12, 2**63, 1e300, -10**15, 10**30]),
        "non_finite": lambda rng, v: rng.choice([float("nan"), float("inf"), float("-inf"), "nan", "inf",
                                                 "-Infinity"]),
        "list_for_scalar": lambda rng, v: rng.choice([[v], [v, v], []]),
        "dict_for_scalar": lambda rng, v: rng.choice([{"value": v}, {}]),
    }
    return table[kind]


VALUE_KINDS = ["other_type", "negative", "zero", "huge", "non_finite", "list_for_scalar", "dict_for_scalar"]
KEY_KINDS = ["drop", "rename", "nest"]
FILE_KINDS = ["empty", "binary", "truncated", "duplicate_key"]


def _mutate_doc(rng: random.Random, doc: dict, kind: str, real: bool) -> str | None:
    """Apply one mutation of `kind` to `doc` in place; its description, or None when it does not apply."""
    paths = _paths(doc)
    if not paths:
        return None
    if kind in VALUE_KINDS:
        leaves = [p for p in paths if not isinstance(_parent(doc, p)[p[-1]], dict)]
        if real and kind == "huge":
            leaves = [p for p in leaves if p[-1] not in _SIZES]
        if not leaves:
            return None
        path = rng.choice(leaves)
        parent = _parent(doc, path)
        old = parent[path[-1]]
        parent[path[-1]] = _value_mutation(kind)(rng, old)
        return f"{kind} {'.'.join(map(str, path))}: {old!r} -> {parent[path[-1]]!r}"
    path = rng.choice(paths)
    parent = _parent(doc, path)
    key = path[-1]
    if kind == "drop":
        del parent[key]
        return f"drop {'.'.join(map(str, path))}"
    if kind == "rename":
        new = _typo(rng, key)
        parent[new] = parent.pop(key)
        return f"rename {'.'.join(map(str, path))} -> {new}"
    # nest: one level deeper, under its own name or under another section
    sections = [k for k, v in doc.items() if isinstance(v, dict) and k != key]
    value = parent.pop(key)
    if sections and rng.random() < 0.5:
        where = rng.choice(sections)
        doc[where][key] = value
        return f"nest {'.'.join(map(str, path))} into {where}"
    parent[key] = {key: value}
    return f"nest {'.'.join(map(str, path))} under itself"


def _mutate_text(rng: random.Random, text: str, kind: str) -> tuple[bytes, str]:
    """File-level mutations: the bytes of the mutated file and a description."""
    if kind == "empty":
        return rng.choice([b"", b"\n", b"# only a comment\n"]), "empty file"
    if kind == "binary":
        garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 400)))
        return rng.choice([garbage, text.encode()[:50] + garbage, b"\x00" * 16]), "binary garbage"
    if kind == "truncated":
        cut = rng.randrange(1, max(2, len(text)))
        return text[:cut].encode(), f"truncated at {cut} of {len(text)} characters"
    lines = text.splitlines(keepends=True)
    i = rng.randrange(len(lines))
    # The copy goes at the end (where it may land in another section) or right after the line itself.
    twice = [*lines, lines[i]] if rng.random() < 0.5 else [*lines[: i + 1], lines[i], *lines[i + 1:]]
    return "".join(twice).encode(), f"line {i + 1} given twice ({lines[i].strip()!r})"


def make_case(rng: random.Random, base: dict, real: bool) -> tuple[bytes, str]:
    """One mutated config file (bytes) from `base`, and what was done to it."""
    doc = copy.deepcopy(base)
    if rng.random() < 0.12:
        return _mutate_text(rng, yaml.safe_dump(doc, sort_keys=False), rng.choice(FILE_KINDS))
    done = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        what = _mutate_doc(rng, doc, rng.choice(VALUE_KINDS + KEY_KINDS), real)
        if what:
            done.append(what)
    return yaml.safe_dump(doc, sort_keys=False).encode(), "; ".join(done) or "unchanged"


# --- running ---------------------------------------------------------------------------------------------------


def run_case(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int | None, str, str]:
    """main(argv) in-process: (exit status or None when an exception escaped, stdout, stderr + the
    escaped exception)."""
    escaped = ""
    try:
        code: int | None = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code if isinstance(e.code, int) else 2
    except Exception as e:  # a traceback for the user: what this test is looking for
        code, escaped = None, f"{type(e).__module__}.{type(e).__name__}: {e}"
    out, err = capsys.readouterr()
    return code, out, err + escaped


def _verdict(code: int | None, err: str) -> str | None:
    """Why an outcome is not acceptable, or None."""
    if code is None:
        return "an exception escaped: " + err.strip().splitlines()[-1][:300]
    if "Traceback" in err:
        return "a traceback was printed"
    if code == 2 and "error:" not in err:
        return "exit 2 without an error message"
    if code not in (0, 2):
        return f"exit status {code}"
    return None


def _extra_args(rng: random.Random) -> list[str]:
    """Sometimes a --nproc or a --set of a random (maybe wrong) value as well."""
    r = rng.random()
    if r < 0.08:
        return ["--nproc", str(rng.choice([1, 2, 3, 8, 0, -1]))]
    if r < 0.16:
        key = rng.choice(["train.lr", "learning_rate", "train.max_steps", "parallel.tensor_parallel", "data.seq_length",
                          "run.device", "optimize.recompute", "train.nosuch", "batch_size", "mode"])
        return ["--set", f"{key}={rng.choice(['1', '-1', 'abc', '[1, 2]', '{a: 1}', '', 'null', '.inf'])}"]
    return []


def _fuzz_dry(capsys: pytest.CaptureFixture, tmp_path: Path, bases: dict[str, dict], count: int
              ) -> tuple[Counter, list[str]]:
    """`count` mutated configs of every base under --dry-run: (exit counts, failures)."""
    rng = random.Random(SEED)
    names = sorted(bases)
    counts: Counter = Counter()
    failures: list[str] = []
    for i in range(count):
        name = names[i % len(names)]
        content, what = make_case(rng, bases[name], real=False)
        path = tmp_path / f"case{i}.yaml"
        path.write_bytes(content)
        argv = ["train", str(path), "--dry-run", *_extra_args(rng)]
        code, _, err = run_case(capsys, argv)
        counts[f"exit {code}"] += 1
        why = _verdict(code, err)
        if why:
            failures.append(f"[{name}] {what} {argv[2:]}: {why}")
    return counts, failures


def _small(path: Path) -> bool:
    """Whether a valid config is small enough to run on a test machine in a second or two: a dropped
    model.preset leaves the default LLaMA-7B sizes (the run would take 25 GB and be killed for it),
    and a dropped max_steps leaves train.epochs."""
    cfg = load_config(path)
    return (count_parameters(cfg.model) < 10_000_000 and cfg.train.epochs is None and (cfg.train.max_steps or 0) <= 8
            and cfg.train.micro_batch_size * (cfg.data.seq_length or 0) <= 4096)


def _fuzz_real(capsys: pytest.CaptureFixture, tmp_path: Path, bases: dict[str, dict], names: list[str],
               count: int) -> tuple[Counter, list[str]]:
    """`count` mutated tiny configs run for real: (exit counts, failures). Most mutations already fail
    the config checks, which the dry runs cover; so the cases run here are drawn from those that pass
    --dry-run, whose mistakes (a data path, a tokenizer, a value only the run can judge) only a run meets."""
    rng = random.Random(SEED + 1)
    counts: Counter = Counter()
    failures: list[str] = []
    for i in range(count):
        name = names[i % len(names)]
        base = copy.deepcopy(bases[name])
        base["train"]["output_dir"] = f"runs/real{i}"  # a fresh run directory each time
        path = tmp_path / f"case{i}.yaml"
        for _ in range(200):  # about one mutation in seven passes the config checks
            content, what = make_case(rng, base, real=True)
            path.write_bytes(content)
            if run_case(capsys, ["train", str(path), "--dry-run"])[0] == 0 and _small(path):
                break
        else:
            continue  # no small valid case: nothing to run (the counts show it)
        code, _, err = run_case(capsys, ["train", str(path)])
        counts[f"exit {code}"] += 1
        why = _verdict(code, err)
        if why:
            failures.append(f"[{name}] {what}: {why}")
    return counts, failures


def _report(capsys: pytest.CaptureFixture, label: str, counts: Counter, failures: list[str]) -> None:
    with capsys.disabled():
        print(f"\n{label}: {sum(counts.values())} mutations, " + ", ".join(
            f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0]))) + f", {len(failures)} failures")


# --- the tests -------------------------------------------------------------------------------------------------


def test_mutations_are_reproducible(bases: dict[str, dict]) -> None:
    """The same seed makes the same cases (a failure found here can be replayed)."""
    first = [make_case(random.Random(SEED), bases["tiny"], False) for _ in range(5)]
    again = [make_case(random.Random(SEED), bases["tiny"], False) for _ in range(5)]
    assert first == again
    many = {make_case(random.Random(s), bases["tiny"], False)[0] for s in range(20)}
    assert len(many) > 10  # and different seeds make different cases


@pytest.mark.timeout(600)
def test_dry_runs_of_mutated_configs_exit_0_or_2(capsys, tmp_path, fuzz_root, bases, monkeypatch) -> None:
    """A few hundred mutations of every config under --dry-run: exit 0, or 2 with a message."""
    monkeypatch.chdir(fuzz_root)  # the configs' relative paths; a default runs/default lands here too
    for name, cfg in bases.items():  # every base is valid as it is
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
        code, _, err = run_case(capsys, ["train", str(tmp_path / f"{name}.yaml"), "--dry-run"])
        assert code == 0, (name, err)
    counts, failures = _fuzz_dry(capsys, tmp_path, bases, DRY_RUNS)
    _report(capsys, "dry runs", counts, failures)
    assert not failures, "\n".join(failures[:20])
    assert counts["exit 2"] > DRY_RUNS // 3  # most mutations are mistakes the checks must catch
    assert counts["exit 0"] > 0  # and some (a dropped optional key) are still valid configs


@pytest.mark.timeout(600)
def test_real_runs_of_mutated_configs_exit_0_or_2(capsys, tmp_path, fuzz_root, bases, monkeypatch) -> None:
    """Mutations of the tiny configs as real 1-2 step runs on CPU: exit 0, or 2 with a message."""
    monkeypatch.chdir(fuzz_root)
    counts, failures = _fuzz_real(capsys, tmp_path, bases, ["tiny", "tiny_sft"], REAL_RUNS)
    _report(capsys, "real runs", counts, failures)
    assert not failures, "\n".join(failures[:20])
    assert counts["exit 0"] > 0 and counts["exit 2"] > 0


def test_duplicate_key_names_both_lines(capsys, tmp_path) -> None:
    """A key given twice (YAML would keep the last silently, dropping a whole section): exit 2 naming
    the key and both lines."""
    cfg = tmp_path / "twice.yaml"
    cfg.write_text("model: {preset: tiny_llama}\ntrain:\n  max_steps: 3\n  lr: 0.1\ntrain:\n  lr: 0.2\n")
    code, _, err = run_case(capsys, ["train", str(cfg), "--dry-run"])
    assert code == 2 and "Traceback" not in err
    assert str(cfg) in err and "found key 'train' a second time (first on line 2)" in err and "line 5" in err


@pytest.mark.parametrize("content, needle", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not a UTF-8 text file: byte 0 is not UTF-8"),
    (b"\x00\x01\x02\x03", "is not valid YAML: unacceptable character #x0000"),
    (b"model: {preset: tiny_llama}\ntrain: {max_steps: \xff\xfe}\n", "byte 47 is not UTF-8"),
    (b"model: {preset: tiny_llama\ntrain:", "not valid YAML"),
    (b"- a\n- b\n", "must hold a mapping"),
])
def test_garbage_files_are_named(capsys, tmp_path, content: bytes, needle: str) -> None:
    """Binary, non-UTF-8, cut-short and non-mapping files: exit 2 naming the file and the problem."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(content)
    code, _, err = run_case(capsys, ["train", str(cfg), "--dry-run"])
    assert code == 2 and "Traceback" not in err
    assert str(cfg) in err and needle in err, err


def test_config_path_that_is_a_directory(capsys, tmp_path) -> None:
    """A directory where the config file goes: exit 2 saying so (not 'does not exist')."""
    code, _, err = run_case(capsys, ["train", str(tmp_path), "--dry-run"])
    assert code == 2 and "is a directory" in err and "Traceback" not in err


def test_json_config_counts_as_yaml(capsys, tmp_path) -> None:
    """JSON is YAML: a config written by json.dump loads (and so a JSON mistake is a YAML one)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"model": {"preset": "tiny_llama"}, "train": {"max_steps": 3}}))
    code, out, err = run_case(capsys, ["train", str(cfg), "--dry-run"])
    assert code == 0, err
    assert "3 steps" in out


def test_cases_cover_every_kind(bases: dict[str, dict]) -> None:
    """The generator makes every kind of mutation (so the counts above mean what they say)."""
    rng = random.Random(SEED)
    kinds = [f"{k} " for k in (*VALUE_KINDS, *KEY_KINDS)] + ["empty file", "binary garbage", "truncated", "twice"]
    seen: Counter = Counter()
    for _ in range(400):
        _, what = make_case(rng, bases["tiny"], False)
        seen.update(kind for kind in kinds if kind in what)
    assert [k for k in kinds if not seen[k]] == []
