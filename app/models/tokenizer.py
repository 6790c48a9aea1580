"""The tokenizer of a GGUF model with a SentencePiece (`tokenizer.ggml.model = llama`) vocabulary.

Encoding is delegated to the `sentencepiece` library: a `ModelProto` is assembled from the
GGUF tokens, scores and token types (BPE, byte fallback, identity normalizer, no dummy prefix,
whitespace escaping on, no extra-whitespace removal). That tokenizes exactly like llama.cpp,
given two adjustments:

* the GGUF stores the user-defined whitespace-run tokens ("  ", "   ", ...) with real spaces,
  while SentencePiece matches escaped text, so they are respelled with U+2581 ('▁');
* SentencePiece never emits CONTROL tokens, so `encode(..., special=True)` first splits the
  text on control-token strings (`<start_of_turn>`, ...; leftmost, longest match first).

The `ModelProto` is written directly in protobuf wire format (varints, strings and floats are
all it needs): `sentencepiece_model_pb2` needs the `protobuf` package, which is not one of our
dependencies. Building and loading it takes about 0.15 s for Gemma 3's 262k-token vocabulary.

Decoding does not go through SentencePiece: every id maps to the bytes llama.cpp renders for
it (normal pieces with '▁' -> ' ', user-defined pieces as stored, byte pieces as their byte,
control/unknown/unused pieces as nothing or, with `skip_special=False`, their text), and the
joined bytes are decoded as UTF-8 with U+FFFD for invalid sequences. `StreamDecoder` feeds the
same bytes through an incremental UTF-8 decoder, so its output always equals `decode`.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import sentencepiece as spm

from app.models.errors import ModelError

if TYPE_CHECKING:
    from app.models.gguf_file import GGUFFile

# GGUF token types (the same numbers as SentencePiece's ModelProto.SentencePiece.Type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_VALID_TYPES = (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)

_WS = "\u2581"  # SentencePiece's escaped space '▁'

# Textual end-of-turn / end-of-generation / fill-in-the-middle tokens that llama.cpp treats as
# CONTROL whatever type the file gives them (llama-vocab.cpp re-marks them when it loads a
# vocabulary: "control-looking token ... its type will be overridden"). Gemma 3's GGUF, for
# one, stores '</s>' as USER_DEFINED; llama.cpp then reads '</s>' typed by a person as text.
LLAMA_CPP_CONTROL_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "</s>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "\u2581<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "\u2581<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "\u2581<MID>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<fim-repo>", "<reponame>",
    "<|repo_name|>", "<|fim_sep|>", "<|file_sep|>", "<fim-sep>", "<file_sep>",
})


def with_llama_cpp_control(tokens: Sequence[str], types: np.ndarray) -> np.ndarray:
    """`types` with llama.cpp's re-marking applied: the tokens above become CONTROL."""
    types = types.copy()
    for i, text in enumerate(tokens):
        if text in LLAMA_CPP_CONTROL_TEXTS and types[i] != CONTROL:
            types[i] = CONTROL
    return types
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# --- protobuf wire format -------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int32/int64 negatives are 10-byte two's complement varints
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_varint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field_bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _varint_widths(values: np.ndarray) -> np.ndarray:
    """Bytes each non-negative value (< 2**35) takes as a protobuf varint."""
    return 1 + sum((values >= 1 << (7 * k)).astype(np.int64) for k in range(1, 5))


def _put_varints(out: np.ndarray, at: np.ndarray, values: np.ndarray, widths: np.ndarray) -> None:
    """Writes values[i] as a varint of widths[i] bytes at out[at[i]:]."""
    for k in range(int(widths.max(initial=1))):
        has = widths > k
        more = (widths[has] > k + 1).astype(np.int64) << 7
        out[at[has] + k] = ((values[has] >> (7 * k)) & 0x7F) | more


