"""A run directory read for the report: its metrics (a run still in progress too), config, memory
estimate, data manifest, fine-tuning share and profile summary. Nothing here draws or writes.

What cannot be found is said in `Run.notes` instead of guessed: a config that does not load, prepared
data that is not where the config points, tokens seen when the device count is unknown.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..builder import build_run_model, describe_finetuning, trainable_summary
from ..config import RunConfig, load_config, tokens_per_step
from ..data.build import prepared_dir
from ..data.files import default_cache_dir, expand_files
from ..data.shards import MANIFEST_FILE
from ..data.tokenizer import load_tokenizer
from ..errors import ShardwiseError
from ..memory.estimate import MemoryEstimate, estimate_memory
from ..train.metrics import METRICS_FILE, read_metrics_file
from ..untrusted import decode_text, parse_yaml, read_bytes, read_json, read_json_object

CONFIG_FILE = "config.yaml"
PROFILE_SUMMARY = Path("profile") / "summary.json"
MAX_STEP = 2**62  # a step beyond this is no step a run logged
MAX_CONFIG = 1 << 20  # config.yaml: a run's is a few kilobytes
MAX_DEVICES = 1 << 24  # a device count read from the records beyond this is no run's


@dataclass
class FineTuning:
    """What trains in a fine-tune: in words, the share, and the adapter's size (LoRA)."""

    description: str  # "LoRA r=16 alpha=32 on 8 projections"
    summary: str  # "4,358,144 of 1,548,072,448 parameters train (0.28%)"
    trainable: int
    total: int
    adapter_params: int  # LoRA parameters (0 for frozen layers)

    @property
    def share(self) -> float:
        return self.trainable / max(self.total, 1)


@dataclass
class Run:
    """One run directory, as the report shows it."""

    path: Path
    name: str
    records: list[dict[str, Any]]  # training records (with a loss), in file order
    evals: list[dict[str, Any]]  # evaluation records (eval_loss, ...)
    restarts: list[int] = field(default_factory=list)  # steps after which the run resumed
    config: RunConfig | None = None
    config_text: str = ""
    tokens_per_step: int | None = None
    devices: int | None = None
    memory: MemoryEstimate | None = None
    memory_device: str = ""  # the device kind the estimate is for
    measured_device: str | None = None  # what peak_memory_gb measured (the records' "device", else run.device)
    manifest: dict[str, Any] | None = None
    manifest_path: Path | None = None
    finetuning: FineTuning | None = None
    profile: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a numeric field of the training records (missing or non-finite left out)."""
        pairs = [(r["step"], float(r[key])) for r in self.records if _finite(r.get(key))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def eval_series(self, key: str = "loss") -> tuple[list[int], list[float]]:
        """(steps, values) of an evaluation figure (eval_<key>) of the evaluation records."""
        pairs = [(r["step"], float(r[f"eval_{key}"])) for r in self.evals if _finite(r.get(f"eval_{key}"))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def non_finite(self, key: str) -> list[int]:
        """Steps whose record holds a number for `key` that is NaN or infinite (a diverged run, or a window
        whose every step was skipped): left out of the plots, so the page says so."""
        return [r["step"] for r in (*self.records, *self.evals) if _number(r.get(key)) and not math.isfinite(r[key])]

    def skipped(self) -> list[tuple[int, int]]:
        """(step, skipped steps in the window ending there) where steps were skipped (a non-finite gradient)."""
        return [(r["step"], int(r["skipped_steps"])) for r in self.records
                if _finite(r.get("skipped_steps")) and r["skipped_steps"] > 0]

    def max_peak_memory_gb(self) -> float | None:
        values = self.series("peak_memory_gb")[1]
        return max(values) if values else None

    def runtime_rss_gb(self) -> float | None:
        """On a CPU, the runtime's own resident memory (the process's before training: interpreter and
        libraries) that its peak RSS holds beside the tensors; None when the records do not say it."""
        values = self.series("runtime_rss_gb")[1]
        return max(values) if values and self.peak_memory_is_rss else None

    def final(self, key: str) -> float | None:
        """The last value of `key` as logged (training or eval records): a NaN or infinite last loss is shown,
        not hidden."""
        values = [float(r[key]) for r in (*self.records, *self.evals) if _number(r.get(key))]
        return values[-1] if values else None

    @property
    def peak_memory_is_rss(self) -> bool:
        """Whether peak_memory_gb measured a CPU process's resident set (not device memory)."""
        return self.measured_device == "cpu"

    def peak_memory_kind(self) -> str:
        """What peak_memory_gb measured, in words."""
        if self.measured_device is None:
            return "not recorded (device unknown)"
        if self.peak_memory_is_rss:
            return "process peak RSS (cpu)"
        return f"peak allocated ({self.measured_device})"


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return _number(value) and math.isfinite(value)


