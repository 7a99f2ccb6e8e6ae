"""The `shardwise` command: parses arguments, calls the library, prints user mistakes without a traceback."""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import ConfigError, ShardwiseError

log = logging.getLogger("shardwise")

DESCRIPTION = ("shardwise: pre-train and fine-tune large language models under compute and memory limits. "
               "A run is one YAML file (the seed documents' train_config.yaml and llm_pretrain.yaml shapes "
               "are accepted).")
EPILOG = """examples:
  shardwise train configs/demo.yaml                          train as the config describes
  shardwise train configs/seed_train_config.yaml --dry-run   size, layout, tokens and FLOPs per step
  shardwise train cfg.yaml --set train.lr=1e-4               override a key of the config
  shardwise train cfg.yaml --nproc 4                         one process per device (data/tensor parallel)
  shardwise generate runs/demo --prompt "It is" --max-new-tokens 50
  shardwise tokenizer train --input 'corpus/*.txt' --vocab-size 32000 --out tok/
  shardwise prepare --input 'corpus/*.jsonl' --tokenizer tok/ --out data/prepared

`shardwise COMMAND --help` describes each command's options."""


class _TqdmHandler(logging.Handler):
    """Writes log lines through tqdm so they do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(verbose: bool = False) -> None:
    """Console logging for the CLI (library code only logs)."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger("shardwise")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _cmd_train(args: argparse.Namespace) -> int:
    from .config import load_config

    cfg = load_config(args.config, args.set)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: give a device count of at least 1")
    if args.dry_run:
        from .train.dry_run import describe_run

        print(describe_run(cfg, args.nproc))
        return 0
    from .parallel.launch import LAUNCH_FLAGS, check_local_devices, launch_env, launch_processes, strip_launch_args

    env = launch_env()
    given = [f for f in LAUNCH_FLAGS if any(a == f or a.startswith(f + "=") for a in args.argv)]
    if env is not None and env.world_size > 1:  # started by torchrun / mpirun: this process is one rank
        if given:
            raise ConfigError(f"started by {env.launcher} (rank {env.rank} of {env.world_size}): the launcher "
                              f"already started the processes; drop {', '.join(given)}")
    elif (args.nproc or 1) > 1 or args.nnodes not in ("1", "1:1") or args.max_restarts:
        from .train.trainer import layout_for

        check_local_devices(cfg.run.device, args.nproc or 1)
        if args.nnodes in ("1", "1:1"):
            layout_for(cfg, args.nproc or 1)  # a wrong layout fails before any process starts
        return launch_processes(strip_launch_args(args.argv), args.nproc or 1, nnodes=args.nnodes,
                                node_rank=args.node_rank, master_addr=args.master_addr,
                                master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint,
                                max_restarts=args.max_restarts)
    from .train.trainer import Trainer

    result = Trainer(cfg).train(resume=args.resume, overwrite=args.overwrite)
    if env is not None and env.rank != 0:
        return 0  # rank 0 reports the run
    if not result.losses:  # resumed at the last step
        from .train.checkpoint import resolve_resume

        checkpoint = result.last_checkpoint or resolve_resume(args.resume or "auto", result.run_dir)
        print(f"already finished at step {result.step} (nothing to train)"
              + (f"; checkpoint {checkpoint}" if checkpoint else ""))
        return 0
    summary = f"done: {result.step} steps, final loss {result.losses[result.step]:.4f}"
    if result.eval:
        summary += f", eval loss {result.eval['loss']:.4f} (perplexity {result.eval['perplexity']:.2f})"
    if result.last_checkpoint:
        summary += f"; checkpoint {result.last_checkpoint}"
    print(summary)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .data.tokenizer import load_tokenizer
    from .models import generate
    from .parallel.launch import resolve_device
    from .train.checkpoint import find_checkpoint, load_model

    path = find_checkpoint(args.checkpoint)
    tokenizer_dir = args.tokenizer or path / "tokenizer"
    if args.tokenizer is None and not tokenizer_dir.is_dir():
        raise ConfigError(
            f"checkpoint {path} holds no tokenizer/ (the run was given none); pass the tokenizer "
            "directory it was trained with: --tokenizer DIR"
        )
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    torch.manual_seed(args.seed)
    model, _ = load_model(path, device=resolve_device(args.device))
    tokenizer = load_tokenizer(str(tokenizer_dir))
    # Pre-training separates documents with EOS and never feeds BOS: the model learned that a new
    # document starts after EOS, so each prompt is prefixed with EOS.
    prompts = [[tokenizer.eos_id, *tokenizer.encode(p)] for p in args.prompt]
    stream = not args.no_stream and len(prompts) == 1
    if stream:
        print(args.prompt[0], end="", flush=True)
        generated: list[int] = []

        def on_token(tokens: list[int]) -> None:
            if tokens[0] < 0:  # the row has finished
                return
            before = tokenizer.decode(generated)
            generated.append(tokens[0])
            print(tokenizer.decode(generated)[len(before):], end="", flush=True)
    else:
        on_token = None
    outputs = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, eos_id=tokenizer.eos_id, on_token=on_token)
    if stream:
        print()
    else:
        for prompt, out in zip(args.prompt, outputs):
            print(prompt + tokenizer.decode(out))
            print("---")
    return 0


