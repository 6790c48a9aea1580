"""The chat service without Qt and without a model: a real ChatStore in a temp folder and a
ScriptedBackend (a ChatBackend that plays scripted events on its own thread) reached through
`dispatch`, the same function the window's bridge uses for a backend."""

from __future__ import annotations

import queue

import pytest

from app.chat.budget import MIN_REPLY_TOKENS, fits, plan_reply, reply_room
from app.chat.documents import PASSAGES_KEY
from app.chat.prompt import chat_messages
from app.chat.metadata import can_continue
from app.chat.replies import COMPLETE, ERROR, INTERRUPTED, STOPPED, STREAMING
from app.chat.service import ChatService, dispatch
from app.engine.events import Failed, Finished
from app.engine.sampling import SamplingParams
from app.storage import ChatStore, NewAttachment
from tests.backends.scripted import Cut, End, ScriptedBackend


class Harness:
    """The service, its store and backend, and the hand-over of events to the test's thread
    (the window does it with a queued signal)."""

    def __init__(self, tmp_path, replies, max_tokens=64):
        self.store = ChatStore(tmp_path / "chats.sqlite3")
        self.backend = ScriptedBackend(replies)
        self.backend.load("scripted-model")
        self.events: queue.Queue = queue.Queue()
        self.requests = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

        def send(request):
            self.requests.append(request)
            dispatch(self.backend, request, self.events.put)

        self.service = ChatService(self.store, send, self.backend.abort, lambda chat: params)
        self.service.set_model("scripted-model", "scripted")
        self.chat = self.store.create_chat(settings={"system_prompt": "Be brief."})

    def ask(self, text, attachments=()):
        message_id = self.service.add_turn(self.chat.id, text, attachments)
        reply = self.service.begin(self.chat.id, message_id)
        self.service.submit(reply)
        return reply

    def run_until_ended(self, reply, timeout=30):
        while reply.outcome is None:
            self.service.apply(self.events.get(timeout=timeout))
        return self.store.get_message(reply.message_id)


@pytest.fixture
def close_backends():
    made = []
    yield made
    for harness in made:
        harness.backend.release()
        harness.backend.close()
        harness.store.close()


def test_a_reply_streams_finishes_and_is_saved_with_its_metadata(tmp_path, close_backends):
    h = Harness(tmp_path, [["Hel", "lo", "!"]])
    close_backends.append(h)
    reply = h.ask("Hi")
    assert h.store.get_message(reply.message_id).status == STREAMING
    saved = h.run_until_ended(reply)
    assert (saved.content, saved.status) == ("Hello!", COMPLETE)
    assert saved.metadata["model"] == "scripted-model"
    assert saved.metadata["backend"] == "scripted"
    assert saved.metadata["finish_reason"] == "stop"
    assert saved.metadata["prompt_tokens"] == 10
    assert reply.outcome.status == COMPLETE and not h.service.busy(h.chat.id)
    messages, _params, session = h.backend.sent[0]
    assert [(m.role, m.content) for m in messages] == [("system", "Be brief."), ("user", "Hi")]
    assert session == str(h.chat.id)


def test_the_history_is_rendered_identically_from_turn_to_turn(tmp_path, close_backends):
    h = Harness(tmp_path, [["One."], ["Two."], ["Three."]])
    close_backends.append(h)
    h.run_until_ended(h.ask("First"))
    h.run_until_ended(h.ask("Second"))
    h.run_until_ended(h.ask("Third"))
    first, second, third = (r.messages for r in h.requests)
    assert second[:len(first)] == first and third[:len(second)] == second
    assert [m.content for m in third] == ["Be brief.", "First", "One.", "Second", "Two.", "Third"]
    # Rebuilt from the store alone (as after a restart): the same messages.
    path = h.store.active_path(h.chat.id)
    assert tuple(chat_messages(h.store.get_chat(h.chat.id), path[:-1])) == third


def test_a_stream_cut_mid_reply_keeps_and_saves_the_partial_text(tmp_path, close_backends):
    h = Harness(tmp_path, [["Hello"], ["The answer ", "is", Cut("The stream was cut.")], ["Yes."]])
    close_backends.append(h)
    h.run_until_ended(h.ask("Warm-up"))
    reply = h.ask("Question")
    saved = h.run_until_ended(reply)
    assert (saved.content, saved.status, saved.error) == ("The answer is", ERROR, "The stream was cut.")
    assert reply.outcome.status == ERROR
    # The failed reply's text is part of the conversation as shown (the next turn's prompt).
    h.run_until_ended(h.ask("Go on"))
    assert [m.content for m in h.requests[-1].messages][-3:] == ["Question", "The answer is", "Go on"]