def run_names(paths: list[Path]) -> list[str]:
    """Legend names: each directory's name, with its parent's where two runs share a name."""
    names = [p.resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]


def read_run(path: str | Path, name: str | None = None) -> Run:
    """Everything the report shows of one run directory (a ShardwiseError naming what is missing when it is
    not one)."""
    path = Path(path)
    _check_run_dir(path)
    read = read_metrics_file(path / METRICS_FILE)
    all_records = [r for r in read.records if _is_step(r.get("step"))]
    records = [r for r in all_records if "loss" in r]
    evals = [r for r in all_records if "eval_loss" in r]
    run = Run(path=path, name=name or path.resolve().name, records=records, evals=evals,
              restarts=find_restarts(all_records))
    if read.skipped_bytes:
        run.notes.append(f"{METRICS_FILE} is larger than the report reads: its first {read.skipped_bytes:,} bytes are "
                         "left out (the curves start at the first step after them)")
    unread = read.bad_lines + len(read.records) - len(all_records)
    if unread:
        run.notes.append(f"{METRICS_FILE}: {unread:,} line(s) are not a record with a step (0 to {MAX_STEP:,}) and "
                         "are left out (a torn last line of a stopped run, or damage)")
    if not records:
        run.notes.append(f"{METRICS_FILE} holds no training record yet")
    _note_non_finite(run)
    _read_config(run)
    run.measured_device = _device_from_records(records) or (
        run.config.run.device if run.config is not None and run.config.run.device != "auto" else None)
    if run.config is not None:
        _tokens(run)
        _memory(run)  # the config's sizes are bounded (models.config.MAX_LAYERS, ...): the meta build is small
        _finetuning(run)
        _manifest(run)
    _profile(run)
    return run


def _note_non_finite(run: Run) -> None:
    for key in ("loss", "eval_loss"):
        bad = run.non_finite(key)
        if bad:
            run.notes.append(f"{key} is not finite (NaN or infinite) at step(s) {', '.join(map(str, bad))}: left "
                             "out of the plots (the summary shows the last value as logged)")


def _check_run_dir(path: Path) -> None:
    """A ShardwiseError naming the path and what is missing when it is not a run directory."""
    if not path.exists():
        raise ShardwiseError(f"{path} does not exist: give a run directory (the train.output_dir of a run)")
    if not path.is_dir():
        raise ShardwiseError(f"{path} is a file, not a run directory: give the directory that holds {METRICS_FILE} "
                             "(the train.output_dir of a run)")
    if not (path / METRICS_FILE).exists() and not (path / METRICS_FILE).is_symlink():
        raise ShardwiseError(f"{path} holds no {METRICS_FILE}: give the run directory (train.output_dir) of a "
                             "run that has logged at least one step")


def find_restarts(records: list[dict[str, Any]]) -> list[int]:
    """Steps after which a run resumed, as metrics.jsonl shows them.

    A resumed run keeps only the records through the step it resumes from (`MetricsWriter`), so a restart
    shows as: a record that says so (`"resumed": true` at the step resumed from), a step that goes back
    (a file from before that rule: marked just before the resumed run's first record), or a training record
    off the `log_steps`
    grid that is not the last: the trainer logs off the grid only when it stops (a signal, or the end
    of max_steps), so more records after one mean the run went on from there.
    """
    found: set[int] = set()
    train = [r for r in records if "loss" in r]
    grid = _log_grid(train)
    for r in records:
        if r.get("resumed") is True:
            found.add(r["step"])
    for prev, cur in zip(train, train[1:]):
        if cur["step"] <= prev["step"]:
            found.add(cur["step"] - 1 if cur["step"] > 0 else 0)
        elif grid and prev["step"] % grid:
            found.add(prev["step"])
    return sorted(found)


def _log_grid(train: list[dict[str, Any]]) -> int | None:
    """The log interval: the most common step difference of the training records (None for one record)."""
    gaps = Counter(b["step"] - a["step"] for a, b in zip(train, train[1:]) if b["step"] > a["step"])
    if not gaps:
        return None
    return max(gaps, key=lambda g: (gaps[g], -g))


