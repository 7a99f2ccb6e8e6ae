"""What the blocks of one micro-batch keep for backward and hold while they run, per rank (`Shape`):
a block's saved activations (`layer_bytes`: norms, attention, MLP, dropout masks, LoRA's adapters), what
recompute keeps of them, a model part's RoPE tables and embedding dropout mask, the MLP's share,
zero-bubble's output gradients; and the transients above them: a block's backward (`layer_transient`),
float8's casts, QLoRA's dequantisation, context parallelism's all-to-all buffers around attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...parallel.float8 import converts
from ...parallel.recompute import down_output_needed, selective_saved_matmuls
from ...peft.quantize import dequantized_transient
from .batch import document_positions
from .layout import Precision
from .parameters import Param, numel

_MASK_BYTES = {"cpu": 4, "cuda": 1, "npu": 1}  # a dropout mask: same dtype as the input on CPU, bool elsewhere


@dataclass(frozen=True)
class Shape:
    """Per-rank tensor sizes of one micro-batch."""

    b: int  # samples
    t: int  # tokens attention and the MLP see
    tn: int  # tokens norms and residuals see (t / tp under sequence parallelism)
    h: int
    q: int  # local query width: heads x head_dim / tp
    kv: int  # local key/value width
    heads: int  # local query heads
    f: int  # local MLP width
    v: int  # local vocabulary (logits columns)
    s: int  # bytes of an activation element
    mask: bool  # explicit document mask [B, 1, T, T]
    cp: int = 1  # context parallel: t is a chunk of cp x t tokens, over which attention runs (heads / cp)


def norm_bytes(m: Any, sh: Shape, input_grad: bool, weight_grad: bool, s: Optional[int] = None) -> int:
    """What one norm saves, input included (its output is counted by the layers that save it); `s`:
    bytes of the norm's elements (fp32 under autocast, else the activation dtype)."""
    s = s or sh.s
    bt = sh.b * sh.tn
    if m.norm == "rmsnorm":
        # models/lean_ops.rms_norm: the input in its own dtype and the rsqrt (fp32, one per token).
        return bt * sh.h * s + bt * 4 if (input_grad or weight_grad) else 0
    # native_layer_norm saves its input, mean and rstd (fp32 on CUDA, the input dtype on CPU).
    return bt * sh.h * s + 2 * bt * 4 if (input_grad or weight_grad) else 0


def layer_bytes(cfg: Any, sh: Shape, flags: dict[str, bool], device: str, level: str) -> int:
    """Bytes one block saves for backward for one micro-batch, without recompute.

    flags: input_grad (the block's input requires grad), norm (norm weights train), and for each
    linear ("wq", ... "w2") whether its weight trains or it has a LoRA adapter ("lora_wq", ...).
    """
    m = cfg.model
    if not any(v for k, v in flags.items() if k != "moe"):
        return 0  # nothing in or before it trains: autograd records nothing
    bt, s = sh.b * sh.t, sh.s
    lora = cfg.lora
    drop = m.dropout > 0
    # Which tensors need a gradient: the block's input, then (once attention's weights train) the residual.
    attn_grad = flags["input_grad"] or flags["norm"] or any(_saves_input(flags, n) for n in ("wq", "wk", "wv"))
    mid_grad = attn_grad or _saves_input(flags, "wo")
    norms_s = 4 if level == "O1" else None
    total = norm_bytes(m, sh, flags["input_grad"], flags["norm"], norms_s) + \
        norm_bytes(m, sh, mid_grad, flags["norm"], norms_s)
    if level == "O1":
        # Autocast: norms and the residual stream stay fp32; each linear casts its input to 16 bits
        # per use and keeps that cast.
        total += _linear_inputs(flags, ("wq", "wk", "wv"), bt * sh.h * 2)
        total += _linear_inputs(flags, ("w1", "w3") if m.mlp == "gated" else ("w1",), bt * sh.h * 2)
        s = 2
    else:
        # The norm output is saved once (q/k/v or w1/w3 share it); under SP it is the all-gathered copy.
        if any(_saves_input(flags, n) for n in ("wq", "wk", "wv")):
            total += bt * sh.h * s
        if any(_saves_input(flags, n) for n in (("w1", "w3") if m.mlp == "gated" else ("w1",))) or flags.get("experts"):
            total += bt * sh.h * s
    # Attention: q (after RoPE), k and v (repeated for GQA), output and log-sum-exp (fp32); Qwen3's q/k norms
    # keep their inputs and an rsqrt per head and token (fp32).
    if attn_grad:
        total += 4 * bt * sh.q * s + sh.b * sh.heads * sh.t * 4
        if m.qk_norm:
            total += bt * (sh.q + sh.kv) * s + bt * (sh.q + sh.kv) // m.head_dim * 4
        if sh.mask:
            total += sh.b * (sh.t * sh.cp) ** 2 * s  # SDPA turns the boolean mask into a float one, per layer
    if drop:
        # Attention dropout runs the math kernel: it keeps the probabilities, the mask and the result.
        total += 3 * sh.b * sh.heads * sh.t * sh.t * sh.cp * s + bt * sh.q * s  # heads / cp over cp x t tokens
        total += 2 * sh.b * sh.tn * sh.h * _MASK_BYTES.get(device, 1)  # residual dropouts
    total += mlp_bytes(cfg, sh, flags, s)
    # LoRA: each adapter saves the rank-r activation between A and B (and its dropout's input and mask).
    if lora is not None:
        for name, width in (("wq", sh.h), ("wk", sh.h), ("wv", sh.h), ("wo", sh.q), ("w1", sh.h), ("w3", sh.h),
                            ("w2", sh.f)):
            if flags.get(f"lora_{name}"):
                total += bt * lora.r * s
                if lora.dropout > 0:
                    total += bt * width * (s + _MASK_BYTES.get(device, 1))
    return total


