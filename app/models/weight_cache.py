"""A model's prepared weights saved once and memory-mapped by every load.

Turning GGUF blocks into what the model multiplies by (4-bit planes, float16/bfloat16
copies) is most of a load's time; the result depends only on the file and the weight format.
So the first load saves the prepared slots in the data folder, and every load, that first
one included, maps them (`torch.load(mmap=True)`): the pages are read as the model touches
them, shared with the OS page cache. (Running on what it built held Gemma 3 270M's first
session at 919 MB resident after loading against 373 mapped, and decoded ~5% slower than
later sessions, measured side by side.)

An entry is a folder of parts: one file per layer and one for the rest (embedding, head,
final norm), named in its `entry.json`, which is written last, so a folder without it is
an entry still being written or torn by a crash, and is never read. The first load writes
each layer's part as soon as that layer is built and from then on runs the layer from it,
mapped (`EntryWriter`), so the build holds about one layer's prepared weights in memory
instead of the whole model's: a 1.8 GB synthetic 3B model's first load peaked at 2.7 GB of
process memory when the whole model was built before saving it, and at 0.8 GB so.

The folder's name carries a hash of everything the result depends on (the model file's
path, size and modification time, the format, the torch version, this module's layout
version); only the newest entry per model file is kept (on Windows a part a running model
still maps stays until a later load), and an unreadable entry is deleted and rebuilt.
Beside each model file's entries a small text file (`<prefix>.source`) names the model
file; an entry whose model file is gone (deleted, moved, a temporary copy) is deleted at the
next store or restore, so the folder never keeps hundreds of MB for models the person no
longer has.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

from app.heap import release_freed_memory
from app.models.layers import DualWeight, WeightFormat
from app.models.int8_products import Int8Codes
from app.models.quantized import Int4Codes, QuantizedWeight, RawTensor

LAYOUT_VERSION = 14  # 2: 4-bit weights use their planes up to 8 rows (was 2); 3: screened heads;
#                   4: only from SCREEN_MIN_ROWS tokens; 5: Q2_K/Q3_K/Q6_K as two planes;
#                   6: two planes packed side by side, one product; 7: screened from 32,768
#                   tokens, one in 128 of them rescored; 8: a folder of parts (was one file);
#                   9: a joined product's parts hold slices of its scales, not copies;
#                   10: `Int8Codes` for the 8-bit activation kernel; 11: 5-bit codes in
#                   5.5 bits (`int8_products.FIVES`); 12: `Int8Codes` interleaved by
#                   groups of 8 outputs; 13: NIBBLES pair codes j and 16 + j of one block;
#                   14: FIVES' fifth bits sliced, bit q of a byte for inputs 4q..
MANIFEST = "entry.json"  # {"parts": [file names]}: written last, the entry is complete with it
# Entries whose model file no `.source` names (written before those files existed): deleted
# once this old (by modification time) unless a load uses them first (which writes their
# `.source`).
UNNAMED_ENTRY_MAX_AGE_S = 30 * 24 * 3600
# Files in an entry's folder that its manifest does not name (a load that crashed while
# writing, or lost to another process writing the same entry): deleted once this old, far
# longer than any load takes, so a part another process is writing right now is left alone.
STRAY_PART_MAX_AGE_S = 24 * 3600


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
        self.path = folder / f"{self.prefix}-{hashlib.sha1(identity.encode()).hexdigest()[:16]}"
        self.source = folder / f"{self.prefix}.source"

    # ---- writing -------------------------------------------------------------------------

    def writer(self, model) -> "EntryWriter":
        """A writer for the entry of `model`, an empty model about to be built: told of each
        slot as the build fills it, it saves the model part by part (`EntryWriter`)."""
        return EntryWriter(self, model)

    def _published(self, parts: list[str]) -> None:
        """After the entry (of `parts`) was written or read: old files in its folder that
        it does not name, and older entries for the same model file, go."""
        self._drop_strays(parts)
        self._drop_older()
        self._name_source()
        prune(self.folder)

    def _drop_strays(self, parts: list[str]) -> None:
        """Delete the files of this entry's folder that its manifest does not name, once
        `STRAY_PART_MAX_AGE_S` old (a part a load left when it was killed while writing)."""
        keep = set(parts) | {MANIFEST}
        cutoff = time.time() - STRAY_PART_MAX_AGE_S
        with contextlib.suppress(OSError):
            for path in self.path.iterdir():
                if path.name not in keep and path.stat().st_mtime < cutoff:
                    _remove(path)

    def _drop_older(self) -> None:
        """Delete this model file's other entries (other formats, older layouts). One that
        Windows keeps, because a running model maps it, goes at a later store or restore."""
        for old in self.folder.glob(f"{self.prefix}-*"):
            if old != self.path:
                _remove_entry(old)

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
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            return False
        try:
            parts = json.loads(manifest.read_text(encoding="utf-8"))["parts"]
            filled = set()
            for part in parts:
                if Path(part).name != part:
                    raise ValueError("a part outside the entry")
                saved = torch.load(self.path / part, mmap=True, weights_only=True)
                spec, tensors = saved["spec"], saved["tensors"]
                for slot, description in spec.items():
                    owner, name = _owner(model, slot)
                    setattr(owner, name, _rebuild(description, tensors))
                filled |= set(spec)
            if filled != set(model.slot_shapes()):
                raise ValueError("slots differ")
            model.finish_loading()
        except Exception:  # any damage: a torn part, a foreign layout; rebuild from the model file
            _remove_entry(self.path)
            return False
        self._published(parts)
        return True


class EntryWriter:
    """Writes one entry while a first load builds the model: each layer as a part of its
    own once its last slot is filled (`assigned`, `fill_weights`' callback), and each other
    slot (embedding, head, final norm) once filled, the slots then running from that part,
    mapped, so the build's memory goes back part by part; and at `finish` whatever is not
    written yet as one more part, then the manifest.

    The parts are written on a thread of their own while the build goes on (torch lets go of
    the GIL while it writes), one at a time: a part waits for the one before it, so the
    build runs at most a part ahead of the disk and holds at most two parts in memory. A
    slot the build has handed over is not touched by it again until `drain`, which the
    build calls before it joins the layers for good. (Writing in turn with the build, a
    1.8 GB model's first load spent ~5 of its ~14 s in the writes.)

    Parts are named after their writer, so two loads writing the same entry at once never
    write one file; the manifest written last wins. A part that cannot be written (a full
    disk) leaves its slots, and every later part's, in memory: the load goes on, and
    `finish` says False (that only costs the next load's time)."""

    def __init__(self, cache: WeightCache, model):
        self.cache, self.model = cache, model
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this writer's, in its parts' names
        self.parts: list[str] = []
        self.written: set[str] = set()  # slots in a part
        self.unfilled = {i: set(layer.slot_shapes()) for i, layer in enumerate(model.layers)}
        self.failed = False
        self._thread: threading.Thread | None = None  # the part being written
        self._error: BaseException | None = None  # what stopped it, besides the disk

    def assigned(self, slot: str) -> None:
        if self.failed:
            return
        if not slot.startswith("layers."):  # the embedding, the head, the final norm
            self._start(self._write_slot, slot)
            return
        _, index, name = slot.split(".", 2)
        unfilled = self.unfilled.get(int(index))
        if unfilled is None or name not in unfilled:
            return
        unfilled.discard(name)
        if not unfilled:
            # Joined first, so the part holds each joined product once and the mapped slots
            # are views of it (`fuse` joins those again as a view, never as a copy).
            self.model.layers[int(index)].fuse_products()
            self._start(self._write_layer, int(index))

    def _start(self, job, arg) -> None:
        self.drain()
        if self.failed:
            return
        self._thread = threading.Thread(target=self._run, args=(job, arg), daemon=True,
                                        name="weight-cache-part")
        self._thread.start()

    def _run(self, job, arg) -> None:
        try:
            job(arg)
        except BaseException as exc:  # handed to the build's thread by `drain`
            self.failed = True
            self._error = exc

    def drain(self) -> None:
        """Wait for the part being written; raise what stopped it other than the disk."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write_layer(self, index: int) -> None:
        layer = self.model.layers[index]
        slots = {f"layers.{index}.{name}": getattr(layer, name) for name in layer.slot_shapes()}
        if self._write_part(f"layer-{index}", slots):
            layer.fuse_products()  # on the mapped views: lets the built tensors go
            release_freed_memory()  # which the C heap would keep otherwise (see `app.heap`)

    def _write_slot(self, slot: str) -> None:
        if self._write_part(slot, {slot: getattr(self.model, slot)}):
            release_freed_memory()

    def _write_part(self, name: str, slots: dict) -> bool:
        """Save `slots` as a part and put them back in the model mapped from it; False (and
        the writer failed) when it could not be written."""
        written = self._write(name, slots)
        if written is None:
            self.failed = True
            return False
        spec, tensors = written
        for slot, description in spec.items():
            owner, attribute = _owner(self.model, slot)
            setattr(owner, attribute, _rebuild(description, tensors))
        return True

    def _write(self, name: str, slots: dict) -> tuple[dict, dict] | None:
        """Save `slots` as a part -> (their descriptions, the part's tensors mapped), or
        None when it could not be written."""
        tensors: dict[str, torch.Tensor] = {}
        spec = {slot: _describe(value, slot, tensors) for slot, value in slots.items()}
        path = self.cache.path / f"{name}.{self.tag}.pt"
        try:
            self.cache.path.mkdir(parents=True, exist_ok=True)
            torch.save({"spec": spec, "tensors": tensors}, path)
            mapped = torch.load(path, mmap=True, weights_only=True)["tensors"]
        except (OSError, RuntimeError):  # a full disk, a read-only folder, a torn write
            _remove(path)
            return None
        self.parts.append(path.name)
        self.written |= set(slots)
        return spec, mapped

    def finish(self) -> bool:
        """Write the remaining slots and the manifest; False (this writer's parts deleted)
        when the entry could not be completed."""
        self.drain()
        model = self.model
        rest = {slot: model._slot_value(slot) for slot in model.slot_shapes() if slot not in self.written}
        manifest = self.cache.path / MANIFEST
        tmp = manifest.with_name(f"{MANIFEST}.{self.tag}.tmp")
        try:
            if rest and self._write("rest", rest) is None:
                raise OSError("a part could not be written")
            tmp.write_text(json.dumps({"parts": self.parts}), encoding="utf-8")
            os.replace(tmp, manifest)
        except OSError:
            _remove(tmp)
            self.abandon()
            return False
        self.cache._published(self.parts)
        return True

    def abandon(self) -> None:
        """Delete this writer's parts: the build failed (a damaged model file, a cancelled
        load) or the entry could not be completed. (A part Windows keeps, because the
        half-built model still maps it, goes as a stray at a later load.)"""
        with contextlib.suppress(Exception):  # (the build's own error is the one to report)
            self.drain()
        for part in self.parts:
            _remove(self.cache.path / part)
        self.parts = []
        with contextlib.suppress(OSError):
            self.cache.path.rmdir()  # (only when nothing else is in it)



def _remove(path: Path) -> None:
    """Delete a file if it is there and the system lets us (a read-only folder, or a file
    Windows keeps because it is mapped, stays); the cache never fails a load for it."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _remove_entry(path: Path) -> None:
    """Delete an entry: a folder of parts, or one file (the layout before version 8). A
    part Windows keeps, because it is mapped, stays, and its folder with it."""
    if path.is_dir():
        with contextlib.suppress(OSError):
            for part in path.iterdir():
                _remove(part)
        with contextlib.suppress(OSError):
            path.rmdir()
    else:
        _remove(path)


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
                for entry in folder.glob(f"{prefix}-*"):
                    _remove_entry(entry)
                source.unlink(missing_ok=True)
        cutoff = time.time() - UNNAMED_ENTRY_MAX_AGE_S
        for entry in folder.glob("*-*"):
            if entry.name.split("-", 1)[0] not in named and entry.stat().st_mtime < cutoff:
                _remove_entry(entry)
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
        codes = value.codes
        if isinstance(codes, Int8Codes):  # [codes, scales, offsets, planes, layout]
            described = [put("c", codes.codes), put("s", codes.scales), put("o", codes.offsets),
                         codes.planes, codes.layout]
        else:  # [packed, scale_zeros, planes]
            described = [put("p", codes.packed), put("sz", codes.scale_zeros), codes.planes]
        return {"kind": "int4", "out": value.out_features, "in": value.in_features,
                "act": _dtype_name(value.act_dtype), "narrow_rows_max": value.narrow_rows_max,
                "codes": described,
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
    c = d["codes"]
    if len(c) == 5:
        codes = Int8Codes(tensors[c[0]], tensors[c[1]], tensors[c[2]], int(c[4]), int(c[3]))
    else:
        codes = Int4Codes(tensors[c[0]], tensors[c[1]], int(c[2]))
    return QuantizedWeight(
        codes,
        int(d["out"]), int(d["in"]),
        _dtype(d["act"]), wide=None if d["wide"] is None else tensors[d["wide"]],
        narrow_rows_max=int(d["narrow_rows_max"]), exact_top=int(d.get("exact_top", 0)),
        rows=None if rows is None else RawTensor(tensors[rows["t"]], GGMLQuantizationType(rows["type"]),
                                                 tuple(rows["shape"])))
