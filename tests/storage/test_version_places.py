"""ChatStore.version_places: every message's place among its versions from one read of the
chat, as ChatStore.versions() gives it one message at a time."""

from app.storage import ChatStore


def test_version_places_match_the_store_for_every_message(tmp_path):
    with ChatStore(tmp_path) as store:
        chat = store.create_chat("branches")
        question = store.add_message(chat.id, "user", "q1")
        first = store.add_message(chat.id, "assistant", "a1")
        store.add_message(chat.id, "assistant", "a1, again", parent_id=question.id)
        store.add_message(chat.id, "user", "q2 below the first reply", parent_id=first.id)
        edited = store.add_message(chat.id, "user", "q1, edited", parent_id=None)
        store.add_message(chat.id, "assistant", "a to the edit", parent_id=edited.id)
        store.add_message(chat.id, "system", "a note", parent_id=edited.id)  # another role
        other = store.create_chat("another chat")
        store.add_message(other.id, "user", "not counted")

        places = store.version_places(chat.id)
        every = store.chat_messages(chat.id)
        assert set(places) == {m.id for m in every}
        for message in every:
            versions = store.versions(message.id)
            assert places[message.id] == (versions.index, versions.count), message.content
        assert places[question.id] == (0, 2) and places[edited.id] == (1, 2)
