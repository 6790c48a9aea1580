"""GGUFFile: metadata and tensors round-trip through gguf-py's writer, the embedded model's
header reads, and every kind of broken file ends in a readable ModelError (never a numpy
error, a MemoryError or a hang)."""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest
from gguf import GGUFValueType, quants
from gguf.constants import GGMLQuantizationType as T

from app.models.errors import ModelError
from app.models.gguf_file import GGUFFile
from tests.gguf_factory import write_gguf

# Words every "broken file" message uses; none of them is a numpy or struct error.
_READABLE = ("truncated", "corrupt", "not a GGUF", "not found", "folder", "version", "unknown", "big-endian")


def _assert_readable(exc: ModelError, path) -> None:
    msg = str(exc)
    assert any(word in msg for word in _READABLE), msg
    assert path.name in msg, msg
    assert "Traceback" not in msg and "buffer" not in msg.lower(), msg


def _open_fails(path) -> ModelError:
    with pytest.raises(ModelError) as info:
        GGUFFile(path).close()
    _assert_readable(info.value, path)
    return info.value


# ---- hand-built files, for corruption the writer cannot produce ------------------------------


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor_info(name: str, dims: list[int], type_id: int, offset: int = 0) -> bytes:
    out = _str(name) + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims)
    return out + struct.pack("<IQ", type_id, offset)


def _gguf(kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"", *, version: int = 3) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % 32)
    return head + data


