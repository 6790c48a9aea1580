"""Chat templates: how a conversation becomes the token ids a model was trained on.

A template renders messages to text in which control tokens are spelled out
(`<start_of_turn>`), to be encoded with `Tokenizer.encode(text, special=True)`; the BOS id is
added by `encode_chat`, never by the template text, so it is never doubled.

`template_for` is the one place that picks a template: a Jinja template stored in the GGUF
(`tokenizer.chat_template`) wins; otherwise the built-in format for the architecture. Gemma 3's
GGUF stores none, so its turn format is built in. New formats plug into `_BUILTIN`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from app.models.errors import ModelError


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str


class ChatTemplate(Protocol):
    name: str

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str: ...

    def stop_token_ids(self, tokenizer) -> set[int]: ...


def _check_roles(messages: Sequence[Message]) -> None:
    for m in messages:
        if m.role not in ("system", "user", "assistant"):
            raise ValueError(f"Unknown chat role {m.role!r}.")


class GemmaTemplate:
    """`<start_of_turn>user\\n…<end_of_turn>\\n<start_of_turn>model\\n…`.

    Gemma has no system role: system text is merged into the first user turn, as Google's
    own template does, separated by a blank line.
    """

    name = "gemma"

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        _check_roles(messages)
        system = "\n\n".join(m.content for m in messages if m.role == "system")
        parts = []
        for m in messages:
            if m.role == "system":
                continue
            content = m.content
            if system and m.role == "user":
                content, system = f"{system}\n\n{content}", ""
            role = "model" if m.role == "assistant" else "user"
            parts.append(f"<start_of_turn>{role}\n{content.strip()}<end_of_turn>\n")
        if system:  # a system prompt with no user turn yet still reaches the model
            parts.insert(0, f"<start_of_turn>user\n{system}<end_of_turn>\n")
        if add_generation_prompt:
            parts.append("<start_of_turn>model\n")
        return "".join(parts)

    def stop_token_ids(self, tokenizer) -> set[int]:
        end = tokenizer.token_id("<end_of_turn>")
        return {end} if end is not None else set()


class JinjaTemplate:
    """A template shipped inside the model file, rendered in a sandbox."""

    name = "jinja"

    def __init__(self, source: str, eos_token: str = ""):
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
            raise ModelError("This model's chat template needs the jinja2 package.") from exc
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelError(f"The model's chat template is invalid: {exc}") from exc
        self._eos = eos_token

    @staticmethod
    def _raise(message: str):
        raise ValueError(message)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        _check_roles(messages)
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt, bos_token="", eos_token=self._eos)

    def stop_token_ids(self, tokenizer) -> set[int]:
        ids = set()
        for piece in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>"):
            token = tokenizer.token_id(piece)
            if token is not None:
                ids.add(token)
        return ids


_BUILTIN = {"gemma3": GemmaTemplate, "gemma2": GemmaTemplate, "gemma": GemmaTemplate}


def template_for(metadata: dict, architecture: str) -> ChatTemplate:
    source = metadata.get("tokenizer.chat_template")
    if isinstance(source, str) and source.strip():
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        eos = tokens[eos_id] if eos_id is not None and 0 <= eos_id < len(tokens) else ""
        return JinjaTemplate(source, eos)
    if architecture in _BUILTIN:
        return _BUILTIN[architecture]()
    raise ModelError(f"No chat template is known for {architecture!r} models.")


def encode_chat(tokenizer, template: ChatTemplate, messages: Sequence[Message],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids for a conversation: BOS (when the model wants one) + the rendered turns."""
    ids = tokenizer.encode(template.render(messages, add_generation_prompt), special=True)
    return ([tokenizer.bos_id] if tokenizer.add_bos else []) + ids


def template_from_source(source: str, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """A Jinja chat template given as text (a Hugging Face folder's tokenizer_config.json)."""
    return JinjaTemplate(source, eos_token)
