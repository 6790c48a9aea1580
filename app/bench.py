"""`python -m app bench`: the engine's speed figures on one model, measured in one run.

Figures (all on the same loaded model and engine):
  decode_tokens_per_s       one stream, greedy, after a short prompt
  prefill_tokens_per_s      a 1,024-token prompt, cold
  follow_up_ttft_cold_s     time to first token of a follow-up turn in a ~2,000-token
  follow_up_ttft_warm_s     conversation, with the cache cleared / with the earlier turns cached
  itl_solo_p50_ms/p95_ms    one stream's inter-token latency, alone
  itl_during_prefill_*      the same stream while another request prefills a 3,000-token document
                            (p50, p95 and the longest gap: a time slice, where the engine takes them)
  document_*                that document's first token beside the stream (which runs past
                            then: stream_ran_throughout), alone, and the ratio
  streams_4_*               4 streams at once against 1, after short and 1,000-token prompts
                            (decode tokens per second once all are decoding, each the best of
                            two runs taken in turn, and the ratio)
  short_during_long_*       a 20-token request sent 1 s into a 12,000-token prefill (or the
                            context less a margin): its first token, and alone
  requests_8_*              8 requests of ~150 tokens sent at once: first and last first token
  peak_rss_mb, peak_gpu_mb  the process's peak resident memory, and the GPU's on CUDA

Speed targets are checked here, never by timed assertions in tests.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.engine import Engine, EngineConfig
from app.engine.events import Finished, Token
from app.engine.sampling import SamplingParams
from app.models import decode_step
from app.models.chat_template import Message, encode_chat
from app.models.loader import LoadedModel
from app.models.prompt import bos_prefix

_SENTENCES = [
    "The committee reviewed the quarterly figures and asked for a clearer breakdown of costs.",
    "Rain moved in from the west during the afternoon, and the harbour emptied quickly.",
    "She rewrote the parser so that every error carried the line and column where it began.",
    "A good index turns a full scan into a handful of page reads, which matters at scale.",
    "The museum's new wing holds maps from the sixteenth century, restored over ten years.",
    "Measure first, then optimise the part that the measurements say is slow.",
    "The bakery on the corner opens at six and sells out of rye bread by nine.",
    "Each chapter ends with exercises that build on the examples worked in the text.",
]


# Every figure's requests: greedy tokens, never ended early by the model's end token.
GREEDY = dict(temperature=0, ignore_eos=True)


def filler_ids(tokenizer, n_tokens: int, salt: int = 0) -> list[int]:
    """About `n_tokens` of ordinary prose (no BOS), varied by `salt` so prompts differ."""
    ids: list[int] = []
    i = salt
    while len(ids) < n_tokens:
        sentence = _SENTENCES[i % len(_SENTENCES)]
        ids += tokenizer.encode(f"{i}. {sentence} ")
        i += 1
    return ids[:n_tokens]


@dataclass
class _Trace:
    tokens: list[float]
    first_token_s: float = 0.0
    finished: Finished | None = None


def _drive(engine: Engine, jobs: dict[str, tuple[list[int], SamplingParams]],
           submit_later: dict[str, tuple[int | float, list[int], SamplingParams]] | None = None,
           until=None) -> dict[str, _Trace]:
    """Submit `jobs`, step until all end; `submit_later[id] = (after, ids, params)` injects a
    request mid-run: `after` an int = once the first job has that many tokens, a float = that
    many seconds after the start. `until(traces)` true: abort what still runs. Token times are
    taken as steps return."""
    traces = {rid: _Trace([]) for rid in jobs}
    start = {}
    for rid, (ids, params) in jobs.items():
        engine.submit(ids, params, request_id=rid)
        start[rid] = time.perf_counter()
    pending = dict(submit_later or {})
    first_job = next(iter(jobs))
    began = time.perf_counter()
    while engine.has_work or pending:
        for event in engine.step():
            trace = traces[event.request_id]
            now = time.perf_counter()
            if isinstance(event, Token):
                if not trace.tokens:
                    trace.first_token_s = now - start[event.request_id]
                trace.tokens.append(now)
            elif isinstance(event, Finished):
                trace.finished = event
        if until is not None and until(traces):
            until = None
            for rid, trace in traces.items():
                if trace.finished is None:
                    engine.abort(rid)
        for rid, (after, ids, params) in list(pending.items()):
            due = (time.perf_counter() - began >= after if isinstance(after, float)
                   else len(traces[first_job].tokens) >= after)
            if due:
                traces[rid] = _Trace([])
                engine.submit(ids, params, request_id=rid)
                start[rid] = time.perf_counter()
                del pending[rid]
    return traces


def _gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _decoding_rate(traces: dict[str, _Trace]) -> float:
    """Tokens per second over the stretch where every trace was decoding (from the last
    first token to the first last token): batched decode alone, no prefill in it."""
    start = max(t.tokens[0] for t in traces.values())
    end = min(t.tokens[-1] for t in traces.values())
    count = sum(sum(1 for x in t.tokens if start < x <= end) for t in traces.values())
    return count / (end - start) if end > start else 0.0


def run_bench(loaded: LoadedModel, decode_tokens: int = 128, stream_tokens: int = 400,
              long_prompt_tokens: int = 12_000) -> dict:
    engine = Engine(loaded, EngineConfig(kv_tokens=max(16_384, long_prompt_tokens + 1_024)))
    tok = loaded.tokenizer
    results: dict = {"model": loaded.name, "device": str(loaded.device),
                     "dtype": loaded.weights_label, "policy": loaded.policy_reason,
                     # measured now, cached and checked now, cached unchecked, ... (kernel_policy)
                     "policy_status": getattr(loaded.load_plan, "policy_status", ""),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "threads": torch.get_num_threads(), "load_s": round(loaded.load_seconds, 2),
                     "decode_step": decode_step.mode(loaded.model)}

    # 1. decode, one stream
    ids = bos_prefix(tok) + filler_ids(tok, 32)
    trace = _drive(engine, {"decode": (ids, SamplingParams(max_tokens=decode_tokens, **GREEDY))})
    results["decode_tokens_per_s"] = round(trace["decode"].finished.timings.decode_tokens_per_s, 1)
    solo = _gaps_ms(trace["decode"].tokens)

    # 2. prefill 1,024 tokens
    engine.clear_cache()
    ids = bos_prefix(tok) + filler_ids(tok, 1023, salt=1)
    trace = _drive(engine, {"prefill": (ids, SamplingParams(max_tokens=1, **GREEDY))})
    prefill_s = trace["prefill"].finished.timings.prefill_s
    results["prefill_1024_s"] = round(prefill_s, 2)
    results["prefill_tokens_per_s"] = round(1024 / prefill_s, 1)

    # 3. follow-up turn in a ~2,000-token conversation: cold, then warm
    history = [Message("user", tok.decode(filler_ids(tok, 1000, salt=2))),
               Message("assistant", tok.decode(filler_ids(tok, 900, salt=3)))]
    earlier = encode_chat(loaded.tokenizer, loaded.template, history, add_generation_prompt=False)
    follow = encode_chat(loaded.tokenizer, loaded.template,
                         history + [Message("user", "Summarise that in one sentence.")])
    assert follow[:len(earlier)] == earlier
    engine.clear_cache()
    cold = _drive(engine, {"cold": (follow, SamplingParams(max_tokens=1, **GREEDY))})["cold"]
    engine.clear_cache()
    # The earlier turns as the previous request left them in the cache.
    _drive(engine, {"earlier": (earlier, SamplingParams(max_tokens=1, **GREEDY))})
    warm = _drive(engine, {"warm": (follow, SamplingParams(max_tokens=1, **GREEDY))})["warm"]
    results["follow_up_prompt_tokens"] = len(follow)
    results["follow_up_ttft_cold_s"] = round(cold.first_token_s, 3)
    results["follow_up_ttft_warm_s"] = round(warm.first_token_s, 3)
    results["follow_up_cached_tokens"] = warm.finished.usage.cached_tokens
    results["follow_up_warm_over_cold"] = round(warm.first_token_s / cold.first_token_s, 3)

    # 4. inter-token latency alone and during a 3,000-token prefill
    engine.clear_cache()
    stream = bos_prefix(tok) + filler_ids(tok, 20, salt=4)
    document = bos_prefix(tok) + filler_ids(tok, 2999, salt=5)
    # The stream runs until its first token after the document's first token (aborted then;
    # 4,000 tokens at most), so the whole prefill happens beside it.
    def stream_went_on(t):
        return ("document" in t and bool(t["document"].tokens)
                and t["stream"].tokens[-1] > t["document"].tokens[0])

    traces = _drive(engine,
                    {"stream": (stream, SamplingParams(max_tokens=max(stream_tokens, 4_000), **GREEDY))},
                    {"document": (8, document, SamplingParams(max_tokens=1, **GREEDY))},
                    until=stream_went_on)
    doc_done = traces["document"].tokens and traces["document"].tokens[0]  # its first token
    stream_times = traces["stream"].tokens
    # The stream's tokens from the document's arrival to its first token, and the one after
    # it: the gap that spans the document's end (a time slice's pause, where there is one).
    during = ([t for t in stream_times if t <= doc_done] + [t for t in stream_times if t > doc_done][:1]
              if doc_done else stream_times)
    gaps_during = _gaps_ms(during[8:])  # from the document's submission on
    solo_p95, during_p95 = _pct(solo, 0.95), _pct(gaps_during, 0.95)
    results["itl_solo_p50_ms"] = round(statistics.median(solo), 1)
    results["itl_solo_p95_ms"] = round(solo_p95, 1)
    results["itl_during_prefill_p50_ms"] = (round(statistics.median(gaps_during), 1)
                                            if gaps_during else None)
    results["itl_during_prefill_p95_ms"] = round(during_p95, 1)
    # Where the document takes time slices (app/engine/prefill_pacer.py), the stream waits
    # one slice now and then: the p95 misses it, the longest gap shows it.
    results["itl_during_prefill_max_ms"] = round(max(gaps_during), 1) if gaps_during else None
    results["itl_p95_ratio"] = round(during_p95 / solo_p95, 2) if solo_p95 else None
    results["document_prefill_while_streaming_s"] = round(
        traces["document"].finished.timings.time_to_first_token_s, 2)

    # 4b. the same document alone
    engine.clear_cache()
    alone = _drive(engine, {"document": (document, SamplingParams(max_tokens=1, **GREEDY))})
    alone_s = alone["document"].finished.timings.time_to_first_token_s
    results["document_prefill_alone_s"] = round(alone_s, 2)
    results["document_beside_stream_over_alone"] = round(
        results["document_prefill_while_streaming_s"] / alone_s, 2)
    # Aborted once the document had its first token, not ended on its own before.
    results["stream_ran_throughout"] = traces["stream"].finished.finish_reason == "abort"

    # 5. four streams at once against one, after a short and a 1,000-token prompt.
    for context in (24, 1000):
        rates = stream_rates(engine, tok, context)
        results[f"streams_1_ctx{context}_tokens_per_s"] = round(rates[1], 1)
        results[f"streams_4_ctx{context}_tokens_per_s"] = round(rates[4], 1)
        results[f"streams_4_over_1_ctx{context}"] = round(rates[4] / rates[1], 2) if rates[1] else None
    results["aggregate_4_streams_tokens_per_s"] = results["streams_4_ctx24_tokens_per_s"]
    # ... and one stream in a long chat (a document in it): attention reads every position's
    # keys each token, so this is where the KV cache's dtype shows.
    engine.clear_cache()
    long_chat = bos_prefix(tok) + filler_ids(tok, min(4000, engine.context_length - 128), salt=30)
    _drive(engine, {"long": (long_chat, SamplingParams(max_tokens=1, **GREEDY))})
    rate = _decoding_rate(_drive(engine, {"long": (long_chat, SamplingParams(max_tokens=96, **GREEDY))}))
    results["decode_ctx4000_tokens_per_s"] = round(rate, 1)
    results["kv_dtype"] = str(loaded.kv_dtype).removeprefix("torch.")

    # 6. a short request sent during a long prefill, and alone
    engine.clear_cache()
    long_n = max(64, min(long_prompt_tokens, engine.context_length - 64))
    long_ids = bos_prefix(tok) + filler_ids(tok, long_n - 1, salt=20)
    short_ids = bos_prefix(tok) + filler_ids(tok, 19, salt=21)
    one = SamplingParams(max_tokens=1, **GREEDY)
    short_alone = _drive(engine, {"short": (short_ids, one)})["short"].first_token_s
    engine.clear_cache()
    traces = _drive(engine, {"long": (long_ids, one)}, {"short": (1.0, short_ids, one)})
    results["long_prompt_tokens"] = long_n
    results["short_during_long_prefill_ttft_s"] = round(traces["short"].first_token_s, 3)
    results["short_alone_ttft_s"] = round(short_alone, 3)

    # 7. eight requests at once, as API clients send them
    engine.clear_cache()
    jobs = {f"r{i}": (bos_prefix(tok) + filler_ids(tok, 149, salt=30 + i),
                      SamplingParams(max_tokens=16, **GREEDY)) for i in range(8)}
    firsts = sorted(t.first_token_s for t in _drive(engine, jobs).values())
    results["requests_8_first_ttft_s"] = round(firsts[0], 3)
    results["requests_8_last_ttft_s"] = round(firsts[-1], 3)
    results["requests_8_last_over_first"] = round(firsts[-1] / firsts[0], 2)

    # 8. memory
    results["peak_rss_mb"] = process_peak_rss_mb()
    if loaded.device.type == "cuda":
        results["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 0)
    return results


def evict_from_page_cache(path) -> bool:
    """Ask the OS to drop a file's cached pages (no privileges needed), so the next read is
    cold; False where the platform cannot."""
    import os

    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def measure_load_times(path, device: str = "auto", dtype: str = "auto") -> dict:
    """A first and a warm load as the window does them (`ModelSession.load`: no measurement
    before loading), in a scratch data folder so the person's caches are neither used nor
    touched:
      load_first_s         no weight cache, no policy, the file dropped from the page cache
                           where the OS allows (`load_first_cold_file`): the safe default
                           format, prepared from the GGUF blocks and saved
      policy_measurement_s the CPU policy's measurement, which the window runs in the
                           background afterwards (`policy_measured`: what it chose)
      policy_prepare_s     preparing the measured format (the background swap), when it differs
      load_warm_s          the next start: the measured format mapped from the weight cache
      engine_start_s       the engine's warm-up passes after a load (part of "ready")"""
    import os
    import tempfile
    from pathlib import Path

    from app.engine.device import WEIGHT_CACHE_ENV, load_on, load_planned, plan_from_policy
    from app.engine.kernel_policy import measure_and_choose

    results: dict = {}
    saved = {name: os.environ.get(name) for name in ("FERROX_DATA_DIR", WEIGHT_CACHE_ENV)}
    with tempfile.TemporaryDirectory(prefix="ferrox-bench-") as scratch:
        # The scratch folder's own weight cache, whatever the environment says: the first
        # load prepares and saves, the warm one maps what it saved.
        os.environ.update({"FERROX_DATA_DIR": scratch, WEIGHT_CACHE_ENV: "1"})
        try:
            results["load_first_cold_file"] = (evict_from_page_cache(path)
                                               if Path(path).is_file() else False)
            started = time.perf_counter()
            loaded = load_on(path, device, dtype, measure=False)
            results["load_first_s"] = round(time.perf_counter() - started, 2)
            started = time.perf_counter()
            Engine(loaded, EngineConfig(kv_tokens=4096))
            results["engine_start_s"] = round(time.perf_counter() - started, 2)
            plan = loaded.load_plan
            loaded.unload()
            del loaded
            if plan is not None and plan.shapes is not None:
                started = time.perf_counter()
                policy = measure_and_choose(plan.shapes, Path(scratch))
                results["policy_measurement_s"] = round(time.perf_counter() - started, 2)
                results["policy_measured"] = policy.label  # ("policy" is the run's own reason)
                new = plan_from_policy(policy, torch.device("cpu"), plan.file_bytes, plan.shapes)
                if (new.dtype, new.wide_dtype, new.int4) != (plan.dtype, plan.wide_dtype, plan.int4):
                    started = time.perf_counter()
                    load_planned(path, torch.device("cpu"), new).unload()
                    results["policy_prepare_s"] = round(time.perf_counter() - started, 2)
            started = time.perf_counter()
            loaded = load_on(path, device, dtype, measure=False)
            results["load_warm_s"] = round(time.perf_counter() - started, 2)
            results["weights"] = loaded.policy_label or loaded.weights_label
            loaded.unload()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return results


