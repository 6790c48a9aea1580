"""Tiny random-weight models of every architecture we run, in both file kinds a user brings.

    from tests.models.tiny_models import CASES, make_tiny_model
    tiny = make_tiny_model("gemma2", tmp_path)
    tiny.hf_dir      # a Hugging Face folder: config.json, model.safetensors, tokenizer.json, ...
    tiny.gguf_path   # the same weights as a float32 GGUF, written as llama.cpp's converter does
    tiny.reference   # transformers' own model (float32, eager attention), for its logits

Cases (`CASES`): llama (Llama 2 shape), llama3-rope (Llama 3.1 scaling, tied head like
SmolLM2), mistral, qwen2 (biases, tied), qwen3 (QK-norm, head_dim != d/heads), phi3 (fused
projections, sliding window), phi4-mini (partial rotary, tied), gemma2 (soft-caps,
alternating window), gemma3 (QK-norm, 5:1 sliding pattern, linear scaling on global
layers), and the 27B layer counts of Gemma 2/3 (46, 62), by which llama.cpp picks their
query scale.

The model is made by transformers' own config class (`LlamaConfig`, `Gemma2Config`, ...) with
seeded random weights (scaled so activations, attention scores and logits are of order one:
soft-caps bite, biases and norm weights matter), saved with `save_pretrained`. The GGUF is
then written from that folder with gguf-py's `GGUFWriter`, following what
`convert_hf_to_gguf.py --outtype f32` does for each family:

* tensor names from gguf-py's own `TensorNameMap` (not from our family modules, so the
  test checks our names against llama.cpp's);
* Llama: the Q and K rows of each head permuted for llama.cpp's interleaved RoPE
  (`LlamaModel.permute`), `rope_freqs` computed by the converter's Llama 3 formula;
* Gemma 2/3: every `*norm.weight` stored as 1 + w, `lm_head` skipped (tied);
* Phi-3: fused `qkv_proj` / `gate_up_proj` kept fused (`attn_qkv`, `ffn_up`), the
  rotary dimension as int(partial_rotary_factor * d_model) // heads, the sliding window
  (0 when none);
* the metadata keys each family's `set_gguf_parameters` writes (Gemma 2 writes no RoPE
  base; key_length only where config.json has head_dim; ...).

The tokenizer in the GGUF is a small SentencePiece-style vocabulary
(`tokenizer.ggml.model = "llama"`: <unk>, <s>, </s>, 256 byte pieces, a few hundred normal
pieces); the folder gets the same vocabulary as a `tokenizers` BPE with byte fallback
(tokenizer.json), as Llama 2's and Gemma's folders hold it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

VOCAB = 320  # 3 specials + 256 bytes + 61 normal pieces
D_MODEL, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 96
PROMPT_LENGTH = 80  # past every sliding window below
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# SentencePiece token types (gguf-py's / llama.cpp's numbering).
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class Case:
    """One tiny model: which family, how transformers' config is made, what it exercises."""

    key: str
    family: str  # our registry key and the GGUF general.architecture
    make_config: Callable[[], Any]
    window: int | None = None  # the smallest sliding window, if the model has one
    deep: bool = False  # a real model's layer count (46, 62): seconds per load, not tenths


@dataclass
class TinyModel:
    case: Case
    hf_dir: Path
    gguf_path: Path | None
    reference: torch.nn.Module  # transformers' model, float32, eval, eager attention
    prompt_ids: list[int]

    @torch.inference_mode()
    def reference_logits(self, ids: list[int] | None = None) -> torch.Tensor:
        """transformers' float32 logits [T, V] for every position of `ids` (default: the prompt)."""
        ids = self.prompt_ids if ids is None else ids
        return self.reference(torch.tensor([ids])).logits[0].float()


# ---- transformers configs --------------------------------------------------------------------


def _common(**extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=FFN, num_hidden_layers=2,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=UNK_ID) | extra


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_common(rms_norm_eps=1e-5,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}))


