"""A Jinja environment for chat templates from model files: sandboxed and bounded.

A chat template is code written by whoever made the model file. jinja2's
`ImmutableSandboxedEnvironment` (what transformers uses) keeps it away from Python's internals
but not from endless work: `{% for i in range(100000) %}{% for j in range(100000) %}` runs for
hours, `10**10000000` never finishes, `'a' * 10**9` takes a gigabyte. This environment renders
the same templates to the same text, within a `RenderBudget` per render:

- steps: every loop iteration and every call (function, method, macro) costs one;
- characters: every string the template makes (an output, a concatenation, a product, a call's
  or filter's result, a loop body's literal text per pass) is charged, so memory stays bounded
  even when the text goes into a `{% set %}` block and never reaches the output;
- time: checked at every step;
- size: no single string beyond the output limit; `**` refuses results beyond `MAX_INT_BITS`;
  a format width or an integer argument beyond `MAX_INT_ARG` is refused before anything runs.

Every refusal is a `TemplateLimitError` (a jinja2 `SecurityError`), raised inside the render,
so one `except TemplateError` catches it with the template's other failures. The work between
two checks is a single bounded operation, which is what makes the bound real: nothing here
relies on interrupting a thread.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import wraps
from typing import Any, Iterable, Iterator

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_STEPS = 1_000_000  # loop iterations + calls in one render
MAX_SECONDS = 2.0
MIN_OUTPUT_CHARS = 1_000_000  # the output limit for a short conversation
MAX_INT_ARG = 100_000  # widths, counts and repeat arguments to calls, filters and formats
MAX_INT_BITS = 100_000  # the largest integer `**` and `*` may make (about 30,000 digits)


class TemplateLimitError(SecurityError):
    """A template tried more work or more text than a chat template ever needs."""


@dataclass
class RenderBudget:
    """What one render may still spend. `output_chars` bounds any one string and the output;
    `made_chars` bounds all the text made along the way."""

    output_chars: int
    made_chars: int
    steps: int = MAX_STEPS
    deadline: float = field(default_factory=lambda: time.monotonic() + MAX_SECONDS)

    @classmethod
    def for_input(cls, input_chars: int) -> "RenderBudget":
        # A template copies each message a few times (strip, split, the output itself).
        output = MIN_OUTPUT_CHARS + 4 * input_chars
        return cls(output_chars=output, made_chars=16 * output)

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateLimitError(f"it ran more than {MAX_STEPS:,} loop passes and calls")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran longer than {MAX_SECONDS:g} s")

    def made(self, value: Any) -> Any:
        """Charge a string or list the template made; refuse one that is too big."""
        if isinstance(value, (str, list, tuple)):
            self.charge(len(value))
        return value

    def charge(self, chars: int) -> None:
        if chars > self.output_chars:
            raise TemplateLimitError(f"it built a text or list {chars:,} long, more than any chat needs")
        self.made_chars -= chars
        if self.made_chars < 0:
            raise TemplateLimitError("it made more text than a chat can hold")


# The budget of the render running in this thread (a ContextVar, so renders in other threads
# each have their own). Outside a render -- jinja folds constants at compile time -- a fresh
# default budget applies to that one operation.
_current: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("render_budget", default=None)


def _budget() -> RenderBudget:
    return _current.get() or RenderBudget.for_input(0)


# -- checks on arguments ------------------------------------------------------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_int(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
        raise TemplateLimitError(f"it passed the number {value} where at most {MAX_INT_ARG:,} makes sense")


def _check_args(args: Iterable[Any], kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        _check_int(value)


def _check_format_widths(fmt: str, brace_style: bool) -> None:
    """Refuse `'%0999999999d'` and `'{:>999999999}'`: widths are made before any check runs."""
    if brace_style:
        specs = _BRACE_SPEC.findall(fmt)
        numbers = [int(n) for spec in specs for n in re.findall(r"\d+", spec)]
    else:
        numbers = [int(n) for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n and n != "*"]
    for n in numbers:
        _check_int(n)


def _product_size(left: Any, right: Any) -> None:
    """Refuse `'a' * 10**9`, `[x] * 10**9` and integer products beyond MAX_INT_BITS."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            _budget().charge(len(seq) * max(count, 0))
            return
    if isinstance(left, int) and isinstance(right, int):
        if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
            raise TemplateLimitError("it multiplied numbers too large for any chat")


