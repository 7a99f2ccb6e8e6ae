"""Mixture-of-experts feed-forward: token-choice top-k routing, dropless, experts as stacked weights.

One `MoE` module replaces a block's `FeedForward` in the layers the config makes sparse
(`ModelConfig.is_moe_layer`). What it does, in the order of its forward:

- `Router`: each token's scores over the experts (softmax, or sigmoid as DeepSeek-V3), optionally
  limited to the best `topk_group` of `n_group` expert groups (a group scored by the sum of its two best
  scores), then the top `num_experts_per_tok` experts. The choice may add a per-expert `expert_bias`
  (DeepSeek-V3's correction bias, the auxiliary-loss-free balancing): the weights come from the scores
  without it. The weights are normalised to sum to one when `norm_topk_prob`, then scaled by
  `routed_scaling_factor`.
- `GroupedExperts`: every routed copy of a token sorted by expert, the experts' gated MLPs run as three
  grouped matrix multiplies over the sorted rows (`grouped_mm`: `torch._grouped_mm` where the device has
  it, else the rows padded to the largest group and one batched matmul), no token dropped, no Python
  loop over experts; each token's copies come back to its place and are summed with their weights.
- shared experts (`num_shared_experts`): a plain gated MLP every token also goes through (Qwen2-MoE's
  and DeepSeek-V3's; DeepSeek's shared width is `num_shared_experts * moe_intermediate_size`).

Load balancing. `moe_aux_loss_coef` adds an auxiliary loss (`moe_aux_loss`: "seq", per sequence as
DeepSeek-V3's complementary loss, or "batch", over the micro-batch as Switch/Mixtral's), and
`router_z_loss_coef` a z-loss on the router logits; both enter the backward through `AuxLossGradient`
(the output passes through unchanged; the losses' gradients join the backward), so the language-model
loss the trainer logs stays the cross-entropy alone and pipelines, chunked losses and recompute need
nothing special. Each loss is a mean over the step's sequences: the trainer sets `aux_loss_scale` (one
over the sequences per optimizer step, `set_aux_loss_scale`), which keeps the "seq" loss the same for
every data-parallel layout. `tokens_per_expert` counts the routed copies each expert received in training since the
last `take_expert_load` (the trainer's step logs max / mean per layer, and with `moe_bias_update_rate`
moves `expert_bias` towards balance after each step, `update_expert_bias`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.models.config import ModelConfig
from shardwise.models.init import init_normal
from shardwise.models.lean_ops import gated_activation


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [M, K], sorted by group, times their group's matrix of `w` [G, K, N]: [M, N].

    `offsets` [G] (int32) is where each group's rows end, `groups` [M] the group of each row. Uses
    `torch._grouped_mm` where the device runs it for this dtype and shape (CPU; CUDA from compute
    capability 9.0 in bf16); elsewhere the rows are padded to the largest group and multiplied in one
    batched matmul (a host read of the largest group's size)."""
    if _grouped_mm_runs(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    starts = (offsets - counts).long()
    position = torch.arange(x.shape[0], device=x.device) - starts[groups]
    padded = x.new_zeros(w.shape[0], int(counts.max()) if x.shape[0] else 0, x.shape[1])
    padded[groups, position] = x
    return torch.bmm(padded, w)[groups, position]


def local_experts(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight: a DTensor's local shard (expert parallelism), else `w`."""
    return w.to_local() if isinstance(w, DTensor) else w


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands on their device: every stride of the operands and
    the output a multiple of 16 bytes (a LoRA adapter's rank 4 in fp32 is, rank 3 is not)."""
    size = x.element_size()
    aligned = all(s * size % 16 == 0 for t in (x, w) for s in t.stride() if s != 1) and w.shape[-1] * size % 16 == 0
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and aligned and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class AuxLossGradient(torch.autograd.Function):
    """Identity on `out` whose backward also sends a gradient of one into `loss` (scaled by `scale`): an
    auxiliary loss joins the backward without joining the loss the trainer computes (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: D102
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class Router(nn.Module):
    """Token-choice top-k routing (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # DeepSeek-V3's e_score_correction_bias: added to the scores for the choice only (fp32, saved).
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, experts [N, k], scores [N, E] fp32, logits [N, E] fp32) for x [N, hidden]."""
        c = self.cfg
        logits = self.gate(x).float()
        scores = logits.sigmoid() if c.router_score == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias if c.router_bias else scores
        if c.n_group > 1:
            choice = _best_groups(choice, c.n_group, c.topk_group)
        experts = choice.topk(c.num_experts_per_tok, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if c.router_score == "sigmoid" else 0.0))
        weights = weights * c.routed_scaling_factor
        return weights.to(x.dtype), experts, scores, logits

    def reset_parameters(self, std: float) -> None:
        """Normal router weights (the bias: `MoE.reset_buffers`)."""
        init_normal(self.gate.weight, std)


def _best_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`choice` [N, E] with the experts outside each token's best `topk_group` of `n_group` equal groups
    set to -inf (a group scored by the sum of its two best choices, DeepSeek-V3's rule; not zero: with the
    correction bias a kept expert's choice may be negative)."""
    n, e = choice.shape
    groups = choice.view(n, n_group, e // n_group)
    group_scores = groups.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(topk_group, dim=-1).indices,
                                                                     True)
    return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)


class GroupedExperts(nn.Module):
    """The routed experts' gated MLPs as stacked weights: w1 and w3 [E, F, hidden], w2 [E, hidden, F].

    `token_exchange` (set from outside by expert parallelism, `parallel.expert`): this rank holds some of
    the experts (its slice of the stacked weights, a DTensor sharded along the experts) and the exchange
    sends each routed copy to the rank of its expert and the results back; None runs every expert here."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts = e
        self.activation = cfg.activation
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w3 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.token_exchange: Optional[Any] = None
        self.expert_replicas: Optional[Any] = None  # the ranks holding the same experts (expert parallelism)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] through each token's experts [N, k], summed with `weights` [N, k]."""
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # the routed copies grouped by expert, each group in token order
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.token_exchange is not None:  # given the copies to hold: it drops them once they are sent
            out = self.token_exchange([x[order // k]], counts, self.run_local)
        else:
            out = self.run_local(x[order // k], counts)
        back = out[order.argsort()].view(n, k, -1)  # each copy back in its token's place
        del out  # not saved for backward: free it before the weighted sum
        # [N, 1, k] @ [N, k, hidden]: the weighted sum without a [N, k, hidden] product in between
        return torch.bmm(weights.unsqueeze(1), back).squeeze(1)

    def run_local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows` sorted by expert, `counts` [experts held here] of them each, through those experts' MLPs."""
        # Under data parallelism at O2 expert-parallel weights stay fp32 (FSDP2, which casts the others for
        # compute, leaves them out): cast them here as it would.
        groups = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts,
                                         output_size=rows.shape[0])
        offsets = counts.cumsum(0).to(torch.int32)
        h = gated_activation(self.project(rows, "w1", offsets, groups), self.project(rows, "w3", offsets, groups),
                             self.activation)
        return self.project(h, "w2", offsets, groups)

    def project(self, rows: torch.Tensor, weight: str, offsets: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert through each one's `weight` ("w1", "w3" or "w2", [experts, out, in]): [rows, out].
        LoRA on the routed experts (`peft.lora.LoRAExperts`) adds its low-rank path here."""
        w = local_experts(getattr(self, weight)).to(rows.dtype)
        return grouped_mm(rows, w.transpose(1, 2), offsets, groups)

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal weights; the down projections get the depth-scaled std."""
        for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            init_normal(w, s)


class MoE(nn.Module):
    """Router, routed experts and optional shared experts in place of a block's feed-forward."""

    def __init__(self, cfg: ModelConfig, shared: Optional[nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared = shared
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32),
                             persistent=False)
        self.aux_loss_scale = 1.0  # one over the sequences per optimizer step (`set_aux_loss_scale`)
        # Context parallelism (set from outside, `parallel.context`): this rank holds 1/sequence_parts of each
        # sequence, and sequence_sum(t) sums t over the ranks holding the others (differentiable).
        self.sequence_parts = 1
        self.sequence_sum: Optional[Any] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        weights, experts, scores, logits = self.router(flat)
        if self.training:  # training's routing only: an evaluation or generation in between counts nothing
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(experts.reshape(-1), minlength=self.cfg.num_experts)
        out = self.experts(flat, experts, weights).view(b, t, h)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training and torch.is_grad_enabled():
            loss = self._balance_loss(scores, experts, logits, b, t)
            if loss is not None:
                out = AuxLossGradient.apply(out, loss, self.aux_loss_scale)
        return out

    def _balance_loss(self, scores: torch.Tensor, experts: torch.Tensor, logits: torch.Tensor, b: int,
                      t: int) -> Optional[torch.Tensor]:
        """The micro-batch's auxiliary and z-losses, summed over its sequences (None when both are off). Under
        context parallelism (`sequence_sum`) each rank holds `t` of each sequence's t x sequence_parts tokens:
        the per-sequence sums behind the auxiliary loss are summed over the ranks, and each rank adds
        1 / sequence_parts of the losses, so that the ranks' gradients add up to the whole sequences'."""
        c = self.cfg
        parts = self.sequence_parts
        total = None
        if c.moe_aux_loss_coef:
            e, k = c.num_experts, c.num_experts_per_tok
            per_seq = c.moe_aux_loss == "seq"
            rows = (b, t) if per_seq else (1, b * t)
            chosen = F.one_hot(experts, e).sum(dim=1).float().view(*rows, e).sum(dim=1)  # [S, E] copies
            probs = (scores / scores.sum(dim=-1, keepdim=True)).view(*rows, e).sum(dim=1)  # [S, E]
            if self.sequence_sum is not None:
                chosen, probs = self.sequence_sum(chosen.detach()), self.sequence_sum(probs)
            tokens = rows[1] * parts
            load = chosen / tokens * e / k  # f_i: tokens routed to i over the even share
            aux = (load * (probs / tokens)).sum(dim=-1)  # sum_i f_i P_i, per sequence (or the micro-batch)
            total = c.moe_aux_loss_coef * (aux.sum() if per_seq else aux.sum() * b) / parts
        if c.router_z_loss_coef:
            # per sequence, summed: this rank's part of each sequence's mean over its tokens
            z = logits.logsumexp(dim=-1).square().view(b, t).sum(dim=1).sum() / (t * parts)
            total = c.router_z_loss_coef * z if total is None else total + c.router_z_loss_coef * z
        return total

    def init_weights(self, std: float, out_std: float) -> None:
        """Initialise the router, the experts and the shared experts (as a dense block's `init_weights`)."""
        self.router.reset_parameters(std)
        self.experts.reset_parameters(std, out_std)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """No bias towards any expert, no load counted. Replaced, not zeroed: a model cast to 16 bits has cast
        these buffers too, and the balancing steps (moe_bias_update_rate) are far below bf16's resolution;
        they stay fp32."""
        self.router.expert_bias = torch.zeros_like(self.router.expert_bias, dtype=torch.float32)
        self.tokens_per_expert = torch.zeros_like(self.tokens_per_expert, dtype=torch.float32)


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE modules by block name ("layers.{name}...": a pipeline stage's, or a wrapped model's,
    too; a MoE module given alone is named "")."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            parts = name.split(".")
            out[parts[parts.index("layers") + 1] if "layers" in parts else name] = m
    return out


def set_aux_loss_scale(model: nn.Module, sequences_per_step: int) -> None:
    """Make each MoE layer's balance losses a mean over the step's `sequences_per_step` sequences."""
    for m in moe_layers(model).values():
        m.aux_loss_scale = 1.0 / max(1, sequences_per_step)


@contextlib.contextmanager
def routing_uncounted(*models: nn.Module) -> Iterator[None]:
    """Within the block, training-mode forwards of the `models` leave the expert load counters as they were:
    forwards that are not the policy's training (a pipeline stage's shape inference, preference tuning's
    reference pass with LoRA's adapters off) do not move the routers' correction bias."""
    counters = [m.tokens_per_expert for model in models for m in moe_layers(model).values()]
    before = [c.clone() for c in counters]
    try:
        yield
    finally:
        with torch.no_grad():
            for c, b in zip(counters, before):
                c.copy_(b)


@torch.no_grad()
def take_expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each MoE layer's routed copies per expert in training forwards since the last call ([E] fp32, on the
    device), and reset. A recomputed block's forward runs again in the backward and counts again: every
    expert of that block twice, which leaves the busiest-over-mean ratio and the bias update's signs as
    they are."""
    out = {}
    for name, m in moe_layers(model).items():
        out[name] = m.tokens_per_expert.clone()
        m.tokens_per_expert.zero_()
    return out


@torch.no_grad()
def update_expert_bias(model: nn.Module, load: dict[str, torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of each expert that received fewer
    copies than the mean over the step (`load`, summed over every rank), lower it for those above."""
    for name, m in moe_layers(model).items():
        counts = load[name]
        m.router.expert_bias.add_(rate * torch.sign(counts.mean() - counts))


def reset_moe_buffers(model: nn.Module) -> None:
    """Zero every MoE block's buffers in fp32 on their device: the routers' correction biases and the load
    counters (a model allocated without initialisation, or cast to 16 bits, before its weights are loaded)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.reset_buffers()
