"""RemoteBackend against recorded vLLM, SGLang, llama.cpp and Ollama answers, served by a
real HTTP server on loopback."""

from __future__ import annotations

import json
import threading

import pytest

from app.backends.base import BackendError, ChatBackend
from app.backends.remote import RemoteBackend, RemoteSettings, estimate_tokens
from app.engine.events import Finished, Token
from app.engine.sampling import SamplingParams
from app.models.chat_template import Message
from app.models.reasoning import split_reasoning
from tests.backends import transcripts as t
from tests.backends.helpers import Collector
from tests.backends.sse_server import TranscriptServer, json_answer, sse_answer

CHAT = [Message("system", "Be brief."), Message("user", "Say hello.")]
PARAMS = SamplingParams(max_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=5)


@pytest.fixture
def server():
    with TranscriptServer() as srv:
        yield srv


def backend_for(server, model, models_body, stream, **settings) -> RemoteBackend:
    server.route("GET", "/v1/models", json_answer(200, models_body))
    server.route("POST", "/v1/chat/completions", sse_answer(stream))
    backend = RemoteBackend(RemoteSettings(server.base_url, **settings))
    backend.load(model)
    return backend


def run_chat(backend, messages=CHAT, params=PARAMS, session_id="chat-42"):
    events = Collector()
    backend.submit_chat(messages, params, events, session_id=session_id)
    return events.wait(), events


def test_vllm_stream_gives_the_engines_events_with_cached_tokens(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream(), api_key="sk-test-123")
    assert isinstance(backend, ChatBackend)
    assert backend.describe().context_length == 32768  # vLLM's max_model_len
    end, events = run_chat(backend)
    assert isinstance(end, Finished) and end.finish_reason == "stop"
    assert end.text == events.text == "Hello there!"
    tokens = [e for e in events.events if isinstance(e, Token)]
    assert [tok.text for tok in tokens] == list(t.PIECES) and all(tok.token_id is None for tok in tokens)
    assert (end.usage.prompt_tokens, end.usage.cached_tokens, end.usage.completion_tokens) == (1200, 1184, 3)
    assert threading.current_thread().name not in events.threads  # never the caller's thread
    backend.close()


def test_request_streams_with_usage_and_sends_key_session_header_and_sampling(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream(), api_key="sk-test-123")
    run_chat(backend)
    request = server.posts()[-1]
    body = request.json()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == t.VLLM_MODEL
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Say hello."}]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (32, 0.7, 0.9, 40, 5)
    assert request.headers["authorization"] == "Bearer sk-test-123"
    assert request.headers["x-session-id"] == "chat-42"
    backend.close()


def test_standard_sampling_only_when_extended_is_off(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream(), extended_sampling=False)
    run_chat(backend, params=SamplingParams(top_k=40, min_p=0.1, repetition_penalty=1.1))
    body = server.posts()[-1].json()
    assert not {"top_k", "min_p", "repetition_penalty"} & set(body)
    backend.close()


def test_history_bytes_repeat_turn_to_turn_and_session_header_is_stable(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream(),
                          session_header="X-Chat-Affinity")
    history = [Message("system", "Be brief. ünïcode ✓"), Message("user", "Say hello.")]
    first, _ = run_chat(backend, history, session_id="chat-7")
    history += [Message("assistant", first.text), Message("user", "Again, in French.")]
    run_chat(backend, history, session_id="chat-7")
    one, two = server.posts()
    messages_one = one.body.split(b'"messages":[', 1)[1].split(b"]", 1)[0]
    messages_two = two.body.split(b'"messages":[', 1)[1]
    assert messages_two.startswith(messages_one + b",")  # turn 1's bytes open turn 2's
    assert one.headers["x-chat-affinity"] == two.headers["x-chat-affinity"] == "chat-7"
    backend.close()


def test_sglang_cache_report(server):
    backend = backend_for(server, t.SGLANG_MODEL, t.SGLANG_MODELS, t.sglang_stream())
    assert backend.describe().context_length == 131072
    end, _ = run_chat(backend)
    assert end.text == "Hello there!" and end.usage.cached_tokens == 960
    assert end.usage.prompt_tokens == 1000
    backend.close()


def test_llama_cpp_cache_n_timings_and_props_context(server):
    server.route("GET", "/props", json_answer(200, t.LLAMA_CPP_PROPS))
    backend = backend_for(server, t.LLAMA_CPP_MODEL, t.LLAMA_CPP_MODELS, t.llama_cpp_stream())
    assert backend.describe().context_length == 8192  # the running n_ctx, not n_ctx_train
    end, _ = run_chat(backend)
    assert end.text == "Hello there!" and end.usage.cached_tokens == 812
    assert end.timings.decode_tokens_per_s == pytest.approx(49.9)  # the server's own figure
    backend.close()


def test_llama_cpp_without_props_uses_trained_context(server):
    backend = backend_for(server, t.LLAMA_CPP_MODEL, t.LLAMA_CPP_MODELS, t.llama_cpp_stream())
    assert backend.describe().context_length == 32768


def test_ollama_has_no_context_size_or_cache_figures(server):
    backend = backend_for(server, t.OLLAMA_MODEL, t.OLLAMA_MODELS, t.ollama_stream())
    assert backend.describe().context_length is None  # the person sets it
    end, _ = run_chat(backend)
    assert end.finish_reason == "length" and end.text == "Hello there!"
    assert (end.usage.prompt_tokens, end.usage.cached_tokens, end.usage.completion_tokens) == (26, 0, 3)
    backend.close()


