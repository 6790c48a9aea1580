"""Chat templates: how a conversation becomes the token ids a model was trained on.

A template renders messages to text in which control tokens are spelled out
(`<start_of_turn>`, `<|im_start|>`), to be encoded with `Tokenizer.encode(text, special=True)`.

`template_for` (GGUF) and `template_from_source` (a Hugging Face folder) are the places that
pick a template. The model's own Jinja template wins, rendered as transformers'
`apply_chat_template` renders it (same environment, same variables, same text) in a sandbox
with budgets (`template_sandbox`); a conversation transformers would refuse (a system turn
for Gemma 2, two user turns in a row) is adapted and tried again. Without a template, or with
one that does not compile, `fallback_template` picks by architecture and vocabulary: Gemma's
turn format, ChatML, Llama 3's headers, or a generic "User:/Assistant:" format; `notice`
says when the format is such a guess.

BOS: templates are rendered with the real `bos_token`, as transformers does, so a template
that writes it mid-text (or relies on it) renders faithfully. `chat_prompt`/`encode_chat` add
the BOS id when the tokenizer wants one, and then drop one leading `bos_token` from the text
(what llama.cpp does), so the ids hold exactly one BOS either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Container, Mapping, Protocol, Sequence

from app.models.errors import ModelError
from app.models.reasoning import prompt_opens_reasoning

ROLES = ("system", "user", "assistant", "tool")

# Pieces that end a turn in one family or another; a template stops on those it writes.
END_OF_TURN_PIECES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
                      "<|END_OF_TURN_TOKEN|>", "<|return|>", "<|call|>")
# Pieces that end the text itself: a stop wherever the vocabulary has them.
END_OF_TEXT_PIECES = ("<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")

GENERIC_NOTICE = "This model has no chat template; using a generic one."


class ChatTemplateError(ModelError, ValueError):
    """A chat template that does not compile or refuses a conversation. A `ModelError` for
    the loader and a `ValueError` for the callers that catch bad input; the message names
    the template as the cause. `over_limit`: the template ran past its budgets."""

    over_limit = False


@dataclass(frozen=True)
class Message:
    """One turn. `content` may be None for an assistant turn that only calls tools.

    tool_calls: OpenAI's shape, [{"id", "type": "function", "function": {"name", "arguments"}}],
    with arguments as a JSON string or a dict. tool_call_id and name belong to role "tool".
    """

    role: str  # "system", "user", "assistant" or "tool"
    content: str | None
    tool_calls: Sequence[Mapping[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatTemplate(Protocol):
    name: str
    bos_token: str  # written by the template at the start when it wants BOS ("" if never)
    supports_tools: bool
    notice: str | None  # a line for the person when the format is a guess
    stop_strings: tuple[str, ...]  # text stops for formats without end-of-turn tokens

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str: ...

    def stop_token_ids(self, tokenizer) -> set[int]: ...


def _check_roles(messages: Sequence[Message], allowed: Sequence[str] = ROLES) -> None:
    for m in messages:
        if m.role not in allowed:
            raise ValueError(f"Unknown chat role {m.role!r}; expected one of {', '.join(allowed)}.")


def _system_text(messages: Sequence[Message]) -> str:
    """The system messages' text, joined by blank lines, for the built-in formats (which
    know the system, user and assistant roles only: others are refused)."""
    _check_roles(messages, ("system", "user", "assistant"))
    return "\n\n".join(m.content or "" for m in messages if m.role == "system")


class _BuiltinFormat:
    """What the formats written here share: no BOS of their own (`encode_chat` adds it), no
    tools, no notice, no text stops."""

    bos_token = ""
    supports_tools = False
    notice = None
    stop_strings = ()


class GemmaTemplate(_BuiltinFormat):
    """`<start_of_turn>user\\n…<end_of_turn>\\n<start_of_turn>model\\n…`.

    Renders valid conversations exactly as Google's Gemma 3 template does (without its BOS,
    which `encode_chat` adds): system text, joined by blank lines, prefixes the first user
    turn; every turn's text is trimmed. Unlike that template it does not refuse two user turns
    in a row (a reply that failed and was dropped leaves one), and it knows no tools.
    """

    name = "gemma"

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        system = _system_text(messages)
        parts = []
        for m in messages:
            if m.role == "system":
                continue
            prefix = ""
            if system and m.role == "user":
                prefix, system = f"{system}\n\n", ""
            role = "model" if m.role == "assistant" else "user"
            parts.append(f"<start_of_turn>{role}\n{prefix}{(m.content or '').strip()}<end_of_turn>\n")
        if system:  # a system prompt with no user turn yet still reaches the model
            parts.insert(0, f"<start_of_turn>user\n{system}<end_of_turn>\n")
        if add_generation_prompt:
            parts.append("<start_of_turn>model\n")
        return "".join(parts)

    def stop_token_ids(self, tokenizer) -> set[int]:
        end = tokenizer.token_id("<end_of_turn>")
        return {end} if end is not None else set()


class ContinuationTemplate(_BuiltinFormat):
    """A conversation as one text, for a base model, which continues text instead of
    answering turns: the system text (then a blank line) and every message's text in order,
    as written, with no markers, so the reply carries on where the last message ends. The
    chat window uses it for the built-in base models (`embedded.continues_text`); the API
    server and `generate --chat` keep the file's own template, as llama.cpp does."""

    name = "continuation"

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        system = _system_text(messages)
        text = "".join(m.content or "" for m in messages if m.role != "system")
        return f"{system}\n\n{text}" if system else text

    def stop_token_ids(self, tokenizer) -> set[int]:
        return set()  # (EOS still ends a reply: `LoadedModel.stop_token_ids`)


