"""Hostile model files: a Hugging Face directory's config.json and safetensors, and a shardwise checkpoint's
config.yaml, as `generate` and `convert` read them. Every case runs under a memory and a time cap
(tests/capped.py) and must end as exit 2 naming the file (and the field), never as a traceback, a hang
or an allocation of what the file claims before its weights are compared with it."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from shardwise.checkpoint.storage import find_checkpoint
from shardwise.data.packing import PackedDataset
from shardwise.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from shardwise.errors import CheckpointError
from shardwise.models import ModelConfig, build_model
from shardwise.models.generate import sample_next
from shardwise.models.hf import save_hf
from shardwise.resolve import resolve_config
from shardwise.train.trainer import Trainer
from tests.capped import assert_each_refused, cli_capped
from tests.data.conftest import write_corpus
from tests.test_cli import logging_restored
from tests.train.conftest import SEQ, make_tokens

CAP = {"memory_mib": 1024, "seconds": 30}
GENERATE = ("--prompt", "It is", "--max-new-tokens", "2")


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile_tok")
    train_bpe_tokenizer(write_corpus(root / "corpus", n_files=1), 300, root / "tok", show_progress=False)
    return root / "tok"


@pytest.fixture(scope="module")
def hf_dir(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA as a Hugging Face directory (config.json, model.safetensors, the tokenizer)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=48, max_position_embeddings=128))
    return save_hf(model, tmp_path_factory.mktemp("hostile_hf") / "llama", tokenizer=load_tokenizer(tok_dir))


def _with_config(hf_dir: Path, tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of the HF directory whose config.json has `changes` (None removes a key)."""
    out = tmp_path / name
    shutil.copytree(hf_dir, out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# --- config.json --------------------------------------------------------------------------------------------

BAD_FIELDS = [
    ("zero heads", {"num_attention_heads": 0}, "num_attention_heads"),
    ("negative size", {"hidden_size": -32}, "hidden_size"),
    ("a string size", {"hidden_size": "32"}, "hidden_size"),
    ("a list size", {"intermediate_size": [48]}, "intermediate_size"),
    ("a bool size", {"num_hidden_layers": True}, "num_hidden_layers"),
    ("a fractional size", {"intermediate_size": 48.5}, "intermediate_size"),
    ("a null required size", {"vocab_size": None}, "vocab_size"),
    ("an absurd vocabulary", {"vocab_size": 10**30}, "vocab_size"),
    ("absurd positions", {"max_position_embeddings": 10**12}, "max_position_embeddings"),
    ("absurd layers", {"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ("zero kv heads", {"num_key_value_heads": 0}, "num_key_value_heads"),
    ("a negative epsilon", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ("architectures as a string", {"architectures": "LlamaForCausalLM"}, "architectures"),
    ("architectures of numbers", {"architectures": [1, 2]}, "architectures"),
    ("an activation as a list", {"hidden_act": ["silu"]}, "hidden_act"),
    ("rope_scaling as a list", {"rope_scaling": [1, 2]}, "rope_scaling"),
    ("a rope factor as a string", {"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "factor"),
    ("a bias flag as a string", {"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ("a head_dim as a float", {"head_dim": 8.25}, "head_dim"),
]


def test_a_bad_config_field_is_named(hf_dir: Path, tmp_path: Path) -> None:
    cases = []
    for i, (_, changes, field) in enumerate(BAD_FIELDS):
        bad = _with_config(hf_dir, tmp_path, f"bad{i}", **changes)
        cases.append((["generate", bad, *GENERATE], (bad / "config.json", field)))
    assert_each_refused(cases)


SIZES = [
    ({"vocab_size": 4_000_000}, "embed_tokens"),  # 4M x 32 would be allocated before the weights were read
    ({"hidden_size": 1 << 20, "head_dim": 8}, "embed_tokens"),
    ({"intermediate_size": 1 << 20}, "mlp"),
    ({"num_hidden_layers": 1000}, "missing"),  # layers the files do not hold: no model of 1000 layers is built
    ({"num_hidden_layers": 1}, "model.layers.1"),
]


def test_sizes_are_checked_against_the_weights_before_allocating(hf_dir: Path, tmp_path: Path) -> None:
    """Sizes within the bounds but not those of the weights present: refused from the safetensors headers,
    before the model is allocated (a 1 GiB cap would not hold what config.json claims)."""
    cases = []
    for i, (changes, tensor) in enumerate(SIZES):
        bad = _with_config(hf_dir, tmp_path, f"sizes{i}", **changes)
        cases.append((["generate", bad, *GENERATE], (bad, tensor)))
    assert_each_refused(cases)


def test_config_json_that_is_no_plain_json_file(hf_dir: Path, tmp_path: Path) -> None:
    """NaN, a 41-digit integer, deep nesting, not UTF-8, a FIFO, a link to /dev/zero, a huge sparse file."""
    cases = {
        "nan": ('{"vocab_size": NaN, "architectures": ["LlamaForCausalLM"]}', "NaN"),
        "digits": ('{"vocab_size": 1' + "0" * 40 + "}", "41 digits"),
        "deep": ("[" * 10_000 + "]" * 10_000, "nests"),
        "binary": (b"\xff\xfe\x00{", "not UTF-8"),
    }
    refused = []
    for name, (text, says) in cases.items():
        bad = _with_config(hf_dir, tmp_path, name)
        (bad / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        refused.append((["generate", bad, *GENERATE], (bad / "config.json", says)))
    fifo = _with_config(hf_dir, tmp_path, "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    zero = _with_config(hf_dir, tmp_path, "zero")
    (zero / "config.json").unlink()
    (zero / "config.json").symlink_to("/dev/zero")
    refused += [(["generate", bad, *GENERATE], (bad / "config.json", "not a regular file")) for bad in (fifo, zero)]
    huge = _with_config(hf_dir, tmp_path, "huge")
    with open(huge / "config.json", "r+b") as f:
        f.truncate(100 << 20)  # sparse: 100 MiB of zeros on no disk
    refused.append((["generate", huge, *GENERATE], (huge / "config.json", "bytes")))
    assert_each_refused(refused)


def test_a_safetensors_header_claiming_more_than_the_file_holds(hf_dir: Path, tmp_path: Path) -> None:
    """A 1 KB file whose header claims a 100 GB tensor (the safetensors library checks the offsets against the
    file's length), and a header length beyond the file."""
    cases = []
    for name, data in (("claims", {"model.embed_tokens.weight": {"dtype": "F32", "shape": [25_000_000_000],
                                                                 "data_offsets": [0, 100_000_000_000]}}),
                       ("short", None)):
        bad = _with_config(hf_dir, tmp_path, name)
        if data is None:
            blob = struct.pack("<Q", 10**12) + b"{}"
        else:
            header = json.dumps(data).encode()
            blob = struct.pack("<Q", len(header)) + header + b"\0" * 1000
        (bad / "model.safetensors").write_bytes(blob)
        cases.append((["generate", bad, *GENERATE], (bad / "model.safetensors", "not a readable safetensors")))
    assert_each_refused(cases)


def test_non_finite_weights_are_named_before_sampling(hf_dir: Path, tmp_path: Path) -> None:
    """NaN (or infinite) weights: the directory and the weight are named (torch.multinomial would raise)."""
    cases = []
    for value in (math.nan, math.inf):
        bad = _with_config(hf_dir, tmp_path, f"weights_{value}")
        with safe_open(str(bad / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = value
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        cases += [(["generate", bad, *GENERATE, "--temperature", temperature],
                   (bad, "layers.1.feed_forward.w2.weight", "NaN or infinite")) for temperature in ("0", "0.8")]
    assert_each_refused(cases)


def test_non_finite_logits_and_temperatures_are_errors() -> None:
    with pytest.raises(CheckpointError, match="NaN or infinite logits"):
        sample_next(torch.tensor([[math.nan, 1.0]]), temperature=0.8)
    with pytest.raises(CheckpointError, match="NaN or infinite logits"):
        sample_next(torch.tensor([[math.inf, 1.0]]), temperature=0.0)
    # A temperature so small that logits / temperature overflow: its limit, greedy.
    assert sample_next(torch.tensor([[1.0, 3.0, 2.0]]), temperature=1e-45).tolist() == [1]


def test_the_good_directory_still_generates(hf_dir: Path) -> None:
    code, text = cli_capped(["generate", hf_dir, *GENERATE], **CAP)
    assert code == 0, text


# --- a shardwise checkpoint's config.yaml ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-step tiny LLaMA run's checkpoint (with its tokenizer)."""
    run = tmp_path_factory.mktemp("hostile_run") / "run"
    cfg = resolve_config({
        "model": {"preset": "tiny_llama"}, "data": {"seq_length": SEQ},
        "train": {"output_dir": str(run), "max_steps": 1, "micro_batch_size": 2, "log_steps": 1,
                  "progress_bar": False, "tensorboard": False}, "run": {"num_threads": 1}})
    threads = torch.get_num_threads()
    try:
        Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ), tokenizer=load_tokenizer(tok_dir)).train()
    finally:
        torch.set_num_threads(threads)
    return find_checkpoint(run)


def _edited(checkpoint: Path, tmp_path: Path, name: str, text: str | None = None, **model: object) -> Path:
    out = tmp_path / name / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, out)
    if text is None:
        raw = yaml.safe_load((checkpoint / "config.yaml").read_text())
        raw["model"].update(model)
        text = yaml.safe_dump(raw)
    (out / "config.yaml").write_text(text)
    return out


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(9)) + "model: *j\n"


CHECKPOINT_CASES = [
    ("a vocabulary the weights lack", {"vocab_size": 10**6}, ["tok_embeddings.weight"]),
    ("layers the weights lack", {"num_layers": 1000}, ["num_layers is 1,000, but the weights hold 2 layers"]),
    ("absurd layers", {"num_layers": 10**7}, ["model.num_layers", "less than or equal to 1024"]),
    ("absurd positions", {"max_position_embeddings": 10**11}, ["max_position_embeddings"]),
    ("a wider model", {"hidden_size": 1 << 16, "head_dim": 16}, ["shape"]),
    ("an alias bomb", None, ["alias"]),
]


def test_a_checkpoint_config_is_checked_against_its_weights(checkpoint: Path, tmp_path: Path) -> None:
    """generate and convert read the checkpoint's config.yaml bounded (no aliases) and compare its model
    with the tensors in .metadata.json before allocating: a 1 GiB cap holds."""
    cases = []
    for i, (_, model, names) in enumerate(CHECKPOINT_CASES):
        bad = _edited(checkpoint, tmp_path, f"bad{i}", ALIAS_BOMB if model is None else None, **(model or {}))
        # Past the checksums (which refuse any edit: an attacker rewrites checksums.json too), to the config.
        cases += [(["generate", bad, *GENERATE, "--no-verify"], (bad / "config.yaml", *names)),
                  (["convert", bad, "--to", "hf", tmp_path / "out", "--no-verify"], (bad / "config.yaml", *names))]
    assert_each_refused(cases)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_config_that_is_no_plain_file(checkpoint: Path, tmp_path: Path) -> None:
    cases = []
    for name, target in (("fifo", None), ("zero", "/dev/zero")):
        bad = _edited(checkpoint, tmp_path, name)
        (bad / "config.yaml").unlink()
        if target is None:
            os.mkfifo(bad / "config.yaml")
        else:
            (bad / "config.yaml").symlink_to(target)
        for verify in ([], ["--no-verify"]):  # the checksums refuse it first, and so does the config's reader
            names = ("config.yaml", "is a symbolic link" if target and not verify else "not a regular file", bad)
            cases += [(["generate", bad, *GENERATE, *verify], names),
                      (["convert", bad, "--to", "hf", tmp_path / "out", *verify], names)]
    assert_each_refused(cases)


def test_a_shard_index_that_misplaces_or_mangles_tensors(tok_dir: Path, tmp_path: Path) -> None:
    """The index of a sharded directory names a tensor in a file that does not hold it, a weight_map that is
    a list, an index that is no JSON object: refused naming the index (no KeyError from safetensors)."""
    model = build_model(ModelConfig(vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=48, max_position_embeddings=128))
    sharded = save_hf(model, tmp_path / "sharded", tokenizer=load_tokenizer(tok_dir), max_shard_size=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    cases = []
    for name, changed in (
            ("misplaced", {**index, "weight_map": {k: files[0] for k in index["weight_map"]}}),
            ("list", {**index, "weight_map": list(index["weight_map"])}),
            ("deep", "[" * 1000 + "]" * 1000)):
        bad = tmp_path / name
        shutil.copytree(sharded, bad)
        (bad / "model.safetensors.index.json").write_text(changed if isinstance(changed, str) else json.dumps(changed))
        cases.append((["generate", bad, *GENERATE], (bad / "model.safetensors.index.json",)))
    assert_each_refused(cases)


def _retype(path: Path, name: str, dtype: str, shape: list[int]) -> None:
    """Rewrite one tensor's dtype and shape in a safetensors header (same bytes, same header length)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[name].update(dtype=dtype, shape=shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])


def test_weights_of_no_float_dtype_are_refused_from_the_header(hf_dir: Path, tmp_path: Path) -> None:
    """F4 (torch cannot slice it: a RuntimeError while loading), integers, booleans: refused naming the tensor."""
    cases = []
    for dtype, shape in (("F4", [320, 256]), ("I32", [320, 32]), ("BOOL", [320, 128]), ("C64", [320, 16])):
        bad = _with_config(hf_dir, tmp_path, dtype)
        _retype(bad / "model.safetensors", "model.embed_tokens.weight", dtype, shape)
        cases.append((["generate", bad, *GENERATE], (bad / "model.safetensors", "model.embed_tokens.weight", dtype)))
    assert_each_refused(cases)
