"""Turn a model file into a ready-to-run model: weights, tokenizer, chat template, facts.

One entry point, `load_model`, for a GGUF file or a Hugging Face folder (config.json,
*.safetensors, tokenizer.json) of any architecture in `app.models.registry`. The family
module reads the hyperparameters into a `DecoderConfig` and names the tensor for each weight
slot; the model is built first and its slots filled afterwards. Anything wrong with the file
surfaces as `ModelError` with a message a person can act on.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.heap import release_freed_memory
from app.models.causal_lm import CausalLM, KVFacts
from app.models.chat_template import (ChatTemplate, fallback_template, template_for,
                                      template_from_source)
from app.models.errors import ModelError
from app.models.families.common import HFConfig
from app.models import int8_products
from app.models.gguf_file import GGUFFile
from app.models.layers import WeightFormat, weights_transposed
from app.models.load_progress import set_within
from app.models.registry import gguf_architecture, hf_architecture
from app.models.tensor_formats import unreadable_type_names
from app.models.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_folder
from app.models.transformer import DecoderConfig, TransformerLM
from app.models.weight_cache import EntryWriter, WeightCache
from app.models.weight_sources import GGUFTensors, SafetensorsTensors, fill_weights, read_json

ProgressFn = Callable[[float], None]  # fraction of the weights loaded, 0..1


@dataclass
class LoadedModel:
    """Everything the engine needs about one loaded model."""

    path: Path
    name: str
    architecture: str
    model: CausalLM
    config: DecoderConfig
    tokenizer: object  # app.models.tokenizer's SentencePiece or byte-level BPE tokenizer
    template: ChatTemplate
    device: torch.device
    dtype: torch.dtype  # the weights' (for decode, when there is a wide copy too)
    load_seconds: float
    wide_dtype: torch.dtype | None = None  # a second copy for prefill, see DualWeight
    weight_format: WeightFormat | None = None
    # What the dtype policy chose and why, for the status bar (app.engine.kernel_policy).
    policy_label: str = ""
    policy_reason: str = ""
    load_plan: object | None = None  # app.engine.device.LoadPlan, when loaded through load_on

    @property
    def weights_label(self) -> str:
        """e.g. "bfloat16", "float16+bfloat16" with a wide copy, "int4(bfloat16)+float16"."""
        if self.weight_format is not None:
            return self.weight_format.label
        return "+".join(str(d).removeprefix("torch.") for d in (self.dtype, self.wide_dtype) if d)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activations (and the KV cache, unless the load plan measured another dtype for it)."""
        return self.model.compute_dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the load plan's measured choice, else the activations'.
        Attention casts its queries to it and its result back (`DecoderLayer._attend`)."""
        return getattr(self.load_plan, "kv_dtype", None) or self.compute_dtype

    @property
    def kv_facts(self) -> KVFacts:
        return self.model.kv_facts

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end a reply: EOS and the template's end-of-turn markers."""
        ids = set(self.template.stop_token_ids(self.tokenizer))
        if self.tokenizer.eos_id is not None:
            ids.add(self.tokenizer.eos_id)
        return frozenset(ids)

    @property
    def filler_token_id(self) -> int:
        """A token to run when a pass needs one and no prompt gives it (warm-up, an empty
        prompt): BOS where the model has one."""
        for candidate in (self.tokenizer.bos_id, self.tokenizer.eos_id, 0):
            if candidate is not None:
                return candidate
        return 0

    def unload(self) -> None:
        """Drop the weights so their memory can be returned (the caller drops its reference)."""
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self.device.type == "mps":
            torch.mps.empty_cache()
        else:
            release_freed_memory()  # the C heap keeps freed pages otherwise (see `app.heap`)


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype,
               compute_dtype: torch.dtype | None = None,
               wide_dtype: torch.dtype | None = None,
               progress: ProgressFn | None = None, int4: WeightFormat | None = None,
               weight_cache_dir: Path | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder onto `device` with weights in `dtype` and
    activations in `compute_dtype` (default: the weights' dtype). With `wide_dtype`, every
    linear weight is also kept in that dtype for many-row products (`DualWeight`). With
    `int4` (a format whose `int4` is set), GGUF weights whose blocks fit the 4-bit kernel
    stay quantized as that format says (`QuantizedWeight`). With `weight_cache_dir`, a GGUF
    model's prepared weights are saved there once and memory-mapped on later loads
    (`app.models.weight_cache`)."""
    start = time.perf_counter()
    path = Path(path)
    fmt = WeightFormat(dtype, weights_transposed(device, dtype), wide_dtype)
    if int4 is not None and int4.int4 and device.type == "cpu":
        fmt = WeightFormat(dtype, fmt.transposed, wide_dtype, True, int4.int4_act_dtype,
                           int4.int4_wide_dtype, int4.int8_acts)
        if fmt.int8_acts:  # compiled now (once a process, ~0.6 s), not at the first token
            int8_products.kernel()
    loader = _load_hf_folder if path.is_dir() else functools.partial(_load_gguf, cache_dir=weight_cache_dir)
    try:
        with torch.inference_mode():
            parts = loader(path, device, fmt, compute_dtype or dtype, progress)
    except torch.OutOfMemoryError as exc:
        raise ModelError(f"Not enough memory on {device} to load {path.name}.") from exc
    except MemoryError as exc:
        raise ModelError(f"Not enough memory to load {path.name}.") from exc
    name, arch, model, cfg, tokenizer, template = parts
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelError(f"{path.name}'s tokenizer has {tokenizer.vocab_size:,} tokens but its "
                         f"embedding only {cfg.vocab_size:,} rows; the file is inconsistent.")
    return LoadedModel(path=path, name=name, architecture=arch, model=model, config=cfg,
                       tokenizer=tokenizer, template=template, device=device, dtype=dtype,
                       load_seconds=time.perf_counter() - start, wide_dtype=wide_dtype,
                       weight_format=fmt)


def load_tokenizer(path: str | Path):
    """Only the tokenizer of a GGUF file or Hugging Face folder (no weights are read)."""
    path = Path(path)
    if path.is_dir():
        return tokenizer_from_hf_folder(path)
    with GGUFFile(path) as gguf:
        return tokenizer_from_gguf(gguf)


def _build(family, cfg: DecoderConfig, refs, source, fmt: WeightFormat,
           compute_dtype: torch.dtype, progress: ProgressFn | None,
           model: TransformerLM | None = None, writer: EntryWriter | None = None) -> TransformerLM:
    model = model if model is not None else TransformerLM(cfg, fmt, compute_dtype)
    refs = list(refs)
    reporting = None
    if progress is not None:
        reporting = _reporting(refs, [_values(ref, source.shapes) for ref in refs], progress)
    try:
        fill_weights(model, refs if reporting is None else reporting, source,
                     writer.assigned if writer is not None else None)
    finally:
        if reporting is not None:
            reporting.close()  # its callback cleared now, in this thread, after an error too
    if writer is not None:
        writer.drain()  # every part mapped back before the layers are joined for good
    return model.finish_loading()


def _values(ref, shapes: dict[str, tuple[int, ...]]) -> int:
    """How many values `ref` fills (its rows of a fused tensor); 1 for a tensor the source
    does not list (`fill_weights` then says what is missing)."""
    shape = shapes.get(ref.name)
    if not shape:
        return 1
    values = math.prod(shape)
    if ref.rows is not None and shape[0]:
        values = values // shape[0] * (ref.rows[1] - ref.rows[0])
    return max(values, 1)


def _reporting(refs, sizes: list[int], progress: ProgressFn):
    """refs, reporting after each how much of the load is done, by the values each fills
    (Gemma 3 270M's embedding is ~60% of its values, one of its ~200 tensors), and within a
    large one as its preparation reports (`load_progress`)."""
    total = max(sum(sizes), 1)
    done = 0
    try:
        for ref, size in zip(refs, sizes):
            start = done
            set_within(lambda fraction: progress((start + min(max(fraction, 0.0), 1.0) * size) / total))
            yield ref
            done += size
            progress(done / total)
    finally:
        set_within(None)


def _load_gguf(path: Path, device, fmt, compute_dtype, progress, cache_dir: Path | None = None):
    with GGUFFile(path) as gguf:
        arch = gguf_architecture(gguf.architecture, path.name)
        bad = unreadable_type_names(info.ggml_type for info in gguf.tensors.values())
        if bad:
            raise ModelError(f"{path.name} stores tensors as {', '.join(bad)}, which Ferrox Chat "
                             "cannot read. Try a file quantized differently (e.g. Q4_K_M or Q8_0).")
        family = arch.load_module()
        tokenizer = tokenizer_from_gguf(gguf)
        source = GGUFTensors(gguf, device)
        cfg = family.config_from_gguf(gguf, source.shapes, source.read)
        template = template_for(gguf.metadata, arch.key)
        cache = (WeightCache(cache_dir, path, fmt, compute_dtype)
                 if cache_dir is not None and device.type == "cpu" else None)
        model = TransformerLM(cfg, fmt, compute_dtype)
        if cache is not None and cache.restore(model):
            if progress is not None:
                progress(1.0)
        else:
            model = TransformerLM(cfg, fmt, compute_dtype)  # (not the one a failed restore touched)
            # Each layer is saved as it is built and then runs from the saved part, mapped.
            writer = cache.writer(model) if cache is not None else None
            try:
                model = _build(family, cfg, family.gguf_tensors(cfg), source, fmt, compute_dtype,
                               progress, model, writer)
            except BaseException:
                if writer is not None:
                    writer.abandon()
                raise
            built = model
            if writer is not None and writer.finish():
                # Run on the saved entry, mapped, as every later load does: what the build
                # still holds (embedding, head) goes back, and the first session decodes as
                # fast as later ones (Gemma 3 270M: 919 -> 373 MB resident after loading,
                # 41.5 -> 43.6 tok/s).
                mapped = TransformerLM(cfg, fmt, compute_dtype)
                if cache.restore(mapped):
                    model = mapped
            if model is built:
                model.own_file_views()
        name = gguf.get("general.name") if isinstance(gguf.get("general.name"), str) else path.stem
    return name, arch.key, model, cfg, tokenizer, template


def _load_hf_folder(path: Path, device, fmt, compute_dtype, progress):
    raw = read_json(path / "config.json")
    arch = hf_architecture(raw, path.name)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else None
    config = HFConfig({**raw, **text} if text else raw)
    family = arch.load_module()
    cfg = family.config_from_hf(config)
    tokenizer = tokenizer_from_hf_folder(path)
    template = _hf_template(path, arch.key, tokenizer)
    source = SafetensorsTensors(path, device)
    model = _build(family, cfg, family.hf_tensors(cfg), source, fmt, compute_dtype, progress)
    return path.name, arch.key, model, cfg, tokenizer, template


def _hf_template(folder: Path, arch: str, tokenizer) -> ChatTemplate:
    """The folder's chat template: chat_template.jinja (transformers 5) or tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: "default")."""
    source = None
    jinja = folder / "chat_template.jinja"
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path) if config_path.exists() else {}
    if jinja.is_file():
        source = jinja.read_text(encoding="utf-8", errors="replace")
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
    if isinstance(source, str) and source.strip():
        return template_from_source(source, bos_token=_token_text(config.get("bos_token")),
                                    eos_token=_token_text(config.get("eos_token")))
    return fallback_template(arch, _Vocabulary(tokenizer), bos_token=_token_text(config.get("bos_token")),
                             eos_token=_token_text(config.get("eos_token")))


class _Vocabulary:
    """`piece in vocabulary`, asked of a tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __contains__(self, piece: object) -> bool:
        return isinstance(piece, str) and self.tokenizer.token_id(piece) is not None


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older files
        value = value.get("content")
    return value if isinstance(value, str) else ""
