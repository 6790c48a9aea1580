"""How a raw prompt starts: the one place that decides whether it gets a BOS token."""

from __future__ import annotations


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] when the model's tokenizer asks for one (`add_bos`), else []. Models differ:
    Gemma and Llama 3 want it, SmolLM2 and Qwen do not."""
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None:
        return [tokenizer.bos_id]
    return []