def _tool_call_for_template(call: Mapping[str, Any], object_arguments: bool) -> dict:
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if object_arguments and isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    elif not object_arguments and isinstance(arguments, Mapping):
        function["arguments"] = json.dumps(arguments, ensure_ascii=False)
    call["function"] = function
    call.setdefault("type", "function")
    return call


def _message_for_template(m: Message, object_arguments: bool) -> dict:
    """A message as transformers hands it to a template: a plain dict without None values."""
    out: dict[str, Any] = {"role": m.role}
    if m.content is not None:
        out["content"] = m.content
    if m.tool_calls:
        out["tool_calls"] = [_tool_call_for_template(c, object_arguments) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _with_empty_content(messages: Sequence[Message]) -> list[Message]:
    """Tool-calling turns with content "" instead of none (Qwen 3 and R1 templates read it)."""
    return [replace(m, content="") if m.content is None else m for m in messages]


def _adapted(messages: Sequence[Message]) -> list[Message]:
    """The conversation in the shape strict templates accept: no None content, system text
    at the head of the first user turn, no two user (or assistant) turns in a row."""
    system = "\n\n".join(m.content or "" for m in messages if m.role == "system")
    out: list[Message] = []
    for m in messages:
        if m.role == "system":
            continue
        if m.content is None:
            m = replace(m, content="")
        if m.role == "user" and system:
            m, system = replace(m, content=f"{system}\n\n{m.content}"), ""
        last = out[-1] if out else None
        if (last and last.role == m.role and m.role in ("user", "assistant")
                and not last.tool_calls and not m.tool_calls):
            out[-1] = replace(last, content=f"{last.content}\n\n{m.content}")
        else:
            out.append(m)
    if system:  # no user turn to carry it
        out.insert(0, Message("user", system))
    return out


def _plain(value: Any) -> Any:
    """Tool specs reduced to JSON types, so a template sees no object with methods."""
    return json.loads(json.dumps(value))


class JinjaTemplate:
    """A Jinja chat template (the model's own, or a built-in fallback), rendered as
    transformers renders it, within `template_sandbox`'s budgets.

    `tool_source`: a second template to use when tools are given (Hugging Face's named
    "tool_use" template). Tool-call arguments go to the template as dicts (what Qwen 2.5,
    Llama 3.1 and Mistral templates read with `| tojson`); a template that fails on dicts is
    rendered again with the JSON strings (DeepSeek R1 concatenates them).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *, name: str = "jinja",
                 tool_source: str | None = None, notice: str | None = None,
                 stop_strings: Sequence[str] = (), special_tokens: Mapping[str, str] | None = None):
        self.name = name
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.notice = notice
        self.stop_strings = tuple(stop_strings)
        self.supports_tools = bool(re.search(r"\btools\b", source + (tool_source or "")))
        # transformers passes the tokenizer's named special tokens (bos/eos/unk/pad/…) that are set.
        self._special = {k: v for k, v in (special_tokens or {}).items() if v}
        self._special.update({k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v})
        self._template = self._compile(source)
        self._tool_template = self._compile(tool_source) if tool_source else None

    @staticmethod
    def _compile(source: str):
        from jinja2.exceptions import TemplateError

        from app.models.template_sandbox import BoundedSandbox, TemplateLimitError

        try:
            return BoundedSandbox().from_string(source)
        except (TemplateError, TemplateLimitError, RecursionError, MemoryError) as exc:
            raise ChatTemplateError(f"This model's chat template is invalid: {exc}") from exc

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        """The conversation as text. `options` are extra template variables (Qwen 3 reads
        `enable_thinking`). Raises `ChatTemplateError` with the template's own reason.

        What transformers renders is rendered the same. Where the template refuses the
        conversation, it is tried again, adapted as llama.cpp adapts one: tool-call arguments as
        JSON strings; an empty content for a tool-calling turn; then also system text merged
        into the first user turn and consecutive same-role turns merged.
        """
        _check_roles(messages)
        template = self._tool_template if tools and self._tool_template is not None else self._template
        has_calls = any(m.tool_calls for m in messages)
        variants = [list(messages)]
        for adapted in (_with_empty_content(messages), _adapted(messages)):
            if adapted not in variants:
                variants.append(adapted)
        attempts = [(v, as_object) for v in variants for as_object in ((True, False) if has_calls else (True,))]
        first_error = None
        for conversation, object_arguments in attempts:
            try:
                return self._render(template, conversation, add_generation_prompt, tools, options,
                                    object_arguments)
            except ChatTemplateError as exc:
                if exc.over_limit:
                    raise
                first_error = first_error or exc
        raise first_error

    def _render(self, template, messages, add_generation_prompt, tools, options, object_arguments) -> str:
        from app.models.template_sandbox import RenderBudget, TemplateLimitError, render_bounded

        variables = {
            **self._special,
            **options,
            "messages": [_message_for_template(m, object_arguments) for m in messages],
            "tools": _plain(list(tools)) if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        input_chars = sum(len(m.content or "") for m in messages) + (len(json.dumps(tools)) if tools else 0)
        try:
            return render_bounded(template, variables, RenderBudget.for_input(input_chars))
        except Exception as exc:  # the template's code is not ours: any failure is its failure
            reason = str(exc) or type(exc).__name__
            error = ChatTemplateError(f"This model's chat template failed: {reason}")
            error.over_limit = isinstance(exc, (TemplateLimitError, RecursionError, MemoryError))
            raise error from exc

    def stop_token_ids(self, tokenizer) -> set[int]:
        """The end-of-turn tokens this template writes (and end-of-text tokens the vocabulary
        has). The tokenizer's EOS is the caller's to add."""
        text = self.source
        pieces = [p for p in END_OF_TURN_PIECES if p in text] + list(END_OF_TEXT_PIECES)
        if "eos_token" in text and self.eos_token:
            pieces.append(self.eos_token)  # Mistral and Phi end an assistant turn with EOS (</s>)
        ids = {tokenizer.token_id(p) for p in pieces}
        ids.discard(None)
        return ids


# -- fallbacks for files without a template --------------------------------------------------

_CHATML_SOURCE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA3_SOURCE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + (message['content'] or '') | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_GENERIC_SOURCE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ (message['content'] or '') + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + (message['content'] or '') + '\\n\\n' }}"
    "{% else %}{{ 'User: ' + (message['content'] or '') + '\\n\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_CHATML_ARCHITECTURES = ("qwen2", "qwen3", "qwen2moe", "qwen3moe")


def fallback_template(architecture: str, vocabulary: Container[str], *, bos_token: str = "",
                      eos_token: str = "") -> ChatTemplate:
    """The format to use when a model ships no template: Gemma's for Gemma, ChatML for Qwen or
    a vocabulary with `<|im_start|>`, Llama 3's for a vocabulary with `<|start_header_id|>`,
    otherwise a generic "User:/Assistant:" one that says so in `notice`."""
    if architecture in _GEMMA_ARCHITECTURES:
        return GemmaTemplate()
    if architecture in _CHATML_ARCHITECTURES or "<|im_start|>" in vocabulary:
        return JinjaTemplate(_CHATML_SOURCE, bos_token, eos_token, name="chatml")
    if "<|start_header_id|>" in vocabulary:
        return JinjaTemplate(_LLAMA3_SOURCE, bos_token, eos_token, name="llama3")
    return JinjaTemplate(_GENERIC_SOURCE, bos_token, eos_token, name="generic", notice=GENERIC_NOTICE,
                         stop_strings=("\nUser:",))


def _pick_sources(source: str | Sequence[Mapping[str, str]]) -> tuple[str | None, str | None]:
    """(default, tool_use) from a template string or Hugging Face's list of named templates."""
    if isinstance(source, str):
        return source, None
    named = {}
    for entry in source or ():
        if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
            named[entry.get("name")] = entry["template"]
    return named.get("default"), named.get("tool_use")


def template_from_source(source: str | Sequence[Mapping[str, str]], *, bos_token: str,
                         eos_token: str) -> JinjaTemplate:
    """The template from a Hugging Face tokenizer_config.json's `chat_template` (a string, or a
    list of {"name", "template"} of which "default" is used, and "tool_use" when tools are
    given). Raises `ChatTemplateError` when there is no usable template in it."""
    default, tool_use = _pick_sources(source)
    if not default or not default.strip():
        raise ChatTemplateError("This model's chat template is empty or has no \"default\" entry.")
    return JinjaTemplate(default, bos_token, eos_token, tool_source=tool_use)


def template_for(metadata: Mapping[str, Any], architecture: str) -> ChatTemplate:
    """The chat template for a GGUF file: `tokenizer.chat_template` (with
    `tokenizer.chat_template.tool_use` for tools) when present, else `fallback_template`.
    A template that does not compile also falls back, its error in the fallback's `notice`."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def piece(key: str) -> str:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else ""

    bos, eos = piece("bos"), piece("eos")
    source = metadata.get("tokenizer.chat_template")
    if isinstance(source, str) and source.strip():
        tool_use = metadata.get("tokenizer.chat_template.tool_use")
        special = {"unk_token": piece("unknown"), "pad_token": piece("padding")}
        try:
            return JinjaTemplate(source, bos, eos, special_tokens=special,
                                 tool_source=tool_use if isinstance(tool_use, str) and tool_use.strip() else None)
        except ChatTemplateError as exc:  # the model stays usable, with a format that says it is a guess
            fallback = fallback_template(architecture, tokens, bos_token=bos, eos_token=eos)
            fallback.notice = f"{exc} Using the {fallback.name} format instead."
            return fallback
    return fallback_template(architecture, tokens, bos_token=bos, eos_token=eos)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text (without the BOS that `ids` starts with, if any), its
    token ids, and whether the reply starts inside a thinking block the prompt opened (an R1
    distill's `<think>\n`): `ReasoningSplitter(starts_in_reasoning=...)` takes it."""

    text: str
    ids: list[int]
    starts_in_reasoning: bool


def chat_prompt(tokenizer, template: ChatTemplate, messages: Sequence[Message],
                add_generation_prompt: bool = True, *, tools: Sequence[Mapping[str, Any]] | None = None,
                **options: Any) -> ChatPrompt:
    """Render and encode a conversation: exactly one BOS when the model wants one, then the turns."""
    text = template.render(messages, add_generation_prompt, tools=tools, **options)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    if bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token):]
    ids = bos + tokenizer.encode(text, special=True)
    return ChatPrompt(text, ids, add_generation_prompt and prompt_opens_reasoning(text))


def encode_chat(tokenizer, template: ChatTemplate, messages: Sequence[Message],
                add_generation_prompt: bool = True, *, tools: Sequence[Mapping[str, Any]] | None = None,
                **options: Any) -> list[int]:
    """Token ids for a conversation (`chat_prompt(...).ids`)."""
    return chat_prompt(tokenizer, template, messages, add_generation_prompt, tools=tools, **options).ids