def _write(tmp_path, content: bytes, name: str = "model.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


# ---- reading what the factory writes ---------------------------------------------------------


def test_reads_metadata_of_every_kind(tmp_path):
    path = write_gguf(
        tmp_path / "meta.gguf",
        metadata={
            "general.name": "Tiny test model ✓",
            "tiny.block_count": 2,
            "tiny.offset": -7,
            "tiny.big": 1 << 40,
            "tiny.eps": 1e-6,
            "tiny.half": 0.5,
            "tiny.yes": True,
            "tiny.no": False,
            "tiny.i8": (-3, GGUFValueType.INT8),
            "tiny.u16": (65535, GGUFValueType.UINT16),
            "tiny.i64": (-(1 << 40), GGUFValueType.INT64),
            "tiny.f64": (0.1, GGUFValueType.FLOAT64),
            "tiny.ints": [1, 2, 3],
            "tiny.signed": [-1, 0, 5],
            "tiny.scores": np.array([0.0, -1.5, 2.25], dtype=np.float32),
            "tiny.types": np.array([1, 3, 6], dtype=np.int32),
            "tiny.bytes": ([7, 8], GGUFValueType.UINT8),
            "tiny.flags": [True, False, True],
            "tiny.tokens": ["<pad>", "<eos>", "▁hello", "", "日本"],
        },
    )
    with GGUFFile(path) as f:
        m = f.metadata
        assert f.version == 3
        assert f.architecture == "gemma3"
        assert m["general.name"] == "Tiny test model ✓"
        assert m["tiny.block_count"] == 2 and isinstance(m["tiny.block_count"], int)
        assert m["tiny.offset"] == -7
        assert m["tiny.big"] == 1 << 40
        assert m["tiny.eps"] == pytest.approx(1e-6, rel=1e-6)
        assert m["tiny.half"] == 0.5
        assert m["tiny.yes"] is True and m["tiny.no"] is False
        assert m["tiny.i8"] == -3 and m["tiny.u16"] == 65535 and m["tiny.i64"] == -(1 << 40)
        assert m["tiny.f64"] == 0.1
        assert m["tiny.ints"].tolist() == [1, 2, 3] and m["tiny.ints"].dtype == np.uint32
        assert m["tiny.signed"].tolist() == [-1, 0, 5] and m["tiny.signed"].dtype == np.int32
        assert m["tiny.scores"].tolist() == [0.0, -1.5, 2.25] and m["tiny.scores"].dtype == np.float32
        assert m["tiny.types"].tolist() == [1, 3, 6] and m["tiny.types"].dtype == np.int32
        assert m["tiny.bytes"].tolist() == [7, 8] and m["tiny.bytes"].dtype == np.uint8
        assert m["tiny.flags"].tolist() == [True, False, True]
        assert m["tiny.tokens"] == ["<pad>", "<eos>", "▁hello", "", "日本"]
        assert f.get("tiny.missing", 42) == 42
        assert f.require("tiny.block_count") == 2
        with pytest.raises(ModelError, match="missing the metadata key 'tiny.missing'"):
            f.require("tiny.missing")
        assert f.tensors == {}


def test_reads_tensors(tmp_path):
    rng = np.random.default_rng(0)
    norm = rng.standard_normal(64).astype(np.float32)
    emb = rng.standard_normal((8, 64))  # float64: written as F32
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    q4 = rng.standard_normal((2, 3, 32)).astype(np.float32)
    k6 = rng.integers(0, 256, size=(2, 210), dtype=np.uint8)  # raw Q6_K blocks
    path = write_gguf(
        tmp_path / "tensors.gguf",
        tensors={
            "output_norm.weight": norm,
            "token_embd.weight": emb,
            "blk.0.attn_q.weight": (q8, T.Q8_0),
            "blk.0.attn_k.weight": (q4, T.Q4_0),
            "blk.0.ffn_down.weight": (k6, T.Q6_K),
            "blk.0.half": (norm, T.F16),
        },
    )
    with GGUFFile(path) as f:
        t = f.tensors
        assert list(t) == [
            "output_norm.weight", "token_embd.weight", "blk.0.attn_q.weight",
            "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "blk.0.half",
        ]
        assert t["output_norm.weight"].shape == (64,) and t["output_norm.weight"].ggml_type == T.F32
        assert t["token_embd.weight"].shape == (8, 64) and t["token_embd.weight"].ggml_type == T.F32
        assert t["blk.0.attn_q.weight"].shape == (4, 64) and t["blk.0.attn_q.weight"].ggml_type == T.Q8_0
        assert t["blk.0.attn_k.weight"].shape == (2, 3, 32)
        assert t["blk.0.ffn_down.weight"].shape == (2, 256) and t["blk.0.ffn_down.weight"].nbytes == 420
        assert t["blk.0.half"].ggml_type == T.F16 and t["blk.0.half"].n_elements == 64
        for info in t.values():
            assert info.offset % 32 == 0

        assert np.array_equal(f.raw_tensor("output_norm.weight").view(np.float32), norm)
        assert np.array_equal(f.raw_tensor("token_embd.weight").view(np.float32).reshape(8, 64), emb.astype(np.float32))
        assert np.array_equal(f.raw_tensor("blk.0.attn_q.weight"), quants.quantize(q8, T.Q8_0).reshape(-1))
        assert np.array_equal(f.raw_tensor("blk.0.attn_k.weight"), quants.quantize(q4, T.Q4_0).reshape(-1))
        assert np.array_equal(f.raw_tensor("blk.0.ffn_down.weight"), k6.reshape(-1))
        assert np.array_equal(f.raw_tensor("blk.0.half").view(np.float16), norm.astype(np.float16))
        raw = f.raw_tensor("output_norm.weight")
        assert raw.dtype == np.uint8 and not raw.flags.writeable
        with pytest.raises(ModelError, match="no tensor named 'nope'"):
            f.raw_tensor("nope")


def test_custom_alignment(tmp_path):
    path = write_gguf(
        tmp_path / "aligned.gguf",
        metadata={"general.alignment": 64},
        tensors={"a": np.ones(3, np.float32), "b": np.full(5, 2.0, np.float32)},
    )
    with GGUFFile(path) as f:
        assert f.metadata["general.alignment"] == 64
        assert all(info.offset % 64 == 0 for info in f.tensors.values())
        assert f.raw_tensor("b").view(np.float32).tolist() == [2.0] * 5


def test_version_2_is_read(tmp_path):
    path = _write(tmp_path, _gguf([_kv("general.architecture", 8, _str("llama"))], version=2))
    with GGUFFile(path) as f:
        assert f.version == 2 and f.architecture == "llama"


def test_embedded_model_header(embedded_model_path):
    with GGUFFile(embedded_model_path) as f:
        assert f.architecture == "gemma3"
        assert f.require("gemma3.block_count") == 18
        assert f.require("gemma3.embedding_length") == 640
        tokens = f.require("tokenizer.ggml.tokens")
        assert len(tokens) == 262144 and all(isinstance(s, str) for s in tokens[:100])
        assert len(f.require("tokenizer.ggml.scores")) == 262144
        assert f.tensors["token_embd.weight"].shape == (262144, 640)
        assert f.tensors["token_embd.weight"].ggml_type == T.Q8_0
        assert len([n for n in f.tensors if n.startswith("blk.17.")]) > 0
        assert not any(n.startswith("blk.18.") for n in f.tensors)
        last = max(info.offset + info.nbytes for info in f.tensors.values())
        assert last <= embedded_model_path.stat().st_size


# ---- files that are not GGUF at all ---------------------------------------------------------


def test_missing_file(tmp_path):
    exc = _open_fails(tmp_path / "nope.gguf")
    assert "not found" in str(exc)


def test_directory(tmp_path):
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    assert "folder" in str(_open_fails(folder))


@pytest.mark.parametrize(
    "content",
    [b"", b"G", b"GGUF", b"hello world\n", b"Once upon a time there was a model file. " * 20, b"\0" * 4096,
     b"GGML" + b"\0" * 100, b"FUGG" + struct.pack("<IQQ", 3, 0, 0)],
    ids=["empty", "one-byte", "magic-only", "short-text", "long-text", "zeros", "ggml-magic", "reversed-magic"],
)
def test_not_a_gguf_file(tmp_path, content):
    path = _write(tmp_path, content, "notes.txt")
    exc = _open_fails(path)
    assert "not a GGUF" in str(exc) or "truncated" in str(exc)


@pytest.mark.parametrize("version", [0, 1, 4, 99, 0xFFFFFFFF])
def test_unsupported_version(tmp_path, version):
    exc = _open_fails(_write(tmp_path, _gguf(version=version)))
    assert f"version {version}" in str(exc)


def test_big_endian_file(tmp_path):
    content = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    exc = _open_fails(_write(tmp_path, content + b"\0" * 32))
    assert "big-endian" in str(exc)


# ---- truncated files ------------------------------------------------------------------------


def test_truncated_factory_file_at_every_byte(tmp_path):
    rng = np.random.default_rng(1)
    full = write_gguf(
        tmp_path / "full.gguf",
        metadata={"tiny.count": 3, "tiny.name": "x" * 40, "tiny.tokens": ["a", "bc", "def"],
                  "tiny.scores": np.arange(5, dtype=np.float32)},
        tensors={"a": rng.standard_normal(16).astype(np.float32),
                 "b": (rng.standard_normal((2, 32)).astype(np.float32), T.Q8_0)},
    ).read_bytes()
    with GGUFFile(tmp_path / "full.gguf") as f:
        data_end = max(info.offset + info.nbytes for info in f.tensors.values())
    assert data_end < len(full)  # the writer pads after the last tensor
    cut_path = tmp_path / "cut.gguf"
    for cut in range(len(full)):
        cut_path.write_bytes(full[:cut])
        if cut < data_end:
            exc = _open_fails(cut_path)
            assert "truncated" in str(exc) or "not a GGUF" in str(exc), (cut, str(exc))
        else:  # only trailing padding is missing: the file is still complete
            with GGUFFile(cut_path) as f:
                assert f.raw_tensor("b").nbytes == 68


def _embedded_layout(path):
    """(data_start, size of the tensor directory) of a GGUF file."""
    with GGUFFile(path) as f:
        data_start = min(info.offset for info in f.tensors.values())
        directory = sum(8 + len(n.encode()) + 4 + 8 * len(i.shape) + 4 + 8 for n, i in f.tensors.items())
    return data_start, directory


def test_truncated_embedded_model(tmp_path, embedded_model_path):
    data_start, directory = _embedded_layout(embedded_model_path)
    dir_start_max = data_start - directory  # the directory starts 0-31 bytes before this
    cuts = {
        "in the magic": 3,
        "in the header": 20,
        "just after the header": 24,
        "in the first key": 30,
        "in the metadata": 1000,
        "in the vocabulary": 3_000_000,
        "at the end of the metadata": dir_start_max - 40,
        "at the start of the tensor directory": dir_start_max + 10,
        "in the tensor directory": dir_start_max + directory // 2,
        "at the end of the tensor directory": data_start - 32,
        "at the start of the tensor data": data_start,
        "in the tensor data": data_start + 1_000_000,
    }
    cut_path = tmp_path / embedded_model_path.name
    with open(embedded_model_path, "rb") as src:
        for where, cut in cuts.items():
            src.seek(0)
            cut_path.write_bytes(src.read(cut))  # only the first `cut` bytes of the model
            exc = _open_fails(cut_path)
            assert "truncated" in str(exc) or "not a GGUF" in str(exc), (where, str(exc))
            if cut >= data_start:
                assert "Download or copy it again" in str(exc), str(exc)


# ---- corrupt files --------------------------------------------------------------------------


def test_huge_string_lengths(tmp_path):
    huge = struct.pack("<Q", 1 << 62)
    cases = {
        "key": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + huge + b"abc" * 20,
        "string value": _gguf([_str("general.name") + struct.pack("<I", 8) + huge + b"x" * 64]),
        "string in array": _gguf([_kv("tok", 9, struct.pack("<IQ", 8, 2) + _str("ok") + huge + b"x" * 64)]),
        "tensor name": b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + huge + b"\0" * 64,
    }
    for what, content in cases.items():
        exc = _open_fails(_write(tmp_path, content, f"{what.replace(' ', '_')}.gguf"))
        assert "truncated or corrupt" in str(exc), (what, str(exc))


def test_huge_counts(tmp_path):
    cases = {
        "tensor count": b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0) + b"\0" * 64,
        "metadata count": b"GGUF" + struct.pack("<IQQ", 3, 0, (1 << 64) - 1) + b"\0" * 64,
        "string array": _gguf([_kv("tok", 9, struct.pack("<IQ", 8, 1 << 61))]),
        "number array": _gguf([_kv("scores", 9, struct.pack("<IQ", 6, 1 << 62))]),
        "nested array": _gguf([_kv("nest", 9, struct.pack("<IQ", 9, 1 << 40))]),
        "tensor dims": _gguf(infos=[_tensor_info("w", [1 << 40, 1 << 20], 0)]),
        "tensor offset": _gguf(infos=[_tensor_info("w", [4], 0, offset=1 << 62)]),
    }
    for what, content in cases.items():
        exc = _open_fails(_write(tmp_path, content))
        assert "corrupt" in str(exc) or "truncated" in str(exc), (what, str(exc))


