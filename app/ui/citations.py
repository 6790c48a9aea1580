"""Citations in a reply ([1], [2], ...) made links that show the passage they cite.
Qt-free: the message view renders the Markdown this returns."""

from __future__ import annotations

import re
from collections.abc import Sequence

CITE_SCHEME = "cite"  # a citation link is "cite:N"
_CITATION = re.compile(r"\[(\d{1,3})\](?![(\[])")  # not a Markdown link's text: [1](url)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def link_citations(markdown: str, numbers: Sequence[int]) -> str:
    """`markdown` with each [n] citing one of `numbers` made a link to "cite:n", outside
    fenced and inline code."""
    valid = set(numbers)
    if not valid:
        return markdown
    lines = markdown.split("\n")
    fence = None
    for i, line in enumerate(lines):
        match = _FENCE.match(line)
        if fence is not None:
            if match and line.strip() == match.group(1) and match.group(1)[0] == fence[0]:
                fence = None
            continue
        if match:
            fence = match.group(1)
            continue
        parts = line.split("`")
        for j in range(0, len(parts), 2):  # even parts are outside inline code
            parts[j] = _CITATION.sub(
                lambda m: (f"[\\[{m.group(1)}\\]]({CITE_SCHEME}:{m.group(1)})"
                           if int(m.group(1)) in valid else m.group(0)), parts[j])
        lines[i] = "`".join(parts)
    return "\n".join(lines)


def cite_number(url: str) -> int | None:
    """N of a "cite:N" link, else None."""
    scheme, _, rest = url.partition(":")
    return int(rest) if scheme == CITE_SCHEME and rest.isdigit() else None
