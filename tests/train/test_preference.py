"""Preference tuning (data/preference.py, preference.py, train/preference_step.py): the pairs' rows, the
losses against the papers' formulas over transformers' log-probabilities, and training runs whose first
step is ln 2 (the policy is the reference) and whose reward accuracy then rises."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data import load_tokenizer, train_bpe_tokenizer
from shardwise.data.preference import PreferenceDataset
from shardwise.errors import DataError
from shardwise.loss import IGNORE_INDEX
from shardwise.preference import PreferenceObjective, pair_losses, row_logps
from shardwise.train.trainer import Trainer
from tests.train.conftest import read_metrics, tiny_config, with_changes

transformers = pytest.importorskip("transformers")

COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
THINGS = ["apple", "sky", "grass", "sun", "night", "snow", "carrot", "plum"]
TRUE = dict(zip(THINGS, ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]))


def _pairs(n: int, seed: int = 0) -> list[dict]:
    """Questions about colours: the right colour chosen, a wrong one rejected, in the three record shapes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        thing = rng.choice(THINGS)
        wrong = rng.choice([c for c in COLOURS if c != TRUE[thing]])
        question = f"What colour is the {thing}?"
        chosen, rejected = f"The {thing} is {TRUE[thing]}.", f"The {thing} is {wrong}."
        if i % 3 == 0:
            out.append({"prompt": question, "chosen": chosen, "rejected": rejected})
        elif i % 3 == 1:
            out.append({"messages": [{"role": "user", "content": question}], "chosen": [
                {"role": "assistant", "content": chosen}], "rejected": {"role": "assistant", "content": rejected}})
        else:
            out.append({"system": "Answer briefly.", "prompt": question, "chosen": chosen, "rejected": rejected})
    return out


