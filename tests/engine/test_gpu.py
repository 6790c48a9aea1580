"""The same engine on CUDA or MPS. Skipped cleanly where neither exists (CI has no GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from app.engine.device import load_on, mps_available
from app.engine.engine import Engine, EngineConfig
from app.engine.events import Finished
from app.engine.generate import generate
from app.engine.sampling import SamplingParams

ACCELERATORS = [d for d, ok in (("cuda", torch.cuda.is_available()), ("mps", mps_available())) if ok]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ACCELERATORS, reason="no CUDA or MPS device")]


@pytest.fixture(scope="module", params=ACCELERATORS or ["none"])
def device(request):
    return request.param


@pytest.fixture(scope="module")
def reference(shared_dir):
    return json.loads((shared_dir / "reference" / "gemma3-270m-reference.json").read_text())


def test_float32_greedy_matches_the_reference(embedded_model_path, device, reference):
    loaded = load_on(embedded_model_path, device, "float32")
    for case in reference["cases"]:
        result = generate(loaded, case["prompt_ids"],
                          SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        assert result.completion_ids == case["transformers"]["generated_ids"]


def test_auto_dtype_agrees_on_the_first_token_and_batches(embedded_model_path, device, reference):
    loaded = load_on(embedded_model_path, device, "auto")
    engine = Engine(loaded, EngineConfig(kv_tokens=4096))
    for i, case in enumerate(reference["cases"] * 2):
        engine.submit(case["prompt_ids"], SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True), request_id=str(i))
    done = {}
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, Finished):
                done[event.request_id] = event
    engine.check_integrity()
    for i, case in enumerate(reference["cases"] * 2):
        assert done[str(i)].completion_ids[0] == case["transformers"]["generated_ids"][0]
