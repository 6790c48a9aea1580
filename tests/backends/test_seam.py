"""The seam itself: the registry, the protocol each backend meets, and the local engine
behind it."""

from __future__ import annotations

import threading

import pytest

from app.backends.base import BackendError, ChatBackend
from app.backends.registry import KINDS, BackendKind, backend_class, create_backend
from app.backends.remote import RemoteSettings
from app.engine.events import Failed, Finished, Token
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from tests.backends.helpers import Collector
from tests.backends.scripted import ScriptedBackend


def test_registry_builds_each_kind_and_names_unknown_ones():
    remote = create_backend("remote", settings=RemoteSettings("http://127.0.0.1:9"))
    assert isinstance(remote, ChatBackend) and remote.kind == "remote"
    remote.close()
    assert backend_class("local").kind == "local"
    assert set(KINDS) == {"local", "remote"}
    with pytest.raises(BackendError, match="Unknown kind of backend 'grpc'; known: local, remote"):
        create_backend("grpc")


def test_a_third_kind_is_a_module_and_a_registry_line(monkeypatch):
    monkeypatch.setitem(KINDS, "scripted", BackendKind("scripted", "tests.backends.scripted:ScriptedBackend"))
    backend = create_backend("scripted", replies=[["Hi", " there"], "!The script failed."])
    assert isinstance(backend, ChatBackend)
    backend.load("script-model")
    ok, bad = Collector(), Collector()
    backend.submit_chat([Message("user", "hi")], SamplingParams(), ok, session_id="c1")
    assert ok.wait().text == "Hi there"
    backend.submit_chat([Message("user", "hi")], SamplingParams(), bad)
    assert bad.wait() == Failed(bad.events[0].request_id, "The script failed.")
    backend.close()


def test_scripted_backend_holds_and_aborts():
    backend = ScriptedBackend([["a", "b", "c"]])
    backend.hold()
    events = Collector()
    request_id = backend.submit_chat([Message("user", "x")], SamplingParams(), events)
    assert events.first_token.wait(30)
    backend.abort(request_id)
    end = events.wait()
    assert isinstance(end, Finished) and (end.finish_reason, end.text) == ("abort", "a")
    backend.close()


@pytest.mark.slow
def test_local_backend_runs_the_engine_behind_the_seam(embedded_model_path):
    backend = create_backend("local", device="cpu", dtype="float32")
    with pytest.raises(BackendError, match="No model is loaded"):
        backend.count_tokens("hi")
    model = backend.load(embedded_model_path)
    assert isinstance(backend, ChatBackend) and backend.describe() == model
    assert model.kind == "local" and model.location == "this computer (cpu)" and model.context_length > 0
    assert backend.count_tokens("Hello there") >= 2
    events = Collector()
    backend.submit_chat([Message("user", "Say hi.")], SamplingParams(max_tokens=4, temperature=0),
                        events, session_id="chat-1")
    end = events.wait()
    assert isinstance(end, Finished) and end.usage.completion_tokens >= 1
    assert all(isinstance(e.token_id, int) for e in events.events if isinstance(e, Token))
    refused = Collector()  # no tool role in this template: a Failed event on another thread
    backend.submit_chat([Message("tool", "42", tool_call_id="c1")], SamplingParams(max_tokens=4), refused)
    assert refused.wait().message == ("The conversation cannot be sent to this model: Unknown chat "
                                      "role 'tool'; expected one of system, user, assistant.")
    assert threading.current_thread().name not in refused.threads
    with pytest.raises(BackendError):
        backend.load(embedded_model_path.with_name("missing.gguf"))
    backend.close()
