"""Pipeline parallelism: layout rules, model splitting, and loss/gradient parity of PP2 (alone, with
FSDP2 DP2, with TP2 + sequence parallel) with one process.

The distributed test forks 2 gloo workers once and runs every variant (each schedule, uneven
stages, packed documents, tied embeddings, evaluation) inside that one launch; the one-process
references are computed in the test process after the workers have finished. The comparison is
strict (harness.py, fp32), with plain SGD and clipping: every parameter's first-step gradient within
1e-5 relative per tensor, every parameter after the last step relative to its update, the loss,
gradient norm and evaluation loss of every step within 5e-6 relative (measured <= ~2e-7: a pipeline
computes each micro-batch as one process does).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardwise.errors import ConfigError
from shardwise.loss import token_loss_sum
from shardwise.models import Transformer, build_model
from shardwise.models.config import ModelConfig
from shardwise.parallel.data_parallel import clip_grad_norm
from shardwise.parallel.pipeline import (
    check_pipeline,
    materialize_chunks,
    named_parameters,
    schedule_class,
    split_model,
    stage_indices,
    stage_layer_counts,
    stage_rank,
)
from shardwise.parallel.recompute import apply_recompute, canonical_name
from shardwise.train.optim import build_optimizer

from .harness import assert_params_close, assert_tensors_close, assert_values_close, grad_norm_of, update_norm

TINY = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
            max_position_embeddings=64)
GPT2 = dict(TINY, num_kv_heads=4, norm="layernorm", mlp="plain", activation="gelu", position="learned",
            qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True, model_type="gpt2")
SEQ, ROWS, STEPS, MAX_NORM = 16, 2, 5, 0.5


# --- layout rules (no processes) ----------------------------------------------------------------------


def test_default_split_is_as_even_as_possible():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(6, 4) == [2, 2, 1, 1]
    assert stage_layer_counts(4, 4) == [1, 1, 1, 1]


def test_stage_layers_override_and_validation():
    assert stage_layer_counts(4, 2, [1, 3]) == [1, 3]
    assert stage_layer_counts(4, 2, [0, 4]) == [0, 4]  # embeddings alone on the first stage
    with pytest.raises(ConfigError, match="2 entries .* 4 stages"):
        stage_layer_counts(4, 4, [2, 2])
    with pytest.raises(ConfigError, match="sums to 5, not model.num_layers 4"):
        stage_layer_counts(4, 2, [2, 3])
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1\] without layers"):
        stage_layer_counts(4, 3, [2, 0, 2])
    with pytest.raises(ConfigError, match="non-negative"):
        stage_layer_counts(4, 2, [-1, 5])
    with pytest.raises(ConfigError, match="exceeds model.num_layers 4"):
        stage_layer_counts(4, 8)


def test_schedule_rules():
    assert check_pipeline(4, 2, 1, "1f1b", micro_batch_num=2) == [2, 2]
    assert check_pipeline(8, 2, 2, "interleaved_1f1b", micro_batch_num=4) == [2, 2, 2, 2]
    with pytest.raises(ConfigError, match="one stage per rank.*virtual_stages is 2"):
        check_pipeline(4, 2, 2, "1f1b")
    with pytest.raises(ConfigError, match="interleaved_1f1b needs virtual_stages >= 2"):
        check_pipeline(4, 2, 1, "interleaved_1f1b")
    with pytest.raises(ConfigError, match="micro_batch_num 1 is below pipeline_parallel 2"):
        check_pipeline(4, 2, 1, "1f1b", micro_batch_num=1)
    check_pipeline(4, 2, 1, "gpipe", micro_batch_num=1)  # GPipe takes any count
    with pytest.raises(ConfigError, match="multiple of micro_batch_num // pipeline_parallel = 2"):
        check_pipeline(8, 2, 2, "interleaved_1f1b", micro_batch_num=5)
    with pytest.raises(ConfigError, match="not known"):
        check_pipeline(4, 2, 1, "pipedream")
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    assert schedule_class("zero_bubble", 2) is ScheduleZBVZeroBubble
    assert schedule_class("zero_bubble", 1) is ScheduleInterleavedZeroBubble
    assert schedule_class("zero_bubble", 3) is ScheduleInterleavedZeroBubble


def test_stage_to_rank_assignment():
    assert stage_indices(0, 2, 2, "loop") == [0, 2]
    assert stage_indices(1, 2, 2, "loop") == [1, 3]
    assert stage_indices(0, 2, 2, "v") == [0, 3]  # V: rank 0 holds the first and the last stage
    assert stage_indices(1, 2, 2, "v") == [1, 2]
    assert stage_indices(2, 4, 2, "v") == [2, 5]
    for pp in (2, 4):
        for style in ("loop", "v"):
            for r in range(pp):
                assert all(stage_rank(s, pp, 2 * pp, style) == r for s in stage_indices(r, pp, 2, style))
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert generate_stage_to_rank_mapping(4, 8, style="v") == {s: stage_rank(s, 4, 8, "v") for s in range(8)}


def _packed(gen: torch.Generator, rows: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """document_ids and restarting position_ids of rows with 1-3 packed documents each."""
    doc = torch.zeros(rows, seq, dtype=torch.long)
    for r in range(rows):
        n_cuts = int(torch.randint(0, 3, (1,), generator=gen))
        for c in torch.randint(1, seq, (n_cuts,), generator=gen).tolist():
            doc[r, c:] += 1
    starts = torch.zeros_like(doc)
    for r in range(rows):
        for t in range(1, seq):
            starts[r, t] = starts[r, t - 1] if doc[r, t] == doc[r, t - 1] else t
    pos = torch.arange(seq).expand(rows, seq) - starts
    return doc, pos


def test_chunks_chained_equal_the_whole_model():
    """Chunks of every rank, run in stage order on one process, give the whole model's logits
    (with packed documents); names are the whole model's; tied weights stay tied on a V rank."""
    for cfg_kw, schedule, vs, layers in ((TINY, "1f1b", 1, [1, 3]), (TINY, "interleaved_1f1b", 2, None),
                                         (GPT2, "zero_bubble", 2, None), (TINY, "gpipe", 1, [0, 4])):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**cfg_kw))
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 64, (3, SEQ), generator=gen)
        doc, pos = _packed(gen, 3)
        with torch.no_grad():
            want = model(ids, position_ids=pos, document_ids=doc)
        names = {n for n, _ in model.named_parameters()}
        chunks = [c for r in range(2) for c in split_model(model, r, 2, vs, layers, schedule)]
        chunks.sort(key=lambda c: c.pp_stage_index)
        assert [c.pp_stage_index for c in chunks] == list(range(2 * vs))
        assert sum(len(c.layers) for c in chunks) == 4
        assert chunks[0].tok_embeddings is not None and chunks[-1].output is not None
        assert all(c.tok_embeddings is None for c in chunks[1:]) and all(c.norm is None for c in chunks[:-1])
        # The chunked loss recomputes its logits in backward on a stage (the estimator counts it so).
        assert model.loss_gradients_in_forward and not any(c.loss_gradients_in_forward for c in chunks)
        got_names = {n for c in chunks for n, _ in c.named_parameters()}
        assert got_names <= names | {"output.weight"} and names <= got_names
        h = ids
        with torch.no_grad():
            for c in chunks:
                h = c(h, position_ids=pos, document_ids=doc)
        torch.testing.assert_close(h, want, rtol=0, atol=1e-6)
        if cfg_kw is GPT2:  # V: stages 0 and 3 are rank 0's, each with its own copy of the tied matrix
            torch.manual_seed(0)
            rank0 = split_model(build_model(ModelConfig(**cfg_kw)), 0, 2, 2, None, "zero_bubble")
            assert rank0[0].tok_embeddings.weight is not rank0[1].output.weight
            assert torch.equal(rank0[0].tok_embeddings.weight, rank0[1].output.weight)
            assert {n for n, _ in named_parameters(rank0)} >= {"tok_embeddings.weight", "output.weight"}
        if cfg_kw is TINY and schedule == "1f1b":
            assert [c.pp_layers for c in chunks] == [[0], [1, 2, 3]]
            assert list(chunks[1].layers.keys()) == ["1", "2", "3"]


