"""A stored connection drives a RemoteBackend: key from the keychain, its session header,
the person's context sizes."""

from __future__ import annotations

from app.backends.from_connection import remote_backend_for
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from app.storage.connections import ConnectionStore, Keychain
from tests.backends import transcripts as t
from tests.backends.helpers import Collector
from tests.backends.sse_server import TranscriptServer, json_answer, sse_answer
from tests.storage.test_connections import MemoryKeyring


def test_a_saved_connection_talks_to_its_server():
    with TranscriptServer() as server, ConnectionStore(keychain=Keychain(MemoryKeyring())) as store:
        server.route("GET", "/v1/models", json_answer(200, t.OLLAMA_MODELS))
        server.route("POST", "/v1/chat/completions", sse_answer(t.ollama_stream()))
        saved = store.add_connection("Ollama box", server.base_url, api_key="sk-saved",
                                     session_header="X-Chat", context_sizes={t.OLLAMA_MODEL: 8192})
        backend = remote_backend_for(store, saved)
        model = backend.load(t.OLLAMA_MODEL)
        assert model.context_length == 8192
        assert model.location == f"Ollama box (127.0.0.1:{server.server_address[1]})"
        assert "sk-saved" not in repr(backend)
        events = Collector()
        backend.submit_chat([Message("user", "hi")], SamplingParams(), events, session_id="chat-9")
        assert events.wait().text == "Hello there!"
        request = server.posts()[-1]
        assert request.headers["authorization"] == "Bearer sk-saved"
        assert request.headers["x-chat"] == "chat-9"
        backend.close()
