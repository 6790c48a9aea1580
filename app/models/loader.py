"""Turn a model file into a ready-to-run model: weights, tokenizer, chat template, facts.

One entry point, `load_model`, for every supported architecture; the architecture table
below is the one place that says which ones exist. Anything wrong with the file surfaces as
`ModelError` with a message a person can act on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.models.chat_template import ChatTemplate, template_for
from app.models.dequant import dequantize
from app.models.errors import ModelError
from app.models.gemma3 import DualWeight, Gemma3, Gemma3Config, weights_transposed
from app.models.gguf_file import GGUFFile
from app.models.model_facts import SUPPORTED_ARCHITECTURES
from app.models.tokenizer import Tokenizer


# GGUF per-layer tensor names -> the attribute a Gemma3Layer reads. Linear weights are
# transposed to [in, out] at load time; norms are vectors.
_GEMMA3_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_GEMMA3_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
                 "post_ffw_norm")


@dataclass
class LoadedModel:
    """Everything the engine needs about one loaded model."""

    path: Path
    name: str
    architecture: str
    model: Gemma3
    config: Gemma3Config
    tokenizer: Tokenizer
    template: ChatTemplate
    device: torch.device
    dtype: torch.dtype  # the weights' (for decode, when there is a wide copy too)
    load_seconds: float
    wide_dtype: torch.dtype | None = None  # a second copy for prefill, see DualWeight

    @property
    def weights_label(self) -> str:
        """e.g. "bfloat16", or "float16+bfloat16" with a wide copy."""
        return "+".join(str(d).removeprefix("torch.") for d in (self.dtype, self.wide_dtype) if d)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activations and KV cache."""
        return self.model.compute_dtype

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end a reply: EOS and the template's end-of-turn markers."""
        return frozenset({self.tokenizer.eos_id, *self.template.stop_token_ids(self.tokenizer)})

    def unload(self) -> None:
        """Drop the weights so their memory can be returned (the caller drops its reference)."""
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self.device.type == "mps":
            torch.mps.empty_cache()


def check_supported(gguf: GGUFFile) -> None:
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{gguf.path.name} is a {arch!r} model; this version of Ferrox Chat runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models."
        )


def _tensor(gguf: GGUFFile, name: str, device: torch.device) -> torch.Tensor:
    info = gguf.tensors.get(name)
    if info is None:
        raise ModelError(f"{gguf.path.name} lacks the tensor {name!r}; the file is incomplete.")
    return dequantize(gguf.raw_tensor(name), info.ggml_type, info.shape, device=device,
                      dtype=torch.float32)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelError(f"Tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}.")


def _load_gemma3(gguf: GGUFFile, cfg: Gemma3Config, device: torch.device, dtype: torch.dtype,
                 compute_dtype: torch.dtype, wide_dtype: torch.dtype | None) -> Gemma3:
    d, D = cfg.d_model, cfg.head_dim
    linear_shapes = {  # [out, in] as stored
        "attn_q": (cfg.n_heads * D, d), "attn_k": (cfg.n_kv_heads * D, d),
        "attn_v": (cfg.n_kv_heads * D, d), "attn_output": (d, cfg.n_heads * D),
        "ffn_gate": (cfg.ffn_dim, d), "ffn_up": (cfg.ffn_dim, d), "ffn_down": (d, cfg.ffn_dim),
    }
    norm_shapes = {"attn_q_norm": (D,), "attn_k_norm": (D,)}
    transposed = weights_transposed(device, dtype)

    def as_linear(w: torch.Tensor) -> torch.Tensor | DualWeight:
        if wide_dtype is not None:
            return DualWeight(w.to(dtype), w.to(wide_dtype))
        return (w.t().contiguous() if transposed else w).to(dtype)

    layers = []
    for i in range(cfg.n_layers):
        weights: dict[str, torch.Tensor] = {}
        for short in _GEMMA3_LINEARS:
            name = f"blk.{i}.{short}.weight"
            w = _tensor(gguf, name, device)
            _check_shape(name, w, linear_shapes[short])
            weights[short] = as_linear(w)
        for short in _GEMMA3_NORMS:
            name = f"blk.{i}.{short}.weight"
            w = _tensor(gguf, name, device)
            _check_shape(name, w, norm_shapes.get(short, (d,)))
            weights[short] = w  # norms stay float32: rms_norm computes in float32
        layers.append(weights)
    embedding = _tensor(gguf, "token_embd.weight", device)
    _check_shape("token_embd.weight", embedding, (cfg.vocab_size, d))
    head = as_linear(embedding)
    del embedding
    output_norm = _tensor(gguf, "output_norm.weight", device)
    _check_shape("output_norm.weight", output_norm, (d,))
    return Gemma3(cfg, head, output_norm, layers, transposed, compute_dtype).eval()


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype,
               compute_dtype: torch.dtype | None = None,
               wide_dtype: torch.dtype | None = None) -> LoadedModel:
    """Load a GGUF model onto `device` with weights in `dtype` and activations in
    `compute_dtype` (default: the weights' dtype). With `wide_dtype`, every weight is also
    kept in that dtype for many-row products (`DualWeight`)."""
    start = time.perf_counter()
    path = Path(path)
    with GGUFFile(path) as gguf:
        check_supported(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        cfg = Gemma3Config.from_gguf_metadata(gguf.metadata, tokenizer.vocab_size)
        template = template_for(gguf.metadata, gguf.architecture)
        try:
            with torch.inference_mode():
                model = _load_gemma3(gguf, cfg, device, dtype, compute_dtype or dtype, wide_dtype)
        except torch.OutOfMemoryError as exc:
            raise ModelError(f"Not enough memory on {device} to load {path.name}.") from exc
        name = str(gguf.get("general.name", path.stem))
    return LoadedModel(path=path, name=name, architecture="gemma3", model=model, config=cfg,
                       tokenizer=tokenizer, template=template, device=device, dtype=dtype,
                       load_seconds=time.perf_counter() - start, wide_dtype=wide_dtype)
