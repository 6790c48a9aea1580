"""Tool calls: which syntax a model writes its calls in, reading them out of a reply (whole or
as it streams), and the grammar that forces a valid call (`tool_choice` required or named).

Syntaxes, chosen from the model's chat template (and vocabulary):
- `hermes`: Hermes / Qwen 2.5 / Qwen 3 -- `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, after optional text;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` per call;
- `json` (Llama 3.x and any other template that takes tools): the reply is the call,
  `{"name": ..., "parameters" | "arguments": {...}}` (after `<|python_tag|>` if any), several
  separated by `;`.

The reply is read from its token ids decoded with special tokens kept (Mistral's
`[TOOL_CALLS]` is a control token, which the engine's text leaves out).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str

    def wire(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(name: Any, arguments: Any, known: set[str]) -> ToolCall | None:
    if not isinstance(name, str) or name not in known:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False),
                    f"call_{uuid.uuid4().hex[:24]}")


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after spaces) and where it ends."""
    start = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


class ToolSyntax:
    """One way of writing calls. `markers`: text that starts a call (what streaming holds
    back once seen, or while the reply's end could still be the start of one)."""

    name = ""
    markers: tuple[str, ...] = ()

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, calls), or None when the reply holds no valid call."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """How much of `text` is surely content (may be sent now): up to the first marker,
        or to a partial marker at the end."""
        cut = len(text)
        for marker in self.markers:
            found = text.find(marker)
            if found >= 0:
                cut = min(cut, found)
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    cut = min(cut, len(text) - n)
                    break
        return cut

    def lark(self, call_schema: Mapping[str, Any], parallel: bool, marker_ids: Mapping[str, int]) -> str:
        raise NotImplementedError


def _literal(text: str) -> str:
    return json.dumps(text)


def _token_or_text(text: str, marker_ids: Mapping[str, int]) -> str:
    """A grammar term for `text`: its control token when the vocabulary has one (a control
    token's bytes are not text to llguidance), else the literal text."""
    return f"<[{marker_ids[text]}]>" if text in marker_ids else _literal(text)


class HermesSyntax(ToolSyntax):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text, known):
        start = text.find("<tool_call>")
        if start < 0:
            return None
        calls = []
        for body in self._block.findall(text[start:]):
            value = _json_prefix(body)
            if value is None or not isinstance(value[0], dict):
                return None
            call = _call(value[0].get("name"), value[0].get("arguments"), known)
            if call is None:
                return None
            calls.append(call)
        return (text[:start].strip(), calls) if calls else None

    def lark(self, call_schema, parallel, marker_ids):
        open_, close = (_token_or_text(t, marker_ids) for t in ("<tool_call>", "</tool_call>"))
        repeat = "+" if parallel else ""
        return (f'start: ({open_} "\\n" call "\\n" {close} "\\n"?){repeat}\n'
                f"call: %json {json.dumps(call_schema)}\n")


class MistralSyntax(ToolSyntax):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse(self, text, known):
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return None
        rest = text[start + len("[TOOL_CALLS]"):]
        calls: list[ToolCall] = []
        value = _json_prefix(rest)
        if value is not None and isinstance(value[0], (list, dict)):
            items = value[0] if isinstance(value[0], list) else [value[0]]
            for item in items:
                call = _call(item.get("name"), item.get("arguments"), known) if isinstance(
                    item, dict) else None
                if call is None:
                    return None
                calls.append(call)
        else:  # v11+: name[ARGS]{...}, each call after its own [TOOL_CALLS]
            for part in rest.split("[TOOL_CALLS]"):
                name, sep, args = part.partition("[ARGS]")
                value = _json_prefix(args) if sep else None
                call = _call(name.strip(), value[0], known) if value else None
                if call is None:
                    return None
                calls.append(call)
        return (text[:start].strip(), calls) if calls else None

    def lark(self, call_schema, parallel, marker_ids):
        marker = _token_or_text("[TOOL_CALLS]", marker_ids)
        more = ' (", " call)*' if parallel else ""
        return (f'start: {marker} "[" call{more} "]"\n'
                f"call: %json {json.dumps(call_schema)}\n")


