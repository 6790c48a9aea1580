"""The engine end to end on the tiny model: paging, prefix reuse, chunking, batching, aborts."""

from __future__ import annotations

import random

import pytest
import torch

from app.engine.contiguous_kv import ContiguousKV
from app.engine.engine import Engine, EngineConfig
from app.engine.events import Failed, Finished, PrefillProgress, Queued, Token
from app.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# The app's default shaping (top-k 64, top-p 0.95). Prefill chunks are not bit-identical in
# floating point, so over a full, flat 262k-token distribution a near-tie in the race could
# in principle flip; the invariant is about sampling as it is used.
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(300, 200_000) for _ in range(n - 1)]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
        abort_after: dict[str, int] | None = None, max_steps: int = 10_000):
    """Submit everything, step until all finish; returns {id: [events]}."""
    events: dict[str, list] = {}
    for rid, (ids, params) in requests.items():
        engine.submit(ids, params, request_id=rid)
        events[rid] = []
    done = set()
    for _ in range(max_steps):
        for event in engine.step():
            events[event.request_id].append(event)
            if isinstance(event, (Finished, Failed)):
                done.add(event.request_id)
        for rid, after in (abort_after or {}).items():
            n_tokens = sum(isinstance(e, (Token, PrefillProgress)) for e in events[rid])
            if n_tokens >= after and rid not in done:
                engine.abort(rid)
        if done == set(requests):
            assert not engine.has_work
            engine.check_integrity()
            return events
    raise AssertionError("requests did not finish")


def finished(events) -> Finished:
    last = events[-1]
    assert isinstance(last, Finished), last
    return last


def tokens_of(events) -> list[int]:
    return list(finished(events).completion_ids)


def make_engine(model, **overrides) -> Engine:
    config = dict(page_size=4, kv_tokens=4096, prefill_chunk=64)
    config.update(overrides)
    return Engine(model, EngineConfig(**config))


def test_event_order_and_usage(tiny):
    events = run(make_engine(tiny), {"a": (prompt(30), GREEDY)})["a"]
    assert isinstance(events[0], Queued) and events[0].prompt_tokens == 30
    assert isinstance(events[1], PrefillProgress) and events[1].done == 0
    assert [type(e) for e in events[-13:]] == [Token] * 12 + [Finished]
    done = finished(events)
    assert done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.cached_tokens, done.usage.completion_tokens) == (30, 0, 12)


def contiguous_greedy(model, ids: list[int], kv_dtype: torch.dtype, n: int = 12
                      ) -> tuple[list[int], set[torch.dtype]]:
    """n greedy tokens from a plain contiguous-cache loop (no engine), and the dtypes the
    model's hidden states came out in."""
    kv = ContiguousKV(model.config, len(ids) + n, model.device, kv_dtype)
    tokens, dtypes, chunk = [], set(), ids
    with torch.inference_mode():
        for _ in range(n):
            hidden = model.model(torch.tensor([chunk]), kv.positions(len(chunk)), kv)
            dtypes.add(hidden.dtype)
            kv.commit(len(chunk))
            chunk = [int(model.model.logits(hidden[0, -1]).argmax())]
            tokens.append(chunk[0])
    return tokens, dtypes


def test_paged_engine_matches_contiguous_cache(tiny):
    """Greedy tokens from the paged pool equal a plain contiguous-cache loop, past the window."""
    ids = prompt(70)
    expected, _ = contiguous_greedy(tiny, ids, torch.float32)
    assert tokens_of(run(make_engine(tiny), {"a": (ids, GREEDY)})["a"]) == expected


def _with_bfloat16_kv(loaded):
    """`loaded` as a load plan with a measured bfloat16 KV cache leaves it."""
    from app.engine.device import LoadPlan

    loaded.load_plan = LoadPlan(torch.float32, None, None, "float32, bfloat16 KV", "test",
                                kv_dtype=torch.bfloat16)
    return loaded


