"""The model registry: which architectures Ferrox Chat runs, and the module for each.

One row per family. A GGUF file names its architecture in `general.architecture`; a Hugging
Face folder in `config.json` (`architectures` and `model_type`). The row names the family
module (imported only when a model of that family is loaded, so this table stays free of
torch for the GUI). Adding a family: write its module in `app/models/families/` and add its
row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from app.models.errors import ModelError


@dataclass(frozen=True)
class Architecture:
    key: str  # our name for the family
    display: str
    gguf_names: tuple[str, ...]  # general.architecture values
    hf_names: tuple[str, ...]  # config.json `architectures` entries and `model_type` values
    module: str

    def load_module(self):
        """The family module: config_from_gguf/config_from_hf, gguf_tensors/hf_tensors."""
        return importlib.import_module(self.module)


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", "Llama", ("llama",),
                 ("LlamaForCausalLM", "MistralForCausalLM", "llama", "mistral"), "app.models.families.llama"),
    Architecture("qwen2", "Qwen 2", ("qwen2",), ("Qwen2ForCausalLM", "qwen2"), "app.models.families.qwen2"),
    Architecture("qwen3", "Qwen 3", ("qwen3",), ("Qwen3ForCausalLM", "qwen3"), "app.models.families.qwen3"),
    Architecture("phi3", "Phi-3", ("phi3",), ("Phi3ForCausalLM", "phi3"), "app.models.families.phi3"),
    Architecture("gemma2", "Gemma 2", ("gemma2",), ("Gemma2ForCausalLM", "gemma2"), "app.models.families.gemma2"),
    Architecture("gemma3", "Gemma 3", ("gemma3",),
                 ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "gemma3", "gemma3_text"),
                 "app.models.families.gemma3"),
)

SUPPORTED_ARCHITECTURES = tuple(a.key for a in ARCHITECTURES)


def _supported_list() -> str:
    return ", ".join(a.display for a in ARCHITECTURES)


def find_gguf_architecture(name: object) -> Architecture | None:
    return next((a for a in ARCHITECTURES if name in a.gguf_names), None)


def find_hf_architecture(config: dict) -> Architecture | None:
    names = config.get("architectures") or []
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    model_type = config.get("model_type")
    for arch in ARCHITECTURES:
        if any(n in arch.hf_names for n in names) or model_type in arch.hf_names:
            return arch
    return None


def gguf_architecture(name: object, file_name: str) -> Architecture:
    arch = find_gguf_architecture(name)
    if arch is None:
        raise ModelError(f"{file_name} is a {name!r} model; Ferrox Chat runs {_supported_list()} models.")
    return arch


def hf_architecture(config: dict, folder_name: str) -> Architecture:
    arch = find_hf_architecture(config)
    if arch is None:
        kind = config.get("model_type") or config.get("architectures")
        raise ModelError(f"{folder_name} holds a {kind!r} model; Ferrox Chat runs {_supported_list()} models.")
    return arch