def _pieces_field(pieces: Sequence[str], scores: np.ndarray, types: np.ndarray) -> bytes:
    """ModelProto's repeated field 1, one SentencePiece message per piece, each
    `0x0a len(body) | 0x0a len(piece) piece | 0x15 score(f32) | 0x18 type`, laid out with
    numpy: a loop over Gemma 3's 262,144 pieces took 0.22 s of a 0.6 s warm load, this 0.09."""
    encoded = [piece.encode("utf-8") for piece in pieces]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    length_widths = _varint_widths(lengths)
    bodies = lengths + length_widths + 8  # two tags, the f32 score, the tag and byte of the type
    body_widths = _varint_widths(bodies)
    records = 1 + body_widths + bodies
    starts = np.concatenate(([0], np.cumsum(records)[:-1])).astype(np.int64)
    out = np.empty(int(records.sum()), dtype=np.uint8)
    out[starts] = 0x0A
    _put_varints(out, starts + 1, bodies, body_widths)
    piece_tags = starts + 1 + body_widths
    out[piece_tags] = 0x0A
    _put_varints(out, piece_tags + 1, lengths, length_widths)
    piece_at = piece_tags + 1 + length_widths
    # The pieces' bytes, in order, fill the positions between each piece_at and its end: a
    # byte mask of them (+1 at each start, -1 at each end, summed), not an index per byte.
    edges = np.zeros(len(out) + 1, dtype=np.int8)
    edges[piece_at] += 1
    edges[piece_at + lengths] -= 1
    out[np.cumsum(edges[:-1], dtype=np.int8).view(np.bool_)] = np.frombuffer(b"".join(encoded), np.uint8)
    ends = piece_at + lengths
    out[ends] = 0x15
    out[ends[:, None] + np.arange(1, 5)] = scores.astype("<f4").view(np.uint8).reshape(-1, 4)
    out[ends + 5] = 0x18
    out[ends + 6] = types.astype(np.uint8)  # token types are 1-6: one-byte varints
    return out.tobytes()


def _serialize_model_proto(
    pieces: Sequence[str],
    scores: np.ndarray,
    types: np.ndarray,
    special: dict[str, tuple[int, str]],
) -> bytes:
    """A serialized sentencepiece ModelProto (see sentencepiece_model.proto for the numbers)."""
    chunks: list[bytes] = [_pieces_field(pieces, scores, types)] if len(pieces) else []
    append = chunks.append

    trainer = [
        _field_varint(3, 2),  # model_type = BPE
        _field_varint(4, len(pieces)),  # vocab_size
        _field_varint(35, 1),  # byte_fallback = true
    ]
    for name, (id_field, piece_field) in (("unk", (40, 45)), ("bos", (41, 46)), ("eos", (42, 47)), ("pad", (43, 48))):
        token_id, text = special.get(name, (-1, ""))
        trainer.append(_field_varint(id_field, token_id))
        if text:
            trainer.append(_field_bytes(piece_field, text.encode("utf-8")))
    normalizer = [
        _field_bytes(1, b"identity"),  # name
        _field_varint(3, 0),  # add_dummy_prefix = false
        _field_varint(4, 0),  # remove_extra_whitespaces = false
        _field_varint(5, 1),  # escape_whitespaces = true
    ]
    append(_field_bytes(2, b"".join(trainer)))
    append(_field_bytes(3, b"".join(normalizer)))
    return b"".join(chunks)


# --- the tokenizer --------------------------------------------------------------------------


