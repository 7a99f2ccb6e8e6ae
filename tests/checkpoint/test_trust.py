"""A checkpoint from someone else never runs code (issue 11): a real checkpoint tampered with as an
attacker would (an item marked `bytes` whose storage is a pickle payload, storage paths out of the
directory, byte ranges past the end of a file, shard files that are not what the metadata says, an
unknown dtype, malformed JSON state) is refused with one message naming the file and the problem,
without unpickling anything and before any weight is used: through every loading function, and through
every command that loads a checkpoint (train --resume, train with model.init_from, generate, convert).
Hugging Face directories and LoRA adapters are read from safetensors only."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import shardwise
from shardwise.checkpoint.format import METADATA_FILE, SafeCheckpointReader, TensorOnlyLoadPlanner
from shardwise.checkpoint.storage import CHECKSUMS_FILE, load_weights, read_saved_tensors, read_trainer_state
from shardwise.checkpoint.weights import load_model
from shardwise.cli import main
from shardwise.data import load_tokenizer, train_bpe_tokenizer
from shardwise.errors import CheckpointError
from shardwise.models.hf import save_hf
from tests.data.conftest import write_corpus
from tests.parallel.harness import run_distributed
from tests.test_cli import assert_user_error, logging_restored, run_cli

STEP_DIR = "step_00000002"
SHARD = "__0_0.distcp"
EMBEDDINGS = "model.tok_embeddings.weight"
NORM = "model.norm.weight"  # 64 floats: small enough that another dtype's file still covers its bytes
ADVICE = "do not load checkpoints from sources you do not trust"


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


class _Payload:
    """Unpickling this creates the marker file: what an attacker's pickle does, made harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


# --- one real checkpoint, written by the CLI ------------------------------------------------------------


def _config(data: dict, path: Path, output_dir: Path, model: dict | None = None) -> Path:
    """A tiny CPU run (tiny_llama unless `model` says otherwise): 2 steps, a checkpoint at step 2."""
    cfg = {
        "model": model or {"preset": "tiny_llama"},
        "data": {"train_files": [str(data["glob"])], "tokenizer": str(data["tokenizer"]), "seq_length": 32,
                 "cache_dir": str(data["root"] / "cache")},
        "train": {"output_dir": str(output_dir), "max_steps": 2, "micro_batch_size": 4, "lr": 1.0e-2,
                  "save_steps": 2, "log_steps": 1, "progress_bar": False, "tensorboard": False},
        "run": {"device": "cpu", "num_threads": 1},
    }
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("trust_data")
    files = write_corpus(root / "corpus", n_files=2)
    train_bpe_tokenizer(files, 300, root / "tok", show_progress=False)
    return {"root": root, "glob": root / "corpus" / "*.txt", "tokenizer": root / "tok"}


