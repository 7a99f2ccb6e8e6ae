"""The Python API of the seed documents runs as written there once the import line reads `shardwise`.

Seed 000, sections 5.2-5.5 (train_config.yaml, AutoTokenizer, TextDataset + create_dataset,
AutoModelForCausalLM.from_pretrained, TrainingArguments, Trainer) and seed 002, section 3.3
(AutoModelForCausalLM.from_config, LLMArguments, LLMTrainer), scaled down to a tiny model on CPU.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

import shardwise
from shardwise.data import train_bpe_tokenizer
from shardwise.errors import CheckpointError, ConfigError, ShardwiseError
from tests.data.conftest import make_text

# --- shared inputs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One pretraining text file (as seed 000's ./pretrain_data.txt), three more, and a vocab-300 tokenizer."""
    root = tmp_path_factory.mktemp("api_corpus")
    files = []
    for i in range(3):
        p = root / f"doc{i}.txt"
        p.write_text(make_text(i, 60), encoding="utf-8")
        files.append(str(p))
    single = root / "pretrain_data.txt"
    single.write_text("\n\n".join(make_text(i, 60) for i in range(2)), encoding="utf-8")
    tok_dir = root / "tok"
    train_bpe_tokenizer(files, 300, tok_dir, show_progress=False)
    return {"dir": root, "single": single, "tokenizer": tok_dir}


