"""A model's prepared weights saved once and memory-mapped by every load.

Turning GGUF blocks into what the model multiplies by (4-bit planes, float16/bfloat16
copies) is most of a load's time; the result depends only on the file and the weight format.
So after the first load the prepared slots are written to one file in the data folder, and
every load, that first one included, maps that file (`torch.load(mmap=True)`): the pages are
read as the model touches them, shared with the OS page cache. (The first load then lets its
built tensors go: they held Gemma 3 270M's first session at 919 MB resident after loading
against 373 mapped, and its decode ~5% slower than later sessions', measured side by side.)
The file's name carries a hash of everything the result depends on (the model file's path,
size and modification time, the format, the torch version, this module's layout version);
only the newest entry per model file is kept (on Windows an older one a running model still
maps stays until the next load), and an unreadable entry is deleted and rebuilt. Beside
each model file's entry a small text file (`<prefix>.source`) names the model file; an entry
whose model file is gone (deleted, moved, a temporary copy) is deleted at the next store or
restore, so the folder never keeps hundreds of MB for models the person no longer has.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

from app.models.layers import DualWeight, WeightFormat
from app.models.quantized import Int4Codes, QuantizedWeight, RawTensor

LAYOUT_VERSION = 7  # 2: 4-bit weights use their planes up to 8 rows (was 2); 3: screened heads;
#                   4: only from SCREEN_MIN_ROWS tokens; 5: Q2_K/Q3_K/Q6_K as two planes;
#                   6: two planes packed side by side, one product; 7: screened from 32,768
#                   tokens, one in 128 of them rescored
# Entries written before `.source` files existed name no model file: deleted once this old
# (by modification time) unless a load uses them first (which writes their `.source`).
UNNAMED_ENTRY_MAX_AGE_S = 30 * 24 * 3600


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _dtype(name: str | None) -> torch.dtype | None:
    value = None if name is None else getattr(torch, name, None)
    if name is not None and not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


class WeightCache:
    """The cache entry for one model file in one weight format."""

    def __init__(self, folder: Path, model_path: Path, fmt: WeightFormat, compute_dtype: torch.dtype):
        stat = model_path.stat()
        resolved = str(model_path.resolve())
        identity = "|".join(map(str, (resolved, stat.st_size, stat.st_mtime_ns, fmt.label, fmt.transposed,
                                      fmt.int4_wide_dtype, compute_dtype, torch.__version__,
                                      LAYOUT_VERSION)))
        self.folder = folder
        self.model_path = resolved
        self.prefix = hashlib.sha1(resolved.encode()).hexdigest()[:16]
        self.path = folder / f"{self.prefix}-{hashlib.sha1(identity.encode()).hexdigest()[:16]}.pt"
        self.source = folder / f"{self.prefix}.source"

    # ---- writing -------------------------------------------------------------------------

    def store(self, model) -> bool:
        """Save every slot of a loaded model; older entries for the same file are deleted.
        False when it could not be written (full disk, read-only folder): that only costs
        the next load's time."""
        tensors: dict[str, torch.Tensor] = {}
        spec: dict[str, dict] = {}
        for slot in model.slot_shapes():
            spec[slot] = _describe(model._slot_value(slot), slot, tensors)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.save({"spec": spec, "tensors": tensors}, tmp)
            os.replace(tmp, self.path)
        except OSError:
            _remove(tmp)  # (where the folder is a file, there is no temporary file either)
            return False
        self._drop_older()
        self._name_source()
        prune(self.folder)
        return True

    def _drop_older(self) -> None:
        """Delete this model file's other entries (other formats, older layouts). One that
        Windows keeps, because a running model maps it, goes at a later store or restore."""
        for old in self.folder.glob(f"{self.prefix}-*.pt"):
            if old != self.path:
                _remove(old)

    def _name_source(self) -> None:
        try:
            if not self.source.is_file():
                self.source.write_text(self.model_path, encoding="utf-8")
        except OSError:
            pass  # unnamed, it is only kept until it is old

    # ---- reading -------------------------------------------------------------------------

    def restore(self, model) -> bool:
        """Fill an empty model's slots from the entry; False (and the entry deleted when it
        was damaged) when there is none to use."""
        if not self.path.is_file():
            return False
        try:
            saved = torch.load(self.path, mmap=True, weights_only=True)
            spec, tensors = saved["spec"], saved["tensors"]
            if set(spec) != set(model.slot_shapes()):
                raise ValueError("slots differ")
            for slot, description in spec.items():
                owner, name = _owner(model, slot)
                setattr(owner, name, _rebuild(description, tensors))
            model.finish_loading()
        except Exception:  # any damage: a torn file, a foreign layout; rebuild from the model file
            _remove(self.path)
            return False
        self._drop_older()
        self._name_source()
        prune(self.folder)
        return True


