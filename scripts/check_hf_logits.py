"""Hold shardwise's import of Hugging Face directories to transformers on their own weights.

    python scripts/check_hf_logits.py /models/Qwen3-30B-A3B /models/DeepSeek-V3-tiny ... [--tokens 64] [--new 16]

For each directory: the logits of one random batch from shardwise (`models.hf.from_hf`) and from transformers
(`AutoModelForCausalLM`, eager attention), both fp32 on the CPU, their largest difference against the 1e-4
bar of tests/models/test_hf.py, and whether greedy decoding of `--new` tokens agrees token for token. The
tests check every family on random weights; this is the same check for published (real) weights, which
this project's machines cannot download: run it where the models are. The exit status is 1 when any
directory misses the bar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

from shardwise.models.generate import generate
from shardwise.models.hf import from_hf

BAR = 1e-4


def check(directory: Path, tokens: int = 64, new: int = 16, seed: int = 0) -> dict:
    """Logits and greedy tokens of shardwise and transformers for one directory (see the module docstring)."""
    ours = from_hf(directory).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    vocab = min(ours.cfg.vocab_size, theirs.config.vocab_size)
    batch = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (ours(batch) - theirs(input_ids=batch).logits).abs().max().item()
        prompt = batch[:1, : tokens // 2]
        mine = generate(ours, prompt, max_new_tokens=new)[0]
        reference = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                    min_new_tokens=new, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    return {"directory": str(directory), "max_logit_diff": diff, "within_bar": diff <= BAR,
            "greedy_equal": mine == reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="Hugging Face model directories")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence of the batch (default 64)")
    parser.add_argument("--new", type=int, default=16, help="tokens to decode greedily (default 16)")
    args = parser.parse_args(argv)
    failed = False
    for directory in args.directories:
        r = check(directory, args.tokens, args.new)
        failed |= not (r["within_bar"] and r["greedy_equal"])
        print(f"{r['directory']}: largest logit difference {r['max_logit_diff']:.2e} "
              f"({'within' if r['within_bar'] else 'ABOVE'} {BAR:g}); greedy decoding "
              f"{'the same' if r['greedy_equal'] else 'DIFFERS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
