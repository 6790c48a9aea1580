"""A dropped file becomes a Document: its text, ready to go into a prompt.

`extract_text` checks a file before reading a byte of it (exists, readable, a regular file,
not a model or another known binary by name, not empty, not over the size limit for its
kind), reads at most that many bytes + 1, and reads the text by kind within `DocumentLimits`,
stopping when the `cancel` flag is set. Every failure is a DocumentError that names the file.
It is Qt-free and keeps no state, so it runs on any thread -- never on the worker every chat
sends through, since a large document takes seconds. `format_for_prompt` is the ONE place a
document's text is put into a prompt.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from app.documents.errors import DocumentError
from app.documents.formats import (DOCX, GGUF_REASON, PDF, TEXT, fence_language, kind_of,
                                   refusal_by_name)
from app.documents.limits import DocumentLimits, check_cancel, too_many_chars
from app.documents.readers import read_docx, read_pdf
from app.documents.text import decode_text

DEFAULT_MAX_BYTES = DocumentLimits.max_file_bytes
# More pages than this is refused, never truncated: pypdf's text extraction is slow per page.
DEFAULT_MAX_PDF_PAGES = DocumentLimits.max_pdf_pages

GGUF_MAGIC = b"GGUF"
PDF_MAGIC = b"%PDF-"


@dataclass(frozen=True)
class Document:
    """The text of one file. `kind` is one of 'text', 'markdown', 'code', 'csv', 'json',
    'pdf', 'docx'; `pages` is set for PDFs only. Newlines in `text` are '\\n'."""

    name: str
    path: Path
    kind: str
    text: str
    size_bytes: int
    pages: int | None = None


def extract_text(path: str | os.PathLike, *, limits: DocumentLimits = DocumentLimits(),
                 cancel: threading.Event | None = None) -> Document:
    """Read a file's text for a prompt within `limits`, or raise DocumentError saying plainly
    why not (DocumentCancelled, a DocumentError, once `cancel` is set). Any thread."""
    path = Path(path)
    name = path.name or str(path)
    kind_by_name = kind_of(path)
    max_bytes = limits.max_file_bytes if kind_by_name in (PDF, DOCX) else limits.max_text_file_bytes
    data = _read_checked(path, name, max_bytes, limits)
    size_bytes = len(data)
    check_cancel(cancel, name)
    if data.startswith(GGUF_MAGIC):
        raise DocumentError(name, GGUF_REASON)
    kind = _kind(path, data)
    pages = None
    if kind == PDF:
        text, pages = read_pdf(data, name, limits, cancel)
    elif kind == DOCX:
        text = read_docx(data, name, limits, cancel)
    else:
        text = decode_text(data, name)
    del data
    if len(text) > limits.max_chars:
        raise DocumentError(name, too_many_chars(len(text), limits.max_chars))
    check_cancel(cancel, name)
    text = _normalized(text)
    if not text.strip():
        raise DocumentError(name, "it contains no text.")
    return Document(name=name, path=path, kind=kind, text=text, size_bytes=size_bytes, pages=pages)


def extract_document(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES,
                     max_pages: int = DEFAULT_MAX_PDF_PAGES) -> Document:
    """`extract_text` with the default limits but these two (kept for existing callers)."""
    return extract_text(path, limits=replace(DocumentLimits(), max_file_bytes=max_bytes,
                                             max_pdf_pages=max_pages))


def format_for_prompt(doc: Document) -> str:
    """A header line naming the file, then its text in a code fence -- tagged with the language
    for code, Markdown, CSV and JSON -- made longer than any run of backticks in the text, so
    the text cannot close it."""
    header = f"File: {doc.name}"
    if doc.pages is not None:
        header += f" ({doc.pages} page{'s' if doc.pages != 1 else ''})"
    fence = "`" * max(3, _longest_backtick_run(doc.text) + 1)
    body = doc.text.rstrip("\n")
    return f"{header}\n{fence}{fence_language(doc.path)}\n{body}\n{fence}"


def _read_checked(path: Path, name: str, max_bytes: int, limits: DocumentLimits) -> bytes:
    """The file's bytes, after every check that needs no reading. `max_bytes` is the limit
    for this kind of file: the file limit, or less for plain text (see DocumentLimits)."""
    try:
        info = path.stat()
    except OSError as error:
        raise DocumentError(name, _os_reason(error)) from error
    if stat.S_ISDIR(info.st_mode):
        raise DocumentError(name, "it is a folder, not a file; attach the files in it one by one.")
    if not stat.S_ISREG(info.st_mode):  # a pipe or a device would block or never end
        raise DocumentError(name, "it is not a regular file.")
    refusal = refusal_by_name(path)
    if refusal is not None:
        raise DocumentError(name, refusal)
    if info.st_size == 0:
        raise DocumentError(name, "the file is empty.")
    if info.st_size > max_bytes:
        raise DocumentError(name, _too_large(info.st_size, max_bytes, limits))
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)  # +1: a file that grew since stat() is still caught
    except OSError as error:
        raise DocumentError(name, _os_reason(error)) from error
    if len(data) > max_bytes:
        raise DocumentError(name, _too_large(len(data), max_bytes, limits))
    if not data:
        raise DocumentError(name, "the file is empty.")
    return data


def _os_reason(error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return "the file does not exist (it may have been moved or deleted)."
    if isinstance(error, PermissionError):
        return "permission to read the file was denied."
    if isinstance(error, IsADirectoryError):
        return "it is a folder, not a file; attach the files in it one by one."
    return f"the file cannot be read ({error.strerror or error})."


def _too_large(size: int, limit: int, limits: DocumentLimits) -> str:
    if limit < limits.max_file_bytes:  # a text file: its size alone shows it is too long
        return (f"the file is {_human_size(size)}, so it holds more than {limits.max_chars:,} "
                f"characters of text, the most that can be attached (text files up to "
                f"{_human_size(limit)}). Attach a shorter part of it.")
    return f"the file is {_human_size(size)}; the limit is {_human_size(limit)}."


def _human_size(size: int) -> str:
    if size < 1024:
        return f"{size:,} bytes"
    for unit in ("KB", "MB"):
        size /= 1024
        if size < 1024:
            return f"{size:,.1f} {unit}"
    return f"{size / 1024:,.1f} GB"


def _kind(path: Path, data: bytes) -> str:
    kind = kind_of(path)
    # A PDF without a .pdf suffix (e.g. a download saved without one) is still a PDF.
    if kind == TEXT and data.startswith(PDF_MAGIC):
        return PDF
    return kind


def _normalized(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)