def test_person_set_context_size_wins(server):
    backend = backend_for(server, t.OLLAMA_MODEL, t.OLLAMA_MODELS, t.ollama_stream(),
                          context_sizes={t.OLLAMA_MODEL: 16384})
    assert backend.describe().context_length == 16384


@pytest.mark.parametrize("stream", [t.vllm_stream(reasoning=("Greet", " them.")),
                                    t.llama_cpp_stream(reasoning=("Greet", " them."))])
def test_reasoning_content_is_split_like_a_local_thinking_model(server, stream):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, stream)
    end, events = run_chat(backend)
    assert end.text == "<think>Greet them.</think>Hello there!" == events.text
    assert split_reasoning(end.text) == ("Greet them.", "Hello there!")
    backend.close()


def test_unknown_model_on_load_lists_what_the_server_offers(server):
    server.route("GET", "/v1/models", json_answer(200, t.VLLM_MODELS))
    backend = RemoteBackend(RemoteSettings(server.base_url))
    with pytest.raises(BackendError, match=r"has no model 'gpt-9'\. It offers: meta-llama"):
        backend.load("gpt-9")
    assert backend.list_models()[0].context_length == 32768


def test_a_base_url_that_is_not_an_openai_server(server):
    server.route("GET", "/v1/models", json_answer(200, b"<html>hello</html>"))
    backend = RemoteBackend(RemoteSettings(server.base_url))
    with pytest.raises(BackendError, match="not JSON; is the base URL right"):
        backend.load("x")


@pytest.mark.parametrize("answer, expected", [
    ({"count": 7, "tokens": [1, 2, 3, 4, 5, 6, 7], "max_model_len": 32768}, 7),  # vLLM
    ({"tokens": [9, 8, 7, 6]}, 4),  # llama.cpp
])
def test_count_tokens_uses_the_servers_tokenizer(server, answer, expected):
    server.route("POST", "/tokenize", json_answer(200, answer))
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream())
    assert backend.count_tokens("Hello there, how are you?") == expected
    body = server.posts("/tokenize")[-1].json()
    assert body["prompt"] == body["content"] == "Hello there, how are you?"


def test_count_tokens_estimates_without_a_tokenize_endpoint(server):
    backend = backend_for(server, t.OLLAMA_MODEL, t.OLLAMA_MODELS, t.ollama_stream())
    text = "x" * 41
    assert backend.count_tokens(text) == estimate_tokens(text) == 11
    assert backend.count_tokens(text) == 11
    assert len(server.posts("/tokenize")) == 1  # asked once, then remembered


def test_abort_closes_a_stalled_stream_and_keeps_the_partial_text(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, [])
    server.route("POST", "/v1/chat/completions", sse_answer(t.vllm_stream(), stall_after=2))
    events = Collector()
    request_id = backend.submit_chat(CHAT, PARAMS, events)
    assert events.first_token.wait(30)
    backend.abort(request_id)
    end = events.wait()  # returns long before the stall (20 s) or the read timeout (300 s) end
    assert not server.release.is_set()
    assert isinstance(end, Finished) and end.finish_reason == "abort" and end.text == "Hello"
    backend.abort(request_id)  # finished: ignored
    backend.abort("no-such-request")
    backend.close()


def test_message_mappings_pass_through_unchanged(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream())
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    run_chat(backend, [Message("user", "hi"), tool_turn, {"role": "tool", "content": "1", "tool_call_id": "c1"}])
    sent = server.posts()[-1].json()["messages"]
    assert sent[1] == tool_turn and sent[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
    assert json.loads(server.posts()[-1].body)["messages"][0] == {"role": "user", "content": "hi"}


def test_continue_sends_the_partial_reply_as_a_final_assistant_message(server):
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream())
    events = Collector()
    backend.submit_chat(CHAT, PARAMS, events, session_id="chat-9", partial="Hello")
    end = events.wait()
    assert isinstance(end, Finished) and end.text == events.text == "Hello there!"  # new text only
    body = server.posts("/v1/chat/completions")[-1].json()
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["messages"][:-1] == [{"role": m.role, "content": m.content} for m in CHAT]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    run_chat(backend)  # a new reply carries neither key
    assert "continue_final_message" not in server.posts("/v1/chat/completions")[-1].json()
    backend.close()


def test_token_counts_are_cached_per_text(server):
    server.route("POST", "/tokenize", json_answer(200, {"count": 7}))
    backend = backend_for(server, t.VLLM_MODEL, t.VLLM_MODELS, t.vllm_stream())
    assert [backend.count_tokens("same text") for _ in range(3)] == [7, 7, 7]
    assert backend.count_tokens("other text") == 7
    assert [p.json()["prompt"] for p in server.posts("/tokenize")] == ["same text", "other text"]
    backend.close()


def test_sglang_counts_under_the_api_path(server):
    server.route("POST", "/v1/tokenize", json_answer(200, {"tokens": [1, 2, 3], "count": 3,
                                                            "max_model_len": 131072}))
    backend = backend_for(server, t.SGLANG_MODEL, t.SGLANG_MODELS, t.sglang_stream())
    assert backend.count_tokens("Hello") == 3 and backend.count_tokens("Hello again") == 3
    assert len(server.posts("/tokenize")) == 1  # the root path, tried once
    assert len(server.posts("/v1/tokenize")) == 2
    backend.close()
