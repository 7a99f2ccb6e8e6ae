"""One rank's estimate (`_estimate_rank`): its parameters, gradients and optimizer state as it holds
them (sharded, offloaded), its stages' activations, what the layout adds, then one optimizer step
replayed in the schedule's order (forwards keep a micro-batch's activations, backwards release them) for
each phase's total, the allocator's overhead on CUDA/NPU and what is in host memory; `estimate_all_ranks`
runs it for every pipeline rank and `estimate_memory` keeps the busiest."""

from __future__ import annotations

import math
from typing import Any, Optional

from ...config.schema import PAGED_OPTIMIZERS
from ...errors import ConfigError
from ...parallel.float8 import float8_all_gather, float8_on
from .activations import (
    Shape,
    exchange_bytes,
    float8_transient,
    input_aliased,
    layer_bytes,
    mlp_bytes,
    moe_forward,
    qlora_transient,
    recompute_bytes,
    stage_bytes,
    weight_grad_inputs,
)
from .backward import backward_walk
from .batch import batch_bytes, document_mask
from .head import head_bytes
from .layout import Layout, Precision, offloads_optimizer, resolve_layout, resolve_precision, streams_optimizer
from .optimizer import (
    gradients_in_transit,
    in_backward_updates,
    norm_temp,
    optimizer_phase_total,
    paged_8bit_state_bytes,
    state_element_bytes,
    streamed_updates,
    torchao_8bit_state_bytes,
)
from .parameters import (
    Param,
    chunk_size,
    fsdp_shard,
    layer_flags,
    numel,
    params_of,
    stored_param_bytes,
    tp_shape,
    zero1_part,
)
from .pipeline import (
    Stage,
    in_flight,
    param_stage,
    pipeline_buffers,
    rank_ops,
    rank_stages,
    stage_layers,
    zero_bubble_leftovers,
)
from .result import MemoryEstimate
from .sharding import fsdp_buffers, replicate_buffers, root_reduction

# Caching-allocator reserve above the tensor bytes on CUDA/NPU (block rounding, fragmentation): a
# documented allowance, as a fraction of the tensor peak. 0 on CPU, where tensors are counted exactly.
ALLOCATOR_OVERHEAD = 0.10


def estimate_memory(cfg: Any, devices: Optional[int] = None, device: str = "cuda") -> MemoryEstimate:
    """Memory of the busiest device of the run `cfg` on `devices` devices of kind `device` ("cuda", "npu", "cpu")."""
    return max(estimate_all_ranks(cfg, devices, device), key=lambda e: e.peak)


def estimate_all_ranks(cfg: Any, devices: Optional[int] = None, device: str = "cuda") -> list[MemoryEstimate]:
    """One estimate per distinct rank role: each pipeline rank (its data/tensor-parallel peers are alike)."""
    if device not in ("cuda", "npu", "cpu"):
        raise ConfigError(f"device {device!r} is not known; use cuda, npu or cpu")
    cfg = _as_counted(cfg)
    lay = resolve_layout(cfg, devices, device)
    prec = resolve_precision(cfg, lay)
    params = params_of(cfg)
    return [_estimate_rank(cfg, lay, prec, params, r, device) for r in range(lay.pp)]


def _as_counted(cfg: Any) -> Any:
    """A preference run as the estimate counts it: each pair is two rows (micro-batches of twice
    micro_batch_size rows, padded to at most seq_length); the head's loss is each row's sum, chunked or from
    whole logits as for any run (`head.head_bytes`). The reference model costs nothing more when
    precomputed, and with LoRA its no-grad forward runs before the policy's and is smaller than its peak; a
    frozen copy adds its weights (`_estimate_rank`)."""
    if cfg.data.kind != "preference":
        return cfg
    t = cfg.train
    rows = {"micro_batch_size": 2 * t.micro_batch_size,  # and a global batch in pairs, when set, in rows too
            **({"global_batch_size": 2 * t.global_batch_size} if t.global_batch_size else {})}
    return cfg.model_copy(update={"train": t.model_copy(update=rows)})


