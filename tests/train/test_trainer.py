import math

import pytest
import torch

from shardwise.errors import CheckpointError, ConfigError, ShardwiseError, TrainingError
from shardwise.train import run_dir as run_dir_module
from shardwise.train import trainer as trainer_module
from shardwise.train.trainer import Trainer

from .conftest import SEQ, MaskedDataset, make_tokens, read_metrics, tiny_config, with_changes


def _run(cfg, ds, **kw):
    return Trainer(cfg, train_dataset=ds, **kw).train(**({"overwrite": True}))


def test_loss_falls_and_metrics_are_logged(tmp_path, dataset):
    cfg = tiny_config(tmp_path, max_steps=12)
    result = _run(cfg, dataset)
    assert result.step == 12
    assert result.losses[12] < result.losses[1] - 0.5
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("lr", "grad_norm", "loss_scale", "tokens_per_s", "target_tokens_per_s", "tokens_per_s_per_device",
                "mfu", "peak_in_doubt", "peak_memory_gb"):
        assert all(key in r for r in records)
    assert records[-1]["tokens_per_s"] > 0 and records[-1]["mfu"] > 0
    # Packed pre-training: every token is real and a target. An MFU above 1 always says so.
    assert all(r["target_tokens_per_s"] == pytest.approx(r["tokens_per_s"]) for r in records)
    assert all(r["peak_in_doubt"] == (r["mfu"] > 1) for r in records)
    assert records[0]["lr"] == pytest.approx(3e-3)  # warmup 1 step reaches the peak


def test_same_seed_same_losses(tmp_path, dataset):
    a = _run(tiny_config(tmp_path / "a"), dataset).losses
    b = _run(tiny_config(tmp_path / "b"), dataset).losses
    assert a == b


def test_grad_accumulation_is_normalised_by_tokens(tmp_path):
    ds = MaskedDataset(make_tokens(), SEQ)
    one = _run(tiny_config(tmp_path / "one", micro_batch_size=4), ds)
    four = _run(with_changes(tiny_config(tmp_path / "four", micro_batch_size=1),
                             optimize={"gradient_accumulation_steps": 4}), ds)
    two = _run(with_changes(tiny_config(tmp_path / "two", micro_batch_size=2),
                            optimize={"gradient_accumulation_steps": 2}), ds)
    for step, loss in one.losses.items():
        assert four.losses[step] == pytest.approx(loss, abs=1e-5)
        assert two.losses[step] == pytest.approx(loss, abs=1e-5)


def test_nan_loss_stops_naming_the_step(tmp_path, dataset):
    cfg = tiny_config(tmp_path, lr=1e30, warmup_steps=0, max_grad_norm=None)
    with pytest.raises(TrainingError, match=r"step \d+: loss is"):
        _run(cfg, dataset)


def test_nan_loss_skipped_when_configured(tmp_path, dataset):
    cfg = tiny_config(tmp_path, lr=1e30, warmup_steps=0, max_grad_norm=None, nan_policy="skip", max_steps=4)
    result = _run(cfg, dataset)
    assert result.step == 4
    records = [r for r in read_metrics(tmp_path / "run") if "skipped_steps" in r]
    assert sum(r["skipped_steps"] for r in records) >= 1
    assert any(not math.isfinite(r["grad_norm"]) for r in records)


def test_evaluation_reports_loss_and_perplexity(tmp_path, dataset):
    cfg = tiny_config(tmp_path, max_steps=3, eval_steps=3)
    ds_eval = type(dataset)(make_tokens(2000, seed=1), SEQ)
    result = Trainer(cfg, train_dataset=dataset, eval_dataset=ds_eval).train()
    assert result.eval["perplexity"] == pytest.approx(math.exp(result.eval["loss"]))
    assert result.eval["tokens"] == len(ds_eval) * SEQ  # the partial last batch counts too
    assert any("eval_loss" in r for r in read_metrics(tmp_path / "run"))


def test_lr_follows_the_schedule_in_the_run(tmp_path, dataset):
    cfg = tiny_config(tmp_path, max_steps=6, warmup_steps=2, lr=1e-3, min_lr=1e-4, decay_style="linear")
    _run(cfg, dataset)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_checkpoint_of_another_shape_names_the_tensor(tmp_path, dataset):
    cfg = tiny_config(tmp_path, max_steps=2)
    _run(cfg, dataset)
    other = with_changes(cfg, model={"intermediate_size": 128}, train={"max_steps": 4})
    with pytest.raises(CheckpointError, match=r"layers\.0\.feed_forward\.w\d\.weight has shape"):
        Trainer(other, train_dataset=dataset).train(resume="auto")