def test_a_bfloat16_kv_cache_is_what_the_pool_holds_and_attention_reads(tokenizer):
    """Greedy tokens with a bfloat16 KV cache equal a plain contiguous bfloat16 cache's, and
    stay the same whatever the chunk and whoever shares the pass."""
    from tests.engine.conftest import make_tiny_model

    model = _with_bfloat16_kv(make_tiny_model(tokenizer))
    assert model.kv_dtype == torch.bfloat16 and model.compute_dtype == torch.float32
    ids = prompt(70)
    expected, dtypes = contiguous_greedy(model, ids, torch.bfloat16)
    assert dtypes == {torch.float32}  # attention came back in the activations' dtype
    engine = make_engine(model)
    assert engine.pool.dtype == torch.bfloat16
    assert tokens_of(run(engine, {"a": (ids, GREEDY)})["a"]) == expected
    for chunk_size in (7, len(ids)):
        assert tokens_of(run(make_engine(model, prefill_chunk=chunk_size),
                             {"a": (ids, GREEDY)})["a"]) == expected
    both = run(make_engine(model), {"a": (ids, GREEDY), "b": (prompt(33, seed=4), GREEDY)})
    assert tokens_of(both["a"]) == expected


def test_a_kv_dtype_measured_later_gets_a_new_pool_at_the_swap(tokenizer):
    from tests.engine.conftest import make_tiny_model

    ids = prompt(40, seed=3)
    with_bf16_kv = tokens_of(run(make_engine(_with_bfloat16_kv(make_tiny_model(tokenizer))),
                                 {"a": (ids, GREEDY)})["a"])
    engine = make_engine(make_tiny_model(tokenizer))
    run(engine, {"a": (ids, GREEDY)})
    assert engine.pool.dtype == torch.float32
    engine.replace_weights(_with_bfloat16_kv(make_tiny_model(tokenizer)))
    engine.step()
    assert engine.replacements_handled == 1 and engine.pool.dtype == torch.bfloat16
    again = run(engine, {"b": (ids, GREEDY)})["b"]
    assert tokens_of(again) == with_bf16_kv and finished(again).usage.cached_tokens == 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunk_size_never_changes_the_tokens(tiny, params):
    ids = prompt(90)  # past the tiny model's 16-token sliding window
    results = {}
    for chunk in (1, 7, 64, len(ids)):
        events = run(make_engine(tiny, prefill_chunk=chunk), {"a": (ids, params)})["a"]
        results[chunk] = tokens_of(events)
    assert len(set(map(tuple, results.values()))) == 1, results


def test_follow_up_turn_adopts_the_whole_conversation(tiny):
    engine = make_engine(tiny)
    turn1 = prompt(41)
    reply = tokens_of(run(engine, {"t1": (turn1, GREEDY)})["t1"])
    turn2 = turn1 + reply + prompt(9, seed=5)[1:]
    warm = finished(run(engine, {"t2": (turn2, GREEDY)})["t2"])
    # Everything written before is cached, page-aligned: prompt + reply minus the last token.
    written = len(turn1) + len(reply) - 1
    assert warm.usage.cached_tokens == written // 4 * 4
    cold = finished(run(make_engine(tiny), {"t2": (turn2, GREEDY)})["t2"])
    assert cold.usage.cached_tokens == 0
    assert warm.completion_ids == cold.completion_ids


def test_identical_prompt_is_backed_off_by_a_page(tiny):
    engine = make_engine(tiny)
    ids = prompt(32)  # a whole number of pages
    first = finished(run(engine, {"a": (ids, GREEDY)})["a"])
    again = finished(run(engine, {"b": (ids, GREEDY)})["b"])
    assert again.usage.cached_tokens == 28  # at least one token is left to run
    assert again.completion_ids == first.completion_ids


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    alone = tokens_of(run(make_engine(tiny), {"a": (prompt(20), SEEDED)})["a"])
    crowd = {"a": (prompt(20), SEEDED)}
    crowd.update({f"o{i}": (prompt(15 + i, seed=i), SamplingParams(max_tokens=9, seed=i))
                  for i in range(3)})
    together = run(make_engine(tiny), crowd)
    assert tokens_of(together["a"]) == alone


def test_different_seeds_differ_and_no_seed_is_random(tiny):
    engine = make_engine(tiny)
    base = dict(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, ignore_eos=True)
    runs = run(engine, {"a": (prompt(10), SamplingParams(seed=1, **base)),
                        "b": (prompt(10), SamplingParams(seed=2, **base))})
    assert tokens_of(runs["a"]) != tokens_of(runs["b"])
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    runs = run(engine, {"c": (prompt(10), unseeded), "d": (prompt(10), unseeded)})
    assert tokens_of(runs["c"]) != tokens_of(runs["d"])


