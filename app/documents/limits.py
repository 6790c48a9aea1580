"""How much a dropped document may cost, stated up front, and the cancel flag's one check.

Every limit is checked as early as it can be: the file's size before reading, a .docx's
declared unpacked sizes before unpacking, a PDF's page count before reading pages, each PDF
stream's unpacked size while pypdf unpacks it, and the extracted characters as they are
produced. Memory stays bounded by these numbers (see `DocumentLimits`), and every loop that can
take more than a moment checks the cancel flag.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from app.documents.errors import DocumentError

MB = 1024 * 1024


@dataclass(frozen=True)
class DocumentLimits:
    """What one document may cost. The defaults fit any document a model's context can hold:
    2,000,000 characters is about 500,000 tokens, four times the largest context we run."""

    max_file_bytes: int = 50 * MB
    max_chars: int = 2_000_000  # extracted text, after decoding
    max_pdf_pages: int = 2000
    # pypdf's text extraction grows faster than linearly with a page's content (1 MB of
    # content: ~3 s, 4 MB: ~40 s), so a page over this is skipped, with a note in the text.
    max_pdf_page_content_bytes: int = 1 * MB
    max_pdf_content_bytes: int = 64 * MB  # all pages' content together
    max_docx_unpacked_bytes: int = 256 * MB  # the ZIP's declared sizes, all parts
    max_docx_xml_bytes: int = 20 * MB  # python-docx parses every XML part: ~13 bytes per byte

    @property
    def max_text_file_bytes(self) -> int:
        """A plain-text file over this holds more than `max_chars` characters in any encoding
        (at most 4 bytes a character), so it is refused before reading."""
        return min(self.max_file_bytes, 4 * self.max_chars)


class DocumentCancelled(DocumentError):
    """Reading or counting was cancelled by the caller's flag; nothing needs to be shown."""

    def __init__(self, name: str, reason: str = "reading it was cancelled."):
        super().__init__(name, reason)


def check_cancel(cancel: threading.Event | None, name: str) -> None:
    if cancel is not None and cancel.is_set():
        raise DocumentCancelled(name)


def too_many_chars(count: int | str, limit: int) -> str:
    """The reason for refusing a document over the character limit."""
    shown = f"{count:,}" if isinstance(count, int) else count
    return (f"it holds {shown} characters of text; at most {limit:,} can be attached "
            "(more than any model's context). Attach a shorter part of it.")
