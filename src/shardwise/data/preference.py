"""Preference data (DPO and its cousins): a prompt with a chosen and a rejected answer -> pairs of rows.

Records
-------
Each line of a `.jsonl` file (or element of a `.json` array) is one pair:

* the prompt: ``"prompt"`` text (one user message; an optional ``"system"`` text goes before it), or
  ``"messages"``: a conversation that ends with a user message (system first if any, then user and
  assistant alternating), rendered with the chat template as instruction data is;
* ``"chosen"`` and ``"rejected"``: each an answer as text, as one ``{"role": "assistant", "content"}``
  message, or as a list holding that one message.

A record that is not JSON, lacks a field, has two identical answers (nothing to prefer) or breaks the
conversation rules is reported by file and line: `on_bad_line="stop"` raises DataError naming them,
`"skip"` leaves it out and counts it.

Rows
----
Each answer is rendered after the prompt with the template (chat.py); only the answer's tokens carry a
label (the last trained run of the rendering: the final assistant turn and its end token), so a prompt
that holds earlier assistant turns trains none of them. A pair longer than `max_seq_len` is cut prompt
first: the prompt keeps its last tokens, at least half of `max_seq_len` when it has them, and the answers
are then cut at their end (both counted). A pair whose answer is left without a target is dropped
(counted). A batch of B pairs is 2B rows, the chosen answer of pair i in row 2i and the rejected one in row
2i + 1, padded to the batch's longest row rounded up to `pad_to_multiple_of` (at most `max_seq_len`); the
loader keeps a pair's two rows in one micro-batch because its items are pairs. With reference
log-probabilities set (`set_reference`), batches carry them as `reference_logps` [2B].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from ..loss import IGNORE_INDEX
from .chat import BadRecord, Message, encode_pieces, parse_messages, resolve_template
from .files import expand_files
from .instruction import BAD_LINE_MODES, BadLines, file_objects, inspect_instruction_file
from .shards import token_dtype
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_RECORDS_PER_CHUNK = 512


# --- records --------------------------------------------------------------------------------------


def _prompt(obj: Mapping[str, Any]) -> list[Message]:
    if "messages" in obj:
        raw = obj["messages"]
        if not isinstance(raw, list) or not raw or not isinstance(raw[-1], dict) or raw[-1].get("role") != "user":
            raise BadRecord("'messages' (the prompt) must be a conversation that ends with a user message")
        # parse_messages checks roles, contents and turn order; a last user turn comes back as "unanswered"
        messages, unanswered = parse_messages(raw + [{"role": "assistant", "content": ""}])
        assert not unanswered
        return messages[:-1]
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        what = "missing" if prompt is None else f"a {type(prompt).__name__}" if not isinstance(prompt, str) else "empty"
        raise BadRecord(f"'prompt' is {what}: give the prompt as text, or as 'messages' ending with a user message")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRecord(f"'system' is a {type(system).__name__}, not text")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _answer(obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if value.get("role") != "assistant" or not isinstance(value.get("content"), str):
            raise BadRecord(f"'{key}' must be an assistant message {{\"role\": \"assistant\", \"content\": text}}")
        value = value["content"]
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}"
        raise BadRecord(f"'{key}' is {what}: give the answer as text or as one assistant message")
    return value


def parse_preference(obj: Any) -> tuple[list[Message], str, str]:
    """(prompt messages, chosen answer, rejected answer) of one record; BadRecord naming what is wrong."""
    if not isinstance(obj, dict):
        raise BadRecord(f"is a JSON {type(obj).__name__}, not an object")
    prompt = _prompt(obj)
    chosen, rejected = _answer(obj, "chosen"), _answer(obj, "rejected")
    if chosen == rejected:
        raise BadRecord("'chosen' and 'rejected' are the same answer: there is nothing to prefer")
    return prompt, chosen, rejected


def _last_run(mask: list[bool]) -> np.ndarray:
    """`mask` with only its last run of True kept (the final assistant turn)."""
    out = np.asarray(mask, dtype=bool)
    end = len(out)
    while end and not out[end - 1]:
        end -= 1
    start = end
    while start and out[start - 1]:
        start -= 1
    out[:start] = False
    return out


# --- the dataset ----------------------------------------------------------------------------------


class PreferenceDataset(Dataset):
    """Pairs of rows (chosen, rejected) for preference tuning; see the module docstring. Counts in `stats`."""

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Tokenizer,
        max_seq_len: int,
        shuffle: bool = True,
        *,
        template: str | Mapping[str, str] = "auto",
        on_bad_line: str = "stop",
        pad_to_multiple_of: int = 1,
    ) -> None:
        """Read, template and tokenize the pairs of `data_files` (paths or globs) into rows of <= `max_seq_len`."""
        if on_bad_line not in BAD_LINE_MODES:
            raise DataError(f"on_bad_line={on_bad_line!r} is not one of {', '.join(BAD_LINE_MODES)}")
        if max_seq_len < 4:
            raise DataError(f"max_seq_len (data.seq_length) must be at least 4 for a prompt and answers, got "
                            f"{max_seq_len}")
        self.files = expand_files(data_files)
        self.tokenizer = tokenizer
        self.seq_length = max_seq_len
        self.shuffle = shuffle
        self.pad_id = tokenizer.pad_id
        self.pad_to_multiple_of = max(1, pad_to_multiple_of)
        renderer = resolve_template(template, tokenizer)
        self.template_name = renderer.label
        self.stats: dict[str, int] = {"records": 0, "bad_lines": 0, "prompt_truncated": 0, "answer_truncated": 0,
                                      "dropped_no_target": 0}
        self._read(renderer, on_bad_line)
        self.reference: np.ndarray | None = None  # [pairs, 2] log-probabilities of the reference model
        self._report()

    # --- reading ----------------------------------------------------------------------------------

    def _read(self, renderer: Any, on_bad_line: str) -> None:
        bad = BadLines(on_bad_line)
        dtype = token_dtype(self.tokenizer.vocab_size)
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        pending: list[tuple[str, list[Message], str, str]] = []

        def flush() -> None:
            rendered = []
            for w, prompt, chosen, rejected in pending:
                try:  # both answers or neither
                    rendered += [renderer.render(prompt + [{"role": "assistant", "content": chosen}]),
                                 renderer.render(prompt + [{"role": "assistant", "content": rejected}])]
                except BadRecord as e:
                    bad(w, str(e))
            encoded = encode_pieces(rendered, self.tokenizer)
            for k in range(0, len(encoded), 2):
                pair = self._fit(*encoded[k], *encoded[k + 1])
                if pair is None:
                    self.stats["dropped_no_target"] += 1
                    continue
                rows.extend((np.asarray(ids, dtype=dtype), mask) for ids, mask in pair)
            pending.clear()

        for path in self.files:
            seen = 0
            for where, obj, _ in file_objects(inspect_instruction_file(path)):
                seen += 1
                if isinstance(obj, BadRecord):
                    bad(where, str(obj))
                    continue
                try:
                    pending.append((where, *parse_preference(obj)))
                except BadRecord as e:
                    bad(where, str(e))
                    continue
                if len(pending) == _RECORDS_PER_CHUNK:
                    flush()
            if seen == 0:
                raise DataError(f"preference data file {path!r} is empty; it needs one JSON object per line with "
                                f"'prompt' (or 'messages'), 'chosen' and 'rejected'")
        flush()
        self.stats["bad_lines"] = bad.count
        self.stats["pairs"] = len(rows) // 2
        self.stats["records"] = self.stats["pairs"] + self.stats["dropped_no_target"]
        if not rows:
            raise DataError(f"no usable preference pairs in {len(self.files)} file(s) ({self.stats['bad_lines']} bad "
                            f"lines, {self.stats['dropped_no_target']} without an answer token within "
                            f"data.seq_length {self.seq_length}); see the warnings above")
        lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._tokens = np.concatenate([ids for ids, _ in rows])
        self._mask = np.concatenate([mask for _, mask in rows])
        self._lengths = lengths
        self.stats["tokens"] = int(lengths.sum())
        self.stats["target_tokens"] = int(sum(int(m[1:].sum()) for _, m in rows))

    def _fit(self, ids_c: list[int], mask_c: list[bool], ids_r: list[int], mask_r: list[bool]
             ) -> tuple[tuple[list[int], np.ndarray], tuple[list[int], np.ndarray]] | None:
        """The two rows of a pair within max_seq_len (prompt cut from its start first, then answers at their
        end), each with the mask of its answer's tokens; None when an answer is left without a target."""
        mc, mr = _last_run(mask_c), _last_run(mask_r)
        start_c, start_r = int(np.argmax(mc)) if mc.any() else len(mc), int(np.argmax(mr)) if mr.any() else len(mr)
        prompt = min(start_c, start_r)  # the shared prefix: what the template puts before the answer
        longest = max(len(ids_c), len(ids_r)) - prompt
        T = self.seq_length
        cut = 0
        if prompt + longest > T:
            keep = max(T - longest, min(prompt, T // 2))
            cut = prompt - keep
            if cut:
                self.stats["prompt_truncated"] += 1
            if keep + longest > T:
                self.stats["answer_truncated"] += 1
        out = []
        for ids, mask in ((ids_c, mc), (ids_r, mr)):
            ids, mask = list(ids[cut:cut + T]), mask[cut:cut + T]
            if not mask[1:].any():  # a target is a trained token after the row's first position
                return None
            out.append((ids, mask))
        return out[0], out[1]

    def _report(self) -> None:
        s = self.stats
        logger.info("preference data: %d pairs (%d tokens, %d trained), template %s", s["pairs"], s["tokens"],
                    s["target_tokens"], self.template_name)
        lost = {k: s[k] for k in ("bad_lines", "prompt_truncated", "answer_truncated", "dropped_no_target") if s[k]}
        if lost:
            logger.warning("preference data: %s (max_seq_len %d)", ", ".join(f"{k} {v}" for k, v in lost.items()),
                           self.seq_length)

    # --- items ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of pairs."""
        return len(self._lengths) // 2

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and shifted labels (int64) of row `index` (pair index // 2; even: chosen, odd: rejected)."""
        start, n = int(self._offsets[index]), int(self._lengths[index])
        ids = self._tokens[start:start + n].astype(np.int64)
        labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
        labels[:-1] = np.where(self._mask[start + 1:start + n], ids[1:], IGNORE_INDEX)
        return ids, labels

    def set_reference(self, logps: np.ndarray) -> None:
        """The reference model's log-probability of each pair's answers, [pairs, 2] (chosen, rejected)."""
        logps = np.asarray(logps, dtype=np.float64)
        if logps.shape != (len(self), 2) or not np.isfinite(logps).all():
            raise DataError(f"reference log-probabilities must be finite, one (chosen, rejected) per pair: "
                            f"{(len(self), 2)}, got {logps.shape}")
        self.reference = logps

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Pairs `indices` as 2B rows ([2B, width] tensors; chosen rows even, rejected odd)."""
        pairs = np.asarray(indices, dtype=np.int64).reshape(-1)
        if pairs.size and (pairs.min() < 0 or pairs.max() >= len(self)):
            raise IndexError(f"pair indices out of range for {len(self)} pairs")
        rows = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
        m = self.pad_to_multiple_of
        width = int(min(-(-int(self._lengths[rows].max()) // m) * m, self.seq_length))
        ids = np.full((rows.size, width), self.pad_id, dtype=np.int64)
        labels = np.full((rows.size, width), IGNORE_INDEX, dtype=np.int64)
        for k, r in enumerate(rows.tolist()):
            tok, lab = self.row(r)
            ids[k, :len(tok)] = tok
            labels[k, :len(lab)] = lab
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.reference is not None:
            batch["reference_logps"] = torch.from_numpy(self.reference[pairs].reshape(-1).astype(np.float32))
        return batch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Pair `index` as its two rows ([2, width] tensors)."""
        return self.get_batch([index])

    @property
    def num_tokens(self) -> int:
        """Tokens of the kept pairs' rows (without padding)."""
        return self.stats["tokens"]


__all__ = ["PreferenceDataset", "parse_preference"]
