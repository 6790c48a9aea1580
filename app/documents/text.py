"""Bytes to text for the plain-text kinds: binary sniffing, then encoding detection.

Order (the ONE place it is decided):
  1. a UTF-32 or UTF-16 byte-order mark decides the encoding;
  1b. without a mark, UTF-16 is recognised by its NUL bytes: text in Latin scripts stored as
     UTF-16 has a NUL as the high byte of nearly every character -- at odd offsets for
     little-endian, even ones for big-endian -- and almost none at the other offsets;
  2. a known file signature, or more than a stray NUL or control byte in the first
     `SNIFF_BYTES`, means the file is binary (a stray NUL in a log is stripped later);
  3. strict UTF-8 (a UTF-8 byte-order mark is dropped);
  4. Windows-1252 (Latin-1 for its five undefined bytes) only when the bytes look like Western
     text: few bytes above 0x7F, where UTF-8 failed. Anything else is an unknown encoding.
"""

from __future__ import annotations

import codecs

from app.documents.errors import DocumentError

SNIFF_BYTES = 8192

# UTF-32 first: its little-endian mark starts with UTF-16's.
_BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"),
)

# Leading bytes of binary formats -> what the file is, for the message.
_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"GIF87a": "a GIF image",
    b"GIF89a": "a GIF image",
    b"\x7fELF": "a program (an ELF executable)",
    b"\xcf\xfa\xed\xfe": "a program (a macOS executable)",
    b"PK\x03\x04": "a ZIP archive",
    b"\x1f\x8b": "a gzip archive",
    b"7z\xbc\xaf\x27\x1c": "a 7-Zip archive",
    b"Rar!\x1a\x07": "a RAR archive",
    b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1": "an old Office document (.doc, .xls or .ppt)",
    b"SQLite format 3\x00": "a SQLite database",
}

# Binary: over 1% of the sniffed bytes are NUL, or over 5% are C0 control bytes that text does
# not contain (tab, newlines, form feed, backspace and escape are allowed).
MAX_NUL_SHARE = 0.01
MAX_CONTROL_SHARE = 0.05
_CONTROL_BYTES = bytes(sorted(set(range(0x20)) - {0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1B}))
_HIGH_BYTES = bytes(range(0x80, 0x100))
# Western text in Windows-1252 has a few accented letters and punctuation above 0x7F; text in
# other 8-bit encodings (Cyrillic, Greek, ...) is mostly above it.
MAX_HIGH_BYTE_SHARE = 0.30


def decode_text(data: bytes, name: str) -> str:
    """The text of a plain-text file, or a DocumentError saying it is binary or unreadable."""
    for mark, codec in _BYTE_ORDER_MARKS:
        if data.startswith(mark):
            return _decode_with_mark(data, codec, name)
    sample = data[:SNIFF_BYTES]
    utf16 = _utf16_without_mark(data, sample)
    if utf16 is not None:
        return utf16
    what = binary_description(sample)
    if what is not None:
        raise DocumentError(name, f"it is {what}, not a text document.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    if _looks_western(sample):
        return _decode_western(data)
    raise DocumentError(name, "its text encoding is not recognised "
                              "(tried UTF-8, UTF-16 and Windows-1252); save it as UTF-8.")


def binary_description(sample: bytes) -> str | None:
    """What a binary file is ('a PNG image', 'a binary file'), or None when it may be text."""
    for signature, what in _SIGNATURES.items():
        if sample.startswith(signature):
            return what
    if (_share(sample, b"\x00") > MAX_NUL_SHARE
            or _share(sample, _CONTROL_BYTES) > MAX_CONTROL_SHARE):
        return "a binary file (for example a program, an image or an archive)"
    return None


# UTF-16 without a mark: at least this share of the code units in the sample have a NUL
# high byte, and at most MAX_NUL_SHARE of them a NUL low byte.
MIN_UTF16_NUL_HIGH_SHARE = 0.30


def _utf16_without_mark(data: bytes, sample: bytes) -> str | None:
    """The text of UTF-16 data without a byte-order mark, or None when it is not that."""
    sample = sample[: len(sample) // 2 * 2]
    if len(sample) < 4 or len(data) % 2:
        return None
    units = len(sample) // 2
    even_nuls, odd_nuls = sample[0::2].count(0) / units, sample[1::2].count(0) / units
    if odd_nuls >= MIN_UTF16_NUL_HIGH_SHARE and even_nuls <= MAX_NUL_SHARE:
        codec = "utf-16-le"
    elif even_nuls >= MIN_UTF16_NUL_HIGH_SHARE and odd_nuls <= MAX_NUL_SHARE:
        codec = "utf-16-be"
    else:
        return None
    try:
        text = data.decode(codec)
    except UnicodeDecodeError:
        return None
    # Numbers stored as 16-bit integers have the same NUL pattern; text has few control codes.
    head = text[:SNIFF_BYTES].encode("latin-1", errors="replace")
    if _share(head, _CONTROL_BYTES) > MAX_CONTROL_SHARE:
        return None
    return text


def _decode_with_mark(data: bytes, codec: str, name: str) -> str:
    try:
        return data.decode(codec)  # the codec reads the mark for byte order and drops it
    except UnicodeDecodeError:
        raise DocumentError(name, f"it starts with a {codec.upper()} marker but is not "
                                  f"valid {codec.upper()} text.") from None


def _looks_western(sample: bytes) -> bool:
    return _share(sample, _HIGH_BYTES) <= MAX_HIGH_BYTE_SHARE


def _decode_western(data: bytes) -> str:
    try:
        return data.decode("cp1252")
    except UnicodeDecodeError:  # 0x81, 0x8D, 0x8F, 0x90, 0x9D are undefined in cp1252
        return data.decode("latin-1")


def _share(sample: bytes, byte_set: bytes) -> float:
    """The fraction of `sample` made of bytes in `byte_set`."""
    kept = sample.translate(None, byte_set)
    return (len(sample) - len(kept)) / max(len(sample), 1)