def _status_mb(field: str) -> int | None:
    """One memory line of Linux's /proc/self/status ("VmHWM", "VmRSS"), in MB; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024)
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_mb() -> int | None:
    """The process's resident memory now, MB."""
    return _status_mb("VmRSS")


def restart_peak_rss() -> bool:
    """Start the process's peak resident memory (Linux's VmHWM) again from now, so a figure
    taken later leaves out what loading did (the kernel policy's check times copies of the
    weights, briefly: ~1 GB on a CPU with a 480 MB last-level cache). False where the
    system cannot: not Linux, or a kernel (or sandbox) that takes the write and keeps the old
    peak, which is why the peak is read back and compared with the resident memory now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak, nothing else
    except OSError:
        return False
    peak, now = _status_mb("VmHWM"), resident_mb()
    # After a real restart the peak is the resident memory of that moment; another thread
    # may have freed some since, hence the slack.
    return peak is not None and now is not None and peak <= now + 32


def peak_rss_since_restart_mb() -> int | None:
    """The peak resident memory since `restart_peak_rss` (since the start without it), MB."""
    return _status_mb("VmHWM")


def process_peak_rss_mb() -> int | None:
    """The process's peak resident memory as `getrusage` tells it, MB (which a
    `restart_peak_rss` restarts too, on Linux); None on Windows, which has no `getrusage`."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**10 if sys.platform != "darwin" else 2**20))  # KB; macOS: bytes


