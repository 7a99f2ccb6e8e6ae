"""Batched text generation with a KV cache: greedy, temperature, top-k and top-p sampling. Loading a
model to generate from (a checkpoint, a Hugging Face directory, an adapter) is `shardwise.inference`'s."""

from __future__ import annotations

from typing import Callable, Collection, Optional, Sequence, Union

import torch

from ..errors import CheckpointError, ConfigError
from .transformer import KVCache, Transformer

# The value given to `on_token` for a row that has already finished.
FINISHED = -1


def _as_lists(prompt_ids: Union[Sequence[Sequence[int]], torch.Tensor]) -> list[list[int]]:
    """Prompts as a list of token lists; a 1-D tensor or list is one prompt."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids.unsqueeze(0)
        if prompt_ids.dim() != 2:
            raise ConfigError(f"prompt_ids must be [batch, length], got shape {tuple(prompt_ids.shape)}")
        return prompt_ids.tolist()
    prompts = list(prompt_ids)
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]
    return [list(p) for p in prompts]


def _check_args(
    prompts: list[list[int]],
    vocab_size: int,
    max_new_tokens: int,
    temperature: float,
    top_k: Optional[int],
    top_p: Optional[float],
) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token (start with the tokenizer's bos token)")
    bad = [t for p in prompts for t in p if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(
            f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
            "use the tokenizer the model was trained with"
        )
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0 <= temperature < float("inf"):  # NaN too
        raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1] or None, got {top_p}")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Pick one token per row from logits [B, vocab]: argmax at temperature 0, else filtered sampling.
    Logits that are NaN or infinite (weights that hold them, or a 16-bit overflow) fail with a
    CheckpointError rather than a token picked from garbage (or torch.multinomial's error)."""
    if not bool(torch.isfinite(logits).all()):
        raise CheckpointError(
            "the model computed NaN or infinite logits, so no token can be picked: its weights hold NaN or "
            "infinite values, or a 16-bit dtype overflowed (try --dtype fp32)")
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if not bool(torch.isfinite(scaled).all()):  # a temperature so small it overflows float32: its limit, greedy
        return logits.argmax(dim=-1)
    logits = scaled
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already hold top_p of the mass; the first always stays.
        drop = probs.cumsum(dim=-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def generate(
    model: Transformer,
    prompt_ids: Union[Sequence[Sequence[int]], torch.Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_id: Union[int, Collection[int], None] = None,
    on_token: Optional[Callable[[list[int]], None]] = None,
    generator: Optional[torch.Generator] = None,
) -> list[list[int]]:
    """Continue each prompt; returns the new tokens per row (ending with the stop token, if one came).

    Prompts of different lengths are left-padded and batched, with a mask and per-row positions so each
    row computes what it would alone. Generation stops at `eos_id` (per row; one id or several, e.g. eos
    and a chat template's end-of-turn token), after `max_new_tokens`, or when the longest prompt
    reaches `max_position_embeddings`. `on_token` is called once per step
    with one token per row (`FINISHED`, -1, for rows already done). top_k/top_p apply only when
    temperature > 0. The model runs in eval mode under inference_mode; its mode is restored after.
    """
    cfg = model.cfg
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    prompts = _as_lists(prompt_ids)
    _check_args(prompts, cfg.vocab_size, max_new_tokens, temperature, top_k, top_p)
    batch, longest = len(prompts), max(len(p) for p in prompts)
    if longest >= cfg.max_position_embeddings:
        raise ConfigError(
            f"a prompt has {longest} tokens but the model allows {cfg.max_position_embeddings} positions; "
            "shorten the prompt so there is room to generate"
        )
    steps = min(max_new_tokens, cfg.max_position_embeddings - longest)
    out: list[list[int]] = [[] for _ in prompts]
    if steps == 0:
        return out

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            total = longest + steps
            tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
            key_valid = torch.zeros(batch, total, dtype=torch.bool, device=device)
            for row, prompt in enumerate(prompts):
                tokens[row, longest - len(prompt):] = torch.tensor(prompt, device=device)
                key_valid[row, longest - len(prompt):longest] = True
            positions = (key_valid[:, :longest].long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
            mask = causal & key_valid[:, None, :longest]
            # Padding queries may see themselves: with no allowed key some SDPA backends return NaN,
            # which would then leak into real rows through the (zero-weighted) padded values.
            mask |= torch.eye(longest, dtype=torch.bool, device=device)
            cache = KVCache.for_model(model, batch_size=batch, max_len=total)
            logits = model(tokens, position_ids=positions, attention_mask=mask[:, None], kv_cache=cache)[:, -1]

            next_pos = torch.tensor([len(p) for p in prompts], device=device)
            done = [False] * batch
            for step in range(steps):
                new = sample_next(logits, temperature, top_k, top_p, generator)
                emitted = []
                for row, tok in enumerate(new.tolist()):
                    if done[row]:
                        emitted.append(FINISHED)
                        continue
                    out[row].append(tok)
                    emitted.append(tok)
                    done[row] = tok in stop
                if on_token is not None:
                    on_token(emitted)
                if all(done) or step == steps - 1:
                    break
                key_valid[:, longest + step] = True
                mask = key_valid[:, None, None, : longest + step + 1]
                logits = model(
                    new[:, None], position_ids=next_pos[:, None], attention_mask=mask, kv_cache=cache
                )[:, -1]
                next_pos += 1
    finally:
        model.train(was_training)
    return out
