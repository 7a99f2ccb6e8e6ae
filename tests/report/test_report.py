"""`shardwise report`: every plot is in the page as a decodable PNG, the page's numbers are the metrics' own
(computed here from the raw records), a torn last line is skipped, runs are overlaid with their loss
differences, restarts and fine-tuning are shown, and without matplotlib the command names the extra."""

from __future__ import annotations

import base64
import io
import json
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml

from shardwise.cli import main
from shardwise.config import load_config, to_yaml
from shardwise.errors import ShardwiseError
from shardwise.memory.estimate import estimate_memory
from shardwise.models import get_preset
from shardwise.models.config import ModelConfig
from shardwise.models.flops import count_parameters
from shardwise.report import plots, write_report
from shardwise.report.runs import find_restarts, read_run
from tests.data.conftest import write_corpus
from tests.test_cli import logging_restored

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")

GIB = 2**30
STEP_PLOTS = {"loss_step", "loss_tokens", "lr", "grad_norm", "loss_scale", "tokens_per_s", "mfu", "peak_memory"}
MICRO_BATCH, SEQ = 4, 32


class Page(HTMLParser):
    """The <img> tags and the tables (id -> rows of cell texts) of a report page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.images: dict[str, dict[str, str]] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "img":
            self.images[a["id"]] = a
        elif tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def table(self, table_id: str) -> list[dict[str, str]]:
        """A table's body rows as header -> cell."""
        header, *rows = self.tables[table_id]
        return [dict(zip(header, row)) for row in rows]

    def pairs(self, table_id: str) -> dict[str, str]:
        """A two-column table as first cell -> second."""
        return {row[0]: row[1] for row in self.tables[table_id][1:]}


def g(x: float) -> str:
    return f"{x:.6g}"


# --- synthetic runs -------------------------------------------------------------------------------------------


def record(step: int, loss: float, **extra) -> dict:
    """A training record with every field the trainer writes (values chosen per step, easy to check)."""
    r = {"step": step, "loss": loss, "lr": 1e-3 * step / 40, "grad_norm": 1.0 + step / 100,
         "loss_scale": 65536.0 if step < 30 else 32768.0,  # fp16's: lowered once
         "tokens_per_s": 1000.0 + step, "target_tokens_per_s": 990.0, "tokens_per_s_per_device": 1000.0 + step,
         "mfu": 0.3 + step / 1000, "peak_in_doubt": False, "peak_memory_gb": 1.0 + (step % 30) / 7,
         "skipped_steps": 0}
    r.update(extra)
    return r


def make_run(root: Path, name: str, records: list[dict], torn: str = "", **sections) -> Path:
    """A run directory: config.yaml (the config in force) beside metrics.jsonl, a prepared-data manifest."""
    run = root / name
    run.mkdir(parents=True)
    prepared = root / f"{name}_prepared"
    prepared.mkdir()
    manifest = {"format": "shardwise-token-shards", "counts": {"documents": 123, "tokens": 45678, "documents_read": 130,
                                                               "dropped_short": 4, "duplicates": 3, "truncated": 0}}
    (prepared / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    raw = {"model": {"preset": "tiny_llama"},
           "data": {"train_files": [str(prepared)], "tokenizer": str(root / "tok"), "seq_length": SEQ},
           "train": {"output_dir": str(run), "max_steps": 100, "micro_batch_size": MICRO_BATCH, "log_steps": 10},
           "run": {"device": "cpu"}}
    for key, values in sections.items():
        raw.setdefault(key, {}).update(values)
    (run / "config.yaml").write_text(to_yaml(load_config(raw=raw)), encoding="utf-8")
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(lines + torn, encoding="utf-8")
    return run


RECORDS = [record(10, 5.0), record(20, 4.5), {"step": 20, "eval_loss": 4.7, "eval_perplexity": 110.0},
           record(30, 4.25, skipped_steps=2), record(40, 4.0), {"step": 40, "eval_loss": 4.3, "eval_perplexity": 74.0}]
TORN = '{"step": 50, "loss": 1.0, "lr": 0.001, "grad_norm"'  # a killed writer's half line


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path, "base", RECORDS, torn=TORN)


