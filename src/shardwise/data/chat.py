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

Jinja templates are not trusted (a tokenizer directory comes from elsewhere): they run in Jinja's
immutable sandbox (no attribute starting with ``_``, no mutation of lists and dicts, ``range()`` of
at most 100,000 items), and on top of it every render is bounded in output, in the size of what one
operation builds and in time. A render may produce `MAX_RENDER_CHARS` characters plus 4 times the
conversation's own; ``*``, ``+``, ``%``, ``~``, ``**`` and the filters and string methods that can
multiply text (``join``, ``replace``, ``center``, ``indent``, ``format``, ``string``, ``tojson``, ...)
are checked before they build anything larger, and a render taking more than `RENDER_SECONDS` is
stopped. Passing a bound is a DataError naming the template (the tokenizer's directory), since the
template, not the record, is at fault; an error the template raises on a record (``raise_exception``, a
type error) makes that record a bad line.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

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


# --- bounded Jinja -----------------------------------------------------------------------------------

# Characters a render may produce (and any one value built on the way), beyond 4x the conversation's own.
MAX_RENDER_CHARS = 16 << 20
# Seconds one render may take (real chat templates render in well under a millisecond).
RENDER_SECONDS = 5.0
# Bits of an integer a template may compute with * or ** (no chat template computes with big numbers).
_MAX_INT_BITS = 1 << 16
_TEMPLATE_FILE = "<template>"  # the file name Jinja gives code compiled from a string
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")
_DIGITS = re.compile(r"\d+")


class _TooBig(Exception):
    """A template passed a bound; `JinjaTemplate` turns it into a DataError naming the template."""


def _size(value: Any, limit: int) -> int:
    """Characters `str(value)` would have, roughly (strings, and containers counted item by item, shared
    items each time they appear); stops counting past `limit`, so it takes at most `limit` steps."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            if total <= limit:
                stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, int) and not isinstance(v, bool):
            total += 1 + v.bit_length() // 3
        else:
            total += 8
        if total > limit:
            return total
    return total


def _int_arg(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with `a ~ b` (string concatenation, not an interceptable operator) joined by
    `environment.bounded_concat`, which checks the size first."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the size checks of the module docstring; `limit` is set per render."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    limit = MAX_RENDER_CHARS

    def too_big(self, what: str) -> _TooBig:
        return _TooBig(f"{what} would be more than the {self.limit:,} characters a render may build")

    def check(self, value: Any, what: str) -> None:
        if _size(value, self.limit) > self.limit:
            raise self.too_big(what)

    def check_printf(self, fmt: str, args: Any) -> None:
        """`fmt % args` (and the `format` filter): widths and precisions bounded, no `*` width."""
        total = len(fmt)
        for width, precision in _PRINTF_SPEC.findall(fmt):
            if "*" in (width, precision):
                raise self.too_big(f"a %-format with a '*' width ({fmt[:40]!r})")
            total += int(width or 0) + int(precision or 0)
        if total + _size(args, self.limit) > self.limit:
            raise self.too_big(f"the %-format {fmt[:40]!r}")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            if _int_arg(left) and _int_arg(right):
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise self.too_big("an integer product")
            else:
                seq, n = (left, right) if _int_arg(right) else (right, left)
                if _int_arg(n) and n > 0 and _size(seq, self.limit) * min(n, self.limit + 1) > self.limit:
                    raise self.too_big("a repeated string or list (*)")
        elif operator == "**":
            if _int_arg(left) and _int_arg(right) and abs(left) > 1 and right > 0:
                if right > _MAX_INT_BITS or right * abs(left).bit_length() > _MAX_INT_BITS:
                    raise self.too_big("a power (**)")
        elif operator == "+":
            if not (isinstance(left, (int, float)) and isinstance(right, (int, float))):
                if _size(left, self.limit) + _size(right, self.limit) > self.limit:
                    raise self.too_big("a concatenation (+)")
        elif operator == "%" and isinstance(left, str):
            self.check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def bounded_concat(self, parts: tuple) -> str:
        total = 0
        for part in parts:
            total += _size(part, self.limit)
            if total > self.limit:
                raise self.too_big("a concatenation (~)")
        return "".join(map(str, parts))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - as Jinja's
        for value in (*args, *kwargs.values()):
            if _int_arg(value) and abs(value) > __self.limit:
                raise __self.too_big(f"a call with the number {value:,}")
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            __self.check_str_method(owner, getattr(target, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def check_str_method(self, s: str, name: str, args: tuple, kwargs: dict) -> None:
        """Bounds on the string methods whose result can be much longer than the string."""
        limit = self.limit
        if name in ("format", "format_map"):
            widths = sum(int(d) for d in _DIGITS.findall(s) if len(d) < 12) + sum(
                len(d) > 11 for d in _DIGITS.findall(s)) * (limit + 1)
            if len(s) + widths + _size((args, kwargs), limit) > limit:
                raise self.too_big(f"the format string {s[:40]!r}")
        elif name == "join" and args:
            items = list(args[0]) if not isinstance(args[0], str) else args[0]
            if _size(items, limit) + len(s) * len(items) > limit:
                raise self.too_big("a join")
        elif name == "replace" and len(args) >= 2:
            self.check_replace(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if _int_arg(tab) and len(s) * max(tab, 1) > limit:
                raise self.too_big("expandtabs")

    def check_replace(self, s: Any, old: Any, new: Any, count: Any = None) -> None:
        if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
            return
        n = s.count(old) if old else len(s) + 1
        if _int_arg(count) and count >= 0:
            n = min(n, count)
        if len(s) + n * max(0, len(new) - len(old)) > self.limit:
            raise self.too_big("a replace")


def _bounded_filters(env: _BoundedSandbox) -> None:
    """Wrap the filters that can build much more than they are given with checks made before they run;
    drop those no chat template uses that print whole structures (pprint, xmlattr, urlize)."""
    for name in ("pprint", "xmlattr", "urlize", "wordwrap"):
        env.filters.pop(name, None)

    def wrap(name: str, check: Any) -> None:
        inner = env.filters[name]

        @functools.wraps(inner)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            # A generator (map, select) is made a list, so that what it holds is checked; its source is bounded.
            args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
            for value in (*args, *kwargs.values()):
                if _int_arg(value) and abs(value) > env.limit:
                    raise env.too_big(f"the filter {name} with the number {value:,}")
            check(*args, **kwargs)
            return inner(*args, **kwargs)

        env.filters[name] = bounded

    def skip_ctx(args: tuple) -> tuple:
        # Filters that take the evaluation context get it first.
        return args[1:] if args and isinstance(args[0], jinja2.nodes.EvalContext) else args

    def value_size(*args: Any, **kwargs: Any) -> None:
        env.check(skip_ctx(args)[:1], "the value")

    def join(*args: Any, **kwargs: Any) -> None:
        args = skip_ctx(args)
        if args and not isinstance(args[0], str):
            items = args[0]
            sep = args[1] if len(args) > 1 else kwargs.get("d", "")
            n = len(items) if hasattr(items, "__len__") else 0
            if _size(items, env.limit) + len(str(sep)) * n > env.limit:
                raise env.too_big("a join")

    def replace(*args: Any, **kwargs: Any) -> None:
        args = skip_ctx(args)
        if len(args) >= 3:
            env.check_replace(str(args[0]), args[1], args[2], args[3] if len(args) > 3 else kwargs.get("count"))

    def indent(s: Any = "", width: Any = 4, *args: Any, **kwargs: Any) -> None:
        width = kwargs.get("width", width)
        pad = len(width) if isinstance(width, str) else width if _int_arg(width) else 0
        text = str(s)
        if len(text) + (text.count("\n") + 1) * pad > env.limit:
            raise env.too_big("an indent")

    def fmt(*args: Any, **kwargs: Any) -> None:
        if args and isinstance(args[0], str):
            env.check_printf(args[0], (args[1:], kwargs))

    def count_arg(*args: Any, **kwargs: Any) -> None:
        for value in (*args[1:], *kwargs.values()):
            if _int_arg(value) and value > MAX_RANGE:
                raise env.too_big(f"a batch or slice of {value:,}")

    for name, check in (("join", join), ("replace", replace), ("indent", indent), ("format", fmt),
                        ("string", value_size), ("tojson", value_size), ("sum", value_size), ("list", value_size),
                        ("batch", count_arg), ("slice", count_arg), ("center", value_size),
                        ("truncate", value_size)):
        if name in env.filters:
            wrap(name, check)


def _jinja_environment() -> tuple[Any, type[Exception]]:
    """A sandboxed Jinja environment set up as `transformers` sets it for chat templates (bounded: see
    the module docstring), and its error."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        if indent is not None and not (_int_arg(indent) and 0 <= indent <= 16):
            raise jinja2.exceptions.TemplateError(f"tojson: indent must be a number 0..16, got {indent!r}")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    # `{{ value }}` prints str(value): a list holding one long string many times would print all of them.
    env.finalize = lambda value: value if isinstance(value, str) else env.check(value, "a printed value") or value
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt)[:256])
    env.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
    _bounded_filters(env)
    return env, jinja2.exceptions.TemplateError


