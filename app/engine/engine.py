"""The engine: continuous batching over a paged KV pool with radix prefix reuse.

API: `submit` and `abort` (thread-safe: they only enqueue), `step` (one scheduling
iteration, run by the engine's own thread), events out as plain data (`app.engine.events`).

One step reads as one sentence: take commands -> admit waiting requests -> one forward pass
that carries a decode token for every running request plus, within a budget, the next
prefill chunk -> sample -> report. Decode comes first so streams never wait behind a long
prompt; while others stream, the pacer (`prefill_pacer.py`) says how many prompt tokens a
pass carries (a chunk in every pass, or a time slice every few passes), and up to
`prefill_chunk` when no one is waiting for a token.

Invariants (docs/ARCHITECTURE.md, "The engine's invariants"):
  - a prefill starts at `request.written`, read off the KV; adopted and cold prefixes take
    one path;
  - an adopted prefix is backed off so at least one prompt token is left to run;
  - pages for prompt + max_tokens are reserved at admission; a request that does not fit
    waits (evicting unlocked cache first), one that can never fit fails with a message;
  - a finished (or aborted) request publishes every full page it wrote -- prompt and reply
    -- into the radix tree, so the next turn adopts the whole conversation;
  - usage reports the real prompt length.
"""

from __future__ import annotations

import itertools
import os
import queue
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from app.chat.budget import plan_reply
from app.engine.device import cpu_threads
from app.engine.events import (Event, Failed, Finished, PrefillProgress, Queued, Timings, Token,
                               Usage)
from app.engine.kv_disk import KVDiskStore, KVDiskWriter, chain_keys
from app.engine.kv_pool import PagedBatchView, PagedKVPool
from app.engine.prefill_pacer import PassPlan, PrefillPacer
from app.engine.radix_cache import PagePool, RadixCache
from app.engine.request import Phase, Request
from app.engine.thread_tuner import ThreadTuner
from app.engine.sampling import SamplingParams
from app.heap import release_freed_memory
from app.models import decode_step
from app.models.loader import LoadedModel


_WARM_UP = ("warm-up",)  # the warm-up's scratch sequence, as the pool's key for its KV copy


