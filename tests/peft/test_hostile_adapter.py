"""Hostile LoRA adapters (adapter_config.json + adapter_model.safetensors) and target_modules patterns: each
case runs under a memory and a time cap (tests/capped.py) and ends as a CheckpointError / ConfigError naming
the file and the field or tensor, never a traceback, a hang, or half an adapter silently dropped."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardwise.errors import ShardwiseError
from shardwise.models import ModelConfig, build_model
from shardwise.models.hf import load_hf_config
from shardwise.peft import apply_lora, load_adapter, lora_state_dict, save_adapter
from shardwise.peft.lora import ARCH_METADATA_KEY
from tests.capped import assert_refused, run_capped
from tests.models.test_hostile_hf import GENERATE, _restore_logging, hf_dir, tok_dir  # noqa: F401 - fixtures

CAP = {"memory_mib": 1024, "seconds": 30}
PREFIX = "base_model.model.model.layers"


def _tiny_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=48, max_position_embeddings=32)


def _save(cfg: ModelConfig, out: Path) -> Path:
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=["q_proj", "down_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    return save_adapter(lora_state_dict(model), cfg, 2, 4, 0.0, ["q_proj", "down_proj"], out)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good adapter of `_tiny_cfg` on q_proj and down_proj of both layers (4 modules)."""
    return _save(_tiny_cfg(), tmp_path_factory.mktemp("hostile_adapter") / "adapter")


def _load(directory: str) -> str:
    """Load the adapter onto a tiny base (in a capped worker): 'ok N' (modules wrapped), or the error."""
    model = build_model(_tiny_cfg())
    try:
        names = load_adapter(model, directory)
    except ShardwiseError as e:
        return f"{type(e).__name__}: {e}"
    return f"ok {len(names)}"


def _load_each(directories: list[str]) -> list[str]:
    return [_load(d) for d in directories]


def _refused(directory: Path, *names: str) -> str:
    said = run_capped(_load, str(directory), **CAP)
    assert said.startswith("CheckpointError: "), said
    for name in names:
        assert name in said, (name, said)
    return said


def _each_refused(cases: list[tuple[Path, tuple[str, ...]]]) -> None:
    """Each (adapter directory, names): a CheckpointError naming each; all in one capped worker."""
    results = run_capped(_load_each, [str(d) for d, _ in cases], **CAP)
    for (directory, names), said in zip(cases, results):
        assert said.startswith("CheckpointError: "), (directory, said)
        for name in names:
            assert name in said, (name, said)


def _copy(adapter: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(adapter, out)
    return out


def _with_config(adapter: Path, tmp_path: Path, name: str, **changes: object) -> Path:
    out = _copy(adapter, tmp_path, name)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _tensors(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _with_tensors(adapter: Path, tmp_path: Path, name: str, tensors: dict, metadata: dict) -> Path:
    out = _copy(adapter, tmp_path, name)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata=metadata)
    return out


def test_the_good_adapter_loads_whole(adapter: Path) -> None:
    assert run_capped(_load, str(adapter), **CAP) == "ok 4"


BAD_SETTINGS = [
    ("lora_dropout", 1.5), ("lora_dropout", -0.1), ("lora_dropout", "0.1"), ("lora_dropout", 1.0),
    ("r", 0), ("r", -4), ("r", 2.5), ("r", "2"), ("r", True), ("r", None), ("r", 10**30), ("r", [2]),
    ("lora_alpha", -1), ("lora_alpha", 0), ("lora_alpha", "16"), ("lora_alpha", 1e300),
    ("target_modules", {"q_proj": 1}), ("target_modules", [1, 2]), ("use_rslora", "yes"),
    ("base_model_name_or_path", 5), ("peft_type", ["LORA"]), ("bias", {"none": 1}),
]


def test_a_bad_setting_is_named(adapter: Path, tmp_path: Path) -> None:
    cases = []
    for i, (field, value) in enumerate(BAD_SETTINGS):
        bad = _with_config(adapter, tmp_path, f"bad{i}", **{field: value})
        cases.append((bad, (str(bad / "adapter_config.json"), field)))
    _each_refused(cases)


def test_an_adapter_config_that_is_no_plain_json_file(adapter: Path, tmp_path: Path) -> None:
    cases = {"nan_alpha": (b'{"r": 2, "lora_alpha": NaN}', "NaN"), "inf_dropout": (b'{"r": 2, "lora_dropout": '
                                                                                    b'Infinity}', "Infinity"),
             "digits": (b'{"r": 1' + b"0" * 60 + b"}", "61 digits"), "deep": (b"[" * 5000 + b"]" * 5000, "nests"),
             "binary": (b"\x80\x81{}", "not UTF-8"), "list": (b"[1, 2]", "not a JSON object")}
    refused = []
    for name, (data, says) in cases.items():
        bad = _copy(adapter, tmp_path, name)
        (bad / "adapter_config.json").write_bytes(data)
        refused.append((bad, (str(bad / "adapter_config.json"), says)))
    for name, target in (("fifo", None), ("zero", "/dev/zero"), ("random", "/dev/urandom")):
        bad = _copy(adapter, tmp_path, name)
        (bad / "adapter_config.json").unlink()
        if target is None:
            os.mkfifo(bad / "adapter_config.json")
        else:
            (bad / "adapter_config.json").symlink_to(target)
        refused.append((bad, (str(bad / "adapter_config.json"), "not a regular file")))
    _each_refused(refused)


def test_a_layer_index_in_other_than_plain_ascii_digits_is_refused_not_dropped(adapter: Path,
                                                                                tmp_path: Path) -> None:
    """Python's \\d and int() take '١', '¹' and '１' for 1: the tensors of layer 1 would be read as a layer
    '١' the model lacks and silently dropped (half the adapter). They are refused, naming the tensor; so are
    a leading zero and a trailing space."""
    tensors, metadata = _tensors(adapter)
    cases = []
    for i, digit in enumerate(["\u0661", "\u00b9", "\uff11", "\u0967", "01", "1 "]):
        renamed = {k.replace(f"{PREFIX}.1.", f"{PREFIX}.{digit}."): v for k, v in tensors.items()}
        bad = _with_tensors(adapter, tmp_path, f"digits{i}", renamed, metadata)
        cases.append((bad, (f"layers.{digit}.", str(bad / "adapter_model.safetensors"))))
    _each_refused(cases)


def test_bad_adapter_tensors(adapter: Path, tmp_path: Path) -> None:
    tensors, metadata = _tensors(adapter)
    q_a = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "unknown": ({**tensors, f"{PREFIX}.0.self_attn.q_proj.weight": torch.zeros(32, 32)}, "q_proj.weight"),
        "twice": ({**tensors, q_a.replace(".weight", ".default.weight"): tensors[q_a].clone()}, "twice"),
        "rank": ({**tensors, q_a: torch.zeros(3, 32)}, "has shape (3, 32)"),
        "transposed": ({**tensors, q_a: tensors[q_a].t().contiguous()}, "has shape (32, 2)"),
        "three_dims": ({**tensors, q_a: torch.zeros(2, 32, 1)}, "has shape (2, 32, 1)"),
        "integers": ({k: (v * 100).to(torch.int32) for k, v in tensors.items()}, "not as floating-point"),
        "no_pair": ({k: v for k, v in tensors.items() if k != q_a}, "no lora_A"),
        "layer_beyond": ({k.replace(f"{PREFIX}.1.", f"{PREFIX}.7."): v for k, v in tensors.items()}, "layer 7"),
    }
    _each_refused([(_with_tensors(adapter, tmp_path, name, changed, metadata), (says,))
                   for name, (changed, says) in cases.items()])


