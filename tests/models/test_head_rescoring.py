"""A screened head's exact logits, compiled (app/models/head_rescoring.py): each candidate's
dot product with x read from its raw Q8_0 blocks, against a float64 reference; which other
candidates or threads share the call changes no bit; bad ids and rows are refused before the
kernel runs; the screened head uses it for Q8_0 rows; the candidates' compiled selection is
numpy's comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as T

from app.models import head_rescoring as R
from app.models import int8_products

pytestmark = pytest.mark.skipif(not int8_products.available(),
                                reason=f"the compiled kernels cannot run here ({int8_products.unavailable_reason()})")


def _rows(vocab: int, width: int, seed: int) -> torch.Tensor:
    values = np.random.default_rng(seed).standard_normal((vocab, width)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.quantize(values, T.Q8_0)))


@pytest.mark.parametrize("width", [32, 576, 640])
def test_each_candidate_is_its_rows_product_with_x(width):
    rows = _rows(3000, width, seed=1)
    x = torch.randn(width, generator=torch.Generator().manual_seed(2)) * 3
    ids = torch.tensor([0, 2999, 17, 17, 1500])
    got = R.rescore(x, rows, ids)
    want = R.reference(x, rows, ids)
    assert got.dtype == torch.float32 and got.shape == (5,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # ... which is the dequantized row's product, as the torch path computes it
    from app.models.dequant import dequantize_rows

    torch.testing.assert_close(got, dequantize_rows(rows.index_select(0, ids), T.Q8_0, width) @ x,
                               rtol=1e-5, atol=1e-5)


def test_other_candidates_and_threads_change_no_bit():
    rows = _rows(5000, 640, seed=3)
    x = torch.randn(640, generator=torch.Generator().manual_seed(4))
    ids = torch.randperm(5000, generator=torch.Generator().manual_seed(5))[:1024]  # threaded
    assert ids.numel() * 640 >= R._PARALLEL_WORK
    together = R.rescore(x, rows, ids)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = R.rescore(x, rows, ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for start in (0, 333, 1000):
        assert torch.equal(R.rescore(x, rows, ids[start:start + 7]), together[start:start + 7])
    assert R.rescore(x, rows, torch.empty(0, dtype=torch.int64)).shape == (0,)


def test_rows_of_x_in_one_call_are_each_rows_own_call():
    rows = _rows(4000, 576, seed=9)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(10))
    gen = torch.Generator().manual_seed(11)
    chosen = [torch.randint(0, 4000, (n,), generator=gen) for n in (300, 1, 0, 450)]
    ids = torch.cat(chosen)
    which = torch.repeat_interleave(torch.tensor([len(c) for c in chosen]))
    together = R.rescore(x, rows, ids, which)
    assert torch.equal(together, torch.cat([R.rescore(x[r], rows, c) for r, c in enumerate(chosen)]))
    torch.testing.assert_close(together.double(), R.reference(x, rows, ids, which), rtol=1e-5, atol=1e-6)


def test_bad_ids_and_rows_are_refused():
    rows = _rows(100, 64, seed=6)
    x = torch.randn(64)
    with pytest.raises(ValueError, match="outside"):
        R.rescore(x, rows, torch.tensor([3, 100]))
    with pytest.raises(ValueError, match="outside"):
        R.rescore(x, rows, torch.tensor([-1]))
    with pytest.raises(ValueError, match="Q8_0 rows"):
        R.rescore(torch.randn(96), rows, torch.tensor([0]))
    with pytest.raises(ValueError, match="whole blocks"):
        R.rescore(torch.randn(2, 48), rows, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="need `which`"):
        R.rescore(torch.randn(2, 64), rows, torch.tensor([0]))
    with pytest.raises(ValueError, match="row outside x"):
        R.rescore(torch.randn(2, 64), rows, torch.tensor([0, 1]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="one row of x a candidate"):
        R.rescore(torch.randn(2, 64), rows, torch.tensor([0, 1]), torch.tensor([0]))


def test_the_ids_at_least_a_rows_threshold_are_numpys():
    gen = torch.Generator().manual_seed(12)
    values = torch.randn(5, 4096, generator=gen)
    values[1, ::5] = float("nan")
    values[2, ::3] = -math.inf
    values[3] = 0.25  # every value equal to the threshold: all of them, `cap` stored
    least = torch.tensor([1.5, 1.0, -math.inf, 0.25, math.nan])
    ids, counts = R.select_at_least(values, least, 300)
    for r in range(5):
        want = np.flatnonzero(values[r].numpy() >= least[r].item())
        assert int(counts[r]) == want.size, r
        stored = min(want.size, 300)
        assert np.array_equal(ids[r, :stored].numpy(), want[:stored]), r
    assert int(counts[3]) == 4096 and int(counts[4]) == 0  # NaN: never at least
    one_thread = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        again = R.select_at_least(values, least, 300)
    finally:
        torch.set_num_threads(one_thread)
    assert torch.equal(again[1], counts) and all(
        torch.equal(again[0][r, :min(int(c), 300)], ids[r, :min(int(c), 300)]) for r, c in enumerate(counts))


def test_bad_selections_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        R.select_at_least(torch.zeros(2, 12), torch.zeros(2), 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        R.select_at_least(torch.zeros(2, 16, dtype=torch.float64), torch.zeros(2), 4)
    with pytest.raises(ValueError, match="one threshold a row"):
        R.select_at_least(torch.zeros(2, 16), torch.zeros(3), 4)
    with pytest.raises(ValueError, match="room for an id"):
        R.select_at_least(torch.zeros(2, 16), torch.zeros(2), 0)


def test_a_screened_q8_0_head_rescores_here(monkeypatch):
    import app.models.quantized as quantized
    from app.models.layers import WeightFormat, linear
    from app.models.quantized import RawTensor

    monkeypatch.setattr(quantized, "SCREEN_MIN_ROWS", 1)
    calls = []
    real = R.rescore
    monkeypatch.setattr(R, "rescore", lambda *a: calls.append(1) or real(*a))
    vocab, width = 4096, 128
    raw = RawTensor(_rows(vocab, width, seed=7), T.Q8_0, (vocab, width))
    head = WeightFormat(torch.float16, False, None, True, torch.bfloat16).prepare(raw, output=True)
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(8))
    got = linear(x, head, False)
    assert len(calls) == 1  # both rows of logits in one call
    exact = x @ raw.dequantize().t()
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