def test_several_requests_decode_together(tiny):
    engine = make_engine(tiny)
    requests = {f"r{i}": (prompt(10 + 3 * i, seed=i), GREEDY) for i in range(5)}
    together = run(engine, requests)
    for rid, (ids, params) in requests.items():
        alone = run(make_engine(tiny), {rid: (ids, params)})
        assert tokens_of(together[rid]) == tokens_of(alone[rid])


def test_abort_mid_prefill_releases_everything(tiny):
    engine = make_engine(tiny, prefill_chunk=8)
    events = run(engine, {"long": (prompt(200), GREEDY), "short": (prompt(12, 3), GREEDY)},
                 abort_after={"long": 3})
    assert finished(events["long"]).finish_reason == "abort"
    assert not any(isinstance(e, Token) for e in events["long"])
    assert finished(events["short"]).finish_reason == "length"
    alone = run(make_engine(tiny), {"short": (prompt(12, 3), GREEDY)})
    assert tokens_of(events["short"]) == tokens_of(alone["short"])


def test_a_prompt_aborted_mid_prefill_leaves_its_computed_pages_for_the_retry(tiny):
    # A running sequence's keys live in its contiguous copy; the pages it computed reach the
    # pool when it ends (kv_pool: forget(write_back=True)). A retry of the same prompt adopts
    # them and must answer as a cold engine does.
    engine = make_engine(tiny, prefill_chunk=8)
    ids = prompt(60, seed=7)
    events = run(engine, {"a": (ids, GREEDY)}, abort_after={"a": 4})
    assert finished(events["a"]).finish_reason == "abort"
    retry = finished(run(engine, {"b": (ids, GREEDY)})["b"])
    assert retry.usage.cached_tokens >= 24  # at least three 8-token chunks were read
    cold = finished(run(make_engine(tiny), {"b": (ids, GREEDY)})["b"])
    assert retry.completion_ids == cold.completion_ids


def test_abort_mid_decode_keeps_what_was_said(tiny):
    engine = make_engine(tiny)
    events = run(engine, {"a": (prompt(20), SamplingParams(max_tokens=50, temperature=0,
                                                            ignore_eos=True))},
                 abort_after={"a": 6})
    done = finished(events["a"])
    assert done.finish_reason == "abort"
    assert 0 < done.usage.completion_tokens < 50
    # The aborted conversation's pages were published: a retry adopts them.
    retry = finished(run(engine, {"b": (prompt(20), GREEDY)})["b"])
    assert retry.usage.cached_tokens == 16


def test_abort_of_a_queued_request(tiny):
    engine = make_engine(tiny)
    engine.submit(prompt(10), GREEDY, request_id="q")
    engine.abort("q")
    events = engine.step()
    assert [type(e) for e in events] == [Queued, Finished]
    assert events[-1].finish_reason == "abort"
    engine.check_integrity()


def test_pool_exhaustion_queues_and_recovers(tiny):
    # 40 usable pages of 4 tokens; each request reserves ceil((30 + 12) / 4) = 11 pages.
    engine = make_engine(tiny, kv_tokens=160)
    for i in range(6):
        engine.submit(prompt(30, seed=i), GREEDY, request_id=f"r{i}")
    most_running, order = 0, []
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, PrefillProgress) and event.done == 0:
                order.append(("admitted", event.request_id))
            if isinstance(event, Finished):
                assert event.finish_reason == "length"
                order.append(("finished", event.request_id))
        most_running = max(most_running, len(engine._running))
        engine.check_integrity()
    assert most_running == 3  # the pool fits three reservations at once
    assert order.index(("admitted", "r3")) > order.index(("finished", "r0"))
    assert sum(1 for kind, _ in order if kind == "finished") == 6


def test_cached_prefixes_are_evicted_for_new_requests(tiny):
    engine = make_engine(tiny, kv_tokens=160)
    for i in range(8):  # each leaves ~10 cached pages behind; the pool holds 40
        run(engine, {f"r{i}": (prompt(30, seed=100 + i), GREEDY)})
    assert engine.cache.cached_pages <= engine.pages.usable


