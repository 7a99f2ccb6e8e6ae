"""Random generator states of one rank, saved with every checkpoint and restored on resume.

What draws random numbers during training: dropout (the global CPU generator, or the device's on an
accelerator), LoRA dropout, and under tensor parallelism with sequence parallelism the per-rank
stream that gives each rank's sequence shard its own dropout mask (`parallel.tensor.rank_rng`).
Data order does not: the loader's permutations are seeded by (seed, epoch).

A rank saves the CPU generator, Python's `random`, *its own* device's generator (not every visible
device's: a job saved with eight GPUs visible per process must resume where each process sees one)
and its tensor-parallel streams, as JSON. Restoring is exact when the layout is the one saved; on
another layout (another number of ranks, or the same number arranged otherwise) a rank's saved
state belongs to a rank that no longer exists, so every rank is re-seeded from (train.seed, step)
instead - consistently, so that ranks sharing a tensor-parallel group still agree - and the run says
so: weights, optimizer state and data order resume exactly, dropout masks start a new sequence.
"""

from __future__ import annotations

import base64
import hashlib
import random
from typing import Any

import torch

from ..errors import CheckpointError

_FORMAT = 2


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8).clone()


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


def _device_module(device: torch.device) -> Any:
    return None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)


def capture(device: torch.device, streams: dict[str, torch.Tensor] | None = None) -> dict:
    """This rank's generator states as a JSON-ready dict: CPU, Python, this rank's `device` (not the
    others the process may see) and named extra streams (tensor parallel)."""
    state: dict[str, Any] = {"format": _FORMAT, "cpu": _b64(torch.get_rng_state()),
                             "python": _jsonable(random.getstate()),
                             "streams": {name: _b64(s) for name, s in (streams or {}).items()}}
    module = _device_module(device)
    if module is not None:
        state["device"] = {"type": device.type, "state": _b64(module.get_rng_state(device))}
    return state


def restore(state: dict, device: torch.device, streams: dict[str, Any] | None = None) -> list[str]:
    """Set this rank's generators from `capture`'s dict (or the format before it); `streams` maps the
    names of extra streams to objects with `set_state(tensor)`. Returns what could not be restored."""
    try:
        return _restore(state, device, streams or {})
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the saved random state is malformed ({type(e).__name__}: {e}); "
                              "the checkpoint was changed or damaged") from e


def _restore(state: dict, device: torch.device, streams: dict[str, Any]) -> list[str]:
    missing: list[str] = []
    torch.set_rng_state(_tensor(state["cpu"] if "cpu" in state else state["torch"]))
    random.setstate(_tupled(state["python"]))
    module = _device_module(device)
    saved = state.get("device")
    if "cuda" in state and "format" not in state:  # before format 2: every visible GPU's state
        saved = _old_cuda_state(state["cuda"], device)
    if module is not None:
        if saved and saved["type"] == device.type:
            module.set_rng_state(_tensor(saved["state"]), device)
        else:
            missing.append(f"the {device.type} generator")
    for name, stream in streams.items():
        if name in state.get("streams", {}):
            stream.set_state(_tensor(state["streams"][name]))
        else:
            missing.append(f"stream {name}")
    return missing


def _old_cuda_state(states: list[str], device: torch.device) -> dict | None:
    """The pre-format-2 list of every visible GPU's state: usable only where the same GPUs are visible."""
    if device.type != "cuda" or len(states) != torch.cuda.device_count():
        return None
    return {"type": "cuda", "state": states[device.index or 0]}


def derived_seed(seed: int, step: int, salt: str = "") -> int:
    """A seed that depends only on (seed, step, salt): the same on every rank that passes the same."""
    digest = hashlib.sha256(f"{seed}|{step}|{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def reseed(seed: int, step: int, device: torch.device, streams: dict[str, Any] | None = None) -> None:
    """Fresh generators for a resume on another layout: the shared ones from (seed, step), the same on
    every rank as at the start of a run; each extra stream from its own `reseed(value)`."""
    value = derived_seed(seed, step)
    torch.manual_seed(value)  # the CPU generator and every device's
    random.seed(value)
    for stream in (streams or {}).values():
        stream.reseed(derived_seed(seed, step, "tensor-parallel"))
