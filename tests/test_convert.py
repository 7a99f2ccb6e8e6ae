"""`shardwise convert`: real checkpoints (one process, and a 2-rank tensor-parallel run) written as
Hugging Face directories that transformers loads with the same logits, the tokenizer and
generation_config beside them; LoRA runs merged or as peft adapters; and the refusals that keep the
user's files safe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.storage import find_checkpoint
from shardwise.checkpoint.weights import load_model
from shardwise.data.packing import PackedDataset
from shardwise.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer
from tests.data.conftest import write_corpus
from tests.parallel.harness import run_distributed
from tests.test_cli import assert_user_error, logging_restored, run_cli
from tests.train.conftest import SEQ, make_tokens

transformers = pytest.importorskip("transformers")

TEXT = "Elizabeth walked to the house with her sister Jane."


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


def _config(run_dir: Path, preset: str = "tiny_llama", **sections: dict):  # noqa: ANN202
    """A 2-step run of a tiny preset writing into run_dir."""
    raw = {"model": {"preset": preset}, "data": {"seq_length": SEQ},
           "train": {"output_dir": str(run_dir), "max_steps": 2, "micro_batch_size": 4, "lr": 3e-3,
                     "warmup_steps": 1, "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7},
           "run": {"num_threads": 1}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return validate(raw)


def _train(cfg, tokenizer_dir: Path) -> Path:  # noqa: ANN001
    """Train `cfg` with the tokenizer (saved into its checkpoints); return the run directory."""
    Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ), tokenizer=load_tokenizer(tokenizer_dir)).train()
    return Path(cfg.train.output_dir)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vocab-300 byte-level BPE tokenizer (the tiny presets have 512 embedding rows)."""
    root = tmp_path_factory.mktemp("convert_tok")
    train_bpe_tokenizer(write_corpus(root / "corpus", n_files=2), 300, root / "tok", show_progress=False)
    return root / "tok"


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A one-process tiny LLaMA run (checkpoint at step 2)."""
    threads = torch.get_num_threads()
    try:
        return _train(_config(tmp_path_factory.mktemp("convert_single") / "run"), tokenizer_dir)
    finally:
        torch.set_num_threads(threads)


# GPT-2's fused c_attn (q, k, v sharing one lora_A) and an MLP projection.
GPT2_LORA = {"r": 4, "alpha": 8, "target_modules": ["c_attn", "mlp.c_fc"]}


def _tp_rank(rank: int, world: int, root: Path, tokenizer_dir: Path) -> None:
    tp = {"tensor_parallel": 2}
    _train(_config(root / "full", "tiny_gpt2", parallel=tp), tokenizer_dir)
    _train(_config(root / "lora", "tiny_gpt2", parallel=tp, lora=GPT2_LORA, train={"lr": 3e-2}), tokenizer_dir)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Two tiny GPT-2 runs on 2 gloo ranks with tensor parallel 2 (DCP shards of DTensors): full/, and
    lora/ with LoRA adapters."""
    root = tmp_path_factory.mktemp("convert_tp")
    run_distributed(_tp_rank, 2, root, tokenizer_dir, timeout=300)
    return root


