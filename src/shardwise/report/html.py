"""The report as one self-contained HTML page: inline CSS, PNGs as base64 data URIs, every text escaped.

Numbers are shown with 6 significant digits (`num`), the same in every table.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..html_page import embedded_png, escape, page, table
from ..units import GIB
from .plots import MEMORY_PARTS, Plot, common_losses, constant_series
from .runs import FineTuning, Run

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.plots { display: flex; flex-wrap: wrap; gap: 0.6em; }
.plots figure { margin: 0; } .plots img { width: 580px; border: 1px solid #eee; }
.note { color: #8a4b00; } pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
"""


def num(value: Any) -> str:
    """A number as the report shows it (6 significant digits; NaN and inf as such); a dash for none."""
    if value is None:
        return "\u2013"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.6g}"


def img(plot: Plot) -> str:
    """The plot's <figure>: its PNG embedded, with the plot's id and title."""
    return embedded_png(plot.png, plot.title, f"{plot.title} ({plot.id}.png)", f"plot-{plot.id}")


def summary_rows(runs: list[Run]) -> list[list[str]]:
    """One row per run: what it reached and what it cost."""
    rows = []
    for run in runs:
        steps = run.steps()
        last = steps[-1] if steps else None
        planned = run.config.train.max_steps if run.config is not None else None
        tokens = last * run.tokens_per_step if last is not None and run.tokens_per_step else None
        tps = run.series("tokens_per_s")[1]
        rows.append([
            run.name,
            f"{num(last)} of {num(planned)}" if planned else num(last),
            num(run.final("loss")),
            num(run.final("eval_loss")),
            num(tokens),
            num(run.max_peak_memory_gb()),
            run.peak_memory_kind(),
            num(statistics.median(tps)) if tps else num(None),  # a compiling first window moves no median
            num(run.final("mfu")),
            num(sum(n for _, n in run.skipped())),
            ", ".join(str(s) for s in run.restarts) or "none",
        ])
    return rows


SUMMARY_HEADER = ("run", "last step", "final loss", "final eval loss", "tokens seen", "max peak memory (GiB)",
                  "peak memory measured as", "median tokens/s (all devices, of the log records)", "final MFU",
                  "skipped steps", "resumed after step")


def difference_rows(runs: list[Run]) -> list[list[str]]:
    """Per later run: its training loss against the first run's at the steps both logged."""
    rows = []
    for run in runs[1:]:
        pairs = common_losses(runs[0], run)
        if not pairs:
            rows.append([run.name, "0", num(None), num(None), num(None)])
            continue
        diffs = [abs(b - a) for _, a, b in pairs]
        rels = [abs(b - a) / abs(a) if a else float("inf") for _, a, b in pairs]
        worst = max(range(len(pairs)), key=lambda k: diffs[k])
        rows.append([run.name, str(len(pairs)), num(max(diffs)), num(max(rels)), num(pairs[worst][0])])
    return rows


DIFFERENCE_HEADER = ("run", "common steps", "max |loss difference|", "max relative difference",
                     "step of the max |difference|")


def layout_text(run: Run) -> str:
    """The layout and the settings that decide memory and speed, in one line."""
    cfg = run.config
    p, o, t = cfg.parallel, cfg.optimize, cfg.train
    if run.devices is None and p.data_parallel == -1:  # the records did not show the device count
        devices, dp = "an unknown number of", "? (data_parallel -1)"
    else:
        devices, dp = run.devices or p.world_size(), p.dp_degree(run.devices)
    return (f"{devices} device(s): data {dp} x tensor {p.tensor_parallel} x pipeline {p.pipeline_parallel} x "
            f"context {p.context_parallel}, ZeRO stage {p.zero_stage}; micro-batch {t.micro_batch_size}, "
            f"gradient accumulation {cfg.gradient_accumulation(run.devices)}, sequence {cfg.data.seq_length}, "
            f"{num(run.tokens_per_step)} tokens per step; {o.mixed_precision} {o.level()}, recompute {o.recompute}; "
            f"device {cfg.run.device}")


def memory_rows(run: Run) -> list[list[str]]:
    rows = [[name, num(getattr(run.memory, attr) / GIB)] for name, attr in MEMORY_PARTS]
    rows.append([f"estimated peak ({run.memory.peak_phase})", num(run.memory.peak / GIB)])
    runtime = run.runtime_rss_gb()
    if runtime is not None:  # a CPU: its measured peak is the process's resident set, the runtime's memory too
        rows.append(["runtime (process RSS at start)", num(runtime)])
        rows.append(["estimated peak + runtime", num(run.memory.peak / GIB + runtime)])
    rows.append([f"measured peak: {run.peak_memory_kind()}", num(run.max_peak_memory_gb())])
    return rows


