"""The `shardwise` command: parses arguments, calls the library, prints user mistakes without a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint.storage import resolve_resume
from .data.build import check_data_files
from .data.prepare import prepare_corpus
from .data.prepare_parts import merge_parts, parse_part, part_path, prepare_part
from .data.tokenizer import load_tokenizer, train_tokenizer
from .errors import ConfigError, DataError, ShardwiseError
from .export import convert_checkpoint
from .inference import load_for_generation
from .models import generate
from .parallel.dims import layout_for
from .parallel.launch import (
    LAUNCH_FLAGS,
    check_local_devices,
    launch_env,
    launch_processes,
    record_failure,
    resolve_device,
    strip_launch_args,
)
from .plan.command import DESCRIPTION as PLAN_DESCRIPTION
from .plan.command import EPILOG as PLAN_EPILOG
from .plan.command import add_plan_arguments, run_plan
from .plan.estimate_command import add_estimate_arguments, describe_memory, device_kind, run_estimate
from .report import write_report
from .resolve import load_run_config
from .train.dry_run import describe_run
from .train.trainer import Trainer

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
  shardwise convert runs/demo --to hf hf_model/                a checkpoint as a Hugging Face model directory
  shardwise estimate cfg.yaml                                memory per device, by phase, before a run
  shardwise plan --model llama_7b --devices 8 --hardware H100   the fastest layouts that fit
  shardwise report runs/demo                                 plots of a run in runs/demo/report/report.html

`shardwise COMMAND --help` describes each command's options."""


