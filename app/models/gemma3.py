"""Gemma 3 as a PyTorch module: what the model computes, with no KV bookkeeping of its own.

The model reads and writes its keys and values through a `KVView` the caller passes in
(a contiguous cache for one sequence, or the engine's paged pool for a batch), so the same
forward serves a one-shot generate, chunked prefill and batched decode.

Shapes: S sequences, T tokens each (padded), d = d_model, H query heads, Hkv key/value heads,
D head_dim, L keys visible to a query.

Details that matter for parity with the reference (see DESIGN.md):
  - embeddings scaled by sqrt(d_model); tied output head;
  - four RMSNorms per block, computed in float32; the GGUF norm weights already include +1;
  - QK-norm before rotate-half RoPE; base 1e6 on global layers, 1e4 on sliding ones;
  - every 6th layer global, the rest see the last `sliding_window` positions;
  - query scale 1/sqrt(head_dim); gelu-tanh gated MLP; no soft-capping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from app.models.errors import ModelError


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    sliding_window: int
    rms_eps: float = 1e-6
    rope_base_global: float = 1_000_000.0
    rope_base_local: float = 10_000.0
    global_layer_period: int = 6  # layers 5, 11, 17, ... are global

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads cannot share {self.n_kv_heads} KV heads evenly.")
        if min(self.d_model, self.n_layers, self.head_dim, self.vocab_size, self.sliding_window) <= 0:
            raise ModelError("The model's hyperparameters are not all positive.")

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.global_layer_period != 0

    def window(self, layer: int) -> int | None:
        """How many most recent positions (itself included) a query of this layer may see."""
        return self.sliding_window if self.is_sliding(layer) else None

    @classmethod
    def from_gguf_metadata(cls, meta: dict, vocab_size: int) -> "Gemma3Config":
        def key(name: str):
            full = f"gemma3.{name}"
            if full not in meta:
                raise ModelError(f"The model file lacks {full!r}, which a Gemma 3 model needs.")
            return meta[full]

        n_heads = int(key("attention.head_count"))
        return cls(
            vocab_size=vocab_size,
            d_model=int(key("embedding_length")),
            n_layers=int(key("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(meta.get("gemma3.attention.head_count_kv", n_heads)),
            head_dim=int(key("attention.key_length")),
            ffn_dim=int(key("feed_forward_length")),
            context_length=int(key("context_length")),
            sliding_window=int(meta.get("gemma3.attention.sliding_window", 512)),
            rms_eps=float(meta.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base_global=float(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        )


class KVView(Protocol):
    """Where a forward pass stores the new keys/values and finds all the visible ones.

    `update` is called once per layer with this step's keys and values
    k, v: [S, Hkv, T, D] and returns (keys, values, mask): keys/values [S, Hkv, L, D] holding
    every position the step's queries may attend to (the new ones included) and a boolean
    mask [S, 1, T, L] (True = may attend) that already applies causality, padding and the
    layer's sliding `window` (None for a global layer).
    """

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm in float32 whatever the activation dtype; `weight` already holds the +1."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [S, 1, T, D] for rotate-half RoPE, computed in float32 (no float64 on MPS)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [S, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [S, 1, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def weights_transposed(device: torch.device, dtype: torch.dtype) -> bool:
    """The weight layout each backend multiplies fastest, measured on the 2-core CPU for a
    [1, 640] x [640, 262144] product: float32 `x @ w` on [in, out] takes 33 ms against
    F.linear's 47 ms on [out, in]; in bfloat16/float16 it is the other way round
    (31 / 590 ms against 13 / 10 ms). GPUs get the standard [out, in]."""
    return device.type == "cpu" and dtype == torch.float32


_HALF_ROWS_MAX = 12
_DUAL_NARROW_ROWS_MAX = 2


@dataclass(frozen=True)
class DualWeight:
    """One [out, in] weight held twice, for the CPU: float16 for products with one or two
    rows (decode, where torch's float16 matrix-vector kernel is the fastest it has) and
    bfloat16 for more rows (prefill, batches: bfloat16 has the fast matrix-matrix kernel).
    Measured on Gemma 3 270M, 2 cores: decode ~50 tok/s with 1,024-token prefill in ~0.8 s,
    where one format alone gives either (float16: 50 tok/s, 1.8 s) or (bfloat16: 34, 0.8 s).
    Twice the weight memory: the policy uses it for small models only."""

    narrow: torch.Tensor  # float16
    wide: torch.Tensor  # bfloat16

    @property
    def device(self) -> torch.device:
        return self.narrow.device


def linear(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x [..., in] times a weight stored [in, out] (transposed) or [out, in].

    Weights may be stored narrower than the activations (e.g. float16 weights, float32
    activations); the product then runs in the weight dtype and comes back in the
    activations'. One exception, measured on the 2-core CPU: torch has a fast float16
    matrix-vector kernel (the reason float16 is the CPU default) but no fast float16
    matrix-matrix one -- 16 rows take 97 ms through it against 76 ms upcasting the weight
    to float32 first, and a 1,024-token prefill 5.1 s against 1.8 s. So past a few rows a
    float16 weight is upcast instead. bfloat16 has fast kernels for both.
    """
    if isinstance(w, DualWeight):
        w = w.narrow if x.numel() // x.shape[-1] <= _DUAL_NARROW_ROWS_MAX else w.wide
    if x.dtype != w.dtype:
        rows = x.numel() // x.shape[-1]
        if w.dtype == torch.float16 and w.device.type == "cpu" and rows > _HALF_ROWS_MAX:
            return F.linear(x, w.to(x.dtype))
        return F.linear(x.to(w.dtype), w).to(x.dtype)
    return x @ w if transposed else F.linear(x, w)


class Gemma3Layer(torch.nn.Module):
    """One transformer block; linear weights are in the layout `weights_transposed` picks."""

    def __init__(self, cfg: Gemma3Config, index: int, weights: dict[str, torch.Tensor],
                 transposed: bool):
        super().__init__()
        self.cfg = cfg
        self.transposed = transposed
        self.index = index
        self.window = cfg.window(index)
        self.rope_base = cfg.rope_base_local if cfg.is_sliding(index) else cfg.rope_base_global
        for name, tensor in weights.items():
            if isinstance(tensor, DualWeight):
                setattr(self, name, tensor)
            else:
                self.register_buffer(name, tensor, persistent=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVView
                ) -> torch.Tensor:
        cfg = self.cfg
        h = rms_norm(x, self.attn_norm, cfg.rms_eps)
        h = self.attention(h, rope, kv)
        x = x + rms_norm(h, self.post_attention_norm, cfg.rms_eps)
        h = rms_norm(x, self.ffn_norm, cfg.rms_eps)
        t = self.transposed
        h = F.gelu(linear(h, self.ffn_gate, t), approximate="tanh") * linear(h, self.ffn_up, t)
        h = linear(h, self.ffn_down, t)
        return x + rms_norm(h, self.post_ffw_norm, cfg.rms_eps)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVView
                  ) -> torch.Tensor:
        cfg = self.cfg
        S, T, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = linear(x, self.attn_q, self.transposed).view(S, T, H, D).transpose(1, 2)  # [S, H, T, D]
        k = linear(x, self.attn_k, self.transposed).view(S, T, Hkv, D).transpose(1, 2)  # [S, Hkv, T, D]
        v = linear(x, self.attn_v, self.transposed).view(S, T, Hkv, D).transpose(1, 2)
        cos, sin = rope
        q = apply_rope(rms_norm(q, self.attn_q_norm, cfg.rms_eps), cos, sin)
        k = apply_rope(rms_norm(k, self.attn_k_norm, cfg.rms_eps), cos, sin)
        keys, values, mask = kv.update(self.index, k, v, self.window)
        # Fold the G query heads that share a KV head into the query axis: plain SDPA on
        # every backend (no enable_gqa, no repeat_interleave of the keys).
        G = H // Hkv
        q = q.reshape(S, Hkv, G * T, D)
        if G > 1:
            mask = mask.repeat(1, 1, G, 1)  # rows g*T + t use query t's mask
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             scale=1.0 / math.sqrt(D))
        out = out.view(S, H, T, D).transpose(1, 2).reshape(S, T, H * D)
        return linear(out, self.attn_output, self.transposed)


