"""Write small synthetic GGUF files for tests, with gguf-py's `GGUFWriter`.

    from tests.gguf_factory import write_gguf
    path = write_gguf(tmp_path / "tiny.gguf", metadata={"gemma3.block_count": 2}, tensors={
        "output_norm.weight": np.ones(64, np.float32),                         # F32
        "blk.0.attn_q.weight": (rng.standard_normal((64, 64)), GGMLQuantizationType.Q8_0),
        "blk.0.ffn_down.weight": (q6k_bytes, GGMLQuantizationType.Q6_K),      # raw blocks
    })

Metadata values map to GGUF types as follows: str -> STRING, bool -> BOOL, float -> FLOAT32,
int -> UINT32 when it fits, else INT32 / UINT64 / INT64. A list -> ARRAY of its elements' type
(ints: UINT32, or INT32 if any is negative); a 1-D numpy array keeps its dtype (int32 ->
INT32, float32 -> FLOAT32, ...). `(value, GGUFValueType.X)` forces a type, e.g.
`(3, GGUFValueType.INT64)`, or `([1, 2], GGUFValueType.UINT8)` for an array of that element
type. Empty arrays cannot be written (GGUFWriter refuses them). `general.alignment` also
sets the data alignment of the file.

Tensors are given in torch order (outermost dimension first), like `TensorInfo.shape`: a
float array is written as F32; `(array, type)` is written as that type -- F32/F16 directly,
other types quantized with `gguf.quants.quantize`. For types gguf-py cannot quantize (the
k-quants), pass the raw blocks instead: a uint8 array of shape (..., row_bytes), as
`GGUFFile.raw_tensor` returns them; the logical shape is derived from the block size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType

TensorSpec = np.ndarray | tuple[np.ndarray, GGMLQuantizationType]

_NUMPY_VALUE_TYPES = {
    np.dtype(np.uint8): GGUFValueType.UINT8,
    np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16,
    np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32,
    np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.uint64): GGUFValueType.UINT64,
    np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float32): GGUFValueType.FLOAT32,
    np.dtype(np.float64): GGUFValueType.FLOAT64,
    np.dtype(np.bool_): GGUFValueType.BOOL,
}


def _scalar_type(value: Any) -> GGUFValueType:
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, np.generic):
        return _NUMPY_VALUE_TYPES[value.dtype]
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, int):
        if 0 <= value < 1 << 32:
            return GGUFValueType.UINT32
        if -(1 << 31) <= value < 0:
            return GGUFValueType.INT32
        return GGUFValueType.UINT64 if value > 0 else GGUFValueType.INT64
    raise TypeError(f"write_gguf: no GGUF type for metadata value {value!r}")


def _array_type(values: list | tuple) -> GGUFValueType:
    """The element type for a list: ints get INT32 if any is negative (UINT32 otherwise)."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        lo, hi = min(values), max(values)
        if lo >= 0:
            return GGUFValueType.UINT32 if hi < 1 << 32 else GGUFValueType.UINT64
        return GGUFValueType.INT32 if lo >= -(1 << 31) and hi < 1 << 31 else GGUFValueType.INT64
    return _scalar_type(values[0])


def _add_metadata(writer: GGUFWriter, key: str, value: Any) -> None:
    forced: GGUFValueType | None = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        value, forced = value
    if isinstance(value, np.ndarray):
        sub = forced if forced is not None else _NUMPY_VALUE_TYPES[value.dtype]
        value, forced = value.tolist(), None
    elif isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"write_gguf: GGUFWriter cannot write the empty array {key!r}")
        sub = forced if forced is not None else _array_type(value)
        forced = None
    else:
        writer.add_key_value(key, value, forced if forced is not None else _scalar_type(value))
        return
    if not value:
        raise ValueError(f"write_gguf: GGUFWriter cannot write the empty array {key!r}")
    writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=sub)


def _add_tensor(writer: GGUFWriter, name: str, spec: TensorSpec) -> None:
    if isinstance(spec, tuple):
        array, qtype = spec
        array, qtype = np.asarray(array), GGMLQuantizationType(qtype)
    else:
        array, qtype = np.asarray(spec), None
    if qtype is None:
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        writer.add_tensor(name, np.ascontiguousarray(array))  # ints go in as I8/I16/I32/I64
        return
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    if qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
        return
    if array.dtype == np.uint8:
        data = np.ascontiguousarray(array)  # already quantized blocks
    else:
        try:
            data = quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
        except NotImplementedError:
            raise ValueError(
                f"write_gguf: gguf-py cannot quantize to {qtype.name}; pass {name!r} as raw "
                f"uint8 blocks of shape (..., row_bytes) instead"
            ) from None
    writer.add_tensor(name, data, raw_dtype=qtype)


def write_gguf(
    path: str | Path,
    *,
    arch: str = "gemma3",
    metadata: Mapping[str, Any] | None = None,
    tensors: Mapping[str, TensorSpec] | None = None,
) -> Path:
    """Write a GGUF v3 file with `general.architecture = arch`, `metadata` and `tensors`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        if key == "general.alignment":
            writer.data_alignment = int(value)
        _add_metadata(writer, key, value)
    for name, spec in (tensors or {}).items():
        _add_tensor(writer, name, spec)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
