"""`plan --report` / `estimate --report`: the PNGs decode, index.html embeds them, and the numbers shown are
the planner's and the estimator's own."""

from __future__ import annotations

import base64
import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardwise.cli import main
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.hardware import get_hardware
from shardwise.memory.estimate import estimate_all_ranks
from shardwise.plan import PlanRequest, plan, workload_config
from shardwise.plan.charts import MEMORY_PARTS, plan_numbers, write_estimate_report, write_plan_report
from shardwise.plan.estimate_command import config_from_args
from shardwise.plan.profile import Run
from shardwise.step_time import StepTime
from shardwise.units import GIB

pytest.importorskip("matplotlib")
import matplotlib.pyplot as plt  # noqa: E402  (after the skip: an optional extra)


@functools.lru_cache(maxsize=1)
def small_plan() -> object:
    """Three layouts of 7B on 4 x A100-40GB (the charts only read the result)."""
    hw = get_hardware("A100-40GB")
    cfg = workload_config(model="llama_7b", seq_length=2048, global_batch=16, devices=4, hardware=hw)
    return plan(PlanRequest(cfg=cfg, devices=4, hardware=hw, top=3, pins={"pp": [1, 2]}))


def decodes(path: Path) -> bool:
    image = plt.imread(path)
    return image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def embedded(index: Path, png: Path) -> bool:
    return base64.b64encode(png.read_bytes()).decode("ascii") in index.read_text()


def test_plan_report_shows_the_planners_numbers(tmp_path: Path) -> None:
    result = small_plan()
    index = write_plan_report(result, tmp_path)
    for name in ("step_time.png", "memory.png"):
        assert decodes(tmp_path / name) and embedded(index, tmp_path / name)
    numbers = json.loads((tmp_path / "plan.json").read_text())
    assert len(numbers["layouts"]) == len(result.ranked) == 3
    page = index.read_text()
    for shown, c in zip(numbers["layouts"], result.ranked):
        assert shown["step"]["total"] == c.step.total
        assert {p: shown["step"][p] for p in StepTime.PARTS} == {p: getattr(c.step, p) for p in StepTime.PARTS}
        assert sum(shown["step"][p] for p in StepTime.PARTS) == pytest.approx(c.step.total, rel=1e-12)
        assert {k: shown["memory"][k] for k, _ in MEMORY_PARTS} == {k: getattr(c.memory, k) for k, _ in MEMORY_PARTS}
        assert shown["memory"]["peak"] == c.memory.peak and shown["usable_bytes"] == c.usable
        assert f"{c.step.total:.6g}" in page and c.layout.describe() in page
    assert numbers["capacity_bytes"] == 40 * GIB


def test_profile_predicted_against_measured(tmp_path: Path) -> None:
    result = small_plan()
    runs = [Run(cfg=c.cfg, devices=4, step_times=[1.0 + i, 1.2 + i, 1.1 + i], label=c.layout.describe(),
                estimate_peak=c.peak, memory_peaks=[c.peak // 2]) for i, c in enumerate(result.ranked)]
    profile = SimpleNamespace(runs=runs, predicted=[c.step for c in result.ranked],
                              calibration=SimpleNamespace(after=[0.9, 2.05, 3.2]))
    index = write_plan_report(result, tmp_path, profile)
    assert decodes(tmp_path / "profile.png") and embedded(index, tmp_path / "profile.png")
    rows = json.loads((tmp_path / "plan.json").read_text())["profile"]
    assert [r["measured_s"] for r in rows] == [1.1, 2.1, 3.1]  # the medians
    assert [r["predicted_s"] for r in rows] == [c.step.total for c in result.ranked]
    assert [r["calibrated_s"] for r in rows] == [0.9, 2.05, 3.2]
    # memory too: the estimate's peak against the measured one, per profiled layout, in the page's table
    page = index.read_text()
    for c in result.ranked:
        assert f"{c.peak / GIB:.4g}" in page and f"{c.peak // 2 / GIB:.4g}" in page


def test_the_charts_leave_the_matplotlib_backend_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library call must not switch the process's backend (a notebook's inline one, say)."""
    import matplotlib

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("matplotlib.use called")

    monkeypatch.setattr(matplotlib, "use", refuse)
    assert write_plan_report(small_plan(), tmp_path).is_file()


def test_a_cpus_capacity_is_its_share_of_the_nodes_ram() -> None:
    """The processes of a CPU node share its RAM: the capacity line per device is RAM / processes (as the
    planner's usable memory), not the whole node's RAM."""
    cpu = get_hardware("cpu")
    request = SimpleNamespace(hardware=cpu, devices=4, nodes=None)
    shown = plan_numbers(SimpleNamespace(request=request, ranked=[]))
    assert shown["capacity_bytes"] == int(cpu.memory_gib * GIB / 4)
    gpu = SimpleNamespace(request=SimpleNamespace(hardware=get_hardware("A100-40GB"), devices=4, nodes=None),
                          ranked=[])
    assert plan_numbers(gpu)["capacity_bytes"] == 40 * GIB


def test_estimate_report_per_pipeline_rank(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["estimate", "--model", "llama_7b", "--pp", "2", "--dp", "2", "--zero", "1", "--memory-gib", "80",
            "--report", str(tmp_path)]
    assert main(argv) == 0
    assert "report:" in capsys.readouterr().out
    args = SimpleNamespace(config=None, model="llama_7b", set=[], seq_length=2048, micro_batch=1, dp=2, tp=1, pp=2,
                           cp=1, ep=1, zero=1, precision="bf16", level=None, recompute="none", offload=False,
                           offload_params=False, offload_activations=False, lora_r=None, freeze_layers=0)
    expected = estimate_all_ranks(config_from_args(args), 4, "cuda")
    shown = json.loads((tmp_path / "estimate.json").read_text())
    assert shown["capacity_bytes"] == 80 * GIB
    assert [r["peak"] for r in shown["ranks"]] == [e.peak for e in expected]
    assert [r["activations"] for r in shown["ranks"]] == [e.activations for e in expected]
    assert decodes(tmp_path / "memory.png") and embedded(tmp_path / "index.html", tmp_path / "memory.png")
    page = (tmp_path / "index.html").read_text()
    assert "pipeline rank 0" in page and "pipeline rank 1" in page  # not a global rank: one per pipeline stage


def test_the_report_refuses_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        write_estimate_report([], target)


def test_without_matplotlib_the_message_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` raises ImportError
    with pytest.raises(ShardwiseError, match=r"pip install 'shardwise\[report\]'"):
        write_plan_report(small_plan(), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
