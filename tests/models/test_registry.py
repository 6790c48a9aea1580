"""The model registry: one row per family, lookups from GGUF and Hugging Face names, refusals
that name what is supported, and a table the GUI can read without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from app.models.errors import ModelError
from app.models.model_facts import read_model_facts
from app.models.registry import (ARCHITECTURES, SUPPORTED_ARCHITECTURES, find_hf_architecture,
                                 gguf_architecture, hf_architecture)
from tests.gguf_factory import write_gguf


def test_every_family_module_has_the_four_functions():
    for arch in ARCHITECTURES:
        module = arch.load_module()
        for name in ("config_from_gguf", "config_from_hf", "gguf_tensors", "hf_tensors"):
            assert callable(getattr(module, name)), (arch.key, name)
    assert set(SUPPORTED_ARCHITECTURES) == {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}


def test_lookups_by_gguf_and_hugging_face_names():
    assert gguf_architecture("llama", "x.gguf").key == "llama"
    assert hf_architecture({"architectures": ["MistralForCausalLM"]}, "m").key == "llama"
    assert hf_architecture({"model_type": "gemma3_text"}, "g").key == "gemma3"
    assert hf_architecture({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "q").key == "qwen3"
    assert find_hf_architecture({"architectures": "not a list"}) is None


def test_unknown_architectures_are_refused_naming_the_supported_ones():
    with pytest.raises(ModelError, match=r"'mamba' model; Ferrox Chat runs Llama, Qwen 2"):
        gguf_architecture("mamba", "m.gguf")
    with pytest.raises(ModelError, match="holds a 'bert' model"):
        hf_architecture({"model_type": "bert"}, "folder")


def test_the_registry_and_model_facts_import_no_torch():
    code = ("import sys, app.models.registry, app.models.model_facts; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_facts_refuse_an_unsupported_architecture_and_name_unreadable_tensor_types(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", metadata={"general.architecture": "mamba"},
                      tensors={"x.weight": np.ones(32, np.float32)})
    facts = read_model_facts(path)
    assert not facts.supported and "'mamba' model" in facts.problem
    path = write_gguf(tmp_path / "q.gguf", metadata={"general.architecture": "llama"},
                      tensors={"x.weight": np.ones(32, np.float32)})
    facts = read_model_facts(path)
    assert facts.supported and facts.architecture == "llama"
    from app.models.tensor_formats import unreadable_type_names
    assert unreadable_type_names([T.Q8_K, T.Q4_K, T.I32]) == ["I32", "Q8_K"]


def test_facts_of_a_hugging_face_folder(tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048}))
    save_file({"a": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.zeros(8, dtype=torch.bfloat16)},
              str(folder / "model.safetensors"))
    facts = read_model_facts(folder)
    assert facts.architecture == "llama" and facts.parameters == 40 and facts.quantization == "BF16"
    assert not facts.supported and "tokenizer.json" in facts.problem
    (folder / "tokenizer.json").write_text("{}")
    assert read_model_facts(folder).supported
    with pytest.raises(ModelError, match="no config.json"):
        read_model_facts(tmp_path)
