"""The paged view attends per sequence: a packed pass mixing decode steps of very different
contexts with a prefill chunk gives each sequence the logits it gets alone in a contiguous
cache; sequences keyed across passes keep a contiguous copy that adopts shared pages once and
then follows every write."""

from __future__ import annotations

import random

import torch

from app.engine.contiguous_kv import ContiguousKV
from app.engine.kv_pool import PagedBatchView, PagedKVPool, SequenceKV

PAGE = 4


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 200_000) for _ in range(n)]


@torch.inference_mode()
def _alone(tiny, history: list[int], new: list[int]) -> torch.Tensor:
    """Logits [len(new), V] of `new` after `history`, on a contiguous cache."""
    kv = ContiguousKV(tiny.kv_facts, len(history) + len(new), tiny.device, torch.float32)
    if history:
        tiny.model(torch.tensor([history]), kv.positions(len(history)), kv)
        kv.commit(len(history))
    hidden = tiny.model(torch.tensor([new]), kv.positions(len(new)), kv)
    return tiny.model.logits(hidden[0])


@torch.inference_mode()
def test_a_mixed_pass_equals_each_sequence_alone(tiny):
    # (context already in the pool, new tokens this pass): decode steps at contexts 3, 5, 40,
    # 41 and 150 (three length groups, one of them past the sliding window) and a prefill
    # chunk of 7 after 20 tokens, in an order that is not sorted by length.
    shapes = [(150, 1), (3, 1), (20, 7), (40, 1), (5, 1), (41, 1)]
    sequences = [(_ids(h, seed=i), _ids(n, seed=100 + i)) for i, (h, n) in enumerate(shapes)]
    pool = PagedKVPool(tiny.kv_facts, 200, PAGE, tiny.device, torch.float32)
    free = iter(range(1, 200))
    tables = []
    for history, new in sequences:
        pages = [next(free) for _ in range(-(-(len(history) + len(new)) // PAGE))]
        tables.append(pages)
        if history:  # fill the pool with the history, one sequence per pass
            view = PagedBatchView(pool, [pages], [0], [len(history)])
            tiny.model(torch.tensor([history]), view.positions(), view)
    view = PagedBatchView(pool, tables, [len(h) for h, _ in sequences],
                          [len(n) for _, n in sequences])
    packed = [t for _, new in sequences for t in new]
    hidden = tiny.model(torch.tensor([packed]), view.positions(), view)[0]
    logits = tiny.model.logits(hidden)
    row = 0
    for history, new in sequences:
        expected = _alone(tiny, history, new)
        got = logits[row: row + len(new)]
        assert torch.allclose(got, expected, atol=1e-4), (len(history), (got - expected).abs().max())
        row += len(new)
    assert len(view._seqs) == len(sequences)  # one contiguous copy per sequence


@torch.inference_mode()
def test_keyed_sequences_adopt_a_shared_prefix_once_and_decode_like_alone(tiny):
    # A 2-page prefix written by one sequence is adopted by two others (their page tables
    # start with the same pages), which then prefill their own tails and decode together,
    # keyed, over several passes, past the tiny model's sliding window of 16.
    pool = PagedKVPool(tiny.kv_facts, 64, PAGE, tiny.device, torch.float32)
    prefix = _ids(2 * PAGE, seed=1)
    shared = [1, 2]
    view = PagedBatchView(pool, [shared], [0], [len(prefix)])
    tiny.model(torch.tensor([prefix]), view.positions(), view)
    tails = {"a": _ids(5, seed=2), "b": _ids(9, seed=3)}
    tables = {"a": shared + list(range(10, 20)), "b": shared + list(range(20, 30))}
    history = {k: prefix + tails[k] for k in tails}
    view = PagedBatchView(pool, [tables["a"], tables["b"]], [len(prefix)] * 2,
                          [len(tails["a"]), len(tails["b"])], keys=["a", "b"])
    copy_a = pool.sequence("a", tables["a"])
    assert torch.equal(copy_a.data[0, 0, :, :len(prefix)],  # the prefix, copied in once
                       pool.keys[0][pool.slots(shared, 0, len(prefix))].transpose(0, 1))
    hidden = tiny.model(torch.tensor([tails["a"] + tails["b"]]), view.positions(), view)[0]
    for step in range(14):
        nxt = {k: _ids(1, seed=100 + 2 * step + j) for j, k in enumerate(tails)}
        view = PagedBatchView(pool, [tables["a"], tables["b"]],
                              [len(history["a"]), len(history["b"])], [1, 1], keys=["a", "b"])
        assert pool.sequence("a", tables["a"]) is copy_a and pool.sequences_held == 2
        hidden = tiny.model(torch.tensor([nxt["a"] + nxt["b"]]), view.positions(), view)[0]
        got = tiny.model.logits(hidden)
        for row, k in enumerate(tails):
            expected = _alone(tiny, history[k], nxt[k])[-1]
            assert torch.allclose(got[row], expected, atol=1e-4), (k, step)
            history[k] += nxt[k]
    # Handed back with write_back, the copy's positions land in the pool: a fresh copy synced
    # from it holds what the keyed one held.
    kept = pool.sequence("b", tables["b"]).data[:, :, :, :len(history["b"])].clone()
    pool.forget("b", write_back=True)
    fresh = SequenceKV(pool, tables["b"], len(history["b"]))
    fresh.sync(pool, len(history["b"]))
    assert torch.equal(fresh.data, kept)
    pool.forget("a")
    assert pool.sequences_held == 0
    assert pool.sequence("a", tables["a"]) is not copy_a  # a new sequence, a new copy