def _power_size(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if abs(base).bit_length() * exponent > MAX_INT_BITS:
            raise TemplateLimitError(f"it computed {base} ** {exponent}, a number too large for any chat")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        _product_size(left, right)
    elif operator == "**":
        _power_size(left, right)
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _budget().charge(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _check_format_widths(left, brace_style=False)
        _check_args(right if isinstance(right, tuple) else (right,), {})


def _joined_size(items: Any, sep: str = "") -> None:
    if isinstance(items, (list, tuple)):
        _budget().charge(sum(len(x) if isinstance(x, str) else 16 for x in items) + len(sep) * len(items))


def _replaced_size(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        hits = text.count(old) if old else len(text) + 1
        _budget().charge(len(text) + hits * max(len(new) - len(old), 0))


# -- the environment ----------------------------------------------------------------------------


def _bounded_iter(iterable: Iterable[Any], body_chars: int = 0) -> Iterator[Any]:
    """A loop's items, one step (and the loop body's literal text) charged per pass."""
    budget = _budget()
    for item in iterable:
        budget.step()
        if body_chars:
            budget.charge(body_chars)
        yield item


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's compiler with two hooks: loops iterate through `_bounded_iter`, and `~`
    concatenations go through `environment.bounded_concat`."""

    def visit_For(self, node: nodes.For, frame) -> None:
        body_chars = sum(len(d.data) for d in node.find_all(nodes.TemplateData))
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"),
                               [node.iter, nodes.Const(body_chars)], [], None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` marks assistant text for training
    masks; for a prompt it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _TemplateDict:
    """`dict(...)` for templates, without the attributes of the `dict` type itself (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace(...)` refusing underscore names, so a template cannot set `__class__` (as transformers)."""

    def __init__(*args, **kwargs):  # noqa: N805 - the same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a template cannot set the attribute {name!r} on a namespace")


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: unlike jinja2's own, no HTML escaping.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _bounded_filter(name: str, func):
    """Wrap a filter: integer arguments checked, known amplifiers sized first, result charged."""

    @wraps(func)
    def bounded(*args, **kwargs):
        # Filters marked pass_context/pass_eval_context/pass_environment get that object first.
        values = args[1:] if getattr(func, "jinja_pass_arg", None) else args
        _check_args(values[1:], kwargs)
        if name == "join" and values:
            items = values[0] if isinstance(values[0], (list, tuple, str)) else list(values[0])
            _joined_size(items, values[1] if len(values) > 1 and isinstance(values[1], str) else "")
            args = args[:len(args) - len(values)] + (items,) + values[1:]
        elif name == "replace" and len(values) >= 3:
            _replaced_size(*values[:3])
        elif name == "format" and values and isinstance(values[0], str):
            _check_format_widths(values[0], brace_style=False)
        return _budget().made(func(*args, **kwargs))

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (trim_blocks, lstrip_blocks, loopcontrols,
    `raise_exception`, `strftime_now`, its `tojson`, `dict` and `namespace`), with budgets."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols],
                         finalize=self._charge_output)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace
        # lipsum(n) writes n paragraphs of filler; no chat template needs it.
        self.globals.pop("lipsum", None)
        self.bounded_iter = _bounded_iter

    @staticmethod
    def _charge_output(value: Any) -> Any:
        if isinstance(value, str):
            _budget().charge(len(value))
        return value

    @staticmethod
    def bounded_concat(parts: tuple) -> str:
        budget = _budget()
        texts = [str(p) for p in parts]
        budget.charge(sum(map(len, texts)))
        return "".join(texts)

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return _budget().made(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format_widths(value.__self__, brace_style=True)
        return wrapped

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        budget = _budget()
        budget.step()
        name = getattr(__obj, "__name__", "")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple)) or name in ("format", "format_map"):
            _check_args(args, kwargs)  # 'a'.center(10**9), '{:{}}'.format('a', 10**9)
        if isinstance(owner, str) and name == "join" and args:
            _joined_size(args[0], owner)
        elif isinstance(owner, str) and name == "replace" and len(args) >= 2:
            _replaced_size(owner, args[0], args[1])
        elif isinstance(__obj, LoopContext) and args:
            # `loop(children)` in a recursive loop: its passes are steps too.
            args = (_bounded_iter(args[0]),) + args[1:]
        return budget.made(super().call(__context, __obj, *args, **kwargs))


def render_bounded(template, variables: dict, budget: RenderBudget) -> str:
    """Render `template` (made by a `BoundedSandbox`) within `budget`; the output is capped
    at `budget.output_chars` as it streams."""
    token = _current.set(budget)
    try:
        parts, size = [], 0
        for part in template.generate(**variables):
            size += len(part)
            if size > budget.output_chars:
                raise TemplateLimitError(f"its output passed {budget.output_chars:,} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        _current.reset(token)
