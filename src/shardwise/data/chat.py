"""Chat templates: a conversation -> text and special-token pieces, each marked trained or not.

A conversation is a list of ``{"role": "system" | "user" | "assistant", "content": str}`` messages: an
optional system message first, then user and assistant messages alternating, starting with a user
message, with at least one assistant message (`parse_messages` checks it; a last user message without
an answer is dropped). Instruction data (instruction.py) reads conversations from files; generation
renders prompts with the same templates, so the model continues where it learned to answer.

Templates (``template=``)
-------------------------
``"default"``: seed 003's form. Every user->assistant exchange becomes, in tokens::

    [bos_id] encode("[INST] " + user + " [/INST]") encode(" " + assistant) [eos_id]

where ``bos_id``/``eos_id`` are the tokenizer's own special ids (never the literal text ``[BOS]``),
the two text pieces are encoded separately (so the answer's first token is the one the model produces
after the prompt, as at generation time), and a system prompt is put in front of the first user
message: ``user_1 = system + "\\n\\n" + user_1``. A multi-turn conversation is one sample: its
exchanges follow each other. Loss is taken on ``encode(" " + assistant)`` and the closing eos of every
exchange. Without a bos token in the tokenizer the bos is left out.

``"tokenizer"``: the tokenizer's own Jinja chat template (``tokenizer.chat_template``), rendered with
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``pad_token``, as
`transformers` does. Assistant turn i is found by rendering incrementally: its span is the text
between ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])``, less
trailing whitespace, which holds its content and the template's end-of-turn marker. A template that
does not render conversations as growing prefixes is refused per record (use another template).

``"auto"`` (default): ``"tokenizer"`` when the tokenizer has a chat template, else ``"default"``.

A dict: a user template with a format string per role, ``{content}`` standing for the message::

    {"user": "### Instruction:\\n{content}\\n\\n",      # required
     "assistant": "### Response:\\n{content}\\n",         # required; loss on {content} and what follows
     "system": "{content}\\n\\n",                        # optional; without it, as "default" does
     "bos": "turn", "eos": "turn"}                      # optional: "turn" | "sample" | "none"

The text before ``{content}`` in ``assistant`` is prompt (no loss) except for its trailing spaces;
those spaces, ``{content}`` and the text after it are trained and encoded together (a byte-level BPE
encodes a word with its leading space, and at generation time the model writes that space itself).
``bos: "turn"`` puts the bos id before every user message, ``"sample"`` once at the start,
``"none"`` nowhere; ``eos: "turn"`` puts the (trained) eos id after every assistant message,
``"sample"`` after the last one only. A ``system`` string puts the system message after the first bos,
before the first user message. Format strings are filled by plain replacement of ``{content}``,
so other braces are literal. ``"default"`` is exactly
``{"user": "[INST] {content} [/INST]", "assistant": " {content}", "bos": "turn", "eos": "turn"}``.

A string holding ``{{`` or ``{%`` is a Jinja chat template used like the tokenizer's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import DataError
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
DEFAULT_TEMPLATE: dict[str, str] = {
    "user": "[INST] {content} [/INST]",
    "assistant": " {content}",
    "bos": "turn",
    "eos": "turn",
}

_TEMPLATE_KEYS = {"system", "user", "assistant", "bos", "eos"}
_PLACEMENTS = ("turn", "sample", "none")

Message = dict[str, str]
# A piece of a rendered conversation: text to encode or a token id, and whether loss is taken on it.
Piece = tuple[str | int, bool]


class BadRecord(Exception):
    """A conversation (a record of instruction data) that cannot be used; the message says why (without
    file and line, which the reader adds)."""


# --- conversations --------------------------------------------------------------------------------


def parse_messages(raw: Any) -> tuple[list[Message], bool]:
    """A checked conversation and whether a last user message without an answer was dropped from it."""
    if not isinstance(raw, list) or not raw:
        raise BadRecord("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    messages: list[Message] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRecord(f"message {i} is a {type(m).__name__}, not an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise BadRecord(f"message {i} has role {role!r}; the roles are 'system', 'user' and 'assistant'")
        content = m.get("content")
        if not isinstance(content, str):
            what = "no 'content'" if content is None else f"a {type(content).__name__} 'content'"
            raise BadRecord(f"message {i} ({role}) has {what}; content must be a string")
        messages.append({"role": role, "content": content})
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            where = len(messages) - len(turns) + i
            raise BadRecord(
                f"message {where} is {m['role']!r} where {want!r} was expected: after an optional "
                f"system message first, user and assistant messages must alternate, starting with user"
            )
    unanswered = bool(turns) and turns[-1]["role"] == "user"
    if unanswered:
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("the conversation has no assistant message, so there is nothing to learn")
    return messages, unanswered


# --- templates ------------------------------------------------------------------------------------


class DictTemplate:
    """A user template: a format string per role and where bos/eos go (see the module docstring)."""

    def __init__(self, spec: Mapping[str, str], bos_id: int | None, eos_id: int, label: str = "dict") -> None:
        """Check `spec` and bind the tokenizer's bos/eos ids; `label` names it in logs."""
        self.label = label
        unknown = set(spec) - _TEMPLATE_KEYS
        if unknown:
            raise DataError(
                f"template has unknown keys {sorted(unknown)}; a template dict has 'user', 'assistant' "
                f"and optionally 'system', 'bos', 'eos'"
            )
        for key in ("user", "assistant", "system"):
            value = spec.get(key)
            if value is None and key != "system":
                raise DataError(
                    f"template has no {key!r} format string; give one such as {DEFAULT_TEMPLATE[key]!r}"
                )
            if value is not None and (not isinstance(value, str) or value.count("{content}") != 1):
                raise DataError(f"template[{key!r}] = {value!r} must be a string holding '{{content}}' once")
        for key in ("bos", "eos"):
            if spec.get(key, "turn") not in _PLACEMENTS:
                raise DataError(f"template[{key!r}] = {spec[key]!r}; use one of {', '.join(_PLACEMENTS)}")
        self.spec = dict(spec)
        self.user = spec["user"]
        prompt, answer = spec["assistant"].split("{content}")
        # Spaces before {content} go with the answer: byte-level BPE encodes a word with its leading
        # space, and at generation time the model produces that space itself.
        self.prompt = prompt.rstrip(" ")
        self.answer_prefix = prompt[len(self.prompt) :]
        self.answer = answer
        self.system = spec.get("system")
        self.bos = spec.get("bos", "turn") if bos_id is not None else "none"
        self.eos = spec.get("eos", "turn")
        self.bos_id, self.eos_id = bos_id, eos_id
        if bos_id is None and spec.get("bos", "turn") != "none":
            logger.info("the tokenizer has no bos token: the template's bos is left out")

    @property
    def key(self) -> str:
        """Identity of the rendering, for the token cache."""
        return json.dumps([self.spec, self.bos_id, self.eos_id], sort_keys=True)

    def render(self, messages: Sequence[Message]) -> list[Piece]:
        """Pieces of one conversation (validated by `parse_record`)."""
        pieces: list[Piece] = []
        system = ""
        if messages[0]["role"] == "system":
            system = messages[0]["content"]
            messages = messages[1:]
        if self.bos != "none":
            pieces.append((self.bos_id, False))  # type: ignore[arg-type]
        if system and self.system is not None:
            pieces.append((self.system.replace("{content}", system), False))
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        for i, m in enumerate(messages):
            if m["role"] == "user":
                if self.bos == "turn" and i > 0:
                    pieces.append((self.bos_id, False))  # type: ignore[arg-type]
                content = m["content"]
                if i == 0 and system and self.system is None:
                    content = f"{system}\n\n{content}"
                pieces.append((self.user.replace("{content}", content) + self.prompt, False))
            else:
                pieces.append((self.answer_prefix + m["content"] + self.answer, True))
                if self.eos == "turn" or (self.eos == "sample" and i == last):
                    pieces.append((self.eos_id, True))
        return pieces