def _read_config(run: Run) -> None:
    path = run.path / CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        run.notes.append(f"no {CONFIG_FILE} in {run.path}: config, tokens seen, memory estimate and data summary "
                         "are left out")
        return
    try:  # a file from elsewhere: bounded, UTF-8, YAML without aliases
        run.config_text = decode_text(read_bytes(path, ShardwiseError, limit=MAX_CONFIG), path, ShardwiseError)
        raw = parse_yaml(run.config_text, path, ShardwiseError)
        if not isinstance(raw, dict):
            raise ShardwiseError(f"{path}: holds a YAML {type(raw).__name__}, not a mapping of sections")
        run.config = load_config(raw=raw)
    except (ShardwiseError, ValueError, TypeError, RecursionError) as exc:
        run.notes.append(f"{CONFIG_FILE} does not load ({' '.join(str(exc).split())[:2000]}): tokens seen, memory "
                         "estimate and data summary are left out")


def _tokens(run: Run) -> None:
    """Tokens per step from the config; the device count from the records where data_parallel is -1."""
    cfg = run.config
    devices = None
    if cfg.parallel.data_parallel == -1:
        devices = _devices_from_records(run.records)
        if devices is None:
            run.notes.append("parallel.data_parallel is -1 and the records do not show the device count: "
                             "tokens seen are left out, and the memory estimate is for data parallel 1")
            return
    run.devices = devices or cfg.parallel.world_size()
    run.tokens_per_step = tokens_per_step(cfg, devices)
    if cfg.data.kind == "instruction" and cfg.data.packing != "pack":
        run.notes.append(f"tokens seen are step x {run.tokens_per_step:,} token slots (global batch x seq_length), "
                         f"padding included (data.packing {cfg.data.packing}); tokens/s counts real tokens only")


def _devices_from_records(records: list[dict[str, Any]]) -> int | None:
    """World size = tokens/s over tokens/s per device (both in every training record)."""
    for r in records:
        total, per = r.get("tokens_per_s"), r.get("tokens_per_s_per_device")
        if _finite(total) and _finite(per) and per > 0 and 0 <= total / per <= MAX_DEVICES:
            return max(1, round(total / per))
    return None


def _device_from_records(records: list[dict[str, Any]]) -> str | None:
    """The device kind a record names (`"device": "cuda"`), if any."""
    kinds = [str(r["device"]).split(":")[0] for r in records if r.get("device")]
    return kinds[-1] if kinds and kinds[-1] in ("cuda", "npu", "cpu") else None


def _memory(run: Run) -> None:
    cfg = run.config
    device = run.measured_device
    if device is None:
        device = "cuda"
        run.notes.append("run.device is auto and the records do not name the device: the memory estimate is for "
                         "cuda (set run.device to choose)")
    run.memory_device = device
    try:
        run.memory = estimate_memory(cfg, run.devices, device)
    except (ShardwiseError, ValueError) as exc:
        run.notes.append(f"memory estimate: none ({exc})")


def _manifest(run: Run) -> None:
    """The prepared data's manifest: the directory train_files names, or the cache entry of the raw files."""
    data = run.config.data
    if data.kind == "instruction":
        run.notes.append("data summary: instruction data is read directly (no prepared manifest)")
        return
    if data.sources is not None:
        run.notes.append(f"data summary: a mixture of {len(data.sources)} sources (data.sources), each prepared "
                         "with its own manifest; the mixture plot shows what was read of each")
        return
    try:
        directory = prepared_dir(list(data.train_files)) or _cached_dir(run)
    except ShardwiseError as exc:
        run.notes.append(f"data summary: {exc}")
        return
    if directory is None:
        return
    path = directory / MANIFEST_FILE
    try:
        manifest = read_json(path, ShardwiseError)
    except ShardwiseError as exc:
        run.notes.append(f"data summary: {path} does not read as JSON ({exc}); run `shardwise prepare` again")
        return
    counts = manifest.get("counts", {}) if isinstance(manifest, dict) else None
    if not isinstance(counts, dict) or not all(_number(v) or v is None for v in counts.values()):
        run.notes.append(f"data summary: {path} is not a prepared-data manifest (a mapping with numeric `counts`)")
        return
    run.manifest_path, run.manifest = path, manifest