def _llama3():
    from transformers import LlamaConfig

    # Llama 3.1's scaling. With head_dim 16 and this base the wavelengths span all three
    # regimes (kept, blended, slowed by `factor`) at the original context of 8192, which is
    # also what the converter assumes when config.json has no top-level
    # original_max_position_embeddings.
    rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(**_common(rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=True,
                                 num_hidden_layers=3, max_position_embeddings=131_072))


def _mistral():
    from transformers import MistralConfig

    # Mistral 7B v0.2 and later: the Llama block under another name, no sliding window.
    return MistralConfig(**_common(rms_norm_eps=1e-5, sliding_window=None,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}))


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**_common(rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}))


def _qwen3():
    from transformers import Qwen3Config

    # An explicit head_dim different from d_model / heads, as Qwen 3 has.
    return Qwen3Config(**_common(head_dim=24, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}))


def _phi3():
    from transformers import Phi3Config

    # Phi-3-mini's shape: a sliding window over every layer, an untied head.
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    return Phi3Config(**_common(rms_norm_eps=1e-5, rope_parameters=rope, sliding_window=24,
                                original_max_position_embeddings=512))


def _phi4_mini():
    from transformers import Phi3Config

    # Phi-4-mini's shape: partial rotary, no sliding window (the converter writes 0), tied head.
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75}
    return Phi3Config(**_common(rms_norm_eps=1e-5, rope_parameters=rope, sliding_window=None,
                                tie_word_embeddings=True, original_max_position_embeddings=512))


def _gemma2():
    from transformers import Gemma2Config

    # Caps small enough that both soft-caps work in tanh's curved part; query_pre_attn_scalar
    # = head_dim, as llama.cpp assumes for the 2B/9B models (GGUF files do not store it).
    return Gemma2Config(**_common(num_hidden_layers=3, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                  sliding_window=16, attn_logit_softcapping=5.0,
                                  final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"))


def _gemma2_27b():
    from transformers import Gemma2Config

    # The 27B model's shape where it matters: 46 layers, which is how llama.cpp recognises it
    # to scale queries by (d_model / heads)^-1/2 = query_pre_attn_scalar^-1/2, not head_dim's.
    return Gemma2Config(**_common(num_hidden_layers=46, hidden_size=96, head_dim=HEAD_DIM,
                                  query_pre_attn_scalar=96 // HEADS, sliding_window=16,
                                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                  hidden_activation="gelu_pytorch_tanh"))


def _gemma3():
    from transformers import Gemma3TextConfig

    # Six layers: five sliding, the sixth global (the fixed pattern llama.cpp assumes).
    # Linear RoPE scaling on the global layers, as Gemma 3 4B and larger have.
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return Gemma3TextConfig(**_common(num_hidden_layers=6, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                      sliding_window=20, rope_parameters=rope,
                                      hidden_activation="gelu_pytorch_tanh"))


def _gemma3_27b():
    from transformers import Gemma3TextConfig

    # As for Gemma 2: 62 layers mark the 27B model, whose query scale is (d_model / heads)^-1/2.
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return Gemma3TextConfig(**_common(num_hidden_layers=62, hidden_size=96, head_dim=HEAD_DIM,
                                      query_pre_attn_scalar=96 // HEADS, sliding_window=20,
                                      rope_parameters=rope, hidden_activation="gelu_pytorch_tanh"))


CASES: dict[str, Case] = {c.key: c for c in (
    Case("llama", "llama", _llama),
    Case("llama3-rope", "llama", _llama3),
    Case("mistral", "llama", _mistral),
    Case("qwen2", "qwen2", _qwen2),
    Case("qwen3", "qwen3", _qwen3),
    Case("phi3", "phi3", _phi3, window=24),
    Case("phi4-mini", "phi3", _phi4_mini),
    Case("gemma2", "gemma2", _gemma2, window=16),
    Case("gemma2-27b", "gemma2", _gemma2_27b, window=16, deep=True),
    Case("gemma3", "gemma3", _gemma3, window=20),
    Case("gemma3-27b", "gemma3", _gemma3_27b, window=20, deep=True),
)}


# ---- random weights --------------------------------------------------------------------------


def _randomize(model: torch.nn.Module, gemma: bool, seed: int) -> None:
    """Seeded weights of order one: linear weights ~ N(0, 1/in), embeddings ~ N(0, 1), biases
    ~ N(0, 0.25), norm weights around 1 (Gemma stores w for a scale of 1 + w: around 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = noise * 0.2 + (0.0 if gemma else 1.0)
            elif name.endswith(".bias"):
                value = noise * 0.5
            elif "embed_tokens" in name:
                value = noise
            else:  # [out, in]
                value = noise / math.sqrt(p.shape[-1])
            p.copy_(value)


def _prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [BOS_ID] + rng.integers(len(SPECIALS), VOCAB, PROMPT_LENGTH - 1).tolist()


# ---- vocabulary ------------------------------------------------------------------------------


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, types: <unk> <s> </s>, the 256 byte pieces, then normal pieces."""
    tokens = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    normal = ["▁"] + list(letters) + ["▁" + c for c in letters]
    normal += ["th", "he", "in", "er", "an", "ing", "▁the", "▁in"][: VOCAB - len(tokens) - len(normal)]
    assert len(tokens) + len(normal) == VOCAB, len(tokens) + len(normal)
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(normal))]
    return tokens + normal, scores, types + [_NORMAL] * len(normal)


