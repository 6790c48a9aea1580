from __future__ import annotations

import math

import pytest
import torch

from app.engine.sampling import RequestSampler, SamplingParams


def logits(values):
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_takes_the_argmax():
    s = RequestSampler(SamplingParams(temperature=0))
    assert s.next_token(logits([0.1, 3.0, 2.0])).id == 1


def test_top_k_one_is_greedy_whatever_the_seed():
    for seed in range(5):
        s = RequestSampler(SamplingParams(temperature=1.5, top_k=1, seed=seed))
        assert s.next_token(logits([0.1, 3.0, 2.9])).id == 1


def test_top_p_and_min_p_cut_the_tail():
    values = logits([5.0, 4.9, -5.0, -5.0])
    for seed in range(30):
        p = SamplingParams(temperature=1.0, top_k=0, top_p=0.5, seed=seed)
        assert RequestSampler(p).next_token(values).id == 0  # 0 alone holds >= 50%
        p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=seed)
        assert RequestSampler(p).next_token(values).id in (0, 1)


def test_sampling_follows_the_distribution():
    counts = [0, 0]
    for seed in range(400):
        s = RequestSampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed))
        counts[s.next_token(logits([0.0, 1.0986])).id] += 1  # p = 0.25 / 0.75
    assert 0.18 < counts[0] / 400 < 0.32


def test_same_seed_same_tokens():
    p = SamplingParams(temperature=1.0, top_k=0, seed=42)
    values = torch.randn(1000)
    a, b = RequestSampler(p), RequestSampler(p)
    assert [a.next_token(values).id for _ in range(5)] == [b.next_token(values).id for _ in range(5)]


def test_penalties_push_seen_tokens_down():
    s = RequestSampler(SamplingParams(temperature=0, repetition_penalty=2.0))
    s.observe([0])
    assert s.next_token(logits([2.0, 1.5])).id == 1
    s = RequestSampler(SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5))
    s.observe([0, 0])
    assert s.next_token(logits([2.5, 1.0])).id == 1  # 2.5 - 1 - 2*0.5 = 0.5 < 1.0


def test_logprobs_are_of_the_model_distribution():
    s = RequestSampler(SamplingParams(temperature=0, top_logprobs=2))
    choice = s.next_token(logits([0.0, 0.0, 0.0, 0.0]))
    assert choice.logprob == pytest.approx(-1.3862944)
    assert len(choice.top) == 2


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0),
                                 dict(min_p=2), dict(top_k=-1), dict(repetition_penalty=0),
                                 dict(top_logprobs=50)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("top_p,min_p", [(0.9, 0.0), (0.8, 0.0), (1.0, 0.05), (0.95, 0.01)])
def test_top_k_off_draws_what_a_full_sort_draws(top_p, min_p):
    """With top-k off, top-p/min-p cut a short list of the best candidates instead of sorting
    the vocabulary; the draws equal those after a sort of all but the one worst token. (A
    cut thousands of tokens deep, top_p 0.999 on flat scores, lands within float32 rounding
    of the mass: a few dozen near-zero tokens either way, as any two summation orders do.)"""
    vocab, g = 49_152, torch.Generator().manual_seed(7)
    probe = RequestSampler(SamplingParams(temperature=0.8, top_k=0, top_p=top_p, min_p=min_p, seed=3))
    full = RequestSampler(SamplingParams(temperature=0.8, top_k=vocab - 1, top_p=top_p, min_p=min_p,
                                         seed=3))
    for step in range(40):
        # Peaked like a language model's scores, some steps flatter than others.
        logits = torch.randn(vocab, generator=g) * (2 + step % 5)
        logits[-1] = -1e4  # the token the reference's top-k leaves out
        assert probe.next_token(logits.clone()).id == full.next_token(logits.clone()).id, step


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_nan_and_infinite_logits_from_a_broken_model_still_give_a_token(temperature):
    """NaN counts as a banned token and +inf as the largest float (the favourite), wherever
    they sit, greedy or sampled."""
    nan, inf = float("nan"), float("inf")
    for values in ([0.5, nan, 2.0], [nan, 0.5, 2.0, nan], [0.5, inf, 2.0, nan], [-inf, nan, 1.0]):
        for seed in range(3):
            choice = RequestSampler(SamplingParams(temperature=temperature, seed=seed)
                                    ).next_token(logits(values))
            assert values[choice.id] == values[choice.id]  # never a NaN one
            if inf in values:
                assert choice.id == values.index(inf)
            elif temperature == 0:
                assert choice.id == max((v, i) for i, v in enumerate(values) if v == v)[1]


