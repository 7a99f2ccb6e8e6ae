"""The run config read as the trainer reads it: the parallel layout resolved against a device count and
checked (`Layout`: degrees, ZeRO stage, batch shape, pipeline stages, offload), the bytes of an element of
each kind of tensor under the precision level (`Precision`), and which offload_optimizer engine, if any,
keeps the optimizer in host memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...errors import ConfigError
from ...parallel.context import check_context_parallel
from ...parallel.data_parallel import one_process_fsdp_settings
from ...parallel.pipeline import check_pipeline
from ...parallel.tensor import check_tensor_parallel


@dataclass(frozen=True)
class Layout:
    # dp and dp_shard count the ranks gradients are reduced and ZeRO shards over: with context parallelism
    # data parallel x cp (`cp` of them hold the chunks of the same samples; `seq` is the whole sequence).
    """Degrees and batch shape of a run, resolved against a device count."""

    dp: int
    dp_shard: int
    tp: int
    pp: int
    virtual_stages: int
    zero: int
    sequence_parallel: bool
    micro_batch: int  # samples per micro-batch
    seq: int
    accumulation: int  # micro-batches per optimizer step on a data-parallel rank
    micro_batch_num: int  # pipeline micro-batches per schedule step
    schedule: str
    stage_counts: tuple[int, ...]  # layers per pipeline stage
    offload: bool
    reduce_every: bool  # ZeRO 2/3: gradients reduce-scattered every micro-batch (parallel.reduce_gradients)
    one_process_fsdp: bool = False  # offload_params on one accelerator: FSDP2 (ZeRO-3) on a one-process group
    cp: int = 1  # context parallel: each sequence split over this many ranks


def resolve_layout(cfg: Any, devices: Optional[int], device: str = "cuda") -> Layout:
    """Resolve and check the parallel layout the way the trainer will on devices of kind `device`."""
    p, m = cfg.parallel, cfg.model
    world = p.world_size(devices)
    if devices is not None and world != devices:
        raise ConfigError(
            f"the layout needs data_parallel {p.dp_degree(devices)} x tensor_parallel {p.tensor_parallel} x "
            f"pipeline_parallel {p.pipeline_parallel} x context_parallel {p.context_parallel} = {world} devices, "
            f"not {devices}; set "
            "parallel.data_parallel: -1 to use every device, or change the degrees")
    dp = p.dp_degree(devices)
    if dp % p.data_parallel_replicate:
        raise ConfigError(f"parallel.data_parallel_replicate {p.data_parallel_replicate} must divide the "
                          f"data-parallel degree {dp}")
    check_tensor_parallel(m, p.tensor_parallel)
    seq = cfg.data.seq_length or m.max_position_embeddings
    if seq > m.max_position_embeddings:
        raise ConfigError(f"data.seq_length {seq} exceeds model.max_position_embeddings {m.max_position_embeddings}")
    sp = p.sequence_parallel and p.tensor_parallel > 1
    if sp and seq % p.tensor_parallel:
        raise ConfigError(f"sequence parallel splits data.seq_length {seq} over tensor_parallel "
                          f"{p.tensor_parallel}: use a multiple of {p.tensor_parallel} or sequence_parallel: false")
    check_context_parallel(cfg)
    cp = p.context_parallel
    if sp and (seq // cp) % p.tensor_parallel:
        raise ConfigError(f"sequence parallel splits each context-parallel chunk of {seq // cp} tokens over "
                          f"tensor_parallel {p.tensor_parallel}: make data.seq_length a multiple of "
                          f"{cp * p.tensor_parallel} or set sequence_parallel: false")
    if p.pipeline_parallel > 1:
        counts = check_pipeline(m.num_layers, p.pipeline_parallel, p.virtual_stages, p.schedule, p.stage_layers,
                                p.micro_batch_num)
    else:
        counts = [m.num_layers]
    offload = cfg.optimize.offload_params  # FSDP2's CPU offload; offload_optimizer alone: `offloads_optimizer`
    if (offload or cfg.optimize.offload_optimizer) and dp > 1 and p.zero_stage < 2:
        raise ConfigError(f"CPU offload needs zero_stage 2 or 3, got {p.zero_stage}: ZeRO 0 and 1 keep full "
                          "replicas on every device; set parallel.zero_stage: 3 to offload")
    zero, reduce_every = (p.zero_stage if dp * cp > 1 else 0), p.reduces_every_micro_batch()
    # On one accelerator offload_params is FSDP2's CPU offload on a one-process group, at ZeRO-3
    # (`parallel.data_parallel.fsdp_on_one_process`); on one CPU it changes nothing.
    alone = offload and world == 1 and device != "cpu"
    if alone:
        zero, reduce_every = one_process_fsdp_settings(cfg)
    return Layout(dp=dp * cp, dp_shard=dp // p.data_parallel_replicate * cp, tp=p.tensor_parallel,
                   pp=p.pipeline_parallel,
                   virtual_stages=p.virtual_stages if p.pipeline_parallel > 1 else 1,
                   zero=zero,
                   sequence_parallel=sp, micro_batch=cfg.train.micro_batch_size, seq=seq,
                   accumulation=cfg.gradient_accumulation(world), micro_batch_num=p.micro_batch_num,
                   schedule=p.schedule, stage_counts=tuple(counts), offload=offload and (dp > 1 or alone),
                   reduce_every=reduce_every, one_process_fsdp=alone, cp=cp)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor under a precision level and layout."""

    level: str
    param: int  # stored model parameters that train
    compute: int  # activations and the parameters the forward uses
    grad: int  # gradients as the optimizer sees them
    state: int  # optimizer state
    masters: bool  # separate fp32 master copies (O2 in one process)
    # Stored frozen parameters: the compute dtype at O2/O3 in every layout (no master, no fp32 shard;
    # `parallel.data_parallel.store_frozen_in`), where ZeRO 0/1 also leave them out of replicate's copy.
    frozen: int = 4