class _Clock:
    """Whether a render is running in this process's main thread (what the CPU timer's signal stops)."""

    rendering = False


def _cpu_timer_fired(signum: int, frame: Any) -> None:
    if _Clock.rendering:
        _Clock.rendering = False
        raise _TooBig(f"it took more than {RENDER_SECONDS:g} s of CPU to render one conversation (a loop without end?)")


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Stop template code running past `seconds`. In the main thread a CPU timer (ITIMER_VIRTUAL,
    SIGVTALRM: nothing else shardwise runs uses it) interrupts it at no cost per line; in another thread,
    which cannot take signals, a trace function on that thread looks at the clock every 256 lines of
    template code (the frames Jinja compiled, file "<template>"), which makes rendering about 3 times slower."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        previous = signal.signal(signal.SIGVTALRM, _cpu_timer_fired)
        _Clock.rendering = True
        timer = signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
        try:
            yield
        finally:
            _Clock.rendering = False
            signal.setitimer(signal.ITIMER_VIRTUAL, *timer)  # (0, 0), which stops it, unless one was set
            signal.signal(signal.SIGVTALRM, signal.SIG_DFL if previous is None else previous)
        return
    deadline = time.monotonic() + seconds
    lines = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += 1
        if not lines & 0xFF and time.monotonic() > deadline:
            raise _TooBig(f"it took more than {seconds:g} s to render one conversation (a loop without end?)")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous_trace = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous_trace)