def test_deeply_nested_arrays(tmp_path):
    nested = struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 4, 0)
    exc = _open_fails(_write(tmp_path, _gguf([_kv("nest", 9, nested)])))
    assert "corrupt" in str(exc)


def test_unknown_tensor_type(tmp_path):
    exc = _open_fails(_write(tmp_path, _gguf(infos=[_tensor_info("blk.0.w", [32], 99)], data=b"\0" * 64)))
    assert "unknown tensor type (99)" in str(exc) and "blk.0.w" in str(exc)


def test_unknown_value_types(tmp_path):
    exc = _open_fails(_write(tmp_path, _gguf([_kv("odd", 77, b"\0" * 16)])))
    assert "unknown metadata value type 77" in str(exc)
    exc = _open_fails(_write(tmp_path, _gguf([_kv("odd", 9, struct.pack("<IQ", 55, 1) + b"\0" * 16)])))
    assert "unknown array element type 55" in str(exc)


def test_bad_tensor_shapes(tmp_path):
    too_many = _gguf(infos=[_tensor_info("w", [1] * 9, 0)], data=b"\0" * 32)
    assert "9 dimensions" in str(_open_fails(_write(tmp_path, too_many)))
    partial_block = _gguf(infos=[_tensor_info("w", [33], int(T.Q8_0))], data=b"\0" * 128)
    assert "do not fit Q8_0 blocks" in str(_open_fails(_write(tmp_path, partial_block)))


