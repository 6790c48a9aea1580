"""The measured CPU weight policy: what it picks from timings, and its cache."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from app.engine import kernel_policy as kp
from app.engine.device import DeviceError, plan_load
from app.models import int8_products
from app.models.quantized import int4_kernel_available

_TORCH_VERSION = torch.__version__
# Small shapes so a real measurement takes a fraction of a second: two layers, as a float load
# runs them (Q, K, V joined; O; gate and up joined; down) and as a 4-bit load does (Q and K
# joined with two planes, V staying a float, one down 4-bit and one float).
TINY = kp.ModelShapes("tiny", {(192, 64): 2, (64, 64): 2, (256, 64): 2, (64, 128): 2}, (512, 64),
                      {(128, 64, 2): 2, (64, 64, 0): 2, (64, 64, 1): 2, (256, 64, 1): 2,
                       (64, 128, 1): 1, (64, 128, 0): 1}, 2)


# What nothing measured gives TINY, a model with 4-bit products (`default_policy`; pinned down
# by the tests of the default below).
def tiny_default() -> str:
    """(A function: which 4-bit kind it decodes with depends on whether this process has the
    8-bit activation kernel ready, which a test may have compiled since.)"""
    return kp.default_policy("", TINY).label


def _m(decode, prefill, spread=0.0) -> kp.Measurement:
    return kp.Measurement(decode, prefill, {k: spread for k in decode}, {k: spread for k in prefill})


def test_the_fastest_kind_per_product_is_chosen_and_explained():
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    policy = kp.choose(_m(decode, prefill), TINY)
    assert (policy.decode, policy.prefill) == ("int4_bf16", "bfloat16")
    assert policy.label == "int4_bf16 decode, bfloat16 prefill"
    assert "2.0 ms with int4_bf16" in policy.reason and "float16 3.0 ms" in policy.reason
    assert kp.cpu_identity() in policy.reason and "noise 0%" in policy.reason


def test_an_avx2_like_machine_gets_float16_not_bfloat16():
    """Timings shaped like the AVX2-only EPYC's: bfloat16 has no fast kernel there."""
    decode = {"float32": 60.0, "bfloat16": 90.0, "float16": 30.0, "int4_bf16": 45.0, "int4_f32": 200.0}
    prefill = {"float32": 80.0, "bfloat16": 400.0, "float16": 90.0, "int4_bf16": 500.0}
    policy = kp.choose(_m(decode, prefill, 0.02), TINY)
    assert (policy.decode, policy.prefill) == ("float16", "float32")
    fmt, wide = policy.weight_format(torch.device("cpu"), file_bytes=200 * 2**20)
    assert (fmt.dtype, fmt.wide_dtype, fmt.int4, wide) == (torch.float16, torch.float32, False,
                                                           torch.float32)


def test_a_kind_is_chosen_only_when_faster_than_the_default_beyond_noise():
    """bfloat16 listed and a hair faster is not enough: the default float16 stays."""
    decode = {"float32": 60.0, "bfloat16": 29.0, "float16": 30.0, "int4_bf16": 29.5, "int4_f32": 90.0}
    prefill = {"float32": 95.0, "bfloat16": 88.0, "float16": 100.0, "int4_bf16": 300.0}
    policy = kp.choose(_m(decode, prefill, 0.15), TINY)
    assert (policy.decode, policy.prefill) == ("float16", "float16")
    assert "not faster beyond noise" in policy.reason and "noise 15%" in policy.reason
    # The same bfloat16 figure with steady timings does win.
    assert kp.choose(_m(decode, prefill, 0.01), TINY).prefill == "bfloat16"


def test_an_int4_decode_never_leaves_the_prefill_to_other_4bit_planes():
    decode = {"float32": 9.0, "bfloat16": 9.0, "float16": 8.0, "int4_bf16": 6.0, "int4_f32": 2.0}
    prefill = {"float32": 50.0, "bfloat16": 30.0, "float16": 40.0, "int4_bf16": 10.0}
    policy = kp.choose(_m(decode, prefill), TINY)
    assert (policy.decode, policy.prefill) == ("int4_f32", "bfloat16")


def test_kinds_that_fail_quality_or_do_not_fit_are_never_chosen(monkeypatch):
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 1.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    no_blocks = kp.ModelShapes("f16 model", TINY.layers, TINY.head,
                               {(n, k, 0): c for (n, k), c in TINY.layers.items()}, 0)
    assert no_blocks.int4_fraction == 0
    assert kp.choose(_m(decode, prefill), no_blocks).decode == "float16"
    monkeypatch.setattr(kp, "FAILS_QUALITY", frozenset({"int4_bf16", "float16"}))
    assert kp.choose(_m(decode, prefill), TINY).decode == "bfloat16"


def test_int4_decode_with_a_float_prefill_keeps_a_wide_copy_for_small_models_only():
    policy = kp.Policy("int4_bf16", "bfloat16", "x", "y",
                       {"float32": 3.0, "bfloat16": 2.0, "float16": 1.0, "int4_bf16": 0.5},
                       {"float32": 3.0, "bfloat16": 1.0, "float16": 2.0, "int4_bf16": 4.0})
    fmt, _ = policy.weight_format(torch.device("cpu"), file_bytes=300 * 2**20)
    assert fmt.int4 and fmt.int4_act_dtype == torch.bfloat16 and fmt.int4_wide_dtype == torch.bfloat16
    assert (fmt.dtype, fmt.wide_dtype) == (torch.float16, torch.bfloat16)  # weights that do not fit
    big, _ = policy.weight_format(torch.device("cpu"), file_bytes=4 * 2**30)
    assert big.int4 and big.int4_wide_dtype is None and big.wide_dtype is None


def test_an_int8_activation_decode_loads_its_kernels_codes_and_times_them():
    """`int4_i8`: 4-bit weights on the 8-bit activation kernel where it takes them (inputs
    whole pairs of blocks), torch's kernel with bfloat16 activations elsewhere."""
    from app.models.int8_products import Int8Codes
    from app.models.quantized import Int4Codes

    policy = kp.Policy("int4_i8", "float16", "x", "y", {"float16": 1.0, "int4_i8": 0.5},
                       {"float16": 1.0, "int4_i8": 2.0})
    fmt, _ = policy.weight_format(torch.device("cpu"), file_bytes=300 * 2**20)
    assert fmt.int4 and fmt.int8_acts and fmt.int4_act_dtype == torch.bfloat16
    assert fmt.label.startswith("int4(int8")
    gen = torch.Generator().manual_seed(0)
    fits, _ = kp._weight("int4_i8", 64, 128, 2, gen)
    assert isinstance(fits.codes, Int8Codes) and fits.act_dtype == torch.float32
    odd, _ = kp._weight("int4_i8", 64, 96, 1, gen)
    assert isinstance(odd.codes, Int4Codes) and odd.act_dtype == torch.bfloat16
    assert kp._nbytes(kp._copy(fits)) == kp._nbytes(fits)


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_a_real_measurement_times_every_kind_interleaved(monkeypatch):
    order = []  # one thread wake-up probe before each timing
    probe = kp._probe_ms
    monkeypatch.setattr(kp, "_probe_ms", lambda: order.append(1) or probe())
    m = kp.measure(TINY, reps=3, busy=lambda: False)
    assert set(m.decode_ms) == set(kp.KINDS) and set(m.prefill_ms) == set(kp.PREFILL_KINDS)
    assert all(ms > 0 for ms in [*m.decode_ms.values(), *m.prefill_ms.values()])
    # The first repetition times every kind once, later ones every kind that can still win.
    assert kp.DEFAULT not in m.timed_once
    if m.stalled > kp.STALLED_MAX:  # a machine whose cores are taken: it stops after one
        assert len(order) == len(kp.KINDS)
    else:
        assert len(order) == len(kp.KINDS) + 2 * (len(kp.KINDS) - len(m.timed_once))
    assert all(s >= 0 for s in m.decode_spread.values())
    assert 0 <= m.stalled <= 1 and (m.stall_ms > kp.STALL_MS) == (m.stalled > 0)


