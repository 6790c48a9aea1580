"""What model families share: tensor maps for llama.cpp's and Hugging Face's standard names,
a checked reader for `config.json`, and RoPE settings from either kind of file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.models.errors import ModelError
from app.models.layers import ROPE_HALF, RopeSpec, llama3_frequency_factors
from app.models.transformer import DecoderConfig

_REQUIRED = object()


@dataclass(frozen=True)
class TensorRef:
    """Where one weight slot of `TransformerLM` comes from in a file.

    `rows` takes rows [start, end) of a fused tensor (Phi-3's qkv and gate_up); `add_one`
    folds Gemma's "(1 + w)" into a norm weight stored without it (Hugging Face files; GGUF
    files store it folded)."""

    slot: str
    name: str
    rows: tuple[int, int] | None = None
    add_one: bool = False


# ---- tensor maps ---------------------------------------------------------------------------


def gguf_tensors(cfg: DecoderConfig, *, fused_qkv: bool = False, fused_gate_up: bool = False
                 ) -> list[TensorRef]:
    """llama.cpp's tensor names (gguf-py's MODEL_TENSORS) for every slot `cfg` needs."""
    refs = [TensorRef("embedding", "token_embd.weight"), TensorRef("output_norm", "output_norm.weight")]
    if not cfg.tied_head:
        refs.append(TensorRef("head", "output.weight"))
    q_out, kv_out, F = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    for i in range(cfg.n_layers):
        blk, slot = f"blk.{i}.", f"layers.{i}."
        names = {"attn_norm": "attn_norm", "o": "attn_output", "ffn_norm": "ffn_norm",
                 "down": "ffn_down"}
        if cfg.qkv_bias:
            names |= {"q_bias": "attn_q", "k_bias": "attn_k", "v_bias": "attn_v"}
        if cfg.qk_norm:
            names |= {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
        if cfg.sandwich_norms:
            names |= {"post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm"}
        for target, stored in names.items():
            suffix = ".bias" if target.endswith("_bias") else ".weight"
            refs.append(TensorRef(slot + target, blk + stored + suffix))
        if fused_qkv:
            qkv = blk + "attn_qkv.weight"
            refs += [TensorRef(slot + "q", qkv, (0, q_out)),
                     TensorRef(slot + "k", qkv, (q_out, q_out + kv_out)),
                     TensorRef(slot + "v", qkv, (q_out + kv_out, q_out + 2 * kv_out))]
        else:
            refs += [TensorRef(slot + s, f"{blk}attn_{s}.weight") for s in ("q", "k", "v")]
        if fused_gate_up:  # [gate; up] stacked in ffn_up, gate first
            up = blk + "ffn_up.weight"
            refs += [TensorRef(slot + "gate", up, (0, F)), TensorRef(slot + "up", up, (F, 2 * F))]
        else:
            refs += [TensorRef(slot + "gate", blk + "ffn_gate.weight"),
                     TensorRef(slot + "up", blk + "ffn_up.weight")]
    return refs


def hf_tensors(cfg: DecoderConfig, *, fused_qkv: bool = False, fused_gate_up: bool = False,
               gemma_norms: bool = False) -> list[TensorRef]:
    """Hugging Face's names (LlamaForCausalLM and its relatives) for every slot `cfg` needs.
    With `gemma_norms`, every norm weight is stored as w for a scale of (1 + w)."""
    g = gemma_norms
    refs = [TensorRef("embedding", "model.embed_tokens.weight"),
            TensorRef("output_norm", "model.norm.weight", add_one=g)]
    if not cfg.tied_head:
        refs.append(TensorRef("head", "lm_head.weight"))
    q_out, kv_out, F = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    for i in range(cfg.n_layers):
        p, slot = f"model.layers.{i}.", f"layers.{i}."
        refs += [TensorRef(slot + "attn_norm", p + "input_layernorm.weight", add_one=g),
                 TensorRef(slot + "o", p + "self_attn.o_proj.weight"),
                 TensorRef(slot + "down", p + "mlp.down_proj.weight")]
        if cfg.sandwich_norms:
            refs += [TensorRef(slot + "post_attn_norm", p + "post_attention_layernorm.weight", add_one=g),
                     TensorRef(slot + "ffn_norm", p + "pre_feedforward_layernorm.weight", add_one=g),
                     TensorRef(slot + "post_ffn_norm", p + "post_feedforward_layernorm.weight", add_one=g)]
        else:
            refs.append(TensorRef(slot + "ffn_norm", p + "post_attention_layernorm.weight", add_one=g))
        if cfg.qkv_bias:
            refs += [TensorRef(f"{slot}{s}_bias", f"{p}self_attn.{s}_proj.bias") for s in "qkv"]
        if cfg.qk_norm:
            refs += [TensorRef(slot + "q_norm", p + "self_attn.q_norm.weight", add_one=g),
                     TensorRef(slot + "k_norm", p + "self_attn.k_norm.weight", add_one=g)]
        if fused_qkv:
            qkv = p + "self_attn.qkv_proj.weight"
            refs += [TensorRef(slot + "q", qkv, (0, q_out)),
                     TensorRef(slot + "k", qkv, (q_out, q_out + kv_out)),
                     TensorRef(slot + "v", qkv, (q_out + kv_out, q_out + 2 * kv_out))]
        else:
            refs += [TensorRef(slot + s, f"{p}self_attn.{s}_proj.weight") for s in "qkv"]
        if fused_gate_up:
            up = p + "mlp.gate_up_proj.weight"
            refs += [TensorRef(slot + "gate", up, (0, F)), TensorRef(slot + "up", up, (F, 2 * F))]
        else:
            refs += [TensorRef(slot + "gate", p + "mlp.gate_proj.weight"),
                     TensorRef(slot + "up", p + "mlp.up_proj.weight")]
    return refs


# ---- config.json ---------------------------------------------------------------------------


class HFConfig:
    """A Hugging Face `config.json` read with the checks `GGUFFile`'s typed accessors make:
    a value of the wrong type or range raises a `ModelError` naming the key."""

    def __init__(self, values: dict, where: str = "config.json"):
        if not isinstance(values, dict):
            raise ModelError(f"{where} does not hold a JSON object.")
        self.values, self.where = values, where

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def _get(self, key: str, default: Any) -> Any:
        value = self.values.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelError(f"{self.where} lacks {key!r}, which this model needs.")
            return default
        return value

    def _bad(self, key: str, value: Any, what: str) -> ModelError:
        return ModelError(f"{self.where} has an invalid {key!r}: {value!r} (it must be {what}).")

    def get_int(self, key: str, default: Any = _REQUIRED, *, min: int | None = None) -> int:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, int) or isinstance(value, bool) or (min is not None and value < min):
            raise self._bad(key, value, "a whole number" + (f" of at least {min}" if min is not None else ""))
        return value

    def get_float(self, key: str, default: Any = _REQUIRED, *, positive: bool = False) -> float:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or (positive and value <= 0)):
            raise self._bad(key, value, "a finite number" + (" above 0" if positive else ""))
        return float(value)

    def get_bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def get_str(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, str):
            raise self._bad(key, value, "text")
        return value

    def get_dict(self, key: str) -> dict:
        value = self.values.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._bad(key, value, "an object")
        return value

    def refuse_if(self, key: str, what: str) -> None:
        """Refuse a feature our decoder does not implement, naming it."""
        if self.values.get(key):
            raise ModelError(f"This model uses {what} ({key} in {self.where}), which Ferrox Chat "
                             "does not support yet.")


def hf_dims(c: HFConfig) -> dict:
    """The hyperparameters every Hugging Face decoder config spells the same way."""
    d = c.get_int("hidden_size", min=1)
    heads = c.get_int("num_attention_heads", min=1)
    head_dim = c.get_int("head_dim", 0, min=0) or d // heads
    return {"d_model": d, "n_layers": c.get_int("num_hidden_layers", min=1), "n_heads": heads,
            "n_kv_heads": c.get_int("num_key_value_heads", heads, min=1), "head_dim": head_dim,
            "ffn_dim": c.get_int("intermediate_size", min=1),
            "context_length": c.get_int("max_position_embeddings", min=1),
            "vocab_size": c.get_int("vocab_size", min=1)}


def hf_rope_parameters(c: HFConfig, section: str | None = None) -> dict:
    """transformers 5 writes `rope_parameters` (per layer kind for Gemma 3); older files
    `rope_theta` + `rope_scaling`. Either way: one dict with rope_theta and rope_type."""
    params = dict(c.get_dict("rope_parameters"))
    if section is not None:
        params = dict(params.get(section) or {})
    if not params:
        params = dict(c.get_dict("rope_scaling"))
        if c.has("rope_theta"):
            params.setdefault("rope_theta", c.get_float("rope_theta", positive=True))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def hf_rope(c: HFConfig, head_dim: int, default_base: float, *, style: str = ROPE_HALF,
            section: str | None = None, partial_rotary_factor: float | None = None) -> RopeSpec:
    p = hf_rope_parameters(c, section)
    base = p.get("rope_theta", default_base)
    if not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ModelError(f"config.json has an invalid RoPE base {base!r}.")
    factor = partial_rotary_factor or p.get("partial_rotary_factor") or c.values.get("partial_rotary_factor") or 1.0
    rotary = int(head_dim * factor)
    kind = p.get("rope_type", "default")
    if kind == "default":
        return RopeSpec(float(base), rotary, style)
    if kind == "linear":
        return RopeSpec(float(base), rotary, style, position_scale=float(p["factor"]))
    if kind == "llama3":
        factors = llama3_frequency_factors(rotary, float(base), float(p["factor"]),
                                           float(p["low_freq_factor"]), float(p["high_freq_factor"]),
                                           int(p["original_max_position_embeddings"]))
        return RopeSpec(float(base), rotary, style, freq_factors=factors)
    raise ModelError(f"This model uses {kind!r} RoPE scaling, which Ferrox Chat does not support yet.")


def hf_windows(c: HFConfig, n_layers: int, pattern=None) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `layer_types` (or `pattern(i) -> sliding?`)."""
    window = c.get_int("sliding_window", 0, min=0) or None
    types = c.values.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if pattern is None or window is None:
        return ()
    return tuple(window if pattern(i) else None for i in range(n_layers))