def test_a_request_that_can_never_fit_fails_clearly(tiny):
    engine = make_engine(tiny, kv_tokens=64)
    events = run(engine, {"big": (prompt(100), GREEDY)})["big"]
    assert isinstance(events[-1], Failed) and "KV memory" in events[-1].message
    events = run(engine, {"ctx": (prompt(10), SamplingParams(max_tokens=5000))})["ctx"]
    assert isinstance(events[-1], Failed) and "context" in events[-1].message
    events = run(engine, {"vocab": ([2, 10**7], GREEDY)})["vocab"]
    assert isinstance(events[-1], Failed) and "vocabulary" in events[-1].message


def test_empty_prompt_runs_on_bos_and_reports_zero_prompt_tokens(tiny):
    events = run(make_engine(tiny), {"e": ([], GREEDY)})["e"]
    done = finished(events)
    assert done.usage.prompt_tokens == 0 and done.usage.completion_tokens == 12


def stream_beside_a_document(engine: Engine, doc_tokens: int = 1500):
    """Start a stream, then a document; yield (stream tokens, document tokens done or None,
    the pass's events) per pass until the document is prefilled."""
    engine.submit(prompt(10), STREAM, request_id="stream")
    for _ in range(5):
        yield 1, None, engine.step()
    engine.submit(prompt(doc_tokens, seed=9), GREEDY, request_id="doc")
    while True:
        events = engine.step()
        progress = [e.done for e in events if isinstance(e, PrefillProgress) and e.request_id == "doc"]
        streamed = sum(isinstance(e, Token) and e.request_id == "stream" for e in events)
        yield streamed, (progress[-1] if progress else None), events
        if progress and progress[-1] == doc_tokens:
            return


STREAM = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def test_long_prefill_mixes_into_every_pass_where_chunks_are_cheap(tiny):
    """Mixing (min_interleave_chunk 0: always): every pass carries the stream's token and
    a chunk of the document."""
    engine = make_engine(tiny, prefill_chunk=512, min_interleave_chunk=0, interleave_ratio=50)
    passes = list(stream_beside_a_document(engine))[5:]
    assert all(streamed == 1 for streamed, _, _ in passes)  # the stream never waits a pass
    assert all(done is not None for _, done, _ in passes)
    assert len(passes) >= 3  # the document was split across several passes


