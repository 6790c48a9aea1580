"""Llama: Llama 2, Llama 3.x (with its RoPE frequency scaling), Mistral 7B-class, TinyLlama,
SmolLM. Pre-norm blocks, SwiGLU MLP, grouped-query attention, optional untied head.

llama.cpp's converter permutes the Q and K rows of each head from Hugging Face's rotate-half
order into pairs (i, i + D/2) next to each other, for its interleaved RoPE; a GGUF file is
therefore run with interleaved RoPE and a Hugging Face folder with rotate-half -- the same
attention scores either way, and no weights are un-permuted at load time. Llama 3.1 files
carry their frequency scaling as a `rope_freqs` tensor (the divisors llama.cpp applies).
"""

from __future__ import annotations

from app.models.errors import ModelError
from app.models.families import common
from app.models.layers import ROPE_HALF, ROPE_INTERLEAVED
from app.models.transformer import DecoderConfig


def config_from_gguf(gguf, shapes, read) -> DecoderConfig:
    arch = gguf.architecture
    dims = common.gguf_dims(gguf, arch, shapes)
    factors = None
    if "rope_freqs.weight" in shapes:
        factors = tuple(float(f) for f in read("rope_freqs.weight").reshape(-1).tolist())
    rope = common.gguf_rope(gguf, arch, dims["head_dim"], ROPE_INTERLEAVED, freq_factors=factors)
    return DecoderConfig(architecture="llama", **dims, rope=rope,
                         rms_eps=gguf.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, positive=True),
                         tied_head="output.weight" not in shapes)


def config_from_hf(c: common.HFConfig) -> DecoderConfig:
    c.refuse_if("attention_bias", "biases on the attention projections")
    c.refuse_if("mlp_bias", "biases in the MLP")
    act = c.get_str("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"This Llama-family model uses the {act!r} activation; only SiLU is supported.")
    dims = common.hf_dims(c)
    windows = ()
    if c.get_str("model_type", "llama") == "mistral" and c.has("sliding_window"):
        windows = (c.get_int("sliding_window", min=1),) * dims["n_layers"]
    return DecoderConfig(architecture="llama", **dims,
                         rope=common.hf_rope(c, dims["head_dim"], 10_000.0, style=ROPE_HALF),
                         windows=windows, rms_eps=c.get_float("rms_norm_eps", 1e-6, positive=True),
                         tied_head=c.get_bool("tie_word_embeddings", False))


def gguf_tensors(cfg: DecoderConfig):
    return common.gguf_tensors(cfg)


def hf_tensors(cfg: DecoderConfig):
    return common.hf_tensors(cfg)