class Gemma3(torch.nn.Module):
    """The whole decoder. `forward` returns final hidden states; `logits` applies the tied head.

    `head` is the token embedding, in the same layout as the other linear weights: [d, V]
    when transposed, [V, d] otherwise. The output head multiplies by it (the head is 63% of
    the bytes a decode step reads) and the embedding lookup gathers from it.
    """

    def __init__(self, cfg: Gemma3Config, head: torch.Tensor | DualWeight, output_norm: torch.Tensor,
                 layers: list[dict[str, torch.Tensor]], transposed: bool,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.transposed = transposed
        self.compute_dtype = compute_dtype  # activations and KV; weights may be narrower
        if isinstance(head, DualWeight):
            self.head = head
        else:
            self.register_buffer("head", head, persistent=False)
        self.register_buffer("output_norm", output_norm, persistent=False)
        self.layers = torch.nn.ModuleList(
            Gemma3Layer(cfg, i, w, transposed) for i, w in enumerate(layers))
        self.embed_scale = math.sqrt(cfg.d_model)

    @property
    def device(self) -> torch.device:
        return self.output_norm.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        table = self.head.narrow if isinstance(self.head, DualWeight) else self.head
        x = table.index_select(1, flat).t() if self.transposed else table[flat]
        x = x.to(self.compute_dtype)
        # The scale is rounded to the activation dtype first, as the reference does.
        scale = torch.tensor(self.embed_scale, dtype=self.compute_dtype, device=x.device)
        return (x * scale).view(*tokens.shape, -1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVView) -> torch.Tensor:
        """tokens, positions: [S, T] int64 -> final-normed hidden states [S, T, d]."""
        cfg = self.cfg
        x = self.embed(tokens)
        ropes = {base: rope_tables(positions, cfg.head_dim, base, x.dtype)
                 for base in {cfg.rope_base_local, cfg.rope_base_global}}
        for layer in self.layers:
            x = layer(x, ropes[layer.rope_base], kv)
        return rms_norm(x, self.output_norm, cfg.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits [..., V]."""
        return linear(hidden, self.head, self.transposed).float()
