"""Charts of a plan, an estimate or a budget: PNGs (matplotlib, the `report` extra) and a self-contained
index.html that embeds them (base64) beside a table of the same numbers, written with a plan.json of
those numbers so that a test or a script can read what the pictures show.

- `write_plan_report(result, out, profile=None)`: the top layouts' predicted step time split into its
  parts (compute, recompute, TP / DP / PP / CP communication, bubble, optimizer, host transfers), their
  memory per device stacked (parameters, gradients, optimizer state, activations, buffers, allocator
  overhead) against the usable memory and the device's capacity, and after `--profile` predicted
  against measured step time and memory.
- `write_estimate_report(estimates, out, capacity)`: the memory of each pipeline rank against a capacity.
- `write_budget_report(budget, out)`: predicted loss against model size at the budget (an IsoFLOP
  curve), with the optimum, the data-constrained best and the model taken marked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError
from ..html_page import embedded_png, escape, figure_class, page, table
from ..step_time import StepTime
from ..units import GIB
from .budget import EXTRAPOLATION_WARNING, BudgetPlan, isoflop_curve
from .search import Candidate, PlanResult

MEMORY_PARTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
                ("activations", "activations"), ("buffers", "buffers"), ("overhead", "allocator overhead"))
STEP_COLOURS = {"compute": "#4878d0", "recompute": "#82c6e2", "reference": "#a1c9f4", "tp_comm": "#ee854a",
                "dp_comm": "#d65f5f", "pp_comm": "#956cb4", "cp_comm": "#dc7ec0", "ep_comm": "#d5bb67",
                "bubble": "#8c613c", "optimizer": "#6acc64", "offload": "#797979"}


def chart_text(name: str) -> str:
    """A name (a hardware file's device) as matplotlib text: `$` escaped (else `a$x$` is parsed as mathtext,
    and a bad formula fails the whole drawing), one line, at most 80 characters."""
    name = " ".join(str(name).split())
    return (name if len(name) <= 80 else name[:77] + "...").replace("$", r"\$")


def _subplots(figsize: tuple[float, float]) -> tuple[Any, Any]:
    fig = figure_class()(figsize=figsize)
    return fig, fig.subplots()


# --- numbers ---------------------------------------------------------------------------------------


def step_numbers(step: StepTime) -> dict[str, float]:
    """A predicted step: every part in seconds, the total, tokens/s per device and MFU."""
    out = {p: getattr(step, p) for p in step.PARTS}
    out.update(total=step.total, tokens_per_s_per_device=step.tokens_per_s_per_device, mfu=step.mfu)
    return out


def memory_numbers(memory: Any) -> dict[str, int]:
    """A memory estimate's parts and peak, bytes."""
    return {**{key: int(getattr(memory, key)) for key, _ in MEMORY_PARTS}, "peak": int(memory.peak)}


def candidate_numbers(rank: int, c: Candidate) -> dict[str, Any]:
    """One ranked layout as plain data."""
    lay = c.layout
    label = f"#{rank} {lay.short()} Z{lay.zero} {lay.recompute} mb{lay.micro_batch}"
    return {"rank": rank, "layout": lay.describe(), "label": label,
            "step": step_numbers(c.step), "memory": memory_numbers(c.memory) if c.memory is not None else None,
            "usable_bytes": c.usable}


