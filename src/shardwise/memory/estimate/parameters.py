"""The parameter table and its shapes on a rank: every parameter of the model with LoRA, freezing and
QLoRA applied (built on the meta device, cached), which of each block's weights train (`layer_flags`), a
tensor's tensor-parallel slice, FSDP2 shard and ZeRO-1 part, and the bytes the parameters take as stored;
and the public readings of the same table: `trainable_shapes`, `offloaded_share`, `run_flops`."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ...builder import build_adapted_model
from ...config import FreezeConfig, LoraConfig
from ...models.config import ModelConfig
from ...models.flops import TrainingFlops, training_flops
from ...parallel.data_parallel import zero1_split
from ...peft.quantize import quantized_bytes
from .layout import Layout, Precision


@dataclass(frozen=True)
class Param:
    """One parameter tensor of the whole model."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    layer: Optional[int]  # block index, None for embeddings / head
    where: str  # "embedding", "layer", "head"
    tp_dim: Optional[int]  # dimension tensor parallel splits, None = replicated
    quant: Optional[str] = None  # lora.quantize_base of a LoRA base weight stored quantised (QLoRA)


def _tp_dim(name: str) -> Optional[int]:
    """The dimension tensor parallel shards (shardwise/parallel/tensor.py's plan), None if replicated."""
    if name.startswith(("tok_embeddings.", "pos_embeddings.", "output.")):
        return 0
    rest = name.split(".", 2)[2] + "." if name.startswith("layers.") else ""  # "attention.wq.weight."
    column = rest.startswith(("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.",
                              "feed_forward.w3.", "feed_forward.shared.w1.", "feed_forward.shared.w3."))
    row = rest.startswith(("attention.wo.", "feed_forward.w2.", "feed_forward.shared.w2."))
    if ".lora_A." in name:
        return 1 if row else None
    if ".lora_B." in name:
        return 0 if column else None
    if column:
        return 0
    if row:
        return 1 if name.endswith(".weight") else None
    return None


@functools.lru_cache(maxsize=16)
def _param_table(key: str) -> tuple[Param, ...]:
    """Every parameter of the model with LoRA / freezing applied (built on the meta device, cached)."""
    spec = json.loads(key)
    lora = LoraConfig(**spec["lora"]) if spec["lora"] is not None else None
    model = build_adapted_model(ModelConfig(**spec["model"]), lora, FreezeConfig(**spec["freeze"]), "meta")
    quantized = _quantized_names(model) if lora is not None and lora.quantize_base != "none" else set()
    out = []
    for name, p in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        where = "layer" if layer is not None else ("head" if name.startswith(("norm.", "output.")) else "embedding")
        shape = tuple(p.shape)
        if name in quantized and len(shape) == 3:
            shape = (shape[0] * shape[1], shape[2])  # an experts' stack, quantised as one matrix
        out.append(Param(name, shape, p.requires_grad, layer, where, _tp_dim(name),
                          lora.quantize_base if name in quantized else None))
    return tuple(out)


def _quantized_names(model: Any) -> set[str]:
    """The base weights QLoRA stores quantised (`peft.qlora.quantize_base`): each adapted linear's weight,
    and all three stacks of a MoE block's experts with any adapter."""
    out = set()
    for n, _ in model.named_parameters():
        if ".lora_A." not in n:
            continue
        module = n.split(".lora_A.")[0]
        if ".feed_forward.experts.lora." in module:
            experts = module.split(".lora.")[0]
            out.update(f"{experts}.{w}" for w in ("w1", "w3", "w2"))
        else:
            out.add(f"{module}.weight")
    return out


def params_of(cfg: Any) -> tuple[Param, ...]:
    freeze = cfg.freeze.model_dump()
    key = json.dumps({"model": cfg.model.model_dump(mode="json"),
                      "lora": cfg.lora.model_dump(mode="json") if cfg.lora is not None else None,
                      "freeze": freeze}, sort_keys=True)
    return _param_table(key)


def trainable_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter that trains under the run config's LoRA / freezing."""
    return {p.name: p.shape for p in params_of(cfg) if p.trainable}


def offloaded_share(cfg: Any) -> tuple[float, float]:
    """(share of all parameter elements, share of the trainable ones) that optimize.offload_params keeps in
    host memory: everything, or with offload_params_blocks the first blocks' (0 without offload_params)."""
    params = params_of(cfg)
    on_host = [p for p in params if cfg.optimize.params_on_host(p.layer)]

    def share(subset: list[Param], of: list[Param]) -> float:
        return sum(numel(p.shape) for p in subset) / max(1, sum(numel(p.shape) for p in of))

    trainable = [p for p in params if p.trainable]
    return share(on_host, params), share([p for p in on_host if p.trainable], trainable)