@pytest.fixture(scope="module")
def original(data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint a 2-step CLI run wrote (config.yaml and tokenizer/ inside)."""
    root = tmp_path_factory.mktemp("trust_run")
    threads = torch.get_num_threads()  # run.num_threads: 1 sets it process-wide
    try:
        with logging_restored():
            assert main(["train", str(_config(data, root / "cfg.yaml", root / "run"))]) == 0
    finally:
        torch.set_num_threads(threads)
    return root / "run" / "checkpoints" / STEP_DIR


# --- the attacks: each changes a copy of the checkpoint ------------------------------------------------


def _read(ckpt: Path) -> dict:
    return json.loads((ckpt / METADATA_FILE).read_text())


def _write(ckpt: Path, doc: dict) -> None:
    (ckpt / METADATA_FILE).write_text(json.dumps(doc))


def _entry(doc: dict, fqn: str) -> dict:
    return next(s for s in doc["storage"] if s["fqn"] == fqn)


def _saved_tensor(ckpt: Path, fqn: str) -> bytes:
    """The bytes the shard holds for `fqn` (one torch.save of its chunk)."""
    s = _entry(_read(ckpt), fqn)
    with open(ckpt / s["path"], "rb") as f:
        f.seek(s["byte_offset"])
        return f.read(s["length"])


def _point(ckpt: Path, fqn: str, path: str, data: bytes) -> None:
    """Make the storage entry of `fqn` name `path`, which holds `data` from its first byte."""
    doc = _read(ckpt)
    _entry(doc, fqn).update(path=path, byte_offset=0, length=len(data))
    _write(ckpt, doc)


def bytes_item(ckpt: Path, marker: Path) -> None:
    """The embeddings marked `bytes`, stored as a pickle that creates `marker` when unpickled (DCP's own
    load planner would `torch.load(weights_only=False)` it)."""
    payload = pickle.dumps(_Payload(marker))
    (ckpt / "__9_0.distcp").write_bytes(payload)
    doc = _read(ckpt)
    doc["state_dict"][EMBEDDINGS] = {"kind": "bytes"}
    doc["storage"] = [s for s in doc["storage"] if s["fqn"] != EMBEDDINGS] + [
        {"fqn": EMBEDDINGS, "offset": None, "index": None, "path": "__9_0.distcp", "byte_offset": 0,
         "length": len(payload), "transforms": None}]
    _write(ckpt, doc)


def parent_path(ckpt: Path, marker: Path) -> None:
    """The embeddings read from ../x, a real tensor outside the checkpoint."""
    data = _saved_tensor(ckpt, EMBEDDINGS)
    (ckpt.parent / "x").write_bytes(data)
    _point(ckpt, EMBEDDINGS, "../x", data)


def absolute_path(ckpt: Path, marker: Path) -> None:
    data = _saved_tensor(ckpt, EMBEDDINGS)
    elsewhere = ckpt.parents[2] / "elsewhere.distcp"
    elsewhere.write_bytes(data)
    _point(ckpt, EMBEDDINGS, str(elsewhere), data)


def sub_directory(ckpt: Path, marker: Path) -> None:
    data = _saved_tensor(ckpt, EMBEDDINGS)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "dir").write_bytes(data)
    _point(ckpt, EMBEDDINGS, "sub/dir", data)


def symlink_out(ckpt: Path, marker: Path) -> None:
    """The shard replaced by a link to a file outside the directory (a faithful copy, so only the link is wrong)."""
    outside = ckpt.parents[2] / "outside.distcp"
    shutil.move(ckpt / SHARD, outside)
    os.symlink(outside, ckpt / SHARD)


def past_end(ckpt: Path, marker: Path) -> None:
    """The last tensor of the shard said to run 1000 bytes past the end of the file."""
    doc = _read(ckpt)
    last = max(doc["storage"], key=lambda s: s["byte_offset"])
    last["length"] += 1000
    _write(ckpt, doc)


def truncated_file(ckpt: Path, marker: Path) -> None:
    shard = ckpt / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def short_range(ckpt: Path, marker: Path) -> None:
    """The metadata and file agree in size, but the embeddings' range stops 64 bytes short of its zip."""
    doc = _read(ckpt)
    _entry(doc, EMBEDDINGS)["length"] -= 64
    _write(ckpt, doc)


def garbage(ckpt: Path, marker: Path) -> None:
    shard = ckpt / SHARD
    shard.write_bytes(random.Random(0).randbytes(shard.stat().st_size))


def _replace_norm(ckpt: Path, value: object) -> None:
    buf = io.BytesIO()
    torch.save(value, buf)
    (ckpt / "__8_0.distcp").write_bytes(buf.getvalue())
    _point(ckpt, NORM, "__8_0.distcp", buf.getvalue())


def other_dtype(ckpt: Path, marker: Path) -> None:
    _replace_norm(ckpt, torch.ones(64, dtype=torch.float16))


def other_shape(ckpt: Path, marker: Path) -> None:
    _replace_norm(ckpt, torch.ones(2, 32))


def not_a_tensor(ckpt: Path, marker: Path) -> None:
    _replace_norm(ckpt, {"weight": torch.ones(64)})


def dtype_load(ckpt: Path, marker: Path) -> None:
    doc = _read(ckpt)
    doc["state_dict"][EMBEDDINGS]["dtype"] = "load"
    _write(ckpt, doc)


def chunk_outside(ckpt: Path, marker: Path) -> None:
    doc = _read(ckpt)
    doc["state_dict"][NORM]["chunks"][0]["sizes"] = [65]
    _write(ckpt, doc)


def metadata_not_json(ckpt: Path, marker: Path) -> None:
    (ckpt / METADATA_FILE).write_text('{"state_dict": ')


def stream_transform(ckpt: Path, marker: Path) -> None:
    doc = _read(ckpt)
    _entry(doc, NORM)["transforms"] = ["zstd"]
    _write(ckpt, doc)


# attack -> what the message must say (beside the checkpoint's path and the advice)
ATTACKS: dict[Callable, tuple[str, ...]] = {
    bytes_item: (METADATA_FILE, EMBEDDINGS, "'bytes'", "tensors only"),
    parent_path: (METADATA_FILE, "'../x'", "not a plain file name"),
    absolute_path: (METADATA_FILE, "elsewhere.distcp", "not a plain file name"),
    sub_directory: (METADATA_FILE, "'sub/dir'", "not a plain file name"),
    symlink_out: (SHARD, "outside.distcp", "outside the checkpoint directory"),
    past_end: (METADATA_FILE, f"of {SHARD}, but {SHARD} has"),
    truncated_file: (METADATA_FILE, f"of {SHARD}, but {SHARD} has"),
    short_range: (SHARD, EMBEDDINGS, "holds no readable tensor"),
    garbage: (SHARD, "holds no", "nothing was unpickled"),
    other_dtype: ("__8_0.distcp", NORM, "holds a float16 tensor of shape [64]", "as float32 of shape [64]"),
    other_shape: ("__8_0.distcp", NORM, "shape [2, 32]", "of shape [64]"),
    not_a_tensor: ("__8_0.distcp", NORM, "holds a dict", "not a plain tensor"),
    dtype_load: (METADATA_FILE, EMBEDDINGS, "dtype 'load'"),
    chunk_outside: (METADATA_FILE, NORM, "outside the tensor's size [64]"),
    metadata_not_json: (METADATA_FILE, "not valid JSON"),
    stream_transform: (METADATA_FILE, NORM, "'zstd'"),
}
# The attacks that fail on the metadata alone, before DCP plans a read.
METADATA_ATTACKS = {bytes_item, parent_path, absolute_path, sub_directory, symlink_out, past_end,
                    truncated_file, dtype_load, chunk_outside, metadata_not_json, stream_transform}


def _tampered(original: Path, tmp_path: Path, attack: Callable) -> tuple[Path, Path]:
    """A copy of the checkpoint (in a run directory of its own) with the attack applied, and the marker
    file a payload would create."""
    ckpt = tmp_path / "victim" / "checkpoints" / STEP_DIR
    shutil.copytree(original, ckpt)
    marker = tmp_path / "PWNED"
    attack(ckpt, marker)
    # Checksums catch a damaged file, but an attacker rewrites or drops checksums.json along with the rest:
    # every check here must hold without it (a checkpoint without one loads, with a warning).
    (ckpt / CHECKSUMS_FILE).unlink()
    return ckpt, marker


def _assert_refused(message: str, ckpt: Path, needles: tuple[str, ...]) -> None:
    assert f"checkpoint {ckpt} cannot be loaded" in message, message
    assert ADVICE in message and "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)


def _fresh_model_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint's model shapes, filled with 7 (so that any loaded value shows)."""
    shapes = read_trainer_state(ckpt)["shapes"]["model"]
    return {name: torch.full(shape, 7.0) for name, shape in shapes.items()}


# --- through the loading functions --------------------------------------------------------------------


def test_the_untampered_copy_loads(original, tmp_path) -> None:
    """The control: a copy loads, so each refusal below comes from its attack alone."""
    ckpt, _ = _tampered(original, tmp_path, lambda ckpt, marker: None)
    tensors = _fresh_model_tensors(ckpt)
    load_weights(ckpt, {"model": tensors})
    model, _ = load_model(ckpt)
    assert torch.equal(tensors["norm.weight"], model.norm.weight)
    assert not torch.equal(tensors["norm.weight"], torch.full((64,), 7.0))
    assert torch.equal(read_saved_tensors(ckpt, "model", ["norm.weight"])["norm.weight"], model.norm.weight)


@pytest.mark.parametrize("attack", list(ATTACKS), ids=lambda a: a.__name__)
def test_load_weights_refuses_the_attack(original, tmp_path, attack) -> None:
    """load_weights (model.init_from, and through _dcp_load every load) refuses each attack with its message;
    nothing is unpickled, and an attack on the metadata changes no tensor."""
    ckpt, marker = _tampered(original, tmp_path, attack)
    tensors = _fresh_model_tensors(ckpt)
    with pytest.raises(CheckpointError) as info:
        load_weights(ckpt, {"model": tensors})
    _assert_refused(str(info.value), ckpt, ATTACKS[attack])
    assert not marker.exists()
    if attack in METADATA_ATTACKS:
        assert all(bool((t == 7.0).all()) for t in tensors.values())


@pytest.mark.parametrize("attack", [bytes_item, parent_path, past_end, garbage], ids=lambda a: a.__name__)
def test_every_reader_refuses(original, tmp_path, attack) -> None:
    """load_model (generate, convert, from_pretrained) and read_saved_tensors refuse too."""
    ckpt, marker = _tampered(original, tmp_path, attack)
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt)
    _assert_refused(str(info.value), ckpt, ATTACKS[attack])
    with pytest.raises(CheckpointError) as info:
        read_saved_tensors(ckpt, "model", ["tok_embeddings.weight", "norm.weight"])
    _assert_refused(str(info.value), ckpt, ATTACKS[attack])
    assert not marker.exists()


