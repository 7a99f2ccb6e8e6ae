"""The torch releases shardwise runs on, checked when shardwise is imported.

The test suite passes on torch 2.13 (the pinned CPU build) and on 2.11 (the CUDA build of the GPU machine
`bench/gpu_checks.sh` is written for). On 2.11 it needed workarounds for what that release does
differently: a DCP stager that stages once, a 16-bit `normal_` that draws other numbers, foreach ops that
drop in-place changes to Partial DTensors, and pipeline stages that take every input for a tensor. One of
those gave wrong numbers without an error (gradients left unclipped). An older release is therefore
refused here, before anything runs; `SHARDWISE_UNTESTED_TORCH=1` lets it through with a warning.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.torch_version import TorchVersion

OLDEST_TESTED = "2.11"
TESTED = ("2.11", "2.13")
OVERRIDE = "SHARDWISE_UNTESTED_TORCH"


def check_torch(version: str = torch.__version__) -> None:
    """Raise ImportError for a torch older than OLDEST_TESTED, naming the fix; warn instead when OVERRIDE
    is set."""
    if TorchVersion(version) >= OLDEST_TESTED:
        return
    problem = (f"shardwise needs torch >= {OLDEST_TESTED} (its tests pass on {' and '.join(TESTED)}), but this "
               f"environment has torch {version}")
    if os.environ.get(OVERRIDE) == "1":
        warnings.warn(f"{problem}; going on because {OVERRIDE}=1: results on this release are not checked",
                      stacklevel=2)
        return
    raise ImportError(f"{problem}. Install a newer build (pip install 'torch>={OLDEST_TESTED}', or your "
                      f"accelerator vendor's build of it), or set {OVERRIDE}=1 to try this one anyway, with "
                      "unchecked results")


check_torch()
