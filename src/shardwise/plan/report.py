"""The plan as text: the workload, the physical limit, the top layouts, why the first wins, a target check.

`search` computes a `PlanResult`; this module only formats one (`format_plan`), and the callers
(`command`, `profile`) print it.
"""

from __future__ import annotations

import textwrap
from typing import Optional

from ..models import count_parameters
from ..units import GIB, gib, human
from .budget import EXTRAPOLATION_WARNING, FIT_PARAMS, FIT_TOKENS, BudgetPlan, rule_of_20
from .search import Candidate, PlanResult

PART_NAMES = {"compute": "compute", "recompute": "recomputation", "reference": "the reference model's forward",
              "tp_comm": "tensor-parallel communication",
              "dp_comm": "data-parallel communication", "pp_comm": "pipeline sends",
              "cp_comm": "context-parallel all-to-alls", "ep_comm": "expert-parallel all-to-alls",
              "bubble": "the pipeline bubble",
              "optimizer": "the optimizer step", "offload": "host transfers (CPU offload)"}


def format_plan(result: PlanResult) -> str:
    """Everything `shardwise plan` prints."""
    lines = header_lines(result)
    if result.ranked:
        lines += ["", candidate_table(result.ranked), ""]
        lines += wrap("why #1: " + explain_winner(result))
    else:
        lines += [""] + wrap(no_fit_message(result))
    target = target_check(result)
    if target:
        lines += [""] + wrap(target)
    return "\n".join(lines)


def header_lines(result: PlanResult) -> list[str]:
    """Workload, hardware, usable memory, the physical limit, and the search's size."""
    req = result.request
    cfg, hw, n = req.cfg, req.hardware, req.devices
    nodes = req.nodes or hw.nodes_for(n)
    m = cfg.model
    params = count_parameters(m)
    seq, gbs = cfg.data.seq_length, cfg.train.global_batch_size
    tune = ""
    if cfg.lora is not None:
        tune = f", LoRA r={cfg.lora.r}"
    elif cfg.freeze.active():
        tune = f", bottom {cfg.freeze.layers} layers frozen" + (" with embeddings" if cfg.freeze.embeddings else "")
    usable = result.ranked[0].usable if result.ranked else (result.smallest.usable if result.smallest else 0)
    reserve = "" if hw.kind == "cpu" else f", {hw.reserved_gib:g} GiB runtime reserve"
    shared = f" (the node's {hw.memory_gib:g} GiB RAM shared by {n // nodes} processes)" if hw.kind == "cpu" else ""
    lim = result.limit
    lines = [
        f"workload   {m.preset or m.model_type}: {human(params)} parameters, seq {seq}, global batch {gbs} "
        f"({gbs * seq:,} tokens per step), {cfg.optimize.mixed_precision} {cfg.optimize.level()}{tune}",
        f"hardware   {n} x {hw.summary()}; {nodes} node(s)",
        f"memory     {gib(usable, 1)} usable per device{shared} ({100 * req.memory_margin:g}% safety "
        f"margin{reserve})",
        f"limit      {limit_arithmetic(lim)}",
    ]
    if "float8_tokens_per_s_per_device" in lim:
        lines.append(f"float8     {lim['float8_flops_per_token']:.3g} of those FLOPs per token (the block linears) at "
                     f"{lim['float8_peak_flops'] / 1e12:g} TFLOP/s float8: "
                     f"{lim['float8_tokens_per_s_per_device']:,.0f} tokens/s per device at best; MFU below stays "
                     "against the 16-bit peak")
    if lim["flops_per_token"] < lim["full_training_flops_per_token"]:
        lines.append(f"           frozen weights skip their weight gradients: {lim['flops_per_token']:.3g} FLOPs "
                     f"per token instead of {lim['full_training_flops_per_token']:.3g} with every weight trained")
    fit_note = (f"{len(result.faster_not_fitting)} faster one(s) do not fit" if result.ranked
                else "none fits")
    lines.append(f"search     {result.evaluated:,} layouts timed, {result.estimated:,} memory estimates; {fit_note}")
    return lines


