"""The parallel layout of a run: degrees, their validation, and the device mesh.

The mesh has four named dimensions, outermost first: "pp" (pipeline stages), "dp_replicate" (HSDP
replicas, usually across nodes), "dp_shard" (ZeRO/FSDP sharding) and "tp" (tensor parallel,
innermost so that its heavy traffic stays inside a node). Dimensions of size 1 are kept, so code
can always slice `mesh["tp"]`; "dp" is the flattened (dp_replicate, dp_shard) pair, the group over
which data is split and gradients are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from ..errors import ConfigError
from .pipeline import check_pipeline

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the number of processes."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    #: FSDP2 on a one-process group and size-1 meshes: optimize.offload_params on one device, whose CPU
    #: offload is FSDP2's (`data_parallel.fsdp_on_one_process`). The degrees stay 1.
    one_process_fsdp: bool = False

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel degree {name} must be at least 1, got {getattr(self, name)}")

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def uses_fsdp(self) -> bool:
        """Whether FSDP2's machinery (fully_shard, replicate) wraps the model: data parallelism, or
        offload_params on one process. Its sharded fp32 parameters are then the master weights at O2."""
        return self.dp > 1 or self.one_process_fsdp

    @property
    def needs_meshes(self) -> bool:
        """Whether the run needs a process group and device meshes."""
        return self.distributed or self.one_process_fsdp

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.tp * self.pp

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    def build_meshes(self, device_type: str) -> "Meshes":
        """The 4-D device mesh ("pp", "dp_replicate", "dp_shard", "tp") and the sub-meshes code uses."""
        world = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS
        )
        # torch wants flattened meshes kept by their maker rather than sliced from the root again.
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        return Meshes(world=world, dp=dp)


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the flattened data-parallel mesh; slice the root for "pp", "tp", ..."""

    world: object  # DeviceMesh
    dp: object  # DeviceMesh: 1-D, (dp_replicate x dp_shard) ranks that hold different data

    def __getitem__(self, name: str | tuple[str, ...]):  # noqa: ANN204 - DeviceMesh
        """A named sub-mesh: "dp", or any of MESH_DIMS (or a tuple of them) sliced from the root."""
        return self.dp if name == "dp" else self.world[name]


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
    raise ConfigError(
        f"the layout data_parallel {dims.dp} x tensor_parallel {dims.tp} x pipeline_parallel {dims.pp} = "
        f"{dims.world_size} processes, but {world_size} are running; set the degrees so that their "
        f"product is {world_size} (data_parallel: -1 takes what the others leave). Layouts for "
        f"{world_size}: {options}"
    )


def dims_from_config(parallel, world_size: int) -> ParallelDims:  # noqa: ANN001 - config.ParallelConfig
    """The ParallelDims of a config's `parallel` section for `world_size` processes (validated)."""
    tp_pp = parallel.tensor_parallel * parallel.pipeline_parallel
    dp = parallel.data_parallel
    if dp == -1:
        if world_size % tp_pp:
            raise ConfigError(
                f"parallel.data_parallel is -1 but {world_size} processes are not divisible by "
                f"tensor_parallel x pipeline_parallel = {tp_pp}; layouts for {world_size}: "
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
                        pp=parallel.pipeline_parallel)
    check_world_size(dims, world_size)
    return dims


def check_layout(cfg: Any) -> None:
    """What of a config's layout can be checked before any process starts: the pipeline's stages,
    schedule, virtual stages and stage layers against the model. (Whether micro_batch_num suits the
    schedule is checked when a run starts, in `layout_for`, so that configs written for other
    frameworks, seed 002's, load.)"""
    p = cfg.parallel
    if p.pipeline_parallel > 1:
        check_pipeline(cfg.model.num_layers, p.pipeline_parallel, p.virtual_stages, p.schedule, p.stage_layers)


def layout_for(cfg: Any, world_size: int) -> ParallelDims:
    """The run's parallel layout for `world_size` processes, every check of it done."""
    p = cfg.parallel
    if world_size == 1 and p.world_size() != 1:
        need = p.world_size()
        raise ConfigError(
            f"this config needs {need} processes (data_parallel {p.dp_degree()} x tensor_parallel "
            f"{p.tensor_parallel} x pipeline_parallel {p.pipeline_parallel}) but runs as one; start it with "
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
    return (f", {dims.world_size} processes (dp {dims.dp} x tp {dims.tp} x pp {dims.pp}, ZeRO "
            f"{p.zero_stage}{pipeline})")
