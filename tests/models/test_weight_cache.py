"""Prepared weights saved once and memory-mapped on later loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.models.layers import WeightFormat
from app.models.loader import load_model
from app.models.quantized import QuantizedWeight

INT4 = WeightFormat(torch.float16, False, torch.bfloat16, True, torch.bfloat16, torch.bfloat16)
IDS = torch.tensor([[2, 818, 5279, 529, 7001, 563]])
# The cache's behaviour is tested on the smaller built-in model (SmolLM2: Q4_1 layers, a tied
# Q8_0 embedding as a screened head; its first load ~2 s against Gemma's ~6); that the entry
# gives back every layout Gemma 3's mixed Q4_K / Q5_0 / Q6_K / Q8_0 blocks are prepared in,
# on the first test.


def _entries(cache: Path) -> list[Path]:
    """The cache's entries: a folder of parts each."""
    return sorted(p for p in cache.iterdir() if p.is_dir())


def _load(path, cache_dir):
    return load_model(path, torch.device("cpu"), torch.float16, torch.float32, torch.bfloat16,
                      int4=INT4, weight_cache_dir=cache_dir)


@torch.inference_mode()
def _logits(loaded) -> torch.Tensor:
    from app.engine.contiguous_kv import ContiguousKV

    kv = ContiguousKV(loaded.kv_facts, IDS.shape[1], loaded.device, loaded.compute_dtype)
    return loaded.model.logits(loaded.model(IDS, kv.positions(IDS.shape[1]), kv)[0])


@pytest.mark.slow
def test_a_cached_model_equals_a_fresh_one_and_damage_rebuilds(embedded_model_path, tmp_path):
    cache = tmp_path / "weights"
    fresh = _load(embedded_model_path, cache)
    entries = _entries(cache)
    assert len(entries) == 1
    # A part a layer and one for each other slot (embedding, final norm, untied head).
    names = {f"layer-{i}" for i in range(len(fresh.model.layers))} | {
        slot for slot in fresh.model.slot_shapes() if not slot.startswith("layers.")}
    parts = sorted(entries[0].glob("*.pt"))
    assert {p.name.split(".")[0] for p in parts} == names and len(parts) == len(names)
    expected = _logits(fresh)
    del fresh

    seen = []
    cached = load_model(embedded_model_path, torch.device("cpu"), torch.float16, torch.float32,
                        torch.bfloat16, progress=seen.append, int4=INT4, weight_cache_dir=cache)
    assert seen == [1.0]  # restored in one step
    assert isinstance(cached.model.layers[0].o, QuantizedWeight)
    assert cached.model.embedding.rows is not None  # the tied embedding's rows came back too
    assert torch.equal(_logits(cached), expected)
    del cached

    parts[0].write_bytes(b"PK\x03\x04 torn")
    rebuilt = _load(embedded_model_path, cache)
    assert torch.equal(_logits(rebuilt), expected)
    assert _entries(cache) == entries  # rewritten
    parts = sorted(entries[0].glob("*.pt"))
    assert len(parts) == len(names) and all(p.stat().st_size > 1000 for p in parts)