@pytest.mark.parametrize(
    "alignment",
    [struct.pack("<I", 4) + struct.pack("<I", 0), struct.pack("<I", 4) + struct.pack("<I", 48),
     struct.pack("<I", 8) + _str("32"), struct.pack("<I", 9) + struct.pack("<IQ", 4, 1) + b"\0" * 4,
     struct.pack("<I", 6) + struct.pack("<f", float("nan")), struct.pack("<I", 5) + struct.pack("<i", -32)],
    ids=["zero", "not-power-of-two", "string", "array", "nan", "negative"],
)
def test_bad_alignment(tmp_path, alignment):
    content = _gguf([_str("general.alignment") + alignment], [_tensor_info("w", [4], 0)], b"\0" * 64)
    assert "alignment" in str(_open_fails(_write(tmp_path, content)))


def test_random_corruption_raises_only_model_error(tmp_path):
    """Flip bytes of a small valid file: it either still opens or fails with a ModelError."""
    rng = np.random.default_rng(2)
    good = write_gguf(
        tmp_path / "good.gguf",
        metadata={"tiny.count": 3, "tiny.tokens": ["a", "bc", "def"], "tiny.scores": np.arange(4, dtype=np.float32)},
        tensors={"a": np.ones(8, np.float32), "b": (np.ones((1, 32), np.float32), T.Q4_0)},
    ).read_bytes()
    with GGUFFile(tmp_path / "good.gguf") as f:
        header_end = min(info.offset for info in f.tensors.values())  # flips in data are harmless
    bad_path = tmp_path / "bad.gguf"
    opened = 0
    for _ in range(400):
        content = bytearray(good)
        for pos in rng.integers(4, header_end, size=rng.integers(1, 4)):
            content[pos] = rng.choice([0x00, 0xFF, 0x7F, 0x80, int(rng.integers(0, 256))])
        bad_path.write_bytes(bytes(content))
        try:
            GGUFFile(bad_path).close()
            opened += 1
        except ModelError as exc:
            _assert_readable(exc, bad_path)
    assert opened < 400


