"""The `data` section of a config -> tokenizer, training dataset and (optional) eval dataset.

Pre-training: raw files are prepared into token shards once (cached by input, tokenizer and options;
`shardwise prepare` does the same ahead of time into a directory you name, which `train_files` may
point at), then packed into `seq_length` samples with document masks. Instruction tuning: `.jsonl`
conversations become `InstructionDataset` samples with loss on the assistant turns only. The seed
documents' `TextDataset` is the same "prepare if needed, then pack" step as a dataset class.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..config import DataConfig, RunConfig
from ..errors import ConfigError, DataError
from .files import default_cache_dir, expand_files, files_key, resolve_inputs
from .instruction import InstructionDataset, inspect_instruction_file
from .loader import unwrap_loader
from .mixture import MixtureDataset
from .packing import PackedDataset
from .preference import PreferenceDataset
from .prepare import cache_lock, prepare_cached
from .shards import MANIFEST_FILE, TokenShards
from .tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer

logger = logging.getLogger(__name__)


def prepared_dir(globs: list[str]) -> Path | None:
    """The directory when `globs` names one `shardwise prepare` output, else None (raw files)."""
    dirs = [Path(g).expanduser() for g in globs if (Path(g).expanduser() / MANIFEST_FILE).is_file()]
    if not dirs:
        return None
    if len(globs) > 1:
        raise DataError(
            f"data files {globs} mix a prepared directory ({dirs[0]}) with other entries; give either one "
            f"prepared directory or globs of raw files"
        )
    return dirs[0]


def _prepare_options(data: DataConfig) -> dict[str, Any]:
    return {
        "fmt": data.format, "text_field": data.text_field, "txt_documents": data.txt_documents,
        "min_chars": data.min_chars, "max_length": data.max_length, "on_bad_line": data.on_bad_line,
        "quality": data.quality, "dedup": data.dedup, "near_dedup": data.near_dedup.model_dump(),
        "boilerplate_lines": data.boilerplate_lines,
    }


def _token_stream(globs: list[str], tokenizer: Tokenizer, data: DataConfig, cache_dir: str) -> TokenShards:
    """Token shards of `globs`: a prepared directory as is, raw files prepared (or found) in the cache."""
    directory = prepared_dir(globs)
    if directory is None:
        directory = prepare_cached(globs, tokenizer, cache_dir, workers=data.prepare_workers,
                                   **_prepare_options(data))
    return TokenShards(directory, tokenizer)


def _train_tokenizer(globs: list[str], data: DataConfig, vocab_size: int, cache_dir: str) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the training files, kept in the cache for the next run."""
    files = resolve_inputs(globs, data.format)
    key = files_key([f.path for f in files], "bpe", vocab_size, data.text_field)
    out = Path(cache_dir).expanduser() / f"tokenizer-{key}"
    if (out / "tokenizer.json").is_file():
        logger.info("using cached tokenizer %s", out)
        return load_tokenizer(out)
    with cache_lock(out):  # one process per file system trains it; the others wait and load it
        if (out / "tokenizer.json").is_file():
            logger.info("using cached tokenizer %s, trained by another process meanwhile", out)
            return load_tokenizer(out)
        return _train_into(out, files, data, vocab_size)