@pytest.fixture()
def shardwise_log(caplog: pytest.LogCaptureFixture):
    """Capture shardwise's log records even when the CLI (run in-process earlier) stopped propagation."""
    logger = logging.getLogger("shardwise")
    logger.addHandler(caplog.handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(old_level)


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# --- seed 000, section 5 -----------------------------------------------------------------------------------

# train_config.yaml of seed 000 (5.2) with the sizes scaled down: a tiny preset, CPU, eager mode,
# fp32 (this CPU has no fast bf16), 32-token samples and a small batch. data_parallel stays 8.
SEED_000_YAML = """\
# 基础配置
model_name: tiny_llama
device_target: CPU
mode: pynative
seed: 42

# 分布式并行配置
parallel:
  data_parallel: 8
  model_parallel: 1
  pipeline_parallel: 1
  auto_parallel: True

# 显存优化配置
optimize:
  mixed_precision: fp32
  recompute: True
  gradient_accumulation_steps: 1
  max_grad_norm: 1.0

# 训练参数
batch_size: 1
seq_length: 32
epochs: 1
learning_rate: 5e-3
save_ckpt: ./ckpt
save_steps: 4
"""


def test_seed_000_script_runs_as_written(corpus, tmp_path, monkeypatch, shardwise_log) -> None:
    """Seed 000 sections 5.3-5.5 verbatim (import line, tokenizer and data paths changed)."""
    monkeypatch.chdir(tmp_path)
    Path("train_config.yaml").write_text(SEED_000_YAML, encoding="utf-8")
    Path("pretrain_data.txt").write_text(corpus["single"].read_text(encoding="utf-8"), encoding="utf-8")
    tokenizer_dir = str(corpus["tokenizer"])

    # ---- seed 000, 5.3 ----
    from shardwise import AutoTokenizer, TextDataset, create_dataset

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = tokenizer.eos_token

    def build_pretrain_dataset(data_path, batch_size, seq_len):
        dataset = TextDataset(
            data_files=data_path,
            tokenizer=tokenizer,
            max_seq_len=seq_len,
            shuffle=True
        )
        dataloader = create_dataset(
            dataset,
            batch_size=batch_size,
            num_parallel_workers=4,
            distributed=True
        )
        return dataloader

    # ---- seed 000, 5.4 ----
    import yaml

    from shardwise import AutoModelForCausalLM, Trainer, TrainingArguments

    with open("train_config.yaml", "r", encoding="utf-8") as f:
        config = yaml.safe_load(f)

    model = AutoModelForCausalLM.from_pretrained(
        config["model_name"],
        parallel_config=config["parallel"],
        optimize_config=config["optimize"]
    )

    training_args = TrainingArguments(
        output_dir=config["save_ckpt"],
        num_train_epochs=config["epochs"],
        per_device_train_batch_size=config["batch_size"],
        learning_rate=float(config["learning_rate"]),
        fp16=config["optimize"]["mixed_precision"] == "fp16",
        bf16=config["optimize"]["mixed_precision"] == "bf16",
        gradient_accumulation_steps=config["optimize"]["gradient_accumulation_steps"],
        save_steps=config["save_steps"],
        log_steps=1  # the seed logs every 10 steps; every step here, to check the whole curve
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=build_pretrain_dataset(
            data_path="./pretrain_data.txt",
            batch_size=config["batch_size"],
            seq_len=config["seq_length"]
        )
    )

    # ---- seed 000, 5.5 ----
    result = trainer.train()

    # One process, data_parallel 8: the same global batch as 8 devices, by accumulating 8x more.
    cfg = trainer.config
    assert cfg.parallel.data_parallel == 1
    assert cfg.gradient_accumulation() == 1 * 8
    assert cfg.global_batch_size() == 1 * 1 * 8
    assert cfg.data.seq_length == 32  # the dataset's samples, not the model's 256 positions
    assert cfg.optimize.mixed_precision == "fp32" and cfg.optimize.recompute == "full"
    assert cfg.train.max_grad_norm == 1.0 and cfg.train.lr == pytest.approx(5e-3)
    warnings = [r.getMessage() for r in shardwise_log.records if r.levelno == logging.WARNING]
    assert any("data_parallel 8" in w and "x8" in w for w in warnings), warnings

    # Steps follow from the global batch: one epoch of ceil(len(dataset) / 8) steps.
    dataset = TextDataset(data_files="./pretrain_data.txt", tokenizer=tokenizer, max_seq_len=32)
    assert result.step == math.ceil(len(dataset) / 8) == len(result.losses)
    assert result.step >= 8

    # It trains: the loss falls clearly over the run.
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert losses[0] > 5.0  # about ln(300) for a fresh model on a 300-token vocabulary
    assert max(losses[-3:]) < losses[0] - 1.0, losses

    # Metrics and checkpoints are written into save_ckpt.
    run_dir = tmp_path / "ckpt"
    records = [r for r in _metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, result.step + 1))
    assert [r["loss"] for r in records] == pytest.approx(losses)
    final = run_dir / "checkpoints" / f"step_{result.step:08d}"
    assert Path(result.last_checkpoint).resolve() == final.resolve()
    assert (final / "trainer_state.json").is_file() and (final / "config.yaml").is_file()
    saved_steps = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir())
    assert all(s % 4 == 0 or s == result.step for s in saved_steps) and saved_steps[-1] == result.step
    # The dataset's tokenizer travels with the run, so `shardwise generate ckpt` can decode.
    assert (final / "tokenizer" / "tokenizer.json").is_file()

    # from_pretrained(output_dir) loads the trained weights: the same logits as the trained model.
    loaded = AutoModelForCausalLM.from_pretrained(config["save_ckpt"])
    fresh = AutoModelForCausalLM.from_pretrained(config["model_name"])
    ids = torch.tensor([tokenizer.encode(make_text(7, 3))[:24]])
    model.eval()
    with torch.no_grad():
        expected = model(ids)
        torch.testing.assert_close(loaded(ids), expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(fresh(ids), expected, atol=1e-2)

    # The run opens in `shardwise generate` too (it needs the tokenizer saved with the run).
    from shardwise.cli import main

    logger = logging.getLogger("shardwise")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        code = main(["generate", config["save_ckpt"], "--prompt", "Elizabeth", "--max-new-tokens", "3",
                     "--no-stream"])
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
    assert code == 0

    # Seed 000, 5.6 swaps the dataset and calls train() again: the finished run is not replaced silently.
    trainer.train_dataset = build_pretrain_dataset(
        data_path="./pretrain_data.txt", batch_size=config["batch_size"], seq_len=config["seq_length"])
    with pytest.raises(ShardwiseError, match="overwrite_output_dir"):
        trainer.train()
    assert (final / "trainer_state.json").is_file()


def test_seed_000_arguments_give_the_seed_global_batch() -> None:
    """The unscaled seed config on one process: 8 x 4 x 8 = 256 samples per step, as the dry run says."""
    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "seed_train_config.yaml").read_text("utf-8"))
    model = shardwise.AutoModelForCausalLM.from_pretrained(
        "tiny_llama", parallel_config=config["parallel"], optimize_config=config["optimize"], device="meta")
    args = shardwise.TrainingArguments(
        output_dir="unused", num_train_epochs=config["epochs"], per_device_train_batch_size=config["batch_size"],
        learning_rate=float(config["learning_rate"]), fp16=config["optimize"]["mixed_precision"] == "fp16",
        bf16=config["optimize"]["mixed_precision"] == "bf16",
        gradient_accumulation_steps=config["optimize"]["gradient_accumulation_steps"],
        save_steps=config["save_steps"], log_steps=10)
    from shardwise.api import run_config_from

    cfg = run_config_from(model, args, seq_length=64)
    assert cfg.global_batch_size() == 256 and cfg.gradient_accumulation() == 32
    assert cfg.optimize.mixed_precision == "bf16" and cfg.optimize.recompute == "full"
    assert cfg.train.epochs == 10 and cfg.train.save_steps == 1000 and cfg.train.lr == pytest.approx(2e-5)

    # fp16=False, bf16=False given explicitly means fp32, whatever the optimize_config said.
    args.bf16 = False
    assert run_config_from(model, args, seq_length=64).optimize.mixed_precision == "fp32"


