"""The sampler is total (issue 10, point 11) and the per-request logits-processor hook:
logit_bias, and a request whose processors leave no token failing alone in the engine."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.engine import Engine, EngineConfig
from app.engine.events import Failed, Finished
from app.engine.logits_processors import LogitBias, logit_bias
from app.engine.sampling import NoTokenAllowed, RequestSampler, SamplingParams


def logits(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("params", [
    dict(temperature=1e-300, top_p=0.5),
    dict(temperature=1e-300, top_p=0.5, min_p=1.0, top_k=1),
    dict(temperature=1.0, repetition_penalty=1e-300, top_p=0.5),
    dict(temperature=2.0, repetition_penalty=1e-300, presence_penalty=2, frequency_penalty=2),
    dict(temperature=0, repetition_penalty=1e-300),
])
def test_extreme_values_still_give_a_token(params):
    values = logits([3.0, -2.0, 5.0, 0.5, -1e30, 1e30])
    for seed in range(5):
        sampler = RequestSampler(SamplingParams(seed=seed, top_logprobs=2, **params))
        sampler.observe([0, 1, 2, 3, 4, 5])  # every token seen: the penalties bite
        for _ in range(3):
            choice = sampler.next_token(values)
            assert 0 <= choice.id < 6 and not math.isnan(choice.logprob)


def test_tiny_temperature_is_greedy():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for seed in range(5):
        sampler = RequestSampler(SamplingParams(temperature=1e-300, top_k=0, top_p=1.0, seed=seed))
        assert sampler.next_token(values).id == int(torch.argmax(values))


@pytest.mark.parametrize("bad", [dict(temperature=math.nan), dict(temperature=math.inf),
                                 dict(top_p=math.nan), dict(presence_penalty=math.inf),
                                 dict(repetition_penalty=math.nan)])
def test_non_finite_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bias_bans_and_forces():
    values = logits([5.0, 4.0, 3.0, 2.0])
    banned = RequestSampler(SamplingParams(temperature=0, logits_processors=(logit_bias({0: -100}),)))
    assert banned.next_token(values).id == 1
    nudged = RequestSampler(SamplingParams(temperature=0, logits_processors=(logit_bias({3: 3.5}),)))
    assert nudged.next_token(values).id == 3
    for seed in range(20):  # +100 forces, whatever the sample
        forced = RequestSampler(SamplingParams(temperature=2.0, top_k=0, seed=seed,
                                               logits_processors=(logit_bias({2: 100, 3: 100}),)))
        assert forced.next_token(values).id in (2, 3)


def test_bias_keeps_the_reported_logprobs_of_the_model():
    values = logits([5.0, 4.0, 3.0, 2.0])
    sampler = RequestSampler(SamplingParams(temperature=0, top_logprobs=1,
                                            logits_processors=(logit_bias({0: -100}),)))
    choice = sampler.next_token(values)
    assert choice.id == 1
    assert choice.logprob == pytest.approx(float(torch.log_softmax(values, -1)[1]))
    assert values.tolist() == [5.0, 4.0, 3.0, 2.0]  # the caller's row is left alone


@pytest.mark.parametrize("bias", [{0: 101}, {0: -100.5}, {-1: 5}, {0: math.nan}])
def test_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError):
        LogitBias(bias)


def test_everything_banned_raises_for_the_request():
    sampler = RequestSampler(SamplingParams(temperature=0.7,
                                            logits_processors=(logit_bias({0: -100, 1: -100}),)))
    with pytest.raises(NoTokenAllowed):
        sampler.next_token(logits([1.0, 2.0]))


def test_processors_see_what_was_generated():
    seen: list[list[int]] = []

    def make():
        def process(generated, row):
            seen.append(list(generated))
            return row
        return process

    sampler = RequestSampler(SamplingParams(temperature=0, logits_processors=(make,)))
    for _ in range(3):
        sampler.next_token(logits([0.0, 1.0]))
    assert seen == [[], [1], [1, 1]]


def test_a_request_left_without_tokens_fails_alone(tiny):
    engine = Engine(tiny, EngineConfig(kv_tokens=4096))
    ban_all = logit_bias({t: -100 for t in range(tiny.vocab_size)})
    doomed = engine.submit([2, 818, 5279], SamplingParams(max_tokens=4, temperature=0.5,
                                                          logits_processors=(ban_all,)))
    fine = engine.submit([2, 818, 1234], SamplingParams(max_tokens=4, temperature=0))
    ends: dict[str, object] = {}
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, (Finished, Failed)):
                ends[event.request_id] = event
    assert isinstance(ends[doomed], Failed) and "no token is allowed" in ends[doomed].message
    assert isinstance(ends[fine], Finished) and ends[fine].usage.completion_tokens == 4
    engine.check_integrity()