def gguf_vocab_size(gguf, shapes: dict[str, tuple[int, ...]]) -> int:
    """Rows of the token embedding (a file may pad its vocabulary past the token list)."""
    shape = shapes.get("token_embd.weight")
    if shape is None or len(shape) != 2:
        raise ModelError(f"{gguf.path.name} lacks a usable token embedding (token_embd.weight).")
    return shape[0]


def gguf_dims(gguf, arch: str, shapes: dict) -> dict:
    """The hyperparameters llama.cpp stores the same way for every family."""
    heads = gguf.get_int(f"{arch}.attention.head_count", min=1)
    d = gguf.get_int(f"{arch}.embedding_length", min=1)
    return {"d_model": d, "n_layers": gguf.get_int(f"{arch}.block_count", min=1), "n_heads": heads,
            "n_kv_heads": gguf.get_int(f"{arch}.attention.head_count_kv", heads, min=1),
            "head_dim": gguf.get_int(f"{arch}.attention.key_length", d // heads, min=1),
            "ffn_dim": gguf.get_int(f"{arch}.feed_forward_length", min=1),
            "context_length": gguf.get_int(f"{arch}.context_length", min=1),
            "vocab_size": gguf_vocab_size(gguf, shapes)}


def gguf_rope(gguf, arch: str, head_dim: int, style: str, default_base: float = 10_000.0,
              freq_factors: tuple[float, ...] | None = None) -> RopeSpec:
    rotary = gguf.get_int(f"{arch}.rope.dimension_count", head_dim, min=2)
    base = gguf.get_float(f"{arch}.rope.freq_base", default_base, min=1.0000001)
    kind = gguf.get_str(f"{arch}.rope.scaling.type", "none")
    scale = 1.0
    if kind == "linear":
        scale = gguf.get_float(f"{arch}.rope.scaling.factor", positive=True)
    elif kind not in ("none", ""):
        raise ModelError(f"{gguf.path.name} uses {kind!r} RoPE scaling, which Ferrox Chat does "
                         "not support yet.")
    return RopeSpec(base, rotary, style, freq_factors=freq_factors, position_scale=scale)
