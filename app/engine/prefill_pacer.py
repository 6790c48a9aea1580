"""How many prompt tokens a pass carries while other requests stream.

A long prompt (a dropped document) must keep moving beside a streaming chat without making
that chat's tokens slow. Which way to share the machine depends on what a chunk costs, so
the pacer measures it from the engine's own passes instead of assuming a device:

* Mixing: every pass carries the decode tokens plus a chunk steered so the pass takes about
  `interleave_ratio` decode passes. Right where many prompt tokens fit in that time (a GPU).
* Time slices: where only a few fit (a CPU: a small chunk pays the pass's fixed part and its
  own attention over the context, so per prompt token a 16-token chunk costs ~3x what a
  400-token one does), mixing would slow every stream token and read the document at a
  fraction of its speed alone. Instead `slice_every` passes carry decode tokens only, then
  the prompt runs alone for a slice of time -- passes of up to `prefill_chunk` prompt
  tokens, the streams left out, as when nobody streams -- long enough that it gets
  `prefill_share` of the time: share / (1 - share) of the time the streams had since the
  last slice, at most `max_slice_s`. A stream's token is late in one gap of every
  `slice_every + 1` -- a document's first slice too waits for `slice_every` stream passes,
  so the late gaps stay under the 5% an inter-token p95 leaves out -- and the slice reads
  the document at its speed alone. (One big chunk per slice would not: attention within a
  chunk grows with its square, so 1,300 tokens in one pass took 2.5x what they take in
  512-token chunks.) The price: a stream pauses for a slice, share / (1 - share) x
  `slice_every` decode passes (~1.1 s for SmolLM2, ~2 s for Gemma 3 270M on a 2-core
  CPU), every `slice_every` tokens. A slice whose time is up while the prompts need only a
  little more (at most `FINISH_OVERRUN` of the slice, and never past `max_slice_s`) runs on
  to finish them: the streams pause a little longer once instead of `slice_every` passes
  later for that remainder, and the document is not a whole phase late for it (SmolLM2's
  3,000-token document beside a stream: 1.50x its time alone with a last ~0.04 s waiting
  out a phase, against ~1.33x -- share's 1 / 0.75 -- finished in its slice).

The regime is `mixes()`: mixing when a chunk of at least `min_interleave_chunk` tokens fits
in the mixing budget at the cost per prompt token of a mixed chunk. That cost is learned
from mixing passes alone (`mixed_token_s`): a long chunk's tokens are cheaper, so judging by
the slices' cost swung a document near the line from slices to mixing and back (a CPU with
a bfloat16 KV cache: 27 mixed passes of 2.3x a decode pass between two slices). Until a
mixing pass has run, the estimate from long chunks must fit twice the floor
(`UNMIXED_MARGIN`), since a mixed chunk's tokens cost more. Passes short prompts ran whole
in (`short_prompt_tokens`) are neither kind: they are the engine's, not the pacer's.
`plan` says what the next pass carries; `learn` is told what it cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.engine import EngineConfig


# Before any mixing pass was measured, a long chunk's cost per token must fit this many times
# `min_interleave_chunk` in the mixing budget (a mixed chunk's tokens cost ~1.5-2x as much).
UNMIXED_MARGIN = 2.0
# A slice may run this fraction of its length over to finish the prompts it serves.
FINISH_OVERRUN = 0.5


@dataclass(frozen=True)
class PassPlan:
    prompt_tokens: int  # prompt tokens the pass may carry (besides short prompts run whole)
    decode: bool = True  # whether the streams' decode tokens ride along (not in a slice)


class PrefillPacer:
    """Reads its settings off the engine's: `prefill_chunk`, `interleave_ratio`,
    `min_interleave_chunk`, `prefill_share`, `slice_every`, `max_slice_s`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.decode_pass_s = 0.0  # a pass carrying only decode tokens
        self.token_s = 0.0  # one more prompt token in a long chunk, at the current context
        self.mixed_token_s = 0.0  # a prompt token in a mixed pass's chunk (0: none ran yet)
        self.interleave_chunk = self._mixed_floor()
        # Passes the streams ran while a prompt waited for its slice, and their time: a slice
        # is due after `slice_every`, and lasts share / (1 - share) of that time.
        self._since_slice = 0
        self._since_slice_s = 0.0
        self._waited = False  # the pass being run was planned while a prompt waited
        self._slice_left_s = 0.0  # > 0: a slice is under way, with this much time left
        self._slice_s = 0.0  # the slice's length as planned
        self._overrun = False  # the slice runs over to finish the prompts

    # ---- what the next pass carries --------------------------------------------------

    def mixes(self) -> bool:
        """Whether prompts share every pass (mixing) rather than taking time slices."""
        floor = self.config.min_interleave_chunk
        if floor <= 0:
            return True
        budget = (self.config.interleave_ratio - 1) * self.decode_pass_s
        if self.mixed_token_s:
            return budget / self.mixed_token_s >= floor
        if not self.token_s:
            return False
        return budget / self.token_s >= UNMIXED_MARGIN * floor

    def plan(self, streaming: bool) -> PassPlan:
        """What the next pass carries; `streaming`: some requests are decoding."""
        c = self.config
        if not streaming:
            return PassPlan(c.prefill_chunk)
        if self.mixes():
            return PassPlan(self.interleave_chunk)
        if self._slice_left_s <= 0:
            if self._since_slice < c.slice_every:
                self._waited = True
                return PassPlan(0)
            share = c.prefill_share
            self._slice_left_s = min(share / (1 - share) * self._since_slice_s, c.max_slice_s)
            self._slice_s, self._overrun = self._slice_left_s, False
        return PassPlan(c.prefill_chunk, decode=False)

    # ---- learning from passes ---------------------------------------------------------

    def warmed_up(self, decode_s: float, small: int, small_s: float, chunk: int,
                  chunk_s: float) -> None:
        """First estimates from the warm-up: passes of 1, `small` and `chunk` tokens."""
        self.decode_pass_s = decode_s
        self.token_s = max(chunk_s - small_s, 1e-6) / (chunk - small)
        base = max(small_s - small * self.token_s, 0.0)
        target = self.config.interleave_ratio * decode_s
        self.interleave_chunk = self._clamp((target - base) / self.token_s)

    def learn(self, seconds: float, prompt_tokens: int, paced_tokens: int,
              streaming: bool, prompt_left: int = 0) -> None:
        """A pass took `seconds`, carrying `prompt_tokens` prompt tokens, `paced_tokens` of
        them from the plan (the rest were short prompts run whole); `streaming`: some
        requests were decoding (in the pass, or left out of it for a slice); `prompt_left`:
        prompt tokens still to be read after it."""
        per_token = 0.0
        if not prompt_tokens:
            self.decode_pass_s = _ema(self.decode_pass_s, seconds)
        else:
            # What prompt tokens cost beyond a pass's fixed part (about a decode pass), at
            # the chunk size just run (a mixing pass's also feeds `mixed_token_s`, below).
            per_token = max(seconds - self.decode_pass_s, 1e-6) / prompt_tokens
            self.token_s = _ema(self.token_s, per_token, 0.5)
        if self._slice_left_s > 0:
            self._slice_left_s -= seconds
            if self._overrun:  # (its time is the prompts' estimate: up to its very end)
                over = not paced_tokens or not prompt_left or self._slice_left_s <= 0
            else:
                # Another chunk only if most of it fits the time left (and a prompt still
                # needs it) -- or the rest of the prompts fits the overrun.
                over = not paced_tokens or self._slice_left_s < 0.5 * seconds
                if over and paced_tokens and 0 < prompt_left:
                    finish_s = self._finish_s(prompt_left)
                    allowed = min(FINISH_OVERRUN * self._slice_s,
                                  self.config.max_slice_s - self._slice_s)
                    if finish_s <= allowed:
                        self._slice_left_s, self._overrun, over = finish_s, True, False
            if over:
                self._slice_left_s = 0.0
                self._since_slice, self._since_slice_s = 0, 0.0
            return
        waited, self._waited = self._waited, False
        if not streaming:
            return
        if waited:  # streams' time only counts while a prompt waits for it to end
            self._since_slice += 1
            self._since_slice_s += seconds
        if paced_tokens and prompt_tokens == paced_tokens:  # a mixing pass
            self.mixed_token_s = _ema(self.mixed_token_s, per_token, 0.5)
            # Damped: the pass has a fixed part that does not shrink with the chunk.
            target = self.config.interleave_ratio * self.decode_pass_s
            self.interleave_chunk = self._clamp(
                self.interleave_chunk * (target / max(seconds, 1e-6)) ** 0.5)

    # ---- helpers ------------------------------------------------------------------------

    def _finish_s(self, prompt_tokens: int) -> float:
        """About how long passes of up to `prefill_chunk` take to read `prompt_tokens`."""
        passes = -(-prompt_tokens // self.config.prefill_chunk)
        return passes * self.decode_pass_s + prompt_tokens * self.token_s

    def _mixed_floor(self) -> int:
        return max(1, self.config.min_interleave_chunk)

    def _clamp(self, size: float) -> int:
        return int(max(self._mixed_floor(), min(self.config.prefill_chunk, size)))


def _ema(old: float, new: float, weight: float = 0.3) -> float:
    return new if not old else old + weight * (new - old)