def _write(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pref_tok")
    text = root / "text.txt"
    text.write_text(" ".join(f"What colour is the {t}? The {t} is {c}. Answer briefly." for t in THINGS
                             for c in COLOURS) * 4, encoding="utf-8")
    train_bpe_tokenizer([str(text)], 400, root / "tok", show_progress=False)
    return root / "tok"


def test_rows_hold_the_answers_labels_only(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    records = _pairs(6) + [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                      {"role": "user", "content": "What colour is the sky?"}],
         "chosen": "The sky is blue.", "rejected": "The sky is green."},
    ]
    ds = PreferenceDataset(_write(tmp_path / "p.jsonl", records), tok, 64, template="default")
    assert len(ds) == 7 and ds.stats["pairs"] == 7 and ds.stats["bad_lines"] == 0
    batch = ds.get_batch([0, 6])
    assert batch["input_ids"].shape[0] == 4
    for row in range(4):
        labels = batch["labels"][row]
        trained = labels != IGNORE_INDEX
        text = tok.decode([int(t) for t in labels[trained]])
        answer = records[[0, 6][row // 2]]["chosen" if row % 2 == 0 else "rejected"]
        answer = answer if isinstance(answer, str) else answer[0]["content"]
        assert answer in text and "Hello there" not in text  # the final answer only, not earlier turns
        # the rows of a pair share the prompt: the same tokens up to the answer
    c, r = batch["input_ids"][2], batch["input_ids"][3]
    first = int(torch.nonzero(batch["labels"][2] != IGNORE_INDEX)[0])
    assert torch.equal(c[:first], r[:first])


def test_bad_records_are_named_and_long_prompts_cut_first(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    good = _pairs(3)
    cases = [
        ("not json", "not JSON"),
        ({"prompt": "q", "chosen": "a"}, "'rejected' is missing"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "the same answer"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "b",
          "rejected": "c"}, "ends with a user message"),
        ({"prompt": "q", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}, "assistant message"),
    ]
    for k, (bad, message) in enumerate(cases):
        path = _write(tmp_path / f"bad{k}.jsonl", good + [bad])
        with pytest.raises(DataError, match=rf"bad{k}.jsonl:4: .*{message}"):
            PreferenceDataset(path, tok, 64, template="default")
    skipped = PreferenceDataset(_write(tmp_path / "all.jsonl", good + [c for c, _ in cases]), tok, 64,
                                template="default", on_bad_line="skip")
    assert skipped.stats["bad_lines"] == len(cases) and len(skipped) == 3
    long_prompt = {"prompt": "What colour is the sky? " * 40, "chosen": "The sky is blue.",
                   "rejected": "The sky is green."}
    ds = PreferenceDataset(_write(tmp_path / "long.jsonl", [long_prompt]), tok, 32, template="default")
    assert ds.stats["prompt_truncated"] == 1 and ds.stats["answer_truncated"] == 0
    labels = ds.get_batch([0])["labels"]
    assert ds.get_batch([0])["input_ids"].shape[1] <= 32
    assert "blue" in tok.decode([int(t) for t in labels[0][labels[0] != IGNORE_INDEX]])


def _hf_logps(hf, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-probabilities of the labelled tokens, from transformers' logits (log_softmax and gather)."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits.double(), dim=-1)
    mask = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def _reference_losses(loss: str, pc, pr, rc, rr, nc, nr, beta=0.1, eps=0.0, gamma=0.5, lam=0.1) -> list[float]:
    """The papers' formulas, one pair at a time, in float64 Python."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    out = []
    for i in range(len(pc)):
        if loss == "dpo":
            d = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i]))
            out.append(-(1 - eps) * math.log(sig(d)) - eps * math.log(sig(-d)))
        elif loss == "ipo":
            d = (pc[i] / nc[i] - rc[i] / nc[i]) - (pr[i] / nr[i] - rr[i] / nr[i])
            out.append((d - 1 / (2 * beta)) ** 2)
        elif loss == "simpo":
            d = beta * (pc[i] / nc[i] - pr[i] / nr[i]) - gamma
            out.append(-(1 - eps) * math.log(sig(d)) - eps * math.log(sig(-d)))
        else:  # orpo
            ac, ar = pc[i] / nc[i], pr[i] / nr[i]
            log_odds = (ac - math.log(1 - math.exp(ac))) - (ar - math.log(1 - math.exp(ar)))
            out.append(-ac - lam * math.log(sig(log_odds)))
    return out


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo"])
def test_losses_match_the_formulas_on_transformers_log_probabilities(tmp_path: Path, tokenizer_dir: Path,
                                                                     loss: str) -> None:
    from shardwise.models.hf import from_hf

    tok = load_tokenizer(tokenizer_dir)
    ds = PreferenceDataset(_write(tmp_path / "p.jsonl", _pairs(8)), tok, 48, template="default")
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, attn_implementation="eager")
    torch.manual_seed(0)
    policy_hf, reference_hf = transformers.LlamaForCausalLM(config).eval(), transformers.LlamaForCausalLM(config).eval()
    policy_hf.save_pretrained(tmp_path / "policy")
    ours = from_hf(tmp_path / "policy").eval()
    batch = ds.get_batch(range(8))
    ids, labels = batch["input_ids"], batch["labels"]
    policy, counts = row_logps(ours(ids), labels)
    hf_policy, hf_reference = _hf_logps(policy_hf, ids, labels), _hf_logps(reference_hf, ids, labels)
    assert (policy.double() - hf_policy).abs().max() < 1e-3  # our forward and gather, transformers'
    objective = PreferenceObjective(loss, beta=0.1 if loss != "simpo" else 2.0, label_smoothing=0.1 * (loss != "ipo"))
    got, chosen, rejected = pair_losses(objective, hf_policy.float(), counts, hf_reference.float())
    n = counts.double().tolist()
    want = _reference_losses(loss, hf_policy[0::2].tolist(), hf_policy[1::2].tolist(), hf_reference[0::2].tolist(),
                             hf_reference[1::2].tolist(), n[0::2], n[1::2], beta=objective.beta,
                             eps=objective.label_smoothing)
    assert np.allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-5), (got, want)
    # a wrong pairing (rows swapped) gives other numbers: the test would see it
    swapped, _, _ = pair_losses(objective, hf_policy.float().flip(0), counts.flip(0), hf_reference.float().flip(0))
    assert not np.allclose(swapped.double().numpy(), want, rtol=1e-3)
    # gradients flow to the policy only
    policy.retain_grad()
    pair_losses(objective, policy, counts, hf_reference.float())[0].sum().backward()
    assert policy.grad is not None and policy.grad.abs().sum() > 0


def _preference_run(tmp_path: Path, tokenizer_dir: Path, steps: int, data: dict | None = None, **changes) -> "object":
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = _write(tmp_path / "train.jsonl", _pairs(48))
    held_out = _write(tmp_path / "eval.jsonl", _pairs(12, seed=1))
    cfg = tiny_config(tmp_path, max_steps=steps, micro_batch_size=8, lr=3e-3, eval_steps=steps)
    data = {"kind": "preference", "train_files": [train], "eval_files": [held_out], "tokenizer": str(tokenizer_dir),
            "template": "default", "seq_length": 32, **(data or {})}
    return with_changes(cfg, data=data, **changes)


def test_dpo_starts_at_ln2_and_learns_the_preference(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = _preference_run(tmp_path, tokenizer_dir, 24, preference={"beta": 0.5})
    result = Trainer(cfg).train()
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6  # the policy is the reference at step 1
    assert records[0]["reward_margin"] == 0 and records[0]["reward_accuracy"] == 0
    last = records[-6:]
    # measured: the last six steps' mean loss 0.58, accuracy 0.65; held out 0.632 and 0.67
    assert sum(r["loss"] for r in last) / 6 < math.log(2) - 0.05
    assert sum(r["reward_accuracy"] for r in last) / 6 > 0.55 and all(r["reward_margin"] > 0 for r in last)
    assert result.eval["reward_accuracy"] > 0.55 and result.eval["loss"] < math.log(2)
    assert (tmp_path / "run" / "reference_logps.npz").is_file()


def test_lora_reference_is_the_base_with_adapters_off(tmp_path: Path, tokenizer_dir: Path) -> None:
    cfg = _preference_run(tmp_path, tokenizer_dir, 12, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                          preference={"beta": 0.5}, train={"lr": 1e-2})
    assert cfg.reference_mode() == "adapters_off"
    Trainer(cfg).train()
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6
    assert sum(r["loss"] for r in records[-4:]) / 4 < math.log(2) - 0.02
    assert not (tmp_path / "run" / "reference_logps.npz").exists()  # nothing precomputed, no copy kept
    # the result generates as an SFT run's does: its chat template, the adapters in peft's format
    from shardwise.inference import load_for_generation
    from shardwise.models import generate

    loaded = load_for_generation(tmp_path / "run")
    assert loaded.tuned_template == "default"
    out = generate(loaded.model, [loaded.tokenizer.encode("What colour is the sky?")], max_new_tokens=4)
    assert len(out[0]) > 0
    from shardwise.export import convert_checkpoint

    convert_checkpoint(tmp_path / "run", tmp_path / "adapter", to="peft")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("mode", ["precompute", "frozen_copy", "adapters_off"])
def test_resume_continues_exactly_with_the_starting_reference(tmp_path: Path, tokenizer_dir: Path, mode: str) -> None:
    """The reference stays the starting weights' on a resume: the stored log-probabilities read back, the
    frozen copy taking the starting weights before the checkpoint replaces the policy's, or LoRA's base."""
    import shutil

    from shardwise.checkpoint.storage import list_checkpoints
    from shardwise.errors import TrainingError

    lora = {"lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}} if mode == "adapters_off" else {}
    cfg = _preference_run(tmp_path, tokenizer_dir, 6, train={"save_steps": 3},
                          preference={"precompute_reference": mode == "precompute"}, **lora)
    assert cfg.reference_mode() == mode
    full = Trainer(cfg).train().losses
    run = Path(cfg.train.output_dir)
    newest = list_checkpoints(run)[-1]
    assert newest.name == "step_00000006"
    shutil.rmtree(newest)  # as if the run had stopped after step 3
    resumed = Trainer(cfg).train(resume="auto").losses
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):  # the reference is the starting weights', not the resumed ones'
        assert resumed[step] == pytest.approx(full[step], abs=1e-6, rel=0)
    if mode != "precompute":
        return
    shutil.rmtree(list_checkpoints(run)[-1])
    (run / "reference_logps.npz").unlink()
    with pytest.raises(TrainingError, match="reference_logps.npz cannot be read"):
        Trainer(cfg).train(resume="auto")


def test_a_frozen_copy_reference_trains_as_the_precomputed_one(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Both references are the starting weights: the losses agree step for step; and a reference-free loss
    (SimPO) needs neither."""
    precomputed = _preference_run(tmp_path / "pre", tokenizer_dir, 4)
    frozen = _preference_run(tmp_path / "copy", tokenizer_dir, 4, preference={"precompute_reference": False})
    assert (precomputed.reference_mode(), frozen.reference_mode()) == ("precompute", "frozen_copy")
    a, b = Trainer(precomputed).train().losses, Trainer(frozen).train().losses
    assert a[1] == pytest.approx(math.log(2), abs=1e-6)
    assert [b[s] for s in sorted(b)] == pytest.approx([a[s] for s in sorted(a)], abs=1e-5)
    simpo = _preference_run(tmp_path / "simpo", tokenizer_dir, 4, preference={"loss": "simpo", "beta": 2.0})
    assert simpo.reference_mode() is None
    losses = Trainer(simpo).train().losses
    assert all(math.isfinite(v) for v in losses.values())
    assert not (tmp_path / "simpo" / "run" / "reference_logps.npz").exists()


def test_qlora_reference_is_the_quantised_base_with_adapters_off(tmp_path: Path, tokenizer_dir: Path) -> None:
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "quantize_base": "nf4"}
    cfg = _preference_run(tmp_path, tokenizer_dir, 8, lora=lora, preference={"beta": 0.5}, train={"lr": 1e-2})
    losses = Trainer(cfg).train().losses
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6)  # the NF4 base with adapters off is the policy
    assert sum(losses[s] for s in (5, 6, 7, 8)) / 4 < math.log(2)


def test_dpo_on_a_mixture_of_experts_model(tmp_path: Path, tokenizer_dir: Path) -> None:
    from shardwise.resolve import resolve_config

    raw = _preference_run(tmp_path, tokenizer_dir, 4).model_dump()
    raw["model"] = {"preset": "tiny_qwen3_moe"}
    cfg = resolve_config(raw)
    assert cfg.model.num_experts == 16
    losses = Trainer(cfg).train().losses
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6)  # routing is the same for the reference pass
    assert all(math.isfinite(v) for v in losses.values())