def report_page(run_dirs: list[Path], out: Path) -> tuple[Page, Path]:
    path = write_report(run_dirs, out)
    return Page(path.read_text(encoding="utf-8")), path


def png_of(image: dict[str, str]) -> bytes:
    head, data = image["src"].split(",", 1)
    assert head == "data:image/png;base64"
    return base64.b64decode(data)


# --- the page --------------------------------------------------------------------------------------------------


def test_every_plot_is_in_the_page_as_a_decodable_png(run: Path, tmp_path: Path) -> None:
    page, path = report_page([run], tmp_path / "out")
    assert set(page.images) == {f"plot-{p}" for p in STEP_PLOTS | {"memory"}}
    for image_id, image in page.images.items():
        png = png_of(image)
        picture = PIL.open(io.BytesIO(png))
        picture.load()  # decodes the whole image
        assert picture.format == "PNG" and picture.size[0] > 100
        assert image["alt"]
        assert (path.parent / f"{image_id.removeprefix('plot-')}.png").read_bytes() == png  # the PNG beside it
    text = path.read_text(encoding="utf-8")
    assert "<script" not in text and "<link" not in text and "http" not in text.replace("http-equiv", "")


def test_the_numbers_are_the_metrics(run: Path, tmp_path: Path) -> None:
    page, _ = report_page([run], tmp_path / "out")
    train = [r for r in RECORDS if "loss" in r]
    (row,) = page.table("summary")
    assert row["final loss"] == g(train[-1]["loss"])  # 4.0: the torn step-50 line (loss 1.0) is skipped
    assert row["final eval loss"] == g(4.3)
    assert row["last step"] == "40 of 100"
    assert row["tokens seen"] == f"{40 * MICRO_BATCH * SEQ:,}"
    assert row["max peak memory (GiB)"] == g(max(r["peak_memory_gb"] for r in train))
    rates = sorted(r["tokens_per_s"] for r in train)
    middle = len(rates) // 2
    median = rates[middle] if len(rates) % 2 else (rates[middle - 1] + rates[middle]) / 2
    assert row["median tokens/s (all devices, of the log records)"] == g(median)
    assert row["final MFU"] == g(train[-1]["mfu"])
    assert row["skipped steps"] == "2"
    assert row["resumed after step"] == "none"
    cfg = load_config(run / "config.yaml")
    estimate = estimate_memory(cfg, 1, "cpu")
    memory = page.pairs("memory-0")
    assert memory["parameters"] == g(estimate.params / GIB)
    assert memory["activations"] == g(estimate.activations / GIB)
    assert memory[f"estimated peak ({estimate.peak_phase})"] == g(estimate.peak / GIB)
    assert memory["measured peak: process peak RSS (cpu)"] == row["max peak memory (GiB)"]
    assert row["peak memory measured as"] == "process peak RSS (cpu)"
    data = page.pairs("data-0")
    assert (data["documents"], data["tokens"], data["duplicates"], data["dropped (shorter than min_chars)"]) == \
        ("123", "45,678", "3", "4")


def test_a_run_in_progress_whose_last_line_is_torn(tmp_path: Path) -> None:
    """Only a torn line so far (the first record half-written): still a page, with the note that says so."""
    run = make_run(tmp_path, "early", [], torn=TORN)
    page, path = report_page([run], tmp_path / "out")
    (row,) = page.table("summary")
    assert row["final loss"] == "\u2013" and "holds no training record yet" in path.read_text(encoding="utf-8")
    assert set(page.images) == {f"plot-{p}" for p in STEP_PLOTS | {"memory"}}


