"""Gemma 3 (text): Gemma 2's block with QK-norm before RoPE instead of soft-capping, five
sliding layers for every global one (layers 5, 11, 17, ... are global), and a RoPE base per
layer kind: 10,000 on sliding layers, the file's base (1e6) on global ones, where larger
models also scale positions linearly.

Not stored in GGUF files but required (transformers' defaults): the local RoPE base and the
every-6th-layer pattern. Norm weights as in Gemma 2: GGUF files hold (1 + w), Hugging Face
files w. The query scale is query_pre_attn_scalar^-1/2 (GGUF: 1/sqrt(head_dim), as llama.cpp
uses, except for the 27B model)."""

from __future__ import annotations

import math

from app.models.families import common
from app.models.layers import ROPE_HALF, RopeSpec
from app.models.transformer import DecoderConfig

GLOBAL_LAYER_PERIOD = 6
LOCAL_ROPE_BASE = 10_000.0
_27B_LAYERS = 62


def _slides(i: int) -> bool:
    return (i + 1) % GLOBAL_LAYER_PERIOD != 0


def config_from_gguf(gguf, shapes, read) -> DecoderConfig:
    arch = gguf.architecture
    dims = common.gguf_dims(gguf, arch, shapes)
    n, D = dims["n_layers"], dims["head_dim"]
    window = gguf.get_int(f"{arch}.attention.sliding_window", 512, min=1)
    rope = common.gguf_rope(gguf, arch, D, ROPE_HALF, 1_000_000.0)
    scale = 1 / math.sqrt(dims["d_model"] / dims["n_heads"] if n == _27B_LAYERS else D)
    return DecoderConfig(
        architecture="gemma3", **dims, activation="gelu_tanh", sandwich_norms=True, embed_scale=True,
        qk_norm=True, rope=rope, rope_local=RopeSpec(LOCAL_ROPE_BASE, rope.rotary_dim, ROPE_HALF),
        windows=tuple(window if _slides(i) else None for i in range(n)),
        rms_eps=gguf.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
        query_scale=scale, tied_head="output.weight" not in shapes)


def config_from_hf(c: common.HFConfig) -> DecoderConfig:
    dims = common.hf_dims(c)
    n, D = dims["n_layers"], dims["head_dim"]
    sections = c.get_dict("rope_parameters")
    if "full_attention" in sections:
        rope = common.hf_rope(c, D, 1_000_000.0, section="full_attention")
        local = common.hf_rope(c, D, LOCAL_ROPE_BASE, section="sliding_attention")
    else:  # older files: rope_theta, rope_local_base_freq, rope_scaling for global layers
        rope = common.hf_rope(c, D, 1_000_000.0)
        local = RopeSpec(c.get_float("rope_local_base_freq", LOCAL_ROPE_BASE, positive=True), D, ROPE_HALF)
    scalar = c.get_float("query_pre_attn_scalar", float(D), positive=True)
    return DecoderConfig(
        architecture="gemma3", **dims, activation="gelu_tanh", sandwich_norms=True, embed_scale=True,
        qk_norm=True, rope=rope, rope_local=local, windows=common.hf_windows(c, n, _slides),
        rms_eps=c.get_float("rms_norm_eps", 1e-6, positive=True), query_scale=scalar ** -0.5,
        attn_softcap=c.get_float("attn_logit_softcapping", None, positive=True),
        final_softcap=c.get_float("final_logit_softcapping", None, positive=True),
        tied_head=c.get_bool("tie_word_embeddings", True))


def gguf_tensors(cfg: DecoderConfig):
    return common.gguf_tensors(cfg)


def hf_tensors(cfg: DecoderConfig):
    return common.hf_tensors(cfg, gemma_norms=True)
