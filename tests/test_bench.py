"""The benchmark runs end to end and reports every figure (on the tiny model: figures here
are not speed claims; `python -m app bench` on the real model makes those)."""

from __future__ import annotations

import os

import pytest
import torch

from app.bench import run_bench
from app.models.gguf_file import GGUFFile
from app.models.tokenizer import Tokenizer
from tests.engine.conftest import make_tiny_model

FIGURES = ["decode_tokens_per_s", "prefill_tokens_per_s", "follow_up_ttft_cold_s",
           "follow_up_ttft_warm_s", "follow_up_cached_tokens", "itl_solo_p50_ms",
           "itl_solo_p95_ms", "itl_during_prefill_p95_ms", "aggregate_4_streams_tokens_per_s",
           "document_prefill_alone_s", "document_beside_stream_over_alone",
           "streams_4_over_1_ctx24", "streams_4_over_1_ctx1000", "decode_ctx4000_tokens_per_s",
           "short_during_long_prefill_ttft_s",
           "short_alone_ttft_s", "requests_8_last_over_first", "peak_rss_mb"]


def test_bench_reports_every_figure(embedded_model_path):
    with GGUFFile(embedded_model_path) as gguf:
        tiny = make_tiny_model(Tokenizer.from_gguf(gguf))
    results = run_bench(tiny, decode_tokens=16, stream_tokens=40, long_prompt_tokens=1_500)
    for key in FIGURES:
        assert results[key] is not None and results[key] >= 0, key
    assert results["stream_ran_throughout"]  # the document's whole prefill was beside the stream
    # The follow-up adopted almost all of the ~1,900-token conversation.
    assert results["follow_up_cached_tokens"] > 0.9 * results["follow_up_prompt_tokens"]


@pytest.mark.slow
def test_load_times_first_and_warm(embedded_model_path, monkeypatch, _own_data_dir):
    """Figures, not claims: both loads happen in a scratch data folder (the person's caches
    untouched), and the policy's background measurement is timed."""
    from app.bench import measure_load_times

    monkeypatch.setenv("FERROX_WEIGHT_CACHE", "0")  # the bench saves in its scratch folder anyway
    results = measure_load_times(embedded_model_path, "cpu", "auto")
    assert results["load_first_s"] > 0 and results["load_warm_s"] > 0
    assert results["policy_measurement_s"] > 0 and results["weights"] == results["policy_measured"]
    assert not (_own_data_dir / "weight-cache").exists()
    assert os.environ["FERROX_WEIGHT_CACHE"] == "0"  # restored


def _record_drives(monkeypatch) -> list[tuple[int, int]]:
    """(prompt length, max_tokens) of every request `bench._drive` runs from now on."""
    import app.bench as bench

    seen = []
    real = bench._drive

    def drive(engine, jobs, *args, **kwargs):
        (ids, params), = jobs.values()
        seen.append((len(ids), params.max_tokens))
        return real(engine, jobs, *args, **kwargs)

    monkeypatch.setattr(bench, "_drive", drive)
    return seen


@pytest.mark.slow
def test_the_dtype_comparison_takes_the_best_of_its_runs(embedded_model_path, monkeypatch):
    """Each figure is the best of `tries` runs, as the llama.cpp side of the comparison
    script takes its best of two; the prefix cache is cleared before each, so the second
    prefill reads its prompt again instead of adopting it."""
    import app.bench as bench

    seen = _record_drives(monkeypatch)
    (row,) = bench.run_dtype_comparison(embedded_model_path, "cpu", ["float16"],
                                        decode_tokens=4, tries=2)
    assert seen == [(33, 4), (33, 4), (1024, 1), (1024, 1)]  # BOS and the filler
    assert row["decode_tokens_per_s"] > 0 and row["prefill_1024_s"] > 0.05  # not a cache hit
    assert row["decode_long_tokens_per_s"] is None  # no long chat asked for


@pytest.mark.slow
def test_the_dtype_comparison_decodes_after_a_long_prompt_when_asked(embedded_model_path,
                                                                   monkeypatch):
    """The comparison script's long-chat column: the same decode after `long_context` prompt
    tokens (a pool large enough for them), the best of its runs."""
    import app.bench as bench

    seen = _record_drives(monkeypatch)
    (row,) = bench.run_dtype_comparison(embedded_model_path, "cpu", ["float16"],
                                        decode_tokens=3, tries=1, long_context=4500)
    assert seen == [(33, 3), (1024, 1), (4501, 3)]
    assert row["decode_long_tokens_per_s"] > 0


