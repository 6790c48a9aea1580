"""Turning a dropped file into text for a prompt. Pure Python: no Qt, no torch.

    doc = extract_document(path)          # or DocumentError, whose message names the file
    prompt_part = format_for_prompt(doc)
"""

from app.documents.errors import DocumentError
from app.documents.extract import Document, extract_document, format_for_prompt
from app.documents.formats import SUPPORTED_SUFFIXES, is_probably_supported

__all__ = ["Document", "DocumentError", "SUPPORTED_SUFFIXES", "extract_document",
           "format_for_prompt", "is_probably_supported"]