# ---- files that are not regular files -------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs need a POSIX system")
def test_a_fifo_named_gguf_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def open_it():
        try:
            GGUFFile(fifo).close()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=open_it, daemon=True)
    worker.start()
    worker.join(timeout=120)  # a safety net only: the refusal takes microseconds
    if worker.is_alive():
        with open(fifo, "wb"):  # release the blocked open() so the thread can end
            pass
        pytest.fail("opening a FIFO blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], ModelError), outcome
    assert "not a regular file" in str(outcome[0]) and "pipe.gguf" in str(outcome[0])


# ---- the tensor directory as a whole --------------------------------------------------------


def _two_tensor_file(tmp_path, **metadata):
    return write_gguf(tmp_path / "two.gguf", metadata=metadata,
                      tensors={"first": np.ones(16, np.float32), "second": np.full(16, 2.0, np.float32)})


def _offset_field(content: bytes, name: str, n_dims: int = 1) -> int:
    """Byte position of tensor `name`'s data-offset field in the tensor directory."""
    start = content.index(_str(name))
    return start + len(_str(name)) + 4 + 8 * n_dims + 4


def _patched_offset(content: bytes, name: str, new_offset) -> bytes:
    pos = _offset_field(content, name)
    old = struct.unpack_from("<Q", content, pos)[0]
    value = new_offset(old) if callable(new_offset) else new_offset
    return content[:pos] + struct.pack("<Q", value) + content[pos + 8:]


def test_a_tensor_offset_moved_by_one_byte_is_refused(tmp_path):
    content = _two_tensor_file(tmp_path).read_bytes()
    path = _write(tmp_path, _patched_offset(content, "second", lambda old: old + 1))
    exc = _open_fails(path)
    assert "second" in str(exc) and "alignment (32)" in str(exc)


def test_overlapping_tensors_are_refused(tmp_path):
    content = _two_tensor_file(tmp_path).read_bytes()
    path = _write(tmp_path, _patched_offset(content, "second", 0))
    exc = _open_fails(path)
    assert "first" in str(exc) and "second" in str(exc) and "overlap" in str(exc)


def test_adjacent_tensors_are_fine(tmp_path):
    with GGUFFile(_two_tensor_file(tmp_path, **{"general.alignment": 64})) as f:
        first, second = f.tensors["first"], f.tensors["second"]
        assert second.offset == first.offset + 64  # 16 floats, padded to the alignment


def test_empty_dimensions_and_zero_dimension_tensors_are_refused(tmp_path):
    empty = _gguf(infos=[_tensor_info("w", [4, 0], 0)], data=b"\0" * 32)
    assert "empty dimension" in str(_open_fails(_write(tmp_path, empty)))
    scalar = _gguf(infos=[_tensor_info("w", [], 0)], data=b"\0" * 32)
    assert "0 dimensions" in str(_open_fails(_write(tmp_path, scalar)))


def test_repeated_names_are_refused(tmp_path):
    twice = _gguf(infos=[_tensor_info("w", [4], 0), _tensor_info("w", [4], 0, offset=32)], data=b"\0" * 64)
    assert "tensor w appears twice" in str(_open_fails(_write(tmp_path, twice)))
    key = _kv("general.name", 8, _str("a"))
    assert "'general.name' appears twice" in str(_open_fails(_write(tmp_path, _gguf([key, key]))))


def test_a_huge_alignment_is_refused(tmp_path):
    content = _gguf([_kv("general.alignment", 4, struct.pack("<I", 1 << 31))], [_tensor_info("w", [4], 0)])
    assert "alignment" in str(_open_fails(_write(tmp_path, content)))


# ---- typed metadata accessors ---------------------------------------------------------------


@pytest.fixture
def meta_file(tmp_path):
    path = write_gguf(tmp_path / "meta.gguf", metadata={
        "gemma3.head_count_kv": 0,
        "gemma3.head_count": 4,
        "gemma3.context_length": "32768",
        "gemma3.context_array": [32768, 1],
        "gemma3.rms_eps": float("nan"),
        "gemma3.rope_base": 0.0,
        "gemma3.rope_int": 10000,
        "gemma3.inf": (float("inf"), GGUFValueType.FLOAT64),
        "gemma3.eps": 1e-6,
        "gemma3.flag": True,
        "gemma3.big": ((1 << 64) - 1, GGUFValueType.UINT64),
        "tok.types": np.array([1, 1, 3, 6], dtype=np.int32),
        "tok.scores": np.array([0.0, -1.5, np.nan], dtype=np.float32),
        "tok.good_scores": np.array([0.0, -1.5], dtype=np.float32),
        "tok.tokens": ["<pad>", "<eos>"],
        "general.name": "tiny",
    })
    with GGUFFile(path) as f:
        yield f


def _refused(call, *args, **kwargs) -> str:
    with pytest.raises(ModelError) as info:
        call(*args, **kwargs)
    msg = str(info.value)
    assert "meta.gguf" in msg and repr(args[0]) in msg, msg
    return msg


def test_get_int(meta_file):
    f = meta_file
    assert f.get_int("gemma3.head_count", min=1) == 4 and type(f.get_int("gemma3.head_count")) is int
    assert f.get_int("gemma3.rope_int") == 10000
    assert "from 1 to 64" in _refused(f.get_int, "gemma3.head_count_kv", min=1, max=64)
    assert "1 or more" in _refused(f.get_int, "gemma3.head_count_kv", min=1)
    assert "'32768' (text)" in _refused(f.get_int, "gemma3.context_length", min=1)
    assert "a list of 2" in _refused(f.get_int, "gemma3.context_array", min=1)
    _refused(f.get_int, "gemma3.flag")  # a bool is not a number
    _refused(f.get_int, "gemma3.eps")  # nor is a float
    assert "at most" in _refused(f.get_int, "gemma3.big", max=(1 << 63) - 1)
    assert "missing" in _refused(f.get_int, "gemma3.nope")
    assert f.get_int("gemma3.nope", 7) == 7 and f.get_int("gemma3.nope", None) is None


def test_get_float(meta_file):
    f = meta_file
    assert f.get_float("gemma3.eps", positive=True) == pytest.approx(1e-6)
    assert f.get_float("gemma3.rope_int", positive=True) == 10000.0  # an integer is a number too
    assert "finite" in _refused(f.get_float, "gemma3.rms_eps", positive=True)
    assert "finite" in _refused(f.get_float, "gemma3.inf")
    assert "above 0" in _refused(f.get_float, "gemma3.rope_base", positive=True)
    assert f.get_float("gemma3.rope_base") == 0.0
    assert f.get_float("gemma3.eps", min=0, max=0.5) == pytest.approx(1e-6)
    assert "at most 100" in _refused(f.get_float, "gemma3.rope_int", max=100)
    _refused(f.get_float, "gemma3.context_length")
    _refused(f.get_float, "gemma3.flag")
    assert f.get_float("gemma3.nope", 1e-6) == 1e-6


def test_get_str_and_bool(meta_file):
    f = meta_file
    assert f.get_str("general.name") == "tiny" and f.get_str("general.missing", "x") == "x"
    assert "must be text" in _refused(f.get_str, "gemma3.head_count")
    assert f.get_bool("gemma3.flag") is True and f.get_bool("gemma3.nope", False) is False
    _refused(f.get_bool, "gemma3.head_count")  # 4 is not true or false
    _refused(f.get_bool, "gemma3.nope")


def test_get_arrays(meta_file):
    f = meta_file
    types = f.get_int_array("tok.types", min=1, max=6, length=4)
    assert types.dtype == np.int64 and types.tolist() == [1, 1, 3, 6]
    assert "4 entries where 5" in _refused(f.get_int_array, "tok.types", length=5)
    _refused(f.get_int_array, "tok.types", max=5)
    _refused(f.get_int_array, "tok.good_scores")  # floats are not whole numbers
    _refused(f.get_int_array, "gemma3.head_count")  # a scalar is not a list
    scores = f.get_float_array("tok.good_scores", length=2)
    assert scores.dtype == np.float32 and scores.tolist() == [0.0, -1.5]
    assert "nan" in _refused(f.get_float_array, "tok.scores")
    assert f.get_str_array("tok.tokens", length=2) == ["<pad>", "<eos>"]
    _refused(f.get_str_array, "tok.types")
    assert f.get_int_array("tok.nope", None) is None