def _jinja_environment() -> tuple[Any, type[Exception]]:
    """A sandboxed Jinja environment set up as `transformers` sets it for chat templates, and its error."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2.exceptions.TemplateError


class JinjaTemplate:
    """A Jinja chat template (the tokenizer's own, or given); assistant spans found by prefix rendering."""

    def __init__(self, source: str, tokenizer: Tokenizer, origin: str = "template") -> None:
        """Compile `source`; bos/eos/pad token strings come from `tokenizer`."""
        self.source = source
        self.origin = origin
        self.label = f"jinja ({origin})"
        env, self._error = _jinja_environment()
        try:
            self._template = env.from_string(source)
        except self._error as e:
            raise DataError(f"the chat template of {origin} is not valid Jinja: {e}; fix it or use "
                            f"template='default'") from e
        self._specials = {
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
        }

    @property
    def key(self) -> str:
        """Identity of the rendering, for the token cache."""
        return json.dumps([self.source, self._specials], sort_keys=True)

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self._specials)
        except self._error as e:
            raise BadRecord(f"the chat template of {self.origin} failed on it: {e}") from e

    def render(self, messages: Sequence[Message]) -> list[Piece]:
        """Pieces of one conversation: text before/between assistant turns untrained, the turns trained."""
        full = self._render(messages, False)
        pieces: list[Piece] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True)
            upto = self._render(messages[: i + 1], False)
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= cursor):
                raise BadRecord(
                    f"the chat template of {self.origin} does not render the conversation as growing "
                    f"prefixes (assistant message {i}), so its answer cannot be located; use "
                    f"template='default' or a template dict"
                )
            # Whitespace after the end-of-turn marker is never generated, so it is not trained.
            end = max(len(before), len(upto.rstrip()))
            pieces.append((full[cursor : len(before)], False))
            pieces.append((full[len(before) : end], True))
            cursor = end
        pieces.append((full[cursor:], False))
        return pieces