def _with_kv(m: kp.Measurement, decode: dict, prefill: dict, spread: float = 0.0) -> kp.Measurement:
    return dataclasses.replace(m, kv_ms=decode, kv_prefill_ms=prefill,
                               kv_spread={k: spread for k in decode})


_WEIGHTS = ({"float32": 5.0, "float16": 3.0, "int4_bf16": 2.0}, {"float32": 50.0, "float16": 40.0})
_KV_FASTER = ({"float32": 10.0, "bfloat16": 7.0}, {"float32": 4.0, "bfloat16": 2.0})


@pytest.mark.parametrize("decode, prefill, spread, expected", [
    (*_KV_FASTER, 0.02, "bfloat16"),
    ({"float32": 10.0, "bfloat16": 9.7}, {"float32": 4.0, "bfloat16": 3.9}, 0.02, "float32"),  # a hair
    ({"float32": 10.0, "bfloat16": 8.5}, {"float32": 4.0, "bfloat16": 3.5}, 0.20, "float32"),  # noise
    # Faster decode, but a prefill chunk's attention much slower (as bfloat16 without
    # AVX-512-BF16): 5 ms more is 12.5% of the 40 ms chunk
    (_KV_FASTER[0], {"float32": 4.0, "bfloat16": 9.0}, 0.02, "float32"),
    # Faster decode, a chunk's attention slower beyond noise but by 1% of the chunk (torch's
    # AVX2 kernels on a 2-core Xeon: 6.5 / 9.7 ms a step, 7.5 / 7.1 ms a chunk): taken
    (_KV_FASTER[0], {"float32": 4.0, "bfloat16": 4.4}, 0.02, "bfloat16"),
    ({"float32": 10.0, "bfloat16": 5.0}, _KV_FASTER[1], 0.40, "float32"),  # erratic
    # Decode alike (sliding layers read few positions), prefill chunks much faster: taken
    ({"float32": 5.0, "bfloat16": 4.9}, {"float32": 7.2, "bfloat16": 2.0}, 0.10, "bfloat16"),
    # ... but not when decode is slower beyond the noise
    ({"float32": 5.0, "bfloat16": 6.0}, {"float32": 7.2, "bfloat16": 2.0}, 0.02, "float32"),
])
def test_the_kv_cache_is_bfloat16_only_when_measured_faster_beyond_noise(decode, prefill, spread,
                                                                         expected):
    policy = kp.choose(_with_kv(_m(*_WEIGHTS), decode, prefill, spread), TINY)
    assert policy.kv == expected and policy.kv_ms == decode
    assert ("bfloat16 KV" in policy.label) == (expected == "bfloat16")
    assert f"KV cache {expected}" in policy.reason and "2,048 positions" in policy.reason
    assert policy.kv_dtype == (torch.bfloat16 if expected == "bfloat16" else None)


def test_without_kv_timings_the_cache_keeps_the_activations_dtype():
    policy = kp.choose(_m(*_WEIGHTS), TINY)  # a model whose attention shape was not read
    assert policy.kv == kp.KV_DEFAULT and policy.kv_dtype is None and "KV" not in policy.reason


def test_a_cached_kv_dtype_loads_and_is_measured_again_only_when_overtaken(tmp_path):
    from app.engine.device import plan_from_policy

    policy = kp.choose(_with_kv(_m(*_WEIGHTS), *_KV_FASTER, 0.02), TINY)
    kp._store(TINY, tmp_path, policy)
    cached = kp.cached_policy(TINY, tmp_path)
    assert cached.kv == "bfloat16" and cached.kv_ms == _KV_FASTER[0]
    assert plan_from_policy(cached, torch.device("cpu"), 100 * 2**20).kv_dtype == torch.bfloat16
    again = lambda decode, prefill: _with_kv(_m(*_WEIGHTS), decode, prefill, 0.02)  # noqa: E731
    assert kp.judge(cached, again({"float32": 10.0, "bfloat16": 7.3}, _KV_FASTER[1]))[0] == kp.HOLDS
    assert kp.judge(cached, again({"float32": 7.0, "bfloat16": 9.5}, _KV_FASTER[1])) == (
        kp.CHANGED, "another kind is now faster beyond noise")
    # A cached float32 cache: bfloat16 overturns it only when its prefill keeps up too.
    f32 = dataclasses.replace(cached, kv="float32")
    assert kp.judge(f32, again(_KV_FASTER[0], {"float32": 4.0, "bfloat16": 9.0}))[0] == kp.HOLDS
    assert kp.judge(f32, again(*_KV_FASTER))[0] == kp.CHANGED
    assert kp._policy_from({**kp.dataclasses.asdict(cached), "kv": "float8"}) is None


def test_a_real_measurement_times_the_kv_dtypes_too():
    shapes = dataclasses.replace(TINY, kv=(2, 4, 2, 16))
    m = kp.measure(shapes, kinds=("float16",), reps=2, busy=lambda: False)
    assert set(m.kv_ms) == set(m.kv_prefill_ms) == set(m.kv_spread) == set(kp.KV_KINDS)
    assert all(ms > 0 for ms in [*m.kv_ms.values(), *m.kv_prefill_ms.values()])
    assert kp.measure(TINY, kinds=("float16",), reps=1, busy=lambda: False).kv_ms == {}


def _with_layout(m: kp.Measurement, per_head: dict, spread: float = 0.0) -> kp.Measurement:
    return dataclasses.replace(m, kv_per_head_ms=per_head,
                               kv_per_head_spread={k: spread for k in per_head})


@pytest.mark.parametrize("per_head, spread, expected", [
    ({"float32": 9.0, "bfloat16": 5.0}, 0.02, True),   # per head faster in the chosen bfloat16
    ({"float32": 9.0, "bfloat16": 6.9}, 0.02, False),  # within the margin: per KV head stays
    ({"float32": 9.0, "bfloat16": 5.0}, 0.40, False),  # beyond its own noise only
    ({"float32": 12.0, "bfloat16": 9.0}, 0.02, False),  # slower (Gemma 3 270M's head size 256)
])
def test_long_decode_steps_ask_per_query_head_only_where_measured_faster(per_head, spread, expected):
    m = _with_layout(_with_kv(_m(*_WEIGHTS), *_KV_FASTER, 0.02), per_head, spread)
    policy = kp.choose(m, TINY)
    assert policy.kv == "bfloat16" and policy.kv_per_head is expected
    assert policy.per_head_from == (kp.PER_HEAD_FROM if expected else None)
    clause = ("decode attention per query head from 1,024 positions" if expected
              else "decode attention per KV head")
    assert clause in policy.reason and f"{per_head['bfloat16']:.1f} against 7.0 ms" in policy.reason


