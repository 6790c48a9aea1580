"""Text out of PDF (pypdf) and Word .docx (python-docx) files.

Both parsers read untrusted bytes and raise many exception types on damaged input; each reader
turns every failure into a DocumentError that names the file. Neither gives up silently: a
PDF over the page cap or with no text is refused, never truncated or passed on empty.
"""

from __future__ import annotations

import io
import zipfile

import docx
from docx.table import Table
from pypdf import PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, WrongPasswordError

from app.documents.errors import DocumentError

PDF_ENCRYPTED = "the PDF is protected by a password and cannot be opened."
# A .docx is a ZIP; its declared unpacked size bounds the memory python-docx can use.
MAX_DOCX_UNPACKED_BYTES = 512 * 1024 * 1024


def read_pdf(data: bytes, name: str, max_pages: int) -> tuple[str, int]:
    """(text, page count) of a PDF; each page's text follows a `--- Page N ---` line and pages
    are separated by a blank line."""
    try:
        return _read_pdf(data, name, max_pages)
    except DocumentError:
        raise
    except (FileNotDecryptedError, WrongPasswordError, DependencyError) as error:
        # DependencyError: AES encryption needs the optional `cryptography` package.
        raise DocumentError(name, PDF_ENCRYPTED) from error
    except Exception as error:  # pypdf on damaged input: PdfReadError, ValueError, KeyError, ...
        raise DocumentError(name, "the PDF is damaged or is not a valid PDF file.") from error


def _read_pdf(data: bytes, name: str, max_pages: int) -> tuple[str, int]:
    # pypdf tries the empty user password itself, so an owner-only password reads fine; with a
    # real user password, touching the pages raises FileNotDecryptedError.
    reader = PdfReader(io.BytesIO(data))
    page_count = len(reader.pages)
    if page_count > max_pages:
        raise DocumentError(name, f"the PDF has {page_count:,} pages; at most {max_pages:,} "
                                  "pages can be attached.")
    page_texts = [page.extract_text() or "" for page in reader.pages]
    if not any(text.strip() for text in page_texts):
        raise DocumentError(name, "the PDF has no text to extract (it is probably scanned "
                                  "images); reading text from images (OCR) is not supported.")
    marked = (f"--- Page {number} ---\n{text}" for number, text in enumerate(page_texts, 1))
    return "\n\n".join(marked), page_count


def read_docx(data: bytes, name: str) -> str:
    """The text of a Word document in reading order: paragraphs one per line, each table row a
    line of tab-separated cells."""
    damaged = "the Word document is damaged or is not a valid .docx file."
    try:
        unpacked = sum(info.file_size for info in zipfile.ZipFile(io.BytesIO(data)).infolist())
    except Exception as error:  # zipfile.BadZipFile, or garbage that fails deeper
        raise DocumentError(name, damaged) from error
    if unpacked > MAX_DOCX_UNPACKED_BYTES:
        raise DocumentError(name, f"the Word document unpacks to {unpacked / 2**20:,.0f} MB; "
                                  f"the limit is {MAX_DOCX_UNPACKED_BYTES / 2**20:,.0f} MB.")
    try:
        document = docx.Document(io.BytesIO(data))
        blocks = [_block_text(block) for block in document.iter_inner_content()]
    except Exception as error:  # python-docx on damaged input: KeyError, ValueError, lxml, ...
        raise DocumentError(name, damaged) from error
    return "\n".join(blocks)


def _block_text(block) -> str:
    if isinstance(block, Table):
        return "\n".join(_row_text(row) for row in block.rows)
    return block.text


def _row_text(row) -> str:
    # A horizontally merged cell appears once per grid column it spans (the same object);
    # its text goes in the first column and the rest stay empty so columns still line up.
    cells, texts = row.cells, []
    for index, cell in enumerate(cells):
        repeated = index > 0 and cell is cells[index - 1]
        texts.append("" if repeated else cell.text.replace("\n", " "))
    return "\t".join(texts)