def _load_on_each_rank(rank: int, world: int, checkpoints: list[Path]) -> list[tuple[str, str]]:
    """Each rank loads each checkpoint into plain tensors in a gloo group: (error type, message) each."""
    outcomes = []
    for ckpt in checkpoints:
        try:
            load_weights(ckpt, {"model": _fresh_model_tensors(ckpt)})
            outcomes.append(("loaded", ""))
        except Exception as e:  # noqa: BLE001 - the type is the assertion
            outcomes.append((type(e).__name__, str(e)))
    return outcomes


@pytest.mark.timeout(300)
def test_every_rank_of_a_job_refuses_with_the_same_message(original, tmp_path) -> None:
    """In a 2-rank job a metadata attack (refused before DCP plans) and shard attacks (refused inside
    DCP's read, which wraps every rank's failure) fail on both ranks with the one message, no hang."""
    attacks = [bytes_item, garbage, other_dtype]
    tampered = [_tampered(original, tmp_path / attack.__name__, attack) for attack in attacks]
    results = run_distributed(_load_on_each_rank, 2, [ckpt for ckpt, _ in tampered], timeout=200)
    for attack, (ckpt, marker), *per_rank in zip(attacks, tampered, *results):
        assert per_rank[0] == per_rank[1], attack.__name__
        kind, message = per_rank[0]
        assert kind == "CheckpointError", (attack.__name__, message)
        _assert_refused(message, ckpt, ATTACKS[attack])
        assert not marker.exists()