def test_without_shared_kv_heads_there_is_no_layout_to_choose():
    policy = kp.choose(_with_kv(_m(*_WEIGHTS), *_KV_FASTER, 0.02), TINY)  # no per-head timings
    assert policy.kv_per_head is False and policy.per_head_from is None
    assert "query head" not in policy.reason


def test_the_layout_is_cached_planned_and_measured_again_when_overturned(tmp_path):
    from app.engine.device import plan_from_policy

    m = _with_layout(_with_kv(_m(*_WEIGHTS), *_KV_FASTER, 0.02), {"float32": 9.0, "bfloat16": 5.0}, 0.02)
    kp._store(TINY, tmp_path, kp.choose(m, TINY))
    cached = kp.cached_policy(TINY, tmp_path)
    assert cached.kv_per_head is True
    assert plan_from_policy(cached, torch.device("cpu"), 100 * 2**20).per_head_from == kp.PER_HEAD_FROM
    assert kp.judge(cached, m)[0] == kp.HOLDS
    assert kp.judge(cached, _with_layout(m, {"float32": 9.0, "bfloat16": 8.0}, 0.02)) == (
        kp.CHANGED, "another kind is now faster beyond noise")
    assert kp.judge(cached, _with_layout(m, {"float32": 9.0, "bfloat16": 5.0}, 0.5))[0] == kp.UNCLEAR
    per_kv_head = dataclasses.replace(cached, kv_per_head=False)
    assert kp.judge(per_kv_head, m)[0] == kp.CHANGED
    assert plan_from_policy(per_kv_head, torch.device("cpu"), 100 * 2**20).per_head_from is None
    assert kp._policy_from({**dataclasses.asdict(cached), "kv_per_head": "yes"}) is None


def test_a_real_measurement_times_the_per_head_layout_where_heads_share_kv_heads():
    shared = kp.measure(dataclasses.replace(TINY, kv=(2, 4, 2, 16)), kinds=("float16",), reps=2,
                        busy=lambda: False)
    assert set(shared.kv_per_head_ms) == set(shared.kv_per_head_spread) == set(kp.KV_KINDS)
    assert all(ms > 0 for ms in shared.kv_per_head_ms.values())
    one_each = kp.measure(dataclasses.replace(TINY, kv=(2, 2, 2, 16)), kinds=("float16",), reps=1,
                          busy=lambda: False)
    assert one_each.kv_ms and one_each.kv_per_head_ms == {}


def _raising_for(dtype, real):
    def run(self, *args, **kwargs):
        if self.dtype == dtype:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real(self, *args, **kwargs)
    return run


def test_a_kv_dtype_whose_attention_raises_here_is_left_out_and_the_model_loads(monkeypatch,
                                                                               tmp_path):
    """As torch's bfloat16 SDPA does under ATEN_CPU_CAPABILITY=avx2 on an AMX CPU: the
    measurement goes on without it, the cache stays float32, and the reason says why."""
    monkeypatch.setattr(kp._KVRun, "_attend", _raising_for(torch.bfloat16, kp._KVRun._attend))
    shapes = dataclasses.replace(TINY, kv=(2, 4, 2, 16))
    m = kp.measure(shapes, kinds=("float16", "float32"), reps=2, busy=lambda: False)
    assert set(m.kv_ms) == {"float32"} and "pack_vnni2" in m.failed["kv bfloat16"]
    policy = kp.choose(m, shapes)
    assert policy.kv == "float32" and "bfloat16 attention failed here" in policy.reason
    # A cached bfloat16 choice whose attention fails now is measured again.
    cached = dataclasses.replace(policy, kv="bfloat16")
    assert kp.judge(cached, m)[0] == kp.CHANGED


def test_a_weight_kind_whose_kernel_raises_here_is_left_out(monkeypatch):
    real = kp._KindRun.decode_pass

    def decode_pass(self):
        if self is runs.get("bfloat16"):
            raise RuntimeError("no kernel for this CPU")
        return real(self)

    runs = {}
    init = kp._KindRun.__init__

    def remember(self, shapes, kind, *args, **kwargs):
        init(self, shapes, kind, *args, **kwargs)
        runs[kind] = self

    monkeypatch.setattr(kp._KindRun, "__init__", remember)
    monkeypatch.setattr(kp._KindRun, "decode_pass", decode_pass)
    m = kp.measure(TINY, reps=2, busy=lambda: False)
    assert "bfloat16" not in m.decode_ms and "bfloat16" not in m.prefill_ms
    assert "bfloat16" not in m.timed_once and "no kernel" in m.failed["bfloat16"]
    assert {"float32", "float16"} <= set(m.decode_ms)
    policy = kp.choose(m, TINY)
    assert policy.decode != "bfloat16" and "bfloat16 left out" in policy.reason
    cached = dataclasses.replace(policy, decode="bfloat16")
    assert kp.judge(cached, m) == (kp.CHANGED, "bfloat16 failed here now (RuntimeError: no kernel for this CPU)")


def test_when_no_kind_runs_the_default_is_kept_and_says_why(monkeypatch, tmp_path):
    def broken(self):
        raise RuntimeError("broken torch")

    monkeypatch.setattr(kp._KindRun, "decode_pass", broken)
    monkeypatch.setattr(kp._KindRun, "prefill_pass", broken)
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert policy.decode == kp.DEFAULT and "no kind's kernels ran here" in policy.reason
    assert kp.cached_policy(TINY, tmp_path) is None


def test_a_measurement_hands_its_timing_weights_memory_back(monkeypatch):
    """Its weights are garbage once it returns, interrupted or not: the C heap's free pages
    go back to the system (they kept Gemma 3 270M's process 1 GB larger)."""
    released = []
    monkeypatch.setattr(kp, "release_freed_memory", lambda: released.append(1))
    kp.measure(TINY, kinds=("float16",), reps=1, busy=lambda: False)
    assert released == [1]
    assert kp.measure(TINY, kinds=("float16",), reps=1, busy=lambda: True) is None
    assert released == [1, 1]


