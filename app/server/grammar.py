"""Constrained decoding for structured output: a JSON schema (or "any JSON object") becomes a
per-request logits processor (see `app.engine.sampling.LogitsProcessor`) that bans, at each
step, every token that could not continue a reply the grammar accepts.

The grammar engine is llguidance (Microsoft's Rust parser behind Guidance; also used by
vLLM, SGLang and llama.cpp): it computes a token mask from an Earley parser and a lexer over
the whole vocabulary in well under a millisecond per token on a CPU, has no dependencies, and
ships abi3 wheels for Linux, macOS and Windows. `scripts/grammar_overhead.py` measures it
against xgrammar (which needs triton and transformers at install) on the embedded model.

JSON is generated compactly, with one space after ':' and ',': a small model given free
whitespace can pad a reply with newlines until max_tokens runs out.

Threads: `GrammarFactory` is built once per model (the vocabulary's bytes, ~1 s for 262k
tokens) and is read-only after; each request's `JsonConstraint` lives on the engine thread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The schema cannot be turned into a grammar; the message says why."""


class GrammarFactory:
    """One model's vocabulary as llguidance sees it; makes per-request constraints.
    `vocab_size`: the logits' width (the model's, which may exceed the tokenizer's).
    `stop_ids`: the tokens that end a reply; allowed once the grammar is complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int]):
        import llguidance

        self.vocab_size = vocab_size
        stop_ids = sorted(set(int(t) for t in stop_ids))
        if not stop_ids:
            raise GrammarError("the model has no end-of-reply token to close the output with")
        self._tokenizer = llguidance.LLTokenizer(
            _VocabularyBytes(tokenizer, vocab_size, stop_ids[0]), n_vocab=vocab_size,
            eos_token=stop_ids)
        self._matcher_class = llguidance.LLMatcher

    def json_schema(self, schema: Mapping[str, Any] | None) -> Callable[[], "JsonConstraint"]:
        """A processor factory for replies that are one JSON value matching `schema`
        (None: any JSON object). Raises GrammarError for a schema it cannot compile."""
        schema = {"type": "object"} if schema is None else dict(schema)
        try:
            grammar = self._matcher_class.grammar_from_json_schema(
                json.dumps(schema), overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema is not valid: {exc}") from None
        return self._factory(grammar, "the JSON schema cannot be enforced")


    def lark(self, grammar: str) -> Callable[[], "JsonConstraint"]:
        """A processor factory for a Lark grammar (llguidance's dialect: `%json {schema}`
        embeds a JSON schema, `<[id]>` is one token). Raises GrammarError."""
        try:
            compiled = self._matcher_class.grammar_from_lark(grammar)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the grammar is not valid: {exc}") from None
        return self._factory(compiled, "the grammar cannot be enforced")

    def _factory(self, grammar: str, failure: str) -> Callable[[], "JsonConstraint"]:
        """Compile once, here (the caller's thread, not the engine's: a large schema takes
        a while), and hand each request a copy of the fresh matcher."""
        matcher = self._matcher_class(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{failure}: {matcher.get_error()}")
        return lambda: JsonConstraint(matcher.deep_copy(), self.vocab_size)


class JsonConstraint:
    """One request's grammar state. Called before each sample: it first consumes the tokens
    sampled since the last call, then bans what cannot come next."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab = vocab_size
        self._consumed = 0
        words = (vocab_size + 31) // 32
        self._bitmask = np.zeros(words, dtype=np.int32)  # one bit per token, little-endian

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        new = generated[self._consumed:]
        if new and not self._matcher.consume_tokens(list(new)):
            raise ValueError(f"the output format's grammar broke: {self._matcher.get_error()}")
        self._consumed = len(generated)
        self._bitmask.fill(0)
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._matcher.is_error():
            raise ValueError(f"the output format's grammar broke: {self._matcher.get_error()}")
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        banned = allowed[: logits.shape[-1]] == 0
        if logits.device.type == "cpu" and logits.is_contiguous():
            # numpy, single-threaded: torch's masked_fill on one 262k row wakes every intra-op
            # thread, which costs more than the work on a busy machine.
            np.copyto(logits.numpy(), -np.inf, where=banned)
            return logits
        return logits.masked_fill_(torch.from_numpy(banned).to(logits.device), -math.inf)


class _VocabularyBytes:
    """What llguidance's TokenizerWrapper reads: each token's bytes, the specials, and a way
    to tokenize text (it uses it for literal strings in grammars)."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        n = tokenizer.vocab_size
        self.tokens = [tokenizer._raw_bytes(i) if i < n else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_control(i)]
        self.eos_token_id = eos_id
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text)