class JsonSyntax(ToolSyntax):
    name = "json"
    markers = ("<|python_tag|>", "{")

    def parse(self, text, known):
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return None
        calls = []
        while body:
            value = _json_prefix(body)
            if value is None or not isinstance(value[0], dict):
                return None
            item = value[0]
            arguments = item.get("parameters", item.get("arguments"))
            call = _call(item.get("name"), arguments, known)
            if call is None:
                return None
            calls.append(call)
            body = body[value[1]:].strip().removeprefix(";").strip()
        return ("", calls) if calls else None

    def hold_from(self, text):
        # A call is the whole reply: hold back only while the reply may still become one.
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or "<|python_tag|>".startswith(
                stripped[:14]) or stripped.startswith("<|python_tag|>"):
            return 0
        return len(text)

    def lark(self, call_schema, parallel, marker_ids):
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: %json {json.dumps(call_schema)}\n"


def syntax_for(template, tokenizer) -> ToolSyntax:
    """The syntax this model's template teaches (see the module docstring)."""
    source = getattr(template, "source", "") or ""
    if "<tool_call>" in source:
        return HermesSyntax()
    if "[TOOL_CALLS]" in source or tokenizer.token_id("[TOOL_CALLS]") is not None:
        return MistralSyntax()
    return JsonSyntax()


def marker_token_ids(tokenizer, syntax: ToolSyntax) -> dict[str, int]:
    """The syntax's markers that are single control tokens in this vocabulary."""
    names = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]",)}
    out = {}
    for text in names.get(syntax.name, ()):
        token = tokenizer.token_id(text)
        if token is not None and tokenizer.is_control(token):
            out[text] = token
    return out


def call_schema(tools: Sequence[Mapping[str, Any]], only: str | None, syntax: ToolSyntax) -> dict:
    """A JSON schema for one call of any of `tools` (or only the one named `only`)."""
    key = "arguments"
    options = []
    for tool in tools:
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object",
                        "properties": {"name": {"const": function["name"]}, key: parameters},
                        "required": ["name", key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": _JSON_STYLE}


class ToolCallReader:
    """A streamed reply with tools on: content goes out as it comes, except what may be (or
    is) a call, which is held back and read when the reply ends."""

    def __init__(self, tokenizer, syntax: ToolSyntax, known: set[str], stop_ids: set[int],
                 parallel: bool):
        self._decoder = tokenizer.stream_decoder(skip_special=False)
        self._syntax, self._known, self._stop_ids = syntax, known, stop_ids
        self._parallel = parallel
        self.raw = ""
        self._sent = 0  # characters of `raw` already sent as content

    def push(self, token_id: int) -> str:
        """The content that can be sent now."""
        if token_id not in self._stop_ids:
            self.raw += self._decoder.push(token_id)
        return self._release(self._syntax.hold_from(self.raw))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the reply has ended."""
        self.raw += self._decoder.flush()
        found = self._syntax.parse(self.raw, self._known)
        if found is None:
            return self._release(len(self.raw)), []
        content, calls = found
        if not self._parallel:
            calls = calls[:1]
        before = self.raw.find(content) + len(content) if content else 0
        return self._release(max(before, self._sent)), calls

    def _release(self, upto: int) -> str:
        upto = max(upto, self._sent)
        text, self._sent = self.raw[self._sent:upto], upto
        return text


def parse_reply(tokenizer, syntax: ToolSyntax, ids: Sequence[int], known: set[str],
                stop_ids: set[int], parallel: bool) -> tuple[str, list[ToolCall]] | None:
    """A whole reply's calls: (content, calls), or None when it holds none."""
    text = tokenizer.decode([t for t in ids if t not in stop_ids], skip_special=False)
    found = syntax.parse(text, known)
    if found is None:
        return None
    content, calls = found
    return content, (calls if parallel else calls[:1])