def test_a_4bit_kind_is_charged_its_float_leftovers_at_the_fastest_float_kind():
    """V and one down stay floats in TINY's 4-bit load: they cost what the fastest float kind
    takes for them, the rest what the 4-bit kernel takes."""
    times = {"float16": {(192, 64, 0): 1.0, (64, 64, 0): 0.5, (256, 64, 0): 2.0, (64, 128, 0): 1.0,
                         kp.HEAD: 1.0},
             "float32": {(192, 64, 0): 2.0, (64, 64, 0): 5.0, (256, 64, 0): 4.0, (64, 128, 0): 2.0,
                         kp.HEAD: 2.0},
             "int4_bf16": {(128, 64, 2): 0.25, (64, 64, 1): 0.125, (256, 64, 1): 0.5,
                           (64, 128, 1): 0.25, kp.HEAD: 0.5}}
    totals = kp._totals(TINY, times, prefill=False)
    assert totals["float16"] == 2 * (1.0 + 0.5 + 2.0 + 1.0) + 1.0  # head scaled: 512 rows timed
    own = 2 * 0.25 + 2 * 0.125 + 2 * 0.5 + 1 * 0.25 + 0.5
    assert totals["int4_bf16"] == own + 2 * 0.5 + 1 * 1.0  # V twice, one down: float16's
    # A prefill has no head.
    assert kp._totals(TINY, times, prefill=True)["int4_bf16"] == own - 0.5 + 2 * 0.5 + 1.0


def test_tune_keeps_a_cached_choice_unless_the_check_says_it_changed(tmp_path, monkeypatch):
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    kp._store(TINY, tmp_path, kp.choose(_m(decode, prefill), TINY))
    for verdict, ending, status in ((kp.HOLDS, "(cached, checked)", kp.CHECKED),
                                    (kp.UNCLEAR, "timings erratic)", kp.CHECK_UNCLEAR)):
        monkeypatch.setattr(kp, "check", lambda *a, v=verdict, **k: (v, "the timings erratic"))
        policy = kp.tune(TINY, tmp_path)
        assert policy.cached and policy.decode == "int4_bf16" and policy.reason.endswith(ending)
        assert policy.status == status
    monkeypatch.setattr(kp, "check", lambda *a, **k: (kp.INTERRUPTED, ""))
    assert kp.tune(TINY, tmp_path) is None
    # Changed, and the re-measurement erratic or stalled: the cached choice is kept, saying so.
    monkeypatch.setattr(kp, "check", lambda *a, **k: (kp.CHANGED, "a drift"))
    for unusable in (_m(decode, prefill, 0.9), dataclasses.replace(_m(decode, prefill), stalled=0.5)):
        monkeypatch.setattr(kp, "measure", lambda *a, u=unusable, **k: u)
        kept = kp.tune(TINY, tmp_path)
        assert kept.cached and kept.status == kp.KEPT and kept.decode == "int4_bf16"
        assert "kept: the check found a drift, but the re-measurement was unusable" in kept.reason
    # Changed: measured again (here float16 wins everything) and the new choice cached.
    monkeypatch.setattr(kp, "measure", lambda *a, **k: _m({**decode, "float16": 1.0},
                                                          {**prefill, "float16": 1.0}, 0.01))
    fresh = kp.tune(TINY, tmp_path)
    assert not fresh.cached and fresh.label == "float16" and fresh.status == kp.MEASURED
    assert fresh.reason.endswith("(measured again: a drift)")
    assert kp.cached_policy(TINY, tmp_path).label == "float16"


def test_a_measurement_being_set_up_gives_way_to_the_engine(monkeypatch):
    # Setting up makes every kind's weights (and copies past the cache): a request arriving
    # then must not share the cores with it until it is done.
    made = []
    weight = kp._weight
    monkeypatch.setattr(kp, "_weight", lambda *a: made.append(a) or weight(*a))
    assert kp.measure(TINY, busy=lambda: True) is None
    assert made == []
    calls = []
    assert kp.measure(TINY, busy=lambda: len(calls) > 3 or calls.append(1)) is None
    assert made and {a[0] for a in made} == {made[0][0]}  # it stopped within the first kind


def test_a_measurement_stops_when_the_engine_gets_work(tmp_path):
    calls = []
    assert kp.measure(TINY, busy=lambda: len(calls) > 2 or calls.append(1)) is None
    assert kp.tune(TINY, tmp_path, busy=lambda: True) is None
    assert not (tmp_path / kp.CACHE_FILE).exists()  # nothing half-measured is kept


