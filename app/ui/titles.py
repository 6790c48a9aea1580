"""Chat titles: a quick one from the first message at once, a better one from the model in
the background after the first reply. Plain text functions; the controller runs the request.
"""

from __future__ import annotations

import re

FALLBACK_WORDS = 6
MAX_TITLE_CHARS = 60
MIN_TITLE_LETTERS = 3
TITLE_MAX_TOKENS = 16
_EXCERPT_CHARS = 600  # of the question and of the reply, for the title prompt


def fallback_title(text: str, attachment_names: list[str]) -> str:
    """The title a chat gets as it is sent: a document chat is named after its document
    (every "Summarise this document." chat would look alike), any other after the first
    words of its first line."""
    if attachment_names:
        more = len(attachment_names) - 1
        return attachment_names[0] + (f" and {more} more" if more else "")
    first_line = next((line for line in text.splitlines() if line.strip()), "")
    words = first_line.split()
    title = " ".join(words[:FALLBACK_WORDS])
    if len(words) > FALLBACK_WORDS:
        title = title.rstrip(",;:.") + "…"
    return _cap(title) or "New chat"


def title_request(question: str, reply: str, attachment_names: list[str]) -> str:
    """What the model is asked: one user turn, the exchange quoted inside it."""
    documents = f"Attached: {', '.join(attachment_names)}\n" if attachment_names else ""
    return ("Write a short title (3 to 6 words) for this conversation. Reply with the title "
            "only, without quotes.\n\n"
            f"{documents}User: {question.strip()[:_EXCERPT_CHARS]}\n"
            f"Assistant: {reply.strip()[:_EXCERPT_CHARS]}")


def clean_title(raw: str) -> str | None:
    """The model's answer as a title, or None when it is not a usable one (empty, a
    paragraph, a refusal to follow the format)."""
    line = next((line.strip() for line in raw.splitlines() if line.strip()), "")
    line = re.sub(r"^(title|chat title)\s*:\s*", "", line, flags=re.IGNORECASE)
    line = line.strip().strip("\"'“”‘’`*#").strip().rstrip(".")
    words = line.split()
    # Under three letters is no title but a fragment: "(f)", "1.", "A" from a base model
    # continuing the prompt's text instead of answering it.
    if not 1 <= len(words) <= 8 or sum(ch.isalpha() for ch in line) < MIN_TITLE_LETTERS:
        return None
    return _cap(line)


def _cap(title: str) -> str:
    title = " ".join(title.split())
    if len(title) > MAX_TITLE_CHARS:
        title = title[:MAX_TITLE_CHARS - 1].rstrip() + "…"
    return title
