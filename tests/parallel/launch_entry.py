"""A tiny rank program for tests/parallel/test_launch.py: join the group, all-reduce, write the result.

    python -m tests.parallel.launch_entry OUT_DIR MODE

MODE: ok (every rank writes rank_<r>.json), fail (rank 1 raises after joining; rank 0 waits in a
collective), fail_once (rank 1 fails unless OUT_DIR/marker exists, and creates it: the restarted
group succeeds).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from shardwise.parallel.launch import init_distributed, restart_count, shutdown

    out, mode = Path(argv[0]), argv[1]
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=float(os.environ.get("LAUNCH_TEST_TIMEOUT", "60")))
    if mode == "fail" and ctx.rank == 1:
        raise RuntimeError(f"rank {ctx.rank} failed on purpose (launch test)")
    if mode == "fail_once" and ctx.rank == 1 and not (out / "marker").exists():
        (out / "marker").write_text("failed once")
        raise RuntimeError("rank 1 fails on the first attempt only")
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    (out / f"rank_{ctx.rank}.json").write_text(json.dumps({
        "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank, "sum": value.item(),
        "backend": ctx.backend, "launcher": ctx.launcher, "restart_count": restart_count(),
        "group_restart_count": ctx.restart_count,
        "omp": os.environ.get("OMP_NUM_THREADS"), "argv": argv}))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
