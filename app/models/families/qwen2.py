"""Qwen 2 / 2.5: the Llama block with biases on the q, k and v projections, rotate-half RoPE
(llama.cpp keeps Hugging Face's layout for this family), optional sliding layers."""

from __future__ import annotations

from app.models.families import common
from app.models.layers import ROPE_HALF
from app.models.transformer import DecoderConfig


def config_from_gguf(gguf, shapes, read) -> DecoderConfig:
    arch = gguf.architecture
    dims = common.gguf_dims(gguf, arch, shapes)
    return DecoderConfig(architecture="qwen2", **dims, qkv_bias=True,
                         rope=common.gguf_rope(gguf, arch, dims["head_dim"], ROPE_HALF, 1_000_000.0),
                         rms_eps=gguf.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
                         tied_head="output.weight" not in shapes)


def config_from_hf(c: common.HFConfig) -> DecoderConfig:
    dims = common.hf_dims(c)
    windows = common.hf_windows(c, dims["n_layers"]) if c.values.get("use_sliding_window") else ()
    return DecoderConfig(architecture="qwen2", **dims, qkv_bias=True,
                         rope=common.hf_rope(c, dims["head_dim"], 10_000.0),
                         windows=windows, rms_eps=c.get_float("rms_norm_eps", 1e-6, positive=True),
                         tied_head=c.get_bool("tie_word_embeddings", False))


def gguf_tensors(cfg: DecoderConfig):
    return common.gguf_tensors(cfg)


def hf_tensors(cfg: DecoderConfig):
    return common.hf_tensors(cfg)
