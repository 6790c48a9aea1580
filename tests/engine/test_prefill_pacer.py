"""The prefill pacer on made-up pass times: which regime it picks, and what each pass carries."""

from __future__ import annotations

import pytest

from app.engine.engine import EngineConfig
from app.engine.prefill_pacer import PassPlan, PrefillPacer

CPU_LIKE = dict(decode_s=0.020, small=4, small_s=0.030, chunk=32, chunk_s=0.070)  # ~1.4 ms a token
GPU_LIKE = dict(decode_s=0.010, small=4, small_s=0.0102, chunk=32, chunk_s=0.0116)  # 0.05 ms


def pacer(warm_up=CPU_LIKE, **overrides) -> PrefillPacer:
    config = dict(prefill_chunk=512, interleave_ratio=2.3, min_interleave_chunk=64,
                  prefill_share=0.7, slice_every=24, max_slice_s=1.5)
    p = PrefillPacer(EngineConfig(**(config | overrides)))
    p.warmed_up(**warm_up)
    return p


def run_slice(p: PrefillPacer, pass_s: float) -> float:
    """Run the slice the next plan starts, in passes of `pass_s`; returns its length."""
    spent = 0.0
    while (plan := p.plan(streaming=True)) == PassPlan(512, decode=False):
        p.learn(pass_s, 512, 512, streaming=True)
        spent += pass_s
    assert plan == PassPlan(0)  # then the streams' turn
    return spent


def test_nobody_streaming_gets_the_whole_prefill_chunk():
    assert pacer().plan(streaming=False) == PassPlan(512)


def stream_passes(p: PrefillPacer, n: int, seconds: float = 0.020) -> None:
    """`n` passes of decode tokens only (the plan gives the prompt nothing meanwhile)."""
    for _ in range(n):
        assert p.plan(streaming=True) == PassPlan(0)
        p.learn(seconds, 0, 0, streaming=True)


def test_where_few_tokens_fit_a_mixed_pass_the_prompt_takes_time_slices():
    p = pacer()  # 1.3 x 20 ms holds ~18 tokens at 1.4 ms: fewer than 64
    assert not p.mixes()
    # `slice_every` passes of decode tokens, then the prompt runs alone (passes of
    # prefill_chunk, the streams left out) for share / (1 - share) of their time:
    # 0.7 / 0.3 x 24 x 0.02 s = 1.12 s.
    stream_passes(p, 24)
    assert run_slice(p, 0.28) == pytest.approx(1.12)
    assert not p.mixes()  # 512 tokens in 0.28 s: ~0.5 ms a token, ~50 would fit
    stream_passes(p, 24)  # and again
    assert run_slice(p, 0.28) == pytest.approx(1.12)


def test_a_document_waits_one_phase_of_the_streams_however_long_they_ran_before():
    """Only passes run while a prompt waited count: the late gaps stay 1 in slice_every + 1
    from the document's arrival on, and the first slice is as long as the others."""
    p = pacer()
    for _ in range(500):  # a stream ran long before the document came
        p.learn(0.020, 0, 0, streaming=True)
    stream_passes(p, 24)
    assert run_slice(p, 0.28) == pytest.approx(1.12)


def test_a_slice_never_runs_past_max_slice_s():
    p = pacer(max_slice_s=0.5)
    stream_passes(p, 24)
    assert run_slice(p, 0.25) == pytest.approx(0.5)
    # A chunk that would mostly run past the slice's end is left for the next slice.
    stream_passes(p, 24)
    assert run_slice(p, 0.4) == pytest.approx(0.4)


def test_a_slice_ends_when_no_prompt_needs_it():
    p = pacer()
    stream_passes(p, 24)
    assert p.plan(streaming=True).decode is False
    p.learn(0.1, 100, 100, streaming=True)  # the document's last 100 tokens
    p.learn(0.02, 0, 0, streaming=True)  # nothing left to prefill: a decode pass
    assert p.plan(streaming=True) == PassPlan(0)  # the next document waits its turn


def slice_until_its_time_is_up(p: PrefillPacer, prompt_left: int) -> None:
    """The 1.12 s slice of `pacer()` after 24 stream passes, in 0.28 s passes of 512 tokens,
    with `prompt_left` tokens still unread after its last pass."""
    stream_passes(p, 24)
    for left in (3, 2, 1, 0):
        assert p.plan(streaming=True) == PassPlan(512, decode=False)
        p.learn(0.28, 512, 512, streaming=True, prompt_left=prompt_left + left * 512)