def run_flops(cfg: Any) -> TrainingFlops:
    """Training FLOPs per token of a run config, per layer and head (`models.flops.training_flops` on
    the parameters that train): what MFU counts and what the planner times."""
    return training_flops(cfg.model, cfg.data.seq_length, trainable_shapes(cfg))


def chunk_size(size: int, parts: int) -> int:
    """The largest piece of `size` split torch.chunk-style into `parts` (what rank 0 holds)."""
    return -(-size // parts)


def tp_shape(p: Param, tp: int) -> tuple[int, ...]:
    if p.tp_dim is None or tp == 1:
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = chunk_size(shape[p.tp_dim], tp)
    return tuple(shape)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def fsdp_shard(shape: tuple[int, ...], n: int, dim: int = 0) -> int:
    """Elements of one FSDP2 shard of a tensor: dimension `dim` padded to a multiple of n, split n ways."""
    if not shape:
        return 1
    return chunk_size(shape[dim], n) * numel(shape) // shape[dim]


def zero1_part(p: Param, shape: tuple[int, ...], lay: "Layout") -> tuple[int, int]:
    """(indices, elements per index) of the part of `p` (local `shape`) that ZeroOneOptimizer keeps on
    rank 0, the rank with the most: split along the first dimension tensor parallelism leaves free;
    a tensor with none left is kept whole (one index of all its elements)."""
    taken = [p.tp_dim] if lay.tp > 1 and p.tp_dim is not None else []
    dim, chunk = zero1_split(shape, taken, lay.dp)
    if dim is None:
        return 1, numel(shape)
    return chunk, (numel(shape) // shape[dim] if shape[dim] else 0)


def stored_param_bytes(params: Iterable[Any], elems: dict[str, int], prec: Precision) -> int:
    """Bytes of `params` stored with `elems[name]` elements each, trainable and frozen in their own dtypes
    (a quantised base weight, which is never sharded: torchao's inner tensors, `peft.quantize`)."""
    return sum(quantized_bytes(p.quant, p.shape, prec.frozen) if p.quant else
               elems[p.name] * (prec.param if p.trainable else prec.frozen) for p in params)


def layer_flags(cfg: Any, params: tuple[Param, ...]) -> dict[int, dict[str, bool]]:
    """Per block: whether its input needs a gradient, and which of its weights train (or carry LoRA)."""
    return _layer_flags_of(cfg.model.num_layers, params)


@functools.lru_cache(maxsize=16)
def _layer_flags_of(num_layers: int, params: tuple[Param, ...]) -> dict[int, dict[str, bool]]:
    by_layer: dict[Optional[int], list[Param]] = {}
    for p in params:
        by_layer.setdefault(p.layer, []).append(p)
    out = {}
    upstream = any(p.trainable for p in params if p.where == "embedding")
    for i in range(num_layers):
        mine = by_layer.get(i, [])
        flags = {"input_grad": upstream, "norm": any(p.trainable for p in mine if "norm" in p.name)}
        for lin, module in (("wq", "attention.wq"), ("wk", "attention.wk"), ("wv", "attention.wv"),
                            ("wo", "attention.wo"), ("w1", "feed_forward.w1"), ("w3", "feed_forward.w3"),
                            ("w2", "feed_forward.w2")):
            prefix = f"layers.{i}.{module}."
            flags[lin] = any(p.trainable for p in mine if p.name.startswith(prefix) and ".lora_" not in p.name)
            flags[f"lora_{lin}"] = any(p.trainable for p in mine if p.name.startswith(prefix) and ".lora_" in p.name)
        # A mixture-of-experts block: whether it has one, and whether its router and experts train.
        flags["moe"] = any(".feed_forward.experts." in p.name for p in mine)
        flags["experts"] = any(p.trainable for p in mine
                               if ".feed_forward.experts." in p.name and ".lora_" not in p.name)
        for w in ("w1", "w3", "w2"):  # LoRA on the routed experts' stacked weights (peft.lora.LoRAExperts)
            flags[f"lora_experts_{w}"] = any(p.trainable for p in mine
                                             if p.name.startswith(f"layers.{i}.feed_forward.experts.lora.{w}."))
        out[i] = flags
        upstream = upstream or any(p.trainable for p in mine)
    return out
