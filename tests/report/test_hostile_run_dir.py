"""Hostile run directories as `shardwise report` (and the resume, tracker, hardware and plan readers) see
them: metrics.jsonl that is endless, a FIFO, huge or full of odd values; config.yaml alias bombs and
patterns that backtrack; side files that are no plain files; hardware names that are markup or mathtext.
Each case runs under a memory and a time cap (tests/capped.py): it ends as a report with a note, or exit 2
naming the file, never as a traceback, a hang or a blow-up."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from shardwise.errors import ConfigError
from shardwise.hardware import keep_best, load_hardware_file
from shardwise.report.runs import read_run
from shardwise.train.metrics import keep_records_through
from shardwise.train.trackers import read_ids
from tests.capped import assert_each_refused, assert_refused, cli_capped, run_capped
from tests.report.test_report import RECORDS, make_run, record
from tests.test_cli import logging_restored

CAP = {"memory_mib": 1024, "seconds": 30}


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


def _replace(path: Path, target: str | None) -> None:
    """`path` becomes a FIFO (target None) or a symbolic link to `target`."""
    path.unlink(missing_ok=True)
    if target is None:
        os.mkfifo(path)
    else:
        path.symlink_to(target)


def _shown_each(runs: list[str]) -> list[dict]:
    return [_shown(run) for run in runs]


def _shown(run: str) -> dict:
    """read_run's view of a run directory (in a capped worker): its steps, restarts and notes."""
    shown = read_run(run)
    return {"steps": shown.steps(), "evals": [r["step"] for r in shown.evals], "restarts": shown.restarts,
            "notes": shown.notes, "config": shown.config is not None, "profile": shown.profile is not None,
            "manifest": shown.manifest is not None}


# --- metrics.jsonl --------------------------------------------------------------------------------------------


def test_metrics_that_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    cases = []
    for name, target in (("fifo", None), ("zero", "/dev/zero"), ("urandom", "/dev/urandom")):
        run = make_run(tmp_path, name, RECORDS)
        _replace(run / "metrics.jsonl", target)
        cases.append((["report", run, "--out", tmp_path / "out"], (run / "metrics.jsonl", "not a regular file")))
    assert_each_refused(cases)


def test_odd_lines_and_values_are_left_out_with_a_note(tmp_path: Path) -> None:
    good = [record(10, 5.0), record(20, 4.5), record(30, 4.0)]
    odd = [b"\xff\xfe not utf-8", b'{"step": 15, "loss": NaN}', b'{"step": "16", "loss": 1.0}',
           b'{"step": -5, "loss": 1.0}', b'{"step": 17.0, "loss": 1.0}', b'{"step": true, "loss": 1.0}',
           b'{"step": 1' + b"0" * 1_000_000 + b', "loss": 1.0}', b'{"step": 18, "loss": 1' + b"0" * 100_000 + b"}",
           b'{"step": ' + b"9" * 30 + b', "loss": 1.0}', b'{"step": 19, "loss": 1e999, "lr": "fast"}',
           b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 200 + b"1" + b"}" * 200, b"[1, 2]", b"null"]
    run = make_run(tmp_path, "run", [])
    lines = [json.dumps(r).encode() for r in good[:2]] + odd + [json.dumps(good[2]).encode()]
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    shown = run_capped(_shown, str(run), **CAP)
    # Kept: the good records, step 15 (a NaN loss is shown as not finite) and step 19 (an infinite loss).
    assert shown["steps"] == [10, 20, 15, 19, 30], shown  # in file order
    assert any("12 line(s)" in n for n in shown["notes"]), shown["notes"]
    assert any("not finite" in n and "15" in n for n in shown["notes"]), shown["notes"]
    code, text = cli_capped(["report", run, "--out", tmp_path / "out"], **CAP)
    assert code == 0 and "Traceback" not in text, text[-3000:]


def test_a_huge_metrics_file_is_read_from_its_tail(tmp_path: Path) -> None:
    """A sparse 2 GiB file of zeros with records after it: the report reads its last 64 MiB, and says so."""
    run = make_run(tmp_path, "run", [])
    with open(run / "metrics.jsonl", "wb") as f:
        f.truncate(2 << 30)
        f.seek(2 << 30)
        f.write(b"\n" + b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS))
    shown = run_capped(_shown, str(run), **CAP)
    assert shown["steps"] == [10, 20, 30, 40] and shown["evals"] == [20, 40], shown
    assert any("bytes are left out" in n for n in shown["notes"]), shown["notes"]