def limit_arithmetic(lim: dict[str, float]) -> str:
    """'989 TFLOP/s / 4.29e10 FLOPs per token = 23,073 tokens/s per device at 100% MFU'."""
    return (f"{lim['peak_flops'] / 1e12:g} TFLOP/s / {lim['flops_per_token']:.3g} FLOPs per token = "
            f"{lim['tokens_per_s_per_device']:,.0f} tokens/s per device at 100% MFU (the physical best)")


def candidate_table(cands: list[Candidate]) -> str:
    """The ranked layouts as a fixed-width table."""
    head = ("#", "layout", "ZeRO", "recompute", "mbs x GA", "schedule", "memory GiB", "step s", "tok/s/dev",
            "MFU", "where the time goes")
    rows = [head]
    for i, c in enumerate(cands, 1):
        lay, s = c.layout, c.step
        # "/step": ZeRO 2/3 gradients reduced once per step (full size until then), not every micro-batch
        params = "+params" + (f"[:{lay.offload_blocks}]" if lay.offload_blocks else "")  # the first blocks only
        zero = (f"{lay.zero}" + ("+off" if lay.offload else "") + (params if lay.offload_params else "")
                + ("+act" if lay.offload_activations else "")
                + ("/step" if lay.reduce_gradients == "once_per_step" else ""))
        recompute = lay.recompute + (f", loss chunk {lay.loss_chunk}" if lay.loss_chunk else "")
        rows.append((str(i), lay.short(), zero, recompute,
                     f"{lay.micro_batch} x {lay.accumulation}", lay.schedule_name(),
                     f"{c.peak / GIB:.3g}", f"{s.total:.3g}", f"{s.tokens_per_s_per_device:,.0f}",
                     f"{100 * s.mfu:.1f}%", s.breakdown()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for r in rows:
        out.append("  ".join(cell.ljust(w) if i in (1, 3, 5, 10) else cell.rjust(w)
                             for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(out)


def explain_winner(result: PlanResult) -> str:
    """Why the first layout beats the others: its time split, the runner-up's extra cost, faster layouts
    that do not fit, and the documents' rule of thumb (prefer data parallelism) checked."""
    best = result.ranked[0]
    s = best.step
    parts = [f"{best.layout.describe()} predicts {s.total:.3g} s per step, {s.tokens_per_s_per_device:,.0f} "
             f"tokens/s per device ({100 * s.mfu:.1f}% MFU); its step is {s.breakdown()}."]
    if len(result.ranked) > 1:
        runner = result.ranked[1]
        parts.append(_compare(best, runner, "The next best"))
    if result.faster_not_fitting:
        fastest = result.faster_not_fitting[0]
        parts.append(f"{len(result.faster_not_fitting)} faster layout(s) do not fit: the fastest, "
                     f"{fastest.layout.describe()} ({fastest.step.total:.3g} s), needs {gib(fastest.peak, 1)} "
                     f"of the {best.usable / GIB:.1f} usable.")
    dp = result.best_data_parallel
    if best.layout.cp > 1:
        parts.append(f"Context parallelism splits each {best.cfg.data.seq_length}-token sequence over {best.layout.cp} "
                     "devices (two all-to-alls around every attention), so each holds the activations of "
                     f"{best.cfg.data.seq_length // best.layout.cp} tokens.")
    if best.layout.ep > 1:
        m = best.cfg.model
        parts.append(f"Expert parallelism holds {m.num_experts // best.layout.ep} of each block's {m.num_experts} "
                     f"experts per device (groups of {best.layout.ep} data-parallel ranks exchange the routed tokens "
                     "by all-to-all in every MoE block).")
    data_only = best.layout.tp == 1 and best.layout.pp == 1 and best.layout.cp == 1  # EP spans data ranks
    if data_only:
        if best.layout.ep == 1:
            parts.append("Plain data parallelism wins, as the documents advise.")
    elif dp is None:
        parts.append("No pure data-parallel layout fits, so model parallelism is needed here.")
    else:
        parts.append(_compare(best, dp, "The best pure data-parallel layout"))
    return " ".join(parts)


def _compare(best: Candidate, other: Candidate, what: str) -> str:
    """How much slower `other` is than `best`, and the part of the step that makes the difference."""
    slower = other.step.total / best.step.total - 1
    diffs = {p: getattr(other.step, p) - getattr(best.step, p) for p in best.step.PARTS}
    part, extra = max(diffs.items(), key=lambda kv: kv[1])
    because = f", mostly {PART_NAMES[part]} (+{extra:.3g} s)" if extra > 0 else ""
    close = " (closer than the model can tell apart: either will do)" if slower < 0.02 else ""
    return f"{what}, {other.layout.describe()}, is {100 * slower:.1f}% slower{because}{close}."


def no_fit_message(result: PlanResult) -> str:
    """Nothing fits: by how much the most frugal layout misses, and what would help."""
    req = result.request
    c = result.smallest
    if c is None:
        return "no layout fits"
    over = c.peak - c.usable
    msg = (f"No layout fits: the most memory-frugal one, {c.layout.describe()}, needs {gib(c.peak, 1)} per "
           f"device, {gib(over, 1)} ({100 * over / max(c.usable, 1):.0f}%) over the {gib(c.usable, 1)} "
           f"usable on {req.hardware.name}.")
    if c.memory is not None:
        msg += " " + _largest_parts(c)
    if result.advice:
        msg += " What would help: " + "; ".join(result.advice) + "."
    return msg


def _largest_parts(c: Candidate) -> str:
    mem = c.memory
    parts = {"parameters": mem.params, "gradients": mem.grads, "optimizer state": mem.optimizer,
             "activations": mem.activations, "buffers": mem.buffers}
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    return "Largest parts: " + ", ".join(f"{k} {gib(v, 1)}" for k, v in top) + "."


def target_check(result: PlanResult) -> Optional[str]:
    """Compare `--target-tokens-per-s` with the physical limit and with the best prediction."""
    target = result.request.target_tokens_per_s
    if target is None:
        return None
    lim = result.limit
    needed = target * lim["flops_per_token"]
    peak = lim["peak_flops"]
    if needed > peak:
        return (f"target {target:,.0f} tokens/s per device is IMPOSSIBLE: {target:,.0f} tokens/s x "
                f"{lim['flops_per_token']:.3g} FLOPs per token = {needed / 1e12:,.0f} TFLOP/s per device, "
                f"{needed / peak:.1f} x the device's peak of {peak / 1e12:g} TFLOP/s; even at 100% MFU it "
                f"reaches {lim['tokens_per_s_per_device']:,.0f} tokens/s per device.")
    best = result.best
    if best is None:
        return f"target {target:,.0f} tokens/s per device: within the physical limit, but no layout fits."
    got = best.step.tokens_per_s_per_device
    if got >= target:
        return f"target {target:,.0f} tokens/s per device: met by #1 ({got:,.0f} predicted)."
    return (f"target {target:,.0f} tokens/s per device: possible in principle ({100 * needed / peak:.0f}% MFU), "
            f"but the best layout predicts {got:,.0f} ({100 * best.step.mfu:.1f}% MFU).")


def wrap(text: str, width: int = 110) -> list[str]:
    """Text wrapped to lines of at most `width` characters."""
    return textwrap.wrap(text, width=width, break_on_hyphens=False) or [""]


def amount(x: float) -> str:
    """Device-hours or a cost: whole numbers with commas from 100, else three significant figures."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def format_budget(bp: BudgetPlan) -> str:
    """What `shardwise plan --budget-hours/--budget-flops/--tokens` prints before the plan of the model taken."""
    s, req = bp.sizing, bp.result.request
    fit, m = s.fit, bp.model
    hw = req.hardware
    lines = []
    if bp.given == "hours":
        lines += wrap(f"budget     {bp.hours:g} h on {req.devices} x {hw.name} = {s.flops:.3g} FLOPs (6ND: 6 x "
                      f"{human(s.params)} parameters x {bp.tokens_per_s:,.0f} tokens/s predicted x {bp.hours:g} h; "
                      + (f"of {bp.rounds} size(s) planned, the lowest predicted loss at its own throughput)"
                         if bp.family else "the model given)")
                      if bp.fits else f"budget     {bp.hours:g} h on {req.devices} x {hw.name}: {s.flops:.3g} FLOPs "
                      "at the last model's size")
    elif bp.given == "flops":
        lines.append(f"budget     {s.flops:.3g} FLOPs (6ND)")
    else:
        lines.append(f"budget     {s.flops:.3g} FLOPs (6ND): the compute whose optimum is one pass over the "
                     f"{human(s.unique_tokens)} tokens")
    n20, d20 = rule_of_20(s.flops)
    lines += wrap(f"fit        L(N, D) = {fit.E:g} + {fit.A:g} / N^{fit.alpha:g} + {fit.B:g} / D^{fit.beta:g}: "
                  f"{fit.source}")
    lines += wrap(f"optimum    N_opt {human(s.n_opt)} parameters, D_opt {human(s.d_opt)} tokens "
                  f"({s.d_opt / s.n_opt:.0f} tokens per parameter), predicted loss {s.loss_opt:.3f}")
    inside = FIT_PARAMS[0] <= s.n_opt <= FIT_PARAMS[1] and FIT_TOKENS[0] <= s.d_opt <= FIT_TOKENS[1]
    lines += wrap(f"range      the fit's runs spanned {human(FIT_PARAMS[0])}-{human(FIT_PARAMS[1])} parameters and "
                  f"{human(FIT_TOKENS[0])}-{human(FIT_TOKENS[1])} tokens: this optimum lies "
                  + ("inside them" if inside else "OUTSIDE them, a further extrapolation"))
    lines += wrap(f"rule of 20 {human(n20)} parameters, {human(d20)} tokens (the paper's Approaches 1-2: ~20 tokens "
                  "per parameter; Chinchilla: 70B on 1.4T)")
    if s.unique_tokens is not None:
        if s.data_bound:
            lines += wrap(f"data       {human(s.unique_tokens)} unique tokens, fewer than D_opt: the best size with "
                          f"repeated tokens and excess parameters discounted (Muennighoff et al. 2023, "
                          f"arXiv:2305.16264, R_D* = 15.4, R_N* = 5.3) is "
                          f"{human(s.n_best)} parameters on {human(s.d_best)} tokens "
                          f"({s.d_best / s.unique_tokens:.2g} epochs), predicted loss {s.loss_best:.3f}"
                          + ("; past ~16 epochs repeats are worth little (at most 16.4x the unique tokens): more "
                             "unique data would help more than more compute" if s.d_best > 16 * s.unique_tokens
                             else ""))
        else:
            lines.append(f"data       {human(s.unique_tokens)} unique tokens: enough for D_opt "
                         f"({s.d_opt / s.unique_tokens:.2g} of an epoch)")
    repeats = f", {s.epochs:.2g} epochs worth {human(s.effective_tokens)}" if s.epochs > 1 else ""
    vocab = f"vocabulary {m.vocab_size:,}" + (" (--vocab-size V for your tokenizer's)" if bp.family else "")
    lines += wrap(f"model      {m.preset or 'LLaMA-like'} {m.hidden_size} wide, {m.num_layers} layers, "
                  f"{m.num_heads} heads, {vocab}: {human(s.params)} parameters on {human(s.tokens)} tokens{repeats}; "
                  f"predicted loss {s.loss:.3f} ({s.loss - s.loss_opt:+.3f} against the optimum)")
    gbs, seq = req.cfg.train.global_batch_size, req.cfg.data.seq_length
    lines += wrap(f"batch      {gbs:,} samples x {seq:,} tokens = {human(gbs * seq)} tokens per step, "
                  f"{s.tokens / (gbs * seq):,.0f} steps ({bp.batch_source or 'as planned'})")
    if bp.fits:
        best = bp.result.best
        lines += wrap(f"layout     {best.layout.describe()}: {best.step.tokens_per_s_per_device:,.0f} tokens/s per "
                      f"device ({100 * best.step.mfu:.1f}% MFU), {bp.tokens_per_s:,.0f} tokens/s on all {req.devices}")
        cost = f"; cost {amount(bp.device_hours)} device-hours x {bp.price_per_device_hour:g} = {amount(bp.cost)}" \
            if bp.cost is not None else f"; {amount(bp.device_hours)} device-hours"
        lines.append(f"time       {human(s.tokens)} tokens / {bp.tokens_per_s:,.0f} tokens/s = {bp.hours:,.1f} h "
                     f"({bp.hours / 24:,.1f} days) wall{cost}")
    else:
        lines.append(f"time       the model fits no layout of {req.devices} x {hw.name} (below)")
    lines += [""] + wrap("NOTE: " + EXTRAPOLATION_WARNING)
    return "\n".join(lines)