def test_erratic_timings_are_never_cached(tmp_path, monkeypatch):
    erratic = _m({"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 1.0, "int4_f32": 9.0},
                 {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}, 0.9)
    calls = []
    monkeypatch.setattr(kp, "measure", lambda *a, **k: calls.append(1) or erratic)
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert "erratic" in policy.reason and policy.label == tiny_default()
    assert len(calls) == kp.MEASURE_TRIES == 2 and "after 2 measurements" in policy.reason
    assert "noise 90%" in policy.reason and "int4_bf16" in policy.reason  # what it saw
    assert kp.cached_policy(TINY, tmp_path) is None


def test_an_erratic_measurement_is_taken_once_more_and_a_steady_one_kept(tmp_path, monkeypatch):
    """One burst on a shared machine must not leave a model on the slow default until its
    next load: the machine is measured again, and a steady second measurement is used."""
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 1.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    tries = iter([_m(decode, prefill, 0.9), _m(decode, prefill, 0.02)])
    calls = []
    monkeypatch.setattr(kp, "measure", lambda *a, **k: calls.append(1) or next(tries))
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert len(calls) == 2 and policy.decode == "int4_bf16" and policy.status == kp.MEASURED
    assert kp.cached_policy(TINY, tmp_path).decode == "int4_bf16"
    # A steady first measurement is not repeated.
    calls.clear()
    monkeypatch.setattr(kp, "measure", lambda *a, **k: calls.append(1) or _m(decode, prefill, 0.02))
    assert kp.measure_and_choose(TINY, tmp_path).decode == "int4_bf16" and len(calls) == 1


def test_the_noise_of_kinds_far_behind_does_not_make_a_measurement_erratic(tmp_path):
    decode = {"float32": 37.0, "bfloat16": 40.0, "float16": 40.0, "int4_bf16": 14.5, "int4_f32": 170.0}
    prefill = {"float32": 300.0, "bfloat16": 100.0, "float16": 320.0, "int4_bf16": 400.0}
    m = kp.Measurement(decode, prefill, {**{k: 0.9 for k in decode}, "int4_bf16": 0.05},
                       {**{k: 0.9 for k in prefill}, "bfloat16": 0.04})
    policy = kp.choose(m, TINY)
    assert policy.decode == "int4_bf16" and policy.prefill == "bfloat16" and policy.noise == 0.05
    # A rival within ERRATIC of the fastest counts, whichever it is.
    near = dataclasses.replace(m, decode_ms={**decode, "float32": 16.0})
    assert kp.choose(near, TINY).noise == 0.9


def test_a_measurement_whose_threads_stalled_is_never_cached(tmp_path, monkeypatch):
    """Figures from a machine whose cores were taken (the stall probe was slow in more than
    STALLED_MAX of the timings) are the scheduler's, however steady: the default is kept."""
    stalled = dataclasses.replace(
        _m({"float32": 38.3, "bfloat16": 2494.0, "float16": 2592.0, "int4_bf16": 3136.0,
            "int4_f32": 3329.0}, {"float32": 4977.0, "bfloat16": 6833.0, "float16": 7437.0,
                                  "int4_bf16": 8277.0}, 0.2), stalled=0.6, stall_ms=8.0)
    monkeypatch.setattr(kp, "measure", lambda *a, **k: stalled)
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert policy.label == tiny_default() and policy.status == kp.NOT_MEASURED
    assert "threads waited for cores other programs held in 60% of the timings" in policy.reason
    assert "(waking them took 8.0 ms there" in policy.reason
    assert kp.cached_policy(TINY, tmp_path) is None
    steady = dataclasses.replace(stalled, stalled=kp.STALLED_MAX)  # at the bar: used
    assert kp.unusable(steady) is None


def test_a_measurement_past_its_budget_keeps_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(kp, "BUDGET_S", 0.0)
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert policy.label == tiny_default() and "busy machine" in policy.reason
    assert kp.cached_policy(TINY, tmp_path) is None


def test_a_cached_choice_is_kept_while_a_re_timing_agrees():
    policy = kp.Policy("int4_bf16", "bfloat16", "x", "y", {}, {}, measured_at=1.0)
    agrees = _m({"int4_bf16": 10.0, "float16": 10.3}, {"bfloat16": 50.0, "float32": 52.0}, 0.03)
    assert kp.still_holds(policy, agrees) is True
    flipped = _m({"int4_bf16": 10.0, "float16": 7.0}, {"bfloat16": 50.0, "float32": 52.0}, 0.03)
    assert kp.still_holds(policy, flipped) is False
    assert kp.still_holds(policy, _m(flipped.decode_ms, flipped.prefill_ms, 0.6)) is None
    # The noise of a kind timed far behind cannot overturn the choice: not erratic.
    far = kp.Measurement({"int4_bf16": 10.0, "float16": 10.3, "int4_f32": 400.0},
                         {"bfloat16": 50.0, "float32": 52.0},
                         {"int4_bf16": 0.03, "float16": 0.03, "int4_f32": 0.9},
                         {"bfloat16": 0.03, "float32": 0.03})
    assert kp.still_holds(policy, far) is True
    assert kp.still_holds(policy, dataclasses.replace(
        far, decode_spread={**far.decode_spread, "float16": 0.5})) is None
    # An int4 decode's prefill is never compared with 4-bit planes it does not use.
    planes = _m({"int4_bf16": 10.0}, {"bfloat16": 50.0, "int4_bf16": 20.0}, 0.03)
    assert kp.still_holds(policy, planes) is True


def test_a_re_timing_whose_choice_drifted_or_was_overtaken_means_changed():
    """The cached entry that ran SmolLM2 in float32: the chosen kind's own figure, or the
    order (int4 was ranked last), contradicted by a re-timing."""
    cached = kp.Policy("float32", "float32", "float32", "y",
                       {"float32": 38.3, "bfloat16": 2494.2, "float16": 2592.4, "int4_bf16": 3136.3},
                       {"float32": 4977.6, "bfloat16": 6833.0, "float16": 7437.6},
                       measured_at=time.time())
    same = _m({"float32": 38.0, "bfloat16": 2400.0, "float16": 2600.0, "int4_bf16": 3100.0},
              {"float32": 4900.0, "bfloat16": 6800.0, "float16": 7400.0}, 0.02)
    assert kp.judge(cached, same) == (kp.HOLDS, "re-timed, it holds")
    for factor in (1.7, 1 / 1.7):  # either way
        drifted = _m({**same.decode_ms, "float32": 38.3 * factor}, same.prefill_ms, 0.02)
        verdict, detail = kp.judge(cached, drifted)
        assert verdict == kp.CHANGED and "float32 decode step" in detail and "38.3 ms cached" in detail
    overtaken = _m({**same.decode_ms, "int4_bf16": 15.0}, same.prefill_ms, 0.02)
    assert kp.judge(cached, overtaken) == (kp.CHANGED, "another kind is now faster beyond noise")
    stalled = dataclasses.replace(overtaken, stalled=0.5, stall_ms=8.0)
    verdict, detail = kp.judge(cached, stalled)
    assert verdict == kp.UNCLEAR and "threads waited" in detail


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_validation_re_times_every_decode_kind_and_three_prefill_kinds_and_expires(monkeypatch):
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    policy = kp.choose(_m(decode, prefill), TINY)  # int4_bf16; bfloat16 (int4_bf16 next)
    asked, real_measure = [], kp.measure

    def recording(shapes, kinds, **kw):  # the real measurement, its arguments noted
        asked.append((list(kinds), list(kw["prefill_kinds"]), kw["reps"]))
        return real_measure(shapes, kinds, **kw)

    monkeypatch.setattr(kp, "measure", recording)
    verdict, detail = kp.check(policy, TINY, busy=lambda: False)
    assert verdict in (kp.HOLDS, kp.CHANGED, kp.UNCLEAR) and detail
    assert asked == [(list(kp.KINDS), ["bfloat16", "float16", "int4_bf16"], kp.VALIDATE_REPS)]
    assert kp.check(policy, TINY, busy=lambda: True)[0] == kp.INTERRUPTED
    policy.measured_at -= (kp.MAX_AGE_DAYS + 1) * 86_400
    asked.clear()
    assert kp.check(policy, TINY)[0] == kp.CHANGED
    assert not asked  # expired: no re-timing, a full measurement follows


def test_a_poisoned_cache_entry_is_caught_and_replaced(tmp_path, monkeypatch):
    """Absurd cached figures (float32 a thousand times faster than anything can be, everything
    else seconds) are caught by a real re-timing and measured again, by the command line's
    path (`policy_for`) as well as the session's (`tune`). The bars for erratic or stalled
    timings are lifted so the verdict does not depend on how busy this machine is."""
    monkeypatch.setattr(kp, "ERRATIC", 1e9)
    monkeypatch.setattr(kp, "STALLED_MAX", 1.0)
    poisoned = {k: 5000.0 for k in kp.KINDS} | {"float32": 0.001}
    entry = kp.Policy("float32", "float32", "float32", "poisoned", poisoned,
                      {k: 9000.0 for k in kp.PREFILL_KINDS} | {"float32": 0.001},
                      noise=0.2, measured_at=time.time())
    for settle in (kp.policy_for, kp.tune):
        kp._store(TINY, tmp_path, entry)
        assert kp.cached_policy(TINY, tmp_path).decode_ms == poisoned
        policy = settle(TINY, tmp_path)
        assert policy.status == kp.MEASURED and not policy.cached
        assert "measured again: float32 decode step" in policy.reason
        replaced = kp.cached_policy(TINY, tmp_path)
        assert replaced.decode_ms == policy.decode_ms and replaced.decode_ms != poisoned
        assert replaced.decode_ms["float32"] > 0.0016  # a real step's products


@pytest.fixture
def steady(monkeypatch):
    """Steady timings as input to the cache logic (a real measurement of TINY's microsecond
    products on a shared machine is often erratic, and then rightly not cached)."""
    m = _m({"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0},
           {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}, 0.02)
    monkeypatch.setattr(kp, "measure", lambda *a, **k: m)
    return m


def test_the_cache_is_written_then_reused_once_checked(tmp_path, steady):
    first = kp.policy_for(TINY, tmp_path)
    assert not first.cached and first.status == kp.MEASURED
    data = json.loads((tmp_path / kp.CACHE_FILE).read_text())
    assert list(data["entries"]) == [kp.cache_key(TINY)]
    assert "status" not in data["entries"][kp.cache_key(TINY)]  # how it was reached is not stored
    again = kp.policy_for(TINY, tmp_path)  # the same steady figures: the check holds
    assert again.cached and again.status == kp.CHECKED and (again.decode, again.prefill,
                                                              again.decode_ms) == (
        first.decode, first.prefill, first.decode_ms)
    assert kp.cached_policy(TINY, tmp_path).status == kp.UNCHECKED


@pytest.mark.parametrize("change", [("PREFILL_ROWS", 128), ("MEASURE_VERSION", 2),
                                    ("KINDS", kp.KINDS[:3]), ("PREFILL_KINDS", kp.PREFILL_KINDS[:3])])
def test_the_key_covers_the_measurement_itself_and_old_entries_are_pruned(tmp_path, monkeypatch,
                                                                         steady, change):
    kp.policy_for(TINY, tmp_path)
    old_key = kp.cache_key(TINY)
    monkeypatch.setattr(kp, *change)
    assert kp.cache_key(TINY) != old_key and kp.cached_policy(TINY, tmp_path) is None
    other_model = dataclasses.replace(TINY, name="other")
    assert not kp.policy_for(other_model, tmp_path).cached  # measured again ...
    entries = json.loads((tmp_path / kp.CACHE_FILE).read_text())["entries"]
    assert list(entries) == [kp.cache_key(other_model)]  # ... and the old measurement's pruned


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"entries": 3}', "\udcff"])
def test_a_damaged_cache_is_ignored_and_rewritten(tmp_path, damage, steady):
    (tmp_path / kp.CACHE_FILE).write_bytes(damage.encode("utf-8", "surrogateescape"))
    policy = kp.policy_for(TINY, tmp_path)
    assert not policy.cached
    assert kp.cache_key(TINY) in json.loads((tmp_path / kp.CACHE_FILE).read_text())["entries"]


def test_a_damaged_entry_is_measured_again(tmp_path, steady):
    kp.write_cache(tmp_path / kp.CACHE_FILE, {kp.cache_key(TINY): {"decode": "warp drive"}})
    assert not kp.policy_for(TINY, tmp_path).cached
    assert kp.policy_for(TINY, tmp_path).cached


def test_another_cpu_torch_or_model_does_not_reuse_the_entry(tmp_path, monkeypatch, steady):
    kp.policy_for(TINY, tmp_path)
    other_model = dataclasses.replace(TINY, name="other")
    assert not kp.policy_for(other_model, tmp_path).cached
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert not kp.policy_for(TINY, tmp_path).cached
    monkeypatch.setattr(torch, "__version__", _TORCH_VERSION)
    monkeypatch.setattr(kp, "cpu_identity", lambda: "Some Other CPU | AVX2 | 2 threads")
    assert not kp.policy_for(TINY, tmp_path).cached
    entries = json.loads((tmp_path / kp.CACHE_FILE).read_text())["entries"]
    assert len(entries) == 4  # every machine and model keeps its own


def test_the_embedded_models_products(embedded_model_path):
    """Gemma 3 270M Q4_K_M: Q, K, gate, up Q5_0 (two planes), V Q5_0 or Q8_0 (two), O Q4_K
    (one), down Q4_K in half the layers and Q6_K (two, approximated) in the others; the tied head Q8_0,
    screened with one plane."""
    shapes = kp.gguf_shapes(embedded_model_path)
    assert shapes.head == (262144, 640) and shapes.head_planes == 1
    assert shapes.layers == {(1536, 640): 18, (640, 1024): 18, (4096, 640): 18, (640, 2048): 18}
    assert shapes.int4_layers == {(1536, 640, 2): 18, (640, 1024, 1): 18, (4096, 640, 2): 18,
                                  (640, 2048, 1): 9, (640, 2048, 2): 9}
    assert shapes.int4_fraction == 1
    assert shapes.kv == (18, 4, 1, 256)  # layers, query heads, KV heads, head dim


def _engine_products(model) -> dict[tuple[int, int, int], int]:
    """(out, in, planes) -> count of the products a loaded model's decode step runs."""
    from app.models.quantized import QuantizedWeight

    found: dict[tuple[int, int, int], int] = {}
    for layer in model.layers:
        (q, k, v, _), (gate, up) = layer._qkv_of, layer._gate_up_of
        qkv = [layer.qkv] + ([layer.v] if v is None else [])
        for w in [*qkv, layer.o, layer.gate_up, layer.down]:
            planes = w.codes.planes if isinstance(w, QuantizedWeight) else 0
            out, inp = (w.out_features, w.in_features) if planes else (
                (w.shape[1], w.shape[0]) if model.fmt.transposed else tuple(w.shape))
            found[(out, inp, planes)] = found.get((out, inp, planes), 0) + 1
    return found


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_the_measured_products_are_the_ones_a_4bit_load_runs(embedded_model_path):
    """What the measurement times for a 4-bit kind is what the loaded engine multiplies by:
    the same joined products with the same planes, the same float leftovers, the same head."""
    from app.engine.device import LoadPlan, load_planned
    from app.models.layers import WeightFormat
    from app.models.quantized import QuantizedWeight

    shapes = kp.gguf_shapes(embedded_model_path)
    fmt = WeightFormat(torch.float16, False, None, True, torch.bfloat16, None)
    loaded = load_planned(embedded_model_path, torch.device("cpu"),
                          LoadPlan(torch.float16, None, fmt, "int4", "test"))
    try:
        model = loaded.model
        assert _engine_products(model) == shapes.int4_layers
        head = model.embedding
        assert isinstance(head, QuantizedWeight) and head.codes.planes == shapes.head_planes == 1
        assert head.exact_top and head.rows is not None
    finally:
        loaded.unload()


def test_a_plans_attention_layout_reaches_every_layer(embedded_model_path):
    from app.engine.device import LoadPlan, load_planned

    plan = LoadPlan(torch.float32, None, None, "float32", "test", per_head_from=kp.PER_HEAD_FROM)
    loaded = load_planned(embedded_model_path, torch.device("cpu"), plan)
    try:
        assert loaded.model.per_head_from == kp.PER_HEAD_FROM
        assert {layer.per_head_from for layer in loaded.model.layers} == {kp.PER_HEAD_FROM}
    finally:
        loaded.unload()
    plain = load_planned(embedded_model_path, torch.device("cpu"),
                         LoadPlan(torch.float32, None, None, "float32", "test"))
    try:
        assert plain.model.per_head_from is None
    finally:
        plain.unload()


def test_forcing_int4_needs_a_gguf_model(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(DeviceError, match="int4 needs a GGUF model"):
        plan_load(folder, torch.device("cpu"), "int4")
    with pytest.raises(DeviceError, match="Unknown dtype"):
        plan_load(folder, torch.device("cpu"), "int3")


def test_auto_on_the_cpu_measures_once_then_checks_and_says_why(embedded_model_path, _own_data_dir):
    plan = plan_load(embedded_model_path, torch.device("cpu"), "auto")
    assert "(cached" not in plan.reason
    again = plan_load(embedded_model_path, torch.device("cpu"), "auto")
    if f"{kp.DEFAULT_SAYS} kept" in plan.reason:  # a busy machine: nothing cached
        assert plan.label == kp.default_policy("", plan.shapes).label
        assert plan.policy_status == kp.NOT_MEASURED
        assert "(cached" not in again.reason
    else:
        assert plan.reason.startswith("measured on ") and plan.policy_status == kp.MEASURED
        # The command line checks the cached entry before trusting it (a busy machine may find
        # it changed, or the check inconclusive: it says so).
        assert again.policy_status in (kp.CHECKED, kp.CHECK_UNCLEAR, kp.KEPT, kp.MEASURED)
        if again.policy_status == kp.CHECKED:
            assert again.reason.endswith("(cached, checked)") and again.label == plan.label
    unchecked = plan_load(embedded_model_path, torch.device("cpu"), "auto", measure=False)
    cached = kp.cached_policy(unchecked.shapes, _own_data_dir)
    assert unchecked.policy_status == (kp.UNCHECKED if cached else kp.NOT_MEASURED)


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_without_measuring_first_the_default_loads(embedded_model_path, _own_data_dir):
    """Nothing measured on this machine: float16, decoding a model's 4-bit products with a
    4-bit kind (the 4-bit planes with a float16 copy for prefill): on 8-bit activations
    where that kernel is ready (the suite's shared kernel folder holds it)."""
    plan = plan_load(embedded_model_path, torch.device("cpu"), "auto", measure=False)
    assert plan.policy_status == kp.NOT_MEASURED and plan.shapes is not None
    decode = kp.provisional_decode(plan.shapes)
    assert decode == (kp.INT8_KIND if int8_products.ready() else "int4_bf16")
    assert plan.label == f"{decode} decode, {kp.DEFAULT} prefill"
    assert plan.reason.startswith(f"{plan.label} {kp.DEFAULT_SAYS} until this CPU is measured")
    assert (plan.dtype, plan.wide_dtype) == (torch.float16, None)
    assert plan.int4.int4 and plan.int4.int4_act_dtype == torch.bfloat16
    assert plan.int4.int8_acts == (decode == kp.INT8_KIND)
    assert plan.int4.int4_wide_dtype == torch.float16  # prefill in float16, as before
    assert kp.cached_policy(plan.shapes, _own_data_dir) is None


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_the_default_decodes_4_bit_products_with_the_first_kernel_ready(monkeypatch):
    assert kp.int4_kernel_runs()  # torch 2.13 on x86: the kernel is there and multiplies right
    monkeypatch.setattr(kp.int8_products, "ready", lambda: True)
    policy = kp.default_policy("why", TINY)
    assert (policy.decode, policy.prefill, policy.status) == ("int4_i8", "float16", kp.NOT_MEASURED)
    assert policy.reason == "int4_i8 decode, float16 prefill (default) why"
    assert policy.weight_format(torch.device("cpu"), 1)[0].int8_acts
    # The 8-bit activation kernel not compiled or saved yet (a first start that skipped the
    # set-up), or seen failing by a measurement: torch's 4-bit kernel.
    assert kp.default_policy("", TINY, failed={"int4_i8": "RuntimeError"}).decode == "int4_bf16"
    monkeypatch.setattr(kp.int8_products, "ready", lambda: False)
    policy = kp.default_policy("why", TINY)
    assert (policy.decode, policy.prefill) == ("int4_bf16", "float16")
    assert policy.reason == "int4_bf16 decode, float16 prefill (default) why"
    assert not policy.weight_format(torch.device("cpu"), 1)[0].int8_acts
    # No shapes, or no 4-bit products: float16 throughout.
    assert kp.default_policy("why").decode == kp.DEFAULT == "float16"
    floats_only = dataclasses.replace(TINY, int4_layers={}, head_planes=0)
    assert floats_only.int4_fraction == 0 and kp.default_policy("", floats_only).label == kp.DEFAULT
    # A measurement that saw the kernel fail, or a kernel that does not run here: float16.
    assert kp.default_policy("", TINY, failed={"int4_bf16": "RuntimeError"}).decode == kp.DEFAULT
    monkeypatch.setattr(kp.int8_products, "ready", lambda: True)
    monkeypatch.setattr(kp, "int4_kernel_runs", lambda: False)
    assert kp.default_policy("", TINY).label == kp.DEFAULT


def test_the_kernel_probe_says_no_when_the_kernel_raises(monkeypatch):
    import app.models.quantized as quantized

    def broken(*args):
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(quantized, "_kernel_runs", None)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", broken)
    assert quantized.int4_kernel_runs() is False


def test_a_files_shapes_are_remembered_until_it_changes(embedded_model_path, tmp_path):
    first = kp.shapes_for(embedded_model_path, tmp_path)
    assert first == kp.gguf_shapes(embedded_model_path)
    files = json.loads((tmp_path / kp.CACHE_FILE).read_text())["files"]
    assert len(files) == 1
    (key, value), = files.items()
    value["name"] = "read from the cache"
    kp.write_cache(tmp_path / kp.CACHE_FILE, files={key: value})
    assert kp.shapes_for(embedded_model_path, tmp_path).name == "read from the cache"
    kp.write_cache(tmp_path / kp.CACHE_FILE, files={key: {"layers": "junk"}})
    assert kp.shapes_for(embedded_model_path, tmp_path) == first  # damaged: read again


OTHER = dataclasses.replace(TINY, name="other", head=(1024, 64))


def test_an_unmeasured_model_borrows_the_newest_choice_measured_on_this_cpu(tmp_path, monkeypatch):
    assert kp.borrowed_policy(TINY, tmp_path) is None  # nothing measured here yet
    old = dataclasses.replace(kp.choose(_with_kv(_m(
        {"float32": 5.0, "float16": 1.0}, {"float32": 50.0, "float16": 10.0}), {}, {}), OTHER),
        measured_at=1.0)
    new = kp.choose(_with_kv(_m(
        {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 1.0},
        {"float32": 50.0, "bfloat16": 10.0}),
        {"float32": 4.0, "bfloat16": 2.0}, {"float32": 4.0, "bfloat16": 2.0}), OTHER)
    new = dataclasses.replace(new, kv_per_head=True)  # that model's heads: per query head
    kp._store(OTHER, tmp_path, old)
    kp._store(dataclasses.replace(OTHER, name="third"), tmp_path, new)
    borrowed = kp.borrowed_policy(TINY, tmp_path)
    assert (borrowed.decode, borrowed.prefill, borrowed.kv) == ("int4_bf16", "bfloat16", "bfloat16")
    assert borrowed.kv_per_head is False  # the layout follows a model's heads: never borrowed
    assert borrowed.status == kp.BORROWED and not borrowed.cached
    assert borrowed.reason.startswith(f"{new.label} as measured on this CPU for third,")
    assert kp.cached_policy(TINY, tmp_path) is None  # this model's own entry: still to measure
    # A model the borrowed kind does not fit (no 4-bit blocks) takes the newest that does.
    no_blocks = dataclasses.replace(TINY, name="f16 model", head_planes=0,
                                    int4_layers={(n, k, 0): c for (n, k), c in TINY.layers.items()})
    assert kp.borrowed_policy(no_blocks, tmp_path).decode == "float16"
    # Measured with another thread count on this CPU (a busy start may measure with one):
    # borrowed when nothing was measured with this one, and said so.
    cpu = kp.cpu_identity()
    monkeypatch.setattr(kp, "cpu_identity", lambda: cpu.rsplit("|", 1)[0] + "| 7 threads")
    other_threads = kp.borrowed_policy(TINY, tmp_path)
    assert (other_threads.decode, other_threads.status) == ("int4_bf16", kp.BORROWED)
    assert other_threads.reason.startswith(f"{new.label} as measured on this CPU for third "
                                           f"on {torch.get_num_threads()} thread")
    # ... but an entry of this thread count wins over a newer one of another.
    kp._store(dataclasses.replace(OTHER, name="seven"), tmp_path,
              dataclasses.replace(old, measured_at=2.0))
    assert kp.borrowed_policy(TINY, tmp_path).reason.startswith(f"{old.label} as measured on "
                                                                "this CPU for seven,")
    # Another CPU (or torch) measures differently: nothing to borrow.
    monkeypatch.setattr(kp, "cpu_identity", lambda: "another CPU | AVX2 | 4 threads")
    assert kp.borrowed_policy(TINY, tmp_path) is None


def test_borrowing_compiles_nothing_and_takes_8_bit_activations_only_where_ready(tmp_path,
                                                                                 monkeypatch):
    """A first load looks for a choice to borrow: an entry that chose `int4_i8` is borrowed
    only where the kernel is ready (saved by an earlier process); asking must not compile it
    (~4 s of a first load)."""
    from app.models import int8_products

    def compile_asked():
        raise AssertionError("borrowing asked for a compile")

    older = dataclasses.replace(kp.choose(_m({"float32": 5.0, "float16": 3.0, "int4_bf16": 1.0},
                                             {"float32": 50.0, "float16": 10.0}), OTHER),
                                measured_at=1.0)
    newer = kp.choose(_m({"float32": 5.0, "float16": 3.0, "int4_bf16": 2.0, "int4_i8": 1.0},
                         {"float32": 50.0, "float16": 10.0}), OTHER)
    assert newer.decode == "int4_i8"
    kp._store(OTHER, tmp_path, older)
    kp._store(dataclasses.replace(OTHER, name="third"), tmp_path, newer)
    monkeypatch.setattr(int8_products, "available", compile_asked)
    monkeypatch.setattr(int8_products, "_compile", compile_asked)
    monkeypatch.setattr(int8_products, "ready", lambda: False)
    assert kp.borrowed_policy(TINY, tmp_path).decode == "int4_bf16"  # the older entry
    monkeypatch.setattr(int8_products, "ready", lambda: True)
    assert kp.borrowed_policy(TINY, tmp_path).decode == "int4_i8"


def test_a_borrowed_format_stays_when_the_models_own_measurement_is_unusable(
        embedded_model_path, smollm2_model_path, _own_data_dir, monkeypatch):
    from app.engine.session import ModelSession

    other = kp.gguf_shapes(smollm2_model_path)
    decode = {"float32": 5.0, "float16": 3.0, "int4_bf16": 1.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0}
    kp._store(other, _own_data_dir, kp.choose(_m(decode, prefill), other))
    plan = plan_load(embedded_model_path, torch.device("cpu"), "auto", measure=False)
    assert plan.policy_status == kp.BORROWED and plan.int4 is not None
    monkeypatch.setenv("FERROX_POLICY_TUNING", "1")
    monkeypatch.setattr(kp, "measure_and_choose",
                        lambda *a, **k: kp.default_policy("kept: its timings were erratic"))
    session = ModelSession()
    try:
        info = session.load(embedded_model_path, "cpu", "auto")
        assert session.wait_for_policy(120)
        assert session._loaded.load_plan is not None and session._loaded.load_plan.int4 is not None
        assert session.info.policy_label == info.policy_label
        assert session.info.policy_reason.endswith("its timings were erratic), so that stays")
    finally:
        session.close()


def test_where_per_head_attention_raises_the_kv_dtype_is_still_measured(monkeypatch):
    """A torch whose SDPA refuses enable_gqa here: per KV head, as before, and the dtype stays."""
    real = kp._KVRun._attend

    def refusing(self, q, layer, keys):
        if q.shape[1] != self.keys[layer].shape[1]:
            raise RuntimeError("enable_gqa is not supported")
        return real(self, q, layer, keys)

    monkeypatch.setattr(kp._KVRun, "_attend", refusing)
    m = kp.measure(dataclasses.replace(TINY, kv=(2, 4, 2, 16)), kinds=("float16",), reps=2,
                   busy=lambda: False)
    assert set(m.kv_ms) == set(kp.KV_KINDS) and m.kv_per_head_ms == {} and not m.failed
    assert kp.pick_layout(m, "bfloat16") == (False, "")


def test_a_kv_dtype_kept_for_erratic_timings_is_measured_again_at_the_next_check(monkeypatch):
    """A re-timing compares decode attention only, so it could not overturn a float32 cache
    that erratic timings left: the entry says so, and the next check measures afresh."""
    erratic = kp.choose(_with_kv(_m(*_WEIGHTS), {"float32": 10.0, "bfloat16": 5.0},
                                 {"float32": 6.3, "bfloat16": 1.7}, 0.40), TINY)
    assert erratic.kv == "float32" and erratic.kv_unsettled and "erratic" in erratic.reason
    monkeypatch.setattr(kp, "measure", lambda *a, **k: pytest.fail("nothing to re-time"))
    assert kp.check(erratic, TINY) == (kp.CHANGED, "its KV cache timings were erratic when measured")
    steady = kp.choose(_with_kv(_m(*_WEIGHTS), *_KV_FASTER, 0.02), TINY)
    assert not steady.kv_unsettled
    assert kp._policy_from({**dataclasses.asdict(steady), "kv_unsettled": 1}) is None


def test_the_default_never_compiles_the_8_bit_activation_kernel(monkeypatch, tmp_path):
    """Only a measurement (or a load in `int4_i8`) compiles it (~4 s): not a first load,
    which takes it only where an earlier process saved it."""
    from app.models import int8_products

    def compile_asked():
        raise AssertionError("the default asked for the 8-bit activation kernel")

    monkeypatch.setattr(int8_products, "available", compile_asked)
    monkeypatch.setattr(int8_products, "_compile", compile_asked)
    assert kp.default_policy("", TINY).label.endswith("decode, float16 prefill")
    # A process that has not compiled it, with no saved copy: torch's 4-bit kernel.
    monkeypatch.setattr(int8_products, "_kernel", None)
    monkeypatch.setattr(int8_products, "_kernel_error", None)
    monkeypatch.setenv(int8_products.OBJECT_CACHE_ENV, str(tmp_path))
    if kp.int4_kernel_runs():
        assert kp.default_policy("", TINY).decode == "int4_bf16"
