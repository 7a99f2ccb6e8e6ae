import os

import pytest

from shardwise.config import apply_overrides, load_config, translate_seed_keys, validate
from shardwise.errors import ConfigError

from tests.conftest import REPO

BASE = {"model": {"preset": "tiny_llama"}, "train": {"max_steps": 5}}


def test_seed_train_config_loads_as_written():
    cfg = load_config(os.path.join(REPO, "configs/seed_train_config.yaml"))
    assert cfg.model.preset == "llama_7b" and cfg.model.hidden_size == 4096
    assert cfg.run.device == "npu" and cfg.run.compile is True
    assert cfg.parallel.data_parallel == 8 and cfg.parallel.tensor_parallel == 1
    assert cfg.optimize.mixed_precision == "bf16" and cfg.optimize.level() == "O2"
    assert cfg.optimize.recompute == "full" and cfg.optimize.gradient_accumulation_steps == 4
    assert cfg.train.max_grad_norm == 1.0 and cfg.train.lr == 2e-5 and cfg.train.epochs == 10
    assert cfg.train.micro_batch_size == 8 and cfg.data.seq_length == 2048
    assert cfg.train.output_dir == "./ckpt" and cfg.train.save_steps == 1000 and cfg.train.seed == 42
    assert cfg.global_batch_size() == 8 * 4 * 8


def test_seed_llm_pretrain_loads_as_written(caplog):
    cfg = load_config(os.path.join(REPO, "configs/seed_llm_pretrain.yaml"))
    assert cfg.model.hidden_size == 8192 and cfg.model.num_layers == 80 and cfg.model.num_heads == 64
    assert cfg.data.seq_length == 4096 and cfg.model.max_position_embeddings >= 4096
    assert cfg.parallel.tensor_parallel == 8 and cfg.parallel.pipeline_parallel == 4
    assert cfg.parallel.data_parallel == -1 and cfg.parallel.zero_stage == 3
    assert cfg.train.global_batch_size == 512 and cfg.train.micro_batch_size == 1
    assert cfg.train.min_lr == 1e-5 and cfg.train.warmup_steps == 1000
    assert cfg.optimize.loss_scale == "dynamic" and cfg.run.compile is True
    assert cfg.parallel.world_size(64) == 64 and cfg.parallel.dp_degree(64) == 2
    assert cfg.gradient_accumulation(64) == 256
    assert any("enable_graph_kernel" in r.message and "no effect" in r.message for r in caplog.records)


def test_unknown_key_names_path_and_closest():
    with pytest.raises(ConfigError) as e:
        validate({**BASE, "train": {"max_steps": 5, "lerning_rate": 1}})
    assert "train.lerning_rate" in str(e.value) and "lr" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate({**BASE, "optimize": {"recompte": "full"}})
    assert "optimize.recompte" in str(e.value) and "optimize.recompute" in str(e.value)


def test_wrong_value_says_what_is_allowed():
    with pytest.raises(ConfigError) as e:
        validate({**BASE, "optimize": {"mixed_precision": "fp8"}})
    msg = str(e.value)
    assert "optimize.mixed_precision" in msg and "bf16" in msg and "fp16" in msg
    with pytest.raises(ConfigError) as e:
        validate({**BASE, "train": {"max_steps": "many"}})
    assert "train.max_steps" in str(e.value)


def test_overrides_and_seed_key_overrides():
    raw = apply_overrides(BASE, ["train.lr=1e-4", "optimize.recompute=selective", "learning_rate=3e-3"])
    cfg = validate(raw)
    assert cfg.train.lr == 3e-3 and cfg.optimize.recompute == "selective"
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides(BASE, ["train.lr"])


def test_seq_length_above_positions_and_batch_that_does_not_divide():
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        validate({**BASE, "data": {"seq_length": 100000}})
    cfg = validate({**BASE, "train": {"max_steps": 5, "micro_batch_size": 3, "global_batch_size": 10}})
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.gradient_accumulation()


def test_tp_must_divide_heads_and_conflicting_seed_keys():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        validate({**BASE, "parallel": {"tensor_parallel": 4}})  # tiny_llama has 2 kv heads
    with pytest.raises(ConfigError, match="same thing"):
        translate_seed_keys({"learning_rate": 1e-3, "train": {"lr": 1e-4}})


def test_length_is_required_and_bad_mode_is_named():
    with pytest.raises(ConfigError, match="max_steps or train.epochs"):
        validate({"model": {"preset": "tiny_llama"}, "train": {}})
    with pytest.raises(ConfigError, match="pynative"):
        translate_seed_keys({"mode": "turbo"})


def test_unknown_preset_lists_known(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate({"model": {"preset": "llama_7"}, "train": {"max_steps": 1}})
    assert "llama_7b" in str(e.value)


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="max_grad_norm"):
        validate({**BASE, "train": {"max_steps": 5, "max_grad_norm": -1.0}})
    with pytest.raises(ConfigError, match="precision_level O2 needs mixed_precision"):
        validate({**BASE, "optimize": {"precision_level": "O2"}})
    with pytest.raises(ConfigError, match="train.eps"):
        validate({**BASE, "optimize": {"mixed_precision": "fp16", "precision_level": "O3"}})
    ok = validate({**BASE, "optimize": {"mixed_precision": "fp16", "precision_level": "O3"},
                   "train": {"max_steps": 5, "eps": 1e-4}})
    assert ok.optimize.level() == "O3"