def _saves_input(flags: dict[str, bool], name: str) -> bool:
    """Whether a linear keeps its input for backward: its weight trains, or an adapter reads it."""
    return flags.get(name, False) or flags.get(f"lora_{name}", False)


def _linear_inputs(flags: dict[str, bool], names: tuple[str, ...], each: int) -> int:
    return sum(each for n in names if _saves_input(flags, n))


def recompute_bytes(cfg: Any, sh: Shape, mode: str, full: int, flags: Optional[dict[str, bool]] = None) -> int:
    """Bytes a recomputed block keeps between its forward and backward (full: what it would keep without;
    `flags`: the block's, for whether selective recompute reaches the down projection)."""
    bt, s = sh.b * sh.t, sh.s
    inputs = sh.b * sh.tn * sh.h * s  # the block's input, kept to run it again
    if mode == "full":
        return inputs
    # Selective (parallel/recompute.py): the outputs of attention and of every other block linear in
    # call order (q, v, gate; down only where the recompute reaches it); LoRA's matmuls are recomputed.
    width = {"wq": sh.q, "wk": sh.kv, "wv": sh.kv, "wo": sh.h, "w1": sh.f, "w3": sh.f, "w2": sh.h}
    reached = down_output_needed(cfg.model.dropout, bool((flags or {}).get("lora_w2")))
    mm = sum(width[n] for n in selective_saved_matmuls(cfg.model.mlp == "gated", reached)) * bt
    if cfg.model.dropout > 0:  # attention's math path: both batched matmuls (scores and output)
        attention = (sh.b * sh.heads * sh.t * sh.t + bt * sh.q) * s
    else:  # the fused kernel's output and log-sum-exp
        attention = bt * sh.q * s + sh.b * sh.heads * sh.t * 4
    return min(full, inputs + mm * s + attention) if full else inputs


def input_aliased(m: Any, sh: Shape, recomputed: bool) -> bool:
    """Whether a block keeps its input tensor itself (not a copy): LayerNorm, fp32 RMSNorm, recompute."""
    return recomputed or m.norm != "rmsnorm" or sh.s == 4


def weight_grad_inputs(cfg: Any, sh: Shape) -> int:
    """What zero-bubble keeps per block between its input- and weight-gradient passes: the gradient
    at the output of every weight (q, k, v, o, the MLP's projections, the two norms)."""
    bt = sh.b * sh.t
    widths = sh.q + 2 * sh.kv + sh.h + (2 if cfg.model.mlp == "gated" else 1) * sh.f + sh.h
    return bt * widths * sh.s + 2 * sh.b * sh.tn * sh.h * sh.s