def _cached_dir(run: Run) -> Path | None:
    """The cache entry prepared from exactly these files (paths and sizes) with the run's tokenizer and
    options; None (said in the notes) when there is none or more than one."""
    data = run.config.data
    cache = Path(data.cache_dir or default_cache_dir()).expanduser()
    tokenizer_dir = Path(data.tokenizer).expanduser() if data.tokenizer else run.path / "tokenizer"
    try:
        files = expand_files(list(data.train_files))
        fingerprint = load_tokenizer(tokenizer_dir).fingerprint
    except (ShardwiseError, OSError) as exc:
        run.notes.append(f"data summary: left out, the run's inputs or tokenizer cannot be read ({exc})")
        return None
    want = sorted((f, os.path.getsize(f)) for f in files)  # absolute paths, as the manifest records them
    found = [d for d in sorted(cache.glob("shards-*")) if _manifest_matches(d / MANIFEST_FILE, want, fingerprint,
                                                                           data)]
    if len(found) == 1:
        return found[0]
    run.notes.append(f"data summary: left out, {'no' if not found else len(found)} prepared entr"
                     f"{'y' if len(found) == 1 else 'ies'} in {cache} match data.train_files with the run's "
                     "tokenizer (give data.train_files a `shardwise prepare` directory to point at it)")
    return None


def _manifest_matches(path: Path, want: list[tuple[str, int]], fingerprint: str, data: Any) -> bool:
    try:
        m = read_json_object(path, ShardwiseError)
    except ShardwiseError:
        return False
    entries, options, tokenizer = m.get("inputs", []), m.get("options", {}), m.get("tokenizer", {})
    if not isinstance(entries, list) or not all(isinstance(i, dict) for i in entries) \
            or not isinstance(options, dict) or not isinstance(tokenizer, dict):
        return False
    inputs = sorted(((str(i.get("path")), i.get("bytes")) for i in entries), key=str)
    return (inputs == sorted(want, key=str) and tokenizer.get("fingerprint") == fingerprint
            and options.get("min_chars") == data.min_chars and options.get("max_length") == data.max_length
            and options.get("text_field") == data.text_field)


def _finetuning(run: Run) -> None:
    """Trainable share and adapter size from the model on the meta device (no weights are made)."""
    cfg = run.config
    if cfg.lora is None and not (cfg.freeze is not None and cfg.freeze.active()):
        return
    try:
        model = build_run_model(cfg, "meta")
    except (ShardwiseError, ValueError) as exc:
        run.notes.append(f"fine-tuning: the model does not build from {CONFIG_FILE} ({exc}): its trainable share "
                         "is left out")
        return
    params = list(model.named_parameters())
    run.finetuning = FineTuning(
        description=describe_finetuning(model, cfg.lora, cfg.freeze) or "",
        summary=trainable_summary(model),
        trainable=sum(p.numel() for _, p in params if p.requires_grad),
        total=sum(p.numel() for _, p in params),
        adapter_params=sum(p.numel() for n, p in params if "lora_" in n),
    )


def _profile(run: Run) -> None:
    path = run.path / PROFILE_SUMMARY
    if not path.exists() and not path.is_symlink():
        return
    try:
        summary = read_json(path, ShardwiseError)
    except ShardwiseError as exc:
        run.notes.append(f"{PROFILE_SUMMARY} does not read ({exc}): the profile section is left out")
        return
    problem = _profile_problem(summary)
    if problem:
        run.notes.append(f"{path}: {problem}: the profile section is left out")
        return
    run.profile = summary


def _profile_problem(summary: Any) -> str:
    """What is wrong with a profile summary's shape (the format `train/profiling.py` writes), or ""."""
    if not isinstance(summary, dict):
        return "not a JSON object"
    shares = summary.get("shares", {})
    if not isinstance(shares, dict) or not all(_number(v) for v in shares.values()):
        return "`shares` is not a mapping of numbers"
    operators = summary.get("top_operators", [])
    if not isinstance(operators, list) or not all(isinstance(o, dict) for o in operators):
        return "`top_operators` is not a list of objects"
    if any(not _number(o.get(k, 0)) for o in operators for k in ("self_time_ms", "share")):
        return "`top_operators` holds a self_time_ms or share that is not a number"
    if not isinstance(summary.get("trace", ""), str) or not isinstance(summary.get("steps", []), list):
        return "`trace` is not a path or `steps` is not a list"
    return ""
