from __future__ import annotations

import pytest

from app.models.chat_template import GemmaTemplate, JinjaTemplate, Message, encode_chat, template_for
from app.models.errors import ModelError


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


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        GemmaTemplate().render([Message("tool", "x")])


def test_template_choice_prefers_the_file_then_the_architecture():
    assert isinstance(template_for({}, "gemma3"), GemmaTemplate)
    jinja = template_for({"tokenizer.chat_template": "{% for m in messages %}[{{ m.role }}]"
                          "{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"},
                         "llama")
    assert isinstance(jinja, JinjaTemplate)
    assert jinja.render([Message("user", "a")]) == "[user]a>"
    with pytest.raises(ModelError, match="No chat template"):
        template_for({}, "mystery")


def test_broken_jinja_template_is_a_model_error():
    with pytest.raises(ModelError, match="chat template"):
        template_for({"tokenizer.chat_template": "{% for %}"}, "llama")


def test_encode_chat_uses_control_tokens_and_one_bos(embedded_model_path):
    from app.models.gguf_file import GGUFFile
    from app.models.tokenizer import Tokenizer

    with GGUFFile(embedded_model_path) as f:
        tok = Tokenizer.from_gguf(f)
    ids = encode_chat(tok, GemmaTemplate(), [Message("user", "Hi")])
    assert ids[:3] == [2, 105, 2364]  # <bos> <start_of_turn> user
    assert ids.count(2) == 1
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn> model \n
