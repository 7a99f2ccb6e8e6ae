import os

import pytest

from shardwise.config import apply_overrides, translate_seed_keys
from shardwise.errors import ConfigError
from shardwise.resolve import load_run_config as load_config
from shardwise.resolve import resolve_config as validate
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
    with pytest.raises(ConfigError, match="optimize.precision_level O2 needs optimize.mixed_precision"):
        validate({**BASE, "optimize": {"precision_level": "O2"}})
    with pytest.raises(ConfigError, match="train.eps"):
        validate({**BASE, "optimize": {"mixed_precision": "fp16", "precision_level": "O3"}})
    ok = validate({**BASE, "optimize": {"mixed_precision": "fp16", "precision_level": "O3"},
                   "train": {"max_steps": 5, "eps": 1e-4}})
    assert ok.optimize.level() == "O3"


def test_reduce_gradients_resolves_per_layout_and_refuses_what_cannot_work():
    def parallel(**p: object):  # noqa: ANN202
        return validate({**BASE, "parallel": p}).parallel

    # auto: every micro-batch for ZeRO 2/3, once per step for ZeRO 0/1 and under a pipeline's schedule
    assert [parallel(data_parallel=2, zero_stage=z).reduces_every_micro_batch() for z in (0, 1, 2, 3)] == \
        [False, False, True, True]
    assert not parallel(data_parallel=2, zero_stage=3, pipeline_parallel=2).reduces_every_micro_batch()
    assert not parallel(data_parallel=2, zero_stage=3, reduce_gradients="once_per_step").reduces_every_micro_batch()
    with pytest.raises(ConfigError, match="every_micro_batch needs zero_stage 2 or 3"):
        parallel(data_parallel=2, zero_stage=1, reduce_gradients="every_micro_batch")
    with pytest.raises(ConfigError, match="pipeline schedule decides"):
        parallel(data_parallel=2, zero_stage=3, pipeline_parallel=2, reduce_gradients="once_per_step")


# --- mistakes named as the user wrote them ------------------------------------------------------------


