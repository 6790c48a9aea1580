"""app/engine/device.py: where prepared weights are saved."""

from __future__ import annotations

from app.engine.device import WEIGHT_CACHE_DIR, weight_cache_folder


def test_the_weight_cache_is_in_the_data_folder_unless_the_environment_says_otherwise(
        monkeypatch, tmp_path, _own_data_dir):
    monkeypatch.delenv("FERROX_WEIGHT_CACHE", raising=False)
    assert weight_cache_folder() == _own_data_dir / WEIGHT_CACHE_DIR
    monkeypatch.setenv("FERROX_WEIGHT_CACHE", "1")
    assert weight_cache_folder() == _own_data_dir / WEIGHT_CACHE_DIR
    monkeypatch.setenv("FERROX_WEIGHT_CACHE", "0")
    assert weight_cache_folder() is None
    monkeypatch.setenv("FERROX_WEIGHT_CACHE", str(tmp_path / "shared"))
    assert weight_cache_folder() == tmp_path / "shared"
