"""train.async_save on a CUDA GPU: FSDP2 on a CUDA mesh (one process, "cuda:nccl,cpu:gloo"), an async save
staged into pinned host memory while training moves on, its tensors equal to a synchronous save's.

    python3 tests/checkpoint/async_save_cuda.py [TMP_DIR]    # prints one JSON line; "ok": true when it holds

Run by tests/checkpoint/test_async_save.py where CUDA is available, and by bench/gpu_checks.sh on a lent GPU.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardwise.checkpoint import storage
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.models.config import ModelConfig
from shardwise.models.transformer import build_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _saved(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for group, names in storage.read_trainer_state(path)["shapes"].items():
        out.update({f"{group}.{n}": t for n, t in storage.read_saved_tensors(path, group, sorted(names)).items()})
    return out


def main(tmp: Path) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=160, max_position_embeddings=64)).cuda()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randint(0, 256, (2, 32), device="cuda")).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    gate, original = threading.Event(), storage._write_tensors

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the background write waits for the next step
        gate.wait(60)
        return original(*args, **kwargs)
    storage._write_tensors = held
    sync = Checkpointer(tmp / "sync", [model], opt).save(1)
    ckpt = Checkpointer(tmp / "async", [model], opt, async_save=True)
    path = ckpt.save(1)
    staged = list(ckpt._stager._state_dict_stager._cached_storage_mapping.values())
    pinned = [s.is_pinned() for s in staged if s.nbytes() >= 5]  # DCP's stager leaves tiny ones unpinned
    step()
    gate.set()
    ckpt.wait()
    a, b = _saved(path), _saved(sync)
    differ = sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    dist.destroy_process_group()
    return {"ok": bool(a) and not differ and bool(pinned) and all(pinned), "tensors": len(a), "differ": differ,
            "pinned": f"{sum(pinned)} of {len(pinned)} staged storages"}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))))
