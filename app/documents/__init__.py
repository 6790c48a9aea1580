"""Turning a dropped file into text for a prompt. Pure Python: no Qt, no torch.

    doc = extract_text(path, limits=DocumentLimits(), cancel=event)  # or DocumentError
    prompt_part = format_for_prompt(doc)
    count = count_tokens(tokenizer.encode, prompt_part, cancel=event)  # TokenCount

Both calls take seconds on large documents and may run on any thread; setting `cancel` (a
`threading.Event`) makes them raise DocumentCancelled (a DocumentError) at the next check.
"""

from app.documents.errors import DocumentError
from app.documents.extract import Document, extract_document, extract_text, format_for_prompt
from app.documents.formats import SUPPORTED_SUFFIXES, is_probably_supported
from app.documents.limits import DocumentCancelled, DocumentLimits
from app.documents.token_count import TokenCount, count_tokens

__all__ = ["Document", "DocumentCancelled", "DocumentError", "DocumentLimits", "SUPPORTED_SUFFIXES",
           "TokenCount", "count_tokens", "extract_document", "extract_text", "format_for_prompt",
           "is_probably_supported"]