def _steps_with_every_gap_different(run: str, count: int) -> dict:
    lines = [json.dumps({"step": i * (i + 1) // 2, "loss": 1.0}) for i in range(1, count + 1)]
    (Path(run) / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    shown = _shown(run)
    return {"steps": len(shown["steps"]), "restarts": len(shown["restarts"])}


def test_many_distinct_step_gaps_take_linear_time(tmp_path: Path) -> None:
    """The log interval was found by counting each gap in the list of gaps: quadratic, minutes for these."""
    run = make_run(tmp_path, "run", [])
    shown = run_capped(_steps_with_every_gap_different, str(run), 50_000, memory_mib=1024, seconds=15)
    assert shown["steps"] == 50_000


def test_resume_refuses_metrics_that_is_no_regular_file(tmp_path: Path) -> None:
    for target in (None, "/dev/zero"):
        path = tmp_path / f"metrics_{target is None}.jsonl"
        _replace(path, target)
        said = run_capped(_keep, str(path), **CAP)
        assert said.startswith(f"ConfigError: {path}: is not a regular file"), said


def _keep(path: str) -> str:
    try:
        keep_records_through(Path(path), 10)
    except ConfigError as e:
        return f"ConfigError: {e}"
    return "kept"


# --- config.yaml and the side files ---------------------------------------------------------------------------


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(9)) + "model: *j\n"


CONFIG_CASES = [("alias", "alias"), ("fifo", "not a regular file"), ("zero", "not a regular file"),
                ("digits", "digits"), ("huge", "bytes"), ("binary", "UTF-8"), ("list", "not a mapping")]


def test_a_config_that_does_not_load_is_a_note(tmp_path: Path) -> None:
    runs = []
    for case, _ in CONFIG_CASES:
        run = make_run(tmp_path, case, RECORDS)
        config = run / "config.yaml"
        if case == "alias":
            config.write_text(ALIAS_BOMB)
        elif case in ("fifo", "zero"):
            _replace(config, None if case == "fifo" else "/dev/zero")
        elif case == "digits":
            config.write_text("train: {max_steps: 1" + "0" * 100 + "}\n")
        elif case == "huge":
            with open(config, "r+b") as f:
                f.truncate(2 << 30)
        elif case == "binary":
            config.write_bytes(b"train: \xff\xfe\n")
        else:
            config.write_text("- 1\n- 2\n")
        runs.append(str(run))
    for (case, says), shown in zip(CONFIG_CASES, run_capped(_shown_each, runs, **CAP)):
        assert not shown["config"] and shown["steps"] == [10, 20, 30, 40], (case, shown)
        assert any("config.yaml does not load" in n and says in n for n in shown["notes"]), (case, shown["notes"])


def test_a_lora_target_that_backtracks_is_a_note_not_a_hang(tmp_path: Path) -> None:
    """lora.target_modules is a regex matched against every module name: `re` would take minutes here."""
    run = make_run(tmp_path, "run", RECORDS, lora={"r": 2, "alpha": 4, "target_modules": r"(.|.)*\d"})
    shown = run_capped(_shown, str(run), **CAP)
    assert any("fine-tuning" in n and "took more than" in n for n in shown["notes"]), shown["notes"]
    assert shown["steps"] == [10, 20, 30, 40]


def _write(path: Path, content: str | None) -> None:
    """A FIFO (None), a link to a device ('/dev/...'), or a file holding `content`."""
    if content is None or content.startswith("/dev/"):
        _replace(path, content)
    else:
        path.write_text(content)


PROFILE_CASES = [
    (None, "not a regular file"), ("/dev/zero", "not a regular file"), ("[" * 50_000 + "]" * 50_000, "nests"),
    ('{"shares": {"compute": NaN}}', "NaN"), ('{"shares": {"compute": 1' + "0" * 60 + "}}", "digits"),
    ('{"shares": {"compute": "most"}}', "not a mapping of numbers"),
]


def test_a_bad_profile_summary_is_a_note(tmp_path: Path) -> None:
    runs = []
    for i, (content, _) in enumerate(PROFILE_CASES):
        run = make_run(tmp_path, f"run{i}", RECORDS)
        (run / "profile").mkdir()
        _write(run / "profile" / "summary.json", content)
        runs.append(str(run))
    for (_, says), shown in zip(PROFILE_CASES, run_capped(_shown_each, runs, **CAP)):
        assert not shown["profile"] and any("summary.json" in n and says in n for n in shown["notes"]), shown["notes"]


def test_a_bad_manifest_is_a_note(tmp_path: Path) -> None:
    runs = []
    for i, content in enumerate([None, "/dev/urandom", '{"counts": {"documents": [1, 2]}}', "{" * 1000]):
        run = make_run(tmp_path, f"run{i}", RECORDS)
        _write(tmp_path / f"run{i}_prepared" / "manifest.json", content)
        runs.append(str(run))
    for shown in run_capped(_shown_each, runs, **CAP):
        assert not shown["manifest"] and any(n.startswith("data summary") for n in shown["notes"]), shown["notes"]


def _ids_each(run_dirs: list[str]) -> list[dict]:
    return [read_ids(Path(d)) for d in run_dirs]


TRACKER_CASES = [
    (None, {}), ("/dev/zero", {}), ("[1]", {}), ('{"wandb": "ab12cd34", "mlflow": ["x"], "other": "y"}',
                                                   {"wandb": "ab12cd34"}),
    ('{"wandb": "' + "a" * 1000 + '"}', {}), ('{"wandb": "../../x"}', {}), ("{" * 5000, {}),
]


def test_tracker_ids_from_a_damaged_file_start_new_runs(tmp_path: Path) -> None:
    dirs = []
    for i, (content, _) in enumerate(TRACKER_CASES):
        (tmp_path / str(i)).mkdir()
        _write(tmp_path / str(i) / "trackers.json", content)
        dirs.append(str(tmp_path / str(i)))
    assert run_capped(_ids_each, dirs, **CAP) == [expected for _, expected in TRACKER_CASES]


def _best_each(paths: list[str]) -> list[float]:
    return [keep_best(Path(path), "cpu|1|fp32", 5.0) for path in paths]


def test_a_damaged_cpu_peak_cache_is_measured_again(tmp_path: Path) -> None:
    paths = []
    for i, content in enumerate([None, "/dev/zero", '{"cpu|1|fp32": "fast"}', '{"cpu|1|fp32": 1e999}',
                                 '{"cpu|1|fp32": NaN}', "[" * 5000]):
        _write(tmp_path / f"cpu_peak{i}.json", content)
        paths.append(str(tmp_path / f"cpu_peak{i}.json"))
    assert run_capped(_best_each, paths, **CAP) == [5.0] * len(paths)


# --- hardware files and plan --report ---------------------------------------------------------------------------


def _plan(tmp_path: Path, entries: dict | str, name: str, report: bool = True) -> list[str]:
    hw = tmp_path / "hw.yaml"
    hw.write_text(entries if isinstance(entries, str) else yaml.safe_dump(entries))
    argv = ["plan", "--model", "tiny_llama", "--devices", "1", "--hardware-file", hw, "--hardware", name]
    return argv + (["--report", tmp_path / "out"] if report else [])


def test_odd_hardware_names_are_text_in_the_report(tmp_path: Path) -> None:
    """Markup is escaped in index.html; `$` is no mathtext on the charts (a bad formula failed the drawing);
    slashes name no file (the files have fixed names); a long name is listed whole."""
    name = r"<b>gpu</b> & <script>x</script> $\frac{a}{$ ünï/../../x $$"
    code, text = cli_capped(_plan(tmp_path, {name: {"like": "H100"}, "g" * 200: {"like": "A100-80GB"}}, name), **CAP)
    assert code == 0 and "Traceback" not in text, text[-3000:]
    page = (tmp_path / "out" / "index.html").read_text()
    assert "<script>x" not in page and "<b>gpu" not in page and "&lt;b&gt;gpu" in page
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.html", "memory.png", "plan.json",
                                                                    "step_time.png"]
    code, text = cli_capped(["plan", "--list-hardware", "--hardware-file", tmp_path / "hw.yaml"], **CAP)
    assert code == 0 and "g" * 200 in text and name in text, text[-3000:]


HARDWARE_CASES = [
    ({"gpu\nwith a line break": {"like": "H100"}}, ["name of 1 to 200 printable"]),
    ({"g" * 201: {"like": "H100"}}, ["name of 1 to 200 printable"]),
    ("1: {like: H100}\n", ["name of 1 to 200 printable"]),
    ({"gpu": {"like": "H100", "memory_gib": "80"}}, ["gpu", "memory_gib"]),
    ({"gpu": {"like": "H100", "memory_gib": -1}}, ["gpu", "memory_gib"]),
    ({"gpu": {"like": "H100", "compute_efficiency": 2}}, ["gpu", "compute_efficiency"]),
    ({"gpu": {"like": "H100", "devices_per_node": 10**20}}, ["gpu", "devices_per_node"]),
    ({"gpu": {"like": "H100", "kind": "tpu"}}, ["gpu", "kind"]),
    ({"gpu": {"like": ["H100"]}}, ["gpu", "like"]),
    ({"gpu": {"memory_gib": 80, "tflops_16": 1e999, "intra_bandwidth_gbps": 100}}, ["gpu", "tflops_16"]),
    ({"gpu": {"like": "H100", "source": ["x"]}}, ["gpu", "source"]),
    (ALIAS_BOMB, ["alias"]),
    ("[1, 2]", ["not a mapping"]),
]


def _hardware_each(paths: list[str]) -> list[str]:
    said = []
    for path in paths:
        try:
            load_hardware_file(path)
        except ConfigError as e:
            said.append(f"ConfigError: {e}")
        else:
            said.append("loaded")
    return said


def test_a_bad_hardware_file_names_the_entry_and_field(tmp_path: Path) -> None:
    paths = []
    for i, (entries, _) in enumerate(HARDWARE_CASES):
        path = tmp_path / f"hw{i}.yaml"
        path.write_text(entries if isinstance(entries, str) else yaml.safe_dump(entries))
        paths.append(str(path))
    for path, (_, names), said in zip(paths, HARDWARE_CASES, run_capped(_hardware_each, paths, **CAP)):
        assert said.startswith(f"ConfigError: {path}"), said
        assert all(name in said for name in names), (names, said)
    # And through the command line: exit 2 naming the file and the field.
    assert_refused(_plan(tmp_path, {"gpu": {"like": "H100", "memory_gib": "80"}}, "gpu", report=False), "hw.yaml",
                   "memory_gib", **CAP)


def test_a_device_count_from_absurd_throughputs_is_not_believed(tmp_path: Path) -> None:
    """data_parallel -1: the device count is tokens/s over tokens/s per device; 1e308 / 1e-308 overflowed
    round() (a traceback) and 1e12 devices is no run's."""
    runs = []
    for i, (total, per) in enumerate(((1e308, 1e-308), (1e12, 1.0), (5.0, 0.0))):
        records = [record(10, 5.0, tokens_per_s=total, tokens_per_s_per_device=per),
                   {k: v for k, v in record(20, 4.0).items() if not k.startswith("tokens_per_s")}]
        runs.append(str(make_run(tmp_path, f"elastic{i}", records, parallel={"data_parallel": -1})))
    for shown in run_capped(_shown_each, runs, **CAP):
        assert shown["steps"] == [10, 20] and shown["config"], shown
        assert any("do not show the device count" in n for n in shown["notes"]), shown["notes"]


def test_a_config_claiming_ten_million_layers_builds_no_model(tmp_path: Path) -> None:
    """The memory estimate and the fine-tuning share build the model on the meta device: 1.5 s per 1,000
    layers. A run's config.yaml claiming 10 million is beyond the model bounds (models.config.MAX_LAYERS):
    noted as a config that does not load, not built for hours."""
    run = make_run(tmp_path, "deep", RECORDS, lora={"r": 2, "alpha": 4})
    config = run / "config.yaml"
    config.write_text(re.sub(r"num_layers: \d+", "num_layers: 10000000", config.read_text()))
    shown = run_capped(_shown, str(run), **CAP)
    assert any("does not load" in n and "num_layers = 10000000" in n for n in shown["notes"]), shown["notes"]
