import numpy as np
import pytest
import torch
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.cli import main
from shardwise.data.packing import PackedDataset
from shardwise.errors import ConfigError
from shardwise.hardware import get_hardware
from shardwise.memory.auto_recompute import choose_recompute_layers, with_recompute_layers
from shardwise.memory.estimate import estimate_all_ranks, run_flops, trainable_shapes
from shardwise.models import build_model, resolve_model_config
from shardwise.parallel.recompute import (
    apply_recompute,
    canonical_name,
    every_other_matmul,
    keeps_down_output,
    selective_saved_matmuls,
)
from shardwise.parallel.tensor import apply_tensor_parallel, full_grads
from shardwise.peft.lora import apply_lora
from shardwise.plan import PlanRequest, plan, workload_config
from shardwise.resolve import resolve_config
from shardwise.step_time import rank_loads, selective_recompute_flops
from shardwise.train import trainer as trainer_module
from shardwise.train.trainer import Trainer

from .harness import assert_tensors_close, run_distributed


def _grads_and_calls(mode, every: int = 1, dropout: float = 0.0):
    torch.manual_seed(0)
    model = build_model(resolve_model_config({"preset": "tiny_llama", "num_layers": 4, "dropout": dropout}))
    calls = {name: 0 for name in model.layers}
    for name, block in model.layers.items():
        block.feed_forward.w1.register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    wrapped = apply_recompute(model, mode, every)
    torch.manual_seed(1)  # the dropout masks
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    grads = {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, calls, wrapped


def test_recompute_modes_keep_gradients_and_recompute_what_they_say():
    ref_loss, ref_grads, calls, wrapped = _grads_and_calls("none")
    assert wrapped == [] and set(calls.values()) == {1}
    for mode, every, expected_wrapped in (("full", 1, ["0", "1", "2", "3"]), ("full", 2, ["0", "2"]),
                                          ("selective", 1, ["0", "1", "2", "3"]),
                                          (["full", "selective", "none", "selective"], 1, ["0", "1", "3"])):
        loss, grads, calls, wrapped = _grads_and_calls(mode, every)
        assert wrapped == expected_wrapped
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert grads.keys() == ref_grads.keys()
        assert_tensors_close(grads, ref_grads, rtol=1e-6, label=f"recompute {mode}")
        for name, n in calls.items():
            # a recomputed block runs its forward again in backward
            assert n == (2 if name in wrapped else 1), (mode, every, name)


def test_recompute_replays_dropout():
    """Dropout in attention, residuals and the MLP: recomputed blocks draw the same masks (RNG state kept)."""
    ref_loss, ref_grads, _, _ = _grads_and_calls("none", dropout=0.2)
    for mode in ("selective", "full", ["selective", "none", "full", "selective"]):
        loss, grads, _, _ = _grads_and_calls(mode, dropout=0.2)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert_tensors_close(grads, ref_grads, rtol=1e-6, label=f"dropout, recompute {mode}")


def _forward_decisions(block, x, rope):
    """(op, decision) of every matmul the selective policy meets in one block's forward."""
    shapes = {(p.shape[1], p.shape[0]) for n, p in block.named_parameters() if ".lora_" in n}
    policy = every_other_matmul(shapes, keeps_down_output(block))
    seen = []

    def recording(ctx, op, *args, **kwargs):  # noqa: ANN001
        decision = policy(ctx, op, *args, **kwargs)
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and not ctx.is_recompute:
            rhs = args[2 if op == torch.ops.aten.addmm.default else 1].shape
            seen.append((tuple(rhs), decision == CheckpointPolicy.MUST_SAVE))
        return decision

    out = checkpoint(block, x, rope, None, True, None, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(recording))
    out.sum().backward()
    return seen


def test_selective_keeps_every_other_block_matmul_and_recomputes_lora():
    cfg = resolve_model_config({"preset": "tiny_llama", "num_layers": 1})
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    x = torch.randn(2, 8, h, requires_grad=True)
    rope = (torch.ones(1, 8, 1, cfg.head_dim), torch.zeros(1, 8, 1, cfg.head_dim))
    model = build_model(cfg)
    block_shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]  # q, k, v, o, gate, up, down
    # The 1st, 3rd and 5th; not the down projection (the 7th): backward never needs its output.
    expected = [(s, i % 2 == 0 and i < 6) for i, s in enumerate(block_shapes)]
    assert _forward_decisions(model.layers["0"], x, rope) == expected
    assert selective_saved_matmuls(True) == ("wq", "wv", "w1")
    assert selective_saved_matmuls(True, down_reached=True) == ("wq", "wv", "w1", "w2")
    assert selective_saved_matmuls(False) == ("wq", "wv", "w1")
    # LoRA on q and o: their rank-r matmuls are recomputed and leave the base ones' alternation alone.
    apply_lora(model, 4, 8.0, 0.0, ["attention.wq", "attention.wo"])
    seen = _forward_decisions(model.layers["0"], x, rope)
    r = 4
    assert [(s, saved) for s, saved in seen if r not in s] == expected
    assert [saved for s, saved in seen if r in s] == [False] * 4
    # LoRA on the down projection: the recompute runs past it, so its output is kept after all.
    model = build_model(cfg)
    apply_lora(model, 4, 8.0, 0.0, ["feed_forward.w2"])
    seen = _forward_decisions(model.layers["0"], x, rope)
    assert [(s, saved) for s, saved in seen if r not in s] == [(s, i % 2 == 0) for i, s in enumerate(block_shapes)]


