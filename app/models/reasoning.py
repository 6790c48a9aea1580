"""Reasoning models' thinking, split from their answer.

Qwen 3, QwQ and the DeepSeek R1 distills write `<think>…</think>` before the answer. Some
templates open the tag themselves: an R1 distill's generation prompt ends with `<think>\\n`,
so the model's text starts inside its thinking and only the closing tag appears.

The rule, the same for a whole text (`split_reasoning`) and a stream (`ReasoningSplitter`):
- thinking opens only at the very start of the reply (after whitespace), or in the prompt;
- it ends at the first `</think>`; everything after is the answer;
- whitespace around the thinking, and at the start of an answer that follows thinking, is
  dropped; a reply without thinking is returned untouched as the answer;
- thinking that never closes (the reply was cut off) is all reasoning, with no answer.
The streamed deltas add up to exactly what `split_reasoning` returns for the whole text.
"""

from __future__ import annotations

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


def prompt_opens_reasoning(prompt: str, open_tag: str = OPEN_TAG) -> bool:
    """True when a rendered prompt ends with an open thinking tag (R1 distills' `<think>\\n`),
    so the reply starts in the middle of its thinking. (Qwen 3 with thinking off ends its prompt
    with an empty `<think>\\n\\n</think>\\n\\n`: False.)"""
    return prompt.rstrip().endswith(open_tag)


def split_reasoning(text: str, *, starts_in_reasoning: bool = False, open_tag: str = OPEN_TAG,
                    close_tag: str = CLOSE_TAG) -> tuple[str | None, str]:
    """(reasoning, answer) for a whole reply; reasoning is None when the reply has none."""
    splitter = ReasoningSplitter(starts_in_reasoning=starts_in_reasoning, open_tag=open_tag, close_tag=close_tag)
    reasoning, answer = splitter.push(text)
    more_reasoning, more_answer = splitter.flush()
    reasoning, answer = reasoning + more_reasoning, answer + more_answer
    return (reasoning if splitter.had_reasoning else None), answer


class ReasoningSplitter:
    """Splits streamed reply text into (reasoning_delta, answer_delta) pairs.

    `push(delta)` returns what can be shown now; text that may be the start of a tag, or
    whitespace that may turn out to be trailing, is held back until the next push or `flush()`.
    `had_reasoning` says whether the reply has a thinking part at all (for an empty one too).

        splitter = ReasoningSplitter(starts_in_reasoning=prompt_opens_reasoning(prompt_text))
        for delta in stream:
            thinking, answer = splitter.push(delta)
        thinking, answer = splitter.flush()
    """

    # States: waiting to see whether the reply opens with the tag / inside thinking / answer.
    _START, _THINKING, _ANSWER = "start", "thinking", "answer"

    def __init__(self, *, starts_in_reasoning: bool = False, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG):
        self.open_tag, self.close_tag = open_tag, close_tag
        self._state = self._THINKING if starts_in_reasoning else self._START
        self.had_reasoning = starts_in_reasoning
        self._held = ""  # text not yet given out (see the class docstring)
        self._thinking_started = False  # leading whitespace of the thinking is dropped until then
        self._answer_started = False  # likewise for an answer after thinking

    def push(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, answer = [], []
        while True:
            progressed = self._step(reasoning, answer, final=False)
            if not progressed:
                break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """Everything still held, at the end of the reply."""
        reasoning, answer = [], []
        while self._step(reasoning, answer, final=True):
            pass
        return "".join(reasoning), "".join(answer)

    def _step(self, reasoning: list[str], answer: list[str], final: bool) -> bool:
        """Move one piece of held text on; False when nothing more can move yet."""
        held = self._held
        if not held:
            return False
        if self._state == self._START:
            body = held.lstrip()
            if body.startswith(self.open_tag):
                self._state, self.had_reasoning = self._THINKING, True
                self._held = body[len(self.open_tag):]
                return True
            if (not body or self.open_tag.startswith(body)) and not final:
                return False  # only whitespace, or the start of the tag so far
            self._state, self._held = self._ANSWER, ""
            answer.append(held)  # no thinking: the reply is the answer, untouched
            self._answer_started = True
            return False
        if self._state == self._THINKING:
            if not self._thinking_started:
                held = self._held = held.lstrip()
                if not held:
                    return False
                self._thinking_started = True
            end = held.find(self.close_tag)
            if end >= 0:
                reasoning.append(held[:end].rstrip())
                self._state, self._held = self._ANSWER, held[end + len(self.close_tag):]
                return True
            keep = 0 if final else _partial_tag_length(held, self.close_tag)
            text = held[:len(held) - keep]
            body = text.rstrip()
            if final:
                body, keep_ws = body, ""
            else:
                keep_ws = text[len(body):]  # may be whitespace before the closing tag
            reasoning.append(body)
            self._held = keep_ws + held[len(held) - keep:] if keep or keep_ws else ""
            if final:
                self._held = ""
            return False
        # _ANSWER after thinking: drop the whitespace that separates it from the thinking.
        if not self._answer_started:
            held = held.lstrip()
            if not held:
                self._held = ""
                return False
            self._answer_started = True
        answer.append(held)
        self._held = ""
        return False


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