def test_two_runs_overlaid_with_their_differences(run: Path, tmp_path: Path) -> None:
    deltas = {10: 0.0, 20: 0.01, 30: -0.05, 40: 0.02}  # the second run's loss minus the first's
    other = [dict(r, loss=r["loss"] + deltas[r["step"]]) if "loss" in r else r for r in RECORDS[:-1]]
    other.append(record(50, 3.9))  # a step the first run did not log: not compared
    second = make_run(tmp_path, "other", other)
    page, path = report_page([run, second], tmp_path / "out")
    assert "plot-loss_diff" in page.images
    assert [r["run"] for r in page.table("summary")] == ["base", "other"]
    (diff,) = page.table("differences")
    base = {r["step"]: r["loss"] for r in RECORDS if "loss" in r}
    assert diff["common steps"] == "4"
    assert diff["max |loss difference|"] == g(abs((4.25 - 0.05) - 4.25))
    assert diff["max relative difference"] == g(max(abs(d) / base[s] for s, d in deltas.items()))
    assert diff["step of the max |difference|"] == "30"
    assert path.parent == tmp_path / "out"


def test_default_out_is_the_first_runs_report_directory(run: Path) -> None:
    path = write_report([run])
    assert path == run / "report" / "report.html" and (run / "report" / "loss_step.png").is_file()


def test_restarts_are_found_and_shown(tmp_path: Path) -> None:
    # stopped by a signal after step 35 (off the log grid), resumed; then a crash resumed at step 50, said so
    records = [record(10, 5.0), record(20, 4.6), record(30, 4.4), record(35, 4.3), record(40, 4.2),
               {"step": 40, "resumed": True}, record(50, 4.1)]
    assert find_restarts(records) == [35, 40]
    # a file from before records were dropped on resume: the resumed run's first record (20) comes after 30
    assert find_restarts([record(s, 5.0) for s in (10, 20, 30, 20, 30, 40)]) == [19]
    assert find_restarts([record(10, 5.0), record(20, 4.6), record(25, 4.5)]) == []  # the last record: the end
    page, _ = report_page([make_run(tmp_path, "resumed", records)], tmp_path / "out")
    assert page.table("summary")[0]["resumed after step"] == "35, 40"