def _cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from .data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.input, args.vocab_size, args.out, min_frequency=args.min_frequency,
                          special_tokens=args.special_tokens, text_field=args.text_field,
                          skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite)
    print(f"saved {tok.vocab_size}-token tokenizer to {args.out} (bos {tok.bos_token!r}, eos "
          f"{tok.eos_token!r}, pad {tok.pad_token!r}, fingerprint {tok.fingerprint})")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .data.prepare import prepare_corpus
    from .data.tokenizer import load_tokenizer

    manifest = prepare_corpus(
        args.input, load_tokenizer(args.tokenizer), args.out, fmt=args.format, text_field=args.text_field,
        txt_documents=args.txt_documents, min_chars=args.min_chars, max_length=args.max_length,
        dedup=args.dedup, workers=args.workers, shard_tokens=args.shard_tokens, on_bad_line=args.on_bad_line,
        overwrite=args.overwrite)
    counts = manifest["counts"]
    print(f"prepared {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in "
          f"{len(manifest['shards'])} shard(s) at {args.out} (dropped: {counts['dropped_short']:,} short, "
          f"{counts['duplicates']:,} duplicates; {counts['truncated']:,} truncated, {counts['bad_lines']:,} "
          f"bad lines skipped)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Argument parser for every sub-command."""
    parser = argparse.ArgumentParser(prog="shardwise", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="pre-train or fine-tune as a YAML config describes", allow_abbrev=False,
                       description="Train as CONFIG describes. Seed-document YAML shapes are accepted. "
                                   "With --nproc N (or under torchrun / mpirun) one process per device.")
    t.add_argument("config", help="YAML run config")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-4 (repeatable)")
    t.add_argument("--resume", metavar="auto|PATH", help="continue from the newest (auto) or a given checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="replace a previous run in train.output_dir; with --resume, allow replacing "
                        "checkpoints newer than the one resumed from")
    t.add_argument("--dry-run", action="store_true",
                   help="validate and print model, layout, tokens and FLOPs per step; touch no device or data")
    launch = t.add_argument_group("launch (several processes)")
    launch.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="processes on this machine, one per GPU/NPU (or a share of the CPU); >1 starts "
                             "them through torchrun; with --dry-run: devices to plan for")
    launch.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="machines taking part (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, metavar="K",
                        help="this machine's number 0..nnodes-1 (with --master-addr/--master-port)")
    launch.add_argument("--master-addr", default="127.0.0.1", metavar="HOST", help="host of node 0")
    launch.add_argument("--master-port", type=int, default=None, metavar="PORT",
                        help="free port on --master-addr (default: any free port on one machine)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="c10d rendezvous instead of --master-addr/--master-port/--node-rank")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the group up to K times after a failure, resuming from the newest "
                             "checkpoint")
    t.set_defaults(func=_cmd_train)

    g = sub.add_parser("generate", help="generate text from a checkpoint",
                       description="Generate text with a KV cache from a checkpoint or run directory.")
    g.add_argument("checkpoint", help="checkpoint directory (step_*) or run directory (newest checkpoint)")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat to batch); it is prefixed with EOS, as a new document starts "
                        "after EOS in pre-training")
    g.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer directory (default: the one saved in the checkpoint)")
    g.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate per prompt (default 100)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this mass")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"],
                   help="where to run (auto: CUDA when present, else CPU)")
    g.add_argument("--no-stream", action="store_true", help="print when done instead of token by token")
    g.set_defaults(func=_cmd_generate)

    tk = sub.add_parser("tokenizer", help="train a tokenizer",
                        description="Tokenizer tools.").add_subparsers(dest="tokenizer_command", required=True)
    tt = tk.add_parser("train", help="train a byte-level BPE tokenizer on .txt or .jsonl files",
                       description="Train a byte-level BPE tokenizer and save it as a Hugging Face "
                                   "tokenizer directory (tokenizer.json + configs).")
    tt.add_argument("--input", nargs="+", required=True, metavar="GLOB",
                    help="files or quoted globs; .txt: lines of text, .jsonl: the --text-field of each line")
    tt.add_argument("--vocab-size", type=int, required=True, metavar="N")
    tt.add_argument("--out", required=True, metavar="DIR")
    tt.add_argument("--min-frequency", type=int, default=2, metavar="K",
                    help="merge only pairs seen at least K times (default 2)")
    tt.add_argument("--special-tokens", nargs="+", default=["<|bos|>", "<|eos|>", "<|pad|>"], metavar="TOKEN",
                    help="bos eos [pad] (ids 0, 1, 2); without pad, pad is eos")
    tt.add_argument("--text-field", default="text", help="field holding the text in .jsonl lines")
    tt.add_argument("--skip-bad-lines", action="store_true",
                    help="skip (and count) .jsonl lines that are not JSON or lack the field")
    tt.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --out")
    tt.set_defaults(func=_cmd_tokenizer_train)

    pr = sub.add_parser("prepare", help="clean and tokenise raw text into memory-mapped token shards",
                        description="Clean (repair UTF-8, drop exact duplicates and short documents), "
                                    "tokenise with worker processes, and write token shards with a "
                                    "document index and manifest.json. Point data.train_files at OUT "
                                    "to train on it.")
    pr.add_argument("--input", nargs="+", required=True, metavar="GLOB",
                    help=".txt, .jsonl (also .gz) or .parquet files, or quoted globs")
    pr.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory or SentencePiece .model")
    pr.add_argument("--out", required=True, metavar="DIR", help="output directory (must not hold other data)")
    pr.add_argument("--format", choices=["auto", "txt", "jsonl", "parquet"], default="auto",
                    help="input format (default: by file extension)")
    pr.add_argument("--text-field", default="text", help="field/column holding the text (.jsonl, .parquet)")
    pr.add_argument("--txt-documents", choices=["file", "paragraph"], default="file",
                    help=".txt: one document per file (default), or documents separated by blank lines")
    pr.add_argument("--min-chars", type=int, default=1, metavar="N",
                    help="drop documents with fewer characters, surrounding whitespace not counted (default 1)")
    pr.add_argument("--max-length", type=int, default=None, metavar="N",
                    help="truncate each document to N tokens (default: keep whole documents)")
    pr.add_argument("--no-dedup", dest="dedup", action="store_false", help="keep exact duplicate documents")
    pr.add_argument("--workers", type=int, default=None, metavar="N",
                    help="tokenising processes (default: the cores, at most 8)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                    help="tokens per shard file (default 100,000,000)")
    pr.add_argument("--on-bad-line", choices=["stop", "skip"], default="stop",
                    help="a .jsonl line that is not JSON or lacks the field: stop (default) or skip and count")
    pr.add_argument("--overwrite", action="store_true", help="replace a prepared directory already at --out")
    pr.set_defaults(func=_cmd_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `shardwise` command."""
    args = build_parser().parse_args(argv)
    # The raw arguments (with a global -v) are what `--nproc` hands to every rank.
    args.argv = list(argv if argv is not None else sys.argv[1:])
    setup_logging(args.verbose)
    from .parallel.launch import record_failure

    try:
        return args.func(args)
    except ShardwiseError as e:
        record_failure(e)  # under a launcher, its summary then names this error
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        record_failure(e)
        raise
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
