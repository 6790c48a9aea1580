"""response_format: json_object and json_schema constrain decoding, so even a model with
random weights answers with JSON that parses and fits the schema; the SDK's `parse()` with a
pydantic model works against the embedded model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_ID, SAFETY_TIMEOUT_S, user

# Only closed choices, so a random model's reply ends well inside max_tokens.
CLOSED = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]},
                   "ok": {"type": "boolean"},
                   "size": {"enum": [1, 2, 3]}},
    "required": ["colour", "ok", "size"],
    "additionalProperties": False,
}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_holds_even_for_a_random_model(tiny_server, seed):
    reply = tiny_server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Pick a colour."), max_tokens=40, temperature=1.0,
        seed=seed, response_format=_schema_format(CLOSED))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    answer = json.loads(choice.message.content)
    assert set(answer) == {"colour", "ok", "size"}
    assert answer["colour"] in ("red", "green", "blue") and isinstance(answer["ok"], bool)
    assert answer["size"] in (1, 2, 3)


def test_json_schema_streamed(tiny_server):
    chunks = list(tiny_server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Pick a colour."), max_tokens=40, temperature=1.0,
        seed=7, stream=True, response_format=_schema_format(CLOSED)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text)["colour"] in ("red", "green", "blue")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_is_json(tiny_server):
    # Any object: a random model may write keys for ever, so only what it wrote so far is
    # checked to be a JSON object's beginning; the closed schema above checks the ending.
    reply = tiny_server.client().chat.completions.create(
        model=MODEL_ID, messages=user("Answer in JSON."), max_tokens=12, temperature=0,
        response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": CLOSED}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "bogus"}, "response_format.type"),
])
def test_bad_formats_are_a_400(tiny_server, fmt, param):
    response = httpx.post(f"{tiny_server.url}/chat/completions", timeout=SAFETY_TIMEOUT_S,
                          json={"model": MODEL_ID, "messages": user("Hi"), "max_tokens": 2,
                                "response_format": fmt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.slow
def test_sdk_parse_returns_a_valid_object(server):
    client = server.client()
    completion = client.chat.completions.parse(
        model=MODEL_ID, max_tokens=60, temperature=0, response_format=Person,
        messages=[{"role": "user", "content": "Ada Lovelace was 36. Give her name and age as "
                                              "JSON."}])
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.name and person.age >= 0


def test_completions_have_no_response_format(tiny_server):
    # OpenAI's legacy completions define no response_format; asking for it is not ignored.
    response = httpx.post(f"{tiny_server.url}/completions", timeout=SAFETY_TIMEOUT_S,
                          json={"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2,
                                "response_format": {"type": "json_object"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"
