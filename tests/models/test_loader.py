"""The loader's progress report: by the values each tensor fills, and inside a large one."""

from __future__ import annotations

import threading

import pytest
import torch

from app.models.families.common import TensorRef
from app.models.load_progress import report_within, set_within
from app.models.loader import _reporting, _values, load_model


def test_progress_is_weighted_by_values_and_reported_within_a_tensor():
    refs = [TensorRef("embedding", "big"), TensorRef("norm", "small"),
            TensorRef("layers.0.q", "fused", (0, 2)), TensorRef("layers.0.k", "fused", (2, 4))]
    shapes = {"big": (60, 10), "small": (40,), "fused": (4, 75)}
    sizes = [_values(ref, shapes) for ref in refs]
    assert sizes == [600, 40, 150, 150]
    assert _values(TensorRef("x", "absent"), shapes) == 1
    seen = []
    for ref in _reporting(refs, sizes, seen.append):
        if ref.name == "big":  # what a chunked preparation reports
            report_within(0.5)
            report_within(1.5)  # clamped to the tensor's share
    assert seen == [300 / 940, 600 / 940, 600 / 940, 640 / 940, 790 / 940, 1.0]
    report_within(0.5)  # after the load: nowhere
    assert seen[-1] == 1.0


def test_a_threads_report_never_reaches_another_load():
    seen = []
    set_within(seen.append)
    try:
        other = threading.Thread(target=report_within, args=(0.5,))
        other.start()
        other.join()
        assert seen == []
        report_within(0.25)
        assert seen == [0.25]
    finally:
        set_within(None)


@pytest.mark.slow
def test_a_first_load_reports_progress_while_its_embedding_is_prepared(embedded_model_path):
    """Gemma 3 270M's tied embedding (~60% of its values) is screened in chunks: the load
    reports as they are done, not only after the whole tensor."""
    from app.models.layers import WeightFormat

    int4 = WeightFormat(torch.float16, False, None, True, torch.bfloat16, None)
    seen = []
    loaded = load_model(embedded_model_path, torch.device("cpu"), torch.float16, torch.float32,
                        torch.bfloat16, progress=seen.append, int4=int4)
    try:
        assert seen == sorted(seen) and seen[-1] == 1.0
        assert len([f for f in seen if 0 < f < 0.5]) >= 16  # inside the embedding: 32 chunks
    finally:
        loaded.unload()


def test_a_load_that_fails_leaves_no_callback_behind(embedded_model_path, monkeypatch):
    """A load that stops part-way (here its progress callback raises) must not leave its
    callback for the thread's next preparation of a weight to report into."""
    import app.models.load_progress as load_progress
    from app.models.layers import WeightFormat

    def cancel(fraction):
        if fraction > 0.1:
            raise RuntimeError("cancelled")

    int4 = WeightFormat(torch.float16, False, None, True, torch.bfloat16, None)
    try:
        load_model(embedded_model_path, torch.device("cpu"), torch.float16, torch.float32,
                   torch.bfloat16, progress=cancel, int4=int4)
    except RuntimeError as error:  # checked while the failed load's frames are still alive
        assert "cancelled" in str(error)
        assert load_progress._within.get() is None
    else:
        pytest.fail("the load was not cancelled")