def test_meta_model_split_and_materialised():
    """A meta-device model splits without allocating; its chunks materialise and chain."""
    with torch.device("meta"):
        model = Transformer(ModelConfig(**GPT2))
    chunks = split_model(model, 0, 2, 2, None, "zero_bubble")
    assert all(p.is_meta for c in chunks for p in c.parameters())
    materialize_chunks(chunks, "cpu", torch.float32)
    assert not any(p.is_meta for c in chunks for p in c.parameters())
    assert [c.pp_stage_index for c in chunks] == [0, 3] and chunks[1].pp_layers == [3]
    with torch.no_grad():
        h = chunks[0](torch.randint(0, 64, (1, SEQ)))
        assert h.shape == (1, SEQ, 32) and torch.isfinite(h).all()
        assert chunks[1](h).shape == (1, SEQ, 64)


# --- PP2 against one process --------------------------------------------------------------------------

# name, model, schedule, virtual_stages, micro_batch_num, stage_layers, packed documents, extra
VARIANTS = [
    ("gpipe", TINY, "gpipe", 1, 2, None, False, {}),
    ("1f1b_docs", TINY, "1f1b", 1, 4, None, True, {}),
    ("interleaved_docs", TINY, "interleaved_1f1b", 2, 4, None, True, {}),
    ("zb1p_docs", TINY, "zero_bubble", 1, 2, None, True, {}),
    ("zbv_docs_eval", TINY, "zero_bubble", 2, 4, None, True, {"eval": True}),
    ("1f1b_uneven_1_3", TINY, "1f1b", 1, 2, [1, 3], False, {"count_tokens": True}),
    ("gpipe_uneven_0_4", TINY, "gpipe", 1, 2, [0, 4], True, {}),
    ("gpt2_tied_1f1b_docs", GPT2, "1f1b", 1, 2, None, True, {}),
    ("gpt2_tied_zbv", GPT2, "zero_bubble", 2, 2, None, False, {}),
    ("gpt2_tied_interleaved_uneven", GPT2, "interleaved_1f1b", 2, 2, [1, 1, 1, 1], True, {}),
    # two pipeline steps per optimizer step (4 micro-batches), tied embeddings exchanged once
    ("gpt2_tied_1f1b_accumulate", GPT2, "1f1b", 1, 2, None, True, {"accumulate": 2}),
    ("zbv_recompute_full", TINY, "zero_bubble", 2, 2, None, True, {"recompute": "full"}),
    ("1f1b_recompute_selective", TINY, "1f1b", 1, 2, [3, 1], True, {"recompute": "selective"}),
    # the sequence length changes between steps (dynamic batching): the stages are rebuilt
    ("1f1b_varying_length", TINY, "1f1b", 1, 2, None, True, {"seq": [16, 12, 12, 8, 16]}),
    ("zbv_varying_length", TINY, "zero_bubble", 2, 2, None, True, {"seq": [8, 16, 12, 16, 16]}),
]