def _merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges that build every multi-character normal piece from two pieces in the vocabulary."""
    vocab, merges = set(tokens), []
    for piece in tokens[len(SPECIALS) + 256:]:
        if len(piece) > 1 and not piece.startswith("<"):
            split = next(i for i in range(len(piece) - 1, 0, -1) if piece[:i] in vocab and piece[i:] in vocab)
            merges.append((piece[:split], piece[split:]))
    return merges


def _save_hf_tokenizer(folder: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json, special_tokens_map.json) for the same
    vocabulary: BPE with byte fallback over '▁'-escaped text, as Llama 2's folders have."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, _, _ = vocabulary()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(tokens),
                     unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


# ---- the GGUF, as convert_hf_to_gguf.py writes it ------------------------------------------


def _llama_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from rotate-half order
    (i, i + D/2) into interleaved pairs (2i, 2i + 1)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(hp: dict, rope: dict) -> np.ndarray:
    """The converter's `rope_freqs` tensor: per-frequency divisors, computed in float32 torch
    for the frequencies and Python floats for the rest, exactly as it does."""
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = hp.get("original_max_position_embeddings", 8192)  # top level, as the converter reads it
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _rope_parameters(hp: dict) -> dict:
    params = hp.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _write_base_parameters(w, hp: dict) -> None:
    """TextModel.set_gguf_parameters: what every family not overriding it writes."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = _rope_parameters(hp)
    if rope.get("rope_type") == "linear" and rope.get("factor") is not None:
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def _write_parameters(w, family: str, hp: dict) -> None:
    if family == "phi3":  # Phi3MiniModel.set_gguf_parameters (does not call the base one)
        rope = _rope_parameters(hp)
        w.add_context_length(hp["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 hp.get("original_max_position_embeddings")))
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hp["hidden_size"])
                                   // hp["num_attention_heads"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
        return
    if family == "gemma2":  # Gemma2Model.set_gguf_parameters: no RoPE base (llama.cpp's 10000)
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
        return
    _write_base_parameters(w, hp)
    if family == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    elif family == "gemma3":  # Gemma3Model.set_gguf_parameters (on top of the base)
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])


def _write_vocabulary(w, family: str) -> None:
    """_set_vocab_sentencepiece + SpecialVocab: tokens, scores, types and the special ids."""
    tokens, scores, types = vocabulary()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if family in ("gemma2", "gemma3"):
        w.add_add_space_prefix(False)


def _gguf_tensors(family: str, hp: dict, state: dict[str, torch.Tensor]):
    """(name, float32 array) in the converter's order: the stored tensors, modified per family,
    then the generated ones (Llama 3's rope_freqs)."""
    import gguf

    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
            "phi3": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
            "gemma3": gguf.MODEL_ARCH.GEMMA3}[family]
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    for name, tensor in state.items():
        tensor = tensor.float()
        if family == "gemma2" and name == "lm_head.weight":
            continue
        if family == "llama":
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                tensor = _llama_permute(tensor, hp["num_attention_heads"], hp["num_attention_heads"])
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                tensor = _llama_permute(tensor, hp["num_attention_heads"], hp["num_key_value_heads"])
        if family in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"gguf-py has no {family} name for {name!r}")
        yield new_name, tensor.numpy()
    rope = _rope_parameters(hp)
    if family == "llama" and rope.get("rope_type") == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _llama3_rope_freqs(hp, rope)