# --- checks ---------------------------------------------------------------------------------------------------


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def _hf_model(out: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    """A transformers model's logits for the test ids."""
    with torch.no_grad():
        out = model(input_ids=_ids())
    return out.logits


def _shardwise_logits(checkpoint: Path) -> torch.Tensor:
    model, _ = load_model(checkpoint)
    with torch.no_grad():
        return model(_ids())


def _assert_same_logits(hf_model: torch.nn.Module, expected: torch.Tensor) -> None:
    got = _logits(hf_model)
    assert expected.std() > 0.1
    assert (got - expected).abs().max().item() <= 1e-4


def _assert_tokenizer_and_generation_config(out: Path, tokenizer_dir: Path) -> None:
    ours = load_tokenizer(tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (ours.bos_id, ours.eos_id, ours.pad_id)
    transformers.GenerationConfig.from_pretrained(out)  # valid for transformers


# --- full models ----------------------------------------------------------------------------------------------


def test_single_process_checkpoint_to_hf(capsys, single_run, tokenizer_dir, tmp_path) -> None:
    """A run directory converts (newest checkpoint) to a directory transformers loads with equal logits."""
    out = tmp_path / "hf"
    code, printed, err = run_cli(capsys, "convert", single_run, "--to", "hf", out)
    assert code == 0, err
    checkpoint = find_checkpoint(single_run)
    hf_model = _hf_model(out)
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    _assert_same_logits(hf_model, _shardwise_logits(checkpoint))
    _assert_tokenizer_and_generation_config(out, tokenizer_dir)
    params = sum(p.numel() for p in hf_model.parameters())
    assert printed.count("\n") == 1
    assert f"{params:,} parameters" in printed and "fp32" in printed and str(out) in printed
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary left beside OUT

    # bf16: the same model, half the bytes, and transformers reads it as bf16.
    code, printed, err = run_cli(capsys, "convert", checkpoint, "--to", "hf", tmp_path / "bf16", "--dtype", "bf16")
    assert code == 0, err
    assert "bf16" in printed
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    with torch.no_grad():
        diff = (half(input_ids=_ids()).logits - hf_model(input_ids=_ids()).logits).abs().max().item()
    assert 0 < diff < 0.1
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tensor_parallel_checkpoint_to_hf(capsys, tp_runs, tokenizer_dir, tmp_path) -> None:
    """A 2-rank tensor-parallel GPT-2 checkpoint converts in one process to an exact GPT2LMHeadModel."""
    checkpoint = find_checkpoint(tp_runs / "full")
    assert len(list(checkpoint.glob("*.distcp"))) == 2  # each rank wrote its shards
    code, _, err = run_cli(capsys, "convert", checkpoint, "--to", "hf", tmp_path / "hf")
    assert code == 0, err
    hf_model = _hf_model(tmp_path / "hf")
    assert type(hf_model).__name__ == "GPT2LMHeadModel"
    _assert_same_logits(hf_model, _shardwise_logits(checkpoint))
    _assert_tokenizer_and_generation_config(tmp_path / "hf", tokenizer_dir)


# --- refusals ---------------------------------------------------------------------------------------------------


def test_existing_output_is_kept_unless_overwrite(capsys, single_run, tmp_path, monkeypatch) -> None:
    """A non-empty OUT is refused and left as it was; --overwrite replaces it whole; an empty OUT is used."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "convert", single_run, "--to", "hf", out)
    assert_user_error(code, err, "--overwrite", str(out))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    code, _, err = run_cli(capsys, "convert", single_run, "--to", "hf", out, "--overwrite")
    assert code == 0, err
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    # An empty OUT is filled in place: here the current directory, which must stay usable.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    code, _, err = run_cli(capsys, "convert", single_run, "--to", "hf", ".")
    assert code == 0, err
    assert Path.cwd().samefile(empty) and (empty / "model.safetensors").is_file()
    code, _, err = run_cli(capsys, "convert", single_run, "--to", "hf", ".", "--overwrite")
    assert_user_error(code, err, "current directory")


def test_output_inside_or_around_the_checkpoint_is_refused(capsys, single_run) -> None:
    """OUT may neither lie inside the checkpoint nor contain it (--overwrite would delete it)."""
    checkpoint = find_checkpoint(single_run)
    before = sorted(p.name for p in checkpoint.iterdir())
    code, _, err = run_cli(capsys, "convert", checkpoint, "--to", "hf", checkpoint / "hf")
    assert_user_error(code, err, "inside the checkpoint")
    code, _, err = run_cli(capsys, "convert", checkpoint, "--to", "hf", single_run, "--overwrite")
    assert_user_error(code, err, "would delete")
    assert sorted(p.name for p in checkpoint.iterdir()) == before


def test_lora_options_without_lora_are_refused(capsys, single_run, tmp_path) -> None:
    """--merge-lora and --to peft need a LoRA checkpoint; nothing is written."""
    code, _, err = run_cli(capsys, "convert", single_run, "--to", "hf", tmp_path / "a", "--merge-lora")
    assert_user_error(code, err, "--merge-lora", "no LoRA", "drop --merge-lora")
    code, _, err = run_cli(capsys, "convert", single_run, "--to", "peft", tmp_path / "b")
    assert_user_error(code, err, "--to peft", "no LoRA", "--to hf")
    assert list(tmp_path.iterdir()) == []


def test_unexportable_model_fails_before_writing(capsys, single_run, tmp_path) -> None:
    """A model no HF architecture expresses (here: LLaMA with LayerNorm) fails naming why; OUT stays absent."""
    import shutil

    import yaml

    odd = tmp_path / "odd" / "checkpoints" / "step_00000002"
    shutil.copytree(find_checkpoint(single_run), odd)
    raw = yaml.safe_load((odd / "config.yaml").read_text())
    raw["model"]["norm"] = "layernorm"
    (odd / "config.yaml").write_text(yaml.safe_dump(raw))
    # The edit changes config.yaml after its checksum was taken: past the checksums to the export's own check.
    code, _, err = run_cli(capsys, "convert", odd, "--to", "hf", tmp_path / "out", "--no-verify")
    assert_user_error(code, err, "cannot be exported", "RMSNorm")
    assert not (tmp_path / "out").exists()


def test_failed_conversion_leaves_output_as_it_was(single_run, tmp_path, monkeypatch) -> None:
    """A failure while writing (even with --overwrite) keeps the old OUT and leaves no temporary behind."""
    import shardwise.export as export
    from shardwise.export import convert_checkpoint

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def broken_save_hf(model, out_dir, **kwargs):  # noqa: ANN001, ANN003, ANN202
        (Path(out_dir) / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_hf", broken_save_hf)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(single_run, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_checkpoint_without_tokenizer(capsys, single_run, tokenizer_dir, tmp_path) -> None:
    """Without a saved tokenizer the model is written alone (and says so); --tokenizer adds one."""
    import shutil

    bare = tmp_path / "bare" / "checkpoints" / "step_00000002"
    shutil.copytree(find_checkpoint(single_run), bare, ignore=shutil.ignore_patterns("tokenizer"))
    code, printed, err = run_cli(capsys, "convert", bare, "--to", "hf", tmp_path / "a")
    assert code == 0, err
    assert "no tokenizer" in printed and "--tokenizer" in err
    assert (tmp_path / "a" / "config.json").is_file() and not (tmp_path / "a" / "tokenizer.json").exists()
    code, printed, err = run_cli(capsys, "convert", bare, "--to", "hf", tmp_path / "b", "--tokenizer", tokenizer_dir)
    assert code == 0, err
    _assert_tokenizer_and_generation_config(tmp_path / "b", tokenizer_dir)


def test_help(capsys) -> None:
    code, out, err = run_cli(capsys, "convert", "--help")
    assert code == 0, err
    for option in ("checkpoint", "OUT", "--to", "--merge-lora", "--dtype", "--overwrite", "--tokenizer"):
        assert option in out, option
    code, out, _ = run_cli(capsys, "--help")
    assert "convert" in out


def test_missing_checkpoint_is_a_user_error(capsys, tmp_path) -> None:
    code, _, err = run_cli(capsys, "convert", tmp_path / "nothing", "--to", "hf", tmp_path / "out")
    assert_user_error(code, err, "does not exist")


# --- LoRA ---------------------------------------------------------------------------------------------------------

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A one-process tiny LLaMA LoRA run; a high LR so that 2 steps move the adapters measurably."""
    threads = torch.get_num_threads()
    try:
        cfg = _config(tmp_path_factory.mktemp("convert_lora") / "run", lora=LORA, train={"lr": 3e-2})
        return _train(cfg, tokenizer_dir)
    finally:
        torch.set_num_threads(threads)


def test_lora_checkpoint_merged_or_beside_its_base(capsys, lora_run, tokenizer_dir, tmp_path) -> None:
    """--merge-lora: one full model equal to the LoRA model; without it: the base model plus OUT/adapter,
    which peft loads onto OUT's model with the same logits; --to peft: the adapter alone, the same files."""
    from peft import PeftModel
    from safetensors.torch import load_file

    checkpoint = find_checkpoint(lora_run)
    lora_logits = _shardwise_logits(checkpoint)

    code, printed, err = run_cli(capsys, "convert", lora_run, "--to", "hf", tmp_path / "merged", "--merge-lora")
    assert code == 0, err
    assert "merged" in printed
    merged = _hf_model(tmp_path / "merged")
    _assert_same_logits(merged, lora_logits)
    assert not (tmp_path / "merged" / "adapter").exists()
    _assert_tokenizer_and_generation_config(tmp_path / "merged", tokenizer_dir)

    out = tmp_path / "hf"
    code, printed, err = run_cli(capsys, "convert", lora_run, "--to", "hf", out)
    assert code == 0, err
    assert "adapter" in printed
    base = _hf_model(out)
    assert sum(p.numel() for p in base.parameters()) == sum(p.numel() for p in merged.parameters())
    # The base alone lacks the adapters' change, which the test's LR makes clearly visible.
    assert (_logits(base) - lora_logits).abs().max().item() > 1e-2
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out.resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    _assert_same_logits(PeftModel.from_pretrained(base, out / "adapter").eval(), lora_logits)

    code, printed, err = run_cli(capsys, "convert", checkpoint, "--to", "peft", tmp_path / "peft")
    assert code == 0, err
    assert "adapter" in printed and str(tmp_path / "peft") in printed
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    alone, beside = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "peft", out / "adapter"))
    assert sorted(alone) == sorted(beside) and all(torch.equal(alone[k], beside[k]) for k in alone)
    _assert_same_logits(PeftModel.from_pretrained(_hf_model(out), tmp_path / "peft").eval(), lora_logits)

    code, _, err = run_cli(capsys, "convert", lora_run, "--to", "peft", tmp_path / "x", "--merge-lora")
    assert_user_error(code, err, "--merge-lora", "--to hf")


def test_tensor_parallel_lora_checkpoint(capsys, tp_runs, tmp_path) -> None:
    """A 2-rank TP GPT-2 LoRA checkpoint: merged, and as a peft adapter (fused c_attn, fan_in_fan_out)
    on the converted base, both give the LoRA model's logits."""
    from peft import PeftModel

    checkpoint = find_checkpoint(tp_runs / "lora")
    lora_logits = _shardwise_logits(checkpoint)
    code, _, err = run_cli(capsys, "convert", checkpoint, "--to", "hf", tmp_path / "merged", "--merge-lora")
    assert code == 0, err
    _assert_same_logits(_hf_model(tmp_path / "merged"), lora_logits)
    code, _, err = run_cli(capsys, "convert", checkpoint, "--to", "hf", tmp_path / "hf")
    assert code == 0, err
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True
    base = _hf_model(tmp_path / "hf")
    assert (_logits(base) - lora_logits).abs().max().item() > 1e-2
    _assert_same_logits(PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").eval(), lora_logits)
