"""A document bigger than the context, in the real window: it is indexed off the GUI thread
(progress and Cancel on its chip; a cancelled index resumes), the chip says it is searched,
the question's passages go into the prompt numbered and stay with the reply, whose sources
show the passage text -- also after the chat is opened again."""

from __future__ import annotations

import pytest

from app.storage import ChatStore
from app.ui.document_actions import INDEX_STOPPED, INDEXING, SEARCHED

FACTS = {
    "Lighthouse": "The lighthouse keeper of Kessel Point is named Ortrud Vale.",
    "Harbour": "The harbour fee for a fishing boat is eleven silver marks a season.",
    "Bakery": "The bakery on Salt Street sells rye bread only on Thursdays.",
    "School": "The village school has one teacher and thirty-two pupils.",
}
FILLER = ("The weather on the coast changes quickly, and the people of the village talk about "
          "it at length in the morning before the boats go out. ")


def _document(path):
    sections = [f"## {title}\n\n{FILLER * 6}\n\n{fact}\n\n{FILLER * 6}" for title, fact in FACTS.items()]
    path.write_text("# The village of Kessel\n\n" + "\n\n".join(sections * 2), encoding="utf-8")
    return path


def _chip(driver, key):
    return driver.controller._find_pending(key)


@pytest.mark.slow  # indexing with the sentence encoder, then a reply
def test_a_document_that_does_not_fit_is_searched_and_the_reply_cites_its_passages(open_window, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    store = ChatStore(data)
    store.set_setting("engine", {"context_size": 2048})  # the document (~3,000 tokens) does not fit
    store.close()
    driver = open_window(data)
    driver.wait_for_model()
    controller, composer = driver.controller, driver.window.composer
    driver.set_max_tokens(8)
    doc = _document(tmp_path / "kessel.md")

    controller.add_files([str(doc)])
    key = controller.pending[controller.current_chat_id][0].key
    driver.qtbot.waitUntil(lambda: _chip(driver, key).index == INDEXING, timeout=60_000)
    widget = composer.attachment_chips()[0]
    assert not widget.index_bar.isHidden() and not widget.cancel_button.isHidden()
    assert "indexing" in widget.label.text()
    driver.qtbot.mouseClick(widget.cancel_button, _left())
    driver.qtbot.waitUntil(lambda: _chip(driver, key).index == INDEX_STOPPED, timeout=60_000)
    assert "indexing stopped" in composer.attachment_chips()[0].label.text()

    controller._remove_attachment(key)  # attached again: indexing resumes
    controller.add_files([str(doc)])
    key = controller.pending[controller.current_chat_id][0].key
    driver.qtbot.waitUntil(lambda: _chip(driver, key).index == SEARCHED, timeout=120_000)
    chip = _chip(driver, key)
    assert chip.passages > 4
    assert f"searched ({chip.passages} passages)" in composer.attachment_chips()[0].label.text()

    prompts = []
    controller.bridge._submit.connect(lambda rid, messages, params, owner, partial: prompts.append(messages))
    driver.type_and_send("What is the name of the lighthouse keeper?")
    driver.wait_until_idle()
    user, answer = driver.path()
    assert user.attachments[0].sha256 and "(searched)" in driver.window.message_view.message_widget(
        user.id).attachments.text()
    passages = answer.metadata["passages"]
    assert [p["number"] for p in passages] == list(range(1, len(passages) + 1))
    assert any("Ortrud Vale" in p["text"] for p in passages[:3])
    sent = prompts[-1][-1].content
    assert "[1] (kessel.md" in sent and sent.endswith("Question: What is the name of the lighthouse keeper?")
    assert len(sent) < len(doc.read_text()) / 2  # passages, not the whole document

    chat_id = controller.current_chat_id
    controller.new_chat()
    controller.show_chat(chat_id)  # reopened: the sources come from the store
    view = driver.window.message_view
    view.apply_pending()
    shown = view.message_widget(answer.id)
    assert not shown.sources_box.isHidden() and "[1]" in shown.sources_label.text()
    shown.sources_label.linkActivated.emit("cite:1")  # what clicking the link sends
    assert not shown.passage_box.isHidden()
    assert passages[0]["text"][:40] in shown.passage_label.text()


def _left():
    from app.ui.qt import Qt

    return Qt.LeftButton
