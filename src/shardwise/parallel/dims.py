"""The parallel layout of a run: degrees, their validation, and the device mesh.

The mesh has five named dimensions, outermost first: "pp" (pipeline stages), "dp_replicate" (HSDP
replicas, usually across nodes), "dp_shard" (ZeRO/FSDP sharding), "cp" (context parallel: the
sequence split, `context.py`) and "tp" (tensor parallel, innermost so that its heavy traffic stays
inside a node). Dimensions of size 1 are kept, so code can always slice `mesh["tp"]`; "dp" is the
flattened (dp_replicate, dp_shard) pair, the group over which data is split. Gradients are reduced
over "dp", and with context parallelism over "dp_cp" (dp x cp: the cp ranks of a replica hold
different tokens of the same samples), whose sharding part is "dp_shard_cp" (torchtitan's layout).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from ..errors import ConfigError
from .context import check_context_parallel
from .pipeline import check_pipeline

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the number of processes."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: ranks that split each sequence (parallel.context_parallel)
    #: FSDP2 on a one-process group and size-1 meshes: optimize.offload_params on one device, whose CPU
    #: offload is FSDP2's (`data_parallel.fsdp_on_one_process`). The degrees stay 1.
    one_process_fsdp: bool = False

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel degree {name} must be at least 1, got {getattr(self, name)}")

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are reduced (and ZeRO shards): data parallel x context parallel."""
        return self.dp * self.cp

    @property
    def uses_fsdp(self) -> bool:
        """Whether FSDP2's machinery (fully_shard, replicate) wraps the model: data or context parallelism,
        or offload_params on one process. Its sharded fp32 parameters are then the master weights at O2."""
        return self.dp_cp > 1 or self.one_process_fsdp

    @property
    def needs_meshes(self) -> bool:
        """Whether the run needs a process group and device meshes."""
        return self.distributed or self.one_process_fsdp

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    def build_meshes(self, device_type: str) -> "Meshes":
        """The 5-D device mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp") and the sub-meshes code uses."""
        world = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=MESH_DIMS
        )
        # torch wants flattened meshes kept by their maker rather than sliced from the root again.
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        if self.cp == 1:
            return Meshes(world=world, dp=dp)
        return Meshes(world=world, dp=dp, dp_shard_cp=world["dp_shard", "cp"]._flatten("dp_shard_cp"),
                      dp_cp=world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"))


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the flattened data-parallel mesh; slice the root for "pp", "tp", ..."""

    world: object  # DeviceMesh
    dp: object  # DeviceMesh: 1-D, (dp_replicate x dp_shard) ranks that hold different data
    # Context parallel only (None without): the 1-D (dp_shard x cp) and (dp_replicate x dp_shard x cp)
    # meshes over which ZeRO shards and gradients are reduced.
    dp_shard_cp: object = None
    dp_cp: object = None

    def __getitem__(self, name: str | tuple[str, ...]):  # noqa: ANN204 - DeviceMesh
        """A named sub-mesh: "dp", "dp_shard_cp", "dp_cp", or any of MESH_DIMS (or a tuple of them) sliced
        from the root."""
        if name in ("dp", "dp_shard_cp", "dp_cp"):
            return getattr(self, name)
        return self.world[name]

    def gradient_mesh(self, name: str):  # noqa: ANN201 - DeviceMesh
        """The mesh gradients are reduced over in place of data-parallel `name` ("dp" or "dp_shard"): itself,
        or its context-parallel widening ("dp_cp", "dp_shard_cp") when the sequence is split."""
        if self.dp_cp is None:
            return self[name]
        return self[{"dp": "dp_cp", "dp_shard": "dp_shard_cp"}[name]]

    def hsdp_mesh(self):  # noqa: ANN201 - DeviceMesh
        """The 2-D (replicas, shards) mesh of HSDP: ("dp_replicate", "dp_shard"), or ("dp_replicate",
        "dp_shard_cp") under context parallelism."""
        if self.dp_cp is None:
            return self.world["dp_replicate", "dp_shard"]
        with warnings.catch_warnings():  # torch's own recipe (torchtitan) for a 2-D mesh over a flattened dim
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.world["dp_replicate", "dp_shard_cp"]


def factorisations(world_size: int, tp: int | None = None, pp: int | None = None) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) whose product is `world_size`, optionally with tp or pp fixed."""
    out = []
    for t in range(1, world_size + 1):
        if world_size % t or (tp is not None and t != tp):
            continue
        for p in range(1, world_size // t + 1):
            if (world_size // t) % p or (pp is not None and p != pp):
                continue
            out.append((world_size // (t * p), t, p))
    return out


def check_world_size(dims: ParallelDims, world_size: int) -> None:
    """Refuse a layout whose product is not the process count, listing the layouts that fit."""
    if dims.world_size == world_size:
        return
    options = ", ".join(f"dp {d} x tp {t} x pp {p}" for d, t, p in factorisations(world_size)[:12])
    cp = f" x context_parallel {dims.cp}" if dims.cp > 1 else ""
    raise ConfigError(
        f"the layout data_parallel {dims.dp} x tensor_parallel {dims.tp} x pipeline_parallel {dims.pp}{cp} = "
        f"{dims.world_size} processes, but {world_size} are running; set the degrees so that their "
        f"product is {world_size} (data_parallel: -1 takes what the others leave). Layouts for "
        f"{world_size}: {options}"
    )


def dims_from_config(parallel, world_size: int) -> ParallelDims:  # noqa: ANN001 - config.ParallelConfig
    """The ParallelDims of a config's `parallel` section for `world_size` processes (validated)."""
    cp = parallel.context_parallel
    tp_pp = parallel.tensor_parallel * parallel.pipeline_parallel * cp
    dp = parallel.data_parallel
    if dp == -1:
        if world_size % tp_pp:
            cp_text = f" x context_parallel {cp}" if cp > 1 else ""
            raise ConfigError(
                f"parallel.data_parallel is -1 but {world_size} processes are not divisible by "
                f"tensor_parallel x pipeline_parallel{cp_text} = {tp_pp}; layouts for {world_size}: "
                + ", ".join(f"dp {d} x tp {t} x pp {p}" for d, t, p in factorisations(world_size)[:12])
            )
        dp = world_size // tp_pp
    replicate = parallel.data_parallel_replicate
    if dp % replicate:
        raise ConfigError(
            f"parallel.data_parallel_replicate {replicate} must divide the data-parallel degree {dp} "
            f"(HSDP shards over data_parallel / data_parallel_replicate ranks)"
        )
    dims = ParallelDims(dp_replicate=replicate, dp_shard=dp // replicate, tp=parallel.tensor_parallel,
                        pp=parallel.pipeline_parallel, cp=cp)
    check_world_size(dims, world_size)
    return dims


def check_layout(cfg: Any) -> None:
    """What of a config's layout can be checked before any process starts: the pipeline's stages,
    schedule, virtual stages and stage layers against the model; context parallelism against the model,
    the data and the other settings (`context.check_context_parallel`). (Whether micro_batch_num suits the
    schedule is checked when a run starts, in `layout_for`, so that configs written for other
    frameworks, seed 002's, load.)"""
    p = cfg.parallel
    if p.pipeline_parallel > 1:
        check_pipeline(cfg.model.num_layers, p.pipeline_parallel, p.virtual_stages, p.schedule, p.stage_layers)
    check_context_parallel(cfg)


def layout_for(cfg: Any, world_size: int) -> ParallelDims:
    """The run's parallel layout for `world_size` processes, every check of it done."""
    p = cfg.parallel
    if world_size == 1 and p.world_size() != 1:
        need = p.world_size()
        raise ConfigError(
            f"this config needs {need} processes (data_parallel {p.dp_degree()} x tensor_parallel "
            f"{p.tensor_parallel} x pipeline_parallel {p.pipeline_parallel} x context_parallel "
            f"{p.context_parallel}) but runs as one; start it with "
            f"`shardwise train CONFIG --nproc {need}` (or torchrun --nproc-per-node {need} -m shardwise.cli "
            f"train CONFIG), or set those degrees to 1"
        )
    dims = dims_from_config(p, world_size)
    check_layout(cfg)
    if dims.pp > 1:
        # The micro-batch count must also suit the schedule to run.
        check_pipeline(cfg.model.num_layers, dims.pp, p.virtual_stages, p.schedule, p.stage_layers, p.micro_batch_num)
        cfg.gradient_accumulation(world_size)  # a whole number of pipeline steps per optimizer step
    return dims


def describe_layout(cfg: Any, dims: ParallelDims) -> str:
    """The layout for the log line a run starts with ("" on one process)."""
    if dims.one_process_fsdp:
        return ", one process with FSDP2's CPU offload (parameters, gradients and optimizer state in host memory)"
    if not dims.distributed:
        return ""
    p = cfg.parallel
    pipeline = ""
    if dims.pp > 1:
        stages = f" x {p.virtual_stages} virtual stages" if p.virtual_stages > 1 else ""
        pipeline = f", pipeline schedule {p.schedule}{stages}, {p.micro_batch_num} micro-batches per step"
    cp = f" x cp {dims.cp}" if dims.cp > 1 else ""
    return (f", {dims.world_size} processes (dp {dims.dp} x tp {dims.tp} x pp {dims.pp}{cp}, ZeRO "
            f"{p.zero_stage}{pipeline})")