def test_a_bad_architecture_entry_is_named(adapter: Path, tmp_path: Path) -> None:
    tensors, metadata = _tensors(adapter)
    cases = []
    for name, entry, says in (("deep", "[" * 5000 + "]" * 5000, "nests"), ("digits", '{"vocab_size": 1' + "0" * 50
                                                                           + "}", "51 digits"),
                              ("nan", '{"vocab_size": NaN}', "NaN"), ("list", "[1, 2]", "not a JSON object"),
                              ("other", json.dumps({"vocab_size": 65}), "another architecture")):
        bad = _with_tensors(adapter, tmp_path, name, tensors, {**metadata, ARCH_METADATA_KEY: entry})
        cases.append((bad, (says,)))
    _each_refused(cases)


def test_a_safetensors_header_claiming_more_than_the_file(adapter: Path, tmp_path: Path) -> None:
    bad = _copy(adapter, tmp_path, "claims")
    header = json.dumps({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [2, 12_500_000_000], "data_offsets": [0, 100_000_000_000]}}).encode()
    (bad / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 512)
    _refused(bad, str(bad / "adapter_model.safetensors"), "not a readable safetensors")


def _target(pattern: str) -> str:
    model = build_model(_tiny_cfg())
    try:
        apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=pattern)
    except ShardwiseError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_a_target_modules_regex_that_backtracks_fails_in_time() -> None:
    """`re` takes minutes on this against 'model.layers.0.self_attn.q_proj'; the bounded match gives up."""
    said = run_capped(_target, ["q_proj", r"([a-z._0-9]|[a-z._0-9])*[A-Z]"], **CAP)
    assert said.startswith("ConfigError: lora.target_modules") and "took more than" in said, said


def _target_each(targets: list) -> list[str]:
    return [_target(t) for t in targets]


def test_target_modules_of_a_wrong_kind() -> None:
    for said in run_capped(_target_each, [{"q_proj": 1}, [], [3], ["x" * 5000], "(" * 2000, None], **CAP):
        assert said.startswith("ConfigError: lora.target_modules"), said


def test_generate_refuses_an_adapter_with_non_ascii_layer_digits(hf_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """End to end: `generate BASE --adapter A` exits 2 naming the tensor (none of the adapter is dropped)."""
    good = _save(load_hf_config(hf_dir), tmp_path / "good")
    tensors, metadata = _tensors(good)
    renamed = {k.replace(f"{PREFIX}.1.", f"{PREFIX}.\u0661."): v for k, v in tensors.items()}
    bad = _with_tensors(good, tmp_path, "bad", renamed, metadata)
    assert_refused(["generate", hf_dir, "--adapter", bad, *GENERATE], str(bad / "adapter_model.safetensors"),
                   "layers.\u0661.", **CAP)