class JinjaTemplate:
    """A Jinja chat template (the tokenizer's own, or given); assistant spans found by prefix rendering."""

    def __init__(self, source: str, tokenizer: Tokenizer, origin: str = "template") -> None:
        """Compile `source`; bos/eos/pad token strings come from `tokenizer`."""
        self.source = source
        self.origin = origin
        self.label = f"jinja ({origin})"
        env, self._error = _jinja_environment()
        self._env = env
        try:
            self._template = env.from_string(source)
        except (self._error, _TooBig, RecursionError, ValueError, TypeError, OverflowError) as e:
            raise DataError(f"the chat template of {origin} is not valid Jinja: {e}; fix it or use "
                            f"template='default'") from None
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
        """The template rendered, bounded in output, in what it builds and in time (module docstring)."""
        own = sum(len(m.get("content", "")) + len(m.get("role", "")) for m in messages)
        limit = MAX_RENDER_CHARS + 4 * own
        self._env.limit = limit
        out: list[str] = []
        size = 0
        try:
            with _deadline(RENDER_SECONDS):
                for chunk in self._template.generate(messages=list(messages),
                                                     add_generation_prompt=add_generation_prompt, **self._specials):
                    size += len(chunk)
                    if size > limit:
                        raise self._env.too_big("its output")
                    out.append(chunk)
        except _TooBig as e:
            raise DataError(
                f"the chat template of {self.origin} is refused: {e}; a chat template that builds that much "
                f"text or runs that long is broken or hostile: fix it, or use template='default'"
            ) from None
        except self._error as e:
            raise BadRecord(f"the chat template of {self.origin} failed on it: {e}") from None
        except (DataError, MemoryError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - any error of template code (TypeError, RecursionError, ...)
            raise BadRecord(f"the chat template of {self.origin} failed on it ({type(e).__name__}: "
                            f"{str(e)[:200]})") from None
        return "".join(out)

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
            return JinjaTemplate(source, tokenizer, origin=getattr(tokenizer, "source", "the tokenizer"))
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
