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
from app.models.gemma3 import Gemma3, Gemma3Config
from app.models.gguf_file import GGUFFile
from app.models.loader import LoadedModel
from app.models.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(embedded_model_path) -> Tokenizer:
    with GGUFFile(embedded_model_path) as gguf:
        return Tokenizer.from_gguf(gguf)


def make_tiny_model(tokenizer: Tokenizer, *, seed: int = 0, sliding_window: int = 16,
                    context_length: int = 4096, dtype=torch.float32) -> LoadedModel:
    cfg = Gemma3Config(vocab_size=tokenizer.vocab_size, d_model=64, n_layers=6, n_heads=4,
                       n_kv_heads=1, head_dim=32, ffn_dim=128, context_length=context_length,
                       sliding_window=sliding_window)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def norm(n):
        return 1 + torch.rand(n, generator=g) * 0.2

    d, D, H, F = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.ffn_dim
    layers = [{
        "attn_q": rand(H * D, d), "attn_k": rand(D, d), "attn_v": rand(D, d),
        "attn_output": rand(d, H * D), "ffn_gate": rand(F, d), "ffn_up": rand(F, d),
        "ffn_down": rand(d, F), "attn_norm": norm(d), "attn_q_norm": norm(D),
        "attn_k_norm": norm(D), "post_attention_norm": norm(d), "ffn_norm": norm(d),
        "post_ffw_norm": norm(d),
    } for _ in range(cfg.n_layers)]
    head = rand(cfg.vocab_size, d, scale=0.15)
    model = Gemma3(cfg, head, norm(d), layers, transposed=False, compute_dtype=torch.float32).eval()
    return LoadedModel(path=Path("tiny.gguf"), name="tiny", architecture="gemma3", model=model,
                       config=cfg, tokenizer=tokenizer, template=GemmaTemplate(),
                       device=torch.device("cpu"), dtype=dtype, load_seconds=0.0)


@pytest.fixture(scope="session")
def tiny(tokenizer) -> LoadedModel:
    return make_tiny_model(tokenizer)
