"""Importing a chat export in the real window: read and checked on a pool thread, then
shown; a broken file is refused with an alert and adds nothing."""

from __future__ import annotations

import json

from app.storage import export_json
from app.ui.qt import QtWidgets


def test_import_runs_off_the_gui_thread_and_opens_the_chat(driver, tmp_path, monkeypatch):
    store, controller = driver.store, driver.controller
    source = store.create_chat("Trip notes")
    store.add_message(source.id, "user", "Where to in May?")
    store.add_message(source.id, "assistant", "The coast.")
    good = tmp_path / "trip.json"
    good.write_text(json.dumps(export_json(store, source.id)), encoding="utf-8")
    broken = tmp_path / "broken.json"
    broken.write_text('{"chat": [', encoding="utf-8")
    chosen = [str(good)]
    monkeypatch.setattr(QtWidgets.QFileDialog, "getOpenFileName",
                        staticmethod(lambda *a, **k: (chosen[0], "")))
    before = len(store.list_chats())

    controller._import_chat()
    assert controller.current_chat_id != source.id  # returned before the import ran
    driver.qtbot.waitUntil(lambda: len(store.list_chats()) == before + 1, timeout=10_000)
    driver.qtbot.waitUntil(lambda: driver.window.chat_title.text() == "Trip notes", timeout=10_000)
    imported = controller.current_chat_id
    assert imported != source.id
    assert [m.content for m in store.active_path(imported)] == ["Where to in May?", "The coast."]

    chosen[0] = str(broken)
    controller._import_chat()
    driver.qtbot.waitUntil(lambda: bool(driver.alerts), timeout=10_000)
    assert driver.alerts[-1][0] == "Import failed" and "broken.json" in driver.alerts[-1][1]
    assert len(store.list_chats()) == before + 1
