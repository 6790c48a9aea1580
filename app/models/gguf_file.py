"""A fast, defensive GGUF reader: header, metadata and tensor directory, tensors via mmap.

gguf-py's `GGUFReader` turns every vocabulary entry into Python objects and takes ~20 s on
the embedded model; this parser reads numeric arrays with `numpy.frombuffer` and strings with
one `struct` call each, so the same file opens in about a second. Tensor bytes are never
copied at open time: `raw_tensor` returns a read-only numpy view over the memory map.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets are relative to here)

Every read is bounds-checked, so a truncated or corrupt file raises `ModelError` with a
plain message instead of a numpy error, a MemoryError or a hang.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from app.models.errors import ModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALAR_TYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("<B", np.dtype("<u1")),
    1: ("<b", np.dtype("<i1")),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype("?")),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
_STRING = 8
_ARRAY = 9
_MAX_ARRAY_DEPTH = 16


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. `shape` is in PyTorch order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Reads little-endian values from a buffer, raising ModelError past its end."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelError(
                f"{self.path.name} is truncated or corrupt: reading {what} at byte {self.pos} "
                f"needs {n} bytes but the file has {len(self.buf)}."
            )

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def string_array(self, count: int, what: str) -> list[str]:
        # The hot loop for a 262k-entry vocabulary: one unpack and one slice per entry.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.need(n, what)
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def array(self, what: str, depth: int = 0) -> Any:
        if depth > _MAX_ARRAY_DEPTH:
            raise ModelError(f"{self.path.name} is corrupt: arrays nested too deeply in {what}.")
        elem_type = self.u32(what)
        count = self.u64(what)
        if elem_type == _STRING:
            self.need(8 * count, what)  # each string has at least its length field
            return self.string_array(count, what)
        if elem_type in _SCALAR_TYPES:
            dtype = _SCALAR_TYPES[elem_type][1]
            self.need(count * dtype.itemsize, what)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return arr
        if elem_type == _ARRAY:
            return [self.array(what, depth + 1) for _ in range(count)]
        raise ModelError(f"{self.path.name} is corrupt: unknown array element type {elem_type} in {what}.")

    def value(self, value_type: int, what: str) -> Any:
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            return self.array(what)
        if value_type in _SCALAR_TYPES:
            return self.scalar(_SCALAR_TYPES[value_type][0], what)
        raise ModelError(f"{self.path.name} is corrupt: unknown metadata value type {value_type} for {what}.")


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo).

    Numeric metadata arrays are numpy arrays viewing the memory map; string arrays are lists.
    Use as a context manager, or call `close()`; tensors returned by `raw_tensor` must not be
    used after closing.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelError(f"Model file not found: {self.path}")
        if self.path.is_dir():
            raise ModelError(f"{self.path} is a folder, not a GGUF model file.")
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise ModelError(f"Cannot read {self.path}: {exc.strerror or exc}") from exc
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 24:
                raise ModelError(f"{self.path.name} is not a GGUF model file (only {size} bytes).")
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            self._file.close()
            raise ModelError(f"Cannot read {self.path}: {exc.strerror or exc}") from exc
        except ModelError:
            self._file.close()
            raise
        self._view = memoryview(self._mmap)
        try:
            self._parse()
        except ModelError:
            self.close()
            raise

    def _parse(self) -> None:
        cur = _Cursor(self._view, self.path)
        if bytes(self._view[:4]) != GGUF_MAGIC:
            raise ModelError(
                f"{self.path.name} is not a GGUF model file (it does not start with 'GGUF')."
            )
        cur.pos = 4
        self.version = cur.u32("the version")
        if self.version not in SUPPORTED_VERSIONS and self.version.to_bytes(4, "little")[::-1] in (
            v.to_bytes(4, "little") for v in SUPPORTED_VERSIONS
        ):
            raise ModelError(
                f"{self.path.name} is a big-endian GGUF file; only little-endian files are supported."
            )
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelError(
                f"{self.path.name} uses GGUF version {self.version}; supported versions are "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}."
            )
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        # Each entry takes at least a few bytes, so larger counts can only come from corruption.
        if n_tensors > len(self._view) // 24 or n_kv > len(self._view) // 12:
            raise ModelError(
                f"{self.path.name} is truncated or corrupt: its header lists {n_tensors:,} tensors "
                f"and {n_kv:,} metadata entries, more than its {len(self._view):,} bytes can hold."
            )

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            self.metadata[key] = cur.value(cur.u32(key), key)

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.u32(name)
            if n_dims > 8:
                raise ModelError(f"{self.path.name} is corrupt: tensor {name} has {n_dims} dimensions.")
            dims = [cur.u64(name) for _ in range(n_dims)]
            type_id = cur.u32(name)
            offset = cur.u64(name)
            infos.append((name, dims, type_id, offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool):
            raise ModelError(f"{self.path.name} is corrupt: alignment {alignment!r} is not an integer.")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelError(f"{self.path.name} is corrupt: alignment {alignment} is not a power of two.")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            self.tensors[name] = self._tensor_info(name, dims, type_id, data_start + offset)

    def _tensor_info(self, name: str, dims: list[int], type_id: int, offset: int) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelError(
                f"{self.path.name}: tensor {name} has an unknown tensor type ({type_id}); "
                "the file may be newer than this app or corrupt."
            ) from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        n = 1
        for d in shape:
            n *= d
        if dims and dims[0] % block_size:
            raise ModelError(
                f"{self.path.name} is corrupt: tensor {name} rows of {dims[0]} do not fit "
                f"{ggml_type.name} blocks of {block_size}."
            )
        nbytes = n // block_size * type_size
        if offset + nbytes > len(self._view):
            raise ModelError(
                f"{self.path.name} is truncated: tensor {name} ends at byte {offset + nbytes:,} "
                f"but the file has only {len(self._view):,} bytes. Download or copy it again."
            )
        return TensorInfo(name, shape, ggml_type, offset, nbytes)

    def raw_tensor(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` as a read-only uint8 array over the mmap."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelError(f"{self.path.name} has no tensor named {name!r}.")
        return np.frombuffer(self._view, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelError(f"{self.path.name} is missing the metadata key {key!r}.")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def close(self) -> None:
        # Views handed out by raw_tensor keep the mmap alive; closing then is a no-op for them.
        try:
            self._view.release()
            self._mmap.close()
        except (BufferError, AttributeError, ValueError):
            pass
        if hasattr(self, "_file"):
            self._file.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