def _train_into(out: Path, files: list[Any], data: DataConfig, vocab_size: int) -> Tokenizer:
    """Train the tokenizer in a temporary directory beside `out`, then rename it to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        # Bad lines are skipped here too when the data section says so: the tokenizer reads the same lines.
        train_bpe_tokenizer([f.path for f in files], vocab_size, tmp, text_field=data.text_field,
                            skip_bad_lines=data.on_bad_line == "skip")
        if out.exists() and not (out / "tokenizer.json").is_file():
            shutil.rmtree(out)  # a leftover without tokenizer.json is unusable
        # Renaming the finished directory keeps a half-trained tokenizer from ever being reused.
        os.replace(tmp, out)
    except OSError:
        if not (out / "tokenizer.json").is_file():
            raise
        # Another process finished the same tokenizer first; theirs is identical, so use it.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(out)


def _tokenizer(data: DataConfig, vocab_size: int, cache_dir: str) -> Tokenizer:
    if data.tokenizer is not None:
        return load_tokenizer(data.tokenizer)
    if data.kind in ("instruction", "preference"):
        raise DataError(
            f"data.kind is {data.kind} but data.tokenizer is not set; fine-tuning uses the tokenizer of the "
            "model it starts from: set data.tokenizer to its directory (a shardwise run has one in "
            "RUN_DIR/tokenizer)"
        )
    for name, globs, _ in data.source_list():
        if prepared_dir(globs) is not None:
            where = "data.train_files" if data.sources is None else f"data.sources {name!r}"
            raise DataError(
                f"{where} is the prepared directory {globs[0]!r}, so data.tokenizer must be the tokenizer it was "
                f"prepared with (its manifest.json records the fingerprint)"
            )
    return _train_tokenizer([g for _, globs, _ in data.source_list() for g in globs], data, vocab_size, cache_dir)


def _mixture(data: DataConfig, tokenizer: Tokenizer, cache_dir: str, flags: dict[str, bool]) -> MixtureDataset:
    """data.sources: each source prepared (or found) and packed on its own, blended by weight."""
    names, datasets, weights = [], [], []
    for name, globs, weight in data.source_list():
        try:
            datasets.append(PackedDataset(_token_stream(globs, tokenizer, data, cache_dir), data.seq_length, **flags))
        except DataError as exc:
            raise DataError(f"data.sources {name!r}: {exc}") from None
        names.append(name)
        weights.append(weight)
    schedule = [(entry.step, [entry.weights[n] for n in names]) for entry in data.mixture_schedule]
    return MixtureDataset(names, datasets, weights, schedule)


def _pretrain_datasets(data: DataConfig, tokenizer: Tokenizer, cache_dir: str) -> tuple[Any, Any]:
    seq = data.seq_length
    flags = {"reset_attention_mask": data.reset_attention_mask, "reset_position_ids": data.reset_position_ids}
    if data.sources is not None:
        if data.eval_fraction:
            raise DataError("data.eval_fraction with data.sources: a tail of each source is not held out yet; give "
                            "the held-out text as data.eval_files")
        train = _mixture(data, tokenizer, cache_dir, flags)
        if data.eval_files:
            return train, PackedDataset(_token_stream(data.eval_files, tokenizer, data, cache_dir), seq, **flags)
        held_out = {}  # each source's own held-out data: evaluation reports each one's loss
        for src in data.sources:
            if src.eval_files:
                try:
                    held_out[src.name] = PackedDataset(_token_stream(src.eval_files, tokenizer, data, cache_dir),
                                                       seq, **flags)
                except DataError as exc:
                    raise DataError(f"data.sources {src.name!r} eval_files: {exc}") from None
        return train, held_out or None
    stream = _token_stream(data.train_files, tokenizer, data, cache_dir)
    if data.eval_files:
        if data.eval_fraction:
            logger.warning("data.eval_files is set, so data.eval_fraction %s is ignored", data.eval_fraction)
        eval_ds = PackedDataset(_token_stream(data.eval_files, tokenizer, data, cache_dir), seq, **flags)
        return PackedDataset(stream, seq, **flags), eval_ds
    if not data.eval_fraction:
        return PackedDataset(stream, seq, **flags), None
    cut = stream.num_tokens - int(round(stream.num_tokens * data.eval_fraction))
    if stream.num_tokens - cut < seq + 1:
        raise DataError(
            f"data.eval_fraction {data.eval_fraction} holds out {stream.num_tokens - cut} of "
            f"{stream.num_tokens} tokens, fewer than the {seq + 1} one eval sample needs; raise "
            f"eval_fraction, lower seq_length or give data.eval_files"
        )
    return PackedDataset(stream, seq, stop=cut, **flags), PackedDataset(stream, seq, start=cut, **flags)


def _instruction_datasets(
    data: DataConfig, tokenizer: Tokenizer, cache_dir: str, micro_batch_size: int, seed: int
) -> tuple[Any, Any]:
    if data.eval_fraction:
        raise DataError(
            "data.eval_fraction is not supported for instruction data (a tail of conversations is not a "
            "fair held-out set when files are sorted by topic); put held-out conversations in a file and "
            "set data.eval_files"
        )
    packing_dynamic = data.packing == "dynamic"

    def dataset(globs: list[str], shuffle: bool) -> InstructionDataset:
        return InstructionDataset(
            globs, tokenizer, data.seq_length, shuffle=shuffle, template=data.template, packing=data.packing,
            truncation=data.truncation, on_bad_line=data.on_bad_line, cache_dir=cache_dir, seed=seed,
            # Dynamic batches hold what micro_batch_size full rows would: the same memory bound.
            token_budget=micro_batch_size * data.seq_length if packing_dynamic else None,
            pad_to_multiple_of=data.pad_to_multiple_of,
        )

    train = dataset(data.train_files, True)
    return train, dataset(data.eval_files, False) if data.eval_files else None


def _preference_datasets(data: DataConfig, tokenizer: Tokenizer) -> tuple[Any, Any]:
    if data.eval_fraction:
        raise DataError("data.eval_fraction is not supported for preference data; put held-out pairs in a file and "
                        "set data.eval_files")

    def dataset(globs: list[str], shuffle: bool) -> PreferenceDataset:
        return PreferenceDataset(globs, tokenizer, data.seq_length, shuffle=shuffle, template=data.template,
                                 on_bad_line=data.on_bad_line, pad_to_multiple_of=data.pad_to_multiple_of)

    return dataset(data.train_files, True), dataset(data.eval_files, False) if data.eval_files else None


class TextDataset(PackedDataset):
    """The seed documents' pretraining dataset: text files packed into `max_seq_len` samples.

    The files are prepared into token shards once (cached by input, tokenizer and options, see
    `prepare_cached`); samples carry document masks and restarting positions.
    """

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Tokenizer,
        max_seq_len: int,
        shuffle: bool = True,
        cache_dir: str | None = None,
        **prepare_options: Any,
    ) -> None:
        """Prepare the files matching `data_files` (options as `prepare_corpus`); `shuffle` is for the loader."""
        self.files = expand_files(data_files)
        self.tokenizer = tokenizer
        self.shuffle = shuffle
        directory = prepare_cached(self.files, tokenizer, cache_dir, **prepare_options)
        super().__init__(TokenShards(directory, tokenizer), max_seq_len)


def check_data_files(data: DataConfig) -> None:
    """Fail now, naming the file, on inputs that cannot be read: an empty glob, a directory, a binary
    or empty-of-JSON file, broken gzip, a .parquet that is not parquet, a mix of prepared and raw
    entries. Only each file's first bytes are read (a bad line deeper in is found when the data is
    read), so this is cheap enough to run before anything is written or removed."""
    if not data.train_files and data.sources is None:
        raise DataError("data.train_files is empty: give globs of data files (or a prepared directory)")
    named = [(f"data.sources {name!r}: ", globs) for name, globs, _ in data.source_list()] \
        if data.sources is not None else [("", data.train_files)]
    named += [(f"data.sources {src.name!r} eval_files: ", src.eval_files) for src in data.sources or []
              if src.eval_files]
    for where, globs in named + [("", data.eval_files or [])]:
        if not globs or prepared_dir(globs) is not None:
            continue
        try:
            if data.kind in ("instruction", "preference"):
                for path in expand_files(globs):
                    inspect_instruction_file(path)
            else:
                resolve_inputs(globs, data.format)
        except DataError as exc:
            if not where:
                raise
            raise DataError(f"{where}{exc}") from None


def build_data(
    data: DataConfig, vocab_size: int, micro_batch_size: int = 1, seed: int = 0
) -> tuple[Tokenizer, Any, Any]:
    """(tokenizer, train dataset, eval dataset or None) as the `data` section describes.

    Without `data.tokenizer`, pre-training trains a byte-level BPE tokenizer of `vocab_size` tokens on
    the training files (cached). `micro_batch_size` sets the token budget of dynamic SFT batches.
    """
    check_data_files(data)
    cache_dir = data.cache_dir if data.cache_dir is not None else default_cache_dir()
    tokenizer = _tokenizer(data, vocab_size, cache_dir)
    if data.kind == "instruction":
        train, evaluation = _instruction_datasets(data, tokenizer, cache_dir, micro_batch_size, seed)
    elif data.kind == "preference":
        train, evaluation = _preference_datasets(data, tokenizer)
    else:
        train, evaluation = _pretrain_datasets(data, tokenizer, cache_dir)
    held_out = sum(len(d) for d in evaluation.values()) if isinstance(evaluation, dict) else \
        len(evaluation) if evaluation is not None else 0
    logger.info("%s data: %d train samples%s", data.kind, len(train), f", {held_out} eval samples" if held_out else "")
    return tokenizer, train, evaluation


def run_data(cfg: RunConfig, train_dataset: Any = None, eval_dataset: Any = None,
             tokenizer: Any = None) -> tuple[Any, Any, Any]:
    """(tokenizer, train dataset, eval dataset) of a run: the datasets given (the Python API's), else
    built from its data section; checked against the run (held-out data for train.eval_steps, a
    vocabulary the model can take)."""
    if train_dataset is None:
        tokenizer, train_dataset, built_eval = build_data(cfg.data, cfg.model.vocab_size, cfg.train.micro_batch_size,
                                                          cfg.train.seed)
        eval_dataset = eval_dataset if eval_dataset is not None else built_eval
    train_dataset = unwrap_loader(train_dataset)
    if cfg.train.eval_steps and eval_dataset is None:
        raise ConfigError(
            "train.eval_steps is set but there is no held-out data; set data.eval_fraction or "
            "data.eval_files (or pass eval_dataset=), or remove train.eval_steps"
        )
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}"
        )
    return tokenizer, train_dataset, eval_dataset


__all__ = ["TextDataset", "build_data", "check_data_files", "prepared_dir", "run_data"]