def test_the_payload_is_real(tmp_path) -> None:
    """What DCP's own load planner does with a `bytes` item: the payload runs. So the marker's absence above
    means shardwise refused it, not that the payload was harmless."""
    marker = tmp_path / "PWNED"
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("x"), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex("x"), storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
    with pytest.raises(Exception):  # noqa: B017 - the pickle is no torch file; it has run by then
        planner.load_bytes(item, io.BytesIO(pickle.dumps(_Payload(marker))))
    assert marker.exists()


def test_planner_and_reader_never_unpickle_whatever_the_plan(original, tmp_path) -> None:
    """Below the metadata checks: the planner's load_bytes refuses, and the reader refuses a plan that
    holds a bytes item even beside DCP's own planner (which would unpickle it)."""
    marker = tmp_path / "PWNED"
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(EMBEDDINGS), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex(EMBEDDINGS), storage_offsets=torch.Size([0]),
                    lengths=torch.Size([0]))
    with pytest.raises(CheckpointError, match="never unpickled"):
        TensorOnlyLoadPlanner(original).load_bytes(item, io.BytesIO(pickle.dumps(_Payload(marker))))
    with pytest.raises(CheckpointError, match="never unpickled"):
        SafeCheckpointReader(original).read_data(LoadPlan([item]), DefaultLoadPlanner())
    assert not marker.exists()