class StreamDecoder:
    """Turns generated token ids into text as they arrive, one `push` per token.

    `push` returns only completed characters: the bytes of a character split over several
    byte-fallback tokens are held back until it completes. `flush` returns the rest (invalid
    leftovers become U+FFFD). All pushes plus the flush equal `Tokenizer.decode` of the ids.
    """

    def __init__(self, tokenizer: "VocabTokenizer", skip_special: bool = True):
        self._bytes_of = tokenizer._piece_bytes_fn(skip_special)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._bytes_of(int(token_id)))

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class VocabTokenizer:
    """What every tokenizer here shares: the vocabulary (pieces and their GGUF token types),
    the special ids, lookups, and decoding by per-id bytes (so `StreamDecoder` equals
    `decode`). Subclasses encode, and say what bytes a piece renders as (`_render`)."""

    def __init__(self, tokens: list[str], types: np.ndarray, *, bos_id: int | None,
                 eos_id: int | None, pad_id: int | None, unk_id: int | None, add_bos: bool,
                 add_eos: bool = False, name: str = "model"):
        self._tokens = tokens
        self._types = types
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.name = name
        self.control_ids: frozenset[int] = frozenset(np.flatnonzero(types == CONTROL).tolist())
        # Ids that decode to nothing with skip_special: control, unknown and unused pieces.
        hidden = (types == CONTROL) | (types == UNKNOWN) | (types == UNUSED)
        self._hidden_ids = frozenset(np.flatnonzero(hidden).tolist())
        self._bytes_cache: dict[int, bytes] = {}

    # -- lookups -----------------------------------------------------------------------------

    @cached_property
    def _ids_by_piece(self) -> dict[str, int]:
        ids: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            ids.setdefault(t, i)
        return ids

    def token_id(self, piece: str) -> int | None:
        """The id of the token stored as `piece`, or None."""
        return self._ids_by_piece.get(piece)

    def piece(self, token_id: int) -> str:
        """The token's text as the vocabulary stores it."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def is_control(self, token_id: int) -> bool:
        return token_id in self.control_ids

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the {self.vocab_size}-token vocabulary")

    # -- decoding ----------------------------------------------------------------------------

    def _render(self, piece: str, kind: int) -> bytes:
        """The bytes token `piece` of GGUF type `kind` renders as."""
        raise NotImplementedError

    def _raw_bytes(self, token_id: int) -> bytes:
        """What the token renders as (special tokens as their text), cached per id."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        self._check_id(token_id)
        raw = self._bytes_cache[token_id] = self._render(self._tokens[token_id],
                                                         int(self._types[token_id]))
        return raw

    def _piece_bytes_fn(self, skip_special: bool):
        raw, hidden = self._raw_bytes, self._hidden_ids
        if not skip_special:
            return raw
        return lambda token_id: b"" if token_id in hidden else raw(token_id)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of `ids`. Control (and unknown/unused) tokens are dropped with
        `skip_special`, else shown as their text; invalid UTF-8 becomes U+FFFD."""
        to_bytes = self._piece_bytes_fn(skip_special)
        return b"".join(to_bytes(int(i)) for i in ids).decode("utf-8", "replace")

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.vocab_size} tokens>"


def gguf_token_id(meta: dict, key: str, n: int, bad: str) -> int | None:
    """tokenizer.ggml.<key>_token_id, checked against an n-token vocabulary (None if absent)."""
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    if value is None:
        return None
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ModelError(f"{bad}: tokenizer.ggml.{key}_token_id is not a number.") from None
    if not 0 <= value < n:
        raise ModelError(f"{bad}: tokenizer.ggml.{key}_token_id {value} is outside the {n}-token vocabulary.")
    return value


class Tokenizer(VocabTokenizer):
    """Encode and decode text for a GGUF model with a SentencePiece vocabulary."""

    def __init__(
        self,
        sp: spm.SentencePieceProcessor,
        tokens: list[str],
        types: np.ndarray,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        unk_id: int,
        add_bos: bool,
        name: str = "model",
    ):
        super().__init__(tokens, types, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                         unk_id=unk_id, add_bos=add_bos, name=name)
        self._sp = sp
        # Control-token strings for `encode(special=True)`, grouped by first character with
        # their lengths longest first.
        by_first: dict[str, set[str]] = {}
        for i in self.control_ids:
            text = tokens[i]
            if text:
                by_first.setdefault(text[0], set()).add(text)
        self._control_by_first = {
            c: (frozenset(texts), sorted({len(t) for t in texts}, reverse=True)) for c, texts in by_first.items()
        }
        self._control_start = (
            re.compile("[" + "".join(re.escape(c) for c in sorted(by_first)) + "]") if by_first else None
        )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: "GGUFFile") -> "Tokenizer":
        name = gguf.path.name
        meta = gguf.metadata
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError(f"{name} has no tokenizer (the metadata key tokenizer.ggml.model is missing).")
        if model != "llama":
            raise ModelError(
                f"{name} uses the tokenizer type {model!r}; only SentencePiece ('llama', as in "
                "Gemma and Llama 2) and byte-level BPE ('gpt2', as in Llama 3 and Qwen) "
                "vocabularies are supported."
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        scores = meta.get("tokenizer.ggml.scores")
        types = meta.get("tokenizer.ggml.token_type")
        bad = f"{name} has a malformed tokenizer vocabulary"
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens[:1]):
            raise ModelError(f"{bad}: tokenizer.ggml.tokens is missing or empty.")
        n = len(tokens)
        for key, arr in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
            if not isinstance(arr, np.ndarray) or arr.ndim != 1:
                raise ModelError(f"{bad}: {key} is missing or not a numeric list.")
            if len(arr) != n:
                raise ModelError(f"{bad}: {key} has {len(arr)} entries for {n} tokens.")
        # Copy: the metadata arrays view the file's memory map, which may be closed later.
        scores = np.array(scores, dtype=np.float32)
        if not np.all(np.isfinite(scores)):
            raise ModelError(f"{bad}: tokenizer.ggml.scores contains NaN or infinite values.")
        if not np.issubdtype(types.dtype, np.integer):
            raise ModelError(f"{bad}: tokenizer.ggml.token_type is not a list of integers.")
        types = with_llama_cpp_control(tokens, np.array(types, dtype=np.int32))
        invalid = ~np.isin(types, _VALID_TYPES)
        if invalid.any():
            i = int(np.flatnonzero(invalid)[0])
            raise ModelError(f"{bad}: token #{i} has the unknown token type {int(types[i])}.")
        if any(not t for t in tokens):
            i = next(i for i, t in enumerate(tokens) if not t)
            raise ModelError(f"{bad}: token #{i} is empty.")

        def special_id(key: str) -> int | None:
            return gguf_token_id(meta, key, n, bad)

        bos_id, eos_id, pad_id = special_id("bos"), special_id("eos"), special_id("padding")
        unk_id = special_id("unknown")
        if unk_id is None:
            unknown = np.flatnonzero(types == UNKNOWN)
            if not len(unknown):
                raise ModelError(f"{bad}: it defines no unknown token.")
            unk_id = int(unknown[0])

        # SentencePiece wants exactly one UNKNOWN piece; GGUF files (Gemma's included) often
        # mark <unk> as CONTROL. Other UNKNOWN-typed pieces become CONTROL: never produced.
        sp_types = types.copy()
        sp_types[sp_types == UNKNOWN] = CONTROL
        sp_types[unk_id] = UNKNOWN
        pieces = list(tokens)
        for i in np.flatnonzero(types == USER_DEFINED).tolist():
            if " " in pieces[i]:
                pieces[i] = pieces[i].replace(" ", _WS)
        special = {"unk": (unk_id, pieces[unk_id])}
        for key, value in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
            if value is not None and value != unk_id:
                special[key] = (value, pieces[value])
        proto = _serialize_model_proto(pieces, scores, sp_types, special)
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError, ValueError) as exc:
            raise ModelError(f"{bad}: SentencePiece rejects it ({str(exc).strip()}).") from None
        if sp.GetPieceSize() != n:
            raise ModelError(f"{bad}: SentencePiece loaded {sp.GetPieceSize()} of its {n} tokens.")
        return cls(
            sp,
            tokens,
            types,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=pad_id,
            unk_id=unk_id,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            name=name,
        )

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids for `text` (never with BOS). With `special`, control-token strings such as
        '<start_of_turn>' become their tokens; without, they are tokenized as plain text."""
        if not text:
            return []
        if not special or self._control_start is None:
            return self._encode_plain(text)
        ids: list[int] = []
        pos = 0
        for start, end in self._control_spans(text):
            if start > pos:
                ids.extend(self._encode_plain(text[pos:start]))
            ids.append(self._ids_by_piece[text[start:end]])
            pos = end
        if pos < len(text):
            ids.extend(self._encode_plain(text[pos:]))
        return ids

    def _control_spans(self, text: str):
        """(start, end) of control-token strings in `text`: leftmost, then longest match."""
        pos = 0
        search = self._control_start.search
        while True:
            m = search(text, pos)
            if m is None:
                return
            i = m.start()
            texts, lengths = self._control_by_first[text[i]]
            for length in lengths:
                if text[i : i + length] in texts:
                    yield i, i + length
                    pos = i + length
                    break
            else:
                pos = i + 1

    def _encode_plain(self, text: str) -> list[int]:
        try:
            return self._sp.EncodeAsIds(text)
        except RuntimeError:
            # Lone surrogates (e.g. from a broken clipboard) cannot be UTF-8 and make the
            # binding fail: encode them as U+FFFD instead.
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                clean = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                return self._sp.EncodeAsIds(clean)
            raise

    # -- decoding ----------------------------------------------------------------------------

    def _render(self, text: str, kind: int) -> bytes:
        if kind == BYTE and (m := _BYTE_PIECE.fullmatch(text)):
            return bytes((int(m.group(1), 16),))
        if kind == NORMAL:
            return text.replace(_WS, " ").encode("utf-8")
        return text.encode("utf-8")


def tokenizer_from_gguf(gguf: "GGUFFile"):
    """The tokenizer a GGUF file describes (dispatch on `tokenizer.ggml.model`): SentencePiece
    ('llama': Gemma, Llama 2, Mistral, Phi-3) here, byte-level BPE ('gpt2': Llama 3, Qwen,
    SmolLM2) in app.models.bpe_tokenizer."""
    if gguf.metadata.get("tokenizer.ggml.model") == "gpt2":
        from app.models.bpe_tokenizer import BPETokenizer

        return BPETokenizer.from_gguf(gguf)
    return Tokenizer.from_gguf(gguf)


def tokenizer_from_hf_folder(folder):
    """The tokenizer of a Hugging Face model folder (its tokenizer.json)."""
    from app.models.bpe_tokenizer import BPETokenizer

    return BPETokenizer.from_hf_folder(folder)