def test_retry_of_a_failed_reply_is_a_new_version_and_the_failed_text_stays(tmp_path, close_backends):
    h = Harness(tmp_path, [["Half ", "way", Cut("Connection reset.")], ["Whole answer."]])
    close_backends.append(h)
    failed = h.ask("Q")
    h.run_until_ended(failed)
    retry = h.service.begin(h.chat.id, h.service.new_version(failed.message_id))
    h.service.submit(retry)
    saved = h.run_until_ended(retry)
    assert (saved.content, saved.status) == ("Whole answer.", COMPLETE)
    versions = h.store.versions(retry.message_id)
    assert [m.content for m in versions.messages] == ["Half way", "Whole answer."]
    assert versions.messages[0].status == ERROR


def test_stop_aborts_and_keeps_the_text_so_far(tmp_path, close_backends):
    h = Harness(tmp_path, [["Once ", "upon ", "a time"]])
    close_backends.append(h)
    h.backend.hold()
    reply = h.ask("Story")
    while not reply.text:  # the first piece arrived; the script waits before the second
        h.service.apply(h.events.get(timeout=30))
    assert h.service.stop(h.chat.id) is reply
    saved = h.run_until_ended(reply)
    assert (saved.content, saved.status) == ("Once ", STOPPED)


def test_stop_before_sending_ends_a_held_reply_here(tmp_path, close_backends):
    h = Harness(tmp_path, [])
    close_backends.append(h)
    message_id = h.service.add_turn(h.chat.id, "Waiting for the model")
    reply = h.service.begin(h.chat.id, message_id, held=True)
    h.service.stop(h.chat.id)
    assert reply.outcome.status == STOPPED
    assert h.store.get_message(message_id).status == STOPPED and not h.requests


def test_continue_carries_on_the_same_message(tmp_path, close_backends):
    h = Harness(tmp_path, [["A long ", "start", End("length")], [" and the end."]])
    close_backends.append(h)
    cut = h.run_until_ended(h.ask("Tell me"))
    assert cut.metadata["finish_reason"] == "length"
    more = h.service.begin_continue(cut.id)
    h.service.submit(more)
    saved = h.run_until_ended(more)
    assert saved.id == cut.id and saved.content == "A long start and the end."
    assert h.backend.partials == ["", "A long start"]
    assert h.requests[1].messages == h.requests[0].messages  # same prompt, then the partial
    assert saved.metadata["completion_tokens"] == 3 + 3  # both parts' words (the script's count)


def test_a_failed_continue_leaves_the_reply_as_it_was(tmp_path, close_backends):
    h = Harness(tmp_path, [["Cut ", "here", End("length")], "!The server refused."])
    close_backends.append(h)
    cut = h.run_until_ended(h.ask("Go"))
    more = h.service.begin_continue(cut.id)
    h.service.submit(more)
    saved = h.run_until_ended(more)
    assert (saved.content, saved.status, saved.error) == ("Cut here", COMPLETE, None)
    assert saved.metadata["finish_reason"] == "length"  # Continue is still offered
    assert more.outcome.continue_failed and more.outcome.error == "The server refused."


def test_a_stopped_reply_can_be_continued(tmp_path, close_backends):
    h = Harness(tmp_path, [["Once ", "upon ", "a time"], ["upon a time."]])
    close_backends.append(h)
    h.backend.hold()
    reply = h.ask("Story")
    while not reply.text:
        h.service.apply(h.events.get(timeout=30))
    h.service.stop(h.chat.id)
    stopped = h.run_until_ended(reply)
    assert can_continue(stopped.status, stopped.metadata, stopped.content)
    h.backend.release()
    more = h.service.begin_continue(stopped.id)
    h.service.submit(more)
    saved = h.run_until_ended(more)
    assert (saved.id, saved.content, saved.status) == (stopped.id, "Once upon a time.", COMPLETE)
    assert h.backend.partials[-1] == "Once "


def test_a_failed_continue_of_an_interrupted_reply_leaves_it_interrupted(tmp_path,
                                                                          close_backends):
    """A crash left the reply half written ("interrupted"); a Continue the server refuses
    puts it back as it was, not as a finished reply."""
    h = Harness(tmp_path, ["!The server refused."])
    close_backends.append(h)
    message_id = h.service.add_turn(h.chat.id, "Story")
    h.store.update_message(message_id, content="Once upon", status=INTERRUPTED)
    more = h.service.begin_continue(message_id)
    h.service.submit(more)
    saved = h.run_until_ended(more)
    assert (saved.content, saved.status) == ("Once upon", INTERRUPTED)
    assert more.outcome.continue_failed and more.outcome.error == "The server refused."


