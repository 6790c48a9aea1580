"""One decoder-only transformer, configured per family by a `DecoderConfig`.

Llama, Qwen 2/3, Phi-3 and Gemma 2/3 differ in a handful of switches (biases, QK-norm,
sandwich norms, activation, soft-capping, embedding scale, sliding layers, RoPE layout);
their blocks are otherwise the same computation. Family modules (`app/models/families/`)
read a file's hyperparameters into a `DecoderConfig` and map its tensors onto the slots
below; nothing here knows a family by name.

Construction is in two steps: `TransformerLM(config, weight_format)` builds every module with
empty weight slots, then the loader `assign`s each slot once (shape-checked) and calls
`finish_loading()`, which refuses a model with a slot left empty.

The model keeps no KV state: each forward reads and writes keys and values through the
`KVView` it is given (a contiguous cache for one sequence, or the engine's paged pool).

Shapes: S sequences, T tokens each, d = d_model, H query heads, Hkv key/value heads,
G = H / Hkv, D head dim, L keys visible to a query, F the MLP width, V the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from app.models import decode_attention, decode_block, decode_step
from app.models.causal_lm import KVFacts, KVView
from app.models.errors import ModelError
from app.models.quantized import QuantizedWeight, RawTensor, int4_linear
from app.models.layers import (ACTIVATIONS, ROPE_HALF, ROPE_INTERLEAVED, RopeSpec, Weight,
                               WeightFormat, fuse, linear, linear_from, on_planes, rms_norm, rotate,
                               soft_cap)


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    rms_eps: float
    rope: RopeSpec  # global (and every) layer
    rope_local: RopeSpec | None = None  # sliding layers, where they rotate differently
    windows: tuple[int | None, ...] = ()  # per layer; () = all global
    activation: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # extra norms after attention and after the MLP (Gemma)
    embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (Gemma)
    query_scale: float = 0.0  # 0 -> 1 / sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tied_head: bool = True
    extras: dict = field(default_factory=dict, compare=False)  # family facts for display

    def __post_init__(self) -> None:
        ints = {"vocabulary size": self.vocab_size, "embedding length": self.d_model,
                "block count": self.n_layers, "head count": self.n_heads,
                "KV head count": self.n_kv_heads, "head dimension": self.head_dim,
                "feed-forward length": self.ffn_dim, "context length": self.context_length}
        for what, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"The model's {what} is {value!r}; it must be a positive integer.")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads cannot share {self.n_kv_heads} KV heads evenly.")
        if self.head_dim % 2:
            raise ModelError(f"The head dimension {self.head_dim} is odd; rotary embeddings need it even.")
        if not (math.isfinite(self.rms_eps) and 0 < self.rms_eps < 1):
            raise ModelError(f"The model's RMS norm epsilon {self.rms_eps!r} is not a small positive number.")
        for spec in (self.rope, self.rope_local):
            if spec is None:
                continue
            if not (math.isfinite(spec.base) and spec.base > 1):
                raise ModelError(f"The model's RoPE base {spec.base!r} must be a finite number above 1.")
            if not (0 < spec.rotary_dim <= self.head_dim and spec.rotary_dim % 2 == 0):
                raise ModelError(f"The model rotates {spec.rotary_dim} of {self.head_dim} head dimensions; "
                                 "that must be an even number no larger than the head.")
            if spec.style not in (ROPE_HALF, ROPE_INTERLEAVED):
                raise ModelError(f"Unknown RoPE layout {spec.style!r}.")
            if spec.freq_factors is not None and len(spec.freq_factors) != spec.rotary_dim // 2:
                raise ModelError(f"The model has {len(spec.freq_factors)} RoPE frequency factors for "
                                 f"{spec.rotary_dim // 2} frequencies.")
            if not (math.isfinite(spec.position_scale) and spec.position_scale > 0):
                raise ModelError(f"The model's RoPE scaling factor {spec.position_scale!r} is not positive.")
        if self.windows and len(self.windows) != self.n_layers:
            raise ModelError(f"{len(self.windows)} layer windows for {self.n_layers} layers.")
        if any(w is not None and w <= 0 for w in self.windows):
            raise ModelError("The model's sliding window must be positive.")
        if self.activation not in ACTIVATIONS:
            raise ModelError(f"Unknown activation {self.activation!r}.")
        for what, cap in (("attention", self.attn_softcap), ("final", self.final_softcap)):
            if cap is not None and not (math.isfinite(cap) and cap > 0):
                raise ModelError(f"The model's {what} logit soft-cap {cap!r} must be positive.")
        if not (math.isfinite(self.query_scale) and self.query_scale >= 0):
            raise ModelError(f"The model's query scale {self.query_scale!r} is invalid.")

    @property
    def kv_facts(self) -> KVFacts:
        windows = self.windows or (None,) * self.n_layers
        return KVFacts(self.n_layers, self.n_kv_heads, self.head_dim, tuple(windows))

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope_for(self, layer: int) -> RopeSpec:
        if self.rope_local is not None and self.window(layer) is not None:
            return self.rope_local
        return self.rope

    @property
    def attention_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)


class DecoderLayer(torch.nn.Module):
    """One block: [norm -> attention (-> norm)] + x, [norm -> gated MLP (-> norm)] + x."""

    def __init__(self, cfg: DecoderConfig, index: int, fmt: WeightFormat):
        super().__init__()
        self.cfg, self.index, self.fmt = cfg, index, fmt
        self.window = cfg.window(index)
        self.rope = cfg.rope_for(index)
        self.act = ACTIVATIONS[cfg.activation]
        # Weight slots, filled by `assign`. Linear weights in `fmt`'s layout, vectors float32.
        self.attn_norm: torch.Tensor | None = None
        self.q: Weight | None = None
        self.k: Weight | None = None
        self.v: Weight | None = None
        self.o: Weight | None = None
        self.q_bias: torch.Tensor | None = None
        self.k_bias: torch.Tensor | None = None
        self.v_bias: torch.Tensor | None = None
        self.q_norm: torch.Tensor | None = None
        self.k_norm: torch.Tensor | None = None
        self.post_attn_norm: torch.Tensor | None = None
        self.ffn_norm: torch.Tensor | None = None
        self.gate: Weight | None = None
        self.up: Weight | None = None
        self.down: Weight | None = None
        self.post_ffn_norm: torch.Tensor | None = None
        # Products joined at `finish_loading` (`fuse_products`): the slots above then hold
        # views of these. `qkv` is Q, K and V side by side (or Q and K when V's kind
        # differs), `gate_up` gate and up; each is used only while the slots still hold the
        # parts it was made of (`_qkv_of`, `_gate_up_of`), so a slot assigned later wins.
        self.qkv: Weight | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.gate_up: Weight | None = None
        self._qkv_of: tuple = ()
        self._gate_up_of: tuple = ()
        # QK-norm's two weights as one [H + Hkv, D] (q_norm for every query head, k_norm for
        # every key head), for one norm over Q and K together; used while the slots still
        # hold what it was made of (`_qk_norm_of`).
        self.qk_norm: torch.Tensor | None = None
        self._qk_norm_of: tuple = ()
        # The decode step's constant arguments (`decode_step.prepare`), made when the
        # products are joined and dropped when any weight is assigned after that.
        self._decode_args: decode_step.DecodeArgs | None = None
        # Whether decode passes attend in one compiled call (`decode_attention.serves`),
        # and whether the norms before QKV and gate-up are computed in those products
        # (`_norms_fit_products`): decided with `_decode_args` and dropped with it.
        self._fused_attention = False
        self._norms_in_products = False
        # Where a decode pass runs the whole layer in one compiled call (`decode_block`): its
        # constants (the weights' addresses), made with `_decode_args` and dropped with it.
        self._block: torch.Tensor | None = None
        # A decode step over at least this many keys asks SDPA per query head (`_attend`);
        # None: never. Set for the whole model (`TransformerLM.per_head_from`).
        self.per_head_from: int | None = None

    # Attributes a scripted decode step reads: assigning one drops `_decode_args`.
    _DECODE_INPUTS = frozenset({"attn_norm", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias",
                                "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "gate", "up",
                                "down", "post_ffn_norm", "qkv", "qkv_bias", "gate_up", "qk_norm"})

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in self._DECODE_INPUTS:
            if self.__dict__.get("_decode_args") is not None:
                self.__dict__["_decode_args"] = None
            self.__dict__["_fused_attention"] = False
            self.__dict__["_norms_in_products"] = False
            self.__dict__["_block"] = None

    def fuse_products(self) -> None:
        """Join Q, K, V (or Q, K) and gate, up into one product each, the slots becoming
        views of the joined weights: a decode step then runs 4 products a layer, not 7."""
        t = self.fmt.transposed
        self.qkv, self.qkv_bias, self.gate_up = None, None, None
        self._qkv_of = self._gate_up_of = ()
        for names in (("q", "k", "v"), ("q", "k")):
            fused = fuse([getattr(self, n) for n in names], t)
            if fused is not None:
                self.qkv, parts = fused
                for name, part in zip(names, parts):
                    setattr(self, name, part)
                self._qkv_of = (parts[0], parts[1], parts[2] if len(parts) == 3 else None,
                                self.q_bias)
                if self.q_bias is not None:
                    self.qkv_bias = torch.cat([getattr(self, f"{n}_bias") for n in names])
                break
        fused = fuse([self.gate, self.up], t)
        if fused is not None:
            self.gate_up, (self.gate, self.up) = fused
            self._gate_up_of = (self.gate, self.up)
        self.qk_norm, self._qk_norm_of = None, ()
        if self.q_norm is not None and self.k_norm is not None:
            c = self.cfg
            self.qk_norm = torch.cat((self.q_norm.expand(c.n_heads, -1),
                                      self.k_norm.expand(c.n_kv_heads, -1)))
            self._qk_norm_of = (self.q_norm, self.k_norm)
        self._fused_attention = decode_attention.serves(self)
        self._norms_in_products = self._norms_fit_products()
        self._block = decode_block.constants(self) if decode_block.serves(self) else None
        self._decode_args = decode_step.prepare(self)

    def _norms_fit_products(self) -> bool:
        """Whether the norms before QKV and gate-up can be computed in those products: both
        joined (Q, K and V without a bias), on 8-bit activations (`int8_products.matmul`
        takes the norm as it rounds x to 8 bits: a small model's decode step then runs two
        norms a layer fewer, ~13 us each on a 2-core CPU)."""
        from app.models.int8_products import Int8Codes

        of, gu = self._qkv_of, self._gate_up_of
        return bool(of and of[0] is self.q and of[1] is self.k and of[2] is not None
                    and of[2] is self.v and self.q_bias is None and self.qkv_bias is None
                    and gu and gu[0] is self.gate and gu[1] is self.up
                    and all(isinstance(w, QuantizedWeight) and isinstance(w.codes, Int8Codes)
                            and not w.exact_top for w in (self.qkv, self.gate_up)))

    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight this layer needs, [out, in] for linear ones, as the loader fills them."""
        c = self.cfg
        d, D, q_out, kv_out = c.d_model, c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        shapes = {"attn_norm": (d,), "q": (q_out, d), "k": (kv_out, d), "v": (kv_out, d),
                  "o": (d, q_out), "ffn_norm": (d,), "gate": (c.ffn_dim, d),
                  "up": (c.ffn_dim, d), "down": (d, c.ffn_dim)}
        if c.qkv_bias:
            shapes |= {"q_bias": (q_out,), "k_bias": (kv_out,), "v_bias": (kv_out,)}
        if c.qk_norm:
            shapes |= {"q_norm": (D,), "k_norm": (D,)}
        if c.sandwich_norms:
            shapes |= {"post_attn_norm": (d,), "post_ffn_norm": (d,)}
        return shapes

    LINEAR_SLOTS = frozenset({"q", "k", "v", "o", "gate", "up", "down"})

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVView
                ) -> torch.Tensor:
        """x [N, d] (the pass's S * T tokens, one per row) -> [N, d]."""
        if self._block is not None:  # (a pass of decode steps alone: see `_decode_block`)
            out = self._decode_block(x, rope, kv)
            if out is not None:
                return out
        eps = self.cfg.rms_eps
        # Without a norm after it, a branch's last product may stay in its kernel's dtype:
        # adding it to the residual stream promotes it (see `linear`).
        sandwich = self.post_attn_norm is not None
        h = self.attention(x, rope, kv, promotes=not sandwich, norm=self.attn_norm)
        if sandwich:
            h = rms_norm(h, self.post_attn_norm, eps)
        x = x + h
        sandwich = self.post_ffn_norm is not None
        h = self.mlp(x, promotes=not sandwich, norm=self.ffn_norm)
        if sandwich:
            h = rms_norm(h, self.post_ffn_norm, eps)
        return x + h

    def _normed(self, x: torch.Tensor, norm: torch.Tensor | None, product: Weight
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, norm) for a product that takes its input's norm (`_norms_in_products`, x on
        the product's 8-bit planes), else (x normed, None)."""
        if norm is None or (self._norms_in_products and on_planes(x, product)):
            return x, norm
        return rms_norm(x, norm, self.cfg.rms_eps), None

    def mlp(self, x: torch.Tensor, promotes: bool = False, norm: torch.Tensor | None = None
            ) -> torch.Tensor:
        """x [N, d] -> [N, d]; `norm`: x is not normed yet, this is its norm's weight."""
        t = self.fmt.transposed
        of = self._gate_up_of
        x, norm = self._normed(x, norm, self.gate_up)
        # gate and up stay in their product's dtype (a 4-bit kernel's bfloat16): the
        # activation and the gating multiply run in it, and the down product takes it as is.
        if norm is not None:  # (joined, on 8-bit activations: `_norms_fit_products`)
            gate, up = int4_linear(x, self.gate_up, True, norm, self.cfg.rms_eps).chunk(2, dim=-1)
        elif of and of[0] is self.gate and of[1] is self.up:
            gate, up = linear(x, self.gate_up, t, promotes=True).chunk(2, dim=-1)
        else:
            gate, up = linear(x, self.gate, t, promotes=True), linear(x, self.up, t, promotes=True)
        if gate.dtype != up.dtype:
            gate, up = gate.to(x.dtype), up.to(x.dtype)
        return linear_from(self.act(gate) * up, self.down, t, x.dtype, promotes)

    def _qkv(self, x: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, d] -> Q, K, V side by side [N, (H + 2 Hkv) * D]; `norm` as `mlp`'s."""
        t = self.fmt.transposed
        of = self._qkv_of  # (q, k, v or None, q_bias) the joined product was made of
        x, norm = self._normed(x, norm, self.qkv)
        if norm is not None:  # (joined, no bias, on 8-bit activations: `_norms_fit_products`)
            return int4_linear(x, self.qkv, self.q_norm is None, norm, self.cfg.rms_eps)
        if of and of[0] is self.q and of[1] is self.k and (of[2] is None or of[2] is self.v) \
                and of[3] is self.q_bias:
            # Q and K meet RoPE's float32 tables and V is copied into the KV cache, both of
            # which promote; a bias or QK-norm comes first and keeps the activations' dtype.
            plain = self.qkv_bias is None and self.q_norm is None and of[2] is not None
            ys = [linear(x, self.qkv, t, promotes=plain)]
            if self.qkv_bias is not None:
                ys[0] = ys[0] + self.qkv_bias.to(ys[0].dtype)
            if of[2] is None:  # V's kind differed: Q and K only were joined
                ys.append(self._product(x, self.v, self.v_bias))
        else:
            ys = [self._product(x, w, b) for w, b in ((self.q, self.q_bias), (self.k, self.k_bias),
                                                      (self.v, self.v_bias))]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    def _product(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        y = linear(x, w, self.fmt.transposed)
        return y if bias is None else y + bias.to(y.dtype)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVView,
                  promotes: bool = False, norm: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, d] -> [N, d]; the rope tables [S, T, 1, R] say how the N rows split into
        S sequences of T tokens; `norm` as `mlp`'s."""
        c = self.cfg
        cos, sin = rope  # [S, T, 1, R]: Q and K heads rotated together
        S, T = cos.shape[0], cos.shape[1]
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        y = self._qkv(x, norm)
        if self._fused_attention:  # (a pass of decode steps alone: see `_attend_decode`)
            out = self._attend_decode(y, cos, sin, kv)
            if out is not None:
                return linear_from(out, self.o, self.fmt.transposed, x.dtype, promotes)
        y = y.view(S, T, H + 2 * Hkv, D)
        qk, v = y.split_with_sizes((H + Hkv, Hkv), 2)  # (one call for the two views)
        of = self._qk_norm_of
        if of and of[0] is self.q_norm and of[1] is self.k_norm and y.dtype == torch.float32:
            # One norm over every Q and K head, then each head's weight: the same values as
            # two norms and a concatenation (float32 rms_norm multiplies by its weight last),
            # in two operations a layer instead of seven.
            qk = rms_norm(qk, None, c.rms_eps) * self.qk_norm
        elif self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :, :H], self.q_norm, c.rms_eps),
                            rms_norm(qk[:, :, H:], self.k_norm, c.rms_eps)), dim=2)
        qk = rotate(qk, cos, sin, self.rope.style)  # [S, T, H + Hkv, D]
        q, k = qk.split_with_sizes((H, Hkv), 2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [S, heads, T, D]
        out = kv.attend(self.index, q, k, v, self.window, self._attend)  # x's or the cache's dtype
        # [S, H, T, D] -> [S * T, H * D]; one token's is the same memory read flat (a view)
        out = out.reshape(1, H * D) if S * T == 1 else out.transpose(1, 2).reshape(S * T, H * D)
        return linear_from(out, self.o, self.fmt.transposed, x.dtype, promotes)

    def _decode_block(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVView
                      ) -> torch.Tensor | None:
        """A pass of decode steps alone, the whole layer in one compiled call (`decode_block`,
        as the scripted step calls it): x [N, d] -> [N, d]; None for any other pass, KV dtype
        or row count (the caller runs the layer's operations)."""
        args = self._decode_args
        if x.dtype != torch.float32 or args is None or x.shape[0] > args.rows_max:
            return None
        seqs = self._decode_seqs(kv)
        if seqs is None:
            return None
        c, N = self.cfg, x.shape[0]
        cos, sin = rope
        return torch.ops.ferrox.decode_block(x, self._block, cos.reshape(N, c.head_dim),
                                             sin.reshape(N, c.head_dim), seqs.tables[0], seqs.kind,
                                             seqs.longest, seqs.threads)

    def _decode_seqs(self, kv: KVView) -> decode_attention.Plan | None:
        """This layer's `decode_attention.Plan` in a pass of decode steps alone whose KV
        copies the kernel reads; None for any other pass or KV dtype."""
        plan_of = getattr(kv, "decode_plan", None)
        plan = plan_of(self.window) if plan_of is not None else None
        if plan is None or plan[0][0].dtype not in decode_attention.KV_KINDS:
            return None
        c = self.cfg
        return decode_attention.plan(*plan, [self.index], c.n_heads, c.n_kv_heads, c.head_dim)

    def _attend_decode(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView
                       ) -> torch.Tensor | None:
        """A pass of decode steps alone, in one compiled call (`decode_attention`, as the
        scripted step calls it): y [N, (H + 2 Hkv) * D] the QKV product -> [N, H * D]
        float32; None for any other pass or KV dtype (the caller attends as usual)."""
        seqs = self._decode_seqs(kv) if y.dtype == torch.float32 else None
        if seqs is None:
            return None
        c, N = self.cfg, y.shape[0]
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        norm = self.qk_norm if self.q_norm is not None else torch.empty(0)
        return torch.ops.ferrox.decode_attention(
            y, cos.reshape(N, D), sin.reshape(N, D), norm, seqs.tables[0], H, Hkv, D,
            self.rope.style == ROPE_HALF, seqs.kind, seqs.longest, seqs.threads, c.rms_eps,
            c.attention_scale)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, T, D], keys/values [B, Hkv, L, D], mask [B, 1, T, L] or None (every key
        visible to every query) -> [B, H, T, D]."""
        c = self.cfg
        B, H, T, D = q.shape
        Hkv, L = keys.shape[1], keys.shape[2]
        # Fold the G query heads that share a KV head into the query axis: plain SDPA on
        # every backend (no enable_gqa, no repeat_interleave of the keys). Query head h uses
        # KV head h // G, as Hugging Face's repeat_kv and llama.cpp do. A decode step over
        # many keys may instead ask per query head (`per_head`), where the CPU policy
        # measured that faster: torch's CPU kernel multiplies each block of keys by G query
        # rows in one small product, slower there than G products of one row each.
        G = H // Hkv
        per_head = (T == 1 and G > 1 and mask is None and self.per_head_from is not None
                    and L >= self.per_head_from and c.attn_softcap is None)
        if not per_head:
            q = q.reshape(B, Hkv, G * T, D)
        if G > 1 and mask is not None:
            mask = mask.repeat(1, 1, G, 1)  # rows g*T + t use query t's mask
        # A KV cache narrower than the activations (the CPU policy's bfloat16 cache): the
        # queries meet the keys in its dtype, the result comes back in the activations'.
        act_dtype = q.dtype
        if keys.dtype != act_dtype:
            q = q.to(keys.dtype)
        if per_head:
            out = F.scaled_dot_product_attention(q, keys, values, scale=c.attention_scale,
                                                 enable_gqa=True)
        elif c.attn_softcap is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 scale=c.attention_scale)
        else:
            out = _softcapped_attention(q, keys, values, mask, c.attention_scale, c.attn_softcap)
        if out.dtype != act_dtype:
            out = out.to(act_dtype)
        return out.view(B, H, T, D)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float, cap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped before the softmax (Gemma 2); SDPA cannot."""
    scores = soft_cap((q @ k.transpose(-1, -2)).float() * scale, cap)  # [S, Hkv, G*T, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