class EngineError(ValueError):
    """A request the engine refuses at submission; the message says why."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_tokens: int = 65_536  # pool capacity in tokens, shared by all chats and the cache
    prefill_chunk: int = 512  # most prompt tokens in one pass when nobody is streaming
    # While others stream, a long prompt shares the machine one of two ways, chosen from
    # measured costs (app/engine/prefill_pacer.py). Mixing: every pass carries a chunk that
    # keeps it within `interleave_ratio` decode passes -- used when at least
    # `min_interleave_chunk` prompt tokens fit (0: always mix). Otherwise time slices:
    # `slice_every` passes of decode tokens only, then the prompt runs alone (chunks of
    # `prefill_chunk`) for a slice giving it `prefill_share` of the time, at most
    # `max_slice_s`. (On 2-core CPUs a 16-token chunk mixed into every pass made a stream's
    # tokens 4.3-4.7x slower and read a 3,000-token document 3-4x slower than alone.)
    interleave_ratio: float = 2.3
    min_interleave_chunk: int = 64
    prefill_share: float = 0.75
    slice_every: int = 24
    max_slice_s: float = 3.0
    # A prompt with at most this many new tokens (a chat message, an API request) runs whole
    # in the next pass even while others stream, such prompts together up to `prefill_chunk`:
    # a stream's step runs longer once, instead of a new message's first token waiting at a
    # document's interleaved pace (8 requests of ~150 tokens sent at once: the last first
    # token came 3.8-5x after the first while the early ones streamed).
    short_prompt_tokens: int = 256
    max_batch: int = 16  # running requests decoding together
    # Most tokens one conversation may hold (prompt + reply); None = the model's full context.
    # Smaller keeps long prompts quick on a slow machine.
    context_limit: int | None = None
    # On the CPU, learn from the passes whether all threads or half of them run faster now
    # (app/engine/thread_tuner.py); off when the user pinned OMP_NUM_THREADS.
    tune_threads: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.prefill_chunk < 1:
            raise ValueError("page size and chunk sizes must be positive")
        if self.min_interleave_chunk < 0 or self.slice_every < 0:
            raise ValueError("min_interleave_chunk and slice_every cannot be negative")
        if not 0 < self.prefill_share < 1 or self.max_slice_s <= 0:
            raise ValueError("prefill_share must be between 0 and 1, max_slice_s positive")
        if self.kv_tokens < 2 * self.page_size:
            raise ValueError("the KV pool must hold at least two pages")
        if self.short_prompt_tokens < 0:
            raise ValueError("short_prompt_tokens cannot be negative")
        if self.interleave_ratio < 1:
            raise ValueError("interleave_ratio must be at least 1")
        if self.context_limit is not None and self.context_limit < 64:
            raise ValueError("the context limit must be at least 64 tokens")


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                 kv_store: KVDiskStore | None = None):
        self.loaded = loaded
        # Decode passes on a path of their own: one-token requests run apart (`_forward`).
        self._decode_apart = decode_step.compiled_layers(loaded.model)
        self.config = config
        # The prefix cache on disk (optional): finished conversations are saved when the
        # engine is idle, and a prompt extending a saved prefix reads it back.
        self.kv_store = kv_store
        self._kv_writer = KVDiskWriter(kv_store) if kv_store is not None else None
        self._pending_saves: list[tuple[list[int], str | None]] = []
        self._cache_owners: dict[str, str] = {}
        self.pool, self.pages = self._new_pool()
        self.cache = RadixCache(config.page_size)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admitted, in admission order
        self._ids = itertools.count(1)
        # How many prompt tokens a pass carries while others stream, learned from the passes.
        self.pacer = PrefillPacer(config)
        # Weights in another format waiting to be swapped in between requests (replace_weights).
        self._replacement: tuple[LoadedModel, KVDiskStore | None] | None = None
        self.replacements_handled = 0  # swapped in or refused, for whoever waits on one
        # From the configured count, not torch's current one: an engine before this one (a
        # model swap, bench's next run) may have left its thread on the fewer-threads count.
        self.threads = ThreadTuner(cpu_threads() if self._tunes_threads() else 1,
                                   torch.set_num_threads)
        self._warm_up()

    def _tunes_threads(self) -> bool:
        return (self.config.tune_threads and self.loaded.device.type == "cpu"
                and "OMP_NUM_THREADS" not in os.environ)

    @torch.inference_mode()
    def _warm_up(self, small: int = 4, chunk: int = 32) -> None:
        """Passes of 1, `small` and `chunk` tokens on scratch pages, twice: the first call of
        each kernel is slow (lazy initialisation); the second round's timings give the
        decode pass and a first guess at the interleaved chunk. The scratch sequence keeps a
        KV copy as a request's does, so its one-token pass is a decode pass as the engine
        runs them (the scripted decode step, app.models.decode_step, compiled here rather
        than in the first reply)."""
        ps = self.config.page_size
        pages = self.pages.allocate(min(-(-chunk // ps), self.pages.free_count))
        chunk = min(chunk, len(pages) * ps)
        small = min(small, chunk - 1)
        try:
            for _ in range(2):
                times = {n: self._timed_pass(pages, n) for n in (1, small, chunk)}
            self.pacer.warmed_up(times[1], small, times[small], chunk, times[chunk])
        finally:
            self.pool.forget(_WARM_UP)
            self.pages.release(pages)

    def _timed_pass(self, pages: list[int], n: int) -> float:
        view = PagedBatchView(self.pool, [pages], [0], [n], keys=[_WARM_UP])
        tokens = torch.full((1, n), self.loaded.filler_token_id, device=self.loaded.device)
        started = time.perf_counter()
        self.loaded.model.logits(self.loaded.model(tokens, view.positions(), view)[0, -1:])
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    # ---- thread-safe API ---------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None, cache_owner: str | None = None) -> str:
        """Queue a request; returns its id. Safe from any thread. `cache_owner` (e.g. a chat)
        is recorded with the pages saved to disk, so `forget_cache_owner` can delete them."""
        request_id = request_id or f"req-{next(self._ids)}"
        if cache_owner is not None:
            self._cache_owners[request_id] = cache_owner
        self._commands.put(("submit", request_id, list(prompt_ids), params))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, prefilling, decoding). Safe from any thread."""
        self._commands.put(("abort", request_id))

    def clear_cache(self) -> None:
        """Drop every cached prefix not in use (e.g. to measure a cold start)."""
        self._commands.put(("clear_cache",))

    def replace_weights(self, fresh: LoadedModel, kv_store: KVDiskStore | None = None) -> None:
        """Swap in the same model loaded in another weight format (what the CPU policy
        measured faster), with the disk store for that format. Safe from any thread; applied
        when no request is running or waiting, so no request mixes two formats. The prefix
        cache is dropped (its KV came from the old weights) and the warm-up timings, which
        steer the interleaved chunk, are taken again."""
        self._commands.put(("replace_weights", fresh, kv_store))

    # ---- the engine thread -------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or not self._commands.empty()
                    or self._pending_saves or self._replacement is not None)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        events: list[Event] = []
        self._take_commands(events)
        if self._replacement is not None and not self._running and not self._waiting:
            self._swap_weights()
        self._admit(events)
        self._restore_some(events)
        if self._running:
            self._run_pass(events)
        elif not self._waiting:
            self._save_pending()
        return events

    def close(self) -> None:
        """Save what finished conversations left in the cache, then stop the disk writer."""
        self._save_pending()
        if self._kv_writer is not None:
            self._kv_writer.close()
            self._kv_writer = None

    def reset(self) -> None:
        """After an internal error: drop every request and the cache, start clean."""
        self._waiting.clear()
        self._running.clear()
        self.pool.forget_all()
        self.pages = PagePool(self.pages.num_pages)
        self.cache = RadixCache(self.config.page_size)

    def check_integrity(self) -> None:
        in_use = [p for r in self._running for p in r.own_pages]
        self.cache.check_integrity(self.pages, in_use)

    @property
    def context_length(self) -> int:
        limit = self.config.context_limit
        return min(self.loaded.context_length, limit) if limit else self.loaded.context_length

    # ---- commands ----------------------------------------------------------------------

    def _take_commands(self, events: list[Event]) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "submit":
                self._accept(*command[1:], events)
            elif kind == "abort":
                self._abort(command[1], events)
            elif kind == "clear_cache":
                self.pages.release(self.cache.clear())
            elif kind == "replace_weights":
                self._replacement = command[1], command[2]
            elif kind == "forget_owner":
                self._forget_owner(command[1])

    def _forget_owner(self, owner: str) -> None:
        self._pending_saves = [(tokens, o) for tokens, o in self._pending_saves if o != owner]
        if self._kv_writer is not None:
            self._kv_writer.forget(owner)
        elif self.kv_store is not None:
            self.kv_store.forget_owner(owner)

    def _swap_weights(self) -> None:
        (fresh, store), self._replacement = self._replacement, None
        try:
            self._swap_in(fresh, store)
        finally:
            del fresh
            release_freed_memory()  # the old weights' pages (see `app.heap`)
            self.replacements_handled += 1

    def _new_pool(self) -> tuple[PagedKVPool, PagePool]:
        config, loaded = self.config, self.loaded
        num_pages = config.kv_tokens // config.page_size + 1  # + the reserved page 0
        return (PagedKVPool(loaded.kv_facts, num_pages, config.page_size, loaded.device,
                            loaded.kv_dtype), PagePool(num_pages))

    def _swap_in(self, fresh: LoadedModel, store: KVDiskStore | None) -> None:
        loaded = self.loaded
        if fresh.compute_dtype != loaded.compute_dtype or fresh.kv_facts != loaded.kv_facts:
            return  # the KV pool would not fit it; keep what serves
        self._save_pending()  # what finished so far belongs to the old format's store
        if store is not None or self.kv_store is not None:
            if self._kv_writer is not None:
                self._kv_writer.close()
            self.kv_store = store
            self._kv_writer = KVDiskWriter(store) if store is not None else None
        # In place: whoever holds this LoadedModel (the session) sees the new format.
        for name in ("model", "dtype", "wide_dtype", "weight_format", "policy_label",
                     "policy_reason", "load_plan"):
            setattr(loaded, name, getattr(fresh, name))
        self.pages.release(self.cache.clear())
        if self.pool.dtype != loaded.kv_dtype:  # the policy measured another KV dtype
            # Nothing runs or waits (see `step`), so no sequence holds a page: a new pool.
            self.pool, self.pages = self._new_pool()
        self._warm_up()

    def _accept(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                events: list[Event]) -> None:
        loaded = self.loaded
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else loaded.stop_token_ids)
        template_stops = getattr(loaded.template, "stop_strings", ())
        if template_stops and not params.ignore_eos:  # formats whose turns end in plain text
            params = replace(params, stop=tuple(params.stop) + tuple(template_stops))
        request = Request(id=request_id, prompt_ids=prompt_ids, params=params,
                          stop_token_ids=stop_ids, stream=loaded.tokenizer.stream_decoder(),
                          tokens=prompt_ids or [loaded.filler_token_id])
        problem = self._refusal(request)
        if problem:
            events.append(Failed(request_id, problem))
            return
        request.sampler.observe(request.tokens)
        self._waiting.append(request)
        events.append(Queued(request_id, len(prompt_ids)))

    def _refusal(self, request: Request) -> str | None:
        vocab = self.loaded.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            return f"The prompt holds a token id outside the vocabulary (0..{vocab - 1})."
        total = len(request.tokens) + request.params.max_tokens
        # The one context budget (app/chat/budget.py): the engine never lowers max_tokens.
        plan = plan_reply(self.context_length, len(request.tokens), request.params.max_tokens,
                          clamp=False)
        if not plan.fits:
            return (f"The prompt has {len(request.prompt_ids):,} tokens and the reply may take "
                    f"{request.params.max_tokens:,} more, but the model's context holds "
                    f"{self.context_length:,}. Shorten the prompt or lower max tokens by "
                    f"{plan.over:,}.")
        if request.pages_needed(self.config.page_size) > self.pages.usable:
            return (f"The prompt and reply need {total:,} tokens of KV memory but the engine "
                    f"was given {self.config.kv_tokens:,}. Lower max tokens or raise the KV "
                    "memory setting.")
        return None

    def _abort(self, request_id: str, events: list[Event]) -> None:
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                request.finish_reason = "abort"
                events.append(self._finished(request))
                return
        for request in self._running:
            if request.id == request_id:
                request.finish_reason = "abort"
                self._retire(request, events)
                return

    # ---- admission ---------------------------------------------------------------------

    def _admit(self, events: list[Event]) -> None:
        """FCFS: the head of the queue is admitted when its pages fit; nobody overtakes it."""
        while self._waiting and len(self._running) < self.config.max_batch:
            request = self._waiting[0]
            if not self._reserve(request):
                return
            self._waiting.popleft()
            request.phase = Phase.PREFILL
            request.admitted_at = time.perf_counter()
            self._running.append(request)
            events.append(PrefillProgress(request.id, request.written, len(request.tokens),
                                          request.cached_tokens))

    def _reserve(self, request: Request) -> bool:
        ps = self.config.page_size
        path = self.cache.match(request.tokens)
        # Back off so at least one prompt token is left to run: its logits give the first
        # sampled token.
        path = path[: (len(request.tokens) - 1) // ps]
        own = request.pages_needed(ps) - len(path)
        self.cache.lock(path)
        shortfall = own - self.pages.free_count
        if shortfall > 0:
            self.pages.release(self.cache.evict(shortfall))
        if own > self.pages.free_count:
            self.cache.unlock(path)
            return False
        request.adopted = path
        request.pages = [node.page for node in path] + self.pages.allocate(own)
        request.cached_tokens = request.written = len(path) * ps
        if self.kv_store is not None:
            # Pages beyond the tree's that were saved to disk are read back instead of being
            # computed (backed off like the tree's: one prompt token is always left to run).
            keys = chain_keys(self.kv_store.identity, request.tokens)[: (len(request.tokens) - 1) // ps]
            saved = self.kv_store.saved_prefix(keys)
            request.restore_keys = keys[len(path):saved]
        return True

    # ---- the prefix cache on disk ------------------------------------------------------

    RESTORE_PAGES_PER_STEP = 32  # bounded like a prefill chunk, so streams keep flowing

    def _restore_some(self, events: list[Event]) -> None:
        """Read back at most RESTORE_PAGES_PER_STEP saved pages into requests' own pages.
        A page that is missing or damaged ends the restore; the rest is computed."""
        budget = self.RESTORE_PAGES_PER_STEP
        for request in self._running:
            restored_now = 0
            while request.restore_keys and budget > 0:
                page = self.kv_store.read(request.restore_keys[0])
                if page is None:
                    request.restore_keys = []
                    break
                self._write_page(request.pages[request.written // self.config.page_size], page[1])
                request.restore_keys.pop(0)
                request.written += self.config.page_size
                request.cached_tokens = request.written
                request.restored_tokens += self.config.page_size
                restored_now += 1
                budget -= 1
            if restored_now:
                events.append(PrefillProgress(request.id, request.written, len(request.tokens),
                                              request.cached_tokens, request.restored_tokens))

    def _page_slots(self, page: int) -> torch.Tensor:
        ps = self.config.page_size
        return torch.arange(page * ps, (page + 1) * ps, device=self.loaded.device)

    def _write_page(self, page: int, kv: torch.Tensor) -> None:
        """kv [L, 2, page_size, Hkv, D] into pool page `page`."""
        slots = self._page_slots(page)
        pool = self.pool
        for layer in range(len(pool.keys)):
            pool.keys[layer][slots] = kv[layer, 0].to(pool.keys[layer].device, pool.keys[layer].dtype)
            pool.values[layer][slots] = kv[layer, 1].to(pool.values[layer].device, pool.values[layer].dtype)

    def _read_page(self, page: int) -> torch.Tensor:
        slots = self._page_slots(page)
        pool = self.pool
        return torch.stack([torch.stack((pool.keys[layer][slots], pool.values[layer][slots]))
                            for layer in range(len(pool.keys))]).cpu()

    def _save_pending(self) -> None:
        """Hand the pages of finished conversations that are not on disk yet to the writer
        (called when the engine is idle, so it never delays a token)."""
        pending, self._pending_saves = self._pending_saves, []
        if self._kv_writer is None:
            return
        store = self.kv_store
        ps = self.config.page_size
        for tokens, owner in pending:
            keys = chain_keys(store.identity, tokens)
            path = self.cache.match(tokens)[: len(keys)]
            # Pages already saved are skipped, unless an owner must be recorded on them too.
            start = 0 if owner is not None else store.saved_prefix(keys)
            for i in range(start, len(path)):
                kv = None if store.contains(keys[i]) else self._read_page(path[i].page)
                self._kv_writer.put(keys[i], keys[i - 1] if i else None, tokens[i * ps:(i + 1) * ps],
                                    kv, owner)

    def forget_cache_owner(self, owner: str) -> None:
        """Delete the saved pages only `owner` used (a chat deleted for good). Safe from any
        thread: while pages are being saved, on the engine thread at its next step (its
        pages not yet handed to the writer are dropped, then the writer deletes after what
        it was handed), so no page of the owner is written after its deletion."""
        if self.kv_store is None:
            return
        if self._kv_writer is None:  # closed: nothing is being saved
            self.kv_store.forget_owner(owner)
            return
        self._commands.put(("forget_owner", owner))

    # ---- one forward pass --------------------------------------------------------------

    def _run_pass(self, events: list[Event]) -> None:
        decoding = [r for r in self._running if r.phase is Phase.DECODE]
        # Shortest remaining prompt first: a short request arriving during a long prefill
        # takes its few tokens from the next pass instead of waiting for the whole document;
        # the long one gets the rest of the pass's budget and, beside streams, its share of
        # the time (the pacer), so it is never starved.
        prefilling = sorted((r for r in self._running
                             if r.phase is Phase.PREFILL and not r.restore_keys),
                            key=lambda r: r.prefill_remaining)
        # Beside streams the pacer decides for long prompts only (short ones run whole).
        short = self.config.short_prompt_tokens
        paced_prompts = any(len(r.tokens) - r.cached_tokens > short for r in prefilling)
        plan = (self.pacer.plan(streaming=bool(decoding)) if paced_prompts or not decoding
                else PassPlan(0))
        riders = decoding if plan.decode else []  # a time slice leaves the streams out
        batch: list[tuple[Request, list[int]]] = [(r, [r.generated[-1].id]) for r in riders]
        budget = plan.prompt_tokens
        paced = 0  # prompt tokens taken from the plan's budget
        burst = self.config.prefill_chunk if riders else 0  # short prompts' share (above)
        for request in prefilling:
            remaining = request.prefill_remaining
            if remaining <= burst and len(request.tokens) - request.cached_tokens <= short:
                take = remaining
                burst -= take
            elif budget > 0:
                take = min(remaining, budget)
                budget -= take
                paced += take
            else:
                continue
            batch.append((request, request.tokens[request.written: request.written + take]))
        if not batch:  # everyone is reading pages back from disk this step
            return
        self.threads.before_pass()
        started = time.perf_counter()
        try:
            logits = self._forward(batch)
        except Exception as exc:  # a failed pass fails its requests, never the engine
            for request, _ in batch:
                events.append(Failed(request.id, f"The model failed: {exc}"))
                self._release(request, publish=False)
            return
        seconds = time.perf_counter() - started
        self.threads.after_pass(sum(len(c) for _, c in batch), seconds)
        prompt_tokens = sum(len(c) for r, c in batch if r.phase is Phase.PREFILL)
        prompt_left = sum(r.prefill_remaining for r in prefilling) - prompt_tokens
        self.pacer.learn(seconds, prompt_tokens, paced, streaming=bool(decoding),
                         prompt_left=prompt_left)
        for (request, chunk), row in zip(batch, logits):
            request.written += len(chunk)
            if request.phase is Phase.PREFILL:
                events.append(PrefillProgress(request.id, request.written, len(request.tokens),
                                              request.cached_tokens))
                if request.prefill_remaining:
                    continue
                request.phase = Phase.DECODE
            try:
                self._sample(request, row, events)
            except Exception as exc:  # a request whose sampling fails fails alone
                events.append(Failed(request.id, f"Sampling failed: {exc}"))
                self._release(request, publish=False)

    def _forward(self, batch: list[tuple[Request, list[int]]]) -> torch.Tensor:
        """Every request's new tokens -> logits [len(batch), V], one row per request (its
        last token's). One pass, except where the model's decode passes run a path of their
        own (`decode_step.compiled_layers`: a layer one compiled call, whose float32
        glue is not torch's bit for bit): there requests adding one token run in a pass of
        their own beside the prompt chunks' pass, so a token is computed the same way
        whether or not a prompt is read beside it (batching changes no greedy token)."""
        ones = [i for i, (_, chunk) in enumerate(batch) if len(chunk) == 1]
        if 0 < len(ones) < len(batch) and self._decode_apart:
            rest = [i for i in range(len(batch)) if len(batch[i][1]) != 1]
            parts = [self._forward_pass([batch[i] for i in ones]), self._forward_pass([batch[i] for i in rest])]
            logits = torch.empty(len(batch), parts[0].shape[1], dtype=parts[0].dtype)
            logits[ones], logits[rest] = parts
            return logits
        return self._forward_pass(batch)

    def _forward_pass(self, batch: list[tuple[Request, list[int]]]) -> torch.Tensor:
        """Run every request's new tokens in one pass (`_forward`)."""
        model, device = self.loaded.model, self.loaded.device
        view = PagedBatchView(self.pool, [r.pages for r, _ in batch],
                              [r.written for r, _ in batch], [len(c) for _, c in batch],
                              keys=[r for r, _ in batch])  # each keeps its contiguous KV copy
        tokens = torch.tensor([[t for _, chunk in batch for t in chunk]], device=device)
        hidden = model(tokens, view.positions(), view)
        rows = torch.tensor(view.last_token_rows(), device=device)
        return model.logits(hidden[0].index_select(0, rows)).cpu()

    # ---- sampling and finishing --------------------------------------------------------

    def _sample(self, request: Request, logits: torch.Tensor, events: list[Event]) -> None:
        choice = request.sampler.next_token(logits)
        if not request.generated:
            request.first_token_at = time.perf_counter()
        request.generated.append(choice)
        if choice.id in request.stop_token_ids:
            request.finish_reason = "stop"
            text = ""
        else:
            text = request.stops.feed(request.stream.push(choice.id))
            if request.stops.stopped:
                request.finish_reason = "stop"
            elif len(request.generated) >= request.params.max_tokens:
                request.finish_reason = "length"
        if request.finish_reason and not request.stops.stopped:
            # The reply ends here: release bytes and text held back for what might have come.
            text += request.stops.feed(request.stream.flush()) + request.stops.flush()
        request.text += text
        events.append(Token(request.id, choice.id, text, choice.logprob, choice.top))
        if request.finish_reason:
            self._retire(request, events)

    def _retire(self, request: Request, events: list[Event]) -> None:
        self._release(request, publish=True)
        events.append(self._finished(request))

    def _release(self, request: Request, publish: bool) -> None:
        """Hand the request's pages back: full written pages to the tree, the rest freed."""
        if request in self._running:
            self._running.remove(request)
        ps = self.config.page_size
        keep = request.written // ps if publish else 0
        # Its contiguous KV copy, written into its pages first when they are published.
        self.pool.forget(request, write_back=keep > 0)
        request.phase = Phase.DONE
        tokens = request.sequence[: keep * ps]
        redundant = self.cache.insert(tokens, request.pages[:keep])
        owner = self._cache_owners.pop(request.id, None)
        if self.kv_store is not None and keep:
            self._pending_saves.append((tokens, owner))
        self.cache.unlock(request.adopted)
        adopted_pages = set(p for p in request.pages[: len(request.adopted)])
        unpublished = [p for p in request.pages[keep:] if p not in adopted_pages]
        self.pages.release(redundant + unpublished)
        request.adopted, request.pages = [], []

    def _finished(self, request: Request) -> Finished:
        now = time.perf_counter()
        n = len(request.generated)
        first = request.first_token_at or now
        decode_s = now - first if request.first_token_at else 0.0
        timings = Timings(
            queued_s=(request.admitted_at or now) - request.submitted_at,
            prefill_s=first - request.admitted_at if request.admitted_at else 0.0,
            time_to_first_token_s=first - request.submitted_at if request.first_token_at else 0.0,
            decode_s=decode_s,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0)
        usage = Usage(len(request.prompt_ids), request.cached_tokens, n, request.restored_tokens)
        return Finished(request.id, request.finish_reason or "abort", request.text, usage,
                        timings, tuple(c.id for c in request.generated))