def test_arguments_passed_win_config_values_beat_defaults() -> None:
    """What the user passes wins; what the model's config says beats the arguments' defaults."""
    from shardwise.api import run_config_from

    model = shardwise.AutoModelForCausalLM.from_config(
        {"model": {"preset": "tiny_llama"}, "train": {"max_steps": 100, "lr": 1e-3, "min_lr": 1e-4,
                                                      "warmup_steps": 5}}, device="meta")
    cfg = run_config_from(model, shardwise.TrainingArguments(learning_rate=0.01, warmup_steps=0), 32)
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps) == (0.01, 1e-4, 0)
    assert (cfg.train.max_steps, cfg.train.epochs) == (100, None)  # no default 3 epochs added
    cfg = run_config_from(model, shardwise.TrainingArguments(num_train_epochs=2), 32)
    assert (cfg.train.max_steps, cfg.train.epochs, cfg.train.lr) == (None, 2.0, 1e-3)
    args = shardwise.TrainingArguments()
    args.max_steps = 7  # assigned after construction counts as passed
    assert run_config_from(model, args, 32).train.max_steps == 7


def test_from_pretrained_missing_directory_is_a_clear_error(tmp_path) -> None:
    """A path that does not exist is not looked up as a preset name."""
    missing = str(tmp_path / "ckpt" / "pretrain_ckpt")
    with pytest.raises(CheckpointError, match=re.escape(missing)):
        shardwise.AutoModelForCausalLM.from_pretrained(missing)
    with pytest.raises(ShardwiseError, match="llama_7b"):  # a typo of a preset name suggests the name
        shardwise.AutoModelForCausalLM.from_pretrained("llama7b")


# --- seed 002, section 3.3 ---------------------------------------------------------------------------------

# llm_pretrain.yaml of seed 002 (3.1) with the sizes scaled down; single process (TP 1, PP 1, DP -1,
# no ZeRO). Schedule values differ from the defaults on purpose, so a test can see them used.
SEED_002_YAML = """\
model:
  model_type: llama
  hidden_size: 64
  num_layers: 2
  num_heads: 4
  seq_length: 32
  vocab_size: 512
  use_flash_attention: true

parallel:
  tensor_parallel: 1
  pipeline_parallel: 1
  data_parallel: -1
  use_zero: false
  zero_level: 3
  micro_batch_interleave: true
  micro_batch_num: 2

train:
  epochs: 1
  batch_size: 8
  micro_batch_size: 1
  optimizer: adamw
  lr: 1e-2
  min_lr: 1e-4
  warmup_steps: 2
  decay_style: linear
  loss_scale: dynamic
  grad_clip_norm: 0.5

run:
  mode: 1
  device_target: CPU
  enable_graph_kernel: true
  graph_kernel_flags: "--disable_expand_ops=Softmax"
"""


