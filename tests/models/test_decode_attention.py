"""The decode step's attention in one compiled call (app/models/decode_attention.py): what it
writes into the KV copies and what it returns, against a float64 reference; batching and
threads change no bit; bad tables and shapes are refused before the kernel runs."""

from __future__ import annotations

import pytest
import torch

from app.models import decode_attention as A
from app.models import int8_products

pytestmark = pytest.mark.skipif(not int8_products.available(),
                                reason=f"the compiled kernels cannot run here ({int8_products.unavailable_reason()})")

LAYERS = 3


def _case(N: int, H: int, Hkv: int, D: int, dtype: torch.dtype, qk_norm: bool, seed: int = 0,
          capacity: int = 300):
    gen = torch.Generator().manual_seed(seed)
    datas = [torch.randn(LAYERS, 2, Hkv, capacity, D, generator=gen).to(dtype) for _ in range(N)]
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=gen)
    cos, sin = torch.randn(N, D, generator=gen), torch.randn(N, D, generator=gen)
    norm = torch.randn(H + Hkv, D, generator=gen) if qk_norm else torch.empty(0)
    return datas, qkv, cos, sin, norm


def _call(qkv, cos, sin, norm, datas, layer, starts, firsts, seens, H, Hkv, D, half, threads=None):
    plan = A.plan(datas, starts, firsts, seens, [layer], H, Hkv, D)
    return torch.ops.ferrox.decode_attention(qkv, cos, sin, norm, plan.tables[0], H, Hkv, D, half,
                                             plan.kind, plan.longest, threads or plan.threads,
                                             1e-6, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, Hkv, D, half, qk_norm", [
    (9, 3, 64, False, False),   # SmolLM2's heads, interleaved RoPE
    (4, 1, 256, True, True),    # Gemma 3 270M's: rotate-half, QK-norm
    (8, 8, 32, True, False),    # one query head a KV head
])
def test_it_writes_and_attends_as_the_float64_reference(dtype, H, Hkv, D, half, qk_norm):
    N = 3
    datas, qkv, cos, sin, norm = _case(N, H, Hkv, D, dtype, qk_norm, capacity=1300)
    expected_datas = [d.clone() for d in datas]
    # seen 1, an odd count, and a sliding window's slice of three parts (`PART_KEYS`) merged
    starts, firsts, seens = [0, 37, 1250], [0, 0, 200], [1, 38, 1051]
    got = _call(qkv, cos, sin, norm, datas, 1, starts, firsts, seens, H, Hkv, D, half)
    want = A.reference(qkv, cos, sin, norm, expected_datas, 1, starts, firsts, seens, H, Hkv, D,
                       half, 1e-6, 0.125)
    assert got.shape == (N, H * D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    for written, expected in zip(datas, expected_datas):
        # float32 arithmetic rounded once against float64's: one unit in the last place of
        # the copy's dtype at most, and that rarely (a value on a rounding boundary)
        ulp = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(written.float(), expected.float(), rtol=ulp, atol=1e-6)
        assert (written != expected).float().mean() < (0.05 if dtype == torch.float32 else 0.002)


def test_a_sequence_alone_equals_it_batched_bit_for_bit_and_threads_change_nothing():
    H, Hkv, D, N = 9, 3, 64, 4
    datas, qkv, cos, sin, norm = _case(N, H, Hkv, D, torch.bfloat16, False, seed=1, capacity=2100)
    starts, firsts, seens = [10, 2000, 700, 55], [0, 0, 0, 0], [11, 2001, 701, 56]
    copies = [d.clone() for d in datas]
    batched = _call(qkv, cos, sin, norm, datas, 2, starts, firsts, seens, H, Hkv, D, False, threads=1)
    threaded = _call(qkv, cos, sin, norm, copies, 2, starts, firsts, seens, H, Hkv, D, False, threads=2)
    assert torch.equal(batched, threaded)
    for i in range(N):
        alone = _call(qkv[i:i + 1].contiguous(), cos[i:i + 1].contiguous(), sin[i:i + 1].contiguous(),
                      norm, [datas[i]], 2, [starts[i]], [firsts[i]], [seens[i]], H, Hkv, D, False)
        assert torch.equal(alone[0], batched[i])


def test_a_plan_holds_every_layer_and_picks_threads_by_work():
    H, Hkv, D = 9, 3, 64
    datas, *_ = _case(2, H, Hkv, D, torch.bfloat16, False, capacity=1200)
    plan = A.plan(datas, [3, 4], [0, 0], [4, 5], [0, 2], H, Hkv, D)
    assert len(plan.tables) == 2 and plan.kind == A.KV_KINDS[torch.bfloat16] and plan.longest == 5
    assert plan.threads == 1  # a few keys: no parallel region
    step = datas[1].stride(0) * datas[1].element_size()
    assert int(plan.tables[1][1, 0]) - int(plan.tables[0][1, 0]) == 2 * step
    long = A.plan(datas, [1100, 4], [0, 0], [1101, 5], [0], H, Hkv, D)
    assert long.threads == (torch.get_num_threads() if int8_products.kernel().threaded else 1)


@pytest.mark.parametrize("bad", ["start past the copy", "seen past the copy", "no keys", "layer",
                                 "dtypes differ", "float16", "heads"])
def test_a_plan_refuses_what_would_read_or_write_outside_a_copy(bad):
    H, Hkv, D = 9, 3, 64
    datas, *_ = _case(2, H, Hkv, D, torch.bfloat16, False, capacity=100)
    starts, firsts, seens, layers = [5, 6], [0, 0], [6, 7], [1]
    if bad == "start past the copy":
        starts = [100, 6]
    elif bad == "seen past the copy":
        firsts, seens = [50, 0], [51, 7]
    elif bad == "no keys":
        seens = [0, 7]
    elif bad == "layer":
        layers = [LAYERS]
    elif bad == "dtypes differ":
        datas[1] = datas[1].float()
    elif bad == "float16":  # (not compiled: such a copy attends through SDPA)
        datas = [d.half() for d in datas]
    else:
        Hkv = 2
    with pytest.raises(ValueError):
        A.plan(datas, starts, firsts, seens, layers, H, Hkv, D)


def test_the_call_refuses_shapes_that_do_not_match_its_table():
    H, Hkv, D = 9, 3, 64
    datas, qkv, cos, sin, norm = _case(2, H, Hkv, D, torch.bfloat16, False)
    plan = A.plan(datas, [5, 6], [0, 0], [6, 7], [1], H, Hkv, D)
    args = dict(H=H, Hkv=Hkv, D=D, half=False, kind=plan.kind, longest=plan.longest, threads=1,
                eps=1e-6, scale=0.125)
    with pytest.raises(ValueError):  # one sequence's row against a table of two
        A.attend(qkv[:1].contiguous(), cos[:1].contiguous(), sin[:1].contiguous(), norm, plan.tables[0], **args)
    with pytest.raises(ValueError):  # heads of 48: not whole blocks of 32 lanes
        A.attend(qkv, cos, sin, norm, plan.tables[0], **(args | {"D": 48}))
    with pytest.raises(ValueError):  # a QK-norm weight of the wrong size
        A.attend(qkv, cos, sin, torch.ones(3, D), plan.tables[0], **args)
    with pytest.raises(ValueError):
        A.attend(qkv, cos, sin, norm, plan.tables[0].float(), **args)