def test_long_prefill_takes_time_slices_where_chunks_are_dear(tiny):
    """Time slices (a mixed pass would hold fewer than min_interleave_chunk tokens; ratio 1
    holds none): from the document's arrival, `slice_every` passes carry the stream's token
    alone, then the document runs alone in passes of up to `prefill_chunk`, and so on;
    chunks and slices change none of the stream's tokens."""
    alone = tokens_of(run(make_engine(tiny), {"stream": (prompt(10), STREAM)})["stream"])
    engine = make_engine(tiny, prefill_chunk=64, min_interleave_chunk=8, interleave_ratio=1.0,
                         slice_every=3, max_slice_s=1e-9)  # every slice: one chunk pass
    assert not engine.pacer.mixes()
    passes = list(stream_beside_a_document(engine))
    kinds = ["slice" if done and not streamed else "stream" if streamed and not done
             else (streamed, done) for streamed, done, _ in passes[5:]]  # (done 0: admitted)
    assert set(kinds) == {"slice", "stream"}, kinds  # never both in one pass
    slices = [i for i, kind in enumerate(kinds) if kind == "slice"]
    assert len(slices) == -(-1500 // 64)
    assert slices[0] == 3  # the first slice too waits for 3 stream passes
    assert all(b - a == 4 for a, b in zip(slices, slices[1:]))  # 3 stream passes between
    events = [e for _, _, step in passes for e in step if e.request_id == "stream"]
    while not isinstance(events[-1], Finished):
        events += [e for e in engine.step() if e.request_id == "stream"]
    assert tokens_of(events) == alone


def test_the_pacer_is_told_what_is_left_of_the_prompts_after_each_pass(tiny, monkeypatch):
    """What lets a slice run on to finish a document (`PrefillPacer.learn`'s prompt_left)."""
    engine = make_engine(tiny, prefill_chunk=64, min_interleave_chunk=8, interleave_ratio=1.0,
                         slice_every=3, max_slice_s=1e-9)
    told = []
    real = engine.pacer.learn

    def learn(seconds, prompt_tokens, paced_tokens, streaming, prompt_left=0):
        told.append((prompt_tokens, prompt_left))
        real(seconds, prompt_tokens, paced_tokens, streaming, prompt_left=prompt_left)

    monkeypatch.setattr(engine.pacer, "learn", learn)
    list(stream_beside_a_document(engine, doc_tokens=1500))
    read = [(n, left) for n, left in told if n]
    assert read[0] == (10, 0)  # the stream's own short prompt
    # then the document in 24 passes of up to 64 tokens (one slice each)
    assert read[1:] == [(min(64, 1500 - 64 * i), max(1500 - 64 * (i + 1), 0)) for i in range(24)]


def test_a_document_aborted_in_its_slice_gives_the_streams_the_next_pass(tiny):
    engine = make_engine(tiny, prefill_chunk=64, min_interleave_chunk=8, interleave_ratio=1.0,
                         slice_every=2, max_slice_s=60.0)  # a slice would take the whole document
    passes = stream_beside_a_document(engine, doc_tokens=1500)
    for streamed, done, _ in passes:
        if done and not streamed:  # in the slice
            break
    engine.abort("doc")
    events = engine.step()
    assert any(isinstance(e, Token) and e.request_id == "stream" for e in events)
    assert any(isinstance(e, Finished) and e.request_id == "doc" for e in events)


def test_a_short_request_is_not_held_behind_a_long_prefill(tiny):
    """Shortest remaining prompt first: a 20-token request sent during a 1,500-token prefill
    gets its first token from the next pass, and the document keeps moving in that pass."""
    engine = make_engine(tiny, prefill_chunk=64)
    engine.submit(prompt(1500, seed=9), GREEDY, request_id="doc")
    for _ in range(3):
        engine.step()
    engine.submit(prompt(20, seed=3), GREEDY, request_id="short")
    events = engine.step()
    assert any(isinstance(e, Token) and e.request_id == "short" for e in events)
    doc = [e for e in events if isinstance(e, PrefillProgress) and e.request_id == "doc"]
    assert doc and doc[-1].done < 1500  # the rest of the pass went to the document


def engine_with_a_stream(model, **overrides) -> Engine:
    """An engine whose request "stream" has sampled its first token (so it is decoding)."""
    # min_interleave_chunk 0: the document mixes into every pass, at the chunk set below.
    engine = make_engine(model, min_interleave_chunk=0, interleave_ratio=1.0, **overrides)
    engine.submit(prompt(10), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                  request_id="stream")
    while not any(isinstance(e, Token) for e in engine.step()):
        pass
    return engine


def prefill_done(events, request_id: str) -> list[int]:
    """Prompt tokens done, per PrefillProgress event of `request_id` in `events`."""
    return [e.done for e in events if isinstance(e, PrefillProgress) and e.request_id == request_id]


def test_short_prompts_run_whole_beside_a_stream_and_a_document_keeps_its_pace(tiny):
    """While a stream runs, prompts of at most `short_prompt_tokens` new tokens are prefilled
    whole in the next pass (together at most `prefill_chunk`); what does not fit, and a
    document, share the interleaved chunk (shortest first); the stream gets its token every
    pass."""
    engine = engine_with_a_stream(tiny, prefill_chunk=64, short_prompt_tokens=24)
    engine.submit(prompt(300, seed=9), GREEDY, request_id="doc")
    for i in range(4):  # 4 x 20 tokens: three fit the 64-token share whole
        engine.submit(prompt(20, seed=10 + i), GREEDY, request_id=f"short{i}")
    # The interleaved chunk is steered from timed passes; set it, as the steering would, so
    # the shares below do not depend on this machine's timing (passes that ran short
    # prompts whole do not steer it).
    engine.pacer.interleave_chunk = 8
    events = engine.step()
    firsts = {e.request_id for e in events if isinstance(e, Token)}
    assert firsts == {"stream", "short0", "short1", "short2"}
    assert prefill_done(events, "short3")[-1] == 8  # the fourth took the interleaved chunk
    assert prefill_done(events, "doc") == [0]  # admitted; its turn comes after the shorter prompt
    events = engine.step()
    assert {"stream", "short3"} <= {e.request_id for e in events if isinstance(e, Token)}
    assert prefill_done(events, "doc")[-1] == 8  # the interleaved chunk, not the whole


def test_short_prompt_tokens_zero_interleaves_every_prompt(tiny):
    # prefill_chunk 16 caps the steered chunk below the 20-token prompt.
    engine = engine_with_a_stream(tiny, prefill_chunk=16, short_prompt_tokens=0)
    engine.submit(prompt(20, seed=3), GREEDY, request_id="short")
    chunk = engine.pacer.interleave_chunk
    events = engine.step()
    assert prefill_done(events, "short")[-1] == chunk < 20  # the interleaved chunk only
    assert not any(isinstance(e, Token) and e.request_id == "short" for e in events)


def test_weights_in_another_format_are_swapped_in_between_requests(tokenizer):
    """The policy tuner's swap: a request running when new weights arrive finishes on the old
    ones; the next runs on the new ones, with no prefix cached from the old weights."""
    from tests.engine.conftest import make_tiny_model

    old, new = make_tiny_model(tokenizer), make_tiny_model(tokenizer, dtype=torch.bfloat16)
    new_model = new.model
    ids = prompt(40, seed=3)
    with_old = tokens_of(run(make_engine(make_tiny_model(tokenizer)), {"a": (ids, GREEDY)})["a"])
    with_new = tokens_of(run(make_engine(make_tiny_model(tokenizer, dtype=torch.bfloat16)),
                             {"a": (ids, GREEDY)})["a"])
    engine = make_engine(old)
    engine.submit(ids, GREEDY, request_id="a")
    events = []
    for _ in range(3):
        events += engine.step()
    engine.replace_weights(new)
    while not any(isinstance(e, Finished) for e in events):
        events += engine.step()
        assert engine.loaded.model is not new_model  # never while the request runs
    assert list(next(e for e in events if isinstance(e, Finished)).completion_ids) == with_old
    assert engine.has_work  # the swap is pending
    engine.step()
    assert engine.replacements_handled == 1 and not engine.has_work
    assert engine.loaded.model is new_model and engine.loaded.dtype == torch.bfloat16
    again = run(engine, {"b": (ids, GREEDY)})["b"]
    assert tokens_of(again) == with_new and finished(again).usage.cached_tokens == 0


def test_on_compiled_layers_a_stream_decodes_alike_beside_a_prompt(smollm2_model_path, monkeypatch):
    """Where decode passes run every layer as one compiled call (`int4_i8`), whose float32
    glue is not torch's bit for bit, a stream's tokens are computed in passes of one-token
    requests even while a prompt is read beside it (`Engine._forward`): its logits are those
    it gets alone, bit for bit."""
    from app.models import decode_step, int8_products
    from app.models.loader import load_model
    from tests.models.test_decode_step import INT8_RUNTIME

    if not int8_products.available():
        pytest.skip(f"the compiled kernels cannot run here ({int8_products.unavailable_reason()})")
    loaded = load_model(smollm2_model_path, torch.device("cpu"), torch.float16, torch.float32,
                        int4=INT8_RUNTIME)
    assert decode_step.compiled_layers(loaded.model)
    STREAM = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    def stream_logits(beside: bool) -> list[torch.Tensor]:
        engine = make_engine(loaded, prefill_chunk=32, short_prompt_tokens=16)
        assert engine._decode_apart
        rows, passes = [], []
        sample, forward_pass = engine._sample, engine._forward_pass

        def record(request, row, events):
            if request.id == "a":
                rows.append(row.clone())
            sample(request, row, events)

        def count(batch):
            passes.append(sorted(len(chunk) for _, chunk in batch))
            return forward_pass(batch)

        monkeypatch.setattr(engine, "_sample", record)
        monkeypatch.setattr(engine, "_forward_pass", count)
        vocab = loaded.model.vocab_size
        engine.submit([t % vocab for t in prompt(12)], STREAM, request_id="a")
        for _ in range(100):  # its prompt alone, then its first token
            if rows:
                break
            engine.step()
        if beside:  # a short prompt, read in the stream's next step, and a long one in chunks
            engine.submit([t % vocab for t in prompt(10, seed=5)],
                          SamplingParams(max_tokens=2, ignore_eos=True), request_id="short")
            engine.submit([t % vocab for t in prompt(300, seed=6)],
                          SamplingParams(max_tokens=2, ignore_eos=True), request_id="doc")
        for _ in range(1000):
            if not engine.has_work:
                break
            engine.step()
        if beside:  # the short prompt read in a pass apart from the stream's step, the same step
            assert [10] in passes and passes[passes.index([10]) - 1] == [1]
        return rows

    alone, beside = stream_logits(False), stream_logits(True)
    assert len(alone) == len(beside) == STREAM.max_tokens
    for got, want in zip(beside, alone):
        assert torch.equal(got, want)