def test_seed_002_script_runs_as_written(corpus, tmp_path, monkeypatch) -> None:
    """Seed 002 section 3.3 verbatim, with a TextDataset in place of MindDataset."""
    monkeypatch.chdir(tmp_path)
    Path("llm_pretrain.yaml").write_text(SEED_002_YAML, encoding="utf-8")
    tokenizer = shardwise.AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))

    import yaml

    from shardwise import AutoModelForCausalLM, LLMArguments, LLMTrainer

    with open("llm_pretrain.yaml", "r") as f:
        cfg = yaml.safe_load(f)

    dataset = shardwise.TextDataset(data_files=str(corpus["dir"] / "doc[01].txt"), tokenizer=tokenizer,
                                    max_seq_len=cfg["model"]["seq_length"])

    model = AutoModelForCausalLM.from_config(cfg)

    args = LLMArguments(
        tensor_parallel=cfg["parallel"]["tensor_parallel"],
        pipeline_parallel=cfg["parallel"]["pipeline_parallel"],
        use_zero=cfg["parallel"]["use_zero"],
        zero_level=cfg["parallel"]["zero_level"],
        epochs=cfg["train"]["epochs"],
        batch_size=cfg["train"]["batch_size"],
        lr=cfg["train"]["lr"]
    )

    trainer = LLMTrainer(
        model=model,
        args=args,
        train_dataset=dataset
    )

    result = trainer.train()

    # The model is the YAML's, and batch_size is the global batch: 8 micro-batches of 1 sample.
    assert (model.cfg.hidden_size, model.cfg.num_layers, model.cfg.vocab_size) == (64, 2, 512)
    c = trainer.config
    assert c.global_batch_size() == cfg["train"]["batch_size"] == 8
    assert c.train.micro_batch_size == 1 and c.gradient_accumulation() == 8
    assert c.parallel.world_size() == 1 and c.parallel.zero_stage == 0
    assert result.step == math.ceil(len(dataset) / 8) >= 8
    # What the YAML says and LLMArguments does not repeat is kept, not replaced by defaults.
    assert c.train.lr == pytest.approx(1e-2) and c.train.min_lr == pytest.approx(1e-4)
    assert c.train.warmup_steps == 2 and c.train.decay_style == "linear"
    assert c.train.max_grad_norm == pytest.approx(0.5) and c.optimize.loss_scale == "dynamic"
    assert c.run.device == "cpu" and c.run.compile is False
    # ... and used: the linear schedule ends at min_lr.
    records = [r for r in _metrics(Path("runs/default")) if "loss" in r]
    assert records[-1]["step"] == result.step
    assert records[-1]["lr"] == pytest.approx(1e-4)

    losses = [result.losses[s] for s in sorted(result.losses)]
    assert max(losses[-3:]) < losses[0] - 1.0, losses


def test_seed_002_tensor_parallel_on_one_process_fails_clearly(corpus, tmp_path) -> None:
    """tensor_parallel 2 needs two devices: a ShardwiseError that says so, before any step."""
    cfg = yaml.safe_load(SEED_002_YAML)
    tokenizer = shardwise.AutoTokenizer.from_pretrained(str(corpus["tokenizer"]))
    dataset = shardwise.TextDataset(data_files=str(corpus["dir"] / "doc[01].txt"), tokenizer=tokenizer,
                                    max_seq_len=32)
    model = shardwise.AutoModelForCausalLM.from_config(cfg)
    args = shardwise.LLMArguments(tensor_parallel=2, pipeline_parallel=1, use_zero=False, zero_level=3,
                                  epochs=1, batch_size=8, lr=1e-3, output_dir=str(tmp_path / "run"))
    with pytest.raises(ShardwiseError) as info:
        shardwise.LLMTrainer(model=model, args=args, train_dataset=dataset).train()
    message = str(info.value)
    assert re.search(r"\b2 processes\b", message) and "--nproc 2" in message, message
    assert "tensor_parallel" in message
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- the package's names -----------------------------------------------------------------------------------

DOCUMENTED = ("AutoModelForCausalLM", "AutoTokenizer", "LLMArguments", "LLMTrainer", "Trainer",
              "TrainingArguments", "TextDataset", "create_dataset", "ShardwiseError", "RunConfig",
              "load_config")


