"""The report's figures, drawn with matplotlib (the `report` extra) on the Agg canvas: PNG bytes, no window.

Every curve of a run has the run's colour; restarts are dashed vertical lines and skipped steps
crosses, on every plot against the step. A field that holds one value for a whole run (the loss scale
without fp16) is not drawn for it, and a plot with nothing else is left out (`constant_series` names
them). The memory chart compares like with like: on a CPU, whose measured peak is the process's
resident set, the estimate's bar carries the runtime's own resident memory too. matplotlib is imported
inside `html_page.figure_class`, so the rest of shardwise works without it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from ..html_page import figure_class
from ..units import GIB
from .runs import Run

# (id, title, metrics field, y label) of the plots of one field against the step (the loss has its own)
STEP_PLOTS = (
    ("lr", "Learning rate", "lr", "learning rate"),
    ("grad_norm", "Gradient norm (before clipping)", "grad_norm", "gradient norm"),
    ("loss_scale", "Loss scale", "loss_scale", "loss scale"),
    ("tokens_per_s", "Throughput", "tokens_per_s", "tokens/s (all devices)"),
    ("mfu", "Model FLOPs utilisation", "mfu", "MFU"),
    ("peak_memory", "Peak memory", "peak_memory_gb", "GiB"),  # the label says what was measured: peak_memory_label
)
MEMORY_PARTS = (("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optimizer"),
                ("activations", "activations"), ("buffers", "buffers"), ("allocator overhead", "overhead"))


@dataclass(frozen=True)
class Plot:
    """One figure: its id (the PNG's file name and the <img> id), title, and PNG bytes."""

    id: str
    title: str
    png: bytes


def colour(i: int) -> str:
    """The colour of the i-th run (matplotlib's default cycle)."""
    return f"C{i % 10}"


def text(name: str) -> str:
    """A run's name as matplotlib text: `$` escaped (else `a$x$` is parsed as mathtext, and a bad formula
    stops the report), and no leading `_` (a legend leaves such labels out)."""
    name = name.replace("$", r"\$")
    return " " + name if name.startswith("_") else name


def peak_memory_label(runs: list[Run]) -> str:
    """The y label of the peak-memory plot: device memory allocated (largest rank), or a CPU's process RSS."""
    kinds = {r.peak_memory_is_rss for r in runs if r.measured_device is not None}
    if kinds == {True}:
        return "GiB: process peak RSS (cpu)"
    if kinds == {False}:
        return "GiB: peak allocated, largest rank"
    return "GiB: peak allocated (accelerator) / process RSS (cpu)"


def constant(values: list[float]) -> bool:
    """Whether a run's series holds one value throughout (two records or more): nothing to draw."""
    return len(values) > 1 and all(v == values[0] for v in values)


def constant_series(runs: list[Run]) -> list[tuple[str, str, float]]:
    """(plot title, run name, value) of every step plot's field that is constant for a run, not drawn."""
    return [(title, run.name, values[0]) for _, title, key, _ in STEP_PLOTS for run in runs
            if constant(values := run.series(key)[1])]


def all_plots(runs: list[Run]) -> list[Plot]:
    """Every figure of the report, in the order it shows them."""
    figure = figure_class()
    plots = [loss_against_step(figure, runs), loss_against_tokens(figure, runs)]
    for plot_id, title, key, ylabel in STEP_PLOTS:
        series = [run.series(key)[1] for run in runs]
        if any(series) and all(constant(values) or not values for values in series):
            continue  # constant for every run that logged it: the page names it instead
        ylabel = peak_memory_label(runs) if key == "peak_memory_gb" else ylabel
        plots.append(against_step(figure, runs, plot_id, title, key, ylabel))
    if any(run.series("reward_accuracy")[0] for run in runs):  # preference tuning
        plots += [train_and_eval(figure, runs, plot_id, title, key, ylabel) for plot_id, title, key, ylabel in (
            ("reward_accuracy", "Reward accuracy (pairs ranked right)", "reward_accuracy", "share of pairs"),
            ("reward_margin", "Reward margin (chosen minus rejected)", "reward_margin", "mean margin"))]
    if len(runs) > 1:
        plots.append(loss_differences(figure, runs))
    if any(r.memory is not None or r.max_peak_memory_gb() is not None for r in runs):
        plots.append(memory_bars(figure, runs))
    if any(r.profile for r in runs):
        plots.append(profile_shares(figure, runs))
    if any(r.records and "tokens_by_source" in r.records[-1] for r in runs):
        plots.append(mixture_shares(figure, runs))
    return plots


def source_shares(run: Run) -> dict[str, tuple[list[int], list[float]]]:
    """A mixture run's share of each source in the tokens read between one logged step and the next
    (`tokens_by_source`, cumulative): source -> (steps, shares)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    before: dict[str, int] = {}
    for record in run.records:
        read = record.get("tokens_by_source")
        if not read:
            continue
        gained = {name: tokens - before.get(name, 0) for name, tokens in read.items()}
        total = sum(gained.values())
        if total > 0:
            for name, tokens in gained.items():
                steps, shares = out.setdefault(name, ([], []))
                steps.append(record["step"])
                shares.append(tokens / total)
        before = dict(read)
    return out


def mixture_shares(figure: Any, runs: list[Run]) -> Plot:
    """Each source's share of the tokens read between logged steps (data.sources): the blend and its
    schedule's changes, one line per source, runs told apart by line style."""
    fig, ax = _axes(figure, "Data mixture: each source's share of the tokens read", "step", "share of tokens")
    has_data = False
    styles = ("-", "--", ":", "-.")
    for i, run in enumerate(runs):
        for j, (name, (steps, shares)) in enumerate(source_shares(run).items()):
            has_data = True
            ax.plot(steps, shares, color=colour(j), linestyle=styles[i % len(styles)],
                    label=f"{text(run.name)}: {text(name)}" if len(runs) > 1 else text(name))
    ax.set_ylim(0, 1)
    _finish(fig, ax, has_data)
    return Plot("mixture", "Data mixture", _png(fig))


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _axes(figure: Any, title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    fig = figure(figsize=(7.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _finish(fig: Any, ax: Any, has_data: bool) -> None:
    if has_data:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no values logged", ha="center", va="center", transform=ax.transAxes)


def skipped_marks(run: Run, steps: list[int], values: list[float]) -> tuple[list[tuple[int, float]], list[int]]:
    """Where to cross the skipped steps of a run: (step, value) on the curve, and the steps the curve has no
    value at (a window whose every step was skipped logs a NaN loss), crossed at the foot of the plot."""
    at = dict(zip(steps, values))
    skipped = [s for s, _ in run.skipped()]
    return [(s, at[s]) for s in skipped if s in at], [s for s in skipped if s not in at]


def _marks(ax: Any, run: Run, i: int, steps: list[int], values: list[float]) -> None:
    """Restarts (dashed lines) and skipped steps (red crosses) of one run."""
    for j, step in enumerate(run.restarts):
        ax.axvline(step, color=colour(i), linestyle="--", linewidth=1,
                   label=f"{text(run.name)}: resumed" if j == 0 else None)
    on_curve, off_curve = skipped_marks(run, steps, values)
    label = None if "skipped steps" in ax.get_legend_handles_labels()[1] else "skipped steps"  # once a plot
    if on_curve:
        ax.scatter([s for s, _ in on_curve], [v for _, v in on_curve], marker="x", color="red", zorder=3, label=label)
        label = None
    if off_curve:  # x in data, y in axes coordinates: just above the x axis (a line, so the x limits take it in)
        ax.plot(off_curve, [0.03] * len(off_curve), linestyle="none", marker="x", color="red", zorder=3, label=label,
                transform=ax.get_xaxis_transform())


def against_step(figure: Any, runs: list[Run], plot_id: str, title: str, key: str, ylabel: str) -> Plot:
    """One metrics field against the step, every run overlaid (but those for which it is constant)."""
    fig, ax = _axes(figure, title, "step", ylabel)
    has_data = False
    for i, run in enumerate(runs):
        steps, values = run.series(key)
        if steps and not constant(values):
            has_data = True
            ax.plot(steps, values, color=colour(i), label=text(run.name), marker="." if len(steps) < 30 else None)
            _marks(ax, run, i, steps, values)
    if key == "loss_scale" and has_data:
        ax.set_yscale("log", base=2)
    _finish(fig, ax, has_data)
    return Plot(plot_id, title, _png(fig))


def loss_against_step(figure: Any, runs: list[Run]) -> Plot:
    """Training loss (line) and evaluation loss (dashed, circles) against the step."""
    return train_and_eval(figure, runs, "loss_step", "Loss against step", "loss", "loss")


def train_and_eval(figure: Any, runs: list[Run], plot_id: str, title: str, key: str, ylabel: str) -> Plot:
    """A training figure (line) and its evaluation one (eval_<key>: dashed, circles) against the step."""
    fig, ax = _axes(figure, f"{title} (train; eval dashed)", "step", ylabel)
    has_data = False
    for i, run in enumerate(runs):
        steps, values = run.series(key)
        if steps:
            has_data = True
            ax.plot(steps, values, color=colour(i), label=f"{text(run.name)} train")
            _marks(ax, run, i, steps, values)
        e_steps, e_values = run.eval_series(key)
        if e_steps:
            has_data = True
            ax.plot(e_steps, e_values, color=colour(i), linestyle="--", marker="o", label=f"{text(run.name)} eval")
    _finish(fig, ax, has_data)
    return Plot(plot_id, title, _png(fig))


def loss_against_tokens(figure: Any, runs: list[Run]) -> Plot:
    """Training and evaluation loss against tokens seen (step x tokens per step)."""
    fig, ax = _axes(figure, "Loss against tokens seen (train; eval dashed)", "tokens seen", "loss")
    has_data = False
    for i, run in enumerate(runs):
        if not run.tokens_per_step:
            continue
        steps, values = run.series("loss")
        e_steps, e_values = run.eval_series()
        if steps:
            ax.plot([s * run.tokens_per_step for s in steps], values, color=colour(i), label=f"{text(run.name)} train")
        if e_steps:
            ax.plot([s * run.tokens_per_step for s in e_steps], e_values, color=colour(i), linestyle="--",
                    marker="o", label=f"{text(run.name)} eval")
        has_data = has_data or bool(steps or e_steps)
    _finish(fig, ax, has_data)
    return Plot("loss_tokens", "Loss against tokens seen", _png(fig))


def loss_differences(figure: Any, runs: list[Run]) -> Plot:
    """Each later run's training loss minus the first run's, at the steps both logged."""
    base = runs[0]
    fig, ax = _axes(figure, f"Loss difference against {text(base.name)}", "step",
                    f"loss - loss of {text(base.name)}")
    ax.axhline(0.0, color=colour(0), linewidth=1)
    has_data = False
    for i, run in enumerate(runs[1:], start=1):
        pairs = common_losses(base, run)
        if pairs:
            has_data = True
            ax.plot([s for s, _, _ in pairs], [b - a for _, a, b in pairs], color=colour(i), marker=".",
                    label=text(run.name))
    _finish(fig, ax, has_data)
    return Plot("loss_diff", "Loss difference against the first run", _png(fig))


def common_losses(base: Run, other: Run) -> list[tuple[int, float, float]]:
    """(step, loss of base, loss of other) at the steps both runs logged (the last record of a step counts)."""
    a, b = dict(zip(*base.series("loss"))), dict(zip(*other.series("loss")))
    return [(s, a[s], b[s]) for s in sorted(set(a) & set(b))]


def comparable_peak(run: Run) -> float | None:
    """The measured peak the memory chart sets beside the run's estimate: device memory allocated, or on a
    CPU the process's peak RSS when the records say the runtime's own resident memory (the chart adds it
    to the estimate); None for a CPU run that does not (tensors against a whole process would mislead)."""
    peak = run.max_peak_memory_gb()
    if peak is None or (run.peak_memory_is_rss and run.memory is not None and run.runtime_rss_gb() is None):
        return None
    return peak


def memory_bars(figure: Any, runs: list[Run]) -> Plot:
    """Per run: the estimate stacked by part (on a CPU with the runtime's resident memory on top) beside the
    measured peak (max peak_memory_gb), in GiB."""
    fig, ax = _axes(figure, "Memory per device: estimate (stacked) and measured peak", "", "GiB")
    labels, x, legend = [], 0, set()

    def once(name: str) -> str | None:  # each part in the legend once, whichever run has it first
        if name in legend:
            return None
        legend.add(name)
        return name

    for run in runs:
        runtime = run.runtime_rss_gb()
        if run.memory is not None:
            bottom = 0.0
            for j, (name, attr) in enumerate(MEMORY_PARTS):
                value = getattr(run.memory, attr) / GIB
                ax.bar(x, value, bottom=bottom, color=f"C{j}", label=once(name), width=0.6)
                bottom += value
            if runtime is not None:  # a CPU: what its resident set holds beside the tensors
                ax.bar(x, runtime, bottom=bottom, color="0.75", label=once("runtime (process RSS at start)"),
                       width=0.6)
            labels.append((x, f"{text(run.name)}\nestimate ({run.memory_device})"
                           + ("\n+ runtime" if runtime is not None else "")))
            x += 1
        peak = comparable_peak(run)
        if peak is not None:
            ax.bar(x, peak, color="0.35", hatch="//", label=once("measured peak"), width=0.6)
            labels.append((x, f"{text(run.name)}\nmeasured" + ("\n(process RSS)" if run.peak_memory_is_rss else "")))
            x += 1
        x += 0.5
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize="small")
    ax.grid(False)
    _finish(fig, ax, bool(labels))
    return Plot("memory", "Memory: estimate and measured peak", _png(fig))


def profile_shares(figure: Any, runs: list[Run]) -> Plot:
    """Per run with a profile: the step's shares of compute, communication and idle time."""
    fig, ax = _axes(figure, "Where the profiled steps' time went", "", "share of the time")
    kinds = ("compute", "communication", "idle")
    with_profile = [(i, r) for i, r in enumerate(runs) if r.profile]
    width = 0.8 / max(len(with_profile), 1)
    for k, (i, run) in enumerate(with_profile):
        shares = run.profile.get("shares", {})
        values = [float(shares.get(kind, math.nan)) for kind in kinds]
        ax.bar([j + k * width for j in range(len(kinds))], values, width=width, color=colour(i),
               label=text(run.name))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylim(0, 1)
    _finish(fig, ax, bool(with_profile))
    return Plot("profile_shares", "Profile: compute, communication and idle shares", _png(fig))