def _remove(path: Path) -> None:
    """Delete a file if it is there and the system lets us (a read-only folder, or a file
    Windows keeps because it is mapped, stays); the cache never fails a load for it."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def prune(folder: Path) -> None:
    """Delete the entries of model files that no longer exist, and entries that name no
    model file once they are `UNNAMED_ENTRY_MAX_AGE_S` old. Never raises: pruning is
    housekeeping, a load must not fail for it."""
    try:
        named = set()
        for source in folder.glob("*.source"):
            prefix = source.stem
            named.add(prefix)
            try:
                model = source.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                continue
            if model and not Path(model).exists():
                for entry in folder.glob(f"{prefix}-*.pt"):
                    entry.unlink(missing_ok=True)
                source.unlink(missing_ok=True)
        cutoff = time.time() - UNNAMED_ENTRY_MAX_AGE_S
        for entry in folder.glob("*.pt"):
            if entry.name.split("-", 1)[0] not in named and entry.stat().st_mtime < cutoff:
                entry.unlink(missing_ok=True)
    except OSError:
        pass


def _owner(model, slot: str):
    if slot.startswith("layers."):
        _, index, name = slot.split(".", 2)
        return model.layers[int(index)], name
    return model, slot


def _describe(value, slot: str, tensors: dict) -> dict:
    def put(suffix: str, tensor: torch.Tensor | None) -> str | None:
        if tensor is None:
            return None
        tensors[f"{slot}.{suffix}"] = tensor
        return f"{slot}.{suffix}"

    if isinstance(value, QuantizedWeight):
        rows = value.rows
        return {"kind": "int4", "out": value.out_features, "in": value.in_features,
                "act": _dtype_name(value.act_dtype), "narrow_rows_max": value.narrow_rows_max,
                "codes": [put("p", value.codes.packed), put("sz", value.codes.scale_zeros),
                          value.codes.planes],
                "wide": put("wide", value.wide), "exact_top": value.exact_top,
                "rows": None if rows is None else {"t": put("rows", rows.data), "type": int(rows.ggml_type),
                                                   "shape": list(rows.shape)}}
    if isinstance(value, DualWeight):
        return {"kind": "dual", "narrow": put("narrow", value.narrow), "wide": put("wide", value.wide)}
    return {"kind": "tensor", "t": put("t", value)}


def _rebuild(d: dict, tensors: dict):
    if d["kind"] == "tensor":
        return tensors[d["t"]]
    if d["kind"] == "dual":
        return DualWeight(tensors[d["narrow"]], tensors[d["wide"]])
    if d["kind"] != "int4":
        raise ValueError(f"unknown slot kind {d['kind']!r}")
    rows = d["rows"]
    return QuantizedWeight(
        Int4Codes(tensors[d["codes"][0]], tensors[d["codes"][1]], int(d["codes"][2])),
        int(d["out"]), int(d["in"]),
        _dtype(d["act"]), wide=None if d["wide"] is None else tensors[d["wide"]],
        narrow_rows_max=int(d["narrow_rows_max"]), exact_top=int(d.get("exact_top", 0)),
        rows=None if rows is None else RawTensor(tensors[rows["t"]], GGMLQuantizationType(rows["type"]),
                                                 tuple(rows["shape"])))
