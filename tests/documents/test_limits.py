"""Heavy and hostile documents: limits are checked before the expensive step, memory stays
bounded, the cancel flag stops reading and counting, and UTF-16 without a mark is read."""

from __future__ import annotations

import io
import threading
import zipfile
import zlib

import docx
import numpy as np
import pytest

from app.documents import (DocumentCancelled, DocumentError, DocumentLimits, TokenCount,
                           count_tokens, extract_text)
from app.documents.readers import PDF_PAGE_SKIPPED
from app.documents.token_count import chunk_spans

MB = 1024 * 1024


class CancelAfter(threading.Event):
    """A cancel flag that a user "sets" after the reader has checked it `checks` times."""

    def __init__(self, checks: int):
        super().__init__()
        self.left = checks

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0 or super().is_set()


def refused(path, *words, limits=DocumentLimits(), cancel=None) -> str:
    with pytest.raises(DocumentError) as caught:
        extract_text(path, limits=limits, cancel=cancel)
    message = str(caught.value)
    assert path.name in message
    for word in words:
        assert word in message, message
    return message


# ---- plain text ----------------------------------------------------------------------------


def test_a_text_file_too_long_to_attach_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.txt"
    with open(path, "wb") as file:  # sparse: nothing is written, and nothing must be read
        file.truncate(4 * DocumentLimits().max_chars + 1)
    refused(path, "more than 2,000,000 characters", "Attach a shorter part")


