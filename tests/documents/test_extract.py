"""Dropped files to prompt text: every format, and every way a file is refused.

Each test writes its files into its own tmp_path; PDFs are written by hand (`make_pdf`) and
DOCX files with python-docx, so no fixture files are needed.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import random
import subprocess
import sys

import docx
import pytest
from pypdf import PdfWriter

from app.documents import (SUPPORTED_SUFFIXES, Document, DocumentError, DocumentLimits,
                           extract_document, extract_text, format_for_prompt,
                           is_probably_supported)


def make_pdf(page_texts: list[str | None]) -> bytes:
    """A minimal valid PDF: one Helvetica text line per page, or a drawn line where None."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in page_texts:
        stream = (b"BT /F1 12 Tf 72 720 Td (%s) Tj ET" % text.encode("latin-1")
                  if text is not None else b"72 72 m 200 200 l S")
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
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


def encrypted_pdf(user_password: str, owner_password: str) -> bytes:
    writer = PdfWriter(clone_from=io.BytesIO(make_pdf(["Secret"])))
    # RC4 works with pypdf alone; AES would need the optional `cryptography` package.
    writer.encrypt(user_password=user_password, owner_password=owner_password, algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def make_docx(path) -> None:
    document = docx.Document()
    document.add_paragraph("Quarterly report")
    table = document.add_table(rows=2, cols=3)
    for column, text in enumerate(["Name", "Count", "Note"]):
        table.cell(0, column).text = text
    table.cell(1, 0).merge(table.cell(1, 1)).text = "Apples and pears"
    table.cell(1, 2).text = "two\nlines"
    document.add_paragraph("The end")
    document.save(path)


def write(path, data: bytes | str):
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def refused(path, *words: str, **kwargs) -> str:
    """The message of the DocumentError that `path` raises; it names the file and says `words`."""
    with pytest.raises(DocumentError) as caught:
        extract_document(path, **kwargs)
    message = str(caught.value)
    assert os.path.basename(path) in message
    for word in words:
        assert word.lower() in message.lower(), message
    return message


# --- plain-text kinds -------------------------------------------------------------------------


def test_plain_text_normalizes_newlines_and_strips_a_stray_nul(tmp_path):
    filler = "an ordinary line of a log file\n" * 10
    path = write(tmp_path / "notes.txt", f"one\r\ntwo\rthree\x00\n  indented\ttab\n{filler}")
    doc = extract_document(path)
    assert doc == Document(name="notes.txt", path=path, kind="text", size_bytes=path.stat().st_size,
                           text=f"one\ntwo\nthree\n  indented\ttab\n{filler}")
    assert doc.pages is None


@pytest.mark.parametrize("name", ["README.md", "guide.markdown"])
def test_markdown(tmp_path, name):
    doc = extract_document(write(tmp_path / name, "# Title\n\n- item\n"))
    assert (doc.kind, doc.text) == ("markdown", "# Title\n\n- item\n")


@pytest.mark.parametrize("name, language", [
    ("main.py", "python"), ("lib.rs", "rust"), ("App.tsx", "tsx"), ("conf.yml", "yaml"),
    ("query.sql", "sql"), ("style.scss", "scss"), ("Widget.svelte", "svelte"),
    ("Dockerfile", "dockerfile"),
])
def test_code_gets_a_fence_with_its_language(tmp_path, name, language):
    source = "def f():\n    return 1  # ` backtick\n"
    doc = extract_document(write(tmp_path / name, source))
    assert (doc.kind, doc.text) == ("code", source)
    assert format_for_prompt(doc) == f"File: {name}\n```{language}\n{source.rstrip()}\n```"


def test_extensionless_text_file_reads_as_text(tmp_path):
    doc = extract_document(write(tmp_path / "LICENSE", "Permission is hereby granted\n"))
    assert (doc.kind, doc.text) == ("text", "Permission is hereby granted\n")


@pytest.mark.parametrize("name, content", [("data.csv", "a,b\n1,\"x, y\"\n"),
                                           ("data.tsv", "a\tb\n1\t2\n")])
def test_csv_and_tsv_are_kept_as_text(tmp_path, name, content):
    doc = extract_document(write(tmp_path / name, content))
    assert (doc.kind, doc.text) == ("csv", content)
    assert format_for_prompt(doc).startswith(f"File: {name}\n```csv\n")


@pytest.mark.parametrize("content", ['{"a": [1, 2]}\n', '{"a": [1, 2,,\n'])
def test_json_valid_or_not_is_kept_as_text(tmp_path, content):
    doc = extract_document(write(tmp_path / "data.json", content))
    assert (doc.kind, doc.text) == ("json", content)


# --- encodings --------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_byte_order_marks(tmp_path, encoding):
    text = "Grüße, 東京 and ümlauts\nline two\n"
    data = text.encode(encoding)
    if encoding in ("utf-16-le", "utf-16-be"):  # these codecs write no mark; add it
        data = "\ufeff".encode(encoding) + data
    assert extract_document(write(tmp_path / "text.txt", data)).text == text


def test_windows_1252_text(tmp_path):
    text = "Café – naïve “quotes” cost 5 €\n"
    assert extract_document(write(tmp_path / "old.txt", text.encode("cp1252"))).text == text


def test_cyrillic_8bit_text_is_an_unknown_encoding(tmp_path):
    path = write(tmp_path / "russian.txt", "Привет, как дела? Всё хорошо.\n".encode("cp1251"))
    refused(path, "encoding", "UTF-8")


# --- PDF --------------------------------------------------------------------------------------


def test_pdf_single_page(tmp_path):
    doc = extract_document(write(tmp_path / "hello.pdf", make_pdf(["Hello"])))
    assert (doc.kind, doc.pages, doc.text) == ("pdf", 1, "--- Page 1 ---\nHello")
    assert format_for_prompt(doc) == "File: hello.pdf (1 page)\n```\n--- Page 1 ---\nHello\n```"


def test_pdf_pages_are_marked_and_separated(tmp_path):
    doc = extract_document(write(tmp_path / "two.pdf", make_pdf(["First page", "Second page"])))
    assert doc.pages == 2
    assert doc.text == "--- Page 1 ---\nFirst page\n\n--- Page 2 ---\nSecond page"
    assert format_for_prompt(doc).startswith("File: two.pdf (2 pages)\n")


def test_pdf_without_suffix_is_sniffed(tmp_path):
    doc = extract_document(write(tmp_path / "download", make_pdf(["Hello"])))
    assert (doc.kind, doc.pages) == ("pdf", 1)


def test_pdf_with_a_blank_page_keeps_the_page_numbers(tmp_path):
    doc = extract_document(write(tmp_path / "mixed.pdf", make_pdf([None, "Later"])))
    assert doc.text == "--- Page 1 ---\n\n\n--- Page 2 ---\nLater"


def test_pdf_without_text_says_ocr_is_not_supported(tmp_path):
    refused(write(tmp_path / "scan.pdf", make_pdf([None, None])), "no text", "OCR", "not supported")


def test_pdf_with_a_user_password_is_refused(tmp_path):
    refused(write(tmp_path / "locked.pdf", encrypted_pdf("user-secret", "owner")), "password")


def test_pdf_with_only_an_owner_password_reads(tmp_path):
    doc = extract_document(write(tmp_path / "restricted.pdf", encrypted_pdf("", "owner")))
    assert doc.text == "--- Page 1 ---\nSecret"


def test_truncated_pdf_is_damaged(tmp_path):
    data = make_pdf(["Hello", "World"])
    refused(write(tmp_path / "cut.pdf", data[: len(data) // 2]), "damaged")


def test_pdf_over_the_page_cap_is_refused_not_truncated(tmp_path):
    path = write(tmp_path / "long.pdf", make_pdf(["a", "b", "c"]))
    refused(path, "3 pages", "at most 2", max_pages=2)
    assert extract_document(path, max_pages=3).pages == 3


# --- DOCX -------------------------------------------------------------------------------------


def test_docx_paragraphs_and_tables_in_order(tmp_path):
    make_docx(tmp_path / "report.docx")
    doc = extract_document(tmp_path / "report.docx")
    assert doc.kind == "docx" and doc.pages is None
    assert doc.text == ("Quarterly report\n"
                        "Name\tCount\tNote\n"
                        "Apples and pears\t\ttwo lines\n"
                        "The end")


def test_truncated_docx_is_damaged(tmp_path):
    make_docx(tmp_path / "full.docx")
    data = (tmp_path / "full.docx").read_bytes()
    refused(write(tmp_path / "cut.docx", data[: len(data) // 2]), "damaged", ".docx")


def test_text_named_docx_is_damaged(tmp_path):
    refused(write(tmp_path / "fake.docx", "just text\n"), "damaged")


def test_docx_that_unpacks_too_large_is_refused_before_parsing(tmp_path):
    make_docx(tmp_path / "bomb.docx")
    with pytest.raises(DocumentError, match="unpacks to .* the limit"):
        extract_text(tmp_path / "bomb.docx", limits=DocumentLimits(max_docx_unpacked_bytes=1024))


def test_office_formats_other_than_docx_say_how_to_convert(tmp_path):
    refused(write(tmp_path / "sheet.xlsx", b"PK\x03\x04" + bytes(50)), ".xlsx files cannot be read", "CSV")
    refused(write(tmp_path / "old.docx.bin", b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(50)), "old Office")


# --- binary and model files -------------------------------------------------------------------


def random_bytes(count: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(count)


def test_png_is_refused_by_name_and_by_content(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + random_bytes(2000)
    refused(write(tmp_path / "photo.png", png), "image")
    refused(write(tmp_path / "photo.txt", png), "PNG image")


def test_elf_program_is_binary(tmp_path):
    elf = b"\x7fELF\x02\x01\x01\x00" + bytes(8) + random_bytes(2000)
    refused(write(tmp_path / "tool", elf), "program")


def test_binary_without_a_signature_is_caught_by_sniffing(tmp_path):
    noise = random_bytes(4000, seed=1).replace(b"\x00", b"\x01")  # no NUL bytes to give it away
    refused(write(tmp_path / "blob.dat", noise), "binary")


def test_gguf_is_a_model_not_a_document(tmp_path):
    # Refused by name before reading: even a model far over the size limit gets this message.
    refused(write(tmp_path / "gemma.gguf", b"GGUF" + bytes(100)), "model file", "add it as a model",
            max_bytes=10)
    refused(write(tmp_path / "renamed.txt", b"GGUF\x03\x00\x00\x00" + bytes(100)), "model file")


# --- file-system cases ------------------------------------------------------------------------


def test_empty_and_blank_files(tmp_path):
    refused(write(tmp_path / "empty.txt", b""), "empty")
    refused(write(tmp_path / "blank.md", " \n\n\t\n"), "no text")


def test_too_large_says_size_and_limit(tmp_path):
    path = write(tmp_path / "big.txt", "x" * 2048)
    refused(path, "2.0 KB", "limit is 1,000 bytes", max_bytes=1000)
    assert extract_document(path, max_bytes=2048).size_bytes == 2048


def test_directory(tmp_path):
    (tmp_path / "folder").mkdir()
    refused(tmp_path / "folder", "folder")


def test_missing_file(tmp_path):
    refused(tmp_path / "gone.txt", "does not exist")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="chmod does not stop root from reading")
def test_unreadable_file(tmp_path):
    path = write(tmp_path / "secret.txt", "hidden\n")
    path.chmod(0)
    try:
        refused(path, "permission")
    finally:
        path.chmod(0o600)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_named_pipe_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    refused(tmp_path / "pipe", "not a regular file")


# --- prompt formatting, support checks, boundaries -----------------------------------------------


def test_fence_outgrows_backticks_in_the_text(tmp_path):
    text = "Example:\n\n```python\nprint(1)\n```\n"
    doc = extract_document(write(tmp_path / "howto.md", text))
    assert format_for_prompt(doc) == f"File: howto.md\n````markdown\n{text.rstrip()}\n````"


def test_plain_text_fence_has_no_language(tmp_path):
    doc = extract_document(write(tmp_path / "notes.txt", "hi\n"))
    assert format_for_prompt(doc) == "File: notes.txt\n```\nhi\n```"


def test_supported_suffixes_and_drag_enter_guess():
    assert {".txt", ".md", ".py", ".csv", ".json", ".pdf", ".docx"} <= SUPPORTED_SUFFIXES
    assert all(suffix == suffix.lower() and suffix.startswith(".") for suffix in SUPPORTED_SUFFIXES)
    for name in ["a.pdf", "b.DOCX", "c.py", "README", "Makefile", "notes.unknownext"]:
        assert is_probably_supported(name), name
    for name in ["photo.PNG", "model.gguf", "app.exe", "bundle.zip", "old.doc", "sheet.xlsx"]:
        assert not is_probably_supported(name), name


def test_document_is_frozen_and_errors_travel_as_data(tmp_path):
    doc = extract_document(write(tmp_path / "a.txt", "a\n"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        doc.text = "b"
    error = pickle.loads(pickle.dumps(DocumentError("a.txt", "the file is empty.")))
    assert (str(error), error.name) == ('Cannot attach "a.txt": the file is empty.', "a.txt")


def test_package_imports_neither_qt_nor_torch():
    code = ("import sys, app.documents; "
            "print([m for m in sys.modules if m.split('.')[0] in ('PySide6', 'torch')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
