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
    entries = list(cache.glob("*.pt"))
    assert len(entries) == 1
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

    entries[0].write_bytes(b"PK\x03\x04 torn")
    rebuilt = _load(embedded_model_path, cache)
    assert torch.equal(_logits(rebuilt), expected)
    assert len(list(cache.glob("*.pt"))) == 1 and entries[0].stat().st_size > 1000  # rewritten


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
def test_the_first_load_runs_on_the_saved_file_too(embedded_model_path, tmp_path):
    """The load that builds the weights saves them and then runs on the saved file, mapped,
    as later loads do, not on the tensors it built (which would stay resident beside it)."""
    cache = tmp_path / "weights"
    first = _load(embedded_model_path, cache)
    entry, = cache.glob("*.pt")
    ranges = _mapped_from(entry.resolve())
    assert ranges
    weights = [first.model.layers[0].o.codes.packed, first.model.layers[-1].down.codes.packed,
               first.model.output_norm]
    for tensor in weights:
        address = tensor.data_ptr()
        assert any(start <= address < end for start, end in ranges)


@pytest.mark.slow
def test_a_first_load_that_cannot_save_runs_on_what_it_built(embedded_model_path, tmp_path):
    blocked = tmp_path / "weights"
    blocked.write_text("a file where the folder would be")  # nothing can be written there
    loaded = _load(embedded_model_path, blocked)
    assert isinstance(loaded.model.layers[0].o, QuantizedWeight)
    assert loaded.model.embedding.rows is not None


@pytest.mark.slow
def test_another_format_replaces_the_entry(embedded_model_path, tmp_path):
    cache = tmp_path / "weights"
    _load(embedded_model_path, cache)
    first = set(cache.glob("*.pt"))
    load_model(embedded_model_path, torch.device("cpu"), torch.bfloat16, torch.float32,
               weight_cache_dir=cache)
    second = set(cache.glob("*.pt"))
    assert len(second) == 1 and second != first  # one entry per model file: the newest


@pytest.mark.slow
def test_an_old_entry_that_cannot_be_deleted_does_not_fail_the_load(embedded_model_path, tmp_path,
                                                                    monkeypatch):
    """Windows refuses to delete a file that is mapped, as the running model maps its entry
    when a measured policy prepares the weights in another format."""
    import pathlib

    cache = tmp_path / "weights"
    _load(embedded_model_path, cache)
    mapped, = cache.glob("*.pt")
    unlink = pathlib.Path.unlink

    def refuse(self, missing_ok=False):
        if self == mapped:
            raise PermissionError(13, "The process cannot access the file", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    other = load_model(embedded_model_path, torch.device("cpu"), torch.bfloat16, torch.float32,
                       weight_cache_dir=cache)
    assert other.model is not None and len(list(cache.glob("*.pt"))) == 2
    monkeypatch.undo()  # the next load, with the old entry no longer mapped, deletes it
    load_model(embedded_model_path, torch.device("cpu"), torch.bfloat16, torch.float32,
               weight_cache_dir=cache)
    assert not mapped.exists() and len(list(cache.glob("*.pt"))) == 1


@pytest.mark.slow
def test_the_entry_of_a_model_file_that_is_gone_is_deleted(embedded_model_path, tmp_path):
    import shutil

    cache = tmp_path / "weights"
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(embedded_model_path, copy)
    _load(copy, cache)
    (entry,) = cache.glob("*.pt")
    copy.unlink()  # the person deleted that model
    _load(embedded_model_path, cache)
    assert not entry.exists()
    assert len(list(cache.glob("*.pt"))) == 1 and len(list(cache.glob("*.source"))) == 1


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
    prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "aaaa-1.pt", "aaaa.source", "cccc-1.pt", "here.gguf"]
    prune(tmp_path / "no such folder")  # housekeeping never raises
