"""The Trainer in every layout of the parity matrix against one process, with plain SGD (issue 11).

Plain SGD (no momentum, no weight decay, constant LR, no clipping) turns every gradient error into
a parameter error of the same relative size: AdamW normalises each element's update, so a gradient
scaled by a constant hardly moves its parameters, and a loss-only comparison under AdamW misses it.
The data (`PaddedDataset`) has ignored labels and padding, so the target-token counts differ between
data-parallel ranks and between the micro-batches of a rank, and every layout accumulates gradients
over at least two micro-batches: a normalisation by a local count, a mean instead of a sum or a
dropped share shows.

For every layout the test compares with one process (`Reference`), strictly (harness.py):
- every parameter's gradient at the first step (captured right before the first optimizer step),
  per tensor relative error <= GRAD_RTOL;
- every parameter after STEPS steps: ||p - p_ref|| <= PARAM_RTOL x ||p_ref - p_0|| (the reference's
  update) + STEPS fp32 roundings of p; frozen parameters bitwise unchanged;
- the loss of every step on every rank and the gradient norm of every step (metrics.jsonl), relative
  error <= SCALAR_RTOL.
test_parity_faults.py injects faults into these same runs and shows that these checks then fail.

One launch per world size (2, 4 and 8 ranks) runs every layout of that size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardwise.checkpoint.checkpointer import canonical_param_names
from shardwise.config import RunConfig
from shardwise.parallel.data_parallel import ZeroOneOptimizer
from shardwise.resolve import resolve_config as validate
from shardwise.train.trainer import Trainer

from ..train.conftest import PaddedDataset, make_tokens, read_metrics
from .harness import (
    GRAD_RTOL,
    PARAM_RTOL,
    SCALAR_RTOL,
    ParityError,
    assert_params_close,
    assert_tensors_close,
    assert_values_close,
    full_tensor,
    grad_norm_of,
    run_distributed,
    update_norm,
)

# The smallest model every layout can split: 4 layers for PP2 x 2 virtual stages, heads and kv heads
# divisible by TP2, a sequence divisible by SP2.
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
             max_position_embeddings=64)
SEQ = 16
ROWS = 8  # samples per optimizer step over all data-parallel ranks, in every layout
STEPS = 3
LR = 0.3  # parameters move by ~3e-5 (norm weights) to ~1e-2 of their norm in 3 steps
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
# A mixture of experts in blocks 1-3 (block 0 dense): 4 experts, top 2, sigmoid scores with the correction
# bias moved after every step by the summed load, and the sequence-wise balance loss and z-loss.
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "first_k_dense": 1,
       "router_score": "sigmoid", "router_bias": True, "moe_bias_update_rate": 0.01, "moe_aux_loss_coef": 0.01,
       "router_z_loss_coef": 0.001}
FINETUNE: dict[str, dict[str, Any]] = {"full": {}, "lora": {"lora": LORA},
                                       "freeze": {"freeze": {"embeddings": True, "layers": 1}},
                                       "moe": {"model": {"preset": "tiny_llama", **MODEL, **MOE}},
                                       # LoRA on attention and on every routed expert's three projections
                                       "moe_lora": {"model": {"preset": "tiny_llama", **MODEL, **MOE},
                                                    "lora": {**LORA, "target_modules": ["q_proj", "experts.w1",
                                                                                        "experts.w3", "experts.w2"]}},
                                       # DeepSeek-V3's shape: latent attention, block 0 dense, grouped sigmoid
                                       # routing with the correction bias, a shared expert
                                       "deepseek": {"model": {"preset": "tiny_deepseek_v3", "vocab_size": 64,
                                                              "num_layers": 4, "max_position_embeddings": 64,
                                                              "moe_bias_update_rate": 0.01}}}
# The tensor fault (a) halves: its largest first-step gradient is ~1e-4 (checked in test_parity_faults).
HALVED = {"full": "layers.1.attention.wq.weight", "freeze": "layers.1.attention.wq.weight",
          "lora": "layers.1.attention.wq.lora_B.weight"}


@dataclass(frozen=True)
class Layout:
    """One layout of the matrix: `parallel` settings, and the per-rank micro-batch size and
    accumulation that make ROWS samples per step (dp x micro_batch_size x accumulation)."""

    name: str
    world: int
    parallel: dict
    micro_batch_size: int
    accumulation: int
    finetune: str = "full"
    optimize: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.parallel.get("data_parallel", 1)

    @property
    def tp(self) -> int:
        return self.parallel.get("tensor_parallel", 1)

    @property
    def pp(self) -> int:
        return self.parallel.get("pipeline_parallel", 1)

    @property
    def cp(self) -> int:
        return self.parallel.get("context_parallel", 1)


def _pp(schedule: str, micro_batch_num: int = 2, virtual_stages: int = 1, **more: Any) -> dict:
    return dict(pipeline_parallel=2, schedule=schedule, micro_batch_num=micro_batch_num,
                virtual_stages=virtual_stages, **more)


LAYOUTS = [
    # 2 ranks
    Layout("zero0", 2, dict(data_parallel=2, zero_stage=0), 2, 2),
    Layout("zero1", 2, dict(data_parallel=2, zero_stage=1), 2, 2, train={"check_replicas_steps": 1}),
    Layout("zero2", 2, dict(data_parallel=2, zero_stage=2), 2, 2),
    Layout("zero3", 2, dict(data_parallel=2, zero_stage=3), 1, 4),
    # zero2 / zero3 above reduce-scatter every micro-batch (parallel.reduce_gradients auto); these
    # accumulate full-size gradients and reduce once per step.
    Layout("zero2_once_per_step", 2, dict(data_parallel=2, zero_stage=2, reduce_gradients="once_per_step"), 2, 2),
    Layout("zero3_once_per_step", 2, dict(data_parallel=2, zero_stage=3, reduce_gradients="once_per_step"), 1, 4),
    Layout("zero2_recompute", 2, dict(data_parallel=2, zero_stage=2), 2, 2, optimize={"recompute": "full"}),
    Layout("zero3_offload", 2, dict(data_parallel=2, zero_stage=3), 2, 2, optimize={"offload_optimizer": True}),
    Layout("tp2_sp", 2, dict(tensor_parallel=2), 2, 4),
    Layout("tp2_no_sp", 2, dict(tensor_parallel=2, sequence_parallel=False), 4, 2),
    Layout("pp2_gpipe", 2, _pp("gpipe"), 2, 4),  # two pipeline steps per optimizer step
    Layout("pp2_1f1b", 2, _pp("1f1b"), 4, 2),
    Layout("pp2_1f1b_stages_1_3", 2, _pp("1f1b", stage_layers=[1, 3]), 4, 2),
    Layout("pp2_interleaved_1f1b", 2, _pp("interleaved_1f1b", 4, 2), 2, 4),
    Layout("pp2_zero_bubble", 2, _pp("zero_bubble"), 4, 2),  # ZB1P (ScheduleInterleavedZeroBubble)
    Layout("pp2_zero_bubble_v", 2, _pp("zero_bubble", 2, 2), 2, 4),  # ZB-V (ScheduleZBVZeroBubble)
    Layout("lora_zero1", 2, dict(data_parallel=2, zero_stage=1), 2, 2, finetune="lora"),
    Layout("lora_tp2", 2, dict(tensor_parallel=2), 4, 2, finetune="lora"),
    Layout("lora_pp2", 2, _pp("1f1b"), 4, 2, finetune="lora"),
    Layout("freeze_tp2", 2, dict(tensor_parallel=2), 4, 2, finetune="freeze"),
    Layout("freeze_zero3", 2, dict(data_parallel=2, zero_stage=3), 2, 2, finetune="freeze"),
    Layout("moe_zero1", 2, dict(data_parallel=2, zero_stage=1), 2, 2, finetune="moe"),
    Layout("moe_zero3", 2, dict(data_parallel=2, zero_stage=3), 1, 4, finetune="moe"),
    Layout("moe_ep2_zero0", 2, dict(data_parallel=2, zero_stage=0, expert_parallel=2), 2, 2, finetune="moe"),
    Layout("moe_ep2_zero1", 2, dict(data_parallel=2, zero_stage=1, expert_parallel=2), 2, 2, finetune="moe"),
    Layout("moe_ep2_zero3", 2, dict(data_parallel=2, zero_stage=3, expert_parallel=2), 1, 4, finetune="moe"),
    # ZB-V: MoE blocks on both ranks, two stages a rank (fails when the stages' shape inference counts in the
    # experts' load, which moves the routers' bias)
    Layout("moe_pp2_zero_bubble_v", 2, _pp("zero_bubble", 2, 2), 2, 4, finetune="moe"),
    Layout("moe_lora_ep2_zero1", 2, dict(data_parallel=2, zero_stage=1, expert_parallel=2), 2, 2,
           finetune="moe_lora"),  # the experts' adapters spread with them
    Layout("moe_lora_tp2", 2, dict(tensor_parallel=2), 4, 2, finetune="moe_lora"),  # ... replicated with them
    Layout("deepseek_pp2_1f1b", 2, _pp("1f1b"), 4, 2, finetune="deepseek"),  # latent attention in stages
    Layout("deepseek_tp2_sp", 2, dict(tensor_parallel=2), 2, 4, finetune="deepseek"),  # ... split by head
    Layout("moe_cp2", 2, dict(context_parallel=2), 4, 2, finetune="moe"),  # balance losses over whole sequences
    Layout("moe_tp2_sp", 2, dict(tensor_parallel=2), 2, 4, finetune="moe"),  # router, experts replicated over TP
    # 4 ranks
    Layout("moe_ep2_tp2_zero3", 4, dict(data_parallel=2, tensor_parallel=2, zero_stage=3, expert_parallel=2), 1, 4,
           finetune="moe"),
    Layout("moe_ep2_tp2_no_sp", 4, dict(data_parallel=2, tensor_parallel=2, zero_stage=1, expert_parallel=2,
                                        sequence_parallel=False), 2, 2, finetune="moe"),
    Layout("moe_pp2_ep2_zero3", 4, dict(data_parallel=2, zero_stage=3, expert_parallel=2, **_pp("1f1b")), 1, 4,
           finetune="moe"),
    Layout("deepseek_ep2_tp2_zero3", 4, dict(data_parallel=2, tensor_parallel=2, zero_stage=3, expert_parallel=2),
           1, 4, finetune="deepseek"),
    Layout("moe_dp2_cp2_zero3", 4, dict(data_parallel=2, context_parallel=2, zero_stage=3), 2, 2, finetune="moe"),
    Layout("moe_ep2_dp4_zero0", 4, dict(data_parallel=4, zero_stage=0, expert_parallel=2), 1, 2, finetune="moe"),
    Layout("moe_ep2_dp4_zero3", 4, dict(data_parallel=4, zero_stage=3, expert_parallel=2), 1, 2, finetune="moe"),
    Layout("hsdp_2x2_zero3", 4, dict(data_parallel=4, data_parallel_replicate=2, zero_stage=3), 1, 2,
           train={"check_replicas_steps": 1}),  # only the replica all-reduce deferred to the last micro-batch
    Layout("hsdp_2x2_zero2", 4, dict(data_parallel=4, data_parallel_replicate=2, zero_stage=2), 1, 2),
    Layout("hsdp_2x2_zero3_once_per_step", 4, dict(data_parallel=4, data_parallel_replicate=2, zero_stage=3,
                                                   reduce_gradients="once_per_step"), 1, 2),
    Layout("dp2_tp2_zero1", 4, dict(data_parallel=2, tensor_parallel=2, zero_stage=1), 2, 2),
    Layout("pp2_dp2_zero1_1f1b", 4, dict(data_parallel=2, zero_stage=1, **_pp("1f1b")), 1, 4,
           train={"check_replicas_steps": 1}),  # two pipeline steps per optimizer step
    Layout("pp2_dp2_zero3_zero_bubble_v", 4, dict(data_parallel=2, zero_stage=3, **_pp("zero_bubble", 2, 2)), 2, 2),
    Layout("pp2_tp2_interleaved_1f1b", 4, dict(tensor_parallel=2, **_pp("interleaved_1f1b", 2, 2)), 4, 2),
    # 8 ranks (one run of ~8 s), two pipeline steps per optimizer step
    Layout("dp2_tp2_pp2_zero3", 8, dict(data_parallel=2, tensor_parallel=2, zero_stage=3, **_pp("1f1b")), 1, 4),
]
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def layout_config(run_dir: Path, layout: Optional[Layout] = None, finetune: str = "full",
                  **train: Any) -> RunConfig:
    """The run of `layout` (one process when None) writing into run_dir: plain SGD, ROWS samples a step."""
    section = {"output_dir": str(run_dir), "max_steps": STEPS, "optimizer": "sgd", "beta1": 0.0, "lr": LR,
               "weight_decay": 0.0, "max_grad_norm": None, "decay_style": "constant", "warmup_steps": 0,
               "log_steps": 1, "progress_bar": False, "tensorboard": False, "seed": 7,
               # a given peak skips measuring the CPU's for MFU (~0.6 s, most of such a run)
               "peak_tflops": 1.0, "micro_batch_size": layout.micro_batch_size if layout else 2}
    section.update(layout.train if layout else {})
    section.update(train)
    raw = {"model": {"preset": "tiny_llama", **MODEL}, "data": {"seq_length": SEQ}, "train": section,
           "run": {"num_threads": 1}, "parallel": dict(layout.parallel) if layout else {},
           "optimize": {"gradient_accumulation_steps": layout.accumulation if layout else ROWS // 2,
                        **(layout.optimize if layout else {})},
           **FINETUNE[layout.finetune if layout else finetune]}
    return validate(raw)


def dataset() -> PaddedDataset:
    return PaddedDataset(make_tokens(4000, vocab=MODEL["vocab_size"]), SEQ)


def named_params(parts: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters by canonical name, each once, in the same order on every rank of a mesh."""
    names = canonical_param_names(parts)
    seen: set[int] = set()
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield names[id(p)], p


