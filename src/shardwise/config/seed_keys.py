"""The source documents' YAML shapes: MindSpore Transformers' `train_config.yaml` (seed 000) and
`llm_pretrain.yaml` (seed 002), translated key by key into ours before validation, so that both
load as written there. The translation remembers where each key came from (`Spelling`), so that an
error names a key as the user's file spells it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

_DEVICE_NAMES = {"ascend": "npu", "npu": "npu", "gpu": "cuda", "cuda": "cuda", "cpu": "cpu", "auto": "auto"}


def _device(v: Any) -> Any:
    if isinstance(v, str) and v.lower() in _DEVICE_NAMES:
        return _DEVICE_NAMES[v.lower()]
    raise ValueError("use Ascend (or npu), GPU (or cuda), CPU, or auto")


def _graph_mode(v: Any) -> Any:
    # MindSpore: mode graph / GRAPH_MODE = 0 compiles; pynative / PYNATIVE_MODE = 1 runs eagerly.
    text = str(v).lower() if isinstance(v, (str, int)) and not isinstance(v, bool) else None
    if text in ("graph", "graph_mode", "0"):
        return True
    if text in ("pynative", "pynative_mode", "1", "eager"):
        return False
    raise ValueError("use graph (or 0) to compile, pynative (or 1) for eager")


# The two shapes by the document that uses them: a typo is matched against the spellings of the
# shapes the user's file is written in (a seed 000 file gets `learning_rate`, ours `train.lr`).
SEED_000, SEED_002 = "seed 000 (train_config.yaml)", "seed 002 (llm_pretrain.yaml)"

SEED_000_KEYS: dict[str, tuple[str, Any]] = {
    "model_name": ("model.preset", None),
    "device_target": ("run.device", _device),
    "mode": ("run.compile", _graph_mode),
    "seed": ("train.seed", None),
    "batch_size": ("train.micro_batch_size", None),
    "seq_length": ("data.seq_length", None),
    "epochs": ("train.epochs", None),
    "learning_rate": ("train.lr", None),
    "save_ckpt": ("train.output_dir", None),
    "save_steps": ("train.save_steps", None),
    "parallel.model_parallel": ("parallel.tensor_parallel", None),
    "parallel.pipeline_stages": ("parallel.pipeline_parallel", None),
    "optimize.max_grad_norm": ("train.max_grad_norm", None),
}
SEED_002_KEYS: dict[str, tuple[str, Any]] = {
    "model.seq_length": ("data.seq_length", None),
    "train.batch_size": ("train.global_batch_size", None),
    "train.grad_clip_norm": ("train.max_grad_norm", None),
    "train.loss_scale": ("optimize.loss_scale", None),
    "run.mode": ("run.compile", _graph_mode),
    "run.device_target": ("run.device", _device),
}
# Each entry: seed key (dotted) -> (our key, value translation). Applied before validation, so both
# seed files load as written there.
SEED_KEYS: dict[str, tuple[str, Any]] = {**SEED_000_KEYS, **SEED_002_KEYS}
ZERO_KEYS = ("parallel.use_zero", "parallel.zero_level")  # seed 002's ZeRO pair -> parallel.zero_stage

# Accepted so that seed files load, but they change nothing here: the warning says why.
NO_EFFECT_KEYS = {
    "run.enable_graph_kernel": "MindSpore graph-kernel fusion has no PyTorch equivalent; use run.compile",
    "run.graph_kernel_flags": "MindSpore graph-kernel flags have no PyTorch equivalent; use run.compile",
    "enable_graph_kernel": "MindSpore graph-kernel fusion has no PyTorch equivalent; use run.compile",
    "graph_kernel_flags": "MindSpore graph-kernel flags have no PyTorch equivalent; use run.compile",
    "parallel.auto_parallel": "shardwise applies the layout you give in parallel.*",
    "parallel.micro_batch_interleave": "MindSpore's micro-batch interleaving has no PyTorch equivalent",
}

# Every seed spelling and the shape it belongs to.
SEED_SPELLINGS: dict[str, str] = {
    **{k: SEED_000 for k in SEED_000_KEYS},
    **{k: SEED_002 for k in SEED_002_KEYS},
    **{k: SEED_002 for k in ZERO_KEYS},
    "enable_graph_kernel": SEED_000, "graph_kernel_flags": SEED_000, "parallel.auto_parallel": SEED_000,
    "run.enable_graph_kernel": SEED_002, "run.graph_kernel_flags": SEED_002,
    "parallel.micro_batch_interleave": SEED_002,
}

# Hints for names people commonly try that are neither ours nor a seed key.
HINTS = {"learning_rate": "lr", "batch_size": "micro_batch_size", "grad_clip": "max_grad_norm",
          "n_layers": "num_layers", "n_heads": "num_heads", "steps": "max_steps",
          "gradient_accumulation_steps": "optimize.gradient_accumulation_steps"}


def get_key(d: dict, dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in a nested dict."""
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def pop_key(d: dict, dotted: str) -> None:
    """Remove a dotted key, and sections it leaves empty."""
    *parents, last = dotted.split(".")
    cur = d
    for part in parents:
        cur = cur[part]
    del cur[last]
    if parents and not cur:
        pop_key(d, ".".join(parents))


