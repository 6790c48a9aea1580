"""Fill-in-the-middle for /v1/completions `suffix`: the prompt becomes the model family's FIM
layout (prefix, then suffix, then the "middle" marker the model continues from), for
vocabularies that have FIM tokens. Others cannot do it, and the API says so (a 400).

Layouts, found by token name (prefix-suffix-middle order for all of them):
- `<|fim_prefix|>` `<|fim_suffix|>` `<|fim_middle|>`: Qwen2.5-Coder, CodeGemma;
- `<fim_prefix>` `<fim_suffix>` `<fim_middle>`: StarCoder 1/2 and their kin;
- `<｜fim▁begin｜>` `<｜fim▁hole｜>` `<｜fim▁end｜>`: DeepSeek-Coder;
- `▁<PRE>` `▁<SUF>` `▁<MID>` (or without `▁`): Code Llama.
"""

from __future__ import annotations

FIM_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    ("<PRE>", "<SUF>", "<MID>"),
)


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the first layout the vocabulary has whole."""
    for names in FIM_LAYOUTS:
        ids = tuple(tokenizer.token_id(name) for name in names)
        if all(i is not None for i in ids):
            return ids  # type: ignore[return-value]
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> list[int] | None:
    """Token ids for filling between `prefix` and `suffix` (BOS first when the model wants
    one), or None when the vocabulary has no FIM tokens."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        return None
    pre, suf, mid = ids
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return bos + [pre] + tokenizer.encode(prefix) + [suf] + tokenizer.encode(suffix) + [mid]