def _tp_selective(rank: int, world: int) -> list:
    mesh = init_device_mesh("cpu", (world,))
    cfg = resolve_model_config({"preset": "tiny_llama", "num_layers": 2, "dropout": 0.1})
    out = []
    for mode in ("none", "selective", ["selective", "full"]):
        torch.manual_seed(0)
        model = build_model(cfg)
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
        apply_recompute(model, mode)
        torch.manual_seed(5 + rank)
        tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
        logits = model(tokens)
        loss = logits.full_tensor().logsumexp(-1).mean() if hasattr(logits, "full_tensor") else \
            logits.logsumexp(-1).mean()
        loss.backward()
        out.append((loss.item(), {canonical_name(n): None if g is None else g.clone() for n, g in full_grads(model)}))
    return out


def test_selective_under_tensor_parallel_with_dropout_matches_no_recompute():
    for per_rank in run_distributed(_tp_selective, 2):
        (ref_loss, ref), *others = per_rank
        for loss, grads in others:
            assert loss == pytest.approx(ref_loss, rel=1e-6)
            assert_tensors_close(grads, ref, rtol=1e-6, label="TP2 SP selective")


def test_recompute_keeps_state_dict_names():
    model = build_model(resolve_model_config({"preset": "tiny_llama"}))
    names = set(model.state_dict())
    apply_recompute(model, "full")
    assert set(model.state_dict()) == names


def _run_config(tmp_path, **optimize):
    return resolve_config({
        "model": {"preset": "demo_llama", "vocab_size": 1024}, "data": {"seq_length": 128},
        "optimize": optimize, "run": {"device": "cpu", "num_threads": 1},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "micro_batch_size": 4, "progress_bar": False,
                  "tensorboard": False, "peak_tflops": 1.0}})


def test_recompute_layers_belong_to_auto_and_to_every_layer(tmp_path):
    with pytest.raises(ConfigError, match="recompute: auto"):
        _run_config(tmp_path, recompute="full", recompute_layers=["none"] * 4)
    with pytest.raises(ConfigError, match="3 entries for model.num_layers 4"):
        _run_config(tmp_path, recompute="auto", recompute_layers=["none"] * 3)
    with pytest.raises(ConfigError, match="no per-layer plan"):
        _run_config(tmp_path, recompute="auto").optimize.layer_recompute([0])


def _peak(cfg, plan, devices=1):
    return [e.peak for e in estimate_all_ranks(with_recompute_layers(cfg, plan), devices, "cpu")]