def _larger(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def stream_prompts(tokenizer, context: int, n: int) -> list[list[int]]:
    """The prompts of n streams decoding together: `context` tokens of prose each, told
    apart by their salt (so no stream shares another's cached prefix)."""
    return [bos_prefix(tokenizer) + filler_ids(tokenizer, context, salt=10 + i) for i in range(n)]


def stream_rates(engine: Engine, tokenizer, context: int, streams: int = 4, tokens: int = 96
                 ) -> dict[int, float]:
    """Tokens per second of one stream and of `streams` at once (`stream_prompts`), greedy,
    each the best of two runs taken in turn (1, n, 1, n), as the comparison script takes its
    best of two, so a busy moment on a shared machine weighs on neither side alone.
    Each run reads its prompts first, so its streams then start decoding together. 96
    tokens: over fewer, one stream's rate moved 15% between runs (a thread-count probe or a
    busy moment weighs on a 0.6 s stretch)."""
    rates = {1: 0.0, streams: 0.0}
    for n in (1, streams) * 2:
        engine.clear_cache()
        prompts = {f"s{i}": ids for i, ids in enumerate(stream_prompts(tokenizer, context, n))}
        _drive(engine, {k: (ids, SamplingParams(max_tokens=1, **GREEDY)) for k, ids in prompts.items()})
        jobs = {k: (ids, SamplingParams(max_tokens=tokens, **GREEDY)) for k, ids in prompts.items()}
        rates[n] = max(rates[n], _decoding_rate(_drive(engine, jobs)))
    return rates


def run_dtype_comparison(path, device: str, dtypes: list[str], decode_tokens: int = 128,
                         tries: int = 2, long_context: int = 0, streams: int = 0) -> list[dict]:
    """Load time, decode and 1,024-token prefill for each weight dtype, one after another in
    one process, so the figures are comparable; with `long_context`, decode after a prompt of
    that many tokens too (`decode_long_tokens_per_s`: a long chat's pace, where attention over
    the context weighs most); with `streams`, that many streams at once against one after
    24-token prompts (`stream_rates`: `streams_1_tokens_per_s`, `streams_n_tokens_per_s`).
    Decode and prefill are each the best of
    `tries` runs on one engine (the prefix cache cleared before each), as the llama.cpp
    side of `scripts/compare_with_llama_cpp.py` takes its best of two. `auto` rows say what
    the measured policy chose and why, and whether the choice was measured or checked now
    (`policy_status`); `running_peak_rss_mb` is the peak resident memory from the end of the
    load to the end of the runs (None where it cannot be told apart from the load's), and
    `peak_rss_mb` the whole process's up to the end of that row, loads included (restarting
    Linux's peak restarts `getrusage`'s too, so the figure from before each restart is kept
    here)."""
    from app.engine.device import load_on

    rows = []
    process_peak = None
    for dtype in dtypes:
        loaded = load_on(path, device, dtype)
        process_peak = _larger(process_peak, process_peak_rss_mb())
        restarted = restart_peak_rss()
        engine = Engine(loaded, EngineConfig(kv_tokens=max(4096, long_context + decode_tokens + 64)))

        def timed_runs(ids: list[int], max_tokens: int, key) -> list[float]:
            runs = []
            for _ in range(max(1, tries)):
                engine.clear_cache()
                trace = _drive(engine, {"r": (ids, SamplingParams(max_tokens=max_tokens, **GREEDY))})["r"]
                runs.append(key(trace.finished.timings))
            return runs

        ids = bos_prefix(loaded.tokenizer) + filler_ids(loaded.tokenizer, 32)
        decode = (max(timed_runs(ids, decode_tokens, lambda t: t.decode_tokens_per_s))
                  if decode_tokens else None)
        ids = bos_prefix(loaded.tokenizer) + filler_ids(loaded.tokenizer, 1023, salt=1)
        prefill = min(timed_runs(ids, 1, lambda t: t.prefill_s))
        decode_long = None
        if long_context and decode_tokens:
            ids = bos_prefix(loaded.tokenizer) + filler_ids(loaded.tokenizer, long_context, salt=2)
            decode_long = max(timed_runs(ids, decode_tokens, lambda t: t.decode_tokens_per_s))
        rates = stream_rates(engine, loaded.tokenizer, 24, streams) if streams > 1 else {}
        rows.append({"dtype": dtype, "weights": loaded.weights_label,
                     "load_s": round(loaded.load_seconds, 2),
                     "decode_tokens_per_s": round(decode, 1) if decode else None,
                     "prefill_1024_s": round(prefill, 2),
                     "decode_long_tokens_per_s": round(decode_long, 1) if decode_long else None,
                     "streams_1_tokens_per_s": round(rates[1], 1) if rates else None,
                     "streams_n_tokens_per_s": round(rates[streams], 1) if rates else None,
                     "policy": loaded.policy_label, "why": loaded.policy_reason,
                     "policy_status": loaded.load_plan.policy_status,
                     "running_peak_rss_mb": peak_rss_since_restart_mb() if restarted else None})
        process_peak = rows[-1]["peak_rss_mb"] = _larger(process_peak, process_peak_rss_mb())
        loaded.unload()
        del engine, loaded
    return rows


def print_table(results: dict) -> None:
    width = max(map(len, results))
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
