"""The session loads at once in a safe format, measures the CPU policy in the background
while idle, and swaps in the measured format between requests."""

from __future__ import annotations

import queue

import pytest
import torch

from app.engine import kernel_policy as kp
from app.engine.events import Failed, Finished
from app.engine.sampling import SamplingParams
from app.engine.session import ModelSession

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _reply(session: ModelSession) -> Finished:
    events: queue.SimpleQueue = queue.SimpleQueue()
    session.submit(session.chat_prompt([]) or [1], GREEDY, events.put)
    while True:
        event = events.get(timeout=120)
        assert not isinstance(event, Failed), event
        if isinstance(event, Finished):
            return event


@pytest.mark.slow
def test_first_load_uses_the_default_then_the_measured_policy(smollm2_model_path, _own_data_dir,
                                                               monkeypatch):
    monkeypatch.setenv("FERROX_POLICY_TUNING", "1")
    monkeypatch.setattr(kp, "REPS", 3)
    said: list[str] = []
    session = ModelSession()
    heard = []
    session.on_policy = heard.append
    try:
        info = session.load(smollm2_model_path, "cpu", "auto", progress=said.append)
        decode = kp.provisional_decode(kp.shapes_for(smollm2_model_path, _own_data_dir))
        assert info.policy_label == (f"{decode} decode, {kp.DEFAULT} prefill"
                                     if decode != kp.DEFAULT else kp.DEFAULT)
        assert kp.DEFAULT_SAYS in info.policy_reason
        assert said[0].startswith("Loading ") and any(s.endswith("100%") for s in said)
        assert len(_reply(session).completion_ids) == 8  # serves while the tuner waits
        assert session.wait_for_policy(600)
        status = session.policy_status
        kept = "(default) kept" in status  # a machine too busy to measure: nothing cached
        assert ("measured on" in status or kept) and status.startswith(session.info.policy_label)
        assert [h.policy_reason for h in heard] == [session.info.policy_reason]
        assert session.info.dtype == session._loaded.weights_label  # the label is what runs
        loaded = session._loaded  # and the measured attention layout is what runs
        assert loaded.model.per_head_from == loaded.load_plan.per_head_from
        shapes = kp.gguf_shapes(smollm2_model_path)
        assert (kp.cached_policy(shapes, _own_data_dir) is None) == kept
        assert len(_reply(session).completion_ids) == 8  # and serves after any swap
    finally:
        session.close()


def test_no_tuner_runs_when_turned_off(smollm2_model_path):
    session = ModelSession()
    try:
        session.load(smollm2_model_path, "cpu", "auto")
        assert session._tuner is None and session.wait_for_policy(0)
        assert "default" in session.policy_status
    finally:
        session.close()