def write_gguf_like_converter(hf_dir: Path, path: Path, family: str) -> Path:
    """A float32 GGUF of the Hugging Face folder, written as `convert_hf_to_gguf.py
    --outtype f32` writes one (see the module docstring)."""
    import gguf
    from safetensors.torch import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    w = gguf.GGUFWriter(path, family)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.name)
    _write_parameters(w, family, hp)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_vocabulary(w, family)
    for name, array in _gguf_tensors(family, hp, state):
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return path


# ---- Gemma 3 with its vision tower ----------------------------------------------------------


def make_gemma3_multimodal(root: Path, seed: int = 0) -> TinyModel:
    """A Gemma3ForConditionalGeneration folder (Gemma 3 4B and larger ship so): config.json
    with text_config/vision_config, the text weights under `language_model.`, a tiny SigLIP
    tower beside them. `gguf_path` is None: the converter writes the text model as for
    Gemma3ForCausalLM, which the "gemma3" case covers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=_gemma3().to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=VOCAB)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize(model, gemma=True, seed=seed)
    folder = root / "tiny-gemma3-multimodal"
    model.save_pretrained(folder)
    _save_hf_tokenizer(folder)
    return TinyModel(CASES["gemma3"], folder, None, model, _prompt(seed + 1))


# ---- config.json as transformers 4 wrote it ---------------------------------------------------


def _unscaled(params: dict) -> dict | None:
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return None if rest.get("rope_type", "default") == "default" else rest


def legacy_config_json(folder: Path) -> None:
    """Rewrite `folder`'s config.json as transformers 4 wrote it, as most folders on the Hub
    still have it: `rope_theta` and `rope_scaling` (null when unscaled) at the top level
    instead of `rope_parameters`, Phi's `partial_rotary_factor` at the top level, Gemma 3's
    local base as `rope_local_base_freq` with `sliding_window_pattern`, and no `layer_types`
    (Gemma 2 and 3 then slide by their fixed patterns)."""
    path = folder / "config.json"
    hp = json.loads(path.read_text())
    params = hp.get("rope_parameters") or {}
    dropped = ("rope_parameters", "layer_types", "_sliding_window_pattern")
    old = {k: v for k, v in hp.items() if k not in dropped}
    if "full_attention" in params:  # Gemma 3
        full, local = params["full_attention"], params["sliding_attention"]
        old |= {"rope_theta": full["rope_theta"], "rope_scaling": _unscaled(full),
                "rope_local_base_freq": local["rope_theta"], "sliding_window_pattern": 6}
    else:
        old |= {"rope_theta": params["rope_theta"], "rope_scaling": _unscaled(params)}
        if "partial_rotary_factor" in params:
            old["partial_rotary_factor"] = params["partial_rotary_factor"]
    old["transformers_version"] = "4.50.0"
    path.write_text(json.dumps(old, indent=2))


# ---- putting it together ---------------------------------------------------------------------


def make_tiny_model(key: str, root: Path, seed: int = 0) -> TinyModel:
    """Build case `key` under `root` (a fresh folder): the transformers model, its Hugging
    Face folder and its GGUF."""
    from transformers import AutoModelForCausalLM

    case = CASES[key]
    config = case.make_config()
    config._attn_implementation = "eager"  # Gemma 2's soft-capping needs it; the reference for all
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, gemma=case.family.startswith("gemma"), seed=seed)
    model.eval()
    hf_dir = root / f"tiny-{key}"
    model.save_pretrained(hf_dir)
    _save_hf_tokenizer(hf_dir)
    gguf_path = write_gguf_like_converter(hf_dir, root / f"tiny-{key}.F32.gguf", case.family)
    return TinyModel(case, hf_dir, gguf_path, model, _prompt(seed + 1))
