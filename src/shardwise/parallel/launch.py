"""The one place where a device kind becomes a torch device and a communication backend."""

from __future__ import annotations

import importlib
import logging

import torch

from ..errors import DeviceError

log = logging.getLogger(__name__)

_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def npu_available() -> bool:
    """True when torch_npu is installed and sees an Ascend device (imported only when asked)."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present, else CPU (torch_npu is imported only for run.device: npu)."""
    if kind == "auto":
        if torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "run.device is cuda but no CUDA device is visible (torch.cuda.is_available() is False); "
                "set run.device: cpu (or device_target: CPU), or run where a GPU and a CUDA build of torch are"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "npu":
        if not npu_available():
            raise DeviceError(
                "run.device is npu (device_target: Ascend) but torch_npu is not installed or sees no "
                "Ascend device; install torch_npu on an Ascend machine, or select another device with "
                "run.device: cpu | cuda | auto (seed files: device_target: CPU or GPU), e.g. "
                "--set run.device=cpu"
            )
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective backend for a device: NCCL, HCCL or gloo."""
    return _BACKENDS[device.type]
