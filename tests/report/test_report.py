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
from shardwise.memory.estimate import estimate_memory
from shardwise.models import get_preset
from shardwise.models.config import ModelConfig
from shardwise.models.flops import count_parameters
from shardwise.report import write_report
from shardwise.report.runs import find_restarts
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
    r = {"step": step, "loss": loss, "lr": 1e-3 * step / 40, "grad_norm": 1.0 + step / 100, "loss_scale": 65536.0,
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
    assert row["mean tokens/s"] == g(sum(r["tokens_per_s"] for r in train) / len(train))
    assert row["final MFU"] == g(train[-1]["mfu"])
    assert row["skipped steps"] == "2"
    assert row["resumed after step"] == "none"
    cfg = load_config(run / "config.yaml")
    estimate = estimate_memory(cfg, 1, "cpu")
    memory = page.pairs("memory-0")
    assert memory["parameters"] == g(estimate.params / GIB)
    assert memory["activations"] == g(estimate.activations / GIB)
    assert memory[f"estimated peak ({estimate.peak_phase})"] == g(estimate.peak / GIB)
    assert memory["measured peak (max peak_memory_gb)"] == row["max peak memory (GiB)"]
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
    assert diff["at step"] == "30"
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
    assert set(page.images) == {f"plot-{p}" for p in STEP_PLOTS | {"memory"}}
