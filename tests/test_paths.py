"""The data folder: one place decides it, and --data-dir reaches everything that uses it."""

from __future__ import annotations

import pytest

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


@pytest.fixture(scope="module")
def folder_before_any_test():
    """data_dir() where a module- or session-scoped fixture sees it: set up before the
    test's own folder is (tests/server/conftest.py loads a model there, measuring the CPU
    policy into the folder)."""
    return data_dir()


def test_fixtures_set_up_before_a_tests_folder_never_use_the_persons(folder_before_any_test,
                                                                      _own_data_dir):
    from platformdirs import user_data_dir

    from app.paths import APP_DIR_NAME

    assert folder_before_any_test != _own_data_dir
    assert not folder_before_any_test.is_relative_to(user_data_dir(APP_DIR_NAME, appauthor=False))
