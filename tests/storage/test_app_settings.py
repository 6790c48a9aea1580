"""App settings: key -> JSON value."""

from __future__ import annotations

import pytest

from app.storage import ChatStore, StorageError


def test_get_returns_the_default_until_set(store):
    assert store.get_setting("theme") is None
    assert store.get_setting("theme", "light") == "light"
    store.set_setting("theme", "dark")
    assert store.get_setting("theme", "light") == "dark"


def test_values_are_json_and_survive_reopening(store):
    value = {"width": 1200, "splitter": [240, 960], "recent": ["a", "b"], "on": True}
    store.set_setting("window", value)
    store.set_setting("window", {**value, "width": 1300})
    path = store.path
    store.close()
    with ChatStore(path) as reopened:
        assert reopened.get_setting("window") == {**value, "width": 1300}


@pytest.mark.parametrize("key, value", [("", 1), (None, 1), ("x", object()), ("x", float("inf"))])
def test_bad_keys_and_values_are_refused(store, key, value):
    with pytest.raises(StorageError):
        store.set_setting(key, value)