@contextlib.contextmanager
def step_pre_hook(hook: Callable) -> Iterator[None]:
    """`hook(optimizer, args, kwargs)` runs before every optimizer step (torch's global hook) in the block."""
    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def outer_optimizer_hook(fn: Callable[[torch.optim.Optimizer], None]) -> Callable:
    """An optimizer-step pre-hook calling fn(optimizer) once per trainer step (not again for the inner
    optimizer that ZeRO-1's ZeroOneOptimizer steps)."""
    inner: set[int] = set()

    def hook(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if isinstance(optimizer, ZeroOneOptimizer):
            inner.add(id(optimizer.local))
        if id(optimizer) not in inner:
            fn(optimizer)

    return hook


def first_step_grads(trainer: Trainer, out: dict) -> contextlib.AbstractContextManager:
    """Fill `out` with every parameter's full gradient (None: no gradient) right before the first
    optimizer step (gathering DTensors: a collective, in the same order on every rank of a mesh)."""
    def capture(_optimizer: torch.optim.Optimizer) -> None:
        masters = trainer.state.masters  # where the optimizer reads it (offload_optimizer: the host master)
        if not out:
            out.update({n: None if g is None else full_tensor(g) for n, g in
                        ((n, (masters.master_of(p) if masters else p).grad)
                         for n, p in named_params(trainer.model_parts))})

    return step_pre_hook(outer_optimizer_hook(capture))


def train_once(cfg: RunConfig, fault: Optional[Callable[[Trainer], contextlib.AbstractContextManager]] = None,
               data: Any = None) -> dict[str, Any]:
    """Train `cfg` on this rank (with `fault` installed, if given) on `data` (default: `dataset()`);
    return what the parity checks read."""
    data = dataset() if data is None else data
    trainer = Trainer(cfg, train_dataset=data)
    grads: dict[str, Optional[torch.Tensor]] = {}
    with contextlib.ExitStack() as stack:
        if fault is not None:
            stack.enter_context(fault(trainer))  # first: a fault's gradient change shows in what is captured
        stack.enter_context(first_step_grads(trainer, grads))
        result = trainer.train()
    return {"grads": grads, "params": {n: full_tensor(p) for n, p in named_params(trainer.model_parts)},
            "losses": [result.losses[s] for s in sorted(result.losses)],
            "counts": getattr(data, "target_counts", None), "result": result}


def run_layouts(rank: int, world: int, root: Path, names: list[str]) -> dict[str, Any]:
    """Worker: every named layout, each in root/<name>."""
    return {name: train_once(layout_config(root / name, BY_NAME[name])) for name in names}


@dataclass
class Reference:
    """One process's run: first-step gradients, initial and final parameters, losses, gradient norms."""

    grads: dict[str, Optional[torch.Tensor]]
    initial: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    losses: list[float]
    grad_norms: list[float]
    counts: list[int]


def reference(root: Path, finetune: str = "full", tag: str = "", **train: Any) -> Reference:
    """The one-process run every layout of `finetune` must equal (in root/single_<finetune><tag>);
    `train`: settings that differ from layout_config's."""
    run_dir = root / f"single_{finetune}{tag}"
    return reference_run(layout_config(run_dir, None, finetune, **train))


def reference_run(cfg: RunConfig, data: Any = None) -> Reference:
    """Train `cfg` in this (single) process (on `data`, default `dataset()`) and keep what the parity
    checks compare with."""
    initial: dict[str, torch.Tensor] = {}

    def snapshot(trainer: Trainer) -> contextlib.AbstractContextManager:
        def keep(_optimizer: torch.optim.Optimizer) -> None:
            if not initial:
                initial.update({n: full_tensor(p) for n, p in named_params(trainer.model_parts)})

        return step_pre_hook(outer_optimizer_hook(keep))

    got = train_once(cfg, snapshot, data)
    return Reference(grads=got["grads"], initial=initial, params=got["params"], losses=got["losses"],
                     grad_norms=grad_norms(Path(cfg.train.output_dir)), counts=got["counts"])


def grad_norms(run_dir: Path) -> list[float]:
    """The gradient norm of every step, as rank 0 logged it (log_steps 1)."""
    return [r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r]


def parity_failures(label: str, ranks: list[dict[str, Any]], run_dir: Path, ref: Reference,
                    grad_rtol: float = GRAD_RTOL, param_rtol: float = PARAM_RTOL,
                    scalar_rtol: float = SCALAR_RTOL) -> dict[str, Optional[str]]:
    """Each strict check of a run (every rank's `train_once` results; rank 0's metrics in run_dir)
    against one process: None where it passes, else the failure. Every rank's copy of a parameter
    (pipeline stages hold disjoint sets, other ranks full copies) is compared; together the ranks
    must hold every parameter."""
    grad_total, update_total = grad_norm_of(ref.grads), update_norm(ref.params, ref.initial)
    checks: dict[str, Callable[[], Any]] = {
        "first-step gradients": lambda: _each_rank(ranks, "grads", ref.grads, lambda got, want, where:
                                                   assert_tensors_close(got, want, rtol=grad_rtol, label=where,
                                                                        total=grad_total), label),
        "parameters after SGD": lambda: _each_rank(ranks, "params", ref.params, lambda got, want, where:
                                                   assert_params_close(got, want, ref.initial, STEPS,
                                                                       rtol=param_rtol, label=where,
                                                                       total=update_total), label),
        "loss per step": lambda: [assert_values_close(r["losses"], ref.losses, rtol=scalar_rtol, what="loss",
                                                      label=f"{label} rank {i}") for i, r in enumerate(ranks)],
        "grad norm per step": lambda: assert_values_close(grad_norms(run_dir), ref.grad_norms, rtol=scalar_rtol,
                                                          what="grad norm", label=label),
    }
    failures: dict[str, Optional[str]] = {}
    for what, check in checks.items():
        try:
            check()
            failures[what] = None
        except ParityError as exc:
            failures[what] = str(exc)
    return failures


def _each_rank(ranks: list[dict[str, Any]], key: str, ref: dict[str, Any], check: Callable, label: str) -> None:
    seen: set[str] = set()
    for rank, got in enumerate(ranks):
        tensors = got[key]
        unknown = set(tensors) - set(ref)
        if unknown:
            raise ParityError(f"{label} rank {rank}: {key} not in one process: {sorted(unknown)}")
        check(tensors, {n: ref[n] for n in tensors}, f"{label} rank {rank}")
        seen |= set(tensors)
    if seen != set(ref):
        raise ParityError(f"{label}: no rank holds {key} {sorted(set(ref) - seen)}")


def assert_run_matches(label: str, ranks: list[dict[str, Any]], run_dir: Path, ref: Reference) -> None:
    """Every strict check of `parity_failures` passes (ParityError naming all that fail otherwise)."""
    failed = {k: v for k, v in parity_failures(label, ranks, run_dir, ref).items() if v}
    if failed:
        raise ParityError(f"{label}: " + "\n".join(f"[{k}] {v}" for k, v in failed.items()))


def _assert_uneven(layout: Layout, ranks: list[dict[str, Any]]) -> None:
    """The data really is uneven in this run: target counts differ between the micro-batches of a
    rank, and between data-parallel ranks (rank 0 and the first rank of the second replica)."""
    counts = ranks[0]["counts"]
    assert len(set(counts)) > 1, (layout.name, counts)
    if layout.dp > 1:  # mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"): data-parallel rank 1 is rank cp x tp
        other = ranks[layout.cp * layout.tp]["counts"]
        assert other != counts, (layout.name, counts, other)


def _check_world(root: Path, world: int, refs: dict[str, Reference]) -> None:
    names = [layout.name for layout in LAYOUTS if layout.world == world]
    results = run_distributed(run_layouts, world, root, names, timeout=540)
    failures = []
    for name in names:
        layout = BY_NAME[name]
        ranks = [r[name] for r in results]
        _assert_uneven(layout, ranks)
        try:
            assert_run_matches(name, ranks, root / name, refs[layout.finetune])
        except ParityError as exc:
            failures.append(str(exc))
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Reference]]:
    root = tmp_path_factory.mktemp("parity")
    refs = {kind: reference(root, kind) for kind in FINETUNE}
    for kind, ref in refs.items():
        # The comparison means something: parameters move, and (LoRA, freezing) some do not.
        assert all(torch.isfinite(torch.tensor(ref.losses))) and ref.losses[-1] < ref.losses[0], kind
        frozen = [n for n, g in ref.grads.items() if g is None]
        assert bool(frozen) == (kind in ("lora", "freeze", "moe_lora")), (kind, frozen[:3])
        assert all(torch.equal(ref.params[n], ref.initial[n]) for n in frozen), kind
        assert all(not torch.equal(ref.params[n], ref.initial[n]) for n in ref.params if n not in frozen), kind
    return root, refs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_trains_like_one_process_with_sgd(references, world: int) -> None:
    """Each layout of `world` ranks: first-step gradients, parameters after SGD steps, losses and
    gradient norms equal one process's within the strict tolerances."""
    root, refs = references
    _check_world(root, world, refs)