def set_key(d: dict, dotted: str, value: Any) -> None:
    """Set a dotted key, making its sections."""
    *parents, last = dotted.split(".")
    cur = d
    for i, part in enumerate(parents):
        nxt = cur.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {dotted}: {'.'.join(parents[: i + 1])} is not a section")
        cur = nxt
    cur[last] = value


def zero_stage_from(use_zero: bool | None, zero_level: int | None) -> int:
    """Seed 002's `use_zero` + `zero_level` as one ZeRO stage (use_zero false means stage 0)."""
    if use_zero is False:
        return 0
    return int(zero_level) if zero_level is not None else 1


def translate_seed_keys(raw: dict) -> tuple[dict, list[str]]:
    """Rewrite the seed documents' keys into ours; return the new dict and warnings to show."""
    canonical, warnings, _ = translate_with_origins(raw)
    return canonical, warnings


def translate_with_origins(raw: dict) -> tuple[dict, list[str], dict[str, str]]:
    """`translate_seed_keys`, plus where each translated key came from (our dotted key -> the key as
    the user wrote it), so that an error about its value can name the key the user knows."""
    raw = deep_copy(raw)
    warnings: list[str] = []
    origins: dict[str, str] = {}
    _translate_zero(raw, origins)
    # `batch_size` is the per-device batch at the top level of seed 000 but the global batch under
    # `train` in seed 002 (next to micro_batch_size): the table keeps the two apart by their paths.
    for seed_key, (our_key, fn) in SEED_KEYS.items():
        found, value = get_key(raw, seed_key)
        if not found:
            continue
        pop_key(raw, seed_key)
        _merge_into(raw, our_key, seed_value(seed_key, value, fn), seed_key)
        origins[our_key] = seed_key
    for key, why in NO_EFFECT_KEYS.items():
        found, value = get_key(raw, key)
        if found:
            pop_key(raw, key)
            warnings.append(f"{key}: {value!r} has no effect in shardwise ({why})")
    # Seed 002 gives seq_length in the model section: make the model long enough for it. Only a
    # usable length is copied, so that a wrong one is reported once, under the key the user wrote.
    found_seq, seq = get_key(raw, "data.seq_length")
    model = raw.get("model")
    if found_seq and isinstance(model, dict) and model and "max_position_embeddings" not in model:
        if not model.get("preset") and isinstance(seq, int) and not isinstance(seq, bool) and seq >= 2:
            model["max_position_embeddings"] = seq
    return raw, warnings, origins


def seed_value(seed_key: str, value: Any, fn: Any) -> Any:
    """A seed value in our terms; a value the seed key cannot take names the key as written."""
    if fn is None:
        return value
    try:
        return fn(value)
    except ValueError as e:
        raise ConfigError(f"{seed_key} = {value!r} is not allowed; {e}") from None


def _translate_zero(raw: dict, origins: dict[str, str]) -> None:
    """Seed 002's `parallel.use_zero` + `parallel.zero_level` -> `parallel.zero_stage`."""
    found_use, use_zero = get_key(raw, "parallel.use_zero")
    found_lvl, level = get_key(raw, "parallel.zero_level")
    if not (found_use or found_lvl):
        return
    if found_use and not isinstance(use_zero, bool):
        raise ConfigError(f"parallel.use_zero = {use_zero!r} is not allowed; use true or false")
    if found_lvl and (isinstance(level, bool) or level not in (0, 1, 2, 3)):
        raise ConfigError(f"parallel.zero_level = {level!r} is not allowed; use 0, 1, 2 or 3 (the ZeRO stage)")
    stage = zero_stage_from(use_zero if found_use else None, level if found_lvl else None)
    for key in ZERO_KEYS:
        if get_key(raw, key)[0]:
            pop_key(raw, key)
    _merge_into(raw, "parallel.zero_stage", stage, "parallel.use_zero/zero_level")
    origins["parallel.zero_stage"] = "parallel.zero_level" if found_lvl else "parallel.use_zero"


def _merge_into(raw: dict, our_key: str, value: Any, seed_key: str) -> None:
    found, existing = get_key(raw, our_key)
    if found and existing != value:
        raise ConfigError(
            f"{seed_key} ({value!r}) and {our_key} ({existing!r}) set the same thing differently; "
            "keep one of them"
        )
    set_key(raw, our_key, value)


def deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [deep_copy(v) for v in d]
    return d


def seeds_used(raw: dict) -> frozenset[str]:
    """The seed shapes (SEED_000, SEED_002) whose own keys a raw config uses."""
    return frozenset(shape for key, shape in SEED_SPELLINGS.items() if get_key(raw, key)[0])


@dataclass(frozen=True)
class Spelling:
    """How the user's file spells its keys, so that an error names a key as it is written there.

    origins: our dotted key -> the key as the user wrote it (a seed key, or the key of a `--set`).
    seeds: the seed shapes the file uses; a misspelt key is matched against their spellings too.
    """

    origins: dict[str, str]
    seeds: frozenset[str]

    def written(self, dotted: str) -> str:
        """Our dotted key (or a path below it) as the user wrote it."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in self.origins:
                return ".".join([self.origins[head], *parts[n:]])
        return dotted

    def in_user_terms(self, text: str) -> str:
        """`text` with each of our translated keys replaced by the user's spelling of it."""
        for ours, theirs in self.origins.items():
            # A whole key only: not inside a longer key, a path or a quoted value.
            text = re.sub(rf"(?<![\w./'\"-]){re.escape(ours)}(?![\w'\"/-])", lambda _: theirs, text)
        return text
