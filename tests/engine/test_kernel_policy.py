"""The measured CPU weight policy: what it picks from timings, and its cache."""

from __future__ import annotations

import json

import pytest
import torch

from app.engine import kernel_policy as kp
from app.engine.device import DeviceError, plan_load
from app.models.quantized import int4_kernel_available

_TORCH_VERSION = torch.__version__
# Small shapes so a real measurement takes a fraction of a second.
TINY = kp.ModelShapes("tiny", {(64, 64): 4, (128, 64): 2, (64, 128): 2}, (512, 64), 1.0, 1.0)


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
    no_blocks = kp.ModelShapes("f16 model", TINY.layers, TINY.head, 0.0)
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


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_a_real_measurement_times_every_kind_interleaved():
    order = []
    m = kp.measure(TINY, reps=3, busy=lambda: order.append(1) and False)
    assert set(m.decode_ms) == set(kp.KINDS) and set(m.prefill_ms) == set(kp.PREFILL_KINDS)
    assert all(ms > 0 for ms in [*m.decode_ms.values(), *m.prefill_ms.values()])
    assert len(order) == 3 * len(kp.KINDS)  # every repetition times every kind once
    assert all(s >= 0 for s in m.decode_spread.values())


def test_tune_keeps_a_cached_choice_unless_the_check_says_it_changed(tmp_path, monkeypatch):
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    kp._store(TINY, tmp_path, kp.choose(_m(decode, prefill), TINY))
    for verdict, ending in ((kp.HOLDS, "(cached, checked)"), (kp.UNCLEAR, "timings erratic)")):
        monkeypatch.setattr(kp, "validate", lambda *a, v=verdict, **k: v)
        policy = kp.tune(TINY, tmp_path)
        assert policy.cached and policy.decode == "int4_bf16" and policy.reason.endswith(ending)
    monkeypatch.setattr(kp, "validate", lambda *a, **k: kp.INTERRUPTED)
    assert kp.tune(TINY, tmp_path) is None
    # Changed: measured again (here float16 wins everything) and the new choice cached.
    monkeypatch.setattr(kp, "validate", lambda *a, **k: kp.CHANGED)
    monkeypatch.setattr(kp, "measure", lambda *a, **k: _m({**decode, "float16": 1.0},
                                                          {**prefill, "float16": 1.0}, 0.01))
    fresh = kp.tune(TINY, tmp_path)
    assert not fresh.cached and fresh.label == "float16"
    assert kp.cached_policy(TINY, tmp_path).label == "float16"


def test_a_measurement_stops_when_the_engine_gets_work(tmp_path):
    calls = []
    assert kp.measure(TINY, busy=lambda: len(calls) > 2 or calls.append(1)) is None
    assert kp.tune(TINY, tmp_path, busy=lambda: True) is None
    assert not (tmp_path / kp.CACHE_FILE).exists()  # nothing half-measured is kept


