"""Text out of PDF (pypdf) and Word .docx (python-docx) files.

Both parsers read untrusted bytes and raise many exception types on damaged input; each reader
turns every failure into a DocumentError that names the file. Neither gives up silently: a
PDF over the page cap or with no text is refused, never truncated or passed on empty. Both
work within `DocumentLimits` (unpacked sizes, characters) and stop when `cancel` is set.
"""

from __future__ import annotations

import io
import threading
import zipfile

import docx
from docx.table import Table
from pypdf import PdfReader, apply_configuration
from pypdf.errors import DependencyError, FileNotDecryptedError, LimitReachedError, WrongPasswordError

from app.documents.errors import DocumentError
from app.documents.limits import DocumentLimits, check_cancel, too_many_chars

PDF_ENCRYPTED = "the PDF is protected by a password and cannot be opened."
PDF_PAGE_SKIPPED = "(This page was skipped: it holds too much drawing or text to read.)"
# pypdf's own caps on the work for one page's text, tighter than its defaults (5,000 form
# XObjects and 2,000,000 parsed items), which let one page take minutes.
_MAX_FORM_XOBJECTS_PER_PAGE = 500
_MAX_PARSED_ITEMS_PER_STREAM = 500_000


def read_pdf(data: bytes, name: str, limits: DocumentLimits = DocumentLimits(),
             cancel: threading.Event | None = None) -> tuple[str, int]:
    """(text, page count) of a PDF; each page's text follows a `--- Page N ---` line and pages
    are separated by a blank line. A page whose content is over the per-page limit is
    replaced by `PDF_PAGE_SKIPPED`; too many pages, characters or content in all is refused."""
    try:
        with apply_configuration(**_pdf_configuration(limits)):
            return _read_pdf(data, name, limits, cancel)
    except DocumentError:
        raise
    except (FileNotDecryptedError, WrongPasswordError, DependencyError) as error:
        # DependencyError: AES encryption needs the optional `cryptography` package.
        raise DocumentError(name, PDF_ENCRYPTED) from error
    except Exception as error:  # pypdf on damaged input: PdfReadError, ValueError, KeyError, ...
        raise DocumentError(name, "the PDF is damaged or is not a valid PDF file.") from error


def _pdf_configuration(limits: DocumentLimits) -> dict[str, int]:
    """pypdf limits for one stream's unpacked size, whatever its compression."""
    per_stream = limits.max_pdf_page_content_bytes
    return {
        "zlib_maximum_output_length": per_stream,
        "lzw_maximum_output_length": per_stream,
        "run_length_maximum_output_length": per_stream,
        "brotli_maximum_output_length": per_stream,
        "array_based_stream_maximum_output_length": per_stream,
        "stream_decoding_work_maximum_length": 4 * per_stream,
        "stream_parsing_work_maximum_count": _MAX_PARSED_ITEMS_PER_STREAM,
        "xform_maximum_invocations_per_extraction": _MAX_FORM_XOBJECTS_PER_PAGE,
    }


def _read_pdf(data: bytes, name: str, limits: DocumentLimits,
              cancel: threading.Event | None) -> tuple[str, int]:
    # pypdf tries the empty user password itself, so an owner-only password reads fine; with a
    # real user password, touching the pages raises FileNotDecryptedError.
    reader = PdfReader(io.BytesIO(data))
    page_count = len(reader.pages)
    if page_count > limits.max_pdf_pages:
        raise DocumentError(name, f"the PDF has {page_count:,} pages; at most "
                                  f"{limits.max_pdf_pages:,} pages can be attached.")
    page_texts: list[str] = []
    chars = content_bytes = 0
    for page in reader.pages:
        check_cancel(cancel, name)
        text, size = _page_text(page, limits)
        content_bytes += size
        if content_bytes > limits.max_pdf_content_bytes:
            raise DocumentError(name, f"the PDF's pages hold over {limits.max_pdf_content_bytes / 2**20:,.0f} "
                                      "MB of content, more than can be read.")
        chars += len(text)
        if chars > limits.max_chars:
            raise DocumentError(name, too_many_chars(f"more than {limits.max_chars:,}", limits.max_chars))
        page_texts.append(text)
    if not any(text.strip() and text != PDF_PAGE_SKIPPED for text in page_texts):
        if PDF_PAGE_SKIPPED in page_texts:
            raise DocumentError(name, "its pages hold too much drawing or text to read "
                                      f"(over {limits.max_pdf_page_content_bytes / 2**20:,.0f} MB a page).")
        raise DocumentError(name, "the PDF has no text to extract (it is probably scanned "
                                  "images); reading text from images (OCR) is not supported.")
    marked = (f"--- Page {number} ---\n{text}" for number, text in enumerate(page_texts, 1))
    return "\n\n".join(marked), page_count


def _page_text(page, limits: DocumentLimits) -> tuple[str, int]:
    """(text, content bytes) of one page; the skip note when its content is over the limit."""
    try:
        contents = page.get_contents()  # unpacked under the per-stream limit
        size = len(contents.get_data()) if contents is not None else 0
        if size > limits.max_pdf_page_content_bytes:
            return PDF_PAGE_SKIPPED, size
        return page.extract_text() or "", size
    except LimitReachedError:
        return PDF_PAGE_SKIPPED, limits.max_pdf_page_content_bytes


def read_docx(data: bytes, name: str, limits: DocumentLimits = DocumentLimits(),
              cancel: threading.Event | None = None) -> str:
    """The text of a Word document in reading order: paragraphs one per line, each table row a
    line of tab-separated cells."""
    damaged = "the Word document is damaged or is not a valid .docx file."
    try:
        parts = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except Exception as error:  # zipfile.BadZipFile, or garbage that fails deeper
        raise DocumentError(name, damaged) from error
    # The declared sizes bound what unpacking can produce: zipfile stops at them (and a part
    # that holds more fails its CRC check), so a ZIP bomb is caught before anything unpacks.
    unpacked = sum(info.file_size for info in parts)
    xml = sum(info.file_size for info in parts if info.filename.endswith((".xml", ".rels")))
    if unpacked > limits.max_docx_unpacked_bytes:
        raise DocumentError(name, f"the Word document unpacks to {unpacked / 2**20:,.0f} MB; "
                                  f"the limit is {limits.max_docx_unpacked_bytes / 2**20:,.0f} MB.")
    if xml > limits.max_docx_xml_bytes:
        raise DocumentError(name, f"the Word document's text and layout unpack to {xml / 2**20:,.0f} MB; "
                                  f"the limit is {limits.max_docx_xml_bytes / 2**20:,.0f} MB.")
    check_cancel(cancel, name)
    try:
        document = docx.Document(io.BytesIO(data))
        blocks, chars = [], 0
        for block in document.iter_inner_content():
            check_cancel(cancel, name)
            text = _block_text(block)
            chars += len(text) + 1
            if chars > limits.max_chars:
                raise DocumentError(name, too_many_chars(f"more than {limits.max_chars:,}", limits.max_chars))
            blocks.append(text)
    except DocumentError:
        raise
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
