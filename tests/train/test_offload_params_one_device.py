"""optimize.offload_params on one device (issue 13, item 5): FSDP2's CPU offload on a one-process group
and size-1 meshes, the engine several ranks use. On this CPU the trainer takes that path only when
asked (`Trainer(fsdp_offload_on_cpu=True)`), and then it must give the plain one-process run's losses
and weights, keep the fp32 masters as FSDP2's host shards at O2 (frozen LoRA bases 16-bit), and write
checkpoints that resume in the plain path and back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError
from shardwise.hardware import get_hardware
from shardwise.memory.estimate import estimate_memory
from shardwise.models import build_model
from shardwise.parallel.data_parallel import check_offload, fsdp_on_one_process
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.launch import init_distributed, join_one_process_group, shutdown
from shardwise.peft.qlora import quantized_layout_problem
from shardwise.plan.search import PlanRequest, enumerate_layouts, layout_config
from shardwise.resolve import resolve_config
from shardwise.step_time import predict_step
from shardwise.train.optim import lowbit_available
from shardwise.train.trainer import Trainer
from shardwise.units import GIB

from .conftest import tiny_config, with_changes

OFFLOAD = {"offload_params": True}
BF16 = {"mixed_precision": "bf16"}
CPU = torch.device("cpu")
# bf16 O2 against the plain path: losses within the tolerance of the multi-rank bf16 parity tests
# (tests/parallel/test_trainer_distributed.py), which compare losses only, as here: the plain path builds
# its weights in bf16 and copies them to fp32 masters, FSDP2 builds the fp32 masters themselves, so the
# two start one bf16 rounding apart (as under data parallelism), and AdamW's normalised first updates
# turn such differences in near-zero gradients into differences of the order of the learning rate.
BF16_LOSS_RTOL = 6e-4


@pytest.fixture(autouse=True)
def _no_group_left():  # noqa: ANN202 - the one-process group must not outlive a test
    yield
    shutdown()


def _train(cfg, ds, fsdp: bool, resume=None):  # noqa: ANN001, ANN202
    trainer = Trainer(cfg, train_dataset=ds, fsdp_offload_on_cpu=fsdp)
    result = trainer.train(resume=resume, overwrite=resume is None)
    shutdown()  # the next run in this process starts alone, as a new process would
    return result, trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, the fp32 master in place of a trained one where the plain path keeps masters apart."""
    out = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
           for n, p in trainer.model.named_parameters()}
    masters = trainer.state.masters
    named = dict(masters.named_masters()) if masters is not None else {}
    assert set(named) <= set(out)
    return {**out, **{n: m.detach().float().clone() for n, m in named.items()}}


def _assert_same_losses(a, b, rel: float) -> None:  # noqa: ANN001
    (ra, _), (rb, _) = a, b
    assert sorted(ra.losses) == sorted(rb.losses) and ra.losses
    for step, loss in ra.losses.items():
        assert rb.losses[step] == pytest.approx(loss, rel=rel, abs=0), step


def _assert_same_run(a, b, rel: float = 1e-6) -> None:  # noqa: ANN001
    _assert_same_losses(a, b, rel)
    wa, wb = _weights(a[1]), _weights(b[1])
    assert sorted(wa) == sorted(wb)
    for name, w in wa.items():
        torch.testing.assert_close(wb[name], w, rtol=rel, atol=rel * float(w.abs().max()), msg=name)


def _is_fsdp_offloaded(trainer: Trainer) -> bool:
    s = trainer.state
    params = list(trainer.model.parameters())
    return (s.dims.one_process_fsdp and all(isinstance(p, DTensor) and p.to_local().device.type == "cpu"
                                            for p in params))