@pytest.mark.slow
def test_the_comparison_keeps_the_loads_peak_beside_the_running_one(embedded_model_path,
                                                                    monkeypatch):
    """Restarting the peak for the 'after loading' figure restarts getrusage's too: the
    row's whole-process peak must still hold what the load briefly held."""
    import app.bench as bench
    import app.engine.device as device

    if not bench.restart_peak_rss():
        pytest.skip("this system cannot restart the peak resident memory")
    real = device.load_on
    load_peak, after_load = [], []

    def load_with_a_transient(*args, **kwargs):  # as the policy check's weight copies do
        block = torch.ones(2**30 // 4)  # 1 GB: more than the runs themselves hold
        load_peak.append(bench.resident_mb())
        del block
        after_load.append(bench.resident_mb())
        return real(*args, **kwargs)

    monkeypatch.setattr(device, "load_on", load_with_a_transient)
    (row,) = bench.run_dtype_comparison(embedded_model_path, "cpu", ["float16"],
                                        decode_tokens=2, tries=1)
    assert row["peak_rss_mb"] >= load_peak[0] - 8  # (MB rounding)
    # The restart left the load out, where the allocator handed the block back (see below).
    if row["running_peak_rss_mb"] is not None and after_load[0] < load_peak[0] - 768:
        assert row["running_peak_rss_mb"] < load_peak[0] - 256


def test_the_peak_memory_restarts_without_what_came_before():
    """The comparison's 'peak after loading' leaves out the load's transient copies: after a
    restart the peak is what the process holds then, not an earlier, larger block's."""
    from app import bench

    if not bench.restart_peak_rss():
        pytest.skip("this system cannot restart the peak resident memory")
    block = torch.ones(256 * 2**20 // 4)  # 256 MB, every page touched
    holding = bench.resident_mb()
    with_block = bench.peak_rss_since_restart_mb()
    assert with_block >= holding  # the peak saw the block
    del block
    if not bench.restart_peak_rss():  # the first restart could not tell: nothing was above
        pytest.skip("this system keeps the old peak")
    # Whether the allocator takes the block from pages it already holds, or hands them back
    # after, is its business (in a long test run it may do either); the restarted peak is
    # the resident memory of now.
    assert bench.peak_rss_since_restart_mb() <= bench.resident_mb() + 32
    if bench.resident_mb() < holding - 200:  # the pages went back, as they usually do
        assert bench.peak_rss_since_restart_mb() < holding - 128


def test_a_restart_the_system_ignored_is_reported(monkeypatch, tmp_path):
    """A kernel or sandbox that takes the write and keeps the old peak: the restart says it
    did not happen, so the comparison prints no peak rather than the load's."""
    from app import bench

    status = {"VmHWM": 1900, "VmRSS": 700}
    monkeypatch.setattr(bench, "_status_mb", lambda field: status[field])
    monkeypatch.setattr(bench, "Path", lambda name: tmp_path / "clear_refs")  # takes writes
    assert not bench.restart_peak_rss()
    status["VmHWM"] = 700  # a restart that took
    assert bench.restart_peak_rss()


def test_stream_rates_take_one_stream_and_several_in_turn(embedded_model_path, monkeypatch):
    """`bench`'s and the comparison script's streams figure: 1, n, 1, n runs, each reading its
    prompts first (a distinct prompt a stream), then decoding them together."""
    import app.bench as bench
    from app.engine.engine import Engine, EngineConfig

    with GGUFFile(embedded_model_path) as gguf:
        tiny = make_tiny_model(Tokenizer.from_gguf(gguf))
    runs = []
    real = bench._drive

    def drive(engine, jobs, *args, **kwargs):
        runs.append(sorted((len(ids), params.max_tokens) for ids, params in jobs.values()))
        return real(engine, jobs, *args, **kwargs)

    monkeypatch.setattr(bench, "_drive", drive)
    rates = bench.stream_rates(Engine(tiny, EngineConfig(kv_tokens=1024)), tiny.tokenizer, 8,
                               streams=3, tokens=5)
    assert set(rates) == {1, 3} and rates[1] > 0 and rates[3] > 0
    prompt = len(bench.stream_prompts(tiny.tokenizer, 8, 1)[0])
    one, three = [(prompt, 1)], [(prompt, 1)] * 3
    assert runs == [one, [(prompt, 5)], three, [(prompt, 5)] * 3] * 2
    prompts = bench.stream_prompts(tiny.tokenizer, 8, 3)
    assert len({tuple(p) for p in prompts}) == 3  # no stream shares another's cached prefix
    assert prompts[0] == bench.stream_prompts(tiny.tokenizer, 8, 1)[0]
