"""Fine-tuning through the Trainer: `model.init_from` (a Hugging Face directory or a shardwise
checkpoint), LoRA and layer freezing, in one process and under DP (ZeRO 1-3), TP and PP.

Every layout must train like one process, checked strictly with plain SGD (test_trainer_parity.py's
checks: first-step gradients, parameters after the steps, losses and gradient norms). A run from
init_from never builds the whole model on a rank: the workers make `build_model` fail, so the only way
to get weights is the meta-device build that each rank fills with its own slices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import storage as ckpt
from shardwise.checkpoint.weights import load_model
from shardwise.data.packing import PackedDataset
from shardwise.errors import ConfigError
from shardwise.models import build_model, resolve_model_config
from shardwise.models.hf import from_hf, save_hf
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer

from ..train.conftest import SEQ, PaddedDataset, make_tokens
from .harness import ParityError, run_distributed
from .test_trainer_parity import assert_run_matches, reference_run, train_once

STEPS = 3
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def _hf_dir(root: Path, preset: str = "tiny_llama", **changes: object) -> Path:
    """A Hugging Face directory holding a (random) tiny model: the 'published weights'."""
    torch.manual_seed(123)
    out = root / f"hf_{preset}{'_odd' if changes else ''}"
    if not out.exists():
        save_hf(build_model(resolve_model_config({"preset": preset, **changes})), out)
    return out


def _config(run_dir: Path, init_from: Path | None, dp: int = 1, zero: int = 0, tp: int = 1, pp: int = 1,
            lora: dict | None = None, freeze: dict | None = None, **train: object):  # noqa: ANN202
    rows = 4 // dp
    # A large learning rate, so that every step moves the loss well beyond the parity tolerance.
    section = {"output_dir": str(run_dir), "max_steps": STEPS, "micro_batch_size": rows, "lr": 2e-2,
               "weight_decay": 0.0, "decay_style": "constant", "log_steps": 1, "progress_bar": False,
               "tensorboard": False, "seed": 7,
               **train}
    raw = {"model": {"init_from": str(init_from)} if init_from else {"preset": "tiny_llama"},
           "data": {"seq_length": SEQ}, "train": section, "run": {"num_threads": 1},
           "parallel": {"data_parallel": dp, "zero_stage": zero, "tensor_parallel": tp, "pipeline_parallel": pp}}
    if pp > 1:
        raw["parallel"].update(micro_batch_num=2)
        section["micro_batch_size"] = rows // 2
    if lora:
        raw["lora"] = lora
    if freeze:
        raw["freeze"] = freeze
    return validate(raw)


# Plain SGD for the layout parity (see test_trainer_parity.py): a gradient error shows in the weights.
SGD = {"optimizer": "sgd", "beta1": 0.0, "lr": 0.3, "max_grad_norm": None, "peak_tflops": 1.0}


def _padded(cfg) -> PaddedDataset:  # noqa: ANN001
    """Uneven target counts per rank and micro-batch (ignored prompts, padding)."""
    return PaddedDataset(make_tokens(vocab=cfg.model.vocab_size), SEQ)


def _train(cfg, model=None) -> dict[int, float]:  # noqa: ANN001
    data = PackedDataset(make_tokens(vocab=cfg.model.vocab_size), SEQ)
    return Trainer(cfg, model=model, train_dataset=data).train().losses


def _assert_close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want), what
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], abs=2e-4), what


def test_init_from_hf_and_checkpoint_in_one_process(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path)
    cfg = _config(tmp_path / "from_hf", hf)
    assert cfg.model.num_layers == 2 and cfg.model.init_from == str(hf)
    from_dir = _train(cfg)
    # The same weights handed over as a model: the loaded weights are exactly the directory's.
    given = _train(_config(tmp_path / "given", None), model=from_hf(hf))
    _assert_close(from_dir, given, "init_from vs from_hf")
    # A shardwise checkpoint (its run directory) as the starting point: the fine-tuned weights.
    again = _train(_config(tmp_path / "from_ckpt", tmp_path / "from_hf"))
    model, _ = load_model(tmp_path / "from_hf")
    _assert_close(again, _train(_config(tmp_path / "given2", None), model=model), "init_from checkpoint")


def test_lora_trains_only_adapters_and_saves_them(tmp_path: Path) -> None:
    from shardwise.peft.lora import is_lora_name, load_adapter

    hf = _hf_dir(tmp_path)
    result = Trainer(_config(tmp_path / "lora", hf, lora=LORA),
                     train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    assert result.losses[STEPS] < result.losses[1]
    shapes = ckpt.read_trainer_state(result.last_checkpoint)["shapes"]
    lora_names = [n for n in shapes["model"] if is_lora_name(n)]
    assert len(lora_names) == 2 * 4 * 2  # A and B, 4 projections, 2 layers
    assert {n.rsplit(".", 1)[0] for n in shapes["optim"]} == set(lora_names)  # state for adapters only
    model, _ = load_model(result.last_checkpoint)
    base = from_hf(hf)
    for name, p in model.named_parameters():  # the base is untouched
        if not is_lora_name(name):
            torch.testing.assert_close(p, dict(base.named_parameters())[name], rtol=0, atol=0)
    # The adapter saved beside the checkpoint gives the checkpoint's model on the original base.
    load_adapter(base, result.last_checkpoint / "adapter")
    tokens = torch.randint(0, 512, (2, 16))
    torch.testing.assert_close(base(tokens), model(tokens), rtol=0, atol=1e-5)


def test_freezing_keeps_layers_fixed_and_without_state(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path)
    result = Trainer(_config(tmp_path / "frozen", hf, freeze={"embeddings": True, "layers": 1}),
                     train_dataset=PackedDataset(make_tokens(), SEQ)).train()
    model, _ = load_model(result.last_checkpoint)
    base = dict(from_hf(hf).named_parameters())
    optim = ckpt.read_trainer_state(result.last_checkpoint)["shapes"]["optim"]
    for name, p in model.named_parameters():
        frozen = name.startswith(("tok_embeddings.", "layers.0."))
        assert torch.equal(p, base[name]) == frozen, name
        assert any(k.startswith(name + ".") for k in optim) != frozen, name


def test_finetuning_config_errors(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"model.num_layers 4 \(the weights have 2\)"):
        validate({"model": {"init_from": str(hf), "num_layers": 4}, "train": {"max_steps": 1}})
    with pytest.raises(ConfigError, match="does not exist"):
        validate({"model": {"init_from": str(tmp_path / "nope")}, "train": {"max_steps": 1}})
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        validate({"model": {"init_from": str(hf)}, "train": {"max_steps": 1},
                  "data": {"train_files": ["x.txt"]}})
    with pytest.raises(ConfigError, match="freeze has no effect with lora"):
        _config(tmp_path / "x", hf, lora=LORA, freeze={"layers": 1})
    with pytest.raises(ConfigError, match="freeze.layers 3 exceeds"):
        _config(tmp_path / "x", hf, freeze={"layers": 3})
    with pytest.raises(ConfigError, match="target_modules"):
        _train(_config(tmp_path / "nomatch", hf, lora={"r": 2, "target_modules": ["qkv_proj"]}))
    # The demo's fine-tuning config, pointed at these weights, loads (its LoRA targets all exist).
    from shardwise.resolve import load_run_config

    demo = load_run_config(Path(__file__).parents[2] / "configs/sft_lora_demo.yaml",
                       [f"model.init_from={hf}", "data.tokenizer=tok"])
    assert demo.lora.r == 16 and demo.data.kind == "instruction" and demo.model.num_layers == 2
    # Fine-tuning defaults: a smaller learning rate and no weight decay, unless given.
    cfg = validate({"model": {"init_from": str(hf)}, "train": {"max_steps": 1}})
    assert (cfg.train.lr, cfg.train.weight_decay) == (2e-5, 0.0)
    cfg = validate({"model": {"init_from": str(hf)}, "train": {"max_steps": 1}, "lora": {"r": 4}})
    assert cfg.train.lr == 2e-4


LAYOUTS = {"full_zero3": dict(dp=2, zero=3), "full_tp2": dict(tp=2), "full_pp2": dict(pp=2),
           "lora_zero2": dict(dp=2, zero=2, lora=LORA), "lora_zero1": dict(dp=2, zero=1, lora=LORA),
           "lora_tp2": dict(tp=2, lora=LORA), "lora_pp2": dict(pp=2, lora=LORA),
           "freeze_tp2": dict(tp=2, freeze={"embeddings": True, "layers": 1}),
           # Uneven shards: ZeRO-3 splits a 509-row embedding into 255 + 254 rows; each rank reads its own.
           "odd_zero3": dict(dp=2, zero=3)}
SINGLE = {"full": {}, "lora": dict(lora=LORA), "freeze": dict(freeze={"embeddings": True, "layers": 1}),
          "odd": {}}


def _layouts(rank: int, world: int, root: Path, hf: Path, odd: Path) -> dict[str, dict]:
    import shardwise.builder as builder

    def no_full_build(*_a: object, **_k: object) -> None:
        raise AssertionError("init_from must not build the whole model on a rank")

    builder.materialize = no_full_build
    out = {}
    for name, kw in LAYOUTS.items():
        cfg = _config(root / name, odd if name.startswith("odd") else hf, **kw, **SGD)
        out[name] = train_once(cfg, data=_padded(cfg))
        out[name].pop("result")
    return out


@pytest.mark.timeout(600)
def test_finetuning_layouts_match_one_process(tmp_path: Path) -> None:
    hf, odd = _hf_dir(tmp_path), _hf_dir(tmp_path, vocab_size=509)
    single = {}
    for kind, kw in SINGLE.items():
        cfg = _config(tmp_path / kind, odd if kind == "odd" else hf, **kw, **SGD)
        single[kind] = reference_run(cfg, _padded(cfg))
    for name, ref in single.items():  # training moves the loss far beyond the parity tolerance
        assert abs(ref.losses[-1] - ref.losses[0]) > 1e-3, (name, ref.losses)
    results = run_distributed(_layouts, 2, tmp_path / "dist", hf, odd, timeout=540)
    failures = []
    for name in LAYOUTS:
        try:
            assert_run_matches(name, [r[name] for r in results], tmp_path / "dist" / name, single[name.split("_")[0]])
        except ParityError as exc:
            failures.append(str(exc))
    assert not failures, "\n\n".join(failures)


def test_bad_weights_fail_before_the_data_is_read(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    from shardwise.errors import CheckpointError
    from shardwise.train.dry_run import describe_run

    hf = _hf_dir(tmp_path)
    cfg = _config(tmp_path / "dry", hf, lora=LORA)
    assert "LoRA r=4 alpha=8 on 8 projections: 4,608 of 156,480" in describe_run(cfg)
    bad = tmp_path / "bad_hf"
    bad.mkdir()
    (bad / "config.json").write_text((hf / "config.json").read_text())
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(weights, bad / "model.safetensors")
    # The data does not exist: had it been read first, the error would be about the data.
    broken = with_data(_config(tmp_path / "bad", bad), train_files=[str(tmp_path / "missing.txt")], tokenizer="x")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.weight.*\(100, 64\).*\(160, 64\)"):
        Trainer(broken).train()
    (bad / "model.safetensors").unlink()
    json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
              open(bad / "model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        Trainer(broken).train()


def with_data(cfg, **data):  # noqa: ANN001, ANN201
    """The config with some data fields replaced, validated again."""
    raw = cfg.model_dump()
    raw["data"].update(data)
    raw["model"] = {"init_from": raw["model"]["init_from"]}
    return validate(raw)
