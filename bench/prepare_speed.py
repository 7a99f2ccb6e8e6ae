#!/usr/bin/env python
"""Corpus preparation speed next to the raw speed of the `tokenizers` library's batch encoding.

    python bench/prepare_speed.py [--input GLOB ...] [--repeat R] [--tokenizer DIR | --vocab-size N]
                                  [--txt-documents file|paragraph] [--workers N] [--rounds K]

On the same documents (default: corpora/austen/*.txt, 6 files, 4 MB), each round measures:

- `raw_parallel`: `tokenizers.Tokenizer.encode_batch` (the fast variant where present) on all the
  documents at once, already in memory, with the library's own thread pool (all cores);
- `raw_one_thread`: the same call with TOKENIZERS_PARALLELISM=false (one core);
- `prepare_workers_1` and `prepare_workers_N`: `prepare_corpus` end to end (reading the files,
  UTF-8 repair, dedup, min length, tokenising, writing shards and the manifest), with 1 and N workers;
- `prepare_cleaned_N`: the same with every cleaning filter on (quality rules, near-duplicate MinHash,
  boilerplate lines seen in 5 earlier documents), N workers;
- `megatron_N` (with --megatron DIR, a Megatron-LM checkout): its `tools/preprocess_data.py` on the same
  documents (one .jsonl, which every prepare row then reads too), the same tokenizer (as a Hugging Face
  tokenizer directory), N workers, EOD appended; timed as a whole command (its Python start and imports,
  `startup_s`, measured apart with --help, are reported and taken off its rate).

Rates are tokens per wall-clock second (EOS included for prepare, not for raw: the raw count is the
tokens the tokenizer produced); the JSON gives the best round (a shared machine only ever slows a run
down) and every round. `cpu_s` is user+system CPU time of this process and its children, which tells
how much of a slowdown came from other load (`loadavg`). Without --tokenizer a byte-level BPE of
--vocab-size is trained on the input first (not timed). --repeat R lists every file R times (through
symlinks) to make the input bigger; deduplication is then switched off, or it would drop the copies.

Prints one JSON object on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.data import load_tokenizer, train_bpe_tokenizer  # noqa: E402
from shardwise.data.files import resolve_inputs  # noqa: E402
from shardwise.data.prepare import default_workers, prepare_corpus  # noqa: E402
from shardwise.data.sources import ReadStats, read_documents  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def timed(fn: Callable[[], int]) -> dict[str, float]:
    """Run fn (returning a token count); tokens, wall seconds, CPU seconds and tokens/s."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    tokens = fn()
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return {
        "tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "tokens_per_s": round(tokens / wall)
    }


