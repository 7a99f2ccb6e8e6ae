"""Tensor parallel (+ sequence parallel, loss parallel) against one process, on 2 forked gloo ranks.

One launch runs every variant (each launch costs seconds of `import torch` and process start); each
variant reports its own result, and the parametrized tests below read them. Every variant trains
the same tiny model twice inside each worker: once plain (the reference, no communication) and
once tensor-parallel, comparing strictly (harness.py, fp32): every parameter's first-step gradient
within 1e-5 relative per tensor (TP splits the matmul reductions: measured <= 8.7e-7), the loss and
the gradient norm of each of 5 steps with clipping within 5e-6 relative (measured <= ~2e-7; plain
SGD, and AdamW's first step, see ADAMW_LATER_RTOL), and the parameters after the last SGD step
(relative to their update).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import traceback

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.loss import token_loss_sum
from shardwise.models.config import ModelConfig
from shardwise.parallel.tensor import check_tensor_parallel

from .harness import (
    GRAD_RTOL,
    SCALAR_RTOL,
    assert_params_close,
    assert_tensors_close,
    assert_values_close,
)

STEPS = 5
BATCH, SEQ = 2, 16

BASE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
            max_position_embeddings=64)
LLAMA = dict(BASE)
QWEN2 = dict(BASE, model_type="qwen2", qkv_bias=True)
QWEN3 = dict(BASE, model_type="qwen3", qk_norm=True, head_dim=16)
# Gemma 3's parts: norms after attention and MLP scaling by 1 + weight, q/k norms, scaled embeddings, a
# window of 6 in block 0 (block 1 global, RoPE of its own base), tied embeddings, gelu.
GEMMA3 = dict(BASE, model_type="gemma3", qk_norm=True, sandwich_norm=True, norm_unit_offset=True,
              scale_embeddings=True, attention_scale=0.3, sliding_window=6, full_attention_every=2,
              rope_local_theta=100.0, tie_embeddings=True, activation="gelu_tanh")
GPT2 = dict(BASE, model_type="gpt2", num_kv_heads=4, norm="layernorm", mlp="plain", activation="gelu_tanh",
            position="learned", qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True)

# name -> (model config, options). loss: "tp" = shardwise.loss.token_loss_sum on sharded logits; "ctx" = the
# trainer's own token_loss_sum inside loss_context (backward inside too); packed: document_ids + position_ids.
# opt: plain SGD by default, so that parameters after the last step are compared too (a gradient
# error is then a parameter error of the same relative size); two variants run AdamW (foreach, on
# DTensor state), whose later steps amplify round-off (see ADAMW_LATER_RTOL).
VARIANTS = {
    "llama_gqa_sp_adamw": (LLAMA, dict(sp=True, lp=True, loss="tp", packed=False, opt="adamw")),
    "llama_gqa_sp_trainer_loss_ctx": (LLAMA, dict(sp=True, lp=True, loss="ctx", packed=False)),
    "llama_gqa_sp_packed": (LLAMA, dict(sp=True, lp=True, loss="tp", packed=True)),
    "qwen2_qkv_bias_sp_packed": (QWEN2, dict(sp=True, lp=True, loss="ctx", packed=True)),
    "qwen3_qk_norm_sp": (QWEN3, dict(sp=True, lp=True, loss="tp", packed=False)),
    "gemma3_sandwich_sliding_sp_packed": (GEMMA3, dict(sp=True, lp=True, loss="ctx", packed=True)),
    "gemma3_no_sp": (GEMMA3, dict(sp=False, lp=True, loss="tp", packed=False)),
    "gpt2_tied_learned_pos_layernorm_sp_packed": (GPT2, dict(sp=True, lp=True, loss="tp", packed=True)),
    "gpt2_tied_sp_trainer_loss_ctx": (GPT2, dict(sp=True, lp=True, loss="ctx", packed=False)),
    "llama_gqa_no_sp_packed": (LLAMA, dict(sp=False, lp=True, loss="tp", packed=True)),
    "qwen2_no_sp_no_loss_parallel_adamw": (QWEN2, dict(sp=False, lp=False, loss="tp", packed=False, opt="adamw")),
    "gpt2_tied_no_sp": (GPT2, dict(sp=False, lp=True, loss="ctx", packed=True)),
    "llama_sp_no_loss_parallel": (LLAMA, dict(sp=True, lp=False, loss="tp", packed=False)),
    # a vocabulary not divisible by 2 (GPT-2's 50257): DTensor shards it unevenly.
    "llama_uneven_vocab_sp_packed": (dict(LLAMA, vocab_size=63), dict(sp=True, lp=True, loss="tp", packed=True)),
    # the trainer's order: tensor parallel, then recompute
    "llama_gqa_sp_recompute_full": (LLAMA, dict(sp=True, lp=True, loss="tp", packed=True, recompute="full")),
    "qwen2_sp_recompute_selective": (QWEN2, dict(sp=True, lp=True, loss="ctx", packed=True, recompute="selective")),
    "llama_uneven_vocab_trainer_loss_ctx": (dict(LLAMA, vocab_size=63),
                                            dict(sp=True, lp=True, loss="ctx", packed=False)),
}
# AdamW after its first step. Its update lr * g / (|g| + eps) changes by up to lr * dg / eps for a
# gradient element near zero, so the ~1e-10 absolute round-off by which TP's gradients differ on
# such elements (eps = 1e-8) becomes a parameter difference of ~1e-4 (measured: one element of
# layers.0.attention.wo after step 1), which later losses and gradient norms show: measured 8.0e-6
# (loss, step 3) and 3.3e-4 (gradient norm, step 3). Plain SGD on the same layouts stays at ~1e-7
# every step, and every variant's first step is compared strictly, so later AdamW steps are compared
# within ~10x of what they reach.
ADAMW_LATER_RTOL = {"loss": 1e-4, "grad norm": 3e-3}
CHECKS = ["pipeline_stages_sp", "pipeline_stages_no_sp", "loss_functions_match_unsharded", "dropout_sp",
          "dropout_no_sp", "dropout_sp_recompute_replays_masks", "refusals", "eval_with_dropout_config_matches"]


# --- worker side ------------------------------------------------------------------------------------


def _batch(cfg: ModelConfig, packed: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100
    labels[1, -2:] = -100
    extras: dict = {}
    if packed:
        # Row 0: documents of 5, 7, 4 tokens; row 1: 9 and 7. Positions restart per document.
        docs = [[5, 7, 4], [9, 7]]
        doc_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        pos = torch.zeros(BATCH, SEQ, dtype=torch.long)
        for b, lens in enumerate(docs):
            start = 0
            for d, n in enumerate(lens):
                doc_ids[b, start:start + n] = d
                pos[b, start:start + n] = torch.arange(n)
                start += n
        extras = {"document_ids": doc_ids, "position_ids": pos}
    return ids, labels, extras


def _named(model: torch.nn.Module) -> list:
    """named_parameters under the plain names (without recompute wrappers' prefixes)."""
    from shardwise.parallel.recompute import canonical_name

    return [(canonical_name(n), p) for n, p in model.named_parameters()]


def _close(got: float, want: float, what: str, rtol: float = SCALAR_RTOL) -> None:
    """One scalar (a loss) within `rtol` relative error of the unsharded one."""
    assert_values_close([float(got)], [float(want)], rtol=rtol, what=what)


def _parity(mesh, cfg_dict: dict, sp: bool, lp: bool, loss: str, packed: bool, opt: str = "sgd",
            recompute: str = "none", label: str = "") -> None:
    from torch.distributed.tensor import DTensor

    from shardwise.loss import count_target_tokens, token_loss_sum
    from shardwise.models import build_model
    from shardwise.parallel.recompute import canonical_name
    from shardwise.parallel.tensor import apply_tensor_parallel, full_grads, full_value, loss_context
    from shardwise.train.optim import build_optimizer

    cfg = ModelConfig(**cfg_dict)
    torch.manual_seed(0)
    ref = build_model(cfg)
    tp_model = copy.deepcopy(ref)
    apply_tensor_parallel(tp_model, mesh, sequence_parallel=sp, loss_parallel=lp)
    if recompute != "none":
        from shardwise.parallel.recompute import apply_recompute

        assert apply_recompute(tp_model, recompute)
    assert all(isinstance(p, DTensor) for p in tp_model.parameters())
    if cfg.tie_embeddings:
        assert tp_model.output.weight is tp_model.tok_embeddings.weight
    lr = 1e-2 if opt == "adamw" else 3e-1
    # SGD: plain (no momentum, no decay), so a gradient error is a parameter error of the same size.
    opts = [build_optimizer(_named(m), opt, lr=lr, weight_decay=0.1 if opt == "adamw" else 0.0,
                            betas=(0.9 if opt == "adamw" else 0.0, 0.95), eps=1e-8)
            for m in (ref, tp_model)]
    initial = {n: p.detach().clone() for n, p in _named(ref)}
    losses: list[list[float]] = [[], []]
    norms_by_step: list[list[float]] = [[], []]
    for step in range(STEPS):
        ids, labels, extras = _batch(cfg, packed, seed=100 + step)
        n_tokens = count_target_tokens([{"labels": labels}])
        # reference
        ref_loss = token_loss_sum(ref(ids, **extras), labels) / n_tokens
        ref_loss.backward()
        # tensor parallel, as the trainer would run it
        if loss == "ctx":
            with loss_context(lp):
                logits = tp_model(ids, **extras)
                assert isinstance(logits, DTensor) == lp
                tp_loss = token_loss_sum(logits, labels) / n_tokens
                tp_loss.backward()
            tp_loss = full_value(tp_loss)
        else:
            tp_loss = token_loss_sum(tp_model(ids, **extras), labels) / n_tokens
            assert not isinstance(tp_loss, DTensor)
            tp_loss.backward()
        losses[0].append(float(ref_loss))
        losses[1].append(float(tp_loss))
        if step == 0:
            # No gradient is left a Partial sum (the norms' under sequence parallel are all-reduced in backward:
            # torch 2.11's foreach clipping would not scale them).
            partial = [n for n, p in tp_model.named_parameters()
                       if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
            assert not partial, partial
            ref_grads = {n: p.grad for n, p in _named(ref)}
            tp_grads = {canonical_name(n): g for n, g in full_grads(tp_model)}
            assert all(g is not None for g in ref_grads.values())
            assert_tensors_close(tp_grads, ref_grads, rtol=GRAD_RTOL, label=label)  # names, shapes, values
        norms = []
        for m, optimizer in zip((ref, tp_model), opts):
            norm = torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.5, foreach=True)
            norms.append(float(full_value(norm)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for i, n in enumerate(norms):
            norms_by_step[i].append(n)
        assert norms[0] > 0.5, "clipping is not exercised"
    for i, what in enumerate(("loss", "grad norm")):
        got, want = (losses, norms_by_step)[i]
        assert_values_close(got[:1], want[:1], what=what, label=label)  # the first step: strict
        assert_values_close(got[1:], want[1:], rtol=SCALAR_RTOL if opt == "sgd" else ADAMW_LATER_RTOL[what],
                            what=f"{what} after step 1", label=label)
    if opt == "sgd":
        got = {canonical_name(n): full_value(q.data) for n, q in tp_model.named_parameters()}
        assert_params_close(got, {n: p.detach() for n, p in _named(ref)}, initial, STEPS, label=label)


def _pipeline_stages(mesh, sp: bool) -> None:
    """Two pipeline-like stages (the first without norm/output, the second without embeddings, as
    the pipeline helper cuts them), each tensor-parallel, run one after the other: same loss and
    gradients as the whole model. With SP the hidden states between them are sequence-shards."""
    from shardwise.loss import token_loss_sum
    from shardwise.models import build_model
    from shardwise.parallel.tensor import apply_tensor_parallel, full_grads

    for cfg_dict, packed in ((LLAMA, False), (GPT2, True)):
        cfg = ModelConfig(**dict(cfg_dict, num_layers=2))
        torch.manual_seed(0)
        ref = build_model(cfg)
        first, second = copy.deepcopy(ref), copy.deepcopy(ref)
        del first.layers["1"]
        first.norm = first.output = None
        del second.layers["0"]
        second.tok_embeddings = second.pos_embeddings = None
        for stage in (first, second):
            apply_tensor_parallel(stage, mesh, sequence_parallel=sp)
        ids, labels, extras = _batch(cfg, packed, seed=7)
        a = token_loss_sum(ref(ids, **extras), labels)
        a.backward()
        h = first(ids, **extras)
        assert h.shape[1] == (SEQ // 2 if sp else SEQ)
        b = token_loss_sum(second(h, **extras), labels)  # extras may hold position_ids or not
        b.backward()
        _close(b, a, "loss of the chained stages")
        grads = dict(full_grads(first))
        for name, g in full_grads(second):
            # tied: each stage holds its own copy of the shared matrix; their gradients add up
            tied_name = "tok_embeddings.weight" if cfg.tie_embeddings and name == "output.weight" else name
            grads[tied_name] = grads[tied_name] + g if tied_name in grads else g
        assert_tensors_close(grads, {n: p.grad for n, p in ref.named_parameters()}, label="chained stages")
        # no extras: the later stage must rebuild the full sequence's positions itself
        ref.zero_grad()
        a = token_loss_sum(ref(ids), labels)
        b = token_loss_sum(second(first(ids)), labels)
        _close(b, a, "loss of the chained stages with default positions")


def _loss_functions(mesh) -> None:
    """The trainer's loss (flatten, .float(), ignore_index, sum) under loss_context, and
    token_loss_sum, on vocab-sharded logits: value and gradient equal the unsharded ones."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from shardwise.loss import token_loss_sum
    from shardwise.parallel.tensor import full_value, loss_context

    for vocab in (64, 63):
        g = torch.Generator().manual_seed(vocab)
        full = torch.randn(2, 8, vocab, generator=g) * 3
        labels = torch.randint(0, vocab, (2, 8), generator=g)
        labels[0, 0] = labels[1, 5] = -100
        labels[1, 2] = vocab - 1  # a target in the last (possibly short) shard
        ref_in = full.clone().requires_grad_()
        ref = token_loss_sum(ref_in, labels)
        ref.backward()
        for kind in ("ctx", "tp", "tp_plain", "tp_replicated"):
            if kind == "tp_plain":
                x = full.clone().requires_grad_()
            else:
                x = distribute_tensor(full.clone(), mesh, [Shard(2)] if kind != "tp_replicated" else None)
                x.requires_grad_()
            if kind == "ctx":
                with loss_context(True):
                    out = token_loss_sum(x, labels)
                    out.backward()
                assert not isinstance(out, DTensor)  # the trainer's loss goes shard-wise by itself
            else:
                out = token_loss_sum(x, labels)
                assert not isinstance(out, DTensor)
                out.backward()
            grad = full_value(x.grad)
            _close(full_value(out), ref, f"loss, vocab {vocab}, {kind}")
            assert_tensors_close({"logits": grad}, {"logits": ref_in.grad}, label=f"vocab {vocab}, {kind}")


def _dropout(mesh, sp: bool) -> None:
    """With dropout, TP trains (finite, consistent replicas); with SP each rank masks its own shard
    with its own RNG stream (same-stream masks would repeat across the sequence shards)."""
    import torch.distributed as dist

    from shardwise.models import build_model
    from shardwise.parallel.tensor import apply_tensor_parallel
    from shardwise.train.optim import build_optimizer

    cfg = ModelConfig(**dict(LLAMA, dropout=0.3))
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_tensor_parallel(model, mesh, sequence_parallel=sp)
    model.train()
    masks = []
    model.emb_dropout.register_forward_hook(lambda m, i, o: masks.append((o == 0).flatten()))
    opt = build_optimizer(model.named_parameters(), "adamw", lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    shared_before = torch.get_rng_state()
    for step in range(2):
        ids, labels, _ = _batch(cfg, False, seed=step)
        loss = token_loss_sum(model(ids), labels) / 20
        assert torch.isfinite(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
    # The shared stream is the same on every rank (data order, later init, anything else uses it).
    state = torch.get_rng_state()
    gathered = [torch.empty_like(state) for _ in range(mesh.size())]
    dist.all_gather(gathered, state, group=mesh.get_group())
    assert all(torch.equal(gathered[0], s) for s in gathered)
    if sp:
        assert torch.equal(shared_before, state), "the training forward consumed the shared RNG stream"
    # Replicated parameters stayed identical across ranks.
    for name, p in model.named_parameters():
        loc = p.to_local().detach().contiguous()
        gathered = [torch.empty_like(loc) for _ in range(mesh.size())]
        dist.all_gather(gathered, loc, group=mesh.get_group())
        if p.placements[0].is_replicate():
            assert all(torch.equal(gathered[0], x) for x in gathered), f"{name} diverged across TP ranks"
    mask = masks[0].to(torch.uint8)
    gathered = [torch.empty_like(mask) for _ in range(mesh.size())]
    dist.all_gather(gathered, mask, group=mesh.get_group())
    if sp:
        assert not torch.equal(gathered[0], gathered[1]), "sequence shards got the same dropout mask"
    else:
        # replicated activations must get the same mask on every rank
        assert torch.equal(gathered[0], gathered[1]), "replicated activations got different dropout masks"


def _dropout_recompute(mesh) -> None:
    """Recompute replays the per-rank dropout masks: the same TP+SP model with and without full
    recompute gives the same loss and gradients."""
    from shardwise.models import build_model
    from shardwise.parallel.recompute import apply_recompute, canonical_name
    from shardwise.parallel.tensor import apply_tensor_parallel, full_grads

    cfg = ModelConfig(**dict(LLAMA, dropout=0.3))
    results = []
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = build_model(cfg)
        apply_tensor_parallel(model, mesh)
        apply_recompute(model, mode)
        model.train()
        ids, labels, extras = _batch(cfg, True, seed=3)
        loss = token_loss_sum(model(ids, **extras), labels)
        loss.backward()
        results.append((float(loss), {canonical_name(n): g for n, g in full_grads(model)}))
    _close(results[1][0], results[0][0], "loss with recompute")
    assert_tensors_close(results[1][1], results[0][1], label="TP + SP with dropout, recompute vs not")


def _eval_with_dropout(mesh) -> None:
    """A model configured with dropout, in eval mode, matches one process exactly."""
    from shardwise.loss import token_loss_sum
    from shardwise.models import build_model
    from shardwise.parallel.tensor import apply_tensor_parallel

    cfg = ModelConfig(**dict(LLAMA, dropout=0.3))
    torch.manual_seed(0)
    ref = build_model(cfg).eval()
    tp_model = copy.deepcopy(ref)
    apply_tensor_parallel(tp_model, mesh)
    ids, labels, extras = _batch(cfg, True, seed=5)
    with torch.no_grad():
        a = token_loss_sum(ref(ids, **extras), labels)
        b = token_loss_sum(tp_model(ids, **extras), labels)
    _close(b, a, "eval loss with a dropout config")


def _refusals(mesh) -> None:
    """Clear errors: a sequence SP cannot split, a second application; a meta model is sharded as structure."""
    from shardwise.models import Transformer, build_model
    from shardwise.parallel.tensor import apply_tensor_parallel

    torch.manual_seed(0)
    model = build_model(ModelConfig(**LLAMA))
    apply_tensor_parallel(model, mesh)
    with pytest.raises(ValueError, match="divisible by 2"):
        model(torch.zeros(1, 15, dtype=torch.long))
    with pytest.raises(ValueError, match="already applied"):
        apply_tensor_parallel(model, mesh)
    # A meta-device model gets its structure sharded (weights are loaded into the shards later).
    with torch.device("meta"):
        meta_model = Transformer(ModelConfig(**LLAMA))
    apply_tensor_parallel(meta_model, mesh)
    wq = meta_model.layers["0"].attention.wq.weight
    assert wq.is_meta and tuple(wq.to_local().shape) == (wq.shape[0] // 2, wq.shape[1])
    with pytest.raises(ConfigError, match="num_kv_heads"):
        apply_tensor_parallel(build_model(ModelConfig(**dict(LLAMA, num_kv_heads=1))), mesh)


def _worker(rank: int, port: int, world: int, out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results: dict[str, str | None] = {}

    def run(name: str, fn, *args, **kwargs) -> None:  # noqa: ANN001
        try:
            fn(*args, **kwargs)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per variant
            results[name] = traceback.format_exc()

    for name, (cfg, opts) in VARIANTS.items():
        run(name, _parity, mesh, cfg, **opts, label=name)
    run("pipeline_stages_sp", _pipeline_stages, mesh, True)
    run("pipeline_stages_no_sp", _pipeline_stages, mesh, False)
    run("loss_functions_match_unsharded", _loss_functions, mesh)
    run("dropout_sp", _dropout, mesh, True)
    run("dropout_no_sp", _dropout, mesh, False)
    run("dropout_sp_recompute_replays_masks", _dropout_recompute, mesh)
    run("refusals", _refusals, mesh)
    run("eval_with_dropout_config_matches", _eval_with_dropout, mesh)
    dist.barrier()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


# --- test side ----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("tp") / "results")
    world = 2
    mp.start_processes(_worker, args=(_free_port(), world, out), nprocs=world, join=True, start_method="fork")
    per_rank = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            per_rank.append(json.load(f))
    return {k: next((res[k] for res in per_rank if res[k]), None) for k in per_rank[0]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS) + CHECKS)
def test_tensor_parallel_two_ranks(tp_results, variant):
    assert variant in tp_results, "the variant did not run"
    err = tp_results[variant]
    assert err is None, err


def test_tp_must_divide_heads_and_kv_heads():
    cfg = ModelConfig(**LLAMA)  # 4 heads, 2 kv heads
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(ConfigError, match="fit this model: 1, 2"):
        check_tensor_parallel(ModelConfig(**dict(LLAMA, num_heads=6, num_kv_heads=6, hidden_size=48)), 4)
    with pytest.raises(ConfigError, match="intermediate_size"):
        check_tensor_parallel(ModelConfig(**dict(LLAMA, intermediate_size=45)), 2)