@pytest.mark.parametrize("content, needles", [
    ("{step: 2", ("not valid JSON",)),
    ("[2]", ("holds a list, not a JSON object",)),
    ('{"step": "2", "shapes": {}}', ("the step '2'",)),
    ('{"step": 2, "shapes": {"model": {"norm.weight": "big"}}}', ("model.norm.weight the shape 'big'",)),
    ('{"step": 2, "shapes": [], "loader": {}}', ("the shapes []",)),
    ('{"step": 2, "shapes": {}, "loader": [1]}', ("data loader state [1]",)),
])
def test_malformed_trainer_state_names_the_file(original, tmp_path, content, needles) -> None:
    ckpt, _ = _tampered(original, tmp_path, lambda ckpt, marker: None)
    (ckpt / "trainer_state.json").write_text(content)
    with pytest.raises(CheckpointError) as info:
        read_trainer_state(ckpt)
    _assert_refused(str(info.value), ckpt, ("trainer_state.json", *needles))


# --- through the commands -------------------------------------------------------------------------------


def _resume(capsys, data: dict, ckpt: Path, tmp_path: Path) -> tuple[int, str, str]:
    cfg = _config(data, tmp_path / "resume.yaml", tmp_path / "resumed")
    return run_cli(capsys, "train", cfg, "--resume", ckpt)


def _init_from(capsys, data: dict, ckpt: Path, tmp_path: Path) -> tuple[int, str, str]:
    cfg = _config(data, tmp_path / "init.yaml", tmp_path / "resumed", model={"init_from": str(ckpt)})
    return run_cli(capsys, "train", cfg)


def _generate(capsys, data: dict, ckpt: Path, tmp_path: Path) -> tuple[int, str, str]:
    return run_cli(capsys, "generate", ckpt, "--prompt", "Elizabeth", "--max-new-tokens", "2")


def _convert(capsys, data: dict, ckpt: Path, tmp_path: Path) -> tuple[int, str, str]:
    return run_cli(capsys, "convert", ckpt, "--to", "hf", tmp_path / "hf")


COMMANDS = {"train --resume": _resume, "train init_from": _init_from, "generate": _generate, "convert": _convert}