def test_a_slice_runs_over_to_finish_a_prompt_that_needs_little_more():
    """A last ~0.07 s of the document is read now, not after another phase of the streams."""
    p = pacer()
    slice_until_its_time_is_up(p, prompt_left=100)  # ~0.02 + 100 x 0.5 ms: within 0.38 s
    assert p.plan(streaming=True) == PassPlan(512, decode=False)
    p.learn(0.07, 100, 100, streaming=True, prompt_left=0)
    assert p.plan(streaming=True) == PassPlan(0)  # and then the streams' turn


def test_a_slice_does_not_run_over_for_a_long_remainder_or_past_max_slice_s():
    p = pacer()
    slice_until_its_time_is_up(p, prompt_left=2_000)  # ~1 s: more than half the slice
    assert p.plan(streaming=True) == PassPlan(0)
    p = pacer(max_slice_s=1.12)  # the slice is as long as it may be
    slice_until_its_time_is_up(p, prompt_left=100)
    assert p.plan(streaming=True) == PassPlan(0)


def test_an_overrun_lasts_what_the_remainder_was_estimated_to_take():
    """A prompt that arrives meanwhile (or a remainder slower than estimated) does not keep
    the slice going: it waits for the next one."""
    p = pacer()
    slice_until_its_time_is_up(p, prompt_left=100)
    assert p.plan(streaming=True) == PassPlan(512, decode=False)
    p.learn(0.28, 512, 512, streaming=True, prompt_left=3_000)  # a new document rode along
    assert p.plan(streaming=True) == PassPlan(0)


def test_where_many_tokens_fit_every_pass_carries_a_steered_chunk():
    p = pacer(GPU_LIKE)  # 1.3 x 10 ms holds ~260 tokens at 0.05 ms
    assert p.mixes()
    plan = p.plan(streaming=True)
    assert plan.decode and 64 <= plan.prompt_tokens <= 512
    for _ in range(3):  # never waits for a slice
        p.learn(0.023, plan.prompt_tokens, plan.prompt_tokens, streaming=True)
        assert p.plan(streaming=True).prompt_tokens > 0
    # A pass that ran over its time (2.3 decode passes) shrinks the chunk.
    chunk = p.plan(streaming=True).prompt_tokens
    p.learn(0.060, chunk, chunk, streaming=True)
    assert p.plan(streaming=True).prompt_tokens < chunk


def test_the_regime_follows_the_measured_cost_of_a_prompt_token():
    p = pacer(GPU_LIKE)
    assert p.mixes()
    chunk = p.plan(streaming=True).prompt_tokens
    p.learn(0.010 + chunk * 0.002, chunk, chunk, streaming=True)  # 2 ms a token after all
    p.learn(0.010 + chunk * 0.002, chunk, chunk, streaming=True)
    assert not p.mixes()


def test_min_interleave_chunk_zero_always_mixes():
    p = pacer(min_interleave_chunk=0)
    assert p.mixes() and p.plan(streaming=True).prompt_tokens >= 1


# 20 ms decode passes and ~0.2 ms a token in long chunks: 1.3 x 20 ms holds ~130 of them.
NEAR_THE_LINE = dict(decode_s=0.020, small=4, small_s=0.0208, chunk=512, chunk_s=0.1224)


def test_mixing_is_judged_by_what_a_mixed_chunk_costs_and_does_not_swing_back():
    """A CPU near the line (a bfloat16 KV cache made long chunks cheap): mixing is tried, its
    chunks measured dear, and the slices' cheap long chunks do not bring it back."""
    p = pacer(NEAR_THE_LINE)
    assert p.mixes()  # ~130 tokens fit at the long-chunk cost: at least 2 x 64
    chunk = p.plan(streaming=True).prompt_tokens  # mixed chunks cost 0.5 ms a token:
    p.learn(0.020 + chunk * 0.0005, chunk, chunk, streaming=True)  # ~52 fit, fewer than 64
    assert not p.mixes()
    stream_passes(p, 24)
    run_slice(p, 0.1224)  # 512-token chunks alone at ~0.2 ms a token
    assert p.token_s < 0.0003 and not p.mixes()


def test_until_a_mixed_chunk_ran_the_long_chunk_estimate_must_fit_twice_the_floor():
    # ~100 tokens fit at the long-chunk cost: over 64, under 2 x 64.
    p = pacer(dict(decode_s=0.020, small=4, small_s=0.0210, chunk=512, chunk_s=0.1526))
    assert 64 < 1.3 * 0.020 / p.token_s < 128 and not p.mixes()
    assert pacer(GPU_LIKE).mixes()