def test_keeps_the_newest_k_checkpoints(tmp_path, dataset):
    from shardwise.checkpoint.storage import list_checkpoints

    cfg = tiny_config(tmp_path, max_steps=5, save_steps=1, keep_checkpoints=2)
    _run(cfg, dataset)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000004", "step_00000005"]


def test_resume_from_a_finished_run_trains_nothing_more(tmp_path, dataset):
    cfg = tiny_config(tmp_path, max_steps=3)
    _run(cfg, dataset)
    again = Trainer(cfg, train_dataset=dataset).train(resume="auto")
    assert again.step == 3 and again.losses == {}


def test_compiled_model_gives_the_eager_losses_and_reports_the_compile_once(tmp_path, dataset, caplog):
    eager = _run(tiny_config(tmp_path / "eager", max_steps=2), dataset).losses
    assert "compile: false" in (tmp_path / "eager" / "run" / "config.yaml").read_text()  # auto on a CPU: eager
    # auto on a CPU compiles a run predicted to train long: at a peak of 1 kFLOP/s these 3 steps would take days
    cfg = tiny_config(tmp_path / "compiled", max_steps=3, peak_tflops=1e-9)
    with caplog.at_level("INFO", logger="shardwise"):
        trainer = Trainer(cfg, train_dataset=dataset)
        compiled = trainer.train().losses
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], abs=1e-4)
    assert all(getattr(block, "_compiled_call_impl", None) is not None for block in trainer.model.layers.values())
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile:")]
    assert len(reports) == 1 and "compiling cost about" in reports[0]
    assert "compile: true" in (tmp_path / "compiled" / "run" / "config.yaml").read_text()


def test_compile_auto_means_accelerators_and_no_quantised_base(tmp_path):
    cfg = tiny_config(tmp_path)
    assert cfg.run.compile == "auto"
    assert cfg.compiles("cuda") and cfg.compiles("npu") and not cfg.compiles("cpu")
    assert cfg.compiles("cpu", train_seconds=600) and not cfg.compiles("cpu", train_seconds=599)
    qlora = with_changes(cfg, lora={"r": 4, "target_modules": ["wq"], "quantize_base": "nf4"})
    assert not qlora.compiles("cuda")
    assert with_changes(cfg, run={"compile": True}).compiles("cpu")
    assert not with_changes(cfg, run={"compile": False}).compiles("cuda")


def test_checkpoint_with_recompute_resumes_without_it(tmp_path, dataset):
    cfg = with_changes(tiny_config(tmp_path, max_steps=2), optimize={"recompute": "full"})
    _run(cfg, dataset)
    plain = with_changes(cfg, optimize={"recompute": "none"}, train={"max_steps": 3})
    assert sorted(Trainer(plain, train_dataset=dataset).train(resume="auto").losses) == [3]


def test_tensorboard_events_are_written(tmp_path, dataset):
    pytest.importorskip("tensorboard")  # installed with the test extra; optional for users
    cfg = tiny_config(tmp_path, max_steps=2, tensorboard=True)
    _run(cfg, dataset)
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_offload_is_refused_on_an_accelerator_and_harmless_on_cpu(tmp_path, dataset):
    from shardwise.errors import ConfigError
    from shardwise.parallel.dims import ParallelDims
    from shardwise.train.trainer import check_offload

    # offload_params is FSDP2's: data parallelism, or one process (tests/train/test_offload_params_one_device.py),
    # not tensor parallelism alone; on one CPU it is a logged no-op
    cfg = with_changes(tiny_config(tmp_path, max_steps=1), optimize={"offload_params": True})
    with pytest.raises(ConfigError, match="optimize.offload_params"):
        check_offload(cfg, torch.device("cuda"), ParallelDims(tp=2))
    assert _run(cfg, dataset).step == 1


def test_fp16_nan_loss_stops_instead_of_skipping_forever(tmp_path, dataset):
    from shardwise.models import build_model

    cfg = with_changes(tiny_config(tmp_path, max_steps=3),
                       optimize={"mixed_precision": "fp16", "precision_level": "O1"})
    model = build_model(cfg.model)
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[0, 0] = float("nan")
    with pytest.raises(TrainingError, match=r"step 1: loss is nan"):
        Trainer(cfg, model=model, train_dataset=dataset).train()