class TransformerLM(torch.nn.Module):
    """The whole decoder; implements `app.models.causal_lm.CausalLM`.

    With a tied head the output projection multiplies by the token embedding, stored once in
    the linear layout; the embedding lookup gathers from it (rows [V, d], or columns when
    the layout is transposed [d, V])."""

    def __init__(self, cfg: DecoderConfig, fmt: WeightFormat, compute_dtype: torch.dtype):
        super().__init__()
        self.cfg, self.fmt = cfg, fmt
        self.compute_dtype = compute_dtype
        self.vocab_size = cfg.vocab_size
        self.kv_facts = cfg.kv_facts
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, i, fmt) for i in range(cfg.n_layers))
        self.embedding: Weight | None = None  # [V, d], in the linear layout when tied
        self.output_norm: torch.Tensor | None = None
        self.head: Weight | None = None  # untied output projection [V, d]
        self._ropes = tuple(dict.fromkeys(layer.rope for layer in self.layers))

    @property
    def per_head_from(self) -> int | None:
        """From how many keys a decode step's attention asks SDPA per query head instead of
        per KV head (None: never). The load plan sets it (`device.load_planned`), from the
        CPU policy's measurement (`kernel_policy.pick_layout`); both layouts give a sequence
        the same result alone or batched, since each sequence is decided by its own keys."""
        return self.layers[0].per_head_from if len(self.layers) else None

    @per_head_from.setter
    def per_head_from(self, keys: int | None) -> None:
        for layer in self.layers:
            layer.per_head_from = keys

    # ---- loading -------------------------------------------------------------------------

    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the model needs, by slot name: "embedding", "output_norm", "head"
        (untied only) and "layers.{i}.{slot}"."""
        c = self.cfg
        shapes = {"embedding": (c.vocab_size, c.d_model), "output_norm": (c.d_model,)}
        if not c.tied_head:
            shapes["head"] = (c.vocab_size, c.d_model)
        for i, layer in enumerate(self.layers):
            shapes |= {f"layers.{i}.{slot}": shape for slot, shape in layer.slot_shapes().items()}
        return shapes

    def assign(self, slot: str, tensor: torch.Tensor) -> None:
        """Put one float32 weight in its slot, converted to the model's weight format."""
        expected = self.slot_shapes().get(slot) if not slot.startswith("layers.") else None
        owner, name = self, slot
        if slot.startswith("layers."):
            _, index, name = slot.split(".", 2)
            owner = self.layers[int(index)]
            expected = owner.slot_shapes().get(name)
        if expected is None:
            raise ModelError(f"The model has no weight slot {slot!r}.")
        if tuple(tensor.shape) != expected:
            raise ModelError(f"Weight {slot!r} has shape {tuple(tensor.shape)}, expected {expected}.")
        is_linear = self._is_linear(name)
        if isinstance(tensor, RawTensor):  # blocks kept quantized (fmt.wants_raw); see pack_int4
            if not is_linear:
                raise ModelError(f"Weight {slot!r} cannot stay quantized.")
            setattr(owner, name, self.fmt.prepare(tensor, keep_rows=name == "embedding",
                                                  output=name in ("embedding", "head")))
            return
        if not torch.isfinite(tensor).all():
            raise ModelError(f"Weight {slot!r} contains NaN or infinite values; the file is damaged.")
        if is_linear:  # the output projection runs for a step's last rows only: no wide copy
            value = self.fmt.prepare(tensor, output=name in ("embedding", "head"))
        elif name == "embedding":
            value = tensor.to(self.fmt.dtype)
        else:
            value = tensor.float()  # norms and biases stay float32
        setattr(owner, name, value)

    def _is_linear(self, name: str) -> bool:
        return name in DecoderLayer.LINEAR_SLOTS or name == "head" or (
            name == "embedding" and self.cfg.tied_head)

    def wants_raw(self, slot: str, ggml_type) -> bool:
        """Whether `slot` should be assigned a GGUF tensor's raw blocks (kept quantized)."""
        name = slot.rsplit(".", 1)[-1]
        output_rows = self.cfg.vocab_size if name in ("embedding", "head") else 0
        return self._is_linear(name) and self.fmt.wants_raw(ggml_type, output_rows)

    def finish_loading(self) -> "TransformerLM":
        missing = [slot for slot in self.slot_shapes() if self._slot_value(slot) is None]
        if missing:
            raise ModelError(f"The model file lacks {len(missing)} weights (first: {missing[0]}); "
                             "it is incomplete.")
        for layer in self.layers:
            layer.fuse_products()
        return self.eval()

    def own_file_views(self) -> None:
        """Copy the raw blocks the embedding or head keeps (`QuantizedWeight.rows`), which
        view the model file's memory map after a build: a model that runs on without its
        saved entry must not depend on the file (rewritten or deleted while the app runs,
        or kept open on Windows)."""
        for slot in ("embedding", "head"):
            value = getattr(self, slot)
            if isinstance(value, QuantizedWeight) and value.rows is not None:
                rows = value.rows
                setattr(self, slot, replace(
                    value, rows=RawTensor(rows.data.clone(), rows.ggml_type, rows.shape)))

    def _slot_value(self, slot: str):
        if slot.startswith("layers."):
            _, index, name = slot.split(".", 2)
            return getattr(self.layers[int(index)], name)
        return getattr(self, slot)

    # ---- running -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.output_norm.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        x = self.fmt.gather_rows(self.embedding, flat, self.cfg.tied_head)
        x = x.to(self.compute_dtype)
        if self.cfg.embed_scale:
            # The scale is rounded to the activation dtype first, as the reference does.
            scale = torch.tensor(math.sqrt(self.cfg.d_model), dtype=self.compute_dtype, device=x.device)
            x = x * scale
        return x.view(*tokens.shape, -1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVView) -> torch.Tensor:
        """tokens, positions: [S, T] int64 -> final-normed hidden states [S, T, d]."""
        x = self.embed(tokens)
        tables = {spec: spec.rotation(positions, x.dtype) for spec in self._ropes}
        x = x.view(-1, x.shape[-1])  # the layers see one token a row: [S * T, d]
        # A pass of decode steps alone: the same operations, scripted (app.models.decode_step).
        scripted = decode_step.run(self.layers, x, tables, kv, self.per_head_from)
        if scripted is not None:
            x = scripted
        else:
            for layer in self.layers:
                x = layer(x, tables[layer.rope], kv)
        return rms_norm(x, self.output_norm, self.cfg.rms_eps).view(*tokens.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits [..., V]."""
        head = self.embedding if self.cfg.tied_head else self.head
        return soft_cap(linear(hidden, head, self.fmt.transposed).float(), self.cfg.final_softcap)