def data_rows(manifest: dict[str, Any]) -> list[list[str]]:
    c = manifest.get("counts", {})
    keys = (("documents", "documents"), ("tokens", "tokens"), ("documents read", "documents_read"),
            ("dropped (shorter than min_chars)", "dropped_short"), ("duplicates", "duplicates"),
            ("truncated", "truncated"), ("bad lines", "bad_lines"))
    return [[label, num(c.get(key))] for label, key in keys if key in c]


def run_section(run: Run, index: int) -> str:
    """Config, layout, memory, data, fine-tuning and profile of one run."""
    parts = [f'<h2 id="run-{index}">Run {escape(run.name)}</h2>', f"<p>{escape(run.path.resolve())}</p>"]
    parts += [f'<p class="note">{escape(n)}</p>' for n in run.notes]
    if run.config is not None:
        parts.append(f"<h3>Layout</h3><p>{escape(layout_text(run))}</p>")
    if run.config_text:
        parts.append("<details><summary>config.yaml (the config in force)</summary>"
                     f"<pre>{escape(run.config_text)}</pre></details>")
    if run.memory is not None:
        parts.append(memory_section(run, index))
    if run.manifest is not None:
        parts.append(f"<h3>Data</h3><p>prepared data: {escape(run.manifest_path)}</p>"
                     + table(("", "count"), data_rows(run.manifest), f"data-{index}"))
    if run.finetuning is not None:
        parts.append("<h3>Fine-tuning</h3>" + table(("", ""), finetuning_rows(run.finetuning), f"finetuning-{index}"))
    if run.profile:
        parts.append(profile_section(run, index))
    return "\n".join(parts)


def memory_section(run: Run, index: int) -> str:
    text = (f"<h3>Memory per device (estimate for {escape(run.memory_device)}, GiB)</h3>"
            + table(("part", "GiB"), memory_rows(run), f"memory-{index}"))
    if run.peak_memory_is_rss and run.runtime_rss_gb() is not None:
        text += ("<p>On the CPU the measured peak is the process's resident set: the tensors the estimate counts "
                 "and the runtime's own memory (the Python interpreter and libraries: the process's resident set "
                 "before training, as the records say), which the table and the memory chart add to the "
                 "estimate.</p>")
    elif run.peak_memory_is_rss:
        text += ("<p>On the CPU the measured peak is the process's resident set (the Python interpreter and "
                 "libraries included) while the estimate counts tensors only, and this run's records do not say "
                 "the runtime's own resident memory (runtime_rss_gb): the memory chart leaves the measured peak "
                 "out rather than set it beside the estimate.</p>")
    return text


def finetuning_rows(f: FineTuning) -> list[list[str]]:
    rows = [["fine-tuning", f.description], ["trainable", f.summary], ["trainable share", num(f.share)]]
    if f.adapter_params:
        rows.append(["adapter", f"{f.adapter_params:,} parameters ({num(f.adapter_params * 4 / 2**20)} MiB in fp32)"])
    return rows


def profile_section(run: Run, index: int) -> str:
    prof = run.profile
    rows = [[o.get("name", ""), num(o.get("self_time_ms")), num(o.get("share"))] for o in prof.get("top_operators", [])]
    shares = prof.get("shares", {})
    text = ", ".join(f"{k} {num(v)}" for k, v in shares.items())
    trace = f"<p>trace (Perfetto / Chrome JSON): {escape(run.path / prof['trace'])}</p>" if prof.get("trace") else ""
    steps = prof.get("steps")
    recorded = f" (steps {escape(', '.join(str(s) for s in steps))})" if isinstance(steps, list) and steps else ""
    return (f"<h3>Profile</h3><p>shares of the profiled time{recorded}: {escape(text)}</p>{trace}"
            + table(("operator", "self time (ms)", "share"), rows, f"profile-{index}"))


def render(runs: list[Run], plots: list[Plot]) -> str:
    """The whole page."""
    names = ", ".join(r.name for r in runs)
    body = [f"<h1>shardwise report</h1><p>{escape(names)}</p>",
            "<h2>Summary</h2>" + table(SUMMARY_HEADER, summary_rows(runs), "summary")]
    if len(runs) > 1:
        body.append(f"<h2>Differences against {escape(runs[0].name)}</h2>"
                    + table(DIFFERENCE_HEADER, difference_rows(runs), "differences"))
    body.append('<h2>Plots</h2><div class="plots">' + "".join(img(p) for p in plots) + "</div>")
    constants = constant_series(runs)
    if constants:
        body.append("<p>Not drawn, one value for the whole run: " + escape("; ".join(
            f"{title.lower()} {num(value)} ({name})" for title, name, value in constants)) + ".</p>")
    body += [run_section(run, i) for i, run in enumerate(runs)]
    return page(f"shardwise report: {names}", STYLE, "\n".join(body))
