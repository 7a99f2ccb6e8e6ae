#!/usr/bin/env python
"""Preference tuning's cost next to supervised fine-tuning on the bench model: peak memory and tokens/s.

    python bench/preference_cost.py [bench/bench_llama.yaml] [--steps N] [--rounds R] [--lora]

Both sides train on the same rows: synthetic chat pairs whose prompt and answers fill seq_length, as
`[INST] prompt [/INST] answer` rows with the loss on the answer. SFT trains on the chosen rows alone,
micro_batch_size rows a micro-batch; DPO (`data.kind: preference`) on the pairs, micro_batch_size / 2
pairs a micro-batch: the same rows and tokens a step. With --lora both train LoRA adapters (r 16 on every
linear of the blocks) and DPO's reference is the base with adapters off (one more forward, no gradient);
without it every weight trains and the reference's log-probabilities are computed before the first step
(not timed: a forward over the data, once). A third side, `dpo_whole`, is DPO with optimize.chunked_loss
false: each row's log-probability from the whole [rows, seq, vocab] logits instead of chunk by chunk,
what the chunked per-row loss saves and costs.

Memory: the peak of live tensor storages over two steps (`train.probe.measure_training`; exact on CPU).
Speed: tokens/s of the steps after the first (`metrics.jsonl`), the two sides interleaved round by round
in this process, as ratios (the machine is shared: compare only the ratio). One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.data import train_bpe_tokenizer  # noqa: E402
from shardwise.resolve import load_run_config, resolve_config  # noqa: E402
from shardwise.train.probe import measure_training  # noqa: E402
from shardwise.train.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORDS = [w.strip(".,;:!?\"'").lower() for w in (REPO / "corpora/austen/emma.txt").read_text().split()[:20000]]


def _sentence(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(WORDS) - words)
    return " ".join(WORDS[start:start + words])


def write_data(root: Path, pairs: int, seq: int) -> dict[str, Any]:
    """Pairs whose rows fill `seq` tokens; the SFT file holds the chosen conversations."""
    rng = random.Random(0)
    train_bpe_tokenizer([str(REPO / "corpora/austen/emma.txt")], 8192, root / "tok", show_progress=False)
    # a prompt of seq / 2 words and answers of seq / 3 overflow seq tokens: every row is cut to seq
    records = [{"prompt": _sentence(rng, seq // 2), "chosen": _sentence(rng, seq // 3),
                "rejected": _sentence(rng, seq // 3)} for _ in range(pairs)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}]}
             for r in records]
    (root / "sft.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    return {"tokenizer": str(root / "tok"), "pairs": str(root / "pairs.jsonl"), "sft": str(root / "sft.jsonl")}


def side_config(base: Any, side: str, files: dict[str, Any], out: Path, steps: int, lora: bool) -> Any:
    raw = base.model_dump(mode="json")
    seq, rows = raw["data"]["seq_length"], raw["train"]["micro_batch_size"]
    common = {"tokenizer": files["tokenizer"], "template": "default", "seq_length": seq, "pad_to_multiple_of": seq}
    if side == "sft":
        raw["data"] = {**common, "kind": "instruction", "train_files": [files["sft"]], "packing": "pad"}
    else:
        raw["data"] = {**common, "kind": "preference", "train_files": [files["pairs"]]}
        raw["train"]["micro_batch_size"] = rows // 2
        raw["optimize"]["chunked_loss"] = side == "dpo"
    raw["train"].update(output_dir=str(out), max_steps=steps, log_steps=1, save_steps=None, eval_steps=None,
                        progress_bar=False, tensorboard=False, loggers=[])
    if lora:
        raw["lora"] = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
    return resolve_config(raw)


def tokens_per_s(run_dir: Path) -> float:
    rates = [r["tokens_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_s" in r][1:]  # the first step compiles caches, allocates
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(REPO / "bench/bench_llama.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args(argv)
    base = load_run_config(args.config)
    with tempfile.TemporaryDirectory(prefix="preference_cost.") as tmp:
        root = Path(tmp)
        files = write_data(root, 4 * base.train.micro_batch_size * (args.steps + 2), base.data.seq_length)
        result: dict[str, Any] = {"bench": "preference_cost", "config": args.config, "lora": args.lora,
                                  "seq_length": base.data.seq_length, "rows_per_step": base.train.micro_batch_size}
        sides = ("sft", "dpo", "dpo_whole")
        for side in sides:
            cfg = side_config(base, side, files, root / f"probe_{side}", 2, args.lora)
            result[f"{side}_peak_bytes"] = measure_training(cfg, None).as_dict()["peak"]
        rates: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                out = root / f"{side}_{r}"
                Trainer(side_config(base, side, files, out, args.steps, args.lora)).train()
                rates[side].append(tokens_per_s(out))
                print(f"round {r} {side}: {rates[side][-1]:,.0f} tokens/s", file=sys.stderr)
        result.update({f"{side}_tokens_per_s": [round(x) for x in v] for side, v in rates.items()})
        for side in sides[1:]:
            speed = statistics.median(rates[side]) / statistics.median(rates["sft"])
            result[f"{side}_over_sft_speed"] = round(speed, 3)
            result[f"{side}_over_sft_memory"] = round(result[f"{side}_peak_bytes"] / result["sft_peak_bytes"], 3)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
