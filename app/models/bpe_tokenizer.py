"""Byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen 2/3, SmolLM2, ...) and Hugging Face
`tokenizer.json` folders.

Encoding is done by Hugging Face's `tokenizers` (Rust; the reference implementation of this
family, much faster than a Python BPE loop). For a GGUF (`tokenizer.ggml.model = gpt2`) the
tokenizer is assembled the way llama.cpp tokenizes:

* vocabulary and merges from the file; llama.cpp's `ignore_merges` for Llama 3 vocabularies
  (a word that is itself a token is taken whole);
* the pre-tokenizer named by `tokenizer.ggml.pre`: llama.cpp's list of split regexes for that
  name, applied in order (`Split(..., "isolated")`), then the byte-to-unicode mapping;
* no normalizer (llama.cpp applies none, even where the original tokenizer.json had NFC);
* CONTROL tokens are matched in the text only with `encode(special=True)`; USER_DEFINED tokens
  always (llama.cpp's `tokenizer_st_partition`). Two `tokenizers` objects are kept, one with
  `encode_special_tokens` set, so the choice never mutates shared state between threads.

Decoding maps every id to the bytes llama.cpp renders for it (byte-level pieces through the
inverse byte-to-unicode table; SentencePiece-style pieces '▁' -> ' ' and '<0xNN>' -> the byte;
added tokens as their text; CONTROL ones hidden with `skip_special`) and decodes the joined bytes
as UTF-8 with U+FFFD for invalid sequences, so `StreamDecoder` output always equals `decode`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.models.errors import ModelError
from app.models.tokenizer import (BYTE, CONTROL, NORMAL, USER_DEFINED, VocabTokenizer, gguf_token_id,
                                  with_llama_cpp_control)

if TYPE_CHECKING:
    from app.models.gguf_file import GGUFFile

# llama.cpp's split regexes per pre-tokenizer type (llama-vocab.cpp), applied in order.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes, ignore_merges). Names as llama.cpp's converter writes them.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{name: ((_GPT2,), False) for name in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion")},
    **{name: ((r"\p{N}", _GPT2), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _byte_level_bytes(piece: str) -> bytes:
    table = _byte_decoder()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:  # not a byte-level piece after all: its text
        return piece.encode("utf-8")


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(piece: str) -> bytes:
    if m := _BYTE_PIECE.fullmatch(piece):
        return bytes((int(m.group(1), 16),))
    return piece.replace("\u2581", " ").encode("utf-8")


class BPETokenizer(VocabTokenizer):
    """Encode and decode text with a `tokenizers` BPE model; lookups and decoding are
    `VocabTokenizer`'s, shared with the SentencePiece tokenizer."""

    def __init__(
        self,
        special: HFTokenizer,
        plain: HFTokenizer,
        tokens: list[str],
        types: np.ndarray,
        *,
        byte_level: bool,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        unk_id: int | None,
        add_bos: bool,
        add_eos: bool = False,
        name: str = "model",
    ):
        super().__init__(tokens, types, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                         unk_id=unk_id, add_bos=add_bos, add_eos=add_eos, name=name)
        self._special = special  # CONTROL tokens in the text become their ids
        self._plain = plain  # only USER_DEFINED ones do
        self._byte_level = byte_level

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: "GGUFFile") -> "BPETokenizer":
        name = gguf.path.name
        meta = gguf.metadata
        bad = f"{name} has a malformed tokenizer vocabulary"
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelError(f"{bad}: tokenizer.ggml.tokens is missing or empty.")
        n = len(tokens)
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise ModelError(f"{bad}: tokenizer.ggml.merges is missing.")
        if types is None:
            types = np.full(n, NORMAL, dtype=np.int32)
        elif not isinstance(types, np.ndarray) or types.ndim != 1 or len(types) != n \
                or not np.issubdtype(types.dtype, np.integer):
            raise ModelError(f"{bad}: tokenizer.ggml.token_type does not list one type per token.")
        # A copy (the file's memory map may close), with llama.cpp's re-marking of textual
        # end-of-turn and fill-in-the-middle tokens as CONTROL.
        types = with_llama_cpp_control(tokens, np.array(types, dtype=np.int32))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            known = ", ".join(sorted(_PRE_TOKENIZERS))
            raise ModelError(f"{name} needs the pre-tokenizer {pre!r}, which Ferrox Chat does not "
                             f"know yet (it knows {known}).")
        regexes, ignore_merges = _PRE_TOKENIZERS[pre]
        # Each merge is "left right", split at its first space. Built in C-level loops (a
        # 49k-entry vocabulary and merge list took ~75 ms of Python loops, run while the
        # window is up).
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
        broken = next((i for i, pair in enumerate(pairs)
                       if len(pair) != 2 or not pair[0] or not pair[1]), None)
        if broken is not None:
            raise ModelError(f"{bad}: merge #{broken} ({merges[broken]!r}) is not two tokens.")
        # A token listed twice keeps its first id (reversed: the first one is written last).
        vocab = dict(zip(reversed(tokens), range(n - 1, -1, -1)))
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
        except Exception as exc:  # tokenizers raises plain Exceptions for unknown merge tokens
            raise ModelError(f"{bad}: {exc}.") from None

        def build() -> HFTokenizer:
            tk = HFTokenizer(bpe)
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tk.decoder = decoders.ByteLevel()
            added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                     for i in np.flatnonzero((types == CONTROL) | (types == USER_DEFINED)).tolist()]
            tk.add_tokens(added)
            return tk

        special, plain = build(), build()
        plain.encode_special_tokens = True

        def special_id(key: str) -> int | None:
            return gguf_token_id(meta, key, n, bad)

        return cls(
            special, plain, list(tokens), types, byte_level=True,
            bos_id=special_id("bos"), eos_id=special_id("eos"), pad_id=special_id("padding"),
            unk_id=special_id("unknown"),
            # llama.cpp's default for BPE vocabularies when the flag is absent: add BOS.
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            name=name,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "BPETokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{folder.name} has no tokenizer.json (only Hugging Face 'fast' "
                             "tokenizers are supported).")
        try:
            special = HFTokenizer.from_file(str(path))
            plain = HFTokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as exc:  # tokenizers raises plain Exceptions on bad files
            raise ModelError(f"{folder.name}/tokenizer.json cannot be read: {exc}") from None
        plain.encode_special_tokens = True
        config = _read_json(folder / "tokenizer_config.json")
        n = special.get_vocab_size(with_added_tokens=True)
        tokens = [""] * n
        for piece, i in special.get_vocab(with_added_tokens=True).items():
            if 0 <= i < n:
                tokens[i] = piece
        types = np.full(n, NORMAL, dtype=np.int32)
        for i, added in special.get_added_tokens_decoder().items():
            if 0 <= i < n:
                types[i] = CONTROL if added.special else USER_DEFINED
        for i, piece in enumerate(tokens):
            if types[i] == NORMAL and _BYTE_PIECE.fullmatch(piece):
                types[i] = BYTE
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})

        def id_of(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return special.token_to_id(value) if isinstance(value, str) else None

        bos_id, eos_id = id_of("bos_token"), id_of("eos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # e.g. Llama 3: the post-processor's template starts with BOS
            single = (spec.get("post_processor") or {}).get("single") or []
            first = single[0] if single else {}
            add_bos = bos_id is not None and "SpecialToken" in first
        return cls(
            special, plain, tokens, types, byte_level=byte_level,
            bos_id=bos_id, eos_id=eos_id, pad_id=id_of("pad_token"), unk_id=id_of("unk_token"),
            add_bos=bool(add_bos), add_eos=bool(config.get("add_eos_token", False)), name=folder.name,
        )

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids for `text` (never with BOS). With `special`, control-token strings such as
        '<|im_start|>' become their tokens; without, they are tokenized as plain text."""
        if not text:
            return []
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (a broken clipboard): as U+FFFD
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        tk = self._special if special else self._plain
        # encode_batch, not encode: only the batch call lets go of the GIL while it works,
        # and the text may be a whole conversation read in a worker thread (encode held
        # the GUI thread up for its whole run, ~6 us a token).
        return tk.encode_batch([text], add_special_tokens=False)[0].ids

    # -- decoding ----------------------------------------------------------------------------

    def _render(self, piece: str, kind: int) -> bytes:
        if kind in (NORMAL, BYTE):
            return _byte_level_bytes(piece) if self._byte_level else _sentencepiece_bytes(piece)
        return piece.encode("utf-8")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