def test_auto_takes_the_least_recompute_that_fits(tmp_path):
    cfg = _run_config(tmp_path, recompute="auto")
    none, sel, full = (_peak(cfg, [m] * 4)[0] for m in ("none", "selective", "full"))
    assert none > sel > full
    assert choose_recompute_layers(cfg, 1, "cpu", none) == ["none"] * 4
    # Between none and all-selective: bottom layers selective first, and one step fewer would not fit.
    budget = (none + sel) // 2
    plan = choose_recompute_layers(cfg, 1, "cpu", budget)
    k = plan.count("selective")
    assert plan == ["selective"] * k + ["none"] * (4 - k) and 0 < k < 4
    assert _peak(cfg, plan)[0] <= budget < _peak(cfg, ["selective"] * (k - 1) + ["none"] * (5 - k))[0]
    plan = choose_recompute_layers(cfg, 1, "cpu", (sel + full) // 2)
    assert "none" not in plan and plan[0] == "full" and plan[-1] == "selective"
    with pytest.raises(ConfigError, match="even full recompute"):
        choose_recompute_layers(cfg, 1, "cpu", full - 1)


def test_auto_gives_the_first_pipeline_stage_more_recompute(tmp_path):
    cfg = _run_config(tmp_path, recompute="auto")
    raw = cfg.model_dump(mode="json")
    raw["parallel"].update(pipeline_parallel=2, micro_batch_num=4, schedule="1f1b")
    raw["train"]["micro_batch_size"] = 2
    cfg = resolve_config(raw)
    none = _peak(cfg, ["none"] * 4, 2)
    budget = int(min(none) * 0.97)
    plan = choose_recompute_layers(cfg, 2, "cpu", budget)
    steps = [sum({"none": 0, "selective": 1, "full": 2}[m] for m in half) for half in (plan[:2], plan[2:])]
    assert steps[0] >= steps[1] and max(_peak(cfg, plan, 2)) <= budget


def test_trainer_resolves_auto_before_building_and_records_the_plan(tmp_path, monkeypatch):
    cfg = _run_config(tmp_path, recompute="auto")
    sel = _peak(cfg, ["selective"] * 4)[0]
    monkeypatch.setattr(trainer_module, "available_host_memory", lambda: int(sel / 0.9) + 1)
    tokens = np.random.default_rng(0).integers(0, 1024, size=128 * 4 * 4 + 1).astype(np.int64)
    trainer = Trainer(cfg, train_dataset=PackedDataset(tokens, 128))
    trainer.train(overwrite=True)
    plan = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["optimize"]["recompute_layers"]
    assert "selective" in plan and _peak(cfg, plan)[0] <= sel < _peak(cfg, ["none"] * 4)[0]
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in trainer.model_parts[0].layers.values()]
    assert wrapped == [mode != "none" for mode in plan]


def test_selective_recompute_flops_count_the_matmuls_it_runs_again(tmp_path):
    cfg = _run_config(tmp_path, recompute="selective")
    m = cfg.model
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    # k, o and the up projection (the down projection is kept and never reached); q, v, gate are kept.
    assert selective_recompute_flops(cfg, 0, {}) == 2 * (h * kv + q * h + h * f)
    lora = resolve_config({**cfg.model_dump(mode="json"), "lora": {"r": 8, "target_modules": ["q_proj", "o_proj"]}})
    shapes = trainable_shapes(lora)
    assert selective_recompute_flops(lora, 1, shapes) == 2 * (h * kv + q * h + h * f) + 2 * 8 * (h + q + q + h)
    loads = {mode: rank_loads(resolve_config({**cfg.model_dump(mode="json"), "optimize": {"recompute": mode}}))[0]
             for mode in ("none", "selective", "full")}
    assert loads["none"].recompute_flops_per_token == 0
    assert loads["selective"].recompute_flops_per_token == 4 * selective_recompute_flops(cfg, 0, {})
    assert loads["full"].recompute_flops_per_token == pytest.approx(sum(run_flops(cfg).layers_forward))


def test_the_planner_ranks_auto_plans_that_fit():
    hw = get_hardware("H100")
    cfg = workload_config(model="llama3_8b", seq_length=8192, global_batch=32, devices=8, hardware=hw)
    req = PlanRequest(cfg=cfg, devices=8, hardware=hw, memory_margin=0.4,
                      pins={"recompute": ["auto"], "tp": [1], "pp": [1], "zero": [3]})
    result = plan(req)
    assert result.ranked
    for c in result.ranked:
        layers = c.cfg.optimize.recompute_layers
        assert c.layout.recompute == "auto" and len(layers) == 32 and c.peak <= c.usable
    assert any("selective" in c.cfg.optimize.recompute_layers for c in result.ranked)


def test_estimate_command_plans_auto_for_the_memory_given(capsys):
    args = ["estimate", "--model", "tiny_llama", "--seq-length", "64", "--recompute", "auto", "--device", "cpu"]
    assert main(args + ["--memory-gib", "100"]) == 0
    assert "recompute auto: layers 0-1 none" in capsys.readouterr().out
    assert main(args + ["--memory-gib", "0.001"]) == 2
    assert "even full recompute of every layer" in capsys.readouterr().err