def _estimate_rank(cfg: Any, lay: Layout, prec: Precision, params: tuple[Param, ...], pp_rank: int,
                   device: str) -> MemoryEstimate:
    m = cfg.model
    stage_ids = rank_stages(lay, pp_rank)
    num_stages = lay.pp * lay.virtual_stages
    stages = {st: Stage(st, stage_layers(lay, st), st == 0, st == num_stages - 1) for st in stage_ids}
    layers = {i: st for st in stage_ids for i in stages[st].layers}
    first, last = 0 in stages, (num_stages - 1) in stages

    # --- parameters, gradients, optimizer state on this rank
    held: list[Param] = [p for p in params if (p.where == "layer" and p.layer in layers)
                          or (p.where == "embedding" and first) or (p.where == "head" and last)]
    if m.tie_embeddings and num_stages > 1 and last:  # the last stage keeps its own copy of the tied matrix
        emb = next(p for p in params if p.name == "tok_embeddings.weight")
        held.append(Param("output.weight", emb.shape, emb.trainable, None, "head", 0))
    sharded = lay.zero >= 2
    local = {p.name: tp_shape(p, lay.tp) for p in held}
    # parallel.expert_parallel: each rank holds its 1/ep of every MoE block's experts, outside the model's
    # FSDP2 units; under ZeRO 2/3 below the data-parallel degree FSDP2 shards them over their replicas too.
    ep = cfg.parallel.expert_parallel
    experts = {p.name for p in held if ".feed_forward.experts." in p.name} if ep > 1 else set()
    replicas = lay.dp_shard // ep if sharded and ep > 1 else 1
    for name in experts:
        local[name] = (local[name][0] // ep, *local[name][1:])
    # FSDP2 keeps each shard padded to even rows; the optimizer state sees the unpadded local rows.
    stored = {p.name: (fsdp_shard(local[p.name], replicas, dim=1) if p.name in experts
                       else fsdp_shard(local[p.name], lay.dp_shard) if sharded else numel(local[p.name]))
              for p in held}
    trainable = [p for p in held if p.trainable]
    rope = 2 * m.max_position_embeddings * m.head_dim * 4 if m.position == "rope" else 0  # fp32 tables per rank
    param_bytes = stored_param_bytes(held, stored, prec) + rope
    if cfg.reference_mode() == "frozen_copy":  # preference tuning's reference: a frozen copy of the weights
        param_bytes += stored_param_bytes(held, stored, prec)
    full_elems = [numel(local[p.name]) for p in trainable]
    if lay.zero == 1:  # 1/dp of every tensor (its first free dimension split torch.chunk style)
        state_elems = sum(math.prod(zero1_part(p, local[p.name], lay)) for p in trainable)
    elif sharded:
        state_elems = sum(stored[p.name] for p in trainable)
    else:
        state_elems = sum(full_elems)
    name = cfg.train.optimizer
    states = 1 if name == "sgd" else 2
    counters = 0 if name == "sgd" else 4 * len(trainable)  # ZeRO-1: a step per part
    optimizer_bytes = states * state_elems * state_element_bytes(cfg, prec) + counters  # Adam: a scalar step per tensor
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        opt_elems = [stored[p.name] if sharded else numel(local[p.name]) for p in trainable]
        one = torchao_8bit_state_bytes if name == "adamw_8bit" else paged_8bit_state_bytes
        optimizer_bytes = states * sum(one(n, 4 if prec.masters else prec.param) for n in opt_elems) + counters
    elif name == "paged_adamw":
        optimizer_bytes = states * state_elems * 4 + counters
    # optimize.offload_params (FSDP2's CPU offload): the parameters it keeps in host memory (all of this
    # rank's, or with offload_params_blocks those of the first blocks), their gradients and state with them.
    on_host = {p.name for p in held if cfg.optimize.params_on_host(p.layer)} if lay.offload else set()
    host_layers = frozenset(p.layer for p in held if p.name in on_host and p.layer is not None)
    host_trainable = [p for p in trainable if p.name in on_host]
    # The optimizer state of the offloaded parameters: their share of the elements (the 8-bit blocks and
    # step counters per tensor make it a share of the bytes to within a few bytes a tensor).
    host_share = sum(stored[p.name] for p in host_trainable) / max(1, sum(stored[p.name] for p in trainable))
    master_bytes = sum(full_elems) * 4 if prec.masters else 0
    grad_bytes = sum(stored[p.name] for p in trainable) * prec.grad
    # What a checkpoint saves of this rank (train.async_save stages a host copy of it): the parameters as
    # held, the optimizer state, the fp32 masters of O2.
    saved_bytes = stored_param_bytes(held, stored, prec) + optimizer_bytes + (state_elems * 4 if prec.masters else 0)
    # optimize.offload_optimizer (memory.offload.HostMasters): this rank's masters, their pinned buffers in
    # the weights' dtype, the masters' gradients and the state are host memory. On an accelerator they
    # leave the device figure; on the CPU (one memory) it keeps them and `host_phases` says which they are.
    host_opt = offloads_optimizer(cfg)
    stream = streams_optimizer(cfg)
    dev_view = device != "cpu"
    if host_opt:
        master_bytes = state_elems * ((4 if prec.masters else prec.param) + prec.param)
    if stream:  # the masters of this rank's shards, pinned (they cross the bus with the state)
        master_bytes = state_elems * 4 if prec.masters else 0
    host_static = master_bytes + optimizer_bytes if host_opt or stream else 0
    host_grads = grad_bytes if host_opt else 0
    if host_opt and dev_view:
        master_bytes = optimizer_bytes = grad_bytes = 0
    if stream and dev_view:  # masters and state in host memory; the gradients stay on the device
        master_bytes = optimizer_bytes = 0
    # bitsandbytes' paged state: CUDA unified memory outside torch's allocator, paged out to host memory
    # when the device is short of room: counted in host memory (step_time charges the paging).
    paged = name in PAGED_OPTIMIZERS and dev_view
    if paged:
        host_static, optimizer_bytes = optimizer_bytes, 0
    host = 0
    offload = lay.offload and device != "cpu"  # on a CPU run host memory is the device's memory
    host_grad_bytes = sum(stored[p.name] for p in host_trainable) * prec.grad
    host_optimizer_bytes = int(optimizer_bytes * host_share)
    if lay.offload:
        host = stored_param_bytes([p for p in held if p.name in on_host], stored, prec) + host_grad_bytes \
            + host_optimizer_bytes
    if offload:  # FSDP2's CPUOffloadPolicy: shards, sharded gradients and the state live in host memory
        param_bytes -= stored_param_bytes([p for p in held if p.name in on_host], stored, prec)
        grad_bytes -= host_grad_bytes
        optimizer_bytes -= host_optimizer_bytes

    # --- activations of one micro-batch, per stage
    tp = lay.tp
    chunk = lay.seq // lay.cp  # the tokens of a sequence this rank holds (context parallelism)
    sh = Shape(b=lay.micro_batch, t=chunk, tn=chunk // tp if lay.sequence_parallel else chunk, h=m.hidden_size,
                q=m.num_heads * m.head_dim // tp, kv=m.num_kv_heads * m.head_dim // tp, heads=m.num_heads // tp,
                f=m.intermediate_size // tp, v=chunk_size(m.vocab_size, tp), s=prec.compute,
                mask=document_mask(cfg, device), cp=lay.cp)
    flags = layer_flags(cfg, params)
    hidden = sh.b * sh.tn * sh.h * sh.s  # one micro-batch of hidden states between blocks / stages
    full: dict[int, int] = {}
    saved: dict[int, int] = {}
    for st in stages.values():  # each model part's blocks get their modes in order (full every k-th: per part)
        for i, mode in zip(st.layers, cfg.optimize.layer_recompute(st.layers)):
            full[i] = layer_bytes(cfg, sh, flags[i], device, prec.level)
            saved[i] = recompute_bytes(cfg, sh, mode, full[i], flags[i]) if mode != "none" else full[i]
    # optimize.offload_activations: what the blocks save goes to host memory in the forward; each block's
    # saved tensors come back whole for its backward (as a recomputed block's do).
    act_host = sum(saved.values()) * max(in_flight(lay, pp_rank, stage_ids).values()) \
        if cfg.optimize.offload_activations else 0
    # The block running its forward holds the tensors it saves on the device while their copies go to the
    # host: at most its MLP's (the widest), until the MLP is done.
    act_live = max((mlp_bytes(cfg, sh, flags[i]) for i in full), default=0) if act_host else 0
    # On an accelerator the copies run on a side stream (memory.offload.SavedCopies): in the forward one
    # block's copies may still be on their way out beside the running block's, and in the backward the
    # next block's come back while one runs: one more block's saved tensors in each.
    ahead = max(saved.values(), default=0) if act_host and dev_view else 0
    act_live += ahead
    if act_host and dev_view:
        saved = {i: 0 for i in saved}
    head = head_bytes(cfg, sh, prec, flags, logits_kept=lay.pp > 1 or lay.tp > 1) if last else None
    for st in stages.values():
        st.act = sum(saved[i] for i in st.layers) + stage_bytes(cfg, sh, st.first, device)
        first_recomputed = bool(st.layers) and saved[st.layers[0]] != full[st.layers[0]]
        if not st.first and st.layers and input_aliased(m, sh, first_recomputed):
            st.act -= hidden  # the first block keeps the received hidden states, already a receive buffer
        if st.last:
            st.act += head["saved"] + head["logits"] + head["lsm"]
        else:
            st.act += hidden  # the stage output, kept by the schedule for its backward
        st.grads = sum(stored[p.name] for p in trainable if param_stage(p, st, num_stages)
                       and not (offload and p.name in on_host)) * prec.grad
        if host_opt and dev_view:
            st.grads = 0

    # --- what the layout adds
    batch = batch_bytes(cfg, lay, device)
    pipe_buffers = pipeline_buffers(lay, stage_ids, hidden)
    f8_gather = float8_all_gather(cfg, lay.dp)
    fsdp = fsdp_buffers(lay, prec, [p for p in held if p.name not in experts or replicas > 1], local, layers,
                        f8_gather, shard_of={n: (replicas, 1) for n in experts})
    gathered = replicate_buffers(lay, prec, held, local) + (fsdp.forward() if fsdp else 0)
    exchange = exchange_bytes(m, sh)
    dequant = qlora_transient(held, prec)  # QLoRA: inside a block's forward and backward, not the head's
    dequant_back = qlora_transient(held, prec, backward=True, tokens=sh.b * sh.t, device=device)
    cast, cast_back = float8_transient(sh, held, local, gathered=f8_gather, compiled=cfg.compiles(device)) \
        if float8_on(cfg) else (0, 0)
    if prec.level == "O1":
        # Autocast caches the 16-bit copy of every trainable weight a matmul uses until the
        # micro-batch's forward and backward are done.
        # The chunked loss casts the output weight itself (counted with the head, released after it).
        chunked = cfg.optimize.loss_chunk() is not None
        gathered += sum(numel(local[p.name]) * 2 for p in trainable
                        if len(p.shape) == 2 and (p.name != "tok_embeddings.weight" or m.tie_embeddings)
                        and not p.name.startswith("pos_")
                        and not (chunked and p.name in ("output.weight", "tok_embeddings.weight")))
    if sharded and not lay.reduce_every and len([op for op in rank_ops(lay, pp_rank, stage_ids)
                                                 if op[1] in "BW"]) > 1 and not offload:
        # Without gradient sync FSDP2 accumulates unsharded gradients (in the reduce dtype) between
        # micro-batches: with accumulation and reduce_gradients once_per_step (or under a pipeline,
        # whose schedule reduces once per pipeline step) ZeRO 2/3 hold full-size gradients. Reduced
        # every micro-batch, they stay sharded (HSDP: the partial shards wait for the replica all-reduce).
        for st in stages.values():
            st.grads = sum(numel(local[p.name]) for p in trainable if param_stage(p, st, num_stages)) * prec.grad
    in_backward = cfg.train.optimizer_in_backward
    updates = in_backward_updates(cfg, lay, prec, trainable, stored, local, device) if in_backward else None
    if stream and in_backward:  # each update holds its gradient and the state streamed around it
        updates = streamed_updates(cfg, lay, prec, trainable, stored, local, device, in_backward=True)
    if host_opt and dev_view:  # each gradient leaves the device once it is final: one tensor at a time
        in_backward, updates = True, gradients_in_transit(lay, prec, trainable, stored, local)
    if in_backward:  # each gradient is used and freed as it arrives (`updates`: the one being applied)
        for st in stages.values():
            st.grads = 0
    pipe_buffers += zero_bubble_leftovers(lay, stage_ids, hidden)
    static = param_bytes + optimizer_bytes + master_bytes + batch + pipe_buffers
    gathered += exchange  # held around each attention, forward and backward (not in the optimizer step)

    # --- replay the step: forwards keep a micro-batch's activations, backwards release them
    held_mb = {st: 0 for st in stages}
    has_grads = {st: False for st in stages}
    pending_w = {st: 0 for st in stages}  # zero-bubble: input gradients done, weight gradients not yet
    inter = {st: sum(weight_grad_inputs(cfg, sh) for _ in stages[st].layers) for st in stages}
    # Interleaved 1F1B waits for its sends at the end of the step: each input gradient sent back stays.
    sent = {st: 0 for st in stages}
    keeps_sends = lay.pp > 1 and lay.schedule == "interleaved_1f1b"
    walks: dict[tuple[int, bool, bool], int] = {}  # one micro-batch's backward peak depends only on these
    forward = backward = 0
    for st_id, kind, _mb in rank_ops(lay, pp_rank, stage_ids):
        st = stages[st_id]
        others = sum(stages[s].act * held_mb[s] + inter[s] * pending_w[s] + sent[s] * hidden for s in stages) \
            + sum(stages[s].grads for s in stages if has_grads[s])
        if kind == "F":
            fwd_extra = head["fwd_extra"] if st.last else 0
            if st.last and fsdp is not None:
                fwd_extra += fsdp.head_forward(st.layers, cfg.optimize.chunked_loss)
            forward = max(forward, static + gathered + others + st.act + fwd_extra)
            if dequant:  # the last block's largest matmul, before the head's tensors exist
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part + dequant)
            if cast:  # optimize.float8: the last block's largest cast, before the head's tensors exist
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part + cast)
            if act_live:  # the last block's MLP, before the head's tensors exist
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part + act_live)
            if st.layers and flags[st.layers[-1]].get("moe"):  # the last block's experts' outputs, unsorted
                head_part = head["saved"] + head["logits"] + head["lsm"] if st.last else 0
                forward = max(forward, static + gathered + others + st.act - head_part
                              + moe_forward(m, sh, flags[st.layers[-1]]))
            held_mb[st_id] += 1
        elif kind in ("B", "I"):
            rest = others - st.act - (st.grads if has_grads[st_id] else 0)
            key = (st_id, has_grads[st_id], kind == "I")
            if key not in walks:
                walks[key] = backward_walk(cfg, sh, st, saved, full, flags, held, stored, prec, head, fsdp,
                                            has_grads[st_id] or in_backward, kind == "I", updates,
                                            dequant=dequant_back, cast=cast_back,
                                            grads_leave=host_layers if offload else frozenset())
            walk = walks[key]
            backward = max(backward, static + gathered + rest + walk + ahead)
            if keeps_sends and not st.first:
                sent[st_id] = min(sent[st_id] + 1, lay.micro_batch_num)
            if kind == "B":
                held_mb[st_id] -= 1
                # offload_optimizer: a micro-batch's gradients wait in the host buffers, the masters'
                # gradients are made during the next backward (or after the last).
                has_grads[st_id] = not host_opt
            else:
                pending_w[st_id] += 1
        elif kind == "W":
            held_mb[st_id] -= 1
            pending_w[st_id] -= 1
            has_grads[st_id] = True
    if in_backward:
        pass  # the updates are counted in the walk (`updates`); no set of gradients is left to reduce
    elif lay.dp > 1 and lay.pp == 1 and not offload:
        backward = max(backward, static + root_reduction(lay, prec, trainable, stored, local))
    if stream and not in_backward:  # the gradients, and the state streamed through one tensor at a time
        window = streamed_updates(cfg, lay, prec, trainable, stored, local, device, in_backward=False)
        sizes = [stored[p.name] if lay.zero >= 2 else numel(local[p.name]) for p in trainable]
        optimizer_phase = static + grad_bytes + max(max(window.values(), default=0), norm_temp(sizes))
    else:
        on_device = [p for p in trainable if not (offload and p.name in on_host)]
        optimizer_phase = optimizer_phase_total(cfg, lay, prec, static, grad_bytes, state_elems, on_device, stored,
                                           local, (host_opt and dev_view) or (offload and not on_device),
                                           "cpu" if host_opt else device)
    checkpoint = static

    # --- the estimate
    phases = {"forward": forward, "backward": backward, "optimizer": optimizer_phase, "checkpoint": checkpoint}
    if cfg.train.async_save and not dev_view:  # a CPU run: the async save's host copy is in the one memory
        phases = {k: v + saved_bytes for k, v in phases.items()}
    tensor_peak = max(phases.values())
    frac = ALLOCATOR_OVERHEAD if device in ("cuda", "npu") else 0.0
    phases = {k: int(v * (1 + frac)) for k, v in phases.items()}
    host_phases = {"forward": host_static + act_host,
                   "backward": host_static + host_grads + act_host, "optimizer": host_static + host_grads,
                   "checkpoint": host_static}
    staged = saved_bytes if cfg.train.async_save else 0
    if staged:  # from the first save on, one host copy of everything saved, kept for the run
        host_phases = {k: v + staged for k, v in host_phases.items()}
    if lay.offload:  # FSDP2's CPU offload: shards and state all along, gradients from backward to the step
        host_phases = {k: v + host - (host_grad_bytes if k in ("forward", "checkpoint") else 0)
                       for k, v in host_phases.items()}
    host = max(host_phases.values())
    # On the CPU (one memory) `phases` hold it all; on an accelerator they are the device's alone.
    device_phases = {k: max(0, v - host_phases[k]) for k, v in phases.items()} if not dev_view else dict(phases)
    peak_phase = max(phases, key=phases.get)
    flight = in_flight(lay, pp_rank, stage_ids)
    block_acts = sum((sum(saved[i] for i in stages[s].layers)) * flight[s] for s in stages)
    activations = block_acts if peak_phase in ("forward", "backward") else 0
    # The gradients that exist at the peak: none with the optimizer in backward (the one being applied is a
    # transient, among the buffers), none after the step; in a forward only those of earlier micro-batches.
    accumulating = peak_phase == "forward" and lay.accumulation > 1 and not host_opt
    grads_at_peak = 0 if in_backward else grad_bytes if peak_phase in ("backward", "optimizer") or accumulating else 0
    buffers = max(0, tensor_peak - (param_bytes + grads_at_peak + optimizer_bytes + master_bytes + activations))
    one = next(iter(layers), None)
    if lay.pp > 1:
        role = f"pipeline rank {pp_rank}, stage{'s' if len(stage_ids) > 1 else ''} {', '.join(map(str, stage_ids))}"
    else:
        role = "one device" if lay.dp * lay.tp == 1 else "every rank"
    detail = {
        "rank_role": role,
        "pp_rank": pp_rank,
        "stages": stage_ids,
        "layers_on_rank": len(layers),
        "layers_with_activations": [i for i in sorted(full) if full[i]],  # what recompute: auto may wrap
        "in_flight": max(flight.values()),
        "in_flight_per_stage": flight,
        "layer_activation_bytes": saved.get(one, 0),
        "layer_activation_bytes_no_recompute": full.get(one, 0),
        "layer_activation_bytes_full_recompute": recompute_bytes(cfg, sh, "full", full[one]) if one is not None else 0,
        "stage_micro_batch_bytes": {s: stages[s].act for s in stages},
        "head": head,
        "masters_bytes": master_bytes,
        "batch_bytes": batch,
        "pipeline_buffer_bytes": pipe_buffers,
        "gathered_parameter_bytes": gathered - exchange,
        "context_parallel_exchange_bytes": exchange,
        "bytes_per_element": {"param": prec.param, "frozen_param": prec.frozen, "compute": prec.compute,
                              "grad": prec.grad, "state": prec.state},
        "precision_level": prec.level,
        "layout": {"dp": lay.dp // lay.cp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "zero": lay.zero,
                   "sequence_parallel": lay.sequence_parallel,
                   "micro_batch": lay.micro_batch, "seq": lay.seq, "accumulation": lay.accumulation,
                   "schedule": lay.schedule if lay.pp > 1 else None, "virtual_stages": lay.virtual_stages},
        "device": device,
        "tensor_peak": tensor_peak,
        "device_phases": device_phases,  # without what is in host memory (on an accelerator: `phases`)
        "host_offload": {"optimizer": host_static + host_grads, "activations": act_host},
        "async_save_host_bytes": staged,  # train.async_save: the staged copy of what a checkpoint saves
    }
    approximate = _approximations(m, ep, lay.tp)
    if approximate:
        detail["approximate"] = "; ".join(approximate)
    return MemoryEstimate(params=param_bytes, grads=grads_at_peak, optimizer=optimizer_bytes + master_bytes,
                          activations=activations, buffers=buffers, overhead=int(tensor_peak * frac),
                          peak=max(phases.values()), phases=phases, detail=detail, host=host,
                          host_phases=host_phases)


def _approximations(m: Any, ep: int, tp: int) -> list[str]:
    """What this estimate counts only roughly, named for the reader (nothing: exact on a CPU)."""
    out = []
    if m.num_experts and tp > 1:
        out.append("tensor parallelism with mixture-of-experts blocks: the sequence each block gathers and splits "
                   "again is not counted")
    if ep > 1:
        out.append("expert parallelism: each rank is taken to receive its even share of the routed copies; a rank "
                   "whose experts are busier holds more, in proportion")
    if m.latent_attention:
        out.append("latent attention: its activations are counted as standard attention's of head_dim (not its "
                   "latent projections' inputs, nor, on a CPU, the scores of the math kernel its unequal key "
                   "and value heads take)")
    if m.sandwich_norm or m.norm_unit_offset:
        out.append("the norms after attention and the MLP (GLM-4, Gemma 3) and Gemma's fp32 norms are not counted")
    if m.sliding_window or m.position == "alibi":
        out.append("the sliding window's and ALiBi's attention masks are not counted")
    return out