Renderer = DictTemplate | JinjaTemplate


def _tokenizer_chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template string, or None (a list of named templates gives 'default')."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    elif isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def resolve_template(template: str | Mapping[str, str], tokenizer: Tokenizer) -> Renderer:
    """The renderer for a `template` option: "auto", "default", "tokenizer", a dict or a Jinja string."""
    if isinstance(template, Mapping):
        return DictTemplate(template, tokenizer.bos_id, tokenizer.eos_id)
    if not isinstance(template, str):
        raise DataError(
            f"template must be 'auto', 'default', 'tokenizer', a dict or a Jinja string, got {template!r}"
        )
    if "{{" in template or "{%" in template:
        return JinjaTemplate(template, tokenizer, origin="the template option")
    if template in ("auto", "tokenizer"):
        source = _tokenizer_chat_template(tokenizer)
        if source is not None:
            return JinjaTemplate(source, tokenizer, origin="the tokenizer")
        if template == "tokenizer":
            raise DataError(
                "template='tokenizer' but the tokenizer has no chat template; add \"chat_template\" to "
                "its tokenizer_config.json, or use template='default' (seed 003's [INST] form)"
            )
        template = "default"
    if template == "default":
        return DictTemplate(DEFAULT_TEMPLATE, tokenizer.bos_id, tokenizer.eos_id, label="default")
    raise DataError(
        f"unknown template {template!r}; use 'auto', 'default', 'tokenizer', a dict of format strings "
        f"per role, or a Jinja chat template string"
    )


def encode_pieces(
    rendered: Sequence[list[Piece]], tokenizer: Tokenizer
) -> list[tuple[list[int], list[bool]]]:
    """Token ids and trained flags of many rendered conversations; text is encoded in one batch."""
    texts = [p for pieces in rendered for p, _ in pieces if isinstance(p, str) and p]
    encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
    out = []
    for pieces in rendered:
        ids: list[int] = []
        trained: list[bool] = []
        for piece, train in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                part = next(encoded)
            else:
                part = [piece]
            ids += part
            trained += [train] * len(part)
        out.append((ids, trained))
    return out


