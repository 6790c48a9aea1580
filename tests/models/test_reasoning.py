from __future__ import annotations

import random
from pathlib import Path

import pytest

from app.models.chat_template import Message, template_from_source
from app.models.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

# (reply text, starts_in_reasoning) -> (reasoning, answer)
CASES = [
    (("Paris is the capital.", False), (None, "Paris is the capital.")),
    (("  Plain answer with <think> in the middle.\n", False), (None, "  Plain answer with <think> in the middle.\n")),
    (("<think>\nThe user asks about France.\n</think>\n\nParis.", False), ("The user asks about France.", "Paris.")),
    (("\n<think>a\n\nb  </think>answer\n", False), ("a\n\nb", "answer\n")),
    (("<think>\n\n</think>\n\nHello", False), ("", "Hello")),
    (("<think>cut off before the end", False), ("cut off before the end", "")),
    (("Okay, so the user wants a colour.\n</think>\n\nBlue.", True), ("Okay, so the user wants a colour.", "Blue.")),
    (("still thinking when the reply stopped", True), ("still thinking when the reply stopped", "")),
    (("x</think>y</think>z", True), ("x", "y</think>z")),
    (("<thin", False), (None, "<thin")),
    (("", False), (None, "")),
    (("<think>a</thi", False), ("a</thi", "")),
]


@pytest.mark.parametrize(("reply", "expected"), CASES)
def test_split_reasoning(reply, expected):
    text, inside = reply
    assert split_reasoning(text, starts_in_reasoning=inside) == expected


def _stream(text: str, inside: bool, cuts: list[int]) -> tuple[str, str, bool]:
    splitter = ReasoningSplitter(starts_in_reasoning=inside)
    reasoning, answer = [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        r, a = splitter.push(text[start:end])
        reasoning.append(r)
        answer.append(a)
    r, a = splitter.flush()
    return "".join(reasoning) + r, "".join(answer) + a, splitter.had_reasoning


@pytest.mark.parametrize(("reply", "expected"), CASES)
def test_streamed_deltas_add_up_to_the_split_for_every_cut(reply, expected):
    text, inside = reply
    reasoning, answer = expected
    cut_sets = [list(range(1, len(text)))]  # one character at a time
    cut_sets += [[i] for i in range(1, len(text))]  # every single cut, tags split anywhere
    rng = random.Random(7)
    cut_sets += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 3))) for _ in range(20)] if text else []
    for cuts in cut_sets:
        assert _stream(text, inside, cuts) == (reasoning or "", answer, reasoning is not None), cuts


def test_pushes_show_text_as_soon_as_it_is_certain():
    splitter = ReasoningSplitter()
    assert splitter.push("<th") == ("", "")  # could still be the tag
    assert splitter.push("ink>\nLet me see") == ("Let me see", "")
    assert splitter.push(" more. </th") == (" more.", "")  # the space may be trailing
    assert splitter.push("ink>\n\nThe answer") == ("", "The answer")
    assert splitter.push(" is 4.") == ("", " is 4.")
    assert splitter.flush() == ("", "")
    plain = ReasoningSplitter()
    assert plain.push("Hi") == ("", "Hi")
    assert not plain.had_reasoning


def test_r1_prompt_opens_the_thinking():
    source = (FIXTURES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(encoding="utf-8")
    template = template_from_source(source, bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>")
    prompt = template.render([Message("user", "Why is the sky blue?")])
    assert prompt.endswith("<｜Assistant｜><think>\n")
    assert prompt_opens_reasoning(prompt)
    reply = "Rayleigh scattering...\n</think>\n\nBecause blue light scatters most."
    assert split_reasoning(reply, starts_in_reasoning=prompt_opens_reasoning(prompt)) == (
        "Rayleigh scattering...", "Because blue light scatters most.")


def test_qwen3_prompt_opens_no_thinking_either_way():
    source = (FIXTURES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    template = template_from_source(source, bos_token="", eos_token="<|im_end|>")
    messages = [Message("user", "Hi")]
    assert not prompt_opens_reasoning(template.render(messages))
    no_thinking = template.render(messages, enable_thinking=False)
    assert no_thinking.endswith("<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning(no_thinking)
