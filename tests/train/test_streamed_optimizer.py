"""optimize.offload_optimizer: stream (issue 25, item 1): the optimizer state (and fp32 masters) in host
memory, each parameter updated on the device by the fused kernel with its state copied in and out on a
side stream. On this CPU host and device are one memory, but the same copies run; the reference is the
plain path (the whole state on the device, torch's fused AdamW over every tensor at once), which the
streamed update must match: per element the same kernel, so in fp32 bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.memory.streamed_optimizer import StreamedAdam, StreamMasters
from shardwise.parallel.data_parallel import check_offload
from shardwise.parallel.dims import layout_for
from shardwise.train.trainer import Trainer

from .conftest import tiny_config, with_changes

STREAM = {"offload_optimizer": "stream"}


def _train(tmp_path: Path, dataset, name: str, steps: int = 4, resume: str | None = None, **sections):  # noqa: ANN001
    cfg = with_changes(tiny_config(tmp_path / name, max_steps=steps, max_grad_norm=0.5), **sections)
    trainer = Trainer(cfg, train_dataset=dataset)
    result = trainer.train(resume=resume, overwrite=resume is None)
    weights = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    return result, weights, trainer


def _streamed(sections: dict) -> dict:
    out = {k: dict(v) for k, v in sections.items()}
    out["optimize"] = {**out.get("optimize", {}), **STREAM}
    return out


def _assert_same(a, b) -> None:  # noqa: ANN001
    (ra, wa, _), (rb, wb, _) = a, b
    assert ra.losses.keys() == rb.losses.keys()
    for step in ra.losses:
        assert rb.losses[step] == pytest.approx(ra.losses[step], rel=1e-6, abs=0)
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n


CASES = {
    "fp32, clipping, 2 micro-batches": {"optimize": {"gradient_accumulation_steps": 2}},
    "fp32, optimizer in backward": {"train": {"optimizer_in_backward": True, "max_grad_norm": None}},
    "adam, weight decay": {"train": {"optimizer": "adam", "weight_decay": 0.1}},
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_streamed_update_is_the_plain_one_in_fp32(tmp_path, dataset, case):
    sections = CASES[case]
    plain = _train(tmp_path, dataset, "plain", **sections)
    streamed = _train(tmp_path, dataset, "stream", **_streamed(sections))
    assert isinstance(streamed[2].state.optimizer, StreamedAdam)
    _assert_same(plain, streamed)


def test_o2_masters_stay_in_host_memory_and_match_the_plain_masters(tmp_path, dataset):
    """bf16 weights with fp32 masters: the masters are the streamed optimizer's, in host memory; without
    clipping the weights are the plain O2 path's bit for bit (with clipping the factor multiplies the
    16-bit gradients here and the fp32 master gradients there: bf16 rounding apart)."""
    sections = {"optimize": {"mixed_precision": "bf16"}, "train": {"max_grad_norm": None}}
    plain = _train(tmp_path, dataset, "plain", **sections)
    streamed = _train(tmp_path, dataset, "stream", **_streamed(sections))
    masters = streamed[2].state.masters
    assert isinstance(masters, StreamMasters)
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters.masters)
    _assert_same(plain, streamed)
    for (_, m), (_, ref) in zip(masters.named_masters(), plain[2].state.masters.named_masters()):
        assert torch.equal(m, ref)


def test_what_crosses_the_bus_is_the_state_in_and_out_each_step(tmp_path, dataset):
    """Per step and trained element: both moments (4 bytes each, 2 with bf16 state), the fp32 master at
    O2, each in and out; plus a 4-byte step count per tensor. Nothing else (gradients, weights) moves."""
    steps = 3
    for name, sections, per_element in [
        ("fp32", {}, 8), ("bf16 state", {"train": {"optimizer_state_dtype": "bf16"}}, 4),
        ("O2", {"optimize": {"mixed_precision": "bf16"}}, 12),
    ]:
        _, _, trainer = _train(tmp_path, dataset, name, steps=steps, **_streamed(sections))
        opt = trainer.state.optimizer
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        expected = steps * (sum(p.numel() for p in params) * per_element + 4 * len(params))
        assert opt.bytes_in == expected, name
        assert opt.bytes_out == expected, name
        assert opt.host_bytes() == sum(p.numel() for p in params) * per_element + 4 * len(params), name


def test_prefetch_follows_the_order_gradients_arrive_in(tmp_path, dataset):
    """With the optimizer in backward the first step learns the order the gradients become final; from
    then on each parameter's state was fetched while the one before it was updated (one late fetch a
    step: the first)."""
    steps = 4
    _, _, trainer = _train(tmp_path, dataset, "inbw", steps=steps,
                           **_streamed({"train": {"optimizer_in_backward": True, "max_grad_norm": None}}))
    opt = trainer.state.optimizer
    tensors = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    first_step_late = opt.fetched_late - (steps - 1)
    assert first_step_late < tensors  # the reverse-of-registration guess already fetches most ahead
    assert opt.fetched_late <= first_step_late + (steps - 1)


def test_a_streamed_checkpoint_resumes_exactly_and_loads_into_the_plain_path(tmp_path, dataset):
    """4 steps with a checkpoint at step 2; resumed from it, steps 3 and 4 are the same, streamed again
    (host state loaded in place) or on the plain path (the state then lives on the device)."""
    saves = {"train": {"save_steps": 2, "keep_checkpoints": 2}}
    whole = _train(tmp_path, dataset, "run", steps=4, **_streamed(saves))
    for i, sections in enumerate((_streamed(saves), saves)):
        shutil.copytree(tmp_path / "run", tmp_path / f"again{i}")
        step_2 = tmp_path / f"again{i}" / "run" / "checkpoints" / "step_00000002"
        shutil.rmtree(step_2.parent / "step_00000004")
        resumed = _train(tmp_path, dataset, f"again{i}", steps=4, resume=str(step_2), **sections)
        for step in (3, 4):
            assert resumed[0].losses[step] == whole[0].losses[step]
        for n in whole[1]:
            assert torch.equal(whole[1][n], resumed[1][n]), n


def test_a_non_finite_step_leaves_weights_and_state_as_they_were(tmp_path, dataset):
    cfg = with_changes(tiny_config(tmp_path, max_steps=2, nan_policy="skip"), optimize=STREAM)
    trainer = Trainer(cfg, train_dataset=dataset)
    trainer.state = trainer.setup(overwrite=True)
    batches = trainer.state.loader.next_step()
    trainer.train_step(batches, 0)
    trainer.state.optimizer.settle()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = [v.clone() for st in trainer.state.optimizer.state.values() for v in st.values()]
    handle = trainer.model.layers["0"].attention.wq.weight.register_hook(lambda g: g * float("inf"))
    result = trainer.train_step(trainer.state.loader.next_step(), 1)
    handle.remove()
    trainer.settle(result)
    assert result.skipped
    trainer.state.optimizer.settle()
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    after = [v for st in trainer.state.optimizer.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(state, after))


@pytest.mark.parametrize("sections, words", [
    ({"train": {"optimizer": "sgd"}}, ["train.optimizer sgd", "adamw or adamw_8bit"]),
    ({"train": {"optimizer": "paged_adamw_8bit"}}, ["paged_adamw_8bit", "adamw or adamw_8bit"]),
    ({"parallel": {"tensor_parallel": 2}}, ["offload_optimizer", "tensor parallelism"]),
    ({"parallel": {"data_parallel": 2, "zero_stage": 1}}, ["zero_stage 1", "2 or 3"]),
])
def test_layouts_the_stream_cannot_run_are_refused_with_the_fix(tmp_path, sections, words):
    cfg = with_changes(tiny_config(tmp_path), **_streamed(sections))
    devices = cfg.parallel.tensor_parallel * max(cfg.parallel.data_parallel, 1)
    with pytest.raises(ConfigError) as err:
        check_offload(cfg, torch.device("cpu"), layout_for(cfg, devices))
    for w in words:
        assert w in str(err.value)


def _tensors(seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of awkward sizes: several chunks, a partial last chunk, one under a block, a vector."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(40, 64), (1000,), (24, 48), (7,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_chunks_of_a_tensor_stream_one_at_a_time_and_update_as_the_whole(tmp_path):
    """State streamed 256 elements at a time gives torch's fused AdamW over whole tensors, bit for bit."""
    ref, streamed = _tensors(), _tensors()
    _steps(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True), ref)
    opt = StreamedAdam(streamed, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True,
                       device=torch.device("cpu"), chunk_elements=256)
    _steps(opt, streamed)
    for a, b in zip(ref, streamed):
        assert torch.equal(a, b)
    assert opt.bytes_in == opt.bytes_out == 5 * sum(p.numel() * 8 + 4 for p in streamed)
    assert opt.fetched_late == 5  # each step's first unit; every other unit was fetched ahead