def resolve_precision(cfg: Any, lay: Layout) -> Precision:
    level = cfg.optimize.level()
    half = cfg.optimize.mixed_precision != "fp32"
    if level in ("O0", "O1") or not half:
        return Precision(level, 4, 4, 4, 4, False)
    if level == "O3":
        return Precision(level, 2, 2, 2, 2, False, frozen=2)
    if (lay.dp > 1 or lay.one_process_fsdp) and not _host_masters(cfg):  # O2 under FSDP2: its fp32 parameters
        return Precision(level, 4, 2, 4, 4, False, frozen=2)  # are the masters of what trains
    if streams_optimizer(cfg):  # the streamed update reads the 16-bit gradients where they are
        return Precision(level, 2, 2, 2, 4, True, frozen=2)
    # O2 in one process (or TP/PP only): 16-bit weights, gradients accumulated in the fp32 masters.
    return Precision(level, 2, 2, 4, 4, True, frozen=2)


def offloads_optimizer(cfg: Any) -> bool:
    """optimize.offload_optimizer cpu (`memory.offload.HostMasters`); with offload_params on as well, FSDP2's
    CPU offload steps the optimizer on the host instead."""
    return cfg.optimize.offload_optimizer == "cpu" and not cfg.optimize.offload_params


def streams_optimizer(cfg: Any) -> bool:
    """optimize.offload_optimizer stream (`memory.streamed_optimizer.StreamedAdam`)."""
    return cfg.optimize.offload_optimizer == "stream" and not cfg.optimize.offload_params


def _host_masters(cfg: Any) -> bool:
    """Whether the fp32 masters of O2 live in host memory (either offload_optimizer engine), so that FSDP2
    keeps 16-bit shards under data parallelism."""
    return offloads_optimizer(cfg) or streams_optimizer(cfg)