def test_a_profile_summary_is_shown(run: Path, tmp_path: Path) -> None:
    (run / "profile").mkdir()
    summary = {"top_operators": [{"name": "aten::mm", "self_time_ms": 12.5, "share": 0.41},
                                 {"name": "aten::<odd>", "self_time_ms": 3.0, "share": 0.1}],
               "shares": {"compute": 0.7, "communication": 0.2, "idle": 0.1}, "trace": "profile/trace.json"}
    (run / "profile" / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    page, _ = report_page([run], tmp_path / "out")
    assert "plot-profile_shares" in page.images
    assert page.table("profile-0") == [{"operator": "aten::mm", "self time (ms)": "12.5", "share": "0.41"},
                                       {"operator": "aten::<odd>", "self time (ms)": "3", "share": "0.1"}]


def test_a_lora_run_shows_its_trainable_share_and_adapter(tmp_path: Path) -> None:
    run = make_run(tmp_path, "lora", RECORDS, lora={"r": 4, "alpha": 8})
    page, _ = report_page([run], tmp_path / "out")
    preset = get_preset("tiny_llama")
    hidden, heads, kv = preset["hidden_size"], preset["num_heads"], preset["num_kv_heads"]
    kv_width = hidden // heads * kv
    # r x (in + out) for q, k, v and o in each layer
    adapter = preset["num_layers"] * 4 * (2 * hidden + 2 * (hidden + kv_width) + 2 * hidden)
    base = count_parameters(ModelConfig(**preset))
    rows = page.pairs("finetuning-0")
    assert rows["trainable"] == f"{adapter:,} of {base + adapter:,} parameters train " \
                                f"({100 * adapter / (base + adapter):.2f}%)"
    assert rows["trainable share"] == g(adapter / (base + adapter))
    assert rows["adapter"].startswith(f"{adapter:,} parameters")


def test_without_matplotlib_the_command_names_the_extra(run: Path, monkeypatch, capsys) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` raises ImportError
    with logging_restored():
        code = main(["report", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'shardwise[report]'" in err and "Traceback" not in err
    assert not (run / "report").exists()


# --- a real run ---------------------------------------------------------------------------------------------------


def test_the_report_of_a_real_run(tmp_path: Path, capsys) -> None:
    """A 4-step CLI run with evaluation, then `shardwise report`: the page's figures are its metrics.jsonl's."""
    from shardwise.data import train_bpe_tokenizer

    files = write_corpus(tmp_path / "corpus", n_files=2)
    train_bpe_tokenizer(files, 300, tmp_path / "tok", show_progress=False)
    cfg = {"model": {"preset": "tiny_llama"},
           "data": {"train_files": [str(tmp_path / "corpus" / "*.txt")], "tokenizer": str(tmp_path / "tok"),
                    "seq_length": SEQ, "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.1},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "micro_batch_size": MICRO_BATCH,
                     "lr": 1e-2, "log_steps": 2, "eval_steps": 4, "eval_batches": 1, "save_steps": 4,
                     "progress_bar": False, "tensorboard": False},
           "run": {"device": "cpu", "num_threads": 1}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        with logging_restored():
            assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
            assert main(["report", str(tmp_path / "run")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "report.html" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    page = Page((tmp_path / "run" / "report" / "report.html").read_text(encoding="utf-8"))
    (row,) = page.table("summary")
    assert row["final loss"] == g(train[-1]["loss"]) and row["last step"] == "4 of 4"
    assert row["final eval loss"] == g([r for r in records if "eval_loss" in r][-1]["eval_loss"])
    assert row["max peak memory (GiB)"] == g(max(r["peak_memory_gb"] for r in train))
    manifest = json.loads(next((tmp_path / "cache").glob("shards-*/manifest.json")).read_text())
    assert page.pairs("data-0")["tokens"] == f"{manifest['counts']['tokens']:,}"  # found in the cache
    # fp32: the loss scale is 1 throughout, not drawn (and so, by chance, may be a peak RSS reached early)
    assert {r["loss_scale"] for r in train} == {1.0}
    constant = {p for p, key in (("loss_scale", "loss_scale"), ("peak_memory", "peak_memory_gb"), ("lr", "lr"))
                if len({r[key] for r in train}) == 1}
    assert "loss_scale" in constant
    assert set(page.images) == {f"plot-{p}" for p in (STEP_PLOTS - constant) | {"memory"}}
    # On the CPU the estimate is set beside the process's peak RSS with the runtime's own resident memory
    runtime = {r["runtime_rss_gb"] for r in train}
    assert len(runtime) == 1 and 0 < min(runtime) <= min(r["peak_memory_gb"] for r in train)
    memory = page.pairs("memory-0")
    assert memory["runtime (process RSS at start)"] == g(min(runtime))


# --- odd inputs ---------------------------------------------------------------------------------------------------


@pytest.fixture()
def legends(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The legend labels each plot ends with (by y label), as matplotlib keeps them (a leading `_` is left out)."""
    seen: dict[str, list[str]] = {}
    finish = plots._finish

    def spy(fig, ax, has_data):
        finish(fig, ax, has_data)
        seen[ax.get_title()] = ax.get_legend_handles_labels()[1]

    monkeypatch.setattr(plots, "_finish", spy)
    return seen


def test_run_names_that_matplotlib_would_misread(tmp_path: Path, legends: dict[str, list[str]]) -> None:
    """A `$...$` in a directory name is not mathtext (a bad formula stopped the report), and a leading `_`
    does not drop the run from the legends."""
    odd = make_run(tmp_path, r"lr$\frac$", RECORDS)
    hidden = make_run(tmp_path, "_second", RECORDS)
    page, _ = report_page([odd, hidden], tmp_path / "out")
    assert [r["run"] for r in page.table("summary")] == [r"lr$\frac$", "_second"]
    assert legends["Learning rate"] == [r"lr\$\frac\$", "skipped steps", " _second"]
    assert " _second train" in legends["Loss against step (train; eval dashed)"]


def test_a_diverged_run_shows_its_non_finite_loss(tmp_path: Path) -> None:
    """A NaN last loss is the run's final loss: the summary does not show the last finite one instead."""
    records = RECORDS + [record(50, float("nan")), {"step": 50, "eval_loss": float("inf")}]
    page, path = report_page([make_run(tmp_path, "diverged", records)], tmp_path / "out")
    (row,) = page.table("summary")
    assert (row["final loss"], row["final eval loss"]) == ("nan", "inf")
    text = path.read_text(encoding="utf-8")
    assert "loss is not finite (NaN or infinite) at step(s) 50" in text
    assert "eval_loss is not finite (NaN or infinite) at step(s) 50" in text


def test_skipped_steps_without_a_loss_are_still_marked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window whose every step was skipped logs a NaN loss: its cross goes at the foot of the plot, inside
    the plot's x range."""
    records = [record(10, 5.0, skipped_steps=1), record(20, 4.0), record(30, float("nan"), skipped_steps=10)]
    run = read_run(make_run(tmp_path, "skips", records))
    steps, values = run.series("loss")
    assert plots.skipped_marks(run, steps, values) == ([(10, 5.0)], [30])
    limits: dict[str, tuple[float, float]] = {}
    finish = plots._finish
    monkeypatch.setattr(plots, "_finish", lambda fig, ax, has_data: (finish(fig, ax, has_data),
                                                                     limits.setdefault(ax.get_title(), ax.get_xlim())))
    write_report([run.path], tmp_path / "out")
    assert limits["Loss against step (train; eval dashed)"][1] >= 30


def test_not_a_run_directory_is_named_with_what_is_missing(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for target, says in (("nope", "does not exist"), ("afile", "is a file, not a run directory"),
                         ("empty", "holds no metrics.jsonl")):
        with pytest.raises(ShardwiseError, match=says):
            write_report([tmp_path / target], tmp_path / "out")
    with logging_restored():
        assert main(["report", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("summary, says", [
    ("{not json", "does not read"),
    ([1, 2], "not a JSON object"),
    ({"shares": {"compute": "most"}}, "`shares` is not a mapping of numbers"),
    ({"top_operators": [{"name": "aten::mm", "self_time_ms": "12"}]}, "not a number"),
    ({"trace": 3}, "`trace` is not a path"),
])
def test_a_broken_profile_summary_is_noted(tmp_path: Path, summary, says: str) -> None:
    run = make_run(tmp_path, "prof", RECORDS)
    (run / "profile").mkdir()
    text = summary if isinstance(summary, str) else json.dumps(summary)
    (run / "profile" / "summary.json").write_text(text, encoding="utf-8")
    shown = read_run(run)
    assert shown.profile is None
    assert any("summary.json" in n and says in n and "left out" in n for n in shown.notes), shown.notes


def test_a_broken_manifest_is_noted(tmp_path: Path) -> None:
    run = make_run(tmp_path, "data", RECORDS)
    manifest = tmp_path / "data_prepared" / "manifest.json"
    for text, says in (("{not json", "does not read as JSON"), ("[1]", "is not a prepared-data manifest")):
        manifest.write_text(text, encoding="utf-8")
        shown = read_run(run)
        assert shown.manifest is None and any(str(manifest) in n and says in n for n in shown.notes), shown.notes
    page, _ = report_page([run], tmp_path / "out")  # the page is still written
    assert "data-0" not in page.tables


def test_what_peak_memory_measured_is_said(tmp_path: Path, legends: dict[str, list[str]]) -> None:
    """A CPU's peak is its process RSS, an accelerator's the allocated memory: the records' `device` says
    which, with or without a config."""
    cpu = make_run(tmp_path, "cpu", [dict(r, device="cpu") if "loss" in r else r for r in RECORDS])
    (cpu / "config.yaml").unlink()
    assert read_run(cpu).peak_memory_kind() == "process peak RSS (cpu)"
    assert plots.peak_memory_label([read_run(cpu)]) == "GiB: process peak RSS (cpu)"
    gpu = read_run(make_run(tmp_path, "gpu", [dict(r, device="cuda") if "loss" in r else r for r in RECORDS],
                            run={"device": "auto"}))
    assert (gpu.peak_memory_kind(), gpu.memory_device) == ("peak allocated (cuda)", "cuda")
    assert plots.peak_memory_label([gpu]) == "GiB: peak allocated, largest rank"
    page, _ = report_page([cpu], tmp_path / "out")
    assert page.table("summary")[0]["peak memory measured as"] == "process peak RSS (cpu)"


MEMORY_CHART = "Memory per device: estimate (stacked) and measured peak"


def test_a_cpu_run_sets_estimate_and_runtime_beside_its_resident_set(tmp_path: Path,
                                                                     legends: dict[str, list[str]]) -> None:
    """A CPU's measured peak is its process's resident set: the chart and the table add the runtime's own
    resident memory (the records' runtime_rss_gb) to the estimate of tensors. A CPU run whose records do
    not say it (older ones) shows no measured bar beside the estimate, and the page says why."""
    cpu = make_run(tmp_path, "cpu", [dict(r, device="cpu", runtime_rss_gb=0.375) if "loss" in r else r
                                     for r in RECORDS])
    run = read_run(cpu)
    assert run.runtime_rss_gb() == 0.375 and plots.comparable_peak(run) == run.max_peak_memory_gb()
    page, path = report_page([cpu], tmp_path / "out")
    memory = page.pairs("memory-0")
    assert memory["runtime (process RSS at start)"] == g(0.375)
    assert memory["estimated peak + runtime"] == g(run.memory.peak / GIB + 0.375)
    assert {"runtime (process RSS at start)", "measured peak"} <= set(legends[MEMORY_CHART])
    assert "which the table and the memory chart add to the estimate" in path.read_text(encoding="utf-8")

    older = make_run(tmp_path, "older", [dict(r, device="cpu") if "loss" in r else r for r in RECORDS])
    run = read_run(older)
    assert run.runtime_rss_gb() is None and plots.comparable_peak(run) is None
    page, path = report_page([older], tmp_path / "out_older")
    assert "runtime (process RSS at start)" not in page.pairs("memory-0")
    assert "measured peak" not in legends[MEMORY_CHART] and "parameters" in legends[MEMORY_CHART]
    assert "leaves the measured peak out" in path.read_text(encoding="utf-8")
    # an accelerator's peak is allocated device memory, set beside the estimate as it is; a runtime_rss_gb
    # in its records (none is written there) is not added
    gpu = read_run(make_run(tmp_path, "gpu", [dict(r, device="cuda", runtime_rss_gb=0.375) if "loss" in r else r
                                              for r in RECORDS], run={"device": "auto"}))
    assert gpu.runtime_rss_gb() is None and plots.comparable_peak(gpu) == gpu.max_peak_memory_gb()


def test_series_constant_for_a_run_are_not_drawn(tmp_path: Path, legends: dict[str, list[str]]) -> None:
    """The loss scale of a bf16 run is 1 throughout: its plot is left out, and the page names the value. Beside
    an fp16 run whose scale moved, the plot is drawn for the fp16 run alone."""
    bf16 = make_run(tmp_path, "bf16", [dict(r, loss_scale=1.0) if "loss" in r else r for r in RECORDS])
    page, path = report_page([bf16], tmp_path / "out")
    assert "plot-loss_scale" not in page.images and "plot-lr" in page.images
    assert "Not drawn, one value for the whole run: loss scale 1 (bf16)." in path.read_text(encoding="utf-8")
    fp16 = make_run(tmp_path, "fp16", RECORDS)
    page, _ = report_page([bf16, fp16], tmp_path / "out_both")
    assert "plot-loss_scale" in page.images
    assert legends["Loss scale"] == ["fp16", "skipped steps"]


def test_nothing_in_a_run_directory_becomes_markup(tmp_path: Path) -> None:
    """Names, config values, manifest counts, profile operators and notes are text: the page holds only the
    report's own tags, and no attribute of its own holds a script."""
    evil = "<img src=x onerror=alert(1)>"
    run = make_run(tmp_path, evil, RECORDS, data={"text_field": "<script>alert(2)</script>"})
    manifest = tmp_path / f"{evil}_prepared" / "manifest.json"
    manifest.write_text(json.dumps({"counts": {"documents": "<b>bold</b>", "tokens": 1}}), encoding="utf-8")
    (run / "profile").mkdir()
    (run / "profile" / "summary.json").write_text(json.dumps({
        "top_operators": [{"name": "</table><script>alert(3)</script>", "self_time_ms": 1.0, "share": 0.5}],
        "shares": {"<i>compute</i>": 1.0}, "trace": "profile/<svg onload=alert(4)>.json",
        "steps": ["<u>2</u>"]}), encoding="utf-8")

    class Tags(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: set[str] = set()
            self.attrs: set[str] = set()

        def handle_starttag(self, tag: str, attrs: list) -> None:
            self.tags.add(tag)
            self.attrs.update(name for name, _ in attrs)

    page, path = report_page([run], tmp_path / "out")
    tags = Tags()
    tags.feed(path.read_text(encoding="utf-8"))
    assert tags.tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "table", "thead",
                         "tbody", "tr", "th", "td", "div", "figure", "img", "figcaption", "details", "summary", "pre"}
    assert not {a for a in tags.attrs if a.startswith("on")}
    assert page.table("summary")[0]["run"] == evil  # shown as text
    assert page.table("profile-0")[0]["operator"] == "</table><script>alert(3)</script>"


def test_padded_instruction_data_says_tokens_seen_count_padding(tmp_path: Path) -> None:
    """step x global batch x seq_length is the token slots, not the real tokens, when samples are padded."""
    run = read_run(make_run(tmp_path, "sft", RECORDS, data={"kind": "instruction", "packing": "pad"}))
    assert run.tokens_per_step == MICRO_BATCH * SEQ
    assert any("padding included (data.packing pad)" in n for n in run.notes), run.notes
    packed = read_run(make_run(tmp_path, "sft_packed", RECORDS, data={"kind": "instruction", "packing": "pack"}))
    assert not any("padding included" in n for n in packed.notes)


def test_an_unknown_device_count_is_not_shown_as_one(tmp_path: Path) -> None:
    """data_parallel -1 and records without tokens_per_s_per_device (an older file): the layout line does not
    claim one device, and the notes say what the memory estimate assumed."""
    records = [{k: v for k, v in r.items() if k != "tokens_per_s_per_device"} for r in RECORDS]
    run = make_run(tmp_path, "elastic", records, parallel={"data_parallel": -1, "zero_stage": 1})
    _, path = report_page([run], tmp_path / "out")
    text = path.read_text(encoding="utf-8")
    assert "an unknown number of device(s): data ? (data_parallel -1)" in text and "1 device(s)" not in text
    assert "the memory estimate is for data parallel 1" in text


def test_a_run_with_only_eval_records(tmp_path: Path) -> None:
    run = make_run(tmp_path, "evals", [r for r in RECORDS if "eval_loss" in r])
    page, path = report_page([run], tmp_path / "out")
    (row,) = page.table("summary")
    assert (row["final loss"], row["final eval loss"]) == ("\u2013", g(4.3))
    assert "holds no training record yet" in path.read_text(encoding="utf-8")


def test_a_preference_run_shows_its_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preference tuning: reward accuracy and margin against the step, train and held out, the records' values."""
    lines: dict[str, list[list[float]]] = {}
    finish = plots._finish

    def spy(fig, ax, has_data):
        lines[ax.get_title()] = [list(line.get_ydata()) for line in ax.get_lines()]
        finish(fig, ax, has_data)

    monkeypatch.setattr(plots, "_finish", spy)
    records = [record(10, 0.69, reward_accuracy=0.5, reward_margin=0.01),
               record(20, 0.6, reward_accuracy=0.75, reward_margin=0.3),
               {"step": 20, "eval_loss": 0.65, "eval_reward_accuracy": 0.625, "eval_reward_margin": 0.2}]
    page, _ = report_page([make_run(tmp_path, "dpo", records)], tmp_path / "out")
    assert {"plot-reward_accuracy", "plot-reward_margin"} <= set(page.images)
    assert lines["Reward accuracy (pairs ranked right) (train; eval dashed)"] == [[0.5, 0.75], [0.625]]
    assert lines["Reward margin (chosen minus rejected) (train; eval dashed)"] == [[0.01, 0.3], [0.2]]
    plain, _ = report_page([make_run(tmp_path, "sft", RECORDS)], tmp_path / "out_sft")
    assert "plot-reward_accuracy" not in plain.images