def _cli(capsys, command: str, data: dict, ckpt: Path, tmp_path: Path) -> tuple[int, str, str]:
    threads = torch.get_num_threads()
    try:
        return COMMANDS[command](capsys, data, ckpt, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _assert_cli_refused(code: int, out: str, err: str, ckpt: Path, needles: tuple[str, ...], tmp_path: Path) -> None:
    """Exit 2, the message on one line, nothing generated and nothing written."""
    assert_user_error(code, err, *needles)
    message = next(line for line in err.splitlines() if line.startswith("shardwise: error: "))
    _assert_refused(message, ckpt, needles)
    assert out == ""
    assert not (tmp_path / "hf").exists()
    assert not (tmp_path / "resumed" / "checkpoints").exists()


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("attack", [bytes_item, parent_path, past_end], ids=lambda a: a.__name__)
def test_commands_refuse_the_issue_attacks(capsys, data, original, tmp_path, command, attack) -> None:
    ckpt, marker = _tampered(original, tmp_path, attack)
    code, out, err = _cli(capsys, command, data, ckpt, tmp_path)
    _assert_cli_refused(code, out, err, ckpt, ATTACKS[attack], tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("command, attack", [("train --resume", garbage), ("generate", other_dtype),
                                             ("convert", symlink_out), ("train init_from", dtype_load)])
def test_commands_refuse_broken_shards(capsys, data, original, tmp_path, command, attack) -> None:
    ckpt, _ = _tampered(original, tmp_path, attack)
    code, out, err = _cli(capsys, command, data, ckpt, tmp_path)
    _assert_cli_refused(code, out, err, ckpt, ATTACKS[attack], tmp_path)


@pytest.mark.parametrize("command, file", [("train --resume", "trainer_state.json"), ("generate", "trainer_state.json"),
                                           ("train --resume", "rng_rank0.json")])
def test_commands_refuse_malformed_json_state(capsys, data, original, tmp_path, command, file) -> None:
    ckpt, _ = _tampered(original, tmp_path, lambda ckpt, marker: (ckpt / file).write_text("not json"))
    code, out, err = _cli(capsys, command, data, ckpt, tmp_path)
    _assert_cli_refused(code, out, err, ckpt, (file, "not valid JSON"), tmp_path)


def _edit_json(ckpt: Path, name: str, change: Callable[[dict], None]) -> None:
    doc = json.loads((ckpt / name).read_text())
    change(doc)
    (ckpt / name).write_text(json.dumps(doc))


@pytest.mark.parametrize("file, change, needles", [
    ("trainer_state.json", lambda d: d.pop("loader"), ("no usable data position",)),
    ("trainer_state.json", lambda d: d.update(loader={"version": "x"}), ("data loader state", "damaged")),
    ("rng_rank0.json", lambda d: d.update(cpu="%%%"), ("random state is malformed",)),
    ("rng_rank0.json", lambda d: d.update(python=[1]), ("random state is malformed",)),
], ids=["no loader", "bad loader", "bad cpu state", "bad python state"])
def test_resume_refuses_state_that_does_not_fit(capsys, data, original, tmp_path, file, change, needles) -> None:
    ckpt, _ = _tampered(original, tmp_path, lambda ckpt, marker: _edit_json(ckpt, file, change))
    code, out, err = _cli(capsys, "train --resume", data, ckpt, tmp_path)
    assert_user_error(code, err, *needles)
    assert out == "" and not (tmp_path / "resumed" / "checkpoints").exists()


# --- Hugging Face directories and adapters: safetensors only -------------------------------------------------


@pytest.fixture
def pickled_hf(original, tmp_path) -> tuple[Path, Path]:
    """A Hugging Face directory (config.json, tokenizer) whose only weights are a pytorch_model.bin that
    creates a marker when unpickled; and the marker."""
    model, _ = load_model(original)
    hf = save_hf(model, tmp_path / "hf_bin", tokenizer=load_tokenizer(original / "tokenizer"))
    (hf / "model.safetensors").unlink()
    marker = tmp_path / "PWNED"
    (hf / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    return hf, marker


CONVERT_HINT = ("pytorch_model.bin", "safetensors only", "AutoModelForCausalLM.from_pretrained(",
                "save_pretrained('OUT', safe_serialization=True)")


def test_pickled_hf_weights_are_refused_with_how_to_convert(capsys, data, pickled_hf, tmp_path) -> None:
    """init_from, generate and from_pretrained refuse a pytorch_model.bin, saying how to convert it."""
    hf, marker = pickled_hf
    cfg = _config(data, tmp_path / "init.yaml", tmp_path / "ft", model={"init_from": str(hf)})
    code, _, err = run_cli(capsys, "train", cfg)
    assert_user_error(code, err, *CONVERT_HINT)
    assert not (tmp_path / "ft" / "checkpoints").exists()
    code, out, err = run_cli(capsys, "generate", hf, "--prompt", "Elizabeth", "--max-new-tokens", "2")
    assert_user_error(code, err, *CONVERT_HINT)
    assert out == ""
    with pytest.raises(CheckpointError) as info:
        shardwise.AutoModelForCausalLM.from_pretrained(str(hf))
    for needle in CONVERT_HINT:
        assert needle in str(info.value)
    assert not marker.exists()


def test_pickled_adapter_is_refused_with_how_to_convert(capsys, original, tmp_path) -> None:
    """generate --adapter refuses a peft adapter_model.bin, saying how to convert it."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    marker = tmp_path / "PWNED"
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    code, out, err = run_cli(capsys, "generate", original, "--adapter", adapter, "--prompt", "Elizabeth",
                             "--max-new-tokens", "2")
    assert_user_error(code, err, "adapter_model.bin", "safetensors only", "PeftModel.from_pretrained(",
                      "save_pretrained('OUT', safe_serialization=True)")
    assert out == ""
    assert not marker.exists()