def test_resuming_an_older_checkpoint_never_silently_replaces_newer_ones(tmp_path, dataset):
    from shardwise.checkpoint.storage import list_checkpoints
    from shardwise.errors import ConfigError

    cfg = tiny_config(tmp_path, max_steps=4, save_steps=2)
    _run(cfg, dataset)
    step2 = str(tmp_path / "run" / "checkpoints" / "step_00000002")
    before = (tmp_path / "run" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
    with pytest.raises(ConfigError, match="step_00000004"):
        Trainer(cfg, train_dataset=dataset).train(resume=step2)
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text() == before
    redo = Trainer(with_changes(cfg, train={"lr": 1e-4}), train_dataset=dataset).train(resume=step2, overwrite=True)
    assert sorted(redo.losses) == [3, 4]
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000002", "step_00000004"]


def test_eval_steps_without_eval_data_is_refused_and_small_eval_sets_work(tmp_path, dataset):
    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError, match="eval_fraction"):
        _run(tiny_config(tmp_path / "a", eval_steps=2), dataset)
    small = type(dataset)(make_tokens(3 * SEQ + 1, seed=2), SEQ)  # 3 samples, micro-batch 4
    result = Trainer(tiny_config(tmp_path / "b", max_steps=2), train_dataset=dataset, eval_dataset=small).train()
    assert result.eval["tokens"] == 3 * SEQ  # evaluated at the end, partial batch included


def test_resume_into_a_new_directory_writes_complete_checkpoints(tmp_path, dataset):
    from shardwise.checkpoint.weights import load_model

    _run(tiny_config(tmp_path / "a", max_steps=2), dataset)
    cfg = tiny_config(tmp_path / "b", max_steps=3)
    result = Trainer(cfg, train_dataset=dataset).train(resume=str(tmp_path / "a" / "run"))
    assert sorted(result.losses) == [3]
    assert (result.last_checkpoint / "config.yaml").is_file()
    model, _ = load_model(result.last_checkpoint)  # usable on its own
    assert model.cfg.num_layers == cfg.model.num_layers


def test_resume_is_exact_with_dropout(tmp_path, dataset):
    full = _run(with_changes(tiny_config(tmp_path / "full", max_steps=4), model={"dropout": 0.1}), dataset)
    cfg = with_changes(tiny_config(tmp_path / "part", max_steps=4, save_steps=2), model={"dropout": 0.1})
    _run(cfg, dataset)
    import shutil

    shutil.rmtree(tmp_path / "part" / "run" / "checkpoints" / "step_00000004")
    resumed = Trainer(cfg, train_dataset=dataset).train(resume="auto")
    assert resumed.losses == {3: full.losses[3], 4: full.losses[4]}


def test_overwrite_keeps_the_old_run_when_the_new_data_is_bad(tmp_path, dataset):
    """--overwrite removes the previous run only once the new run's data has been read: a broken line
    deep in a file must not cost the user the run they had."""
    cfg = tiny_config(tmp_path, max_steps=2)
    _run(cfg, dataset)
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} of the corpus"}}\n' for i in range(300)) + "{broken\n")
    bad = with_changes(cfg, data={"train_files": [str(corpus)], "cache_dir": str(tmp_path / "cache")})
    with pytest.raises(ShardwiseError, match="corpus.jsonl:301"):
        Trainer(bad).train(overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == kept
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_run_larger_than_the_free_memory_is_refused_before_the_data(tmp_path, monkeypatch):
    """On the CPU, a model the machine cannot hold (say a forgotten preset: 7B) fails at once with the
    estimate, instead of preparing the data and then being killed."""
    monkeypatch.setattr(run_dir_module, "available_host_memory", lambda: 2**20)  # 1 MiB free
    cfg = with_changes(tiny_config(tmp_path), data={"train_files": [str(tmp_path / "never-read.jsonl")]})
    with pytest.raises(ConfigError, match=r"needs about .* GiB of memory \(estimate.*0.0 GiB free") as info:
        Trainer(cfg).train()
    assert "model.preset" in str(info.value) and "shardwise estimate" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_phase_hook_follows_a_step(tmp_path, dataset):
    """Tools follow a step through the phase hook (the memory measurement, the out-of-memory report):
    forward and backward per micro-batch, then the optimizer step; a save at the end; eval after it."""
    cfg = with_changes(tiny_config(tmp_path, max_steps=2, save_steps=2),
                       optimize={"gradient_accumulation_steps": 2})
    trainer = Trainer(cfg, train_dataset=dataset, eval_dataset=dataset)
    seen = []
    trainer.add_phase_hook(seen.append)
    trainer.train()
    step = ["forward", "backward", "forward", "backward", "optimizer step"]
    assert seen == step + step + ["checkpoint save", "evaluation"]
    assert set(seen) <= set(trainer_module.PHASES) and trainer.phase == "evaluation"
