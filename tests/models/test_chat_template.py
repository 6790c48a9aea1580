from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.models.chat_template import (
    GENERIC_NOTICE,
    ChatTemplateError,
    GemmaTemplate,
    JinjaTemplate,
    Message,
    chat_prompt,
    encode_chat,
    fallback_template,
    template_for,
    template_from_source,
)
from app.models.errors import ModelError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

# fixture file -> (bos_token, eos_token) of that model's tokenizer
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>"),
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "HuggingFaceTB-SmolLM2-135M-Instruct.jinja": ("<|im_start|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "google-gemma-3-it.jinja": ("<bos>", "<eos>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}
WITH_TOOLS = {"Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
              "meta-llama-Llama-3.2-3B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja"}

CONVERSATIONS = {
    "system+user": [Message("system", "Answer briefly."), Message("user", "Name a colour.")],
    "multi-turn": [Message("system", "You are helpful."), Message("user", "Hi"),
                   Message("assistant", "Hello! How can I help?"), Message("user", "What is 2+2?")],
    "no system": [Message("user", "Hi"), Message("assistant", "  Hello  "), Message("user", "Again, please.")],
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Mistral wants 9-character call ids.
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
TOOL_CHAT = [Message("system", "Use the tools."), Message("user", "Weather in Paris?"),
             Message("assistant", None, tool_calls=[CALL]),
             Message("tool", '{"temp_c": 21}', tool_call_id="call12345", name="get_weather"),
             Message("assistant", "It is 21 °C in Paris."), Message("user", "Thanks!")]


def _source(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def _ours(name: str) -> JinjaTemplate:
    bos, eos = TEMPLATES[name]
    return template_from_source(_source(name), bos_token=bos, eos_token=eos)


def _transformers_render(name: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    bos, eos = TEMPLATES[name]
    return _transformers_render_source(_source(name), bos, eos, messages, add_generation_prompt, **kwargs)


def _transformers_render_source(source, bos, eos, messages, add_generation_prompt, **kwargs) -> str:
    """transformers' public `apply_chat_template` on a tokenizer carrying the template (the
    reference: a word-level tokenizer with only the special tokens, built in memory)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    specials = {"<unk>": 0, eos: 1, **({bos: 2} if bos else {})}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(specials, unk_token="<unk>"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos or None, eos_token=eos,
                                               chat_template=source)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **kwargs)


def _as_dicts(messages, *, arguments_as_object=True, empty_content=False) -> list[dict]:
    """Messages as transformers' documentation writes them (tool-call arguments as dicts)."""
    out = []
    for m in messages:
        d = {"role": m.role}
        if m.content is not None or empty_content:
            d["content"] = m.content or ""
        if m.tool_calls:
            d["tool_calls"] = [{**c, "function": {**c["function"], "arguments": (
                json.loads(c["function"]["arguments"]) if arguments_as_object else c["function"]["arguments"])}}
                for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        out.append(d)
    return out


# -- renders identical to transformers ------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_matches_transformers(name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = _ours(name).render(messages, add_generation_prompt)
    try:
        expected = _transformers_render(name, _as_dicts(messages), add_generation_prompt)
    except Exception as refused:  # Gemma 2 refuses a system turn: ours merges it into the user turn
        assert "System role not supported" in str(refused)
        merged = [Message("user", f"{messages[0].content}\n\n{messages[1].content}"), *messages[2:]]
        expected = _transformers_render(name, _as_dicts(merged), add_generation_prompt)
    assert ours == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(WITH_TOOLS))
def test_tools_and_tool_calls_render_as_transformers(name, add_generation_prompt):
    template = _ours(name)
    assert template.supports_tools
    ours = template.render(TOOL_CHAT, add_generation_prompt, tools=[WEATHER_TOOL])
    try:
        expected = _transformers_render(name, _as_dicts(TOOL_CHAT), add_generation_prompt, tools=[WEATHER_TOOL])
    except Exception:  # Qwen 3 reads `content` of the tool-calling turn: it must be there, even empty
        expected = _transformers_render(name, _as_dicts(TOOL_CHAT, empty_content=True), add_generation_prompt,
                                        tools=[WEATHER_TOOL])
    assert ours == expected
    assert "get_weather" in ours and "Paris" in ours


# Templates leaning on each part of transformers' environment. (The real templates above are
# written with `{%-` everywhere and would render the same without trim_blocks/lstrip_blocks.)
ENVIRONMENT_FEATURES = {
    "trim_blocks and lstrip_blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
                                     "    {% endif %}\n{% endfor %}\n",
    "tojson without HTML escaping": "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}",
    "loop controls": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                     "{% endfor %}",
    "generation tag": "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}",
    "dict and namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                          "{% endfor %}{{ dict(a=ns.n) | tojson }}",
    "strftime_now and special tokens": "{{ bos_token }}{{ strftime_now('%Y') }}{{ eos_token }}"
                                       "{{ add_generation_prompt }}",
    "None values are absent": "{% for m in messages %}{{ m.content is defined }}{{ m.tool_calls is defined }}"
                              "{% endfor %}",
}


@pytest.mark.parametrize("feature", sorted(ENVIRONMENT_FEATURES))
def test_environment_matches_transformers(feature):
    source = ENVIRONMENT_FEATURES[feature]
    messages = [Message("user", "a <b> & 'c'"), Message("assistant", None, tool_calls=[CALL]),
                Message("user", "d")]
    ours = JinjaTemplate(source, "<s>", "</s>").render(messages, tools=[WEATHER_TOOL])
    expected = _transformers_render_source(source, "<s>", "</s>", _as_dicts(messages), True,
                                           tools=[WEATHER_TOOL])
    assert ours == expected


def test_tool_call_arguments_reach_the_template_as_an_object():
    text = _ours("Qwen-Qwen2.5-7B-Instruct.jinja").render(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in text


def test_a_template_that_concatenates_arguments_gets_the_json_string():
    # DeepSeek R1 writes `'...' + tool['function']['arguments']`: a dict fails there, the string works.
    source = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
              "{{ c.function.name + ' ' + c.function.arguments }}{% endfor %}{% endfor %}")
    assert JinjaTemplate(source).render(TOOL_CHAT) == 'get_weather {"city": "Paris"}'


def test_supports_tools_follows_the_source():
    assert not _ours("google-gemma-3-it.jinja").supports_tools
    assert not _ours("microsoft-Phi-3.5-mini-instruct.jinja").supports_tools
    assert not GemmaTemplate().supports_tools


def test_template_options_reach_the_template():
    name = "Qwen-Qwen3-0.6B.jinja"
    messages = CONVERSATIONS["system+user"]
    ours = _ours(name).render(messages, enable_thinking=False)
    assert ours == _transformers_render(name, _as_dicts(messages), True, enable_thinking=False)
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_two_user_turns_in_a_row_are_merged_for_a_strict_template():
    # A failed reply dropped from the history leaves two user turns; Gemma 2 would refuse them.
    text = _ours("google-gemma-2-2b-it.jinja").render([Message("user", "One"), Message("user", "Two")])
    assert text == "<bos><start_of_turn>user\nOne\n\nTwo<end_of_turn>\n<start_of_turn>model\n"


def test_a_refusal_the_adaptations_cannot_fix_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="chat template failed: Conversation roles must alternate"):
        _ours("google-gemma-3-it.jinja").render([Message("assistant", "I speak first")])


# -- the built-in Gemma format, BOS and encode_chat ---------------------------------------------


def test_gemma_turn_format():
    text = GemmaTemplate().render([Message("user", "Hi"), Message("assistant", "Hello!"),
                                   Message("user", "How are you?")])
    assert text == ("<start_of_turn>user\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nHow are you?<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_gemma_merges_system_into_first_user_turn():
    text = GemmaTemplate().render([Message("system", "Be brief."), Message("user", "Hi")],
                                  add_generation_prompt=False)
    assert text == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_builtin_gemma_format_is_googles_template_without_bos(conversation):
    messages = CONVERSATIONS[conversation]
    google = _ours("google-gemma-3-it.jinja").render(messages)
    assert google == "<bos>" + GemmaTemplate().render(messages)


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        GemmaTemplate().render([Message("tool", "x")])
    with pytest.raises(ValueError, match="role"):
        _ours("Qwen-Qwen2.5-7B-Instruct.jinja").render([Message("robot", "x")])


def test_message_stays_positional_and_backwards_compatible():
    m = Message("user", "Hi")
    assert (m.role, m.content, m.tool_calls, m.tool_call_id, m.name) == ("user", "Hi", None, None, None)


def test_encode_chat_uses_control_tokens_and_one_bos(embedded_model_path):
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    with GGUFFile(embedded_model_path) as f:
        tok = Tokenizer.from_gguf(f)
    ids = encode_chat(tok, GemmaTemplate(), [Message("user", "Hi")])
    assert ids[:3] == [2, 105, 2364]  # <bos> <start_of_turn> user
    assert ids.count(2) == 1
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn> model \n


def test_a_template_writing_bos_still_gives_one_bos(embedded_model_path):
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    with GGUFFile(embedded_model_path) as f:
        tok = Tokenizer.from_gguf(f)
    messages = CONVERSATIONS["multi-turn"]
    google = _ours("google-gemma-3-it.jinja")
    builtin_ids = encode_chat(tok, GemmaTemplate(), messages)
    assert encode_chat(tok, google, messages) == builtin_ids  # BOS added once, the text's dropped
    tok.add_bos = False  # a model that leaves BOS to its template: the text's own BOS is kept
    assert encode_chat(tok, google, messages) == builtin_ids
    assert encode_chat(tok, GemmaTemplate(), messages) == builtin_ids[1:]


def test_chat_prompt_gives_text_ids_and_where_the_reply_starts(embedded_model_path):
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    with GGUFFile(embedded_model_path) as f:
        tok = Tokenizer.from_gguf(f)
    messages = [Message("user", "Hi")]
    prompt = chat_prompt(tok, _ours("google-gemma-3-it.jinja"), messages)
    assert prompt.text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert prompt.ids == [tok.bos_id] + tok.encode(prompt.text, special=True)
    assert not prompt.starts_in_reasoning
    r1 = _ours("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    assert chat_prompt(tok, r1, messages).starts_in_reasoning
    assert not chat_prompt(tok, r1, messages, add_generation_prompt=False).starts_in_reasoning


# -- stops --------------------------------------------------------------------------------------


class _Vocabulary:
    """The one tokenizer lookup `stop_token_ids` uses, over a list of pieces."""

    def __init__(self, pieces):
        self._ids = {p: i for i, p in enumerate(pieces)}

    def token_id(self, piece):
        return self._ids.get(piece)


def test_stops_are_the_end_of_turn_tokens_the_template_writes():
    qwen = _Vocabulary(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_turn>", "hello"])
    assert _ours("Qwen-Qwen2.5-7B-Instruct.jinja").stop_token_ids(qwen) == {0, 2}
    llama = _Vocabulary(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>"])
    assert _ours("meta-llama-Llama-3.1-8B-Instruct.jinja").stop_token_ids(llama) == {1, 2, 3}
    mistral = _Vocabulary(["<unk>", "<s>", "</s>", "[INST]"])
    assert _ours("mistralai-Mistral-Nemo-Instruct-2407.jinja").stop_token_ids(mistral) == {2}
    phi = _Vocabulary(["<unk>", "<s>", "</s>", "<|endoftext|>", "<|end|>", "<|assistant|>"])
    assert _ours("microsoft-Phi-3.5-mini-instruct.jinja").stop_token_ids(phi) == {3, 4}
    gemma = _Vocabulary(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
    assert _ours("google-gemma-2-2b-it.jinja").stop_token_ids(gemma) == {4}
    assert GemmaTemplate().stop_token_ids(gemma) == {4}


# -- choosing a template ------------------------------------------------------------------------


def test_template_choice_prefers_the_file_then_the_architecture():
    assert isinstance(template_for({}, "gemma3"), GemmaTemplate)
    jinja = template_for({"tokenizer.chat_template": "{% for m in messages %}[{{ m.role }}]"
                          "{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"},
                         "llama")
    assert isinstance(jinja, JinjaTemplate)
    assert jinja.render([Message("user", "a")]) == "[user]a>"


def test_template_for_passes_the_files_bos_and_eos_and_its_tool_template():
    metadata = {"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"], "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
                "tokenizer.chat_template.tool_use": "{{ bos_token }}tools: {{ tools | length }}"}
    template = template_for(metadata, "llama")
    assert template.render([Message("user", "x")]) == "<s>x</s>"
    assert template.render([Message("user", "x")], tools=[WEATHER_TOOL]) == "<s>tools: 1"


def test_fallbacks_by_architecture_and_vocabulary():
    chat = [Message("system", "S"), Message("user", "Hi")]
    chatml = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fallback_template("qwen2", []).render(chat) == chatml
    assert fallback_template("llama", ["<|im_start|>", "<|im_end|>"]).render(chat) == chatml
    llama3 = fallback_template("llama", ["<|begin_of_text|>", "<|start_header_id|>"],
                               bos_token="<|begin_of_text|>")
    assert llama3.render(chat) == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                                   "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert llama3.notice is None
    generic = fallback_template("mystery", ["<s>", "</s>"])
    assert generic.notice == GENERIC_NOTICE
    assert generic.render(chat + [Message("assistant", "Hello"), Message("user", "Bye")]) == (
        "S\n\nUser: Hi\n\nAssistant: Hello\n\nUser: Bye\n\nAssistant:")
    assert generic.stop_strings == ("\nUser:",)
    assert template_for({}, "mystery").notice == GENERIC_NOTICE


def test_template_from_source_picks_the_default_of_named_templates():
    named = [{"name": "tool_use", "template": "T{{ tools | length }}"},
             {"name": "default", "template": "D{{ messages | length }}"}]
    template = template_from_source(named, bos_token="<s>", eos_token="</s>")
    assert template.render([Message("user", "x")]) == "D1"
    assert template.render([Message("user", "x")], tools=[WEATHER_TOOL]) == "T1"
    with pytest.raises(ChatTemplateError, match="default"):
        template_from_source([{"name": "tool_use", "template": "T"}], bos_token="", eos_token="")


def test_a_template_that_does_not_compile_falls_back_and_says_so():
    with pytest.raises(ModelError, match="chat template is invalid"):
        JinjaTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="chat template is invalid"):
        template_from_source("{{ x | no_such_filter }}", bos_token="", eos_token="")
    metadata = {"tokenizer.chat_template": "{% for %}", "tokenizer.ggml.tokens": ["<unk>", "<|im_start|>"]}
    template = template_for(metadata, "llama")
    assert template.name == "chatml"
    assert template.notice.startswith("This model's chat template is invalid: ")
    assert template.notice.endswith("Using the chatml format instead.")
    assert GemmaTemplate.notice is None and template_for({}, "gemma3").notice is None


# -- untrusted templates: bounded and sandboxed ---------------------------------------------------


HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge power": "{{ 10**10000000 }}",
    "huge string": "{{ 'a' * 10**9 }}",
    "doubling string": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s }}",
    "text kept out of the output": "{% set s %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
                                   "{% endset %}",
    "huge width": "{{ '%0999999999d' % 1 }}{{ 'a'.center(10**9) }}",
    "huge join": "{% set big = 'a' * 900000 %}{{ ([big] * 100000) | join }}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_templates_fail_with_a_clear_error(kind):
    template = JinjaTemplate(HOSTILE[kind])
    with pytest.raises(ChatTemplateError, match="^This model's chat template failed: ") as raised:
        template.render([Message("user", "hi")])
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, ModelError)


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__['os'].popen('id').read() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').popen('id').read() }}",
    "{{ (messages | map(attribute='role')).gi_frame.f_globals }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ messages.append(1) }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ ('{0.__class__.__mro__}' | attr('format'))('') }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_stay_blocked(source):
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        JinjaTemplate(source).render([Message("user", "hi")])


def test_budgets_leave_room_for_long_conversations():
    long = [Message("user", "x" * 3_000_000)]
    assert len(_ours("Qwen-Qwen3-0.6B.jinja").render(long)) > 3_000_000
    many = [Message("user" if i % 2 == 0 else "assistant", f"turn {i} " * 50) for i in range(801)]
    text = _ours("mistralai-Mistral-Nemo-Instruct-2407.jinja").render([Message("system", "S"), *many])
    assert text.count("[INST]") == 401


def test_the_continuation_template_writes_the_conversation_as_one_text():
    from app.models.chat_template import ContinuationTemplate

    t = ContinuationTemplate()
    turns = [Message("user", "Once upon a time"), Message("assistant", " there was a fox."),
             Message("user", "\nThe end")]
    assert t.render(turns) == t.render(turns, add_generation_prompt=False) == \
        "Once upon a time there was a fox.\nThe end"
    assert t.render([Message("system", "A story."), Message("user", "Once")]) == "A story.\n\nOnce"
    assert t.render([]) == "" and t.stop_token_ids(None) == set()
    with pytest.raises(ValueError, match="role"):
        t.render([Message("tool", "{}")])