def test_only_nan_logits_allow_no_token():
    from app.engine.sampling import NoTokenAllowed

    with pytest.raises(NoTokenAllowed):
        RequestSampler(SamplingParams(temperature=0)).next_token(logits([float("nan")] * 3))


@pytest.mark.parametrize("vocab", [1_024, 32_000, 49_152, 262_151])
def test_greedy_over_a_large_vocabulary_takes_the_first_best(vocab):
    """The maximum is taken in blocks (and a vocabulary's last partial block apart): ties
    still go to the first, as argmax's do, wherever the tied entries sit."""
    values = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab))
    for where in ([5], [vocab - 1], [700, vocab - 3], [vocab // 2, 17], [511, 512]):
        tied = values.clone()
        tied[where] = 9.0
        assert RequestSampler(SamplingParams(temperature=0)).next_token(tied).id == min(where)


@pytest.mark.parametrize("vocab", [32_000, 49_152])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_nan_anywhere_in_a_large_vocabulary_is_a_banned_token(vocab, temperature):
    """A NaN in any block, or in the last partial one, is seen (and banned) as one max over
    the whole vocabulary sees it."""
    for nan_at in (3, vocab // 2, vocab - 1):
        values = torch.randn(vocab, generator=torch.Generator().manual_seed(nan_at))
        values[100] = 60.0
        values[nan_at] = float("nan")
        choice = RequestSampler(SamplingParams(temperature=temperature, seed=1)).next_token(values)
        assert choice.id == 100


@pytest.mark.parametrize("vocab", [1_000, 49_152, 262_144])
@pytest.mark.parametrize("k", [1, 64, 256, 2_048])
def test_the_top_k_through_candidates_is_torchs_top_k(vocab, k):
    """`_top` (a sampled threshold, then the candidates' top k) against torch's topk over
    the whole row: the same values in the same order, and each id holds its value; on rows
    like a model's, with ties, with -inf (banned tokens), and on rows unlike their sample."""
    from app.engine.sampling import _top

    g = torch.Generator().manual_seed(vocab + k)
    rows = [torch.randn(vocab, generator=g) * 3,
            torch.randint(0, 7, (vocab,), generator=g).float(),  # many equal values
            torch.full((vocab,), -math.inf)]
    rows[2][torch.randperm(vocab, generator=g)[:k // 2 + 1]] = 1.0  # mostly banned
    spiky = torch.zeros(vocab)
    spiky[1::997] = torch.arange(1, len(range(1, vocab, 997)) + 1).float()  # off the sample's stride
    rows.append(spiky)
    sampled_high = torch.zeros(vocab)
    sampled_high[::max(1, vocab // 1024)] = 5.0  # the sample is all the row's best: the whole row
    rows.append(sampled_high)
    for row in rows:
        values, ids = _top(row, k)
        expected = torch.topk(row, min(k, vocab)).values
        assert torch.equal(values, expected)
        assert torch.equal(row[ids], values) and ids.unique().numel() == ids.numel()


def test_penalties_reach_every_seen_token():
    """Seen tokens are kept in buffers that grow: the 500th distinct token is penalised too,
    and a token seen twice counts twice."""
    s = RequestSampler(SamplingParams(temperature=0, frequency_penalty=1.0))
    s.observe(range(500))
    s.observe([499])
    values = torch.zeros(1000)
    values[:499] = 1.5  # seen once: 1.5 - 1.0 = 0.5
    values[499] = 2.5  # seen twice: 2.5 - 2 * 1.0 = 0.5
    values[500] = 0.6  # unseen: the best once every seen token is pushed down
    assert s.next_token(values).id == 500