@pytest.mark.parametrize("parallel, multiple", [
    ({"tensor_parallel": 2, "sequence_parallel": True}, 2),
    ({"context_parallel": 2}, 2),
    ({"context_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True}, 4),
])
def test_a_batch_width_the_layout_cannot_split_is_refused_by_name(tmp_path: Path, tokenizer_dir: Path,
                                                                  parallel: dict, multiple: int) -> None:
    """Preference batches are as wide as their longest row rounded up to data.pad_to_multiple_of: the rows'
    split over sequence-parallel and context-parallel ranks needs that multiple, and the message names it."""
    with pytest.raises(Exception, match=f"pad_to_multiple_of to a multiple of {multiple}"):
        _preference_run(tmp_path, tokenizer_dir, 2, parallel=parallel, data={"pad_to_multiple_of": 1})
    cfg = _preference_run(tmp_path, tokenizer_dir, 2, parallel=parallel, data={"pad_to_multiple_of": 8})
    assert cfg.parallel.context_parallel == parallel.get("context_parallel", 1)


def test_the_lora_reference_pass_does_not_count_in_the_expert_load(tmp_path: Path, tokenizer_dir: Path) -> None:
    """With LoRA the reference pass runs the policy's own modules (adapters off) in training mode: its routing
    must not count in the load that moves the routers' correction bias, only the policy's forward does."""
    from shardwise.builder import build_run_model
    from shardwise.models.moe import take_expert_load
    from shardwise.resolve import resolve_config
    from shardwise.train.preference_step import PreferenceTuning

    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    raw = _preference_run(tmp_path, tokenizer_dir, 2, lora=lora).model_dump()
    raw["model"] = {"preset": "tiny_qwen3_moe", "router_bias": True, "moe_bias_update_rate": 0.01}
    cfg = resolve_config(raw)
    assert cfg.reference_mode() == "adapters_off"
    model = build_run_model(cfg, "cpu").train()
    data = PreferenceDataset(cfg.data.train_files, load_tokenizer(tokenizer_dir), 32, template="default")
    mb = data.get_batch([0, 1, 2])
    PreferenceTuning(cfg).micro_loss(model, mb, mb["input_ids"], mb["labels"], torch.device("cpu"))
    routed = mb["input_ids"].numel() * cfg.model.num_experts_per_tok  # one forward's copies per MoE block
    load = take_expert_load(model)
    assert load and all(float(counts.sum()) == routed for counts in load.values())


def test_the_step_time_model_counts_the_reference_forward_as_its_own_part(tmp_path: Path, tokenizer_dir: Path) -> None:
    """LoRA's reference (adapters off) is one more forward, no gradient: the planner shows it as `reference`,
    beside compute and recompute, which stay as with a precomputed reference (none per step)."""
    from shardwise.hardware import get_hardware
    from shardwise.step_time import predict_step

    lora = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    online = _preference_run(tmp_path, tokenizer_dir, 2, lora=lora)
    stored = _preference_run(tmp_path, tokenizer_dir, 2, lora=lora, preference={"precompute_reference": True})
    assert (online.reference_mode(), stored.reference_mode()) == ("adapters_off", "precompute")
    h100 = get_hardware("H100")
    a, b = predict_step(online, 1, h100), predict_step(stored, 1, h100)
    assert b.reference == 0 < a.reference < a.compute
    assert (a.compute, a.recompute) == (b.compute, b.recompute)
    assert a.total > b.total


def test_a_global_batch_in_pairs_is_estimated_in_rows(tmp_path: Path, tokenizer_dir: Path) -> None:
    """train.global_batch_size counts pairs as micro_batch_size does: the estimate (and the planner, which
    calls it per layout) counts both in rows, not twice the micro-batch against the pairs' global batch."""
    from shardwise.memory.estimate import estimate_memory

    set_batch = _preference_run(tmp_path, tokenizer_dir, 2, train={"global_batch_size": 16})  # 8 pairs x 2
    derived = _preference_run(tmp_path, tokenizer_dir, 2, optimize={"gradient_accumulation_steps": 2})
    assert set_batch.gradient_accumulation(1) == derived.gradient_accumulation(1) == 2
    assert estimate_memory(set_batch, 1, "cuda").peak == estimate_memory(derived, 1, "cuda").peak
