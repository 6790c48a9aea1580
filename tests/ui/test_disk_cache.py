"""The conversations' KV cache on disk, in the real window: a follow-up after a restart
reads the conversation back from disk, and deleting a chat for good deletes its pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.ui.defaults import DISK_CACHE_FOLDER

LONG_QUESTION = ("Here are my notes on the history of the river trade in the valley. " * 12
                 + "What do they say about the river?")


def _pages_of(folder: Path, owner: str) -> set[Path]:
    """Page files whose owner list names `owner`."""
    return {side.with_suffix(".kv") for side in folder.glob("*/??/*.owners")
            if owner in side.read_text().split()}


def _wait_until_written(driver, folder: Path) -> None:
    """The engine hands finished pages to a writer thread: wait until no new file appears
    for a second (then nothing is left to write)."""
    seen: list[int] = []

    def settled() -> bool:
        seen.append(len(list(folder.glob("*/??/*"))))
        return len(seen) > 4 and seen[-1] == seen[-5] and seen[-1] > 0

    driver.qtbot.waitUntil(settled, timeout=30_000)


@pytest.mark.slow  # two windows, two model loads
def test_a_follow_up_after_a_restart_restores_from_disk_and_purging_forgets_it(open_window, tmp_path):
    data = tmp_path / "data"
    folder = data / DISK_CACHE_FOLDER
    first = open_window(data)
    first.wait_for_model()
    first.set_max_tokens(6)
    first.type_and_send(LONG_QUESTION)
    first.wait_until_idle()
    chat_id = first.controller.current_chat_id
    first.window.close()  # quitting saves what is not on disk yet
    assert _pages_of(folder, str(chat_id))

    second = open_window(data)
    second.wait_for_model()
    assert second.controller.current_chat_id == chat_id  # the chat reopens
    second.set_max_tokens(6)
    second.type_and_send("And in one word?")
    second.wait_until_idle()
    answer = second.path()[-1]
    assert answer.status == "complete"
    assert answer.metadata["restored_tokens"] > 0
    assert answer.metadata["cached_tokens"] >= answer.metadata["restored_tokens"]
    second.window.message_view.apply_pending()
    info = second.window.message_view.message_widget(answer.id).info.text()
    assert f"restored {answer.metadata['restored_tokens']:,} tokens from disk" in info
    assert "from the disk cache" in second.window.statusBar().currentMessage()
    assert f"({answer.metadata['restored_tokens']:,} from disk)" in second.find("contextMeter").text()

    _wait_until_written(second, folder)
    owned = _pages_of(folder, str(chat_id))
    assert owned and all(p.exists() for p in owned)
    second.controller.delete_chat(chat_id)
    second.controller.purge_chats([chat_id])
    # Deleted in turn with the saves (pages written after `owned` was listed go too), on
    # the writer's thread: wait for the whole deletion, not only for the pages listed.
    second.qtbot.waitUntil(lambda: not any(p.exists() for p in owned)
                           and not _pages_of(folder, str(chat_id)), timeout=30_000)
