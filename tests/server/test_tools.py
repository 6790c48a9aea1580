"""Tool calls: the three syntaxes read out of replies (whole and streamed), and the API with
the openai SDK on the tiny model given Qwen 2.5's chat template (Hermes `<tool_call>`
syntax): a required or named tool_choice decodes a valid call even with random weights, and
a round trip (call, `role: "tool"` result, answer) works streamed and not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import openai
import pytest

from app.models.chat_template import JinjaTemplate
from app.server.tools import (HermesSyntax, JsonSyntax, MistralSyntax, ToolCallReader,
                              syntax_for)
from tests.server.conftest import MODEL_ID, SAFETY_TIMEOUT_S, running_server, user

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
KNOWN = {"get_weather", "get_time"}

# Closed parameters (enums, booleans), so a random model's call ends well inside max_tokens.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                      "celsius": {"type": "boolean"}},
                       "required": ["city", "celsius"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}},
]


# ---- reading calls -----------------------------------------------------------------------


def test_hermes_calls_after_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
            '</tool_call>')
    content, calls = HermesSyntax().parse(text, KNOWN)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


@pytest.mark.parametrize("text", [
    "No calls here.",
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # unknown tool
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',  # not an object
])
def test_hermes_without_a_valid_call_is_content(text):
    assert HermesSyntax().parse(text, KNOWN) is None


def test_mistral_both_generations():
    old = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]'
    new = '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert [c.name for c in MistralSyntax().parse(old, KNOWN)[1]] == ["get_time"]
    assert [c.name for c in MistralSyntax().parse(new, KNOWN)[1]] == ["get_time", "get_weather"]
    assert MistralSyntax().parse("Plain answer.", KNOWN) is None


def test_llama_json_calls():
    one = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    two = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; ' \
          '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert json.loads(JsonSyntax().parse(one, KNOWN)[1][0].arguments) == {"zone": "UTC"}
    assert [c.name for c in JsonSyntax().parse(two, KNOWN)[1]] == ["get_time", "get_weather"]
    assert JsonSyntax().parse("The time is noon.", KNOWN) is None


def test_the_syntax_follows_the_template(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    for name, syntax in [("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"),
                         ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
                         ("meta-llama-Llama-3.1-8B-Instruct", "json")]:
        template = JinjaTemplate((TEMPLATES / f"{name}.jinja").read_text())
        assert template.supports_tools and syntax_for(template, tokenizer).name == syntax


def test_streamed_reply_sends_content_and_holds_the_call(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    reply = ('Checking now.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
             '</tool_call>')
    reader = ToolCallReader(tokenizer, HermesSyntax(), KNOWN, stop_ids={1}, parallel=True)
    sent = "".join(reader.push(t) for t in tokenizer.encode(reply) + [1])
    assert sent.strip() == "Checking now." and "<" not in sent
    rest, calls = reader.finish()
    assert (sent + rest).strip() == "Checking now."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    plain = ToolCallReader(tokenizer, HermesSyntax(), KNOWN, stop_ids=set(), parallel=True)
    text = "Less than 3 is <b>true</b>."
    sent = "".join(plain.push(t) for t in tokenizer.encode(text))
    assert sent + plain.finish()[0] == text and plain.finish()[1] == []


# ---- over the API --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_server(tiny_loaded):
    source = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    loaded = dataclasses.replace(tiny_loaded, template=JinjaTemplate(source,
                                                                     eos_token="<|im_end|>"))
    with running_server(loaded) as running:
        yield running


def _ask(server, **extra):
    return server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Weather in Oslo?"), tools=TOOLS, max_tokens=60,
        temperature=1.0, **extra)


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_choice_gives_a_valid_call(qwen_server, seed):
    reply = _ask(qwen_server, tool_choice="required", seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.function.name in KNOWN for c in calls)
    for call in calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["city"] in ("Paris", "Oslo") and isinstance(args["celsius"], bool)
        else:
            assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


def test_named_tool_choice_calls_that_tool_once(qwen_server):
    reply = _ask(qwen_server, seed=5,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]


def _streamed_call(server, **extra):
    chunks = list(server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Time in Paris?"), tools=TOOLS, max_tokens=60,
        temperature=1.0, stream=True, **extra))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    return chunks, deltas


def test_streamed_call_arrives_as_tool_call_deltas(qwen_server):
    chunks, deltas = _streamed_call(qwen_server, seed=3, tool_choice="required",
                                    parallel_tool_calls=False)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name in KNOWN and json.loads(deltas[0].function.arguments)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(qwen_server, stream):
    client = qwen_server.client()
    question = user("What is the time in UTC?")
    first = client.chat.completions.create(
        model=MODEL_ID, messages=question, tools=TOOLS, max_tokens=60, seed=9,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = first.choices[0].message.tool_calls[0]
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    if stream:
        chunks = list(client.chat.completions.create(
            model=MODEL_ID, messages=history, tools=TOOLS, max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        usage, finish = chunks[-1].usage, chunks[-2].choices[0].finish_reason
    else:
        answer = client.chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS,
                                                max_tokens=4, temperature=0)
        usage, finish = answer.usage, answer.choices[0].finish_reason
    assert finish in ("stop", "length", "tool_calls")
    # The call and its result are in the prompt, as the template renders them.
    assert usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_tool_choice_none_renders_no_tools(qwen_server):
    a = qwen_server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Hi"), tools=TOOLS, tool_choice="none", max_tokens=1)
    b = qwen_server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Hi"), tools=TOOLS, max_tokens=1)
    assert a.usage.prompt_tokens < b.usage.prompt_tokens  # no tool list in the prompt
    assert a.choices[0].message.tool_calls is None


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_a_400(qwen_server, extra, param):
    response = httpx.post(f"{qwen_server.url}/chat/completions", timeout=SAFETY_TIMEOUT_S,
                          json={"model": MODEL_ID, "messages": user("Hi"), "max_tokens": 2,
                                **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_a_template_without_tools_refuses_them(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(model=MODEL_ID, messages=user("Hi"),
                                                     tools=TOOLS, max_tokens=2)
    assert caught.value.body["param"] == "tools" and "tool support" in caught.value.message


def test_a_control_token_marker_is_forced_as_that_token(tiny_loaded):
    """Where the vocabulary has the marker as one control token (Qwen's <tool_call> is text,
    Mistral's [TOOL_CALLS] is not), the grammar asks for that token, not its spelling.
    Gemma's <start_of_turn>/<end_of_turn> stand in as such a pair here."""
    import torch

    from app.server.grammar import GrammarFactory
    from app.server.tools import call_schema

    tokenizer = tiny_loaded.tokenizer
    start, end = tokenizer.token_id("<start_of_turn>"), tokenizer.token_id("<end_of_turn>")
    assert tokenizer.is_control(start) and tokenizer.is_control(end)
    factory = GrammarFactory(tokenizer, tiny_loaded.vocab_size, {tokenizer.eos_id})
    syntax = HermesSyntax()
    grammar = syntax.lark(call_schema(TOOLS, "get_time", syntax), False,
                          {"<tool_call>": start, "</tool_call>": end})
    constraint = factory.lark(grammar)()
    row = constraint([], torch.zeros(tiny_loaded.vocab_size))
    assert torch.isfinite(row).nonzero().flatten().tolist() == [start]
    # Then the call's text, and the closing token.
    body = '\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    generated = [start]
    for token in tokenizer.encode(body):
        row = constraint(generated, torch.zeros(tiny_loaded.vocab_size))
        assert torch.isfinite(row[token])
        generated.append(token)
    row = constraint(generated, torch.zeros(tiny_loaded.vocab_size))
    assert torch.isfinite(row).nonzero().flatten().tolist() == [end]
