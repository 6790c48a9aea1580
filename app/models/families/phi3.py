"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama block with fused projections -- one qkv weight
([q; k; v] stacked) and one gate_up weight ([gate; up], gate first) -- rotate-half RoPE,
optionally over part of each head, and a sliding window over every layer when the model
sets one. The fused weights are split into the shared slots at load time."""

from __future__ import annotations

from app.models.errors import ModelError
from app.models.families import common
from app.models.layers import ROPE_HALF
from app.models.transformer import DecoderConfig


def config_from_gguf(gguf, shapes, read) -> DecoderConfig:
    arch = gguf.architecture
    if "rope_factors_long.weight" in shapes or "rope_factors_short.weight" in shapes:
        raise ModelError(f"{gguf.path.name} is a long-context Phi-3 (LongRoPE), which Ferrox Chat "
                         "does not support yet; the 4k-context versions work.")
    dims = common.gguf_dims(gguf, arch, shapes)
    window = gguf.get_int(f"{arch}.attention.sliding_window", 0, min=0) or None
    cfg = DecoderConfig(architecture="phi3", **dims,
                        rope=common.gguf_rope(gguf, arch, dims["head_dim"], ROPE_HALF),
                        windows=(window,) * dims["n_layers"] if window else (),
                        rms_eps=gguf.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, positive=True),
                        tied_head="output.weight" not in shapes,
                        extras={"fused_qkv": "blk.0.attn_qkv.weight" in shapes})
    return cfg


def config_from_hf(c: common.HFConfig) -> DecoderConfig:
    kind = common.hf_rope_parameters(c).get("rope_type", "default")
    if kind not in ("default", None):
        raise ModelError("This is a long-context Phi-3 (LongRoPE), which Ferrox Chat does not "
                         "support yet; the 4k-context versions work.")
    dims = common.hf_dims(c)
    window = c.get_int("sliding_window", 0, min=0) or None
    return DecoderConfig(architecture="phi3", **dims,
                         rope=common.hf_rope(c, dims["head_dim"], 10_000.0),
                         windows=(window,) * dims["n_layers"] if window else (),
                         rms_eps=c.get_float("rms_norm_eps", 1e-5, positive=True),
                         tied_head=c.get_bool("tie_word_embeddings", False))


def gguf_tensors(cfg: DecoderConfig):
    return common.gguf_tensors(cfg, fused_qkv=cfg.extras.get("fused_qkv", True), fused_gate_up=True)


def hf_tensors(cfg: DecoderConfig):
    return common.hf_tensors(cfg, fused_qkv=True, fused_gate_up=True)
