"""A rank program for tests/train/test_shared_storage.py: a two-rank run whose run directory may not be
shared (the test gives rank 1 a directory of its own at the same path).

    python -m tests.train.shared_storage_entry ROOT

Trains (expecting the shared-storage check to stop it before training), then saves a checkpoint
directly (expecting it not to be published), and writes what it saw to ROOT/out/rank_<r>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    import torch

    from shardwise.checkpoint.storage import save_checkpoint
    from shardwise.data.packing import PackedDataset
    from shardwise.parallel.launch import init_distributed, shutdown
    from shardwise.train.trainer import Trainer

    from .conftest import SEQ, make_tokens, tiny_config, with_changes

    root = Path(argv[0])
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=60)
    seen: dict = {"rank": ctx.rank}
    prepared = []
    real_prepare = Trainer._prepare_data
    Trainer._prepare_data = lambda self: (prepared.append(1), real_prepare(self))[1]
    cfg = with_changes(tiny_config(root / "shared", max_steps=2, micro_batch_size=2),
                       train={"output_dir": str(root / "shared" / "run")}, parallel={"data_parallel": 2})
    trainer = Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ))
    start = time.monotonic()
    try:
        trainer.train()
        seen["train"] = "trained"
    except Exception as e:  # noqa: BLE001 - what this rank saw
        seen["train"] = f"{type(e).__name__}: {e}"
    seen.update(train_s=time.monotonic() - start, set_up=trainer.state is not None, prepared_data=bool(prepared))
    # Each rank holds a tensor of its own (as pipeline stages do), so each writes a shard file.
    tensors = {"model": {f"w{ctx.rank}": torch.full((3,), float(ctx.rank))}}
    try:
        save_checkpoint(root / "shared" / "saves", 1, tensors, {"loader": {}})
        seen["save"] = "saved"
    except Exception as e:  # noqa: BLE001
        seen["save"] = f"{type(e).__name__}: {e}"
    (root / "out" / f"rank_{ctx.rank}.json").write_text(json.dumps(seen))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
