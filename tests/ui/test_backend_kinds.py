"""The bridge and the picker's routing know no kind of backend by name: a kind registered
here, in the test, with one registry entry (app/backends/registry.py) and a real
ChatBackend (tests/backends/scripted.py), serves a chat through the bridge and the chat
service, with no other module changed. And a connection's model gets the same context
budget as a local one (app/chat/budget.py), checked against the loopback transcript server."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.backends.registry import KINDS, BackendKind, picker_key
from app.chat.replies import COMPLETE, STOPPED
from app.chat.service import ChatService
from app.engine.events import Finished
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from app.storage import ChatStore
from app.storage.connections import ConnectionStore, Keychain
from app.ui.bridge import REMOTE_TOKENS_PER_MESSAGE, EngineBridge
from app.ui.remote_models import remote_key, route
from app.ui.reply_wiring import ReplyWiring
from tests.backends import transcripts as t
from tests.backends.scripted import ScriptedBackend
from tests.backends.sse_server import TranscriptServer, json_answer, sse_answer
from tests.storage.test_connections import MemoryKeyring

TIMEOUT_MS = 30_000  # only ends a hang: scripted replies end in milliseconds

# What the scripted kind answers, in order (see tests/backends/scripted.py).
SCRIPT = [["Hi", " there", "!"], ["Long", " story", " short"]]
BUILT: list[tuple[str, str, int | None]] = []  # (connection name, model, context) per build


def build_scripted(connections, connection, model: str, context_length: int | None):
    """The scripted kind's builder, in the registry's shape."""
    BUILT.append((connection.name, model, context_length))
    backend = ScriptedBackend(list(SCRIPT), context_length=context_length or 4096)
    backend.load(model)
    return backend


@pytest.fixture
def scripted_kind(monkeypatch):
    """The one registry line a new kind takes."""
    monkeypatch.setitem(KINDS, "scripted", BackendKind(
        "scripted", "tests.backends.scripted:ScriptedBackend",
        build=f"{__name__}:build_scripted", key_prefix="scripted:"))
    BUILT.clear()


def test_a_kind_registered_in_the_test_serves_a_chat_through_the_bridge(qtbot, scripted_kind):
    with ChatStore() as store, ConnectionStore(store.path, keychain=Keychain(MemoryKeyring())) as connections:
        saved = connections.add_connection("Script box", "http://script.invalid")
        key = picker_key("scripted", saved.id, "echo:v1")  # a colon in the name survives
        chosen = route(key)
        assert (chosen.kind, chosen.connection_id, chosen.model, chosen.needs_local_model) == \
            ("scripted", saved.id, "echo:v1", False)
        assert route("/models/x.gguf").kind == "local" and route("scripted:x:y").kind == "local"

        bridge = EngineBridge()
        params = SamplingParams(max_tokens=32, temperature=0.0)
        service = ChatService(store, bridge.submit_request, bridge.abort, lambda chat: params)
        wiring = ReplyWiring(service, bridge)
        # Signals collected in lists (qtbot.waitSignal's timers, collected later on another
        # thread, warn).
        ended, changed, loaded, counted = [], [], [], []
        wiring.ended.connect(ended.append)
        wiring.changed.connect(lambda reply, event: changed.append(reply))
        bridge.modelLoaded.connect(loaded.append)
        bridge.tokensCounted.connect(lambda key, tokens: counted.append((key, tokens)))
        try:
            bridge.load_backend(connections, chosen, 2048)
            qtbot.waitUntil(lambda: bool(loaded), timeout=TIMEOUT_MS)
            info = loaded[0]
            assert (info.path, info.name, info.dtype, info.context_length) == (key, "echo:v1", "scripted", 2048)
            assert BUILT == [("Script box", "echo:v1", 2048)]
            backend = bridge.backend
            assert isinstance(backend, ScriptedBackend) and bridge.session.info is None
            service.set_model(info.name, chosen.kind)

            # A reply streams through the bridge into the service and is saved.
            chat = store.create_chat(settings={"system_prompt": "Be brief."})
            reply = service.begin(chat.id, service.add_turn(chat.id, "Hello?"))
            service.submit(reply)
            qtbot.waitUntil(lambda: len(ended) == 1, timeout=TIMEOUT_MS)
            answer = store.get_message(reply.message_id)
            assert (answer.content, answer.status) == ("Hi there!", COMPLETE)
            assert answer.metadata["backend"] == "scripted" and answer.metadata["model"] == "echo:v1"
            messages, sent_params, session = backend.sent[0]
            assert [(m.role, m.content) for m in messages] == [("system", "Be brief."), ("user", "Hello?")]
            assert session == str(chat.id)

            # Stop reaches the kind's backend through the bridge; the text so far is kept.
            backend.hold()
            second = service.begin(chat.id, service.add_turn(chat.id, "More?"))
            service.submit(second)
            qtbot.waitUntil(lambda: second in changed, timeout=TIMEOUT_MS)
            service.stop(chat.id)
            qtbot.waitUntil(lambda: len(ended) == 2, timeout=TIMEOUT_MS)
            stopped = store.get_message(second.message_id)
            assert (stopped.content, stopped.status) == ("Long", STOPPED)

            # Token counts come from the kind's backend (the script counts words).
            bridge.count_tokens("k", "three short words")
            qtbot.waitUntil(lambda: bool(counted), timeout=TIMEOUT_MS)
            assert counted == [("k", 3)]
        finally:
            wiring.stop()
            bridge.shutdown()


def test_remote_replies_get_the_context_budget_before_they_are_sent(qtbot):
    """A remote model's reply is cut to the room its context leaves (max_tokens in the
    request), and a conversation that leaves too little is refused before anything is sent,
    with the window's own overflow message, not the server's 400. Against the loopback
    transcript server, which counts every text as 10 tokens (its /tokenize, as vLLM answers)."""
    chat = (Message("system", "Be brief."), Message("user", "Say hello."))
    prompt = 2 * (10 + REMOTE_TOKENS_PER_MESSAGE)  # what the bridge counts for `chat`
    asked = SamplingParams(max_tokens=512, temperature=0.0)
    with TranscriptServer() as server, ChatStore() as store, \
            ConnectionStore(store.path, keychain=Keychain(MemoryKeyring())) as connections:
        server.route("POST", "/tokenize", json_answer(200, {"count": 10}))
        server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream()))
        saved = connections.add_connection("Loopback vLLM", server.base_url)
        chosen = route(remote_key(saved.id, "llama-3.3-70b"))
        bridge = EngineBridge()
        loaded, ended, overflows = [], [], []
        bridge.modelLoaded.connect(loaded.append)
        bridge.event.connect(lambda e: ended.append(e) if isinstance(e, Finished) else None)
        bridge.contextOverflow.connect(lambda *args: overflows.append(args))

        def use(context):
            loaded.clear()
            bridge.load_backend(connections, chosen, context)
            qtbot.waitUntil(lambda: bool(loaded), timeout=TIMEOUT_MS)

        try:
            # Room left: 256 - 28 = 228 tokens, so max_tokens 512 goes out as 228.
            use(256)
            bridge.submit("r1", chat, asked, cache_owner="7")
            qtbot.waitUntil(lambda: len(ended) == 1, timeout=TIMEOUT_MS)
            assert server.posts()[-1].json()["max_tokens"] == 256 - prompt
            # A request that fits as asked goes as asked.
            bridge.submit("r2", chat, replace(asked, max_tokens=100), cache_owner="7")
            qtbot.waitUntil(lambda: len(ended) == 2, timeout=TIMEOUT_MS)
            assert server.posts()[-1].json()["max_tokens"] == 100
            # No context known (neither set nor reported): sent as asked, the server decides.
            use(None)
            bridge.submit("r3", chat, asked, cache_owner="7")
            qtbot.waitUntil(lambda: len(ended) == 3, timeout=TIMEOUT_MS)
            assert server.posts()[-1].json()["max_tokens"] == 512
            # 40 - 28 = 12 tokens of room, under MIN_REPLY_TOKENS: refused here, nothing sent.
            use(40)
            posts = len(server.posts())
            bridge.submit("r4", chat, asked, cache_owner="7")
            qtbot.waitUntil(lambda: bool(overflows), timeout=TIMEOUT_MS)
            assert overflows == [("r4", prompt, 40)] and len(server.posts()) == posts
        finally:
            bridge.shutdown()
