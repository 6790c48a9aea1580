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
plain message instead of a numpy error, a MemoryError or a hang. Only regular files are opened
(a FIFO named `x.gguf` would block `open()` forever), and the tensor directory is checked as a
whole: every tensor's data is aligned to `general.alignment`, lies inside the file, overlaps no
other tensor, and has a positive shape whose rows fill whole quantization blocks.

Model config readers take metadata through the typed accessors (`get_int`, `get_float`,
`get_str`, `get_bool`, `get_int_array`, `get_float_array`, `get_str_array`), which check the
stored type and the range the caller needs and raise a `ModelError` naming the key -- so a
`head_count_kv` of 0, a NaN epsilon or a context length stored as text is refused at load
time instead of surfacing as a ZeroDivisionError or empty output.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
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
_MAX_DIMS = 8
MAX_ALIGNMENT = 1 << 16

# "No default given": the key is required.
_REQUIRED: Any = object()


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
        self._file = self._open_regular_file()
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

    def _open_regular_file(self):
        """The file opened for reading, refusing anything but a regular file.

        `open()` on a FIFO blocks until a writer appears -- forever, in the one worker that
        loads models -- so the type is checked before opening, the open itself is
        non-blocking, and the opened descriptor is checked again (the path may have been
        swapped in between)."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            raise ModelError(f"Model file not found: {self.path}") from None
        except OSError as exc:
            raise ModelError(f"Cannot read {self.path}: {exc.strerror or exc}") from exc
        if stat.S_ISDIR(info.st_mode):
            raise ModelError(f"{self.path} is a folder, not a GGUF model file.")
        not_regular = (f"{self.path.name} is not a GGUF model file: it is not a regular file "
                       "(a pipe, socket or device).")
        if not stat.S_ISREG(info.st_mode):
            raise ModelError(not_regular)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(self.path, flags)
        except OSError as exc:
            raise ModelError(f"Cannot read {self.path}: {exc.strerror or exc}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ModelError(not_regular)
        return os.fdopen(fd, "rb")

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
            if key in self.metadata:
                raise ModelError(f"{self.path.name} is corrupt: the metadata key {key!r} appears twice.")
            self.metadata[key] = cur.value(cur.u32(key), key)

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.u32(name)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ModelError(f"{self.path.name} is corrupt: tensor {name} has {n_dims} dimensions.")
            dims = [cur.u64(name) for _ in range(n_dims)]
            type_id = cur.u32(name)
            offset = cur.u64(name)
            infos.append((name, dims, type_id, offset))

        alignment = self._alignment()
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise ModelError(f"{self.path.name} is corrupt: the tensor {name} appears twice.")
            if offset % alignment:
                raise ModelError(
                    f"{self.path.name} is corrupt: tensor {name} starts at data offset {offset:,}, "
                    f"which is not a multiple of the file's alignment ({alignment})."
                )
            self.tensors[name] = self._tensor_info(name, dims, type_id, data_start + offset)
        self._check_no_overlap()

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not _is_int(alignment):
            raise ModelError(f"{self.path.name} is corrupt: alignment {alignment!r} is not an integer.")
        if not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise ModelError(
                f"{self.path.name} is corrupt: alignment {alignment} is not a power of two "
                f"from 1 to {MAX_ALIGNMENT:,}."
            )
        return int(alignment)

    def _check_no_overlap(self) -> None:
        # Sorted by start, each tensor must begin at or after the previous one's end.
        previous: TensorInfo | None = None
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            if previous is not None and info.offset < previous.offset + previous.nbytes:
                raise ModelError(
                    f"{self.path.name} is corrupt: the data of tensors {previous.name} and "
                    f"{info.name} overlap."
                )
            previous = info

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
        if 0 in shape:
            raise ModelError(f"{self.path.name} is corrupt: tensor {name} has an empty dimension {shape}.")
        n = 1
        for d in shape:
            n *= d
        if dims[0] % block_size:
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
        """The raw stored value (unchecked); prefer the typed accessors below."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelError(f"{self.path.name} is missing the metadata key {key!r}.")
        return self.metadata[key]

    # ---- typed metadata accessors -------------------------------------------------------
    # Each returns the value as a plain Python type, or raises a ModelError naming the file
    # and the key. Leaving out `default` makes the key required; a given default (None too)
    # is returned as it is when the key is absent. `min`/`max` are inclusive bounds.

    def get_int(self, key: str, default: Any = _REQUIRED, *, min: int | None = None,
                max: int | None = None) -> int:
        """An integer of any GGUF integer type (not a bool, not a float)."""
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        if not _is_int(value):
            raise self._bad_value(key, value, "a whole number" + _range_text(min, max))
        value = int(value)
        self._check_range(key, value, min, max, "a whole number")
        return value

    def get_float(self, key: str, default: Any = _REQUIRED, *, min: float | None = None,
                  max: float | None = None, positive: bool = False) -> float:
        """A finite number (a float, or an integer type); `positive` also refuses 0."""
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        what = "a finite number" + (" above 0" if positive else "")
        if not (_is_int(value) or isinstance(value, (float, np.floating))):
            raise self._bad_value(key, value, what + _range_text(min, max))
        value = float(value)
        if not math.isfinite(value) or (positive and value <= 0):
            raise self._bad_value(key, value, what + _range_text(min, max))
        self._check_range(key, value, min, max, what)
        return value

    def get_str(self, key: str, default: Any = _REQUIRED) -> str:
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        if not isinstance(value, str):
            raise self._bad_value(key, value, "text")
        return value

    def get_bool(self, key: str, default: Any = _REQUIRED) -> bool:
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        if not isinstance(value, (bool, np.bool_)):
            raise self._bad_value(key, value, "true or false")
        return bool(value)

    def get_int_array(self, key: str, default: Any = _REQUIRED, *, min: int | None = None,
                      max: int | None = None, length: int | None = None) -> np.ndarray:
        """A 1-D array of integers as int64 (each element within `min`/`max`, `length`
        elements if given)."""
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        what = "a list of whole numbers" + _range_text(min, max)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
            raise self._bad_value(key, value, what)
        self._check_length(key, value, length)
        if value.dtype == np.uint64 and value.size and int(value.max()) > np.iinfo(np.int64).max:
            raise self._bad_value(key, int(value.max()), what)
        array = value.astype(np.int64)
        self._check_array_range(key, array, min, max, what)
        return array

    def get_float_array(self, key: str, default: Any = _REQUIRED, *, min: float | None = None,
                        max: float | None = None, length: int | None = None) -> np.ndarray:
        """A 1-D array of finite numbers as float32 (integer arrays are converted)."""
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        what = "a list of finite numbers" + _range_text(min, max)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
            raise self._bad_value(key, value, what)
        self._check_length(key, value, length)
        array = value.astype(np.float32)
        if not np.isfinite(array).all():
            raise self._bad_value(key, float(array[~np.isfinite(array)][0]), what)
        self._check_array_range(key, array, min, max, what)
        return array

    def get_str_array(self, key: str, default: Any = _REQUIRED, *,
                      length: int | None = None) -> list[str]:
        if key not in self.metadata:
            return self._missing(key, default)
        value = self.metadata[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad_value(key, value, "a list of text strings")
        self._check_length(key, value, length)
        return value

    def _missing(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise ModelError(f"{self.path.name} is missing the metadata key {key!r}.")
        return default

    def _bad_value(self, key: str, value: Any, what: str) -> ModelError:
        return ModelError(
            f"{self.path.name} has an invalid value for {key!r}: {_describe(value)} "
            f"(it must be {what}). The file is corrupt or was made for another program."
        )

    def _check_range(self, key: str, value: float, lo: float | None, hi: float | None,
                     what: str) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self._bad_value(key, value, what + _range_text(lo, hi))

    def _check_array_range(self, key: str, array: np.ndarray, lo: float | None,
                           hi: float | None, what: str) -> None:
        if lo is not None and array.size and array.min() < lo:
            raise self._bad_value(key, array.min().item(), what)
        if hi is not None and array.size and array.max() > hi:
            raise self._bad_value(key, array.max().item(), what)

    def _check_length(self, key: str, value: Any, length: int | None) -> None:
        if getattr(value, "ndim", 1) != 1:
            raise self._bad_value(key, value, "a flat list")
        if length is not None and len(value) != length:
            raise ModelError(
                f"{self.path.name} has an invalid value for {key!r}: {len(value):,} entries "
                f"where {length:,} are needed. The file is corrupt or was made for another program."
            )

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


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _range_text(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" from {lo:,} to {hi:,}"
    if lo is not None:
        return f", {lo:,} or more"
    if hi is not None:
        return f", at most {hi:,}"
    return ""


def _describe(value: Any) -> str:
    """A short account of a stored value for an error message (never a 262k-entry dump)."""
    if isinstance(value, np.ndarray):
        return f"a list of {value.size:,} {value.dtype.name} values"
    if isinstance(value, list):
        return f"a list of {len(value):,} entries"
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "…") + " (text)"
    if isinstance(value, (bool, np.bool_)):
        return f"{bool(value)} (true/false)"
    return repr(value.item() if isinstance(value, np.generic) else value)
