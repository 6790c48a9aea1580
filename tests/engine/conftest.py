"""Engine fixtures: the real tokenizer on a tiny random-weight Gemma 3, fast enough for 2 cores.

The tiny model keeps every structural feature that matters to the engine (GQA, QK-norm,
sliding layers with a window of 16 next to a global layer, tied head over the real
262k vocabulary), so paging, windows and chunking are exercised on real shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.models.chat_template import GemmaTemplate
from app.models.gguf_file import GGUFFile
from app.models.layers import RopeSpec, WeightFormat
from app.models.loader import LoadedModel
from app.models.tokenizer import Tokenizer
from app.models.transformer import DecoderConfig, TransformerLM


@pytest.fixture(scope="session")
def tokenizer(embedded_model_path) -> Tokenizer:
    with GGUFFile(embedded_model_path) as gguf:
        return Tokenizer.from_gguf(gguf)


def make_tiny_model(tokenizer: Tokenizer, *, seed: int = 0, sliding_window: int = 16,
                    context_length: int = 4096, dtype=torch.float32) -> LoadedModel:
    """A Gemma 3-shaped `TransformerLM` with random weights, built and filled as the loader
    fills a real one (every slot assigned, then `finish_loading`)."""
    layers = 6
    cfg = DecoderConfig(
        architecture="gemma3", vocab_size=tokenizer.vocab_size, d_model=64, n_layers=layers,
        n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=128, context_length=context_length,
        rms_eps=1e-6, rope=RopeSpec(1_000_000.0, 32), rope_local=RopeSpec(10_000.0, 32),
        windows=tuple(sliding_window if (i + 1) % 6 else None for i in range(layers)),
        activation="gelu_tanh", qk_norm=True, sandwich_norms=True, embed_scale=True)
    g = torch.Generator().manual_seed(seed)
    model = TransformerLM(cfg, WeightFormat(dtype, transposed=False), torch.float32)
    for slot, shape in model.slot_shapes().items():
        if len(shape) == 1:  # norms
            model.assign(slot, 1 + torch.rand(*shape, generator=g) * 0.2)
        else:
            scale = 0.15 if slot == "embedding" else 0.08
            model.assign(slot, torch.randn(*shape, generator=g) * scale)
    model.finish_loading()
    return LoadedModel(path=Path("tiny.gguf"), name="tiny", architecture="gemma3", model=model,
                       config=cfg, tokenizer=tokenizer, template=GemmaTemplate(),
                       device=torch.device("cpu"), dtype=dtype, load_seconds=0.0)


@pytest.fixture(scope="session")
def tiny(tokenizer) -> LoadedModel:
    return make_tiny_model(tokenizer)