def _batch(variant_index: int, step: int, micro_batch_num: int, docs: bool,
           seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * variant_index + step)
    rows = micro_batch_num * ROWS
    ids = torch.randint(0, 64, (rows, seq + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[torch.rand(rows, seq, generator=gen) < 0.25] = -100  # ignored targets vary per micro-batch
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": labels}
    if docs:
        batch["document_ids"], batch["position_ids"] = _packed(gen, rows, seq)
    return batch


def _extras(batch: dict[str, torch.Tensor], rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    return {k: batch[k][rows] for k in ("position_ids", "document_ids") if k in batch}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    try:
        from shardwise.parallel.dims import ParallelDims
        from shardwise.parallel.pipeline import build_schedule, pipeline_eval, pipeline_step

        pp_mesh = ParallelDims(pp=world).build_meshes("cpu")["pp"]
        for index, (name, cfg_kw, schedule, vs, mbs, layers, docs, extra) in enumerate(VARIANTS):
            torch.manual_seed(0)
            model = build_model(ModelConfig(**cfg_kw))
            chunks = split_model(model, pp_mesh.get_local_rank(), world, vs, layers, schedule)
            del model
            for chunk in chunks:
                apply_recompute(chunk, extra.get("recompute", "none"))
            pipe = build_schedule(chunks, pp_mesh, "cpu", mbs, schedule)
            named = [(canonical_name(n), p) for n, p in named_parameters(chunks)]
            accumulate = extra.get("accumulate", 1)
            opt = _optimizer(named)
            result = {"losses": [], "norms": [], "grads": {}, "class": type(pipe.schedule).__name__}
            for step in range(STEPS):
                batch = _batch(index, step, mbs * accumulate, docs, extra.get("seq", [SEQ] * STEPS)[step])
                n_tokens = None if extra.get("count_tokens") else int((batch["labels"] != -100).sum())
                loss = 0.0
                for part in range(accumulate):
                    rows = slice(part * mbs * ROWS, (part + 1) * mbs * ROWS)
                    loss += pipeline_step(pipe, batch["input_ids"][rows], batch["labels"][rows],
                                          global_tokens=n_tokens, finish_step=part == accumulate - 1,
                                          **_extras(batch, rows))
                norm = clip_grad_norm([p for _, p in named], MAX_NORM, reduce_group=pp_mesh.get_group(),
                                      exclude=pipe.norm_exclusions())
                if step == 0:
                    result["grads"] = {n: p.grad.clone() for n, p in named}
                opt.step()
                opt.zero_grad(set_to_none=True)
                result["losses"].append(float(loss))
                result["norms"].append(float(norm))
                if extra.get("eval") and step == 1:
                    ev = _batch(index, 99, mbs, docs)
                    result["eval"] = float(pipeline_eval(pipe, ev["input_ids"], ev["labels"], **_extras(ev)))
            result["params"] = {n: _full(p) for n, p in named}
            torch.save(result, os.path.join(out_dir, f"{name}.{rank}.pt"))
        # Mistakes are refused on every rank before any communication.
        chunks = split_model(build_model(ModelConfig(**TINY)), rank, world, 2, None, "interleaved_1f1b")
        with pytest.raises(ConfigError, match=r"holds stages \[\d, \d\] but schedule zero_bubble"):
            build_schedule(chunks, pp_mesh, "cpu", 4, "zero_bubble")
        pipe = build_schedule(chunks, pp_mesh, "cpu", 4, "interleaved_1f1b")
        batch = _batch(0, 0, 4, True)
        with pytest.raises(ConfigError, match="divisible into micro_batch_num 4"):
            pipeline_step(pipe, batch["input_ids"][:6], batch["labels"][:6])
        with pytest.raises(ValueError, match="position_ids has 1 rows"):
            pipeline_step(pipe, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"][:1])
    finally:
        dist.destroy_process_group()


def _reference(index: int, cfg_kw: dict, mbs: int, docs: bool, extra: dict) -> dict:
    """One process, trainer-style: per micro-batch sum(token losses) / step tokens, clip, SGD."""
    mbs *= extra.get("accumulate", 1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**cfg_kw))
    apply_recompute(model, extra.get("recompute", "none"))
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    opt = _optimizer(named)
    out = {"losses": [], "norms": [], "grads": {}, "initial": {n: p.detach().clone() for n, p in named}}
    for step in range(STEPS):
        batch = _batch(index, step, mbs, docs, extra.get("seq", [SEQ] * STEPS)[step])
        n_tokens = int((batch["labels"] != -100).sum())
        total = 0.0
        for m in range(mbs):
            rows = slice(m * ROWS, (m + 1) * ROWS)
            logits = model(batch["input_ids"][rows], **_extras(batch, rows))
            loss = token_loss_sum(logits, batch["labels"][rows]) / n_tokens
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in named}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(total)
        out["norms"].append(float(norm))
        if extra.get("eval") and step == 1:
            ev = _batch(index, 99, mbs, docs)
            model.eval()
            with torch.no_grad():
                out["eval"] = float(token_loss_sum(model(ev["input_ids"], **_extras(ev)), ev["labels"]))
            model.train()
    out["params"] = {n: p.detach().clone() for n, p in named}
    return out


def _optimizer(named: list) -> torch.optim.Optimizer:
    """Plain SGD (no momentum, no decay): a gradient error becomes a parameter error of its size, and
    nothing amplifies round-off (AdamW's per-element normalisation would, see test_tensor.py)."""
    return build_optimizer(named, "sgd", 0.3, 0.0, (0.0, 0.95), 1e-8)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _assert_steps_match(got: dict, ref: dict, label: str, norms: bool) -> None:
    """Loss (and gradient norm) of every step, and the evaluation loss, strictly."""
    assert_values_close(got["losses"], ref["losses"], what="loss", label=label)
    if norms:
        assert_values_close(got["norms"], ref["norms"], what="grad norm", label=label)
    if "eval" in ref:
        assert_values_close([got["eval"]], [ref["eval"]], what="eval loss", label=label)


def _assert_stage_grads_match(per_rank: list[dict], ref: dict, cfg_kw: dict, label: str) -> None:
    """Every rank's first-step gradients (its stages' parameters; a last-stage copy of a tied matrix
    holds the tied matrix's whole gradient) strictly against one process's; together the ranks hold
    every parameter."""
    total = grad_norm_of(ref)
    seen = set()
    for r, grads in enumerate(per_rank):
        for pname, grad in grads.items():  # a V rank holds both copies of a tied matrix: each is compared
            ref_name = "tok_embeddings.weight" if pname == "output.weight" and cfg_kw.get("tie_embeddings") else pname
            assert_tensors_close({ref_name: grad}, {ref_name: ref[ref_name]}, label=f"{label} rank {r} {pname}",
                                 total=total)
            seen.add(ref_name)
    assert seen == set(ref), (label, set(ref) - seen)


def _assert_stage_params_match(per_rank: list[dict], ref: dict, cfg_kw: dict, label: str) -> None:
    """Every rank's parameters after the last step against one process's (relative to the update)."""
    total = update_norm(ref["params"], ref["initial"])
    for r, params in enumerate(per_rank):
        for pname, p in params.items():
            ref_name = "tok_embeddings.weight" if pname == "output.weight" and cfg_kw.get("tie_embeddings") else pname
            assert_params_close({ref_name: p}, {ref_name: ref["params"][ref_name]}, ref["initial"], STEPS,
                                label=f"{label} rank {r} {pname}", total=total)


@pytest.mark.timeout(300)
def test_pp2_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="fork", join=True)
    classes = {}
    for index, (name, cfg_kw, schedule, vs, mbs, layers, docs, extra) in enumerate(VARIANTS):
        ref = _reference(index, cfg_kw, mbs, docs, extra)
        ranks = [torch.load(tmp_path / f"{name}.{r}.pt") for r in range(2)]
        classes[name] = ranks[0]["class"]
        for r, got in enumerate(ranks):  # every rank reports the step loss and the global norm
            _assert_steps_match(got, ref, f"{name} rank {r}", norms=True)
        _assert_stage_grads_match([got["grads"] for got in ranks], ref["grads"], cfg_kw, name)
        _assert_stage_params_match([got["params"] for got in ranks], ref, cfg_kw, name)
    assert classes["zbv_docs_eval"] == "ScheduleZBVZeroBubble"
    assert classes["zb1p_docs"] == "ScheduleInterleavedZeroBubble"
    assert classes["interleaved_docs"] == "ScheduleInterleaved1F1B"
    assert classes["1f1b_docs"] == "Schedule1F1B" and classes["gpipe"] == "ScheduleGPipe"


# --- PP2 x DP2 with FSDP2: the tied-matrix exchange and the clipping on sharded (DTensor) gradients ----

# name, model, schedule, virtual_stages, micro_batch_num, reshard_after_forward
FSDP_VARIANTS = [
    ("gpt2_tied_1f1b_zero3", GPT2, "1f1b", 1, 2, True),
    # zero-bubble schedules need reshard_after_forward=False (see the module docstring)
    ("gpt2_tied_zbv", GPT2, "zero_bubble", 2, 2, False),
]


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    try:
        from torch.distributed.fsdp import fully_shard

        from shardwise.parallel.dims import ParallelDims
        from shardwise.parallel.pipeline import build_schedule, pipeline_eval, pipeline_step

        meshes = ParallelDims(dp_shard=2, pp=2).build_meshes("cpu")
        pp_mesh, dp_mesh = meshes["pp"], meshes["dp"]
        dp_rank = dp_mesh.get_local_rank()
        for index, (name, cfg_kw, schedule, vs, mbs, reshard) in enumerate(FSDP_VARIANTS):
            torch.manual_seed(0)
            chunks = split_model(build_model(ModelConfig(**cfg_kw)), pp_mesh.get_local_rank(), 2, vs, None, schedule)
            for chunk in chunks:
                for block in chunk.layers.values():
                    fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
                fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard)
            pipe = build_schedule(chunks, pp_mesh, "cpu", mbs, schedule)
            named = list(named_parameters(chunks))
            opt = _optimizer(named)
            result = {"losses": [], "grads": {}}
            for step in range(STEPS):
                batch = _batch(100 + index, step, 2 * mbs, True)  # both replicas' rows
                rows = slice(dp_rank * mbs * ROWS, (dp_rank + 1) * mbs * ROWS)
                n_tokens = int((batch["labels"] != -100).sum())
                # FSDP2 averages over the 2 replicas (a divide factor of 1 needs PREMUL_SUM, which gloo
                # lacks), so the loss is scaled by 2 to make the reduced gradient the global sum.
                loss = pipeline_step(pipe, batch["input_ids"][rows], batch["labels"][rows],
                                     global_tokens=n_tokens / 2, **_extras(batch, rows)) / 2
                dist.all_reduce(loss, group=dp_mesh.get_group())
                clip_grad_norm([p for _, p in named], MAX_NORM, reduce_group=pp_mesh.get_group(),
                                      exclude=pipe.norm_exclusions())
                if step == 0:
                    result["grads"] = {n: p.grad.full_tensor() for n, p in named}
                opt.step()
                opt.zero_grad(set_to_none=True)
                result["losses"].append(float(loss))
                if step == 1:  # every replica evaluates the same rows (FSDP2 gathers across them)
                    ev = _batch(100 + index, 99, 2 * mbs, True)
                    result["eval"] = float(pipeline_eval(pipe, ev["input_ids"], ev["labels"], **_extras(ev)))
            result["params"] = {n: _full(p) for n, p in named}
            torch.save(result, os.path.join(out_dir, f"{name}.{rank}.pt"))
        _tp_variants(rank, out_dir)
    finally:
        dist.destroy_process_group()