def stage_bytes(cfg: Any, sh: Shape, first: bool, device: str) -> int:
    """What a model part keeps besides its blocks: RoPE cos/sin for the micro-batch (every part builds
    them, in the compute dtype) and the embedding dropout's mask."""
    m = cfg.model
    rows = sh.b if document_positions(cfg) else 1
    total = 2 * rows * sh.t * m.head_dim * sh.s if m.position == "rope" else 0
    if first and m.dropout > 0:
        total += sh.b * sh.tn * sh.h * _MASK_BYTES.get(device, 1)
    return total


def layer_transient(cfg: Any, sh: Shape, flags: dict[str, bool]) -> tuple[int, int]:
    """What a block's backward holds above its saved activations: (in the MLP, in attention).

    Gated MLP: the down projection's input is released as its gradient appears, then the gate's
    two gradients join (+2 x [B, T, F]); plain MLP +1; a frozen down projection kept no input, so its
    input gradient adds one more. The MLP's also holds the block's output gradient. Attention: the
    gradients of q, k, v and of the output (+4 x [B, T, H*D]), the block's output gradient and its
    residual sum.
    """
    bt = sh.b * sh.t
    mlp = ((2 if cfg.model.mlp == "gated" else 1) + (0 if _saves_input(flags, "w2") else 1)) * bt * sh.f * sh.s
    if flags.get("moe"):
        mlp = moe_transient(cfg.model, sh)
    attention = 4 * bt * sh.q * sh.s
    residual = sh.b * sh.tn * sh.h * sh.s
    return mlp + residual, attention + 2 * residual


def moe_forward(m: Any, sh: Shape, flags: dict[str, bool]) -> int:
    """What a mixture-of-experts block's forward holds above what it saves, at its peak (measured): the
    experts' outputs in expert order [n k, hidden] while they are put back in token order, that order
    (int64), the router's logits (fp32 [n, E], kept for the balance losses) and, when the experts are frozen,
    the routed copies [n k, hidden] and the norm's output [n, hidden], which then are not saved but live
    until the experts are done."""
    n, k = sh.b * sh.t, m.num_experts_per_tok
    rows = 0 if flags.get("experts") else (n * k + n) * sh.h * sh.s
    return n * k * (sh.h * sh.s + 8) + n * m.num_experts * 4 + rows


def moe_transient(m: Any, sh: Shape) -> int:
    """A mixture-of-experts block's backward at its peak (measured), putting the experts' output gradients
    back in expert order: indexing's backward makes zeros [n k, hidden] and puts the token-ordered gradient
    into a copy of them, beside that gradient, while the weighted sum's backward has released the saved
    outputs (net: two [n k, hidden]); no expert's weight gradient exists yet, and the later steps release
    more than they make."""
    return 2 * sh.b * sh.t * m.num_experts_per_tok * sh.h * sh.s


def qlora_transient(held: list[Param], prec: Precision, backward: bool = False, tokens: int = 0,
                           device: str = "cuda") -> int:
    """QLoRA: the largest dequantisation of one quantised base weight in forward (its 16-bit copy and
    temporaries) or backward (with the fp32 sums of the input gradient over a micro-batch's `tokens` rows,
    at most `peft.quantize.GRAD_ROWS` at a time; on a CPU the matmuls' widened operands); one weight at a time."""
    return max((dequantized_transient(p.quant, p.shape, prec.frozen, backward, tokens=tokens, widens=device == "cpu")
                for p in held if p.quant), default=0)


def float8_transient(sh: Shape, held: list[Param], local: dict[str, tuple[int, ...]], gathered: bool,
                      compiled: bool) -> tuple[int, int]:
    """optimize.float8: what one block linear's casts to float8 hold at once above the block's own tensors,
    at the largest (forward, backward). What autograd saves does not change (torchao saves the bf16 input).
    Eager, casting n bf16 elements holds 9n bytes at its peak (torchao 0.18's `_ToFloat8ConstrFunc`: an fp32
    copy scaled, clamped by `to_fp8_saturated`, and the 1-byte result); compiled, the fused cast leaves only
    the result. Forward casts the input x, then the weight w; backward the output gradient g, the weight,
    g again (for the weight gradient) and x again. Under FSDP2's float8 all-gather (`gathered`) the weight
    arrives cast already. Counted from torchao's code, not measured: float8 does not run on a CPU."""
    bt = sh.b * sh.t
    fwd = back = 0
    for p in held:
        shape = local[p.name]
        if p.layer is None or not converts(shape, p.trainable):
            continue
        g, x, w = bt * shape[0], bt * shape[1], 0 if gathered else numel(shape)
        if compiled:
            fwd, back = max(fwd, x + w), max(back, 2 * g + x + w)
        else:
            fwd = max(fwd, 9 * x, x + 9 * w)
            back = max(back, 9 * g, g + 9 * w, 10 * g + w, 2 * g + w + 9 * x)
    return fwd, back


