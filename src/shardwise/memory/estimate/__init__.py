"""Per-device memory of a training run, predicted from its config before anything is allocated.

`estimate_memory(cfg, devices, device)` splits the memory of the busiest device into parameters,
gradients, optimizer state (fp32 master copies included), activations (saved for backward over the
micro-batches in flight), buffers (communication buffers, logits and loss temporaries, transients of
the op at the peak) and allocator overhead, and gives the total of each phase of a step: forward,
backward, optimizer step (unscale, clipping, master copies, the update) and checkpoint save.
`estimate_all_ranks` gives one estimate per pipeline stage (the ranks of a stage are alike).

The counts follow what shardwise itself allocates, not a paper's formula:
- activations: what autograd saves in our Transformer block (RMSNorm upcasts to fp32 and saves that
  copy, SwiGLU saves both branches, SDPA's fused kernel saves q, k, v, the output and the log-sum-exp,
  GQA saves the repeated k and v, an explicit document mask becomes a float [B, 1, T, T] per layer),
  per micro-batch and layer, scaled by the tensor-parallel split (heads, MLP width, vocabulary) and
  the sequence split of sequence parallelism (norms, residuals) and of context parallelism (every
  per-token tensor holds T / cp tokens; attention's q, k, v and output as many bytes, head-split over
  the whole sequence; an explicit document mask stays [B, 1, T, T]); recompute (per layer, as
  `optimize.layer_recompute` says) keeps each wrapped block's input (full) or its input plus the
  outputs of attention and of q, v and gate (selective, `parallel.recompute`; the down projection's
  too where a dropout or adapter after it takes the recompute that far), and adds one block's
  activations back during its backward;
- the head: logits [B, T, V] stay referenced through backward, cross-entropy saves an fp32
  log-softmax, and its backward holds two more fp32 [B, T, V] buffers at once (the largest transient
  of small models and of large vocabularies);
- ZeRO (FSDP2 for stages 2/3): sharded parameters, gradients and state (padded to even shards),
  the all-gathered blocks a stage keeps (ZeRO-2: all of them until their backward; ZeRO-3: about two
  at a time), reduce-scatter buffers, full-size unsharded gradients under accumulation only when they
  are reduced once per step (`parallel.reduce_gradients`); ZeRO-1's state for 1/dp of every tensor
  and its bucketed all-gather, as its optimizer splits them;
  CPU offload moves shards, gradients and state to host memory (`host`);
- float8 (`optimize.float8`): what autograd saves is unchanged (torchao saves the bf16 inputs); ZeRO 2/3
  gather the converted linears' weights in 1 byte; the casts add a transient (`activations.float8_transient`);
- context parallelism (`parallel.context`): gradients reduced and ZeRO sharded over dp x cp ranks, and
  each layer's all-to-all buffers around attention (`activations.exchange_bytes`), held in forward and backward;
- pipelines: the schedule's own order of forwards and backwards (torch's pipeline_order) gives the
  micro-batches in flight on each rank (zero-bubble keeps a micro-batch until its weight gradient).

What is counted is the same quantity `memory.measure.MemoryTracker` measures: bytes of tensor
storages. On CPU that is the whole estimate (overhead 0). On CUDA/NPU `overhead` adds
`ALLOCATOR_OVERHEAD` of the tensor peak for the caching allocator's rounding and fragmentation
(`max_memory_reserved` above `max_memory_allocated`); the CUDA context itself (about 0.5 GiB, outside
the allocator) is not included.

`run_flops(cfg)` gives the run's training FLOPs per token from the same parameter table (what trains
under LoRA / freezing decides what the backward computes): the trainer's MFU and the planner's step
time both count with it.

The package, one module per thing it counts; a module imports only from modules listed below it:

    rank           one rank's walk through a step, the phases' totals; estimate_memory, estimate_all_ranks
    backward       one micro-batch's backward through a stage, block by block
    optimizer      state bytes, the update's temporaries, in backward, streamed and offloaded optimizers
    sharding       FSDP2's gathered blocks and buffers, the root's reduction, replicate's copy
    pipeline       the schedule's order of forwards and backwards, stages, in-flight micro-batches, buffers
    head           the final norm, the logits and the (chunked) loss
    activations    what a block saves for backward, recompute, its transients
    batch          the token batches, packed documents' mask and positions
    parameters     the parameter table, its TP / FSDP / ZeRO-1 shapes; trainable_shapes, run_flops
    layout         the parallel layout and precision read from the run config
    result         MemoryEstimate and PHASES
"""

from .head import head_recomputes_logits
from .optimizer import TORCHAO_COMPILED_TEMPORARIES
from .parameters import offloaded_share, run_flops, trainable_shapes
from .rank import ALLOCATOR_OVERHEAD, estimate_all_ranks, estimate_memory
from .result import PHASES, MemoryEstimate

__all__ = ["ALLOCATOR_OVERHEAD", "PHASES", "TORCHAO_COMPILED_TEMPORARIES", "MemoryEstimate", "estimate_all_ranks",
           "estimate_memory", "head_recomputes_logits", "offloaded_share", "run_flops", "trainable_shapes"]