# --- PP2 x TP2 with sequence parallel (run in the same 4-rank launch as PP2 x DP2) ---------------------

# name, model, schedule, virtual_stages, micro_batch_num, packed documents
TP_VARIANTS = [
    ("tp_1f1b_docs", TINY, "1f1b", 1, 2, True),
    ("tp_zbv", TINY, "zero_bubble", 2, 2, False),
]


def _tp_variants(rank: int, out_dir: str) -> None:
    """Each chunk tensor-parallel (sequence parallel, vocabulary-sharded DTensor logits into the
    last stage's loss), every TP rank fed the whole batch; gradients gathered with full_tensor()."""
    from shardwise.loss import token_loss_sum as trainer_loss_sum
    from shardwise.parallel.dims import ParallelDims
    from shardwise.parallel.pipeline import build_schedule, pipeline_step
    from shardwise.parallel.tensor import apply_tensor_parallel

    meshes = ParallelDims(pp=2, tp=2).build_meshes("cpu")
    pp_mesh, tp_mesh = meshes["pp"], meshes["tp"]
    for index, (name, cfg_kw, schedule, vs, mbs, docs) in enumerate(TP_VARIANTS):
        torch.manual_seed(0)
        chunks = split_model(build_model(ModelConfig(**cfg_kw)), pp_mesh.get_local_rank(), 2, vs, None, schedule)
        for chunk in chunks:
            apply_tensor_parallel(chunk, tp_mesh, sequence_parallel=True, loss_parallel=True)
        logit_types = set()

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logit_types.add(type(logits).__name__)  # DTensor: the vocabulary-sharded logits reach the loss
            return trainer_loss_sum(logits, labels)

        pipe = build_schedule(chunks, pp_mesh, "cpu", mbs, schedule, loss_fn=loss_fn)
        named = list(named_parameters(chunks))
        opt = _optimizer(named)
        result = {"losses": [], "norms": [], "grads": {}, "class": type(pipe.schedule).__name__}
        for step in range(STEPS):
            batch = _batch(200 + index, step, mbs, docs)
            loss = pipeline_step(pipe, batch["input_ids"], batch["labels"], **_extras(batch))
            norm = clip_grad_norm([p for _, p in named], MAX_NORM, reduce_group=pp_mesh.get_group(),
                                      exclude=pipe.norm_exclusions())
            if step == 0:
                result["grads"] = {n: p.grad.full_tensor() for n, p in named}
            opt.step()
            opt.zero_grad(set_to_none=True)
            result["losses"].append(float(loss))
            result["norms"].append(float(norm))
        result["logits"] = sorted(logit_types)
        result["params"] = {n: _full(p) for n, p in named}
        torch.save(result, os.path.join(out_dir, f"{name}.{rank}.pt"))


