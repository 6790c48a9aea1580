"""The SentencePiece tokenizer built from GGUF metadata: exactness against llama.cpp, decoding,
stream-safe decoding and errors for bad vocabularies."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app.models.errors import ModelError
from app.models.gguf_file import GGUFFile
from app.models.tokenizer import BYTE, CONTROL, USER_DEFINED, Tokenizer


@pytest.fixture(scope="module")
def gemma_gguf(embedded_model_path):
    with GGUFFile(embedded_model_path) as gguf:
        yield gguf


@pytest.fixture(scope="module")
def tok(gemma_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_gguf)


@pytest.fixture(scope="module")
def reference(shared_dir) -> list[dict]:
    return json.loads((shared_dir / "reference" / "gemma3-270m-tokenizer.json").read_text("utf-8"))


def stream(tok: Tokenizer, ids, *, skip_special: bool = True) -> list[str]:
    """The deltas of a stream decoder fed `ids`, the flush last."""
    dec = tok.stream_decoder(skip_special=skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


def byte_id(tok: Tokenizer, value: int) -> int:
    return tok.token_id(f"<0x{value:02X}>")


# --- exactness ------------------------------------------------------------------------------


def test_reference_has_all_cases(reference):
    assert len(reference) == 14


def test_matches_llama_cpp_exactly(tok, reference):
    mismatches = []
    for case in reference:
        text = case["text"]
        plain = tok.encode(text)
        special = tok.encode(text, special=True)
        if plain != case["llama_cpp"]:
            mismatches.append(("plain", text, plain, case["llama_cpp"]))
        if special != case["llama_cpp_special"]:
            mismatches.append(("special", text, special, case["llama_cpp_special"]))
    assert not mismatches


def test_basic_properties(tok):
    assert tok.vocab_size == 262144
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    assert tok.add_bos is True
    assert tok.piece(tok.bos_id) == "<bos>"
    assert tok.token_id("<start_of_turn>") == 105
    assert tok.token_id("<end_of_turn>") == 106
    assert tok.token_id("definitely not a token") is None
    assert tok.token_id("   ") == 139  # whitespace runs are looked up as the GGUF stores them
    assert {0, 1, 2, 105, 106} <= tok.control_ids
    assert isinstance(tok.control_ids, frozenset)
    assert tok.is_control(106) and not tok.is_control(tok.encode("hi")[0])
    with pytest.raises(ValueError):
        tok.piece(tok.vocab_size)


# --- round trip -----------------------------------------------------------------------------

ROUND_TRIP = [
    "",
    "Hello, world!",
    "    indented\n\t\ttabs\n\n\n\nand      spaces   ",
    " " * 40 + "x" + "\n" * 40,
    "Emoji 😀🫠👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "你好，世界！こんにちは 안녕하세요",
    "Rare characters via byte fallback: ꙮ 𓀀 𐍈 \U0001fae8",
    "NUL\x00 and control \x07 chars, nbsp\xa0, zwsp\u200b",
    "<start_of_turn>user\nplain text that looks special<end_of_turn>",
    "[multimodal] <table><tr><td>x</td></tr></table>",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, special=True), skip_special=False) == text


def test_reference_round_trip(tok, reference):
    for case in reference:
        assert tok.decode(case["llama_cpp"]) == case["text"]
        assert tok.decode(case["llama_cpp_special"], skip_special=False) == case["text"]


def test_lone_surrogates_are_encoded_as_replacement_character(tok):
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_decode_accepts_numpy_ints(tok):
    ids = tok.encode("numpy ids")
    assert tok.decode(np.array(ids, dtype=np.int64)) == "numpy ids"


# --- special tokens -------------------------------------------------------------------------


def test_encode_never_adds_bos(tok):
    for text in ("Hello", "<bos>Hello"):
        assert tok.encode(text)[0] != tok.bos_id
    assert tok.encode("") == [] and tok.encode("", special=True) == []


def test_special_true_parses_control_tokens(tok):
    text = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, special=True)
    sot, eot = tok.token_id("<start_of_turn>"), tok.token_id("<end_of_turn>")
    assert ids[:2] == [tok.bos_id, sot]
    assert ids.count(sot) == 2 and ids.count(eot) == 1
    assert ids[2:5] == tok.encode("user\nHi")
    assert tok.decode(ids) == "user\nHi\nmodel\n"
    assert tok.decode(ids, skip_special=False) == text


def test_special_false_encodes_control_strings_as_text(tok):
    text = "<start_of_turn>user<end_of_turn><eos>"
    ids = tok.encode(text)
    assert not tok.control_ids & set(ids)
    assert tok.decode(ids) == text


def test_adjacent_and_partial_control_strings(tok):
    sot, eot = tok.token_id("<start_of_turn>"), tok.token_id("<end_of_turn>")
    assert tok.encode("<end_of_turn><start_of_turn>", special=True) == [eot, sot]
    # Broken or near-miss spellings stay text.
    for text in ("<start_of_turn", "<<end_of_turn>>", "<START_OF_TURN>", "<start_of_turn >"):
        ids = tok.encode(text, special=True)
        assert tok.decode(ids, skip_special=False) == text
        if text != "<<end_of_turn>>":
            assert not tok.control_ids & set(ids)
    assert tok.encode("<<end_of_turn>>", special=True).count(eot) == 1


def test_decode_skip_special(tok):
    ids = [tok.bos_id, *tok.encode("Hi"), tok.token_id("<end_of_turn>"), tok.eos_id]
    assert tok.decode(ids) == "Hi"
    assert tok.decode(ids, skip_special=True) == "Hi"
    assert tok.decode(ids, skip_special=False) == "<bos>Hi<end_of_turn><eos>"


# --- stream decoding ------------------------------------------------------------------------

STREAM_TEXTS = [
    "I love pizza 🍕🔥 and emoji 👩‍👩‍👧!",
    "你好，世界！今天天气很好。",
    "Mixed: naïve café — 日本語 😀 ꙮ 𓀀 end",
    "ꙮꙮꙮ 𓀀𓀁𓀂 \U0001fae8\U0001fae8",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_matches_decode_and_never_breaks_characters(tok, text):
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # Every delta is whole characters of the text, in order.
    pos = 0
    for d in deltas:
        assert text.startswith(d, pos)
        pos += len(d)


def test_stream_holds_back_split_characters(tok):
    ids = tok.encode("ꙮ𓀀")
    assert all(int(tok._types[i]) == BYTE for i in ids), "these characters must use byte fallback"
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids] == ["", "", "ꙮ", "", "", "", "𓀀"]
    assert dec.flush() == ""


def test_stream_control_token_between_bytes(tok):
    """A hidden control token in the middle of a character: decode joins the bytes, so must
    the stream; shown as text, it breaks the character in both."""
    first, *rest = [byte_id(tok, b) for b in "😀".encode()]
    ids = [first, tok.token_id("<end_of_turn>"), *rest]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "😀"
    shown = stream(tok, ids, skip_special=False)
    assert "".join(shown) == tok.decode(ids, skip_special=False) == "\ufffd<end_of_turn>\ufffd\ufffd\ufffd"


def test_stream_invalid_and_truncated_bytes(tok):
    b = lambda *values: [byte_id(tok, v) for v in values]  # noqa: E731
    a = tok.encode("a")
    cases = [
        b(0x80),  # lone continuation byte
        b(0xF0, 0x9F) + a,  # truncated sequence followed by text
        b(0xE4, 0xBD),  # truncated at the very end: only flush can resolve it
        b(0xFF, 0xC0, 0xAF),  # never valid in UTF-8
        b(0xED, 0xA0, 0x80),  # encoded surrogate
    ]
    for ids in cases:
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert "\ufffd" in tok.decode(ids)
    dec = tok.stream_decoder()
    assert dec.push(byte_id(tok, 0xE4)) == "" and dec.push(byte_id(tok, 0xBD)) == ""
    assert dec.flush() == "\ufffd"
    # After a flush the decoder starts clean.
    assert dec.push(tok.encode("x")[0]) == "x"


def test_stream_random_valid_text_split_into_bytes(tok):
    """Random characters (1-4 UTF-8 bytes) spelled as byte tokens, mixed with normal, user-
    defined and hidden control tokens: no delta ever carries a U+FFFD."""
    rng = random.Random(1234)
    control = sorted(tok.control_ids)
    words = [tok.encode(w)[0] for w in ("the", " cat", "  ", "\n\n")]
    for _ in range(200):
        ids, expected = [], []
        for _ in range(rng.randrange(1, 12)):
            roll = rng.random()
            if roll < 0.5:
                ch = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x800, 0xD800),
                                     rng.randrange(0x10000, 0x110000)]))
                ids += [byte_id(tok, v) for v in ch.encode()]
                expected.append(ch)
            elif roll < 0.8:
                w = rng.choice(words)
                ids.append(w)
                expected.append(tok.decode([w]))
            else:
                ids.append(rng.choice(control))
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids) == "".join(expected)
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_random_ids_equal_decode(tok, skip_special):
    """For ANY id sequence the deltas add up to `decode`, invalid bytes included."""
    rng = random.Random(99 if skip_special else 100)
    types = tok._types
    bytes_ = np.flatnonzero(types == BYTE).tolist()
    high_bytes = [byte_id(tok, v) for v in range(0x80, 0x100)]
    user = np.flatnonzero(types == USER_DEFINED).tolist()
    control = np.flatnonzero(types == CONTROL).tolist()
    pools = [bytes_, high_bytes, high_bytes, user, control]
    for _ in range(300):
        ids = []
        for _ in range(rng.randrange(0, 30)):
            if rng.random() < 0.3:
                ids.append(rng.randrange(tok.vocab_size))
            else:
                ids.append(rng.choice(rng.choice(pools)))
        assert "".join(stream(tok, ids, skip_special=skip_special)) == tok.decode(ids, skip_special=skip_special)


def test_stream_long_generation(tok):
    text = ("Streaming 😀 text, 日本語 and ꙮ. " * 200).strip()
    ids = tok.encode(text)
    assert "".join(stream(tok, ids)) == text


# --- errors ---------------------------------------------------------------------------------


def fake_gguf(name: str, metadata: dict) -> SimpleNamespace:
    return SimpleNamespace(path=Path(name), metadata=metadata)


def test_rejects_non_sentencepiece_tokenizer(gemma_gguf):
    meta = dict(gemma_gguf.metadata, **{"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ModelError, match=r"bad\.gguf.*'gpt2'.*SentencePiece"):
        Tokenizer.from_gguf(fake_gguf("bad.gguf", meta))
    meta = {k: v for k, v in gemma_gguf.metadata.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(ModelError, match="has no tokenizer"):
        Tokenizer.from_gguf(fake_gguf("bad.gguf", meta))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens is missing or empty"),
        ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores is missing"),
        ({"tokenizer.ggml.token_type": "oops"}, "tokenizer.ggml.token_type is missing"),
        ("truncate_types", r"token_type has 262143 entries for 262144 tokens"),
        ("bad_type", "token #7 has the unknown token type 9"),
        ("nan_score", "NaN or infinite"),
        ("empty_token", "token #200 is empty"),
        ("duplicate", "SentencePiece rejects it"),
        ({"tokenizer.ggml.bos_token_id": 999999}, "bos_token_id 999999 is outside"),
    ],
)
def test_malformed_vocabulary(gemma_gguf, change, message):
    meta = dict(gemma_gguf.metadata)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta["tokenizer.ggml.token_type"])
    scores = np.array(meta["tokenizer.ggml.scores"])
    if change == "truncate_types":
        meta["tokenizer.ggml.token_type"] = types[:-1]
    elif change == "bad_type":
        types[7] = 9
        meta["tokenizer.ggml.token_type"] = types
    elif change == "nan_score":
        scores[500] = np.nan
        meta["tokenizer.ggml.scores"] = scores
    elif change == "empty_token":
        tokens[200] = ""
        meta["tokenizer.ggml.tokens"] = tokens
    elif change == "duplicate":
        tokens[1000] = tokens[1001]
        meta["tokenizer.ggml.tokens"] = tokens
    else:
        meta.update(change)
    with pytest.raises(ModelError, match=message) as info:
        Tokenizer.from_gguf(fake_gguf("broken.gguf", meta))
    assert "broken.gguf" in str(info.value)


# --- a tiny vocabulary written as a real GGUF file ------------------------------------------


def write_tiny_gguf(path: Path, *, with_unknown: bool = True) -> Path:
    import gguf

    # 0-3 pad/eos/bos/unk, 4-7 control tokens (one a prefix of another), then user-defined
    # whitespace runs with real spaces, 256 byte tokens and a few normal pieces.
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<a>", "<a><b>", "<b>", "<start_of_turn>", "  ", "   "]
    types = [CONTROL] * 8 + [USER_DEFINED] * 2
    tokens += [f"<0x{v:02X}>" for v in range(256)]
    types += [BYTE] * 256
    normal = ["▁", "h", "e", "l", "o", "x", "he", "ll", "llo", "hello", "▁hello"]
    tokens += normal
    types += [1] * len(normal)
    scores = [0.0] * (len(tokens) - len(normal)) + [-float(i) for i in range(len(normal))][::-1]
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    if with_unknown:
        w.add_unk_token_id(3)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_vocabulary(tmp_path):
    with GGUFFile(write_tiny_gguf(tmp_path / "tiny.gguf")) as g:
        t = Tokenizer.from_gguf(g)
    # Usable after the file is closed: nothing keeps viewing the memory map.
    assert t.vocab_size == 10 + 256 + 11 and t.add_bos is False
    assert t.control_ids == frozenset(range(8))
    hello, sp_hello = t.token_id("hello"), t.token_id("▁hello")
    assert t.encode("hello hello") == [hello, sp_hello]
    # The whitespace-run user-defined tokens match (they are respelled with '▁').
    assert t.encode("x   x  x") == [t.token_id("x"), 9, t.token_id("x"), 8, t.token_id("x")]
    # Leftmost, then longest control-token match.
    assert t.encode("<a><b><b>", special=True) == [5, 6]
    assert t.encode("x<a><a>", special=True) == [t.token_id("x"), 4, 4]
    assert not set(t.encode("<a><b>")) & t.control_ids
    # Characters outside the vocabulary fall back to bytes.
    assert t.encode("é") == [10 + 0xC3, 10 + 0xA9]
    assert t.decode(t.encode("héllo  <a>", special=True), skip_special=False) == "héllo  <a>"


def test_tiny_vocabulary_without_unknown_token(tmp_path):
    with GGUFFile(write_tiny_gguf(tmp_path / "nounk.gguf", with_unknown=False)) as g:
        with pytest.raises(ModelError, match="nounk.gguf.*no unknown token"):
            Tokenizer.from_gguf(g)


def _piece_message_by_the_book(piece: str, score: float, kind: int) -> bytes:
    """One SentencePiece message as field 1 of ModelProto, written field by field."""
    from app.models.tokenizer import _field_bytes, _field_varint

    body = (_field_bytes(1, piece.encode("utf-8")) + b"\x15" + np.float32(score).tobytes()
            + _field_varint(3, kind))
    return _field_bytes(1, body)


def test_pieces_field_is_the_protobuf_encoding_of_each_piece():
    # lengths around each varint width (1, 2 and 3 bytes for the piece and for the message)
    from app.models.tokenizer import _pieces_field

    rng = random.Random(7)
    pieces = ["a", "▁the", "é" * 40, "x" * 118, "x" * 119, "x" * 127, "y" * 128, "z" * 16_375,
              "w" * 16_384, "<0x0A>", "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(300))]
    scores = np.array([rng.uniform(-1e4, 1e4) for _ in pieces], dtype=np.float32)
    types = np.array([rng.randrange(1, 7) for _ in pieces], dtype=np.int32)
    expected = b"".join(_piece_message_by_the_book(p, s, t) for p, s, t in zip(pieces, scores, types))
    assert _pieces_field(pieces, scores, types) == expected