def test_a_continue_cut_mid_stream_keeps_what_it_wrote(tmp_path, close_backends):
    """The server went away after the continuation had begun: the text on screen is kept
    (with the error), not thrown away with the failed Continue."""
    h = Harness(tmp_path, [["A long ", "start", End("length")],
                           [" and more", Cut("The connection was cut.")]])
    close_backends.append(h)
    cut = h.run_until_ended(h.ask("Tell me"))
    more = h.service.begin_continue(cut.id)
    h.service.submit(more)
    saved = h.run_until_ended(more)
    assert (saved.content, saved.status) == ("A long start and more", ERROR)
    assert saved.error == "The connection was cut." and not more.outcome.continue_failed
    assert saved.metadata["model"] == "scripted-model"  # what it had before is kept
    assert can_continue(saved.status, saved.metadata, saved.content)


def test_which_replies_offer_continue():
    assert can_continue(COMPLETE, {"finish_reason": "length"}, "cut")
    assert not can_continue(COMPLETE, {"finish_reason": "stop"}, "done")
    for ended_early in (STOPPED, INTERRUPTED, ERROR):
        assert can_continue(ended_early, {}, "Some text")
        assert not can_continue(ended_early, {}, "  ")  # nothing to carry on from
    assert not can_continue(STREAMING, {}, "live")


def test_passages_saved_with_a_reply_survive_its_end(tmp_path, close_backends):
    h = Harness(tmp_path, [["From the passage [1]."]])
    close_backends.append(h)
    attachment = NewAttachment("notes.txt", "text", "Cats sleep a lot.", 5, 17, sha256="ab" * 32)
    message_id = h.service.add_turn(h.chat.id, "How much do cats sleep?", [attachment])
    reply = h.service.begin(h.chat.id, message_id)
    plan = h.service.search_plan(reply, context=4096, used=100)
    assert plan is not None and plan.question == "How much do cats sleep?"
    assert plan.sources == [("ab" * 32, "notes.txt")] and reply.searching
    h.store.update_message(reply.message_id, metadata={PASSAGES_KEY: [
        {"number": 1, "id": 1, "document_id": 1, "file": "notes.txt", "index": 0,
         "page": None, "heading": None, "text": "Cats sleep a lot.", "score": 1.0}]})
    reply.searching = False
    h.service.submit(reply)
    saved = h.run_until_ended(reply)
    assert saved.metadata[PASSAGES_KEY][0]["text"] == "Cats sleep a lot."
    assert "Cats sleep a lot." in h.requests[0].messages[-1].content  # the numbered passage


def test_save_streams_writes_only_changed_text(tmp_path, close_backends):
    h = Harness(tmp_path, [["partial ", "text"]])
    close_backends.append(h)
    h.backend.hold()
    reply = h.ask("Q")
    while not reply.text:
        h.service.apply(h.events.get(timeout=30))
    assert h.service.save_streams() == []
    assert h.store.get_message(reply.message_id).content == "partial "
    assert not reply.due_for_save()
    h.service.close()  # the app closes mid-reply: saved as stopped, text kept
    assert h.store.get_message(reply.message_id).status == STOPPED


# ---- the context budget ------------------------------------------------------------------

def test_the_window_lowers_max_tokens_to_the_room_left():
    plan = plan_reply(100, 90, 64, min_reply=1)
    assert plan.fits and plan.max_tokens == 10


def test_the_window_refuses_a_prompt_that_leaves_too_little_room():
    plan = plan_reply(100, 100 - MIN_REPLY_TOKENS + 1, 64, min_reply=MIN_REPLY_TOKENS)
    assert not plan.fits and plan.max_tokens == 0


def test_the_api_never_lowers_an_explicit_max_tokens():
    assert not plan_reply(100, 90, 20, clamp=False).fits
    assert plan_reply(100, 90, None, clamp=False, default=4096).max_tokens == 10
    assert plan_reply(10_000, 90, None, clamp=False, default=4096).max_tokens == 4096
    assert fits(100, 90, 10) and not fits(100, 90, 11)
    assert plan_reply(100, 0, None).prompt_tokens == 1  # an empty prompt still runs one


def test_document_fitting_keeps_room_for_a_reply_up_to_a_limit():
    assert reply_room(256) == 256 and reply_room(32_000) == 1024


def test_events_of_other_requests_are_not_the_services():
    store_free = ChatService(None, lambda r: None, lambda r: None, lambda c: None)
    assert store_free.apply(Failed("someone-else", "x")) is None
    assert store_free.apply(Finished("someone-else", "stop", "", None, None)) is None