def _mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from `path` (Linux's /proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps", encoding="utf-8"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_the_first_load_runs_on_the_saved_file_too(smollm2_model_path, tmp_path):
    """The load that builds the weights saves them and then runs on the saved file, mapped,
    as later loads do, not on the tensors it built (which would stay resident beside it)."""
    cache = tmp_path / "weights"
    first = _load(smollm2_model_path, cache)
    entry, = _entries(cache)
    ranges = [r for part in entry.glob("*.pt") for r in _mapped_from(part.resolve())]
    assert ranges
    weights = [first.model.layers[0].o.codes.packed, first.model.layers[-1].down.codes.packed,
               first.model.output_norm, first.model.embedding.rows.data]
    for tensor in weights:
        address = tensor.data_ptr()
        assert any(start <= address < end for start, end in ranges)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_first_load_runs_each_layer_from_its_part_as_soon_as_it_is_built(
        smollm2_model_path, tmp_path, monkeypatch):
    """The build does not hold the whole model in memory: once a layer is written, it runs
    from its part, mapped, while the later layers are built."""
    from app.models.weight_cache import EntryWriter

    seen = []
    write_layer = EntryWriter._write_layer

    def checked(self, index):
        write_layer(self, index)
        layer = self.model.layers[index]
        part, = self.cache.path.glob(f"layer-{index}.*.pt")
        ranges = _mapped_from(part.resolve())
        seen.append(index)
        for tensor in (layer.o.codes.packed, layer.qkv.codes.packed, layer.gate_up.codes.packed,
                       layer.attn_norm):
            assert any(start <= tensor.data_ptr() < end for start, end in ranges)

    monkeypatch.setattr(EntryWriter, "_write_layer", checked)
    loaded = _load(smollm2_model_path, tmp_path / "weights")
    assert seen == list(range(len(loaded.model.layers)))


@pytest.mark.slow
def test_a_failed_build_leaves_no_parts_behind(smollm2_model_path, tmp_path):
    """A load that stops part-way (a damaged tensor late in the file, a cancelled load)
    deletes the parts it wrote: nothing half-written stays in the data folder."""
    cache = tmp_path / "weights"

    def stop_late(fraction):
        if fraction > 0.8:
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        load_model(smollm2_model_path, torch.device("cpu"), torch.float16, torch.float32,
                   torch.bfloat16, progress=stop_late, int4=INT4, weight_cache_dir=cache)
    assert not list(cache.rglob("*.pt")) and _entries(cache) == []


@pytest.mark.slow
def test_a_disk_that_fills_while_writing_parts_loses_nothing_but_the_entry(
        smollm2_model_path, tmp_path, monkeypatch):
    """A full disk part-way through: the layers not written stay in memory, the model runs
    as it would from the entry, no entry is published and no part is left behind."""
    import errno

    import app.models.weight_cache as weight_cache

    expected = _logits(_load(smollm2_model_path, tmp_path / "reference"))
    save, calls = torch.save, []

    def fills_up(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(weight_cache.torch, "save", fills_up)
    cache = tmp_path / "weights"
    loaded = _load(smollm2_model_path, cache)
    assert torch.equal(_logits(loaded), expected)
    assert not list(cache.rglob("*.pt")) and not list(cache.rglob("entry.json"))


@pytest.mark.slow
def test_an_entry_without_its_manifest_is_rebuilt_not_read_and_strays_go(smollm2_model_path, tmp_path):
    """The manifest is written last: a folder without one (a load that crashed while
    writing) is never read, and the next load completes it."""
    cache = tmp_path / "weights"
    expected = _logits(_load(smollm2_model_path, cache))
    entry, = _entries(cache)
    (entry / "entry.json").unlink()
    import os
    import time

    from app.models.weight_cache import STRAY_PART_MAX_AGE_S

    old_stray, new_stray = entry / "layer-0.999999.pt", entry / "layer-1.999998.pt"
    for stray in (old_stray, new_stray):  # a crashed load's part, and one another process is writing
        stray.write_bytes(b"x")
    long_ago = time.time() - STRAY_PART_MAX_AGE_S - 60
    os.utime(old_stray, (long_ago, long_ago))
    seen = []
    loaded = load_model(smollm2_model_path, torch.device("cpu"), torch.float16, torch.float32,
                        torch.bfloat16, progress=seen.append, int4=INT4, weight_cache_dir=cache)
    assert len(seen) > 1  # built again, not restored in one step
    assert torch.equal(_logits(loaded), expected)
    assert (entry / "entry.json").is_file()
    assert not old_stray.exists() and new_stray.exists()
    os.utime(new_stray, (long_ago, long_ago))  # a day on, a load that only reads the entry
    seen.clear()
    _load(smollm2_model_path, cache)
    assert not new_stray.exists() and (entry / "entry.json").is_file()


@pytest.mark.slow
def test_a_first_load_that_cannot_save_runs_on_what_it_built(smollm2_model_path, tmp_path):
    blocked = tmp_path / "weights"
    blocked.write_text("a file where the folder would be")  # nothing can be written there
    loaded = _load(smollm2_model_path, blocked)
    assert isinstance(loaded.model.layers[0].o, QuantizedWeight)
    assert loaded.model.embedding.rows is not None


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", ["none", "unwritable"])
def test_a_model_that_runs_without_an_entry_does_not_depend_on_its_file(
        smollm2_model_path, tmp_path, cache_kind):
    """The build keeps the tied embedding's raw rows as a view of the file (no copy while a
    saved entry will replace them); a model that runs on what it built copies them, so the
    file may be rewritten or deleted while it runs."""
    import shutil

    from app.models.gguf_file import GGUFFile

    model_file = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_model_path, model_file)
    cache = None
    if cache_kind == "unwritable":
        cache = tmp_path / "weights"
        cache.write_text("a file where the folder would be")
    loaded = _load(model_file, cache)
    expected = _logits(loaded)
    rows = loaded.model.embedding.rows.data
    if Path("/proc/self/maps").exists():
        address = rows.data_ptr()
        assert not any(start <= address < end for start, end in _mapped_from(model_file.resolve()))
    with GGUFFile(model_file) as gguf:
        info = gguf.tensors["token_embd.weight"]
        offset, size = info.offset, info.nbytes
    with open(model_file, "r+b") as f:  # the bytes the rows came from, zeroed in place
        f.seek(offset)
        f.write(bytes(size))
    assert torch.equal(_logits(loaded), expected)


@pytest.mark.slow
def test_another_format_replaces_the_entry(smollm2_model_path, tmp_path):
    cache = tmp_path / "weights"
    _load(smollm2_model_path, cache)
    first = set(_entries(cache))
    load_model(smollm2_model_path, torch.device("cpu"), torch.bfloat16, torch.float32,
               weight_cache_dir=cache)
    second = set(_entries(cache))
    assert len(second) == 1 and second != first  # one entry per model file: the newest


@pytest.mark.slow
def test_an_old_entry_that_cannot_be_deleted_does_not_fail_the_load(smollm2_model_path, tmp_path,
                                                                    monkeypatch):
    """Windows refuses to delete a file that is mapped, as the running model maps its entry
    when a measured policy prepares the weights in another format."""
    import pathlib

    cache = tmp_path / "weights"
    _load(smollm2_model_path, cache)
    mapped, = _entries(cache)
    unlink = pathlib.Path.unlink

    def refuse(self, missing_ok=False):
        if self.parent == mapped:
            raise PermissionError(13, "The process cannot access the file", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    other = load_model(smollm2_model_path, torch.device("cpu"), torch.bfloat16, torch.float32,
                       weight_cache_dir=cache)
    assert other.model is not None and len(_entries(cache)) == 2
    monkeypatch.undo()  # the next load, with the old entry no longer mapped, deletes it
    load_model(smollm2_model_path, torch.device("cpu"), torch.bfloat16, torch.float32,
               weight_cache_dir=cache)
    assert not mapped.exists() and len(_entries(cache)) == 1


@pytest.mark.slow
def test_the_entry_of_a_model_file_that_is_gone_is_deleted(smollm2_model_path, tmp_path):
    import shutil

    cache = tmp_path / "weights"
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_model_path, copy)
    _load(copy, cache)
    (entry,) = _entries(cache)
    copy.unlink()  # the person deleted that model
    _load(smollm2_model_path, cache)
    assert not entry.exists()
    assert len(_entries(cache)) == 1 and len(list(cache.glob("*.source"))) == 1


def test_pruning_keeps_the_entries_of_models_that_exist(tmp_path):
    import os
    import time

    from app.models.weight_cache import UNNAMED_ENTRY_MAX_AGE_S, prune

    model = tmp_path / "here.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "aaaa.source").write_text(str(model))
    (tmp_path / "aaaa-1.pt").write_bytes(b"x")
    (tmp_path / "bbbb.source").write_text(str(tmp_path / "gone.gguf"))
    (tmp_path / "bbbb-1.pt").write_bytes(b"x")
    (tmp_path / "cccc-1.pt").write_bytes(b"x")  # written before .source files: recent
    old = tmp_path / "dddd-1.pt"  # written before .source files: long unused
    old.write_bytes(b"x")
    long_ago = time.time() - UNNAMED_ENTRY_MAX_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    for entry in ("aaaa-2", "bbbb-2"):  # entries as folders of parts
        (tmp_path / entry).mkdir()
        (tmp_path / entry / "layer-0.1.pt").write_bytes(b"x")
    prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "aaaa-1.pt", "aaaa-2", "aaaa.source", "cccc-1.pt", "here.gguf"]
    prune(tmp_path / "no such folder")  # housekeeping never raises


@pytest.mark.skipif(not __import__("app.models.int8_products", fromlist=["available"]).available(),
                    reason="the 8-bit activation kernel cannot run on this CPU")
def test_weights_for_the_8_bit_activation_kernel_come_back_from_their_entry(smollm2_model_path,
                                                                          tmp_path):
    """`Int8Codes` (codes, scales, offsets, layout) are saved and mapped like torch's planes."""
    from app.models.int8_products import Int8Codes

    fmt = WeightFormat(torch.float16, False, None, True, torch.bfloat16, int8_acts=True)
    load = lambda: load_model(smollm2_model_path, torch.device("cpu"), torch.float16,  # noqa: E731
                              torch.float32, int4=fmt, weight_cache_dir=tmp_path)
    fresh = load()
    expected = _logits(fresh)
    del fresh
    cached = load()
    layer = cached.model.layers[0]
    assert isinstance(layer.gate_up.codes, Int8Codes) and isinstance(layer.up.codes, Int8Codes)
    assert layer.up.codes.codes.data_ptr() > layer.gate_up.codes.codes.data_ptr()  # still a view
    assert torch.equal(_logits(cached), expected)
