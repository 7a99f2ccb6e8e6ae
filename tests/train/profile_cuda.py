"""Issue 16 items 4 and 5 on a CUDA GPU: train.profile's CUDA path and the end-of-run summary there.

A tiny bf16 run on the GPU profiles steps 3-4 and checks:

- RUN_DIR/profile/trace_rank0.json is a Chrome trace holding kernels (cat "kernel") as well as CPU operators;
- RUN_DIR/profile/memory_snapshot.pickle exists and holds the allocator's segments and traces (torch's
  memory_viz format, read back with pickle: a file this run wrote);
- summary.json: steps [3, 4], top operators by device time (self_time_ms > 0), shares summing to 1 with a
  compute share above 0 (kernels ran);
- the run summary names the GPU's memory and, the peak of a tiny model being far below an H200's, suggests a
  larger micro-batch;
- `shardwise report` of the run labels the measured peak as the CUDA allocator's and shows the profile.

    python3 tests/train/profile_cuda.py [OUT_DIR]   # one JSON line; exit 1 on a failed check
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from pathlib import Path

import torch

from shardwise.data.packing import PackedDataset
from shardwise.report import write_report
from shardwise.resolve import resolve_config
from shardwise.train.profiling import MEMORY_SNAPSHOT_FILE, PROFILE_DIR, SUMMARY_FILE, trace_file
from shardwise.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_tokens  # noqa: E402 - the trainer tests' learnable token stream

SEQ = 128


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="profile_cuda_"))
    cfg = resolve_config({"model": {"preset": "tiny_llama"}, "data": {"seq_length": SEQ},
                          "optimize": {"mixed_precision": "bf16"}, "run": {"device": "cuda", "compile": False},
                          "train": {"output_dir": str(root / "run"), "max_steps": 5, "micro_batch_size": 4,
                                    "log_steps": 1, "progress_bar": False, "tensorboard": False,
                                    "profile": {"start_step": 3, "steps": 2}}})
    result = Trainer(cfg, train_dataset=PackedDataset(make_tokens(), SEQ)).train(overwrite=True)
    out = root / "run" / PROFILE_DIR
    trace = json.loads((out / trace_file(0)).read_text())
    cats = {e.get("cat") for e in trace["traceEvents"]}
    with open(out / MEMORY_SNAPSHOT_FILE, "rb") as f:
        snapshot = pickle.load(f)
    summary = json.loads((out / SUMMARY_FILE).read_text())
    page = write_report([root / "run"], root / "report").read_text()
    checks = {
        "trace_has_kernels": "kernel" in cats and "cpu_op" in cats,
        "snapshot_has_segments": bool(snapshot.get("segments")) and "device_traces" in snapshot,
        "summary_steps": summary["steps"] == [3, 4],
        "top_operators_device_time": bool(summary["top_operators"]) and summary["top_operators"][0]["self_time_ms"] > 0,
        "shares_sum_to_1": abs(sum(summary["shares"].values()) - 1) < 1e-6,
        "compute_share": summary["shares"]["compute"] > 0,
        "summary_names_gpu_memory": any("GiB of" in line for line in result.summary),
        "memory_suggestion": any("train.micro_batch_size" in line for line in result.summary),
        "report_names_cuda_peak": "peak allocated (cuda)" in page,
        "report_shows_profile": "<h3>Profile</h3>" in page,
    }
    print(json.dumps({"checks": checks, "shares": summary["shares"],
                      "top": [o["name"] for o in summary["top_operators"][:5]], "summary": result.summary}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