def test_eight_bit_state_streams_as_torchaos_adamw8bit_updates(tmp_path):
    """adamw_8bit + stream: torchao's 8-bit moments in host memory, its own update on the device, chunk by
    chunk (chunks are whole blocks, so block-wise quantisation is unchanged): torchao's AdamW8bit, eager,
    bit for bit; the moments of tensors of 4096+ elements are 8-bit on the host (a quarter of fp32's)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    ref, streamed = _tensors(), _tensors()
    with torch.compiler.set_stance("force_eager"):
        _steps(torchao_optim.AdamW8bit(ref, lr=1e-2, weight_decay=0.1), ref)
    opt = StreamedAdam(streamed, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True,
                       device=torch.device("cpu"), eight_bit=True, chunk_elements=1024)
    _steps(opt, streamed)
    for a, b in zip(ref, streamed):
        assert torch.equal(a, b)
    big = streamed[0]  # 2560 elements: under torchao's 4096, so plain; grow one to see the 8-bit state
    assert not hasattr(opt.state[big]["exp_avg"], "codes")
    large = [torch.nn.Parameter(torch.randn(64, 96))]
    ref_large = [torch.nn.Parameter(large[0].detach().clone())]
    with torch.compiler.set_stance("force_eager"):
        _steps(torchao_optim.AdamW8bit(ref_large, lr=1e-2), ref_large)
    opt8 = StreamedAdam(large, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True,
                        device=torch.device("cpu"), eight_bit=True, chunk_elements=1024)
    _steps(opt8, large)
    assert torch.equal(large[0], ref_large[0])
    moment = opt8.state[large[0]]["exp_avg"]
    assert moment.codes.dtype == torch.uint8 and moment.codes.device.type == "cpu"
    assert opt8.host_bytes() == 2 * (6144 + 6144 // 256 * 4) + 4


def test_a_skipped_eight_bit_step_changes_nothing():
    pytest.importorskip("torchao.optim")
    params = [torch.nn.Parameter(torch.randn(64, 96))]
    opt = StreamedAdam(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True,
                       device=torch.device("cpu"), eight_bit=True, chunk_elements=1024)
    _steps(opt, params, steps=2)
    before = params[0].detach().clone()
    st = opt.state[params[0]]
    codes, scale, step = st["exp_avg"].codes.clone(), st["exp_avg_sq"].scale.clone(), st["step"].clone()
    params[0].grad = torch.randn(64, 96)
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    assert torch.equal(params[0], before)
    assert torch.equal(st["exp_avg"].codes, codes) and torch.equal(st["exp_avg_sq"].scale, scale)
    assert torch.equal(st["step"], step)