@pytest.mark.parametrize("optimize", [{}, {"gradient_accumulation_steps": 2}], ids=["one", "accumulation"])
def test_one_process_fsdp_offload_gives_the_plain_losses_and_weights_fp32(tmp_path, dataset, optimize):
    # max_grad_norm 0.05 clips every step: the norm must come from FSDP2's host gradients, whole.
    plain = with_changes(tiny_config(tmp_path / "plain", max_grad_norm=0.05), optimize=optimize)
    off = with_changes(tiny_config(tmp_path / "off", max_grad_norm=0.05), optimize={**optimize, **OFFLOAD})
    a, b = _train(plain, dataset, fsdp=False), _train(off, dataset, fsdp=True)
    assert not a[1].state.dims.one_process_fsdp and _is_fsdp_offloaded(b[1])
    _assert_same_run(a, b)
    state = [v for st in b[1].state.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert state and all(isinstance(v, DTensor) and v.to_local().device.type == "cpu" for v in state)


def test_one_process_fsdp_offload_at_bf16_o2_keeps_fp32_masters_as_host_shards(tmp_path, dataset):
    a = _train(with_changes(tiny_config(tmp_path / "plain"), optimize=BF16), dataset, fsdp=False)
    b = _train(with_changes(tiny_config(tmp_path / "off"), optimize={**BF16, **OFFLOAD}), dataset, fsdp=True)
    assert b[1].state.masters is None  # FSDP2's fp32 shards are the masters: no second copy
    assert all(p.dtype == torch.float32 for p in b[1].model.parameters())
    _assert_same_losses(a, b, BF16_LOSS_RTOL)


def test_one_process_fsdp_offload_keeps_frozen_lora_bases_16_bit(tmp_path, dataset):
    lora = {"r": 4}
    a = _train(with_changes(tiny_config(tmp_path / "plain"), optimize=BF16, lora=lora), dataset, fsdp=False)
    b = _train(with_changes(tiny_config(tmp_path / "off"), optimize={**BF16, **OFFLOAD}, lora=lora), dataset,
               fsdp=True)
    assert _is_fsdp_offloaded(b[1])
    dtypes = {n: p.dtype for n, p in b[1].model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    _assert_same_losses(a, b, BF16_LOSS_RTOL)


def test_checkpoints_resume_between_the_one_process_fsdp_and_plain_paths(tmp_path, dataset):
    def cfg(root, steps, optimize):  # noqa: ANN001, ANN202
        return with_changes(tiny_config(root, max_steps=steps, decay_style="constant"), optimize=optimize)

    full = _train(cfg(tmp_path / "full", 4, BF16), dataset, fsdp=False)[0]
    for name, first, then in (("fsdp_then_plain", True, False), ("plain_then_fsdp", False, True)):
        _train(cfg(tmp_path / name, 2, {**BF16, **OFFLOAD}), dataset, fsdp=first)  # saves step 2
        resumed = _train(cfg(tmp_path / name, 4, {**BF16, **OFFLOAD}), dataset, fsdp=then, resume="auto")[0]
        assert sorted(resumed.losses) == [3, 4]
        for step in (3, 4):
            assert resumed.losses[step] == pytest.approx(full.losses[step], rel=BF16_LOSS_RTOL, abs=0), (name, step)


def test_who_takes_the_one_process_path_and_what_it_refuses(tmp_path):
    cfg = with_changes(tiny_config(tmp_path), optimize=OFFLOAD)
    alone = ParallelDims(one_process_fsdp=True)
    assert fsdp_on_one_process(cfg, torch.device("cuda"), ParallelDims())  # one accelerator: always
    assert not fsdp_on_one_process(cfg, CPU, ParallelDims())  # one CPU: only when asked
    assert fsdp_on_one_process(cfg, CPU, ParallelDims(), on_cpu=True)
    assert not fsdp_on_one_process(cfg, torch.device("cuda"), ParallelDims(dp_shard=2))  # the multi-rank path
    assert not fsdp_on_one_process(with_changes(cfg, optimize={"offload_params": False}), torch.device("cuda"),
                                   ParallelDims())
    check_offload(cfg, torch.device("cuda"), alone)
    check_offload(cfg, CPU, ParallelDims())  # logged: everything already lives in CPU memory
    with pytest.raises(ConfigError, match="parallel.data_parallel >= 2"):
        check_offload(cfg, torch.device("cuda"), ParallelDims(tp=2))
    qlora = with_changes(cfg, optimize={**BF16, **OFFLOAD}, lora={"r": 4, "quantize_base": "nf4"})
    assert "offload_params" in quantized_layout_problem(qlora, alone)


@pytest.mark.parametrize("train", [{"optimizer_in_backward": True, "max_grad_norm": None}, {"optimizer": "adamw_8bit"}],
                         ids=["optimizer_in_backward", "adamw_8bit"])
def test_the_host_step_combines_with_the_optimizer_in_backward_and_8_bit_adamw(tmp_path, dataset, train):
    if train.get("optimizer") == "adamw_8bit" and not lowbit_available():
        pytest.skip("torchao's 8-bit AdamW is not installed")
    a = _train(tiny_config(tmp_path / "plain", max_steps=2, **train), dataset, fsdp=False)
    b = _train(with_changes(tiny_config(tmp_path / "off", max_steps=2, **train), optimize=OFFLOAD), dataset, fsdp=True)
    assert _is_fsdp_offloaded(b[1])
    _assert_same_losses(a, b, 1e-6)


def _llama3_lora(lora: bool = True, **optimize):  # noqa: ANN202 - issue 13's target: Llama-3-8B, seq 2048, mbs 2
    return resolve_config({"model": {"preset": "llama3_8b"}, "data": {"seq_length": 2048},
                           "train": {"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 2},
                           "lora": {"r": 16, "alpha": 32} if lora else None,
                           "optimize": {"mixed_precision": "bf16", "recompute": "full", **optimize}})


def test_the_estimate_moves_every_shard_to_the_host_on_one_gpu_and_changes_nothing_on_one_cpu():
    plain, off = _llama3_lora(), _llama3_lora(offload_params=True)
    gpu, gpu_off = estimate_memory(plain, 1, "cuda"), estimate_memory(off, 1, "cuda")
    assert gpu_off.detail["layout"]["zero"] == 3 and gpu_off.detail["rank_role"] == "one device"
    # The bf16 base (15 GiB) leaves the device: what stays is the gathered blocks in flight, the root's
    # embedding and output projection (2 x 1 GiB, gathered from forward to the end of backward), activations.
    assert gpu.params > 14 * GIB and gpu_off.params < 0.1 * GIB
    gathered = gpu_off.detail["gathered_parameter_bytes"]
    assert 1.9 * GIB < gathered < 2.1 * GIB
    assert gpu_off.peak < gpu.peak - 12 * GIB
    assert 15 * GIB < gpu_off.host < 15.5 * GIB  # the base, the adapters' fp32 shards, gradients and state
    # The full fine-tune: the fp32 gradients (30 GiB) go to the host shards as they are reduced, block by block.
    full = estimate_memory(_llama3_lora(lora=False, offload_params=True), 1, "cuda")
    assert full.peak < 8 * GIB and 115 * GIB < full.host < 125 * GIB  # fp32 params, grads, two moments: 16 B each
    cpu, cpu_off = estimate_memory(plain, 1, "cpu"), estimate_memory(off, 1, "cpu")
    assert cpu_off.peak == cpu.peak and cpu_off.host == cpu.host == 0  # one CPU: the plain path


def test_step_time_counts_the_host_copies_and_step_and_the_planner_proposes_it_on_one_gpu():
    hw = get_hardware("RTX4090")
    plain, off = predict_step(_llama3_lora(), 1, hw), predict_step(_llama3_lora(offload_params=True), 1, hw)
    assert plain.offload == 0 and off.offload > 0  # every block's weights cross the host link, mostly hidden
    # 15 GiB of bf16 base in for the forward (0.64 s at 25 GB/s) against the forward's compute (1/3 of 1.65 s):
    # not all hidden; the backward (2/3 of the compute plus the recompute) hides all but its first block's copy
    weights = 15 * GIB / (hw.host_bandwidth_gbps * 1e9)
    forward = off.compute / 3
    assert off.offload == pytest.approx(weights - hw.comm_overlap * forward + weights / 32, rel=0.05)
    assert off.optimizer > plain.optimizer  # the host AdamW
    # Half the blocks offloaded: half the weights cross, hidden in both passes but for the first block's copy
    half = predict_step(_llama3_lora(offload_params=True, offload_params_blocks=16), 1, hw)
    block = (8.03e9 - 2 * 128256 * 4096) / 32 * 2 / (hw.host_bandwidth_gbps * 1e9)  # one block's bf16 weights
    assert half.offload == pytest.approx(2 * block, rel=0.05)
    req = PlanRequest(cfg=_llama3_lora(), devices=1, hardware=hw)
    layouts = [lay for lay, cfg in enumerate_layouts(req) if lay.offload_params]
    assert layouts and all(lay.dp == 1 and not lay.offload for lay in layouts)
    cfg = layout_config(req.cfg, layouts[0])
    assert cfg.optimize.offload_params and not cfg.optimize.offload_optimizer
    assert "FSDP2 CPU offload of parameters" in layouts[0].describe()
    assert not [lay for lay, _ in enumerate_layouts(dataclasses.replace(req, hardware=get_hardware("cpu")))
                if lay.offload_params]  # one CPU: nothing to offload to


def test_the_one_process_group_needs_no_network_and_goes_with_shutdown(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed("cpu")
    assert ctx.world_size == 1 and not dist.is_initialized()  # a plain single process joins nothing
    join_one_process_group(ctx)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert init_distributed("cpu").world_size == 1  # a second trainer in the process finds it
    shutdown()
    assert not dist.is_initialized()


def test_offloading_the_first_blocks_only_gives_the_plain_run_and_keeps_the_rest_on_the_device(tmp_path, dataset):
    """optimize.offload_params_blocks: FSDP2's CPU offload policy on the first blocks only; the others and the
    root keep theirs on the device. One clipped fp32 run against the plain path (the norm spans gradients on
    both sides), and the policy each FSDP2 parameter got."""
    plain = tiny_config(tmp_path / "plain", max_grad_norm=0.05)
    off = with_changes(tiny_config(tmp_path / "off", max_grad_norm=0.05),
                       optimize={**OFFLOAD, "offload_params_blocks": 1})
    a, b = _train(plain, dataset, fsdp=False), _train(off, dataset, fsdp=True)
    _assert_same_run(a, b)
    model = b[1].model
    on_host = {name: param.offload_to_cpu for module in model.modules() if isinstance(module, FSDPModule)
               for param in module._get_fsdp_state()._fsdp_param_group.fsdp_params
               for name in [param._param_fqn]}
    assert on_host and {n for n, host in on_host.items() if host} == {n for n in on_host if n.startswith("layers.0.")}
    with pytest.raises(Exception, match="offload_params_blocks 3 is above model.num_layers 2"):
        with_changes(off, optimize={"offload_params_blocks": 3})
    with pytest.raises(Exception, match="needs offload_params: true"):
        with_changes(tiny_config(tmp_path), optimize={"offload_params_blocks": 1})


def test_the_estimate_of_offloading_the_first_blocks_moves_exactly_their_bytes():
    """Half the blocks offloaded: the bf16 base of layers 0-15 and their adapters' fp32 shards, gradients and
    two moments (16 bytes an element) leave the device for the host; the rest stays. Counted here from the
    model's own parameters."""
    cfg = _llama3_lora(offload_params=True, offload_params_blocks=16)
    model = build_model(cfg.model, device="meta")
    base = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[:2] in [["layers", str(i)]
                                                                                    for i in range(16)])
    adapters = 16 * 2 * 16 * (4096 + 4096) + 16 * 2 * 16 * (4096 + 1024)  # r=16 on q and v of 16 blocks
    whole, half = estimate_memory(_llama3_lora(offload_params=True), 1, "cuda"), estimate_memory(cfg, 1, "cuda")
    plain = estimate_memory(_llama3_lora(), 1, "cuda")
    counters = 4 * 128  # Adam's step count, 4 bytes for each of the 128 adapter tensors at most
    assert 0 <= half.host - (base * 2 + adapters * 16) <= counters
    assert plain.params - half.params == base * 2  # the base leaves; the adapters' fp32 copies are counted apart
    assert whole.peak < half.peak < plain.peak
