"""Gemma 2: sandwich norms (four per block), GELU-tanh MLP, embeddings scaled by sqrt(d),
tied head, sliding and global layers alternating (even layers slide), and soft-capping of
both the attention scores and the final logits.

Norm weights: Hugging Face stores w for a scale of (1 + w); llama.cpp's converter adds the 1,
so GGUF norms are used as they are. The query scale is query_pre_attn_scalar^-1/2; GGUF files
do not store that scalar, so they use what llama.cpp does (1/sqrt(head_dim), except the 27B
model's d_model/heads)."""

from __future__ import annotations

import math

from app.models.families import common
from app.models.layers import ROPE_HALF
from app.models.transformer import DecoderConfig

_27B_LAYERS = 46  # how llama.cpp recognises Gemma 2 27B, whose query scale differs


def _even_layers_slide(i: int) -> bool:
    return i % 2 == 0


def config_from_gguf(gguf, shapes, read) -> DecoderConfig:
    arch = gguf.architecture
    dims = common.gguf_dims(gguf, arch, shapes)
    window = gguf.get_int(f"{arch}.attention.sliding_window", 4096, min=1)
    n = dims["n_layers"]
    scale = 1 / math.sqrt(dims["d_model"] / dims["n_heads"] if n == _27B_LAYERS else dims["head_dim"])
    return DecoderConfig(
        architecture="gemma2", **dims, activation="gelu_tanh", sandwich_norms=True, embed_scale=True,
        rope=common.gguf_rope(gguf, arch, dims["head_dim"], ROPE_HALF),
        windows=tuple(window if _even_layers_slide(i) else None for i in range(n)),
        rms_eps=gguf.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
        query_scale=scale,
        attn_softcap=gguf.get_float(f"{arch}.attn_logit_softcapping", 50.0, positive=True),
        final_softcap=gguf.get_float(f"{arch}.final_logit_softcapping", 30.0, positive=True),
        tied_head="output.weight" not in shapes)


def config_from_hf(c: common.HFConfig) -> DecoderConfig:
    dims = common.hf_dims(c)
    n = dims["n_layers"]
    windows = common.hf_windows(c, n, _even_layers_slide)
    scalar = c.get_float("query_pre_attn_scalar", float(dims["head_dim"]), positive=True)
    return DecoderConfig(
        architecture="gemma2", **dims, activation="gelu_tanh", sandwich_norms=True, embed_scale=True,
        rope=common.hf_rope(c, dims["head_dim"], 10_000.0), windows=windows,
        rms_eps=c.get_float("rms_norm_eps", 1e-6, positive=True), query_scale=scalar ** -0.5,
        attn_softcap=c.get_float("attn_logit_softcapping", None, positive=True),
        final_softcap=c.get_float("final_logit_softcapping", None, positive=True),
        tied_head=c.get_bool("tie_word_embeddings", True))


def gguf_tensors(cfg: DecoderConfig):
    return common.gguf_tensors(cfg)


def hf_tensors(cfg: DecoderConfig):
    return common.hf_tensors(cfg, gemma_norms=True)
