"""Activation offload moves what every recompute mode keeps (issue 25, item 3).

For recompute `none`, `full` and `selective` on a tiny model, one forward under `ActivationOffload`
is held against the same forward without it: what a plain forward leaves alive for backward (every
storage an op made, held weakly, that is still alive afterwards: autograd's saved tensors and torch's
selective-checkpoint cache alike) must have gone to the host, byte for byte, with nothing left on the
device but the RoPE tables a checkpoint keeps in its closure; the blocks' share of the bytes moved must
be the estimator's host figure; and the gradients must be the plain run's exactly (fp32). On this
machine host and device are one memory, so the copies are counted, not the devices.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.memory.estimate import estimate_memory
from shardwise.memory.offload import ActivationOffload, SavedCopies
from shardwise.models import build_model
from shardwise.parallel.recompute import apply_recompute

from ..train.conftest import SEQ, tiny_config, with_changes

BATCH = 2


class _Made(TorchDispatchMode):
    """Every storage an op returns while it is active, held weakly with its address and size."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[int, StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages.append((s.data_ptr(), StorageWeakRef(s), s.nbytes()))
        return out

    def alive(self, besides: set[int]) -> int:
        """Bytes of the storages still alive, but those at the addresses `besides`."""
        live = {ptr: n for ptr, ref, n in self.storages if not ref.expired() and ptr not in besides}
        return sum(live.values())


class _Counted(ActivationOffload):
    """Records each host copy it makes and where the forward was when it made it (a block's name, or
    "outside" the blocks)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.copies: dict[int, torch.Tensor] = {}
        self.moved: dict[str, int] = {}
        self.where = "outside"

    def _pack(self, t: torch.Tensor):  # noqa: ANN202
        packed = super()._pack(t)
        if isinstance(packed, tuple) and packed[0].data_ptr() not in self.copies:
            self.copies[packed[0].data_ptr()] = packed[0]
            self.moved[self.where] = self.moved.get(self.where, 0) + packed[0].nbytes
        return packed


def _config(tmp: Path, recompute: str):  # noqa: ANN202
    return with_changes(tiny_config(tmp, micro_batch_size=BATCH),
                        optimize={"recompute": recompute, "offload_activations": True})


def _forward_backward(cfg, offload: bool) -> dict:  # noqa: ANN001
    """One forward (under activation offload or not) and its backward: the bytes alive on the device
    after the forward, the offload's copies, the loss and the gradients."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_recompute(model, cfg.optimize.recompute)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    counted = _Counted() if offload else None
    if counted:
        for name, block in model.layers.items():
            block.register_forward_pre_hook(lambda *_, n=name: setattr(counted, "where", n))
            block.register_forward_hook(lambda *_: setattr(counted, "where", "outside"))
    before = {t.untyped_storage().data_ptr() for t in [tokens, *model.parameters(), *model.buffers()]}
    with _Made() as made, counted or contextlib.nullcontext():
        loss = model(tokens).logsumexp(-1).mean()
    ours = before | {loss.untyped_storage().data_ptr()} | set(counted.copies if counted else ())
    left = made.alive(besides=ours)
    loss.backward()
    return {"left": left, "moved": counted.moved if counted else {}, "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}, "blocks": list(model.layers)}


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_offload_moves_what_each_recompute_mode_keeps(tmp_path: Path, recompute: str) -> None:
    cfg = _config(tmp_path, recompute)
    plain, off = _forward_backward(cfg, offload=False), _forward_backward(cfg, offload=True)
    m = cfg.model
    rope = 2 * SEQ * m.head_dim * 4  # the fp32 cos and sin of the micro-batch's positions, shared by the blocks
    token_ids = BATCH * SEQ * 8  # the embedding saves the token ids, which the caller holds: a copy moves
    # A checkpointed block keeps its arguments that are not tensors in the checkpoint's closure: the
    # (cos, sin) pair stays. Without recompute the first block's RoPE saves them, and they move.
    stays = 0 if recompute == "none" else rope
    assert off["left"] == stays, f"{off['left'] - stays} bytes kept for backward stayed on the device"
    moved = sum(off["moved"].values())
    assert moved - token_ids == plain["left"] - stays  # every other byte a plain forward keeps went to the host

    # The estimator: what the blocks save goes to the host; it keeps the RoPE tables with the model part.
    blocks = sum(off["moved"].get(name, 0) for name in off["blocks"])
    host = estimate_memory(cfg, 1, "cpu").detail["host_offload"]["activations"]
    assert blocks == host + (rope if recompute == "none" else 0)

    assert torch.equal(off["loss"], plain["loss"])
    for name, grad in plain["grads"].items():
        assert torch.equal(off["grads"][name], grad), name


class _Watched(ActivationOffload):
    """Sends its copies back as an accelerator run does (real copies into fresh memory, here on the CPU)
    and records, at every storage backward takes, the groups whose copies are on the "device" then."""

    def __init__(self, blocks) -> None:  # noqa: ANN001
        super().__init__(torch.device("cpu"), blocks)
        self.seen: list[tuple[int, set[int]]] = []  # (group backward is in, groups with copies on the device)
        self.forwards: list[SavedCopies] = []

    def __enter__(self) -> None:
        super().__enter__()
        copies = self._copies
        copies.back_to_device = True
        take = copies.take

        def watched(i: int) -> torch.Tensor:
            raw = take(i)
            self.seen.append((copies.position, {copies.group_of[j] for j in copies.on_device}))
            return raw

        copies.take = watched
        self.forwards.append(copies)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_copies_come_back_a_block_ahead_and_leave_once_taken(tmp_path: Path, recompute: str) -> None:
    cfg = _config(tmp_path, recompute)
    plain = _forward_backward(cfg, offload=False)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_recompute(model, cfg.optimize.recompute)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    watched = _Watched(list(model.layers.values()))
    with watched:
        loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    copies = watched.forwards[0]
    blocks = len(model.layers)
    assert len(copies.groups) == blocks + 1 and all(copies.groups)  # the embedding's, then one per block
    position = [g for g, _ in watched.seen]
    assert position == sorted(position, reverse=True) and set(position) == set(range(blocks + 1))  # head down
    for g, resident in watched.seen:
        assert resident <= {g, g - 1}, f"backward in group {g}, groups {sorted(resident)} are on the device"
    # every group but the embedding's was on the device beside the one before it: fetched ahead
    assert {g for g, resident in watched.seen if g - 1 in resident} == set(range(1, blocks + 1))
    assert not copies.on_device and not any(copies.untaken)  # each copy left once all its tensors were taken
    assert torch.equal(loss.detach(), plain["loss"])
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, plain["grads"][name]), name