def test_erratic_timings_are_never_cached(tmp_path, monkeypatch):
    erratic = _m({"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 1.0, "int4_f32": 9.0},
                 {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}, 0.9)
    monkeypatch.setattr(kp, "measure", lambda *a, **k: erratic)
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert "erratic" in policy.reason and policy.label == kp.DEFAULT
    assert "noise 90%" in policy.reason and "int4_bf16" in policy.reason  # what it saw
    assert kp.cached_policy(TINY, tmp_path) is None


def test_a_measurement_past_its_budget_keeps_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(kp, "BUDGET_S", 0.0)
    policy = kp.measure_and_choose(TINY, tmp_path)
    assert policy.label == kp.DEFAULT and "busy machine" in policy.reason
    assert kp.cached_policy(TINY, tmp_path) is None


def test_a_cached_choice_is_kept_while_a_re_timing_agrees():
    policy = kp.Policy("int4_bf16", "bfloat16", "x", "y", {}, {}, measured_at=1.0)
    agrees = _m({"int4_bf16": 10.0, "float16": 10.3}, {"bfloat16": 50.0, "float32": 52.0}, 0.03)
    assert kp.still_holds(policy, agrees) is True
    flipped = _m({"int4_bf16": 10.0, "float16": 7.0}, {"bfloat16": 50.0, "float32": 52.0}, 0.03)
    assert kp.still_holds(policy, flipped) is False
    assert kp.still_holds(policy, _m(flipped.decode_ms, flipped.prefill_ms, 0.6)) is None
    # An int4 decode's prefill is never compared with 4-bit planes it does not use.
    planes = _m({"int4_bf16": 10.0}, {"bfloat16": 50.0, "int4_bf16": 20.0}, 0.03)
    assert kp.still_holds(policy, planes) is True


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 kernel")
def test_validation_re_times_the_choice_and_runner_up_only_and_expires():
    decode = {"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0}
    prefill = {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}
    policy = kp.choose(_m(decode, prefill), TINY)  # int4_bf16 (float16 next), bfloat16 (int4_bf16 next)
    timed = []
    verdict = kp.validate(policy, TINY, busy=lambda: timed.append(1) and False)
    assert verdict in (kp.HOLDS, kp.CHANGED, kp.UNCLEAR)
    assert len(timed) == kp.VALIDATE_REPS * 3  # int4_bf16, float16, bfloat16
    assert kp.validate(policy, TINY, busy=lambda: True) == kp.INTERRUPTED
    policy.measured_at -= (kp.MAX_AGE_DAYS + 1) * 86_400
    timed.clear()
    assert kp.validate(policy, TINY, busy=lambda: timed.append(1) and False) == kp.CHANGED
    assert not timed  # expired: no re-timing, a full measurement follows


@pytest.fixture
def steady(monkeypatch):
    """Steady timings as input to the cache logic (a real measurement of TINY's microsecond
    products on a shared machine is often erratic, and then rightly not cached)."""
    m = _m({"float32": 5.0, "bfloat16": 4.0, "float16": 3.0, "int4_bf16": 2.0, "int4_f32": 9.0},
           {"float32": 50.0, "bfloat16": 10.0, "float16": 40.0, "int4_bf16": 30.0}, 0.02)
    monkeypatch.setattr(kp, "measure", lambda *a, **k: m)
    return m


def test_the_cache_is_written_then_reused(tmp_path, steady):
    first = kp.policy_for(TINY, tmp_path)
    assert not first.cached
    data = json.loads((tmp_path / kp.CACHE_FILE).read_text())
    assert list(data["entries"]) == [kp.cache_key(TINY)]
    again = kp.policy_for(TINY, tmp_path)
    assert again.cached and (again.decode, again.prefill, again.decode_ms) == (
        first.decode, first.prefill, first.decode_ms)


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
    other_model = kp.ModelShapes("other", TINY.layers, TINY.head, 1.0)
    assert not kp.policy_for(other_model, tmp_path).cached
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert not kp.policy_for(TINY, tmp_path).cached
    monkeypatch.setattr(torch, "__version__", _TORCH_VERSION)
    monkeypatch.setattr(kp, "cpu_identity", lambda: "Some Other CPU | AVX2 | 2 threads")
    assert not kp.policy_for(TINY, tmp_path).cached
    entries = json.loads((tmp_path / kp.CACHE_FILE).read_text())["entries"]
    assert len(entries) == 4  # every machine and model keeps its own


def test_the_embedded_models_shapes(embedded_model_path):
    shapes = kp.gguf_shapes(embedded_model_path)
    assert shapes.head == (262144, 640)
    assert shapes.layers[(2048, 640)] == 2 * 18 and shapes.layers[(640, 2048)] == 18
    assert 0.9 < shapes.int4_fraction < 1 and 1 < shapes.int4_planes <= 2  # Q6_K does not fit


def test_forcing_int4_needs_a_gguf_model(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(DeviceError, match="int4 needs a GGUF model"):
        plan_load(folder, torch.device("cpu"), "int4")
    with pytest.raises(DeviceError, match="Unknown dtype"):
        plan_load(folder, torch.device("cpu"), "int3")


def test_auto_on_the_cpu_measures_once_and_says_why(embedded_model_path, _own_data_dir):
    plan = plan_load(embedded_model_path, torch.device("cpu"), "auto")
    assert "(cached)" not in plan.reason
    again = plan_load(embedded_model_path, torch.device("cpu"), "auto")
    if plan.reason.startswith(f"{kp.DEFAULT} (default) kept"):  # a busy machine: nothing cached
        assert plan.label == kp.DEFAULT and "(cached)" not in again.reason
    else:
        assert plan.reason.startswith("measured on ")
        assert again.reason.endswith("(cached)") and again.label == plan.label


def test_without_measuring_first_the_safe_default_loads(embedded_model_path, _own_data_dir):
    plan = plan_load(embedded_model_path, torch.device("cpu"), "auto", measure=False)
    assert plan.label == kp.DEFAULT and "default" in plan.reason and plan.shapes is not None
    assert (plan.dtype, plan.wide_dtype, plan.int4) == (torch.float16, None, None)
    assert kp.cached_policy(plan.shapes, _own_data_dir) is None


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
