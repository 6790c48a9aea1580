"""What the model picker shows about a model, read from its header alone (no torch): a GGUF
file's metadata and tensor directory, or a Hugging Face folder's config.json and safetensors
headers. `supported` says whether Ferrox Chat can run it and `problem` why not."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from app.models.errors import ModelError
from app.models.gguf_file import GGUFFile
from app.models.registry import SUPPORTED_ARCHITECTURES, find_gguf_architecture, find_hf_architecture
from app.models.tensor_formats import unreadable_type_names

__all__ = ["ModelFacts", "read_model_facts", "model_size_bytes", "SUPPORTED_ARCHITECTURES"]

_SAFETENSORS_HEADER_MAX = 100 * 2**20


@dataclass(frozen=True)
class ModelFacts:
    name: str
    architecture: str
    supported: bool
    context_length: int
    quantization: str  # the tensor type holding most of the bytes, e.g. "Q4_K"
    size_bytes: int
    parameters: int
    problem: str = ""  # why it cannot run, when it cannot

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.name} · {self.architecture} · {self.parameters / 1e6:,.0f}M parameters · "
                f"{self.quantization} · {self.size_bytes / 1e6:,.0f} MB · "
                f"context {self.context_length:,}")


def read_model_facts(path: str | Path) -> ModelFacts:
    """Raises ModelError for a broken file or a folder that is not a model."""
    path = Path(path)
    return _folder_facts(path) if path.is_dir() else _gguf_facts(path)


def model_size_bytes(path: str | Path) -> int:
    """Bytes of weights: the file, or a folder's safetensors files."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size if path.exists() else 0


def _gguf_facts(path: Path) -> ModelFacts:
    with GGUFFile(path) as gguf:
        bytes_by_type: dict[str, int] = {}
        for info in gguf.tensors.values():
            name = info.ggml_type.name
            bytes_by_type[name] = bytes_by_type.get(name, 0) + info.nbytes
        arch = gguf.architecture
        problem = ""
        if find_gguf_architecture(arch) is None:
            problem = (f"{path.name} is a {arch!r} model; Ferrox Chat runs "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)} models.")
        elif bad := unreadable_type_names(i.ggml_type for i in gguf.tensors.values()):
            problem = (f"{path.name} stores tensors as {', '.join(bad)}, which Ferrox Chat cannot "
                       "read. Try a file quantized differently (e.g. Q4_K_M or Q8_0).")
        name = gguf.get("general.name")
        try:
            context = gguf.get_int(f"{arch}.context_length", 0, min=0)
        except ModelError as exc:  # shown, not raised: the picker says why it cannot run
            context, problem = 0, problem or str(exc)
        return ModelFacts(
            name=name if isinstance(name, str) and name.strip() else path.stem,
            architecture=arch,
            supported=not problem,
            context_length=context,
            quantization=max(bytes_by_type, key=bytes_by_type.get) if bytes_by_type else "unknown",
            size_bytes=path.stat().st_size,
            parameters=sum(i.n_elements for i in gguf.tensors.values()),
            problem=problem,
        )


def _folder_facts(path: Path) -> ModelFacts:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{path.name} is not a model folder: it has no config.json.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path.name}/config.json is unreadable ({exc}).") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path.name}/config.json is not a JSON object.")
    files = sorted(path.glob("*.safetensors"))
    parameters, dtypes = 0, {}
    for file in files:
        for dtype, count in _safetensors_counts(file).items():
            dtypes[dtype] = dtypes.get(dtype, 0) + count
            parameters += count
    arch = find_hf_architecture(config)
    kind = config.get("model_type") if isinstance(config.get("model_type"), str) else "unknown"
    problem = ""
    if arch is None:
        problem = f"{path.name} holds a {kind!r} model; Ferrox Chat runs {', '.join(SUPPORTED_ARCHITECTURES)} models."
    elif not files:
        problem = f"{path.name} has no .safetensors weights."
    elif not (path / "tokenizer.json").is_file():
        problem = f"{path.name} has no tokenizer.json."
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    context = text.get("max_position_embeddings", 0)
    return ModelFacts(
        name=path.name, architecture=arch.key if arch else kind, supported=not problem,
        context_length=context if isinstance(context, int) and context > 0 else 0,
        quantization=max(dtypes, key=dtypes.get) if dtypes else "unknown",
        size_bytes=sum(f.stat().st_size for f in files), parameters=parameters, problem=problem)


def _safetensors_counts(file: Path) -> dict[str, int]:
    """Element counts per dtype from a safetensors header (8-byte length + JSON)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= _SAFETENSORS_HEADER_MAX:
                raise ValueError("implausible header length")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelError(f"{file.name} is not a readable safetensors file ({exc}).") from None
    counts: dict[str, int] = {}
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        n = 1
        for d in entry.get("shape", []):
            n *= int(d)
        dtype = str(entry.get("dtype", "?"))
        counts[dtype] = counts.get(dtype, 0) + n
    return counts