def exchange_bytes(m: Any, sh: Shape) -> int:
    """Context parallelism: what one attention's all-to-alls hold at once above the saved activations (0
    without): q, k, v of the chunk as projected, and for the tensor being exchanged its send and receive
    blocks (`parallel.context._all_to_all`); key/value heads repeated up to the query heads when fewer
    than cp per rank. The backward's exchange of the three gradients holds as much."""
    if sh.cp == 1:
        return 0
    bt = sh.b * sh.t
    kv = sh.kv if (m.num_kv_heads * sh.heads // m.num_heads) % sh.cp == 0 else sh.q
    return bt * sh.s * (sh.q + 2 * kv) + 2 * bt * sh.s * sh.q


def mlp_bytes(cfg: Any, sh: Shape, flags: dict[str, bool], s: Optional[int] = None) -> int:
    """The part of a block's saved activations that its MLP keeps (freed before attention's backward);
    `s`: bytes of an activation element (default the micro-batch's)."""
    bt = sh.b * sh.t
    s = s or sh.s
    if flags.get("moe"):
        return moe_bytes(cfg.model, sh, flags, s, cfg.lora.r if cfg.lora is not None else 0)
    if cfg.model.mlp == "gated":
        mlp = bt * sh.f * s * 2
    else:
        mlp = bt * sh.f * s * (1 if cfg.model.activation != "relu" else 0)
    if _saves_input(flags, "w2"):
        mlp += bt * sh.f * s
    return mlp


def moe_bytes(m: Any, sh: Shape, flags: dict[str, bool], s: int, lora_r: int = 0) -> int:
    """What a mixture-of-experts block's feed-forward saves for backward (models/moe.py), per micro-batch of
    n tokens routed to k experts each: the router's fp32 scores [n, E] and chosen experts (int64 [n, k]), with
    normalised weights their sum and the weights before it (fp32); the experts' order and the way back (int64
    [n k] each) and the per-expert offsets (int32 [E]); the routed copies of the input [n k, hidden] when a
    weight reading them trains (the gate and up projections, or their adapters); the gate and up projections
    [n k, F] each for the activation's backward, the activated ones [n k, F] when the down projection (or its
    adapter) trains; with LoRA on the routed experts (`lora_r`) each adapter's rank-r rows [n k, r]; the
    weights [n, k] and the experts' outputs [n k, hidden] for the weighted sum; the shared experts as a gated
    MLP (their input is the norm's output, counted with it). What needs no gradient is not kept: the
    router's tensors without anything training before it or in it, the outputs without the weights needing
    a gradient (LoRA alone on the experts, nothing before them training)."""
    upstream = flags.get("input_grad") or flags.get("norm") or any(_saves_input(flags, n)
                                                                    for n in ("wq", "wk", "wv", "wo"))
    trains = bool(flags.get("experts"))
    adapters = [w for w in ("w1", "w3", "w2") if flags.get(f"lora_experts_{w}")]
    gate_up = trains or "w1" in adapters or "w3" in adapters
    if not (trains or upstream or adapters):
        return 0
    n, k, e = sh.b * sh.t, m.num_experts_per_tok, m.num_experts
    copies = n * k
    routing = trains or upstream  # the router's output needs a gradient: its tensors and the experts' outputs
    router = (n * e * 4 + copies * 8 + ((n + copies) * 4 if m.norm_topk_prob else 0)) if routing else 0
    f = m.moe_intermediate_size
    experts = 2 * copies * 8 + e * 4 + (gate_up * copies * sh.h + routing * copies * sh.h) * s \
        + ((2 if gate_up or upstream else 0) + (trains or "w2" in adapters)) * copies * f * s + copies * s \
        + len(adapters) * copies * lora_r * s
    shared = 3 * n * m.num_shared_experts * m.moe_intermediate_size * s
    return router + experts + shared