def test_star_import_exposes_the_documented_names() -> None:
    """`from shardwise import *` gives the documents' names, and they are the API's classes."""
    namespace: dict = {}
    exec("from shardwise import *", namespace)
    missing = [name for name in DOCUMENTED if name not in namespace]
    assert not missing, missing
    for name in shardwise.__all__:
        assert name in namespace and namespace[name] is getattr(shardwise, name)
    from shardwise import api, data

    # The document-shaped Trainer (model=, args=), not the config-driven loop it builds on.
    assert namespace["Trainer"] is api.Trainer and issubclass(namespace["LLMTrainer"], api.Trainer)
    assert namespace["TextDataset"] is data.TextDataset and namespace["create_dataset"] is data.create_dataset
    assert issubclass(namespace["LLMArguments"], namespace["TrainingArguments"])


# --- arguments that would silently do something else --------------------------------------------------------


@pytest.mark.parametrize("use_zero, zero_level, stage", [
    (True, 0, 0), (True, 3, 3), (True, None, 1), (False, 3, 0), (None, 2, 2), (False, None, 0)])
def test_llm_arguments_zero_stage_agrees_with_the_yaml(use_zero, zero_level, stage) -> None:
    """use_zero/zero_level given to LLMArguments mean the same ZeRO stage as in the seed YAML."""
    from shardwise.config import translate_seed_keys

    given = {k: v for k, v in (("use_zero", use_zero), ("zero_level", zero_level)) if v is not None}
    translated, _ = translate_seed_keys({"parallel": given})
    assert translated["parallel"]["zero_stage"] == stage
    args = shardwise.LLMArguments(use_zero=use_zero, zero_level=zero_level)
    assert args.parallel_overrides() == {"zero_stage": stage}


def test_trainer_refuses_unknown_arguments() -> None:
    """A misspelt keyword is a TypeError naming it, not silently ignored."""
    model = shardwise.AutoModelForCausalLM.from_pretrained("tiny_llama", device="meta")
    with pytest.raises(TypeError, match="eval_datset"):
        shardwise.Trainer(model=model, args=shardwise.TrainingArguments(), eval_datset=[])


def test_from_pretrained_directory_refuses_model_overrides(tmp_path) -> None:
    """Overrides change a preset; a directory's model is what was saved, so they are an error there."""
    with pytest.raises(ConfigError, match="presets only") as info:
        shardwise.AutoModelForCausalLM.from_pretrained(str(tmp_path), num_layers=4)
    assert "num_layers" in str(info.value)
    model = shardwise.AutoModelForCausalLM.from_pretrained("tiny_llama", device="meta", num_layers=1)
    assert model.cfg.num_layers == 1


def test_save_strategy_is_steps_or_no() -> None:
    """"no" keeps only the final checkpoint; any other value than "steps"/"no" is a ConfigError."""
    from shardwise.api import run_config_from

    with pytest.raises(ConfigError, match="'epoch'") as info:
        shardwise.TrainingArguments(save_strategy="epoch")
    assert "'steps'" in str(info.value) and "'no'" in str(info.value)
    model = shardwise.AutoModelForCausalLM.from_pretrained("tiny_llama", device="meta")
    args = shardwise.TrainingArguments(max_steps=10, save_steps=5, save_strategy="steps")
    assert run_config_from(model, args, 32).train.save_steps == 5
    args.save_strategy = "no"
    assert run_config_from(model, args, 32).train.save_steps is None
    args.save_strategy = "epoch"  # assigned after construction: refused when the run is configured
    with pytest.raises(ConfigError, match="save_strategy 'epoch'"):
        run_config_from(model, args, 32)


def test_from_pretrained_reads_a_hugging_face_directory(tmp_path) -> None:  # noqa: ANN001
    import torch

    from shardwise import AutoModelForCausalLM
    from shardwise.models import build_model, resolve_model_config
    from shardwise.models.hf import save_hf

    torch.manual_seed(3)
    source = build_model(resolve_model_config({"preset": "tiny_gpt2"}))
    save_hf(source, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.cfg.position == "learned" and model.cfg.tie_embeddings
    tokens = torch.randint(0, 512, (2, 12))
    torch.testing.assert_close(model(tokens), source(tokens), rtol=0, atol=0)