class _TqdmHandler(logging.Handler):
    """Writes log lines through tqdm so they do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
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
    cfg = load_run_config(args.config, args.set)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: give a device count of at least 1")
    if args.dry_run:
        print(describe_run(cfg, args.nproc))
        print(describe_memory(cfg, args.nproc or cfg.parallel.world_size(), device_kind(cfg, None)))
        return 0
    env = launch_env()
    given = [f for f in LAUNCH_FLAGS if any(a == f or a.startswith(f + "=") for a in args.argv)]
    if env is not None and env.world_size > 1:  # started by torchrun / mpirun: this process is one rank
        if given:
            raise ConfigError(f"started by {env.launcher} (rank {env.rank} of {env.world_size}): the launcher "
                              f"already started the processes; drop {', '.join(given)}")
    elif (args.nproc or 1) > 1 or args.nnodes not in ("1", "1:1") or args.max_restarts:
        check_local_devices(cfg.run.device, args.nproc or 1)
        if args.nnodes in ("1", "1:1"):
            layout_for(cfg, args.nproc or 1)  # a wrong layout fails before any process starts
        return launch_processes(strip_launch_args(args.argv), args.nproc or 1, nnodes=args.nnodes,
                                node_rank=args.node_rank, master_addr=args.master_addr,
                                master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint,
                                max_restarts=args.max_restarts, join_timeout_s=args.rdzv_timeout,
                                local_addr=args.local_addr)
    if args.overwrite:
        # The run replaces the previous one only once training starts; inputs that cannot be read
        # fail now, before anything of the previous run is removed.
        check_data_files(cfg.data)
    result = Trainer(cfg).train(resume=args.resume, overwrite=args.overwrite)
    if env is not None and env.rank != 0:
        return 0  # rank 0 reports the run
    if result.stopped_by:  # preempted: the checkpoint is saved, and a stop asked for is a success
        print(f"stopped by {result.stopped_by} after step {result.step}; checkpoint {result.last_checkpoint}; "
              "continue with --resume auto")
        return 0
    if not result.losses:  # resumed at the last step
        checkpoint = result.last_checkpoint or resolve_resume(args.resume or "auto", result.run_dir)
        print(f"already finished at step {result.step} (nothing to train)"
              + (f"; checkpoint {checkpoint}" if checkpoint else ""))
        return 0
    summary = f"done: {result.step} steps, final loss {result.losses[result.step]:.4f}"
    if result.eval:
        summary += f", eval loss {result.eval['loss']:.4f}" + (
            f" (reward accuracy {result.eval['reward_accuracy']:.3f})" if "reward_accuracy" in result.eval
            else f" (perplexity {result.eval['perplexity']:.2f})")
    if result.last_checkpoint:
        summary += f"; checkpoint {result.last_checkpoint}"
    print(summary)
    return 0


def _cmd_estimate(args: argparse.Namespace) -> int:
    return run_estimate(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    torch.manual_seed(args.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    loaded = load_for_generation(args.source, tokenizer=args.tokenizer, adapter=args.adapter,
                                 device=resolve_device(args.device), dtype=dtype, verify=args.verify)
    template = loaded.chat_template(args.chat)
    if template is None and args.system is not None:
        raise ConfigError(f"--system needs a chat template, and {args.source} is used as a plain text model "
                          f"({'--no-chat' if args.chat is False else 'not instruction-tuned'}); add --chat")
    if template is not None:
        why = loaded.tuned_because if loaded.tuned_template is not None else "--chat"
        names = {"tokenizer": "the tokenizer's chat template", "default": "the [INST] template",
                 "auto": "the tokenizer's chat template (else the [INST] template)"}
        what = names[template] if isinstance(template, str) else "the run's template dict"
        log.info("chat: prompts are user turns in %s (%s); --no-chat continues the text instead", what, why)
    tokenizer = loaded.tokenizer
    prompts = loaded.prompt_ids(args.prompt, template, args.system)
    chat = template is not None

    def answer(ids: list[int]) -> str:
        text = tokenizer.decode(ids)
        # A chat answer starts after the template's separator (often a space the model writes itself).
        return text.lstrip() if chat else text

    stream = not args.no_stream and len(prompts) == 1
    generated: list[int] = []
    shown = [""]  # the streamed text printed so far

    def show(tokens: list[int]) -> None:
        if tokens[0] < 0:  # the row has finished
            return
        generated.append(tokens[0])
        text = answer(generated)
        if not text.endswith("\ufffd"):  # wait for the rest of a character split across tokens
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    if stream:
        print("" if chat else args.prompt[0], end="", flush=True)
    outputs = generate(loaded.model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, eos_id=loaded.stop_ids_for(template),
                       on_token=show if stream else None)
    if stream:
        print(answer(outputs[0])[len(shown[0]):])
        return 0
    for prompt, out in zip(args.prompt, outputs):
        print(f"> {prompt}\n{answer(out)}" if chat else prompt + answer(out))
        print("---")
    return 0


def _cmd_tokenizer_train(args: argparse.Namespace) -> int:
    tok = train_tokenizer(args.input, args.vocab_size, args.out, min_frequency=args.min_frequency,
                          special_tokens=args.special_tokens, text_field=args.text_field,
                          skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite)
    print(f"saved {tok.vocab_size}-token tokenizer to {args.out} (bos {tok.bos_token!r}, eos "
          f"{tok.eos_token!r}, pad {tok.pad_token!r}, fingerprint {tok.fingerprint})")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    result = convert_checkpoint(args.checkpoint, args.out, to=args.to, merge_lora=args.merge_lora,
                                dtype=args.dtype, overwrite=args.overwrite, tokenizer=args.tokenizer,
                                verify=args.verify)
    print(result.summary())
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer)
    if args.merge:
        manifest = merge_parts(args.out, tokenizer, overwrite=args.overwrite)
    else:
        if not args.input:
            raise DataError("prepare needs --input (the files to prepare), or --merge to merge parts prepared before")
        near = {k: v for k, v in (("ngram", args.near_ngram), ("bands", args.near_bands), ("rows", args.near_rows))
                if v is not None}
        options = dict(fmt=args.format, text_field=args.text_field, txt_documents=args.txt_documents,
                       min_chars=args.min_chars, max_length=args.max_length, dedup=args.dedup, near_dedup=near or None,
                       workers=args.workers, shard_tokens=args.shard_tokens, on_bad_line=args.on_bad_line,
                       overwrite=args.overwrite, quality=args.quality, boilerplate_lines=args.boilerplate_lines)
        if args.part:
            manifest = prepare_part(args.input, tokenizer, args.out, args.part, **options)
            where = part_path(Path(os.path.abspath(args.out)), *parse_part(args.part))
            print(f"prepared part {args.part} into {where}: "
                  f"{manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens (duplicates across "
                  f"parts are dropped by the merge: shardwise prepare --merge --out {args.out} --tokenizer "
                  f"{args.tokenizer})")
            return 0
        manifest = prepare_corpus(args.input, tokenizer, args.out, **options)
    counts = manifest["counts"]
    removed = counts.get("removed_by_quality")
    by_rule = f", {sum(removed.values()):,} by quality rules ({', '.join(f'{k} {v:,}' for k, v in removed.items())})" \
        if removed else ""
    near = f", {counts['near_duplicates']:,} near duplicates" if "near_duplicates" in counts else ""
    print(f"prepared {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in "
          f"{len(manifest['shards'])} shard(s) at {args.out} (dropped: {counts['dropped_short']:,} short, "
          f"{counts['duplicates']:,} duplicates{near}{by_rule}; {counts['truncated']:,} truncated, "
          f"{counts['bad_lines']:,} bad lines skipped)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    return run_plan(args)


def _cmd_report(args: argparse.Namespace) -> int:
    print(f"report: {write_report(args.run_dirs, args.out)}")
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
                        help="c10d rendezvous instead of --master-addr/--master-port/--node-rank: the "
                             "first node's address and a free port on it, the same on every node")
    launch.add_argument("--rdzv-timeout", type=int, default=None, metavar="S",
                        help="seconds to wait for every node to join, also after a restart (default 600)")
    launch.add_argument("--local-addr", default=None, metavar="ADDR",
                        help="the address other nodes reach this one by (default: the one the route to "
                             "--rdzv-endpoint leaves from)")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the group up to K times after a failure, resuming from the newest "
                             "checkpoint")
    t.set_defaults(func=_cmd_train)

    g = sub.add_parser(
        "generate", help="generate text from a checkpoint or Hugging Face model (+ LoRA adapter)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text with a KV cache from a shardwise checkpoint or run directory, or a\n"
                    "Hugging Face model directory, optionally with a LoRA adapter. Several --prompt run as one\n"
                    "batch. Instruction-tuned models get the chat template (--chat/--no-chat override it): the\n"
                    "run's data.template for our instruction checkpoints and adapters, else the chat_template\n"
                    "of the tokenizer of a Hugging Face model or adapter.",
        epilog="examples:\n"
               "  shardwise generate runs/demo --prompt \"It is\" --max-new-tokens 50\n"
               "  shardwise generate models/Qwen2-0.5B-Instruct --prompt \"Hi!\" --system \"Be brief.\"\n"
               "  shardwise generate models/Llama-2-7b --adapter runs/lora/checkpoints/step_00001000/adapter "
               "--prompt \"Hi\"\n"
               "  shardwise generate runs/demo --prompt \"Once\" --prompt \"The sea\" --temperature 0.8 --top-p 0.9")
    g.add_argument("source", metavar="SOURCE",
                   help="shardwise checkpoint directory (step_*) or run directory (newest checkpoint), or a "
                        "Hugging Face model directory (config.json + *.safetensors)")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat to batch). With a chat template it is one user turn. Without, the "
                        "text is continued: for a shardwise checkpoint it is prefixed with EOS, as a new "
                        "document starts after EOS in pre-training; for a Hugging Face model with BOS when its "
                        "tokenizer adds one (as transformers does)")
    g.add_argument("--adapter", metavar="DIR", default=None,
                   help="LoRA adapter in peft format (saved by peft or shardwise: adapter_config.json + "
                        "adapter_model.safetensors; a LoRA run's checkpoint also works) to apply on SOURCE")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render each prompt with the chat template (default: when the model is "
                        "instruction-tuned); --no-chat continues plain text")
    g.add_argument("--system", metavar="TEXT", default=None, help="system message (with the chat template)")
    g.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer directory (default: the adapter's if it has one, else SOURCE's)")
    g.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate per prompt (default 100)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this mass")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"],
                   help="where to run (auto: CUDA when present, else CPU)")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="weight dtype (default fp32)")
    g.add_argument("--no-stream", action="store_true",
                   help="print when done instead of token by token (several prompts always print when done)")
    g.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check a shardwise checkpoint's files against its checksums.json (saves reading the "
                        "files once more; a flipped bit or a changed file then loads unnoticed)")
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

    es = sub.add_parser("estimate", help="memory per device for a config (or a preset and layout), by phase",
                        description="Predict the memory of each device: parameters, gradients, optimizer state, "
                                    "activations, buffers and the peak, per phase (forward, backward, optimizer "
                                    "step, checkpoint save). Nothing is allocated.")

    add_estimate_arguments(es)
    es.set_defaults(func=_cmd_estimate)

    cv = sub.add_parser("convert", help="write a checkpoint as a Hugging Face model or a peft adapter",
                        description="Convert a checkpoint (any parallel layout) to a Hugging Face model directory "
                                    "(config.json, safetensors, generation_config.json, tokenizer) or, for a "
                                    "LoRA run, a peft adapter. OUT is written completely or not at all.")
    cv.add_argument("checkpoint", help="checkpoint directory (step_*) or run directory (newest checkpoint)")
    cv.add_argument("out", metavar="OUT", help="output directory (replaced only with --overwrite)")
    cv.add_argument("--to", required=True, choices=["hf", "peft"],
                    help="hf: a transformers model directory (a LoRA run: the base model plus OUT/adapter, or "
                         "merged with --merge-lora); peft: the LoRA adapter only")
    cv.add_argument("--merge-lora", action="store_true",
                    help="fold the LoRA adapters into the weights and write one full model")
    cv.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                    help="dtype of the written weights (default fp32)")
    cv.add_argument("--tokenizer", metavar="DIR", default=None,
                    help="tokenizer directory to include (default: the one saved in the checkpoint)")
    cv.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    cv.add_argument("--no-verify", dest="verify", action="store_false",
                    help="do not check a shardwise checkpoint's files against its checksums.json (saves reading the "
                         "files once more; a flipped bit or a changed file then loads unnoticed)")
    cv.set_defaults(func=_cmd_convert)

    pr = sub.add_parser("prepare", help="clean and tokenise raw text into memory-mapped token shards",
                        description="Clean (repair UTF-8, drop exact duplicates and short documents), "
                                    "tokenise with worker processes, and write token shards with a "
                                    "document index and manifest.json. Point data.train_files at OUT "
                                    "to train on it.")
    pr.add_argument("--input", nargs="+", metavar="GLOB",
                    help=".txt, .jsonl (also .gz, .zst), .parquet or .arrow files, Hugging Face datasets saved to "
                         "disk (their directory), or quoted globs")
    pr.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory or SentencePiece .model")
    pr.add_argument("--out", required=True, metavar="DIR", help="output directory (must not hold other data)")
    pr.add_argument("--format", choices=["auto", "txt", "jsonl", "parquet", "arrow"], default="auto",
                    help="input format (default: by file extension)")
    pr.add_argument("--text-field", default="text", help="field/column holding the text (.jsonl, .parquet)")
    pr.add_argument("--txt-documents", choices=["file", "paragraph"], default="file",
                    help=".txt: one document per file (default), or documents separated by blank lines")
    pr.add_argument("--min-chars", type=int, default=1, metavar="N",
                    help="drop documents with fewer characters, surrounding whitespace not counted (default 1)")
    pr.add_argument("--max-length", type=int, default=None, metavar="N",
                    help="truncate each document to N tokens (default: keep whole documents)")
    pr.add_argument("--dedup", choices=["exact", "near", "none"], default="exact",
                    help="drop exact duplicate documents (default), also near duplicates (MinHash LSH over word "
                         "5-grams: Jaccard 0.9 found 99.96%% of the time, 0.8 92%%, 0.5 5%%), or keep them all")
    pr.add_argument("--no-dedup", dest="dedup", action="store_const", const="none", help="same as --dedup none")
    pr.add_argument("--near-ngram", type=int, default=None, metavar="N", help="--dedup near: words a shingle (5)")
    pr.add_argument("--near-bands", type=int, default=None, metavar="B", help="--dedup near: LSH bands (14)")
    pr.add_argument("--near-rows", type=int, default=None, metavar="R",
                    help="--dedup near: MinHash values a band (8); more rows or fewer bands raise the similarity "
                         "at which documents count as near duplicates (about (1/B)^(1/R))")
    pr.add_argument("--quality", choices=["none", "default"], default="none",
                    help="default: drop documents by Gopher/C4-style quality rules (counted by rule in the manifest, "
                         "samples in removed_samples.jsonl beside it)")
    pr.add_argument("--boilerplate-lines", type=int, default=0, metavar="N",
                    help="remove each line (20+ characters) that N earlier documents had: navigation, cookie "
                         "notices, footers (default 0: off; 5 removed no line of the bundled novels and classics)")
    pr.add_argument("--workers", type=int, default=None, metavar="N",
                    help="tokenising processes (default: the cores, at most 8)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                    help="tokens per shard file (default 100,000,000)")
    pr.add_argument("--on-bad-line", choices=["stop", "skip"], default="stop",
                    help="a .jsonl line that is not JSON or lacks the field: stop (default) or skip and count")
    pr.add_argument("--overwrite", action="store_true", help="replace a prepared directory already at --out")
    scale = pr.add_mutually_exclusive_group()
    scale.add_argument("--part", metavar="I/N", default=None,
                       help="prepare part I of N (counted from 0) into OUT.parts: run one per process or node, "
                            "each with the same inputs and options, then --merge")
    scale.add_argument("--merge", action="store_true",
                       help="merge the N parts in OUT.parts into OUT, duplicates decided over all of them")
    pr.set_defaults(func=_cmd_prepare)


    pl = sub.add_parser("plan", help="rank parallel layouts that fit memory by predicted speed (and profile them)",
                        description=PLAN_DESCRIPTION, epilog=PLAN_EPILOG, allow_abbrev=False,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(pl)
    pl.set_defaults(func=_cmd_plan)

    rp = sub.add_parser("report", help="one self-contained report.html of one or more runs, with plots",
                        description="Plot a run's metrics (loss against step and tokens, learning rate, gradient "
                                    "norm, loss scale, tokens/s, MFU, peak memory; restarts and skipped steps "
                                    "marked), its config and layout, memory estimate against the measured peak, "
                                    "data summary and profile, into OUT/report.html (images embedded) and the "
                                    "PNGs beside it. Several runs are overlaid, with their loss differences "
                                    "against the first. A run still in progress can be reported. Needs "
                                    "matplotlib: pip install 'shardwise[report]'.")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (train.output_dir)")
    rp.add_argument("--out", metavar="DIR", default=None, help="output directory (default: the first RUN_DIR/report)")
    rp.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `shardwise` command."""
    args = build_parser().parse_args(argv)
    # The raw arguments (with a global -v) are what `--nproc` hands to every rank.
    args.argv = list(argv if argv is not None else sys.argv[1:])
    setup_logging(args.verbose)

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