def encode_conversation(
    messages: Sequence[Message], tokenizer: Tokenizer, template: str | Mapping[str, str] = "auto"
) -> tuple[list[int], list[bool]]:
    """Token ids of one conversation and, per token, whether loss is taken on it (for inspection)."""
    try:
        msgs, _ = parse_messages([dict(m) for m in messages])
        pieces = resolve_template(template, tokenizer).render(msgs)
    except BadRecord as e:
        raise DataError(f"conversation: {e}") from e
    return encode_pieces([pieces], tokenizer)[0]


# --- generation prompts ---------------------------------------------------------------------------

# Assistant content used where only the text around an answer matters (it is never encoded).
_PLACEHOLDER = "shardwise-answer-probe"


def _as_renderer(template: Renderer | str | Mapping[str, str], tokenizer: Tokenizer) -> Renderer:
    """A renderer as is, or the one `resolve_template` makes of a template option."""
    if isinstance(template, (DictTemplate, JinjaTemplate)):
        return template
    return resolve_template(template, tokenizer)


def render_generation_prompt(
    template: Renderer | str | Mapping[str, str], tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]
) -> list[int]:
    """Token ids of a conversation ending with a user message, up to where the assistant's answer starts.

    These are exactly the ids training (`encode_conversation`) gives the same conversation with an
    answer appended, cut before the answer's first trained token: so the model continues where it
    learned to answer. `template` is a renderer or any `template=` option ("auto", "default",
    "tokenizer", a dict, a Jinja string). A Jinja template renders as transformers'
    `apply_chat_template(messages, add_generation_prompt=True)`.
    """
    renderer = _as_renderer(template, tokenizer)
    msgs = [dict(m) for m in messages]
    if not msgs or msgs[-1].get("role") != "user":
        last = msgs[-1].get("role") if msgs else "nothing"
        raise DataError(
            f"a generation prompt is a conversation ending with the user message to answer; it ends with {last}"
        )
    try:
        # The placeholder answer makes the conversation complete, so it is checked and rendered as in training.
        checked, _ = parse_messages(msgs + [{"role": "assistant", "content": _PLACEHOLDER}])
        if isinstance(renderer, JinjaTemplate) and not any(m["role"] == "assistant" for m in msgs):
            # One exchange: training's untrained first piece is exactly this text. Rendering it directly
            # also serves templates that do not render growing prefixes (which training refuses), as
            # apply_chat_template does.
            return tokenizer.encode(renderer._render(checked[:-1], True))
        pieces = renderer.render(checked)
    except BadRecord as e:
        raise DataError(f"conversation: {e}") from e
    # The placeholder answer is the last piece of text that is trained; everything before it is prompt.
    answer = max(i for i, (piece, trained) in enumerate(pieces) if trained and isinstance(piece, str))
    return encode_pieces([pieces[:answer]], tokenizer)[0][0]


def chat_stop_ids(template: Renderer | str | Mapping[str, str], tokenizer: Tokenizer) -> list[int]:
    """Ids that end an assistant turn: eos, and the special token(s) a Jinja template closes a turn with.

    A template that ends turns with a special token other than eos (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>) is found by rendering a short conversation and encoding what follows the answer.
    """
    renderer = _as_renderer(template, tokenizer)
    stops = [tokenizer.eos_id]
    if not isinstance(renderer, JinjaTemplate):
        return stops  # dict templates close an answer with eos (or nothing)
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PLACEHOLDER}]
    try:
        text = renderer._render(probe, False)
    except BadRecord as e:
        raise DataError(f"conversation: {e}") from e
    at = text.find(_PLACEHOLDER)
    if at < 0:
        return stops
    for tid in tokenizer.encode(text[at + len(_PLACEHOLDER):]):
        # Special tokens are the ones decoding drops; the first ordinary token ends the marker.
        if tokenizer.decode([tid], skip_special_tokens=True) != "":
            break
        if tid not in stops:
            stops.append(tid)
    return stops




__all__ = [
    "DEFAULT_TEMPLATE",
    "ROLES",
    "BadRecord",
    "DictTemplate",
    "JinjaTemplate",
    "Message",
    "Piece",
    "Renderer",
    "chat_stop_ids",
    "encode_conversation",
    "encode_pieces",
    "parse_messages",
    "render_generation_prompt",
    "resolve_template",
]