def _error(raw: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(raw=raw, overrides=overrides)
    return str(e.value)


SEED_000_SHAPE = {"model_name": "tiny_llama", "epochs": 1, "learning_rate": 1e-3}


@pytest.mark.parametrize("typo, meant", [("learnin_rate", "learning_rate"), ("batch_sze", "batch_size"),
                                         ("seq_lenght", "seq_length"), ("device_targt", "device_target")])
def test_typo_in_a_seed_000_file_gets_the_seed_spelling(typo: str, meant: str) -> None:
    """A file written in seed 000's shape is answered in that shape: `learning_rate`, not `train.lr`."""
    msg = _error({**SEED_000_SHAPE, typo: 1})
    assert f"unknown key {typo}; did you mean {meant}?" in msg
    assert "train." not in msg and "valid keys here" not in msg


def test_typo_in_our_shape_gets_our_key() -> None:
    """The same slip in a file written in our shape gets our key."""
    assert "unknown key learnin_rate; did you mean train.lr?" in _error({**BASE, "learnin_rate": 1})
    assert "unknown key parallel_confg; did you mean parallel?" in _error({**BASE, "parallel_confg": {}})


def test_misspelt_seed_keys_inside_sections() -> None:
    """A seed key of a section (seed 000's parallel.model_parallel, seed 002's train.batch_size)."""
    msg = _error({**SEED_000_SHAPE, "parallel": {"model_paralel": 2}})
    assert "unknown key parallel.model_paralel; did you mean parallel.model_parallel?" in msg
    seed_002 = {"model": {"preset": "tiny_llama"}, "train": {"epochs": 1, "batch_sze": 8, "grad_clip_norm": 1.0}}
    assert "unknown key train.batch_sze; did you mean train.batch_size?" in _error(seed_002)


def test_key_in_the_wrong_section_is_found() -> None:
    """A right key in the wrong place: its section is named (the wrong place has nothing close)."""
    assert "unknown key lr; did you mean train.lr?" in _error({**BASE, "lr": 1e-3})
    msg = _error({**BASE, "train": {"max_steps": 5, "tensor_parallel": 2}})
    assert "unknown key train.tensor_parallel; did you mean parallel.tensor_parallel?" in msg
    msg = _error({**BASE, "model": {"preset": "tiny_llama", "data": {}}})
    assert "unknown key model.data; did you mean data?" in msg


def test_wrong_value_names_the_key_as_written_and_what_is_allowed() -> None:
    """learning_rate: fast in a seed file is reported as learning_rate, with the type and bound."""
    msg = _error({**SEED_000_SHAPE, "learning_rate": "fast"})
    assert "learning_rate = 'fast': input should be a valid number" in msg
    assert "expected a number > 0 (peak learning rate)" in msg and "train.lr" not in msg
    msg = _error({**SEED_000_SHAPE, "parallel": {"model_parallel": "two"}})
    assert "parallel.model_parallel = 'two'" in msg and "a whole number >= 1" in msg and "tensor_parallel" not in msg
    # An override is named as the --set wrote it, and takes the file's spelling away from that key.
    assert "learning_rate = 'fast'" in _error(BASE, ["learning_rate=fast"])
    assert "train.lr = 'fast'" in _error(SEED_000_SHAPE, ["train.lr=fast"])
    # A check across keys speaks of them as written too.
    msg = _error({**SEED_000_SHAPE, "train": {"min_lr": 0.1}})
    assert "train.min_lr 0.1 is above learning_rate 0.001" in msg
    msg = _error({"model_name": "tiny_llama", "epochs": 1, "seq_length": 100000})
    assert "seq_length 100000 is above model.max_position_embeddings 256" in msg and "data.seq_length" not in msg


def test_seed_values_that_cannot_be_translated_name_their_key() -> None:
    """Values of seed keys checked while translating: device_target, use_zero, zero_level, mode."""
    assert "device_target = 'tpu' is not allowed; use Ascend" in _error({**SEED_000_SHAPE, "device_target": "tpu"})
    assert "parallel.use_zero = 'yes' is not allowed; use true or false" in _error(
        {**BASE, "parallel": {"use_zero": "yes"}})
    assert "parallel.zero_level = 7 is not allowed; use 0, 1, 2 or 3" in _error({**BASE, "parallel": {"zero_level": 7}})
    assert "mode = ['graph'] is not allowed" in _error({**SEED_000_SHAPE, "mode": ["graph"]})


TINY = {"preset": "tiny_llama"}
ONE_STEP = {"max_steps": 1}


@pytest.mark.parametrize("raw, needle", [
    ({"model": TINY, "train": {"epochs": float("inf")}}, "train.epochs = inf: input should be a finite number"),
    ({"model": TINY, "train": {**ONE_STEP, "lr": "nan"}}, "train.lr = 'nan': input should be a finite number"),
    ({"model": {**TINY, "rope_theta": float("inf")}, "train": ONE_STEP},
     "model.rope_theta = inf: give a finite number"),
    ({"model": {**TINY, "hidden_size": 2**64}, "train": ONE_STEP},
     "model.hidden_size = 18446744073709551616: input should be less than or equal to 1048576"),
    ({**BASE, "train": {**ONE_STEP, "max_steps": 2**64}},
     "train.max_steps = 18446744073709551616 is larger than any run can use (at most 2,147,483,647)"),
    ({**BASE, "lora": {"r": 10**30}}, "lora.r = 1000000000000000000000000000000 is larger"),
    ({"model": TINY, "train": {**ONE_STEP, "seed": -1}}, "train.seed = -1: input should be greater than or equal to 0"),
    ({"model": {"preset": {"name": "tiny_llama"}}, "train": ONE_STEP},
     "model.preset = {'name': 'tiny_llama'} must be text"),
    ({"model": {"init_from": 3}, "train": ONE_STEP}, "model.init_from = 3 must be text"),
    ({**BASE, "train": 5}, "train = 5 is not a section; expected a mapping of keys such as output_dir"),
    ({**BASE, "optimize": {"loss_scale": "big"}},
     "optimize.loss_scale = 'big' is not allowed; expected one of 'dynamic' or a number"),
    ({**BASE, "data": {"train_files": ["a.txt", 3]}},
     "data.train_files[1] = 3: input should be a valid string; expected text"),
    ({**BASE, 3: 4}, "key 3 in the top level is not text"),
])
def test_values_no_run_can_use_are_refused(raw: dict, needle: str) -> None:
    """Non-finite numbers, integers past any size, negative seeds, wrong types: one clear line each."""
    assert needle in _error(raw)


def test_set_without_a_key() -> None:
    with pytest.raises(ConfigError, match="has no key before '='"):
        apply_overrides(BASE, ["=3"])