@pytest.mark.timeout(300)
def test_pp2_dp2_fsdp_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_fsdp_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4, start_method="fork",
                       join=True)
    for index, (name, cfg_kw, schedule, vs, mbs, reshard) in enumerate(FSDP_VARIANTS):
        ref = _reference(100 + index, cfg_kw, 2 * mbs, True, {"eval": True})
        ranks = [torch.load(tmp_path / f"{name}.{r}.pt") for r in range(4)]
        for r, got in enumerate(ranks):
            _assert_steps_match(got, ref, f"{name} rank {r}", norms=False)
        _assert_stage_grads_match([got["grads"] for got in ranks], ref["grads"], cfg_kw, name)
        _assert_stage_params_match([got["params"] for got in ranks], ref, cfg_kw, name)
    # PP2 x TP2 (same launch): every rank's loss and norm, and the gradients merged over the stages
    classes = {}
    for index, (name, cfg_kw, schedule, vs, mbs, docs) in enumerate(TP_VARIANTS):
        ref = _reference(200 + index, cfg_kw, mbs, docs, {})
        ranks = [torch.load(tmp_path / f"{name}.{r}.pt") for r in range(4)]
        for r, got in enumerate(ranks):
            classes[name] = got["class"]
            last = r // 2 == (0 if vs == 2 else 1)  # the pp rank holding the last stage (rank 0 under ZBV's V)
            assert got["logits"] == (["DTensor"] if last else []), (name, r, got["logits"])
            _assert_steps_match(got, ref, f"{name} rank {r}", norms=True)
        _assert_stage_grads_match([got["grads"] for got in ranks], ref["grads"], cfg_kw, name)
        _assert_stage_params_match([got["params"] for got in ranks], ref, cfg_kw, name)
    assert classes == {"tp_1f1b_docs": "Schedule1F1B", "tp_zbv": "ScheduleZBVZeroBubble"}
