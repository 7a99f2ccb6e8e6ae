"""Chat templates: the default [INST] form, dict templates, the tokenizer's Jinja template (checked
against transformers), and which tokens are trained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import shardwise.data.chat as chat
from shardwise.data import Tokenizer
from shardwise.data.chat import encode_conversation
from shardwise.data.instruction import InstructionDataset
from shardwise.errors import DataError

# A small Jinja chat template in the ChatML style: a role header per message, eos closing each one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}{{ eos_token }}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)

SYSTEM = "You answer briefly."

TWO_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Who is Jane?"},
    {"role": "assistant", "content": "Her sister, at the house."},
    {"role": "user", "content": "And the letter?"},
    {"role": "assistant", "content": "It was for Darcy."},
]


def write_jsonl(path: Path, records: list[Any]) -> str:
    """Write one JSON value (or a raw string) per line; return the path."""
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def expected_chat_template_labels(tok: Tokenizer, answers: list[str]) -> list[int]:
    out: list[int] = []
    for a in answers:
        out += tok.encode(a) + [tok.eos_id]
    return out


# --- templates and labels ---------------------------------------------------------------------------


def test_default_template_layout_of_a_two_turn_chat_with_system(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    ids, trained = encode_conversation(TWO_TURNS, tok, template="default")
    bos, eos = tok.bos_id, tok.eos_id
    first_prompt = tok.encode(f"[INST] {SYSTEM}\n\nWho is Jane? [/INST]")
    answer1 = tok.encode(" Her sister, at the house.")
    second_prompt = tok.encode("[INST] And the letter? [/INST]")
    answer2 = tok.encode(" It was for Darcy.")
    assert ids == [bos, *first_prompt, *answer1, eos, bos, *second_prompt, *answer2, eos]
    want_trained = (
        [False] * (1 + len(first_prompt)) + [True] * (len(answer1) + 1)
        + [False] * (1 + len(second_prompt)) + [True] * (len(answer2) + 1)
    )
    assert trained == want_trained
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"<|bos|>[INST] {SYSTEM}\n\nWho is Jane? [/INST] Her sister, at the house.<|eos|>"
        "<|bos|>[INST] And the letter? [/INST] It was for Darcy.<|eos|>"
    )


def test_jinja_template_option_and_template_errors(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    ids, trained = encode_conversation(TWO_TURNS[1:3], tok, template=CHAT_TEMPLATE)
    want = expected_chat_template_labels(tok, ["Her sister, at the house."])
    assert [i for i, t in zip(ids, trained) if t] == want
    assert tok.decode(ids[: trained.index(True)], skip_special_tokens=False) == (
        "<|bos|><|user|>\nWho is Jane?<|eos|>\n<|assistant|>\n"
    )
    with pytest.raises(DataError, match="no chat template"):
        encode_conversation(TWO_TURNS, tok, template="tokenizer")
    with pytest.raises(DataError, match="not valid Jinja"):
        encode_conversation(TWO_TURNS, tok, template="{% for m in messages %}")
    # A template that reorders turns cannot be located by prefixes: refused per record, by file and line.
    reversed_template = "{% for m in messages|reverse %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    with pytest.raises(DataError, match=r"chat\.jsonl:1: .*growing prefixes"):
        InstructionDataset(f, tok, 160, template=reversed_template)


def test_dict_template_roles_and_bos_eos_placement(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    template = {
        "system": "<<{content}>>\n",
        "user": "Q: {content}\n",
        "assistant": "A: {content}\n",
        "bos": "sample",
        "eos": "sample",
    }
    ids, trained = encode_conversation(TWO_TURNS, tok, template=template)
    p1 = tok.encode(f"<<{SYSTEM}>>\n")
    p2 = tok.encode("Q: Who is Jane?\nA:")
    a1 = tok.encode(" Her sister, at the house.\n")  # the space before {content} goes with the answer
    p3 = tok.encode("Q: And the letter?\nA:")
    a2 = tok.encode(" It was for Darcy.\n")
    assert ids == [tok.bos_id, *p1, *p2, *a1, *p3, *a2, tok.eos_id]
    assert [i for i, t in zip(ids, trained) if t] == [*a1, *a2, tok.eos_id]
    # The default template is a dict template; bos/eos "turn" wrap every exchange.
    assert encode_conversation(TWO_TURNS, tok, dict(chat.DEFAULT_TEMPLATE)) == encode_conversation(
        TWO_TURNS, tok, "default"
    )
    for bad, match in (
        ({"user": "{content}"}, "no 'assistant'"),
        ({"user": "{content}", "assistant": "no placeholder"}, "holding '\\{content\\}' once"),
        ({"user": "{content}", "assistant": "{content}", "eos": "always"}, "turn, sample, none"),
        ({"user": "{content}", "assistant": "{content}", "tool": "{content}"}, "unknown keys"),
    ):
        with pytest.raises(DataError, match=match):
            encode_conversation(TWO_TURNS, tok, bad)


LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def test_jinja_rendering_matches_transformers(tiny_tokenizer_dir: Path, tiny_tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_tokenizer_dir / "tokenizer.json"), bos_token="<|bos|>", eos_token="<|eos|>"
    )
    for template, answers in (
        (LLAMA2_TEMPLATE, [" Her sister, at the house. <|eos|>", " It was for Darcy. <|eos|>"]),
        (CHAT_TEMPLATE, ["Her sister, at the house.<|eos|>", "It was for Darcy.<|eos|>"]),
    ):
        hf.chat_template = template
        ids, trained = encode_conversation(TWO_TURNS, tiny_tokenizer, template)
        assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == hf.apply_chat_template(
            TWO_TURNS, tokenize=False
        )
        assert trained_spans(tiny_tokenizer, ids, trained) == answers


def trained_spans(tok: Tokenizer, ids: list[int], trained: list[bool]) -> list[str]:
    """Text of each run of consecutive trained tokens."""
    spans: list[list[int]] = []
    for i, (token, t) in enumerate(zip(ids, trained)):
        if t:
            if i == 0 or not trained[i - 1]:
                spans.append([])
            spans[-1].append(token)
    return ["".join(tok.decode([x], skip_special_tokens=False) for x in span) for span in spans]
