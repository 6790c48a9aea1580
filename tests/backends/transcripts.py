"""Recorded answers of real servers, rebuilt from their documented formats: stream chunks
(`stream_options.include_usage`), /v1/models cards and error bodies of vLLM, SGLang,
llama.cpp server and Ollama. The reply in each is "Hello there!" in three pieces."""

from __future__ import annotations

import json

PIECES = ("Hello", " there", "!")


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _chunk(model: str, delta: dict, finish=None, **extra) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
    return {"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1733150000,
            "model": model, "choices": [choice]}


# vLLM (OpenAI server, --enable-prompt-tokens-details): an empty role chunk first, `usage: null`
# on every chunk until a last choices-less usage chunk; `stop_reason` beside finish_reason.
VLLM_MODEL = "meta-llama/Llama-3.3-70B-Instruct"


def vllm_stream(pieces=PIECES, *, cached=1184, reasoning=(), finish="stop") -> list[str]:
    events = [sse({**_chunk(VLLM_MODEL, {"role": "assistant", "content": ""}), "usage": None})]
    events += [sse({**_chunk(VLLM_MODEL, {"reasoning_content": r}), "usage": None}) for r in reasoning]
    events += [sse({**_chunk(VLLM_MODEL, {"content": p}), "usage": None}) for p in pieces]
    events.append(sse({**_chunk(VLLM_MODEL, {"content": ""}, finish, stop_reason=None), "usage": None}))
    events.append(sse({"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1733150000,
                       "model": VLLM_MODEL, "choices": [],
                       "usage": {"prompt_tokens": 1200, "total_tokens": 1203, "completion_tokens": 3,
                                 "prompt_tokens_details": {"cached_tokens": cached}}}))
    events.append(sse("[DONE]"))
    return events


VLLM_MODELS = {"object": "list", "data": [
    {"id": VLLM_MODEL, "object": "model", "created": 1733150000, "owned_by": "vllm",
     "root": VLLM_MODEL, "parent": None, "max_model_len": 32768, "permission": []}]}

VLLM_404 = {"object": "error", "message": "The model `nope` does not exist.",
            "type": "NotFoundError", "param": None, "code": 404}
VLLM_401 = {"error": "Unauthorized"}  # the --api-key middleware's body

# SGLang (--enable-cache-report): like vLLM; `matched_stop` on the last choice.
SGLANG_MODEL = "Qwen/Qwen2.5-72B-Instruct"


def sglang_stream(pieces=PIECES, *, cached=960) -> list[str]:
    events = [sse({**_chunk(SGLANG_MODEL, {"role": "assistant", "content": p}), "usage": None})
              for p in pieces]
    events.append(sse({**_chunk(SGLANG_MODEL, {"content": None}, "stop", matched_stop=151645),
                       "usage": None}))
    events.append(sse({"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1733150000,
                       "model": SGLANG_MODEL, "choices": [],
                       "usage": {"prompt_tokens": 1000, "total_tokens": 1003, "completion_tokens": 3,
                                 "prompt_tokens_details": {"cached_tokens": cached}}}))
    events.append(sse("[DONE]"))
    return events


SGLANG_MODELS = {"object": "list", "data": [
    {"id": SGLANG_MODEL, "object": "model", "created": 1733150000, "owned_by": "sglang",
     "root": SGLANG_MODEL, "max_model_len": 131072}]}

SGLANG_500 = {"object": "error", "message": "Internal server error: CUDA out of memory.",
              "type": "InternalServerError", "param": None, "code": 500}

# llama.cpp server: no usage until the last chunk, which also carries `timings` (cache_n: the
# prompt tokens reused from the slot's cache; prompt_n: the ones computed).
LLAMA_CPP_MODEL = "qwen2.5-7b-instruct-q4_k_m.gguf"


def llama_cpp_stream(pieces=PIECES, *, cache_n=812, reasoning=()) -> list[str]:
    def chunk(delta, finish=None):
        return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": 1733150000,
                "id": "chatcmpl-Xa9", "model": LLAMA_CPP_MODEL, "system_fingerprint": "b4600-8b576b6c",
                "object": "chat.completion.chunk"}
    events = [sse(chunk({"reasoning_content": r})) for r in reasoning]
    events += [sse(chunk({"content": p})) for p in pieces]
    last = chunk({}, "stop")
    last["usage"] = {"completion_tokens": 3, "prompt_tokens": 840, "total_tokens": 843}
    last["timings"] = {"cache_n": cache_n, "prompt_n": 840 - cache_n, "prompt_ms": 41.2,
                       "prompt_per_token_ms": 1.47, "prompt_per_second": 679.6, "predicted_n": 3,
                       "predicted_ms": 60.1, "predicted_per_token_ms": 20.0,
                       "predicted_per_second": 49.9}
    events += [sse(last), sse("[DONE]")]
    return events


LLAMA_CPP_MODELS = {"object": "list", "data": [
    {"id": LLAMA_CPP_MODEL, "object": "model", "created": 1733150000, "owned_by": "llamacpp",
     "meta": {"vocab_type": 2, "n_vocab": 152064, "n_ctx_train": 32768, "n_embd": 3584,
              "n_params": 7615616512, "size": 4677120000}}]}
LLAMA_CPP_PROPS = {"default_generation_settings": {"n_ctx": 8192, "params": {"n_predict": -1}},
                   "total_slots": 1, "model_path": f"/models/{LLAMA_CPP_MODEL}"}
LLAMA_CPP_401 = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}

# Ollama (OpenAI compatibility): `system_fingerprint: fp_ollama`; usage without details.
OLLAMA_MODEL = "llama3.3:70b"


def ollama_stream(pieces=PIECES) -> list[str]:
    def chunk(delta, finish=None):
        return {"id": "chatcmpl-512", "object": "chat.completion.chunk", "created": 1733150000,
                "model": OLLAMA_MODEL, "system_fingerprint": "fp_ollama",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    events = [sse(chunk({"role": "assistant", "content": p})) for p in pieces]
    events.append(sse(chunk({"role": "assistant", "content": ""}, "length")))
    events.append(sse({"id": "chatcmpl-512", "object": "chat.completion.chunk", "created": 1733150000,
                       "model": OLLAMA_MODEL, "system_fingerprint": "fp_ollama", "choices": [],
                       "usage": {"prompt_tokens": 26, "completion_tokens": 3, "total_tokens": 29}}))
    events.append(sse("[DONE]"))
    return events


OLLAMA_MODELS = {"object": "list", "data": [
    {"id": OLLAMA_MODEL, "object": "model", "created": 1733150000, "owned_by": "library"}]}
OLLAMA_404 = {"error": {"message": 'model "nope" not found, try pulling it first',
                        "type": "api_error", "param": None, "code": None}}

# A rate-limiting gateway in front of a server (OpenAI's shape).
RATE_LIMITED = {"error": {"message": "Rate limit reached for requests", "type": "requests",
                          "param": None, "code": "rate_limit_exceeded"}}
# vLLM/SGLang put an error into an already started stream.
MID_STREAM_ERROR = {"error": {"object": "error", "message": "The engine died unexpectedly.",
                              "type": "InternalServerError", "code": 500}}
