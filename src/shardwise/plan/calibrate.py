"""Measuring this machine's links and CPU as the planner sees them: gloo collectives between local
processes, matmul rates per thread count, memory bandwidth (`measure_cpu`, behind the catalogue's
`cpu` entry and bench/plan_calibration.py's `--measure-hardware`).

Every figure is the best of repeated runs: a shared machine only slows things down, so the best is
the undisturbed rate.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from ..hardware import best_rate, matmul_flops


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], seconds: float, out: Any) -> None:
    """One rank of the gloo measurement: best all-reduce and send/recv times per message size."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    result: dict[str, dict[int, float]] = {"all_reduce": {}, "p2p": {}}
    for size in sizes:
        t = torch.ones(size // 4)
        for kind in ("all_reduce", "p2p"):
            best, rounds = float("inf"), 0
            end = time.perf_counter() + seconds
            while True:
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(t)
                elif rank == 0:
                    dist.send(t, 1)
                elif rank == 1:
                    dist.recv(t, 0)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
                best, rounds = min(best, float(elapsed)), rounds + 1
                # Every rank stops after the same round: rank 0 decides.
                stop = torch.tensor([float(rounds >= 3 and time.perf_counter() >= end)])
                dist.broadcast(stop, 0)
                if stop.item():
                    break
            result[kind][size] = best
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def measure_collectives(world: int, sizes: tuple[int, ...] = (4, 1 << 20, 16 << 20, 64 << 20),
                        seconds: float = 1.0) -> dict[str, dict[int, float]]:
    """Best gloo all-reduce and rank 0 -> 1 send times (s) per message size (bytes) over `world` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_worker, args=(r, world, port, list(sizes), seconds, out))
             for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    return result


def measure_cpu(seconds: float = 2.0, worlds: tuple[int, ...] = (2, 4)) -> dict[str, Any]:
    """Measure this CPU as the planner sees it: matmul TFLOP/s per thread count, memory bandwidth, and
    gloo all-reduce bus bandwidth and latency between processes. Best of repeated runs (a shared
    machine only slows things down), so these are the undisturbed rates."""
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"cores": os.cpu_count(), "matmul_tflops": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for t in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(t)
            out["matmul_tflops"][f"{str(dtype).split('.')[-1]}_{t}thread"] = matmul_flops(dtype, seconds) / 1e12
    torch.set_num_threads(1)
    src = torch.ones(64 << 18)  # 64 MiB
    dst = torch.empty_like(src)
    # A copy reads and writes every byte; AdamW streams its tensors the same way.
    out["memory_gbps_1thread"] = best_rate(lambda: dst.copy_(src), 2 * src.numel() * 4, seconds) / 1e9
    torch.set_num_threads(threads)
    for world in worlds:
        times = measure_collectives(world, seconds=seconds / 2)
        ar = times["all_reduce"]
        big = max(ar)
        # Ring all-reduce moves 2 (n-1)/n of the message through every rank's link: the "bus" bandwidth.
        out[f"gloo_{world}"] = {
            "all_reduce_bus_gbps": 2 * (world - 1) / world * big / ar[big] / 1e9,
            "all_reduce_latency_us": ar[min(ar)] * 1e6,
            "p2p_gbps": big / times["p2p"][big] / 1e9,
            "all_reduce_s": {str(k): v for k, v in ar.items()},
        }
    return out