def raw_encode(tok: Any, docs: list[str], parallel: bool) -> int:
    """Tokens from the library's encode_batch on all documents, with or without its thread pool."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    try:
        fast = getattr(tok.backend, "encode_batch_fast", None) or tok.backend.encode_batch
        return sum(len(e.ids) for e in fast(docs, add_special_tokens=False))
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


class _Megatron:
    """Times Megatron-LM's tools/preprocess_data.py on one .jsonl (see the module's docstring)."""

    def __init__(self, args: argparse.Namespace, tokenizer_dir: Path, jsonl: str, work: Path) -> None:
        self.script = Path(args.megatron) / "tools" / "preprocess_data.py"
        self.python, self.workers, self.work = args.megatron_python, args.workers, work
        self.command = [self.python, str(self.script), "--input", jsonl, "--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", str(tokenizer_dir), "--workers", str(args.workers), "--append-eod",
                        "--json-keys", "text"]
        t0 = time.perf_counter()
        subprocess.run([self.python, str(self.script), "--help"], check=True, capture_output=True,
                       cwd=args.megatron)
        self.startup_s = round(time.perf_counter() - t0, 3)
        self.cwd = args.megatron

    def __call__(self) -> dict[str, float]:
        prefix = self.work / "megatron"
        c0, t0 = cpu_seconds(), time.perf_counter()
        subprocess.run(self.command + ["--output-prefix", str(prefix)], check=True, capture_output=True, cwd=self.cwd)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        data = Path(f"{prefix}_text_document.bin")
        tokens = data.stat().st_size // 2 if data.stat().st_size else 0  # uint16 for vocabularies < 65,500
        data.unlink()
        Path(f"{prefix}_text_document.idx").unlink()
        work_s = max(wall - self.startup_s, 1e-9)
        return {"tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                "tokens_per_s": round(tokens / work_s), "tokens_per_s_with_startup": round(tokens / wall)}


def _megatron(args: argparse.Namespace, tok: Any, jsonl: str, work: Path) -> _Megatron:
    """Megatron's script reads the tokenizer as a Hugging Face directory: save ours as one."""
    directory = work / "hf_tokenizer"
    tok.save(directory)
    return _Megatron(args, directory, jsonl, work)


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", default=[str(REPO / "corpora/austen/*.txt")], help="files or globs")
    ap.add_argument("--repeat", type=int, default=1, help="list every input file R times (dedup off)")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: train a BPE on the input)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="vocab of the BPE trained otherwise")
    ap.add_argument("--txt-documents", choices=["file", "paragraph"], default="paragraph")
    ap.add_argument("--format", default="auto", dest="fmt")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--workers", type=int, default=default_workers(), help="N for prepare_workers_N")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--megatron", help="a Megatron-LM checkout: time its tools/preprocess_data.py too")
    ap.add_argument("--megatron-python", default=sys.executable, help="the Python that runs Megatron's script")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    work = Path(tempfile.mkdtemp(prefix="prepare_speed."))
    try:
        files = [f.path for f in resolve_inputs(args.input, args.fmt)]
        inputs = files
        if args.repeat > 1:
            inputs = []
            for r in range(args.repeat):
                for i, f in enumerate(files):
                    link = work / "inputs" / f"{r:03d}-{i:04d}-{Path(f).name}"
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(f)
                    inputs.append(str(link))
        train_s = 0.0
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
        else:
            t0 = time.perf_counter()
            tok = train_bpe_tokenizer(files, args.vocab_size, work / "tokenizer", show_progress=False)
            train_s = time.perf_counter() - t0
        dedup = args.repeat == 1
        docs = list(
            read_documents(resolve_inputs(inputs, args.fmt), text_field=args.text_field,
                           txt_documents=args.txt_documents, stats=ReadStats())
        )
        fmt, text_field = args.fmt, args.text_field
        if args.megatron:  # one .jsonl for every side: the form Megatron's script reads
            inputs = [str(work / "documents.jsonl")]
            Path(inputs[0]).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
            fmt, text_field = "jsonl", "text"
        n_bytes = sum(os.path.getsize(f) for f in inputs)
        print(f"{len(inputs)} files, {n_bytes / 1e6:.1f} MB, {len(docs)} documents; "
              f"{args.rounds} rounds", file=sys.stderr)

        def prep(workers: int, r: int, cleaned: bool = False) -> Callable[[], int]:
            cleaning = {"quality": "default", "dedup": "near", "boilerplate_lines": 5} if cleaned else {"dedup": dedup}

            def run() -> int:
                out = work / f"out-{workers}-{r}-{cleaned}"
                m = prepare_corpus(inputs, tok, out, fmt=fmt, text_field=text_field,
                                   txt_documents=args.txt_documents, workers=workers, **cleaning)
                shutil.rmtree(out)
                return m["num_tokens"]
            return run

        megatron = _megatron(args, tok, inputs[0], work) if args.megatron else None

        rounds = []
        for r in range(args.rounds):
            row = {
                "raw_parallel": timed(lambda: raw_encode(tok, docs, True)),
                "raw_one_thread": timed(lambda: raw_encode(tok, docs, False)),
                "prepare_workers_1": timed(prep(1, r)),
                "prepare_workers_N": timed(prep(args.workers, r)),
                "prepare_cleaned_N": timed(prep(args.workers, r, cleaned=True)),
            }
            if megatron is not None:
                row["megatron_N"] = megatron()
            print(json.dumps({k: v["tokens_per_s"] for k, v in row.items()}), file=sys.stderr)
            rounds.append(row)
        best = {k: max(row[k]["tokens_per_s"] for row in rounds) for k in rounds[0]}
        median = {k: round(statistics.median(row[k]["tokens_per_s"] for row in rounds)) for k in rounds[0]}
        result = {
            "bench": "prepare_speed",
            "input": args.input,
            "repeat": args.repeat,
            "files": len(inputs),
            "bytes": n_bytes,
            "documents": len(docs),
            "txt_documents": args.txt_documents,
            "dedup": dedup,
            "tokenizer": args.tokenizer
            or f"byte-level BPE, vocab {tok.vocab_size}, trained in {train_s:.1f} s",
            "tokens_prepared": rounds[0]["prepare_workers_1"]["tokens"],
            "tokens_raw": rounds[0]["raw_parallel"]["tokens"],
            "cores": os.cpu_count(),
            "workers_N": args.workers,
            "loadavg_1min_end": round(os.getloadavg()[0], 2),
            "tokens_per_s_best": best,
            "tokens_per_s_median": median,
            "prepare_N_over_raw_parallel": round(best["prepare_workers_N"] / best["raw_parallel"], 3),
            "prepare_1_over_raw_one_thread": round(best["prepare_workers_1"] / best["raw_one_thread"], 3),
            "cleaned_over_prepare_N": round(best["prepare_cleaned_N"] / best["prepare_workers_N"], 3),
            **({"prepare_N_over_megatron_N": round(best["prepare_workers_N"] / best["megatron_N"], 3),
                "megatron_startup_s": megatron.startup_s} if megatron is not None else {}),
            "rounds": rounds,
        }
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
