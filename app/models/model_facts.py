"""What the model picker shows about a GGUF file, read from its header alone (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from app.models.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("gemma3",)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    architecture: str
    supported: bool
    context_length: int
    quantization: str  # the tensor type holding most of the bytes, e.g. "Q4_K"
    size_bytes: int
    parameters: int

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.name} · {self.architecture} · {self.parameters / 1e6:,.0f}M parameters · "
                f"{self.quantization} · {self.size_bytes / 1e6:,.0f} MB · "
                f"context {self.context_length:,}")


def read_model_facts(path: str | Path) -> ModelFacts:
    """Raises ModelError for a broken or non-GGUF file."""
    path = Path(path)
    with GGUFFile(path) as gguf:
        bytes_by_type: dict[str, int] = {}
        for info in gguf.tensors.values():
            name = info.ggml_type.name
            bytes_by_type[name] = bytes_by_type.get(name, 0) + info.nbytes
        arch = gguf.architecture
        return ModelFacts(
            name=str(gguf.get("general.name", path.stem)),
            architecture=arch,
            supported=arch in SUPPORTED_ARCHITECTURES,
            context_length=int(gguf.get(f"{arch}.context_length", 0) or 0),
            quantization=max(bytes_by_type, key=bytes_by_type.get) if bytes_by_type else "unknown",
            size_bytes=path.stat().st_size,
            parameters=sum(i.n_elements for i in gguf.tensors.values()),
        )
