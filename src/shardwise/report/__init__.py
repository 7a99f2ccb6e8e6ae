"""`shardwise report RUN_DIR [RUN_DIR ...]`: one self-contained report.html of one or more runs (their
curves overlaid, with their differences), and its PNGs beside it.

`runs.py` reads the run directories (a run still in progress too), `plots.py` draws the figures
(matplotlib, the `report` extra), `html.py` writes the page.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ShardwiseError
from ..files import write_bytes_atomic, write_text_atomic
from ..html_page import figure_class
from .html import render
from .plots import all_plots
from .runs import Run, read_run, run_names

REPORT_FILE = "report.html"

__all__ = ["REPORT_FILE", "Run", "read_run", "write_report"]


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write OUT/report.html and OUT/<plot>.png for the runs (default OUT: the first run's report/); its path."""
    if not run_dirs:
        raise ShardwiseError("give at least one run directory")
    figure_class()  # before any reading: say what to install first
    paths = [Path(p) for p in run_dirs]
    runs = [read_run(p, name) for p, name in zip(paths, run_names(paths))]
    plots = all_plots(runs)
    out_dir = Path(out) if out is not None else paths[0] / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    for plot in plots:
        write_bytes_atomic(out_dir / f"{plot.id}.png", plot.png)
    report = out_dir / REPORT_FILE
    write_text_atomic(report, render(runs, plots))
    return report
