"""The paged view attends per sequence: a packed pass mixing decode steps of very different
contexts (several length groups) with a prefill chunk gives each sequence the logits it gets
alone in a contiguous cache."""

from __future__ import annotations

import random

import torch

from app.engine.contiguous_kv import ContiguousKV
from app.engine.kv_pool import PagedBatchView, PagedKVPool

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
    assert len(view._plan(None)) >= 3  # the decode steps really were split into groups
