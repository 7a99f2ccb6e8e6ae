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
import math
import random
from typing import Any

import torch

from ..errors import CheckpointError

_FORMAT = 2


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


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


def restore(state: Any, device: torch.device, streams: dict[str, Any] | None = None,
            source: str = "the checkpoint") -> list[str]:
    """Set this rank's generators from `capture`'s dict (or the format before it); `streams` maps the
    names of extra streams to objects with `state()` and `set_state(tensor)`. Returns what could not be
    restored. Every value is checked by type and size against the generator it is for before any is set,
    so a damaged or crafted file (`source`, named in the error) changes nothing."""
    try:
        plan = _checked(state, device, streams or {})
    except _Malformed as e:
        raise CheckpointError(f"{source}: the saved random state is malformed ({e}); the checkpoint was changed "
                              "or damaged: copy it again from the run that saved it") from None
    missing: list[str] = []
    try:
        for name, apply in plan:
            if apply is None:
                missing.append(name)
            else:
                apply()
    except (TypeError, ValueError, RuntimeError) as e:  # checked above: a state this torch refuses anyway
        raise CheckpointError(f"{source}: the saved random state is malformed ({type(e).__name__}: {e}); the "
                              "checkpoint was changed or damaged") from None
    return missing


class _Malformed(ValueError):
    pass


def _bytes_of(value: Any, what: str, length: int) -> torch.Tensor:
    """A base64 string of exactly `length` bytes, as a uint8 tensor (the length checked before decoding)."""
    if not isinstance(value, str):
        raise _Malformed(f"{what} is {type(value).__name__}, not a base64 string")
    if len(value) != 4 * ((length + 2) // 3):
        raise _Malformed(f"{what} has {len(value):,} characters; the {length:,}-byte state it stands for has "
                         f"{4 * ((length + 2) // 3):,}")
    try:
        data = base64.b64decode(value, validate=True)
    except ValueError as e:  # binascii.Error
        raise _Malformed(f"{what} is not base64 ({e})") from None
    if len(data) != length:
        raise _Malformed(f"{what} holds {len(data):,} bytes, not {length:,}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _python_state(value: Any) -> tuple:
    """`random.getstate()` as JSON gives it back: [3, [625 words < 2**32, the last an index <= 624], null or a
    float]."""
    if not isinstance(value, list) or len(value) != 3 or value[0] != 3 or isinstance(value[0], bool):
        raise _Malformed(f"the Python state is {str(value)[:80]}, not [3, [625 numbers], null or a number]")
    words, gauss = value[1], value[2]
    if not isinstance(words, list) or len(words) != 625 or not all(
            type(w) is int and 0 <= w < 2**32 for w in words) or words[-1] > 624:
        raise _Malformed("the Python state's words are not 624 numbers below 2**32 and an index up to 624")
    if gauss is not None and (type(gauss) is not float or not math.isfinite(gauss)):
        raise _Malformed(f"the Python state's last value is {str(gauss)[:40]}, not null or a number")
    return (3, tuple(words), gauss)


def _checked(state: Any, device: torch.device, streams: dict[str, Any]) -> list[tuple[str, Any]]:
    """(what, a function that sets it, or None where nothing saved fits) for each generator, every value
    checked first."""
    if not isinstance(state, dict):
        raise _Malformed(f"it is {type(state).__name__}, not an object")
    fmt = state.get("format")
    if fmt is not None and (type(fmt) is not int or not 1 <= fmt <= _FORMAT):
        raise _Malformed(f"format {str(fmt)[:40]} is not one this shardwise reads (1 to {_FORMAT})")
    key = "cpu" if "cpu" in state else "torch"
    cpu = _bytes_of(state.get(key), f"the CPU state ({key!r})", torch.get_rng_state().numel())
    python = _python_state(state.get("python"))
    plan: list[tuple[str, Any]] = [("the CPU generator", lambda: torch.set_rng_state(cpu)),
                                   ("Python's random", lambda: random.setstate(python))]
    module = _device_module(device)
    saved = state.get("device")
    if "cuda" in state and fmt is None:  # before format 2: every visible GPU's state
        cuda = state["cuda"]
        if not isinstance(cuda, list) or len(cuda) > 4096:
            raise _Malformed("the old CUDA states are not a list of states")
        saved = _old_cuda_state(cuda, device)
    if saved is not None and (not isinstance(saved, dict) or not isinstance(saved.get("type"), str)):
        raise _Malformed(f"the device state is {str(saved)[:80]}, not an object with a type and a state")
    if module is not None:
        if saved and saved["type"] == device.type:
            value = _bytes_of(saved.get("state"), f"the {device.type} state",
                              module.get_rng_state(device).numel())
            plan.append((f"the {device.type} generator", lambda: module.set_rng_state(value, device)))
        else:
            plan.append((f"the {device.type} generator", None))
    saved_streams = state.get("streams", {})
    if not isinstance(saved_streams, dict):
        raise _Malformed(f"the streams are {type(saved_streams).__name__}, not an object")
    for name, stream in streams.items():
        if name in saved_streams:
            value = _bytes_of(saved_streams[name], f"stream {name}", stream.state().numel())
            plan.append((f"stream {name}", lambda stream=stream, value=value: stream.set_state(value)))
        else:
            plan.append((f"stream {name}", None))
    return plan


def _old_cuda_state(states: list[str], device: torch.device) -> dict | None:
    """The pre-format-2 list of every visible GPU's state: usable only where the same GPUs are visible."""
    if device.type != "cuda" or len(states) != torch.cuda.device_count():
        return None
    if not isinstance(states[device.index or 0], str):
        raise _Malformed("an old CUDA state is not a string")
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