def capacity_per_device(req: Any) -> int:
    """A device's memory, bytes; on a CPU the processes of a node share its RAM (as `search.usable_bytes`)."""
    hw = req.hardware
    if hw.kind != "cpu":
        return int(hw.memory_gib * GIB)
    nodes = req.nodes or hw.nodes_for(req.devices)
    return int(hw.memory_gib * GIB / max(1, req.devices // nodes))


def plan_numbers(result: PlanResult, profile: Any = None) -> dict[str, Any]:
    """What the plan's charts show, as plain data (plan.json)."""
    req = result.request
    hw = req.hardware
    out: dict[str, Any] = {"hardware": hw.name, "devices": req.devices, "capacity_bytes": capacity_per_device(req),
                           "layouts": [candidate_numbers(i, c) for i, c in enumerate(result.ranked, 1)]}
    if profile is not None:
        out["profile"] = [{"layout": run.label, "predicted_s": pred.total, "measured_s": run.step_s,
                           "calibrated_s": after, "estimated_bytes": run.estimate_peak,
                           "measured_bytes": run.memory_peak}
                          for run, pred, after in zip(profile.runs, profile.predicted, profile.calibration.after)]
    return out


# --- charts ----------------------------------------------------------------------------------------


def step_chart(layouts: Sequence[dict[str, Any]], path: Path) -> Path:
    """Horizontal stacked bars: each layout's predicted step time by part."""
    labels = [lay["label"] for lay in layouts][::-1]
    fig, ax = _subplots((9, 1.2 + 0.45 * len(layouts)))
    left = [0.0] * len(layouts)
    for part in StepTime.PARTS:
        widths = [lay["step"][part] for lay in layouts][::-1]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, color=STEP_COLOURS[part], label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("predicted seconds per optimizer step")
    ax.set_title("where the step's time goes (top layouts)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return _save(fig, path)


def memory_chart(bars: Sequence[tuple[str, dict[str, int]]], path: Path, capacity: Optional[int] = None,
                 usable: Optional[int] = None, title: str = "memory per device") -> Path:
    """Stacked bars of memory parts per bar (GiB), with the device's capacity (and usable memory) drawn."""
    fig, ax = _subplots((max(7.0, 3.4 + 0.9 * len(bars)), 4.5))
    labels = [label for label, _ in bars]
    bottom = [0.0] * len(bars)
    for key, name in MEMORY_PARTS:
        heights = [mem[key] / GIB for _, mem in bars]
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottom, label=name)
        bottom = [a + b for a, b in zip(bottom, heights)]
    ax.scatter(labels, [mem["peak"] / GIB for _, mem in bars], marker="_", s=400, color="black", label="peak",
               zorder=3)
    if capacity:
        ax.axhline(capacity / GIB, color="red", linestyle="-", label=f"capacity {capacity / GIB:.3g} GiB")
    if usable:
        ax.axhline(usable / GIB, color="red", linestyle="--", label=f"usable {usable / GIB:.3g} GiB")
    ax.set_ylabel("GiB per device")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return _save(fig, path)


def profile_chart(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Grouped bars of each profiled layout (#1 = the plan's first): predicted, measured and calibrated step
    time; beside them the estimated and measured peak memory (GiB; a layout without a measure has no bar)."""
    fig = figure_class()(figsize=(max(8.0, 3.0 + 2.6 * len(rows)), 4.0))
    time_ax, memory_ax = fig.subplots(1, 2)
    xs = list(range(len(rows)))
    for offset, key, name in ((-0.27, "predicted_s", "predicted"), (0.0, "measured_s", "measured"),
                              (0.27, "calibrated_s", "calibrated")):
        time_ax.bar([x + offset for x in xs], [r[key] for r in rows], width=0.27, label=name)
    for offset, key, name in ((-0.2, "estimated_bytes", "estimated"), (0.2, "measured_bytes", "measured")):
        memory_ax.bar([x + offset for x in xs], [(r[key] or 0) / GIB for r in rows], width=0.4, label=name)
    panels = ((time_ax, "seconds per step", "step time: predicted against measured"),
              (memory_ax, "GiB, busiest rank", "peak memory: estimated against measured (live tensors)"))
    for ax, ylabel, title in panels:
        ax.set_xticks(xs, [f"#{i + 1}" for i in xs])
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    return _save(fig, path)


def isoflop_chart(budget: BudgetPlan, path: Path) -> Path:
    """Predicted loss against model size at the budget, the optimum and the model taken marked."""
    s = budget.sizing
    fig, ax = _subplots((7.5, 4.5))
    curve = isoflop_curve(s.fit, s.flops)
    ax.plot([n for n, _ in curve], [loss for _, loss in curve], label=f"{s.flops:.3g} FLOPs, unlimited data")
    if s.unique_tokens is not None:
        limited = isoflop_curve(s.fit, s.flops, s.unique_tokens)
        ax.plot([n for n, _ in limited], [loss for _, loss in limited], linestyle="--",
                label=f"{s.unique_tokens:.3g} unique tokens (repeats and excess parameters discounted, Muennighoff)")
        ax.scatter([s.n_best], [s.loss_best], marker="s", color="tab:orange", zorder=3,
                   label=f"best for the data: {s.n_best:.3g}")
    ax.scatter([s.n_opt], [s.loss_opt], marker="o", color="tab:blue", zorder=3, label=f"optimum: {s.n_opt:.3g}")
    ax.scatter([s.params], [s.loss], marker="*", s=160, color="tab:red", zorder=4, label=f"taken: {s.params:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N (tokens D = C / 6N)")
    ax.set_ylabel("predicted loss (Hoffmann et al. 2022 fit)")
    ax.set_title("IsoFLOP curve at the budget (an extrapolation: absolute losses do not transfer)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# --- the page --------------------------------------------------------------------------------------


PAGE_STYLE = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
              "table{border-collapse:collapse;font-size:0.85em}td,th{border:1px solid #ccc;padding:2px 6px;"
              "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}")


def index_html(title: str, images: Sequence[Path], tables: Sequence[str], notes: Sequence[str] = ()) -> str:
    """A self-contained page: the notes, the PNGs embedded, and the HTML tables."""
    parts = [f"<h1>{escape(title)}</h1>", *(f"<p>{escape(note)}</p>" for note in notes)]
    parts += [embedded_png(image.read_bytes(), image.stem, image.name) for image in images]
    return page(title, PAGE_STYLE, "\n".join([*parts, *tables]))


def _gib(n: Optional[int]) -> str:
    return f"{n / GIB:.4g}" if n else "-"


def _out_dir(out: str | Path) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--report {out}: that is a file; give a directory to write the charts to")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_plan_report(result: PlanResult, out: str | Path, profile: Any = None,
                      budget: Optional[BudgetPlan] = None) -> Path:
    """The plan's charts, plan.json and index.html in `out` (with a budget: its IsoFLOP chart first);
    returns the index's path."""
    figure_class()  # fail before writing anything when matplotlib is missing
    out = _out_dir(out)
    numbers = plan_numbers(result, profile)
    (out / "plan.json").write_text(json.dumps(numbers, indent=1))
    layouts = numbers["layouts"]
    images, tables, notes = [], [], []
    if budget is not None:
        images.append(write_budget_report(budget, out))
        notes.append(EXTRAPOLATION_WARNING)
        tables.append(budget_table(budget))
    if layouts:
        images.append(step_chart(layouts, out / "step_time.png"))
        bars = [(lay["label"], lay["memory"]) for lay in layouts if lay["memory"] is not None]
        images.append(memory_chart(bars, out / "memory.png", numbers["capacity_bytes"], layouts[0]["usable_bytes"],
                                   f"memory per device on {chart_text(numbers['hardware'])}"))
        parts = [p for p in StepTime.PARTS if any(lay["step"][p] for lay in layouts)]
        tables.append(table(["layout", "step s", *parts, "tokens/s per device", "MFU", "peak GiB"],
                                 [[lay["label"] + " " + lay["layout"], f"{lay['step']['total']:.6g}",
                                   *(f"{lay['step'][p]:.4g}" for p in parts),
                                   f"{lay['step']['tokens_per_s_per_device']:,.0f}",
                                   f"{100 * lay['step']['mfu']:.1f}%",
                                   f"{lay['memory']['peak'] / GIB:.3g}" if lay["memory"] else "-"] for lay in layouts]))
    if profile is not None:
        rows = numbers["profile"]
        images.append(profile_chart(rows, out / "profile.png"))
        tables.append(table(["layout", "predicted s", "measured s", "calibrated s", "estimated peak GiB",
                                  "measured peak GiB"],
                                 [[f"#{i} {r['layout']}", f"{r['predicted_s']:.4g}", f"{r['measured_s']:.4g}",
                                   f"{r['calibrated_s']:.4g}", _gib(r["estimated_bytes"]), _gib(r["measured_bytes"])]
                                  for i, r in enumerate(rows, 1)]))
    notes.append(f"{result.request.devices} x {numbers['hardware']}: the {len(layouts)} fastest layouts that fit, "
                 "as `shardwise plan` ranks them" if layouts else "no layout fits")
    index = out / "index.html"
    index.write_text(index_html("shardwise plan", images, tables, notes))
    return index


def write_estimate_report(estimates: Sequence[Any], out: str | Path, capacity: Optional[int] = None) -> Path:
    """`shardwise estimate --report`: each pipeline rank's memory against `capacity` (when known)."""
    figure_class()
    out = _out_dir(out)
    bars = [(f"pipeline rank {i}" if len(estimates) > 1 else "device", memory_numbers(e))
            for i, e in enumerate(estimates)]
    (out / "estimate.json").write_text(json.dumps({"capacity_bytes": capacity,
                                                   "ranks": [mem for _, mem in bars]}, indent=1))
    image = memory_chart(bars, out / "memory.png", capacity, None, "estimated memory per device")
    head = ["", *(name for _, name in MEMORY_PARTS), "peak"]
    rows = [[label, *(f"{mem[key] / GIB:.4g}" for key, _ in MEMORY_PARTS), f"{mem['peak'] / GIB:.4g}"]
            for label, mem in bars]
    index = out / "index.html"
    index.write_text(index_html("shardwise estimate", [image], [table(head, rows)],
                                ["GiB per device" + (f"; capacity {capacity / GIB:.3g} GiB" if capacity else "")]))
    return index


def budget_table(budget: BudgetPlan) -> str:
    """The budget's figures as an HTML table."""
    s = budget.sizing
    rows = [("budget FLOPs (6ND)", f"{s.flops:.4g}"), ("fit", s.fit.source),
            ("N_opt parameters", f"{s.n_opt:.4g}"), ("D_opt tokens", f"{s.d_opt:.4g}"),
            ("predicted loss at the optimum", f"{s.loss_opt:.4f}")]
    if s.unique_tokens is not None:
        rows += [("unique tokens", f"{s.unique_tokens:.4g}"), ("best parameters for the data", f"{s.n_best:.4g}")]
    rows += [("model taken: parameters", f"{s.params:.4g}"), ("tokens it sees", f"{s.tokens:.4g}"),
             ("its predicted loss", f"{s.loss:.4f}"),
             ("wall hours", f"{budget.hours:.4g}" if budget.hours is not None else "does not fit"),
             ("cost", f"{budget.cost:.4g}" if budget.cost is not None else "-")]
    return table(["budget", ""], rows)


def write_budget_report(budget: BudgetPlan, out: str | Path) -> Path:
    """The IsoFLOP chart of a budget (and budget.json) in `out`."""
    figure_class()
    out = _out_dir(out)
    s = budget.sizing
    numbers = {"flops": s.flops, "n_opt": s.n_opt, "d_opt": s.d_opt, "loss_opt": s.loss_opt, "n_best": s.n_best,
               "d_best": s.d_best, "params": s.params, "tokens": s.tokens, "loss": s.loss,
               "unique_tokens": s.unique_tokens, "hours": budget.hours, "cost": budget.cost,
               "fit": s.fit.source, "warning": EXTRAPOLATION_WARNING}
    (out / "budget.json").write_text(json.dumps(numbers, indent=1))
    return isoflop_chart(budget, out / "budget_isoflop.png")