def test_text_over_the_character_limit_is_refused(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("word " * 400)
    refused(path, "2,000 characters", "at most 1,000", limits=DocumentLimits(max_chars=1_000))
    assert len(extract_text(path, limits=DocumentLimits(max_chars=2_000)).text) == 2_000


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be"])
def test_utf16_without_a_byte_order_mark_is_read(tmp_path, codec):
    text = "Grüße aus Köln!\r\nNaïve café, 12 € — and 日本語 too.\n" * 20
    path = tmp_path / "windows.txt"
    path.write_bytes(text.encode(codec))  # no BOM
    assert extract_text(path).text == text.replace("\r\n", "\n")


def test_16_bit_numbers_are_still_binary(tmp_path):
    path = tmp_path / "samples.dat"
    path.write_bytes((np.arange(4096) % 31).astype("<u2").tobytes())  # NULs at odd offsets
    refused(path, "binary")


# ---- Word documents ------------------------------------------------------------------------


def docx_with_paragraphs(count: int, text: str = "All work and no play makes Jack a dull boy.") -> bytes:
    """A valid .docx whose body is `count` copies of one paragraph; it compresses to little."""
    base = io.BytesIO()
    docx.Document().save(base)
    source = zipfile.ZipFile(io.BytesIO(base.getvalue()))
    paragraph = f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>".encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename == "word/document.xml":
                head, tail = data.split(b"<w:body>")
                data = head + b"<w:body>" + paragraph * count + tail
            bundle.writestr(info.filename, data)
    return out.getvalue()


def test_a_docx_whose_text_unpacks_too_large_is_refused_before_unpacking(tmp_path):
    path = tmp_path / "bomb.docx"
    path.write_bytes(docx_with_paragraphs(300_000))  # 24 MB of XML in a ~130 KB file
    assert path.stat().st_size < MB
    refused(path, "text and layout unpack to 23 MB", "limit is 20 MB")


def test_a_docx_over_the_character_limit_is_refused(tmp_path):
    path = tmp_path / "long.docx"
    path.write_bytes(docx_with_paragraphs(100))
    refused(path, "more than 1,000 characters", limits=DocumentLimits(max_chars=1_000))
    assert extract_text(path).text.count("Jack") == 100


def test_reading_a_docx_stops_when_cancelled(tmp_path):
    path = tmp_path / "long.docx"
    path.write_bytes(docx_with_paragraphs(1_000))
    with pytest.raises(DocumentCancelled):
        extract_text(path, cancel=CancelAfter(50))  # a few checks in, mid-document


# ---- PDFs ----------------------------------------------------------------------------------


def pdf_with_streams(contents: list[bytes]) -> bytes:
    """A PDF with one page per content stream, each Flate-compressed (so a 2 MB stream is a
    few KB in the file)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for content in contents:
        packed = zlib.compress(content, 9)
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(packed), packed))
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % len(objects))
        kids.append(b"%d 0 R" % len(objects))
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(kids), len(kids))
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    return bytes(out)


def page(text: str, repeat: int = 1) -> bytes:
    return b"BT /F1 12 Tf 72 720 Td " + b"(%s) Tj\n" % text.encode("latin-1") * repeat + b"ET"


def test_a_pdf_page_holding_a_huge_stream_is_skipped_with_a_note(tmp_path):
    path = tmp_path / "bomb.pdf"
    path.write_bytes(pdf_with_streams([page("Before"), page("Hello world", 130_000), page("After")]))
    assert path.stat().st_size < 100_000  # the middle page unpacks to 2.2 MB
    document = extract_text(path)
    assert document.pages == 3
    assert document.text == (f"--- Page 1 ---\nBefore\n\n--- Page 2 ---\n{PDF_PAGE_SKIPPED}\n\n"
                             "--- Page 3 ---\nAfter")


def test_a_pdf_whose_every_page_is_too_large_is_refused(tmp_path):
    path = tmp_path / "bomb.pdf"
    path.write_bytes(pdf_with_streams([b" " * (3 * MB)]))
    refused(path, "too much drawing or text to read")


def test_a_pdf_over_the_character_limit_is_refused(tmp_path):
    path = tmp_path / "long.pdf"
    path.write_bytes(pdf_with_streams([page("x" * 400)] * 5))
    refused(path, "more than 1,000 characters", limits=DocumentLimits(max_chars=1_000))


def test_a_pdf_over_the_total_content_limit_is_refused(tmp_path):
    path = tmp_path / "heavy.pdf"
    path.write_bytes(pdf_with_streams([page("Some text", 2_000)] * 4))
    refused(path, "more than can be read", limits=DocumentLimits(max_pdf_content_bytes=60_000))


def test_reading_a_pdf_stops_when_cancelled(tmp_path):
    path = tmp_path / "pages.pdf"
    path.write_bytes(pdf_with_streams([page(f"Page {n}") for n in range(20)]))
    with pytest.raises(DocumentCancelled):
        extract_text(path, cancel=CancelAfter(5))
    done = threading.Event()
    done.set()
    with pytest.raises(DocumentCancelled):
        extract_text(path, cancel=done)


# ---- counting tokens -----------------------------------------------------------------------


def utf8_bytes(text: str) -> list[int]:
    """A byte-level tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def test_chunks_cover_the_text_and_cut_before_whitespace():
    text = ("lorem ipsum dolor sit amet\n" * 5_000) + "x" * 10_000
    spans = chunk_spans(text, 1000)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(end == next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert all(0 < end - start <= 1000 for start, end in spans)
    assert all(text[end] in " \n" for _, end in spans if end < 5_000 * 27)


def test_count_is_exact_in_chunks_and_estimated_above_the_limit():
    text = "Grüße, world! " * 50_000
    assert count_tokens(utf8_bytes, text, chunk_chars=4096) == TokenCount(len(text.encode()), exact=True)
    estimate = count_tokens(utf8_bytes, text, max_exact_chars=100_000, chunk_chars=4096)
    assert not estimate.exact and estimate.tokens == pytest.approx(len(text.encode()), rel=0.01)


def test_counting_stops_when_cancelled():
    with pytest.raises(DocumentCancelled):
        count_tokens(utf8_bytes, "word " * 100_000, chunk_chars=1000, cancel=CancelAfter(10))


def test_chunked_count_matches_the_model_tokenizer(embedded_model_path):
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    with GGUFFile(embedded_model_path) as gguf:
        tokenizer = Tokenizer.from_gguf(gguf)
    paragraph = ("The quick brown fox jumps over the lazy dog; naïve café, 日本語のテキスト. 12345\n"
                 "    indented code(x) {\n\n\treturn y;  }\n") * 40
    text = paragraph * 40
    whole = len(tokenizer.encode(text))
    counted = count_tokens(tokenizer.encode, text, chunk_chars=8192)
    assert counted.exact and abs(counted.tokens - whole) <= len(chunk_spans(text, 8192))
