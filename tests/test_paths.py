"""The data folder: one place decides it, and --data-dir reaches everything that uses it."""

from __future__ import annotations

from app.paths import data_dir, models_dir, use_data_dir


def test_the_environment_names_the_folder_by_default(_own_data_dir):
    assert data_dir() == _own_data_dir
    assert models_dir() == _own_data_dir / "models"


def test_the_command_lines_folder_becomes_every_later_calls(tmp_path, _own_data_dir):
    """The engine finds the kernel-policy and weight caches through data_dir() without being
    told the window's or the server's --data-dir: they must land beside its chats."""
    chosen = tmp_path / "elsewhere"
    assert use_data_dir(str(chosen)) == chosen and chosen.is_dir()
    assert data_dir() == chosen and models_dir() == chosen / "models"


def test_no_command_line_folder_changes_nothing(_own_data_dir):
    assert use_data_dir(None) == _own_data_dir
    assert data_dir() == _own_data_dir
