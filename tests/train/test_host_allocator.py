"""run.keep_host_memory: a CPU run's malloc keeps freed memory, so the tensors a step makes again and again stop
page-faulting their memory in (counted by the kernel, in a fresh process: the setting is process-wide)."""

import subprocess
import sys

import pytest

from shardwise.train import host_allocator, trainer
from shardwise.train.host_allocator import keeps_host_memory
from shardwise.train.trainer import Trainer

from .conftest import tiny_config, with_changes

# In a fresh process: the minor page faults of allocating and freeing five 64 MiB tensors (each written
# whole), with malloc as it is and after keep_freed_host_memory (a first round grows the heap once).
CHURN = """
import resource, sys, torch
from shardwise.train.host_allocator import keep_freed_host_memory
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def churn():
    for _ in range(5):
        torch.ones(16 * 2**20)
churn()
before = faults(); churn(); system = faults() - before
applied = keep_freed_host_memory(); churn()
before = faults(); churn(); kept = faults() - before
print(system, kept, applied)
"""
PAGE = 4096
CHURNED_BYTES = 5 * 64 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._glibc() is None, reason="a glibc setting")
def test_kept_memory_is_reused_without_page_faults() -> None:
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=120, check=True)
    system, kept, applied = out.stdout.split()
    assert applied == "True"
    # glibc maps each 64 MiB block afresh and unmaps it at free: every page faults again, every time ...
    assert int(system) >= CHURNED_BYTES // PAGE // 2, out.stdout
    # ... and with freed memory kept, the same blocks come back from the heap, already mapped.
    assert int(kept) < 100, out.stdout


def test_auto_means_a_cpu_run() -> None:
    assert keeps_host_memory("auto", "cpu")
    assert not keeps_host_memory("auto", "cuda") and not keeps_host_memory("auto", "npu")
    assert not keeps_host_memory(False, "cpu")
    assert keeps_host_memory(True, "cuda")


def test_without_glibc_nothing_changes(monkeypatch) -> None:
    monkeypatch.setattr(host_allocator, "_glibc", lambda: None)
    assert host_allocator.keep_freed_host_memory() is False


@pytest.mark.parametrize("setting, applied", [("auto", True), (False, False)])
def test_the_trainer_applies_the_setting_on_a_cpu_run(tmp_path, dataset, monkeypatch, setting, applied) -> None:
    calls = []
    monkeypatch.setattr(trainer, "keep_freed_host_memory", lambda: calls.append(1) or True)
    cfg = with_changes(tiny_config(tmp_path, max_steps=1), run={"keep_host_memory": setting})
    Trainer(cfg, train_dataset=dataset).train(overwrite=True)
    assert calls == ([1] if applied else [])
