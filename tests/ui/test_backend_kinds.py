"""The bridge and the picker's routing know no kind of backend by name: a kind registered
here, in the test, with one registry entry (app/backends/registry.py) and a real
ChatBackend (tests/backends/scripted.py), serves a chat through the bridge and the chat
service, with no other module changed."""

from __future__ import annotations

import pytest

from app.backends.registry import KINDS, BackendKind, picker_key
from app.chat.replies import COMPLETE, STOPPED
from app.chat.service import ChatService
from app.engine.sampling import SamplingParams
from app.storage import ChatStore
from app.storage.connections import ConnectionStore, Keychain
from app.ui.bridge import EngineBridge
from app.ui.remote_models import route
from app.ui.reply_wiring import ReplyWiring
from tests.backends.scripted import ScriptedBackend
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
