"""Tensors out of model files as float32 torch tensors, and the loop that fills a model's
weight slots from them.

Two sources share one small interface (`shapes`, `read`): a GGUF file (dequantized from its
stored block format by `app.models.dequant`) and a Hugging Face folder of `*.safetensors`
files (read with the `safetensors` library, sharded or not).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from gguf.constants import GGML_QUANT_SIZES

from app.models.dequant import _as_torch_bytes, dequantize
from app.models.errors import ModelError
from app.models.families.common import TensorRef
from app.models.gguf_file import GGUFFile
from app.models.quantized import RawTensor


class GGUFTensors:
    def __init__(self, gguf: GGUFFile, device: torch.device):
        self.gguf, self.device = gguf, device
        self.shapes = {name: tuple(info.shape) for name, info in gguf.tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelError(f"{self.gguf.path.name} lacks the tensor {name!r}; the file is incomplete.")
        return dequantize(self.gguf.raw_tensor(name), info.ggml_type, info.shape, device=self.device,
                          dtype=torch.float32)

    def ggml_type(self, name: str):
        info = self.gguf.tensors.get(name)
        return None if info is None else info.ggml_type

    def read_raw(self, name: str) -> RawTensor:
        """A 2-D tensor's stored blocks, row by row, without dequantizing (a view of the file)."""
        info = self.gguf.tensors.get(name)
        if info is None or len(info.shape) != 2:
            raise ModelError(f"{self.gguf.path.name} lacks the 2-D tensor {name!r}; the file is incomplete.")
        data = _as_torch_bytes(self.gguf.raw_tensor(name))
        rows, cols = (int(d) for d in info.shape)
        block, size = GGML_QUANT_SIZES[info.ggml_type]
        if cols % block or data.numel() != rows * cols // block * size:
            raise ModelError(f"Tensor {name!r} holds {data.numel():,} bytes, wrong for its shape "
                             f"{(rows, cols)}; the file is corrupt.")
        return RawTensor(data.view(rows, -1), info.ggml_type, (rows, cols))


# Multimodal checkpoints keep the language model under another prefix; map it to the
# text-only names the family maps use.
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))


class SafetensorsTensors:
    """Every `*.safetensors` file of a folder (an index file, if any, is not needed: each
    file's header lists its tensors)."""

    def __init__(self, folder: Path, device: torch.device):
        from safetensors import safe_open

        self.device = device
        self._files: dict[str, object] = {}
        self._where: dict[str, tuple[object, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{folder.name} holds no .safetensors weights.")
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # the library raises its own error types
                raise ModelError(f"{path.name} is not a readable safetensors file ({exc}).") from None
            self._files[path.name] = handle
            for stored in handle.keys():
                name = stored
                for old, new in _PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                self._where[name] = (handle, stored)
                self.shapes[name] = tuple(handle.get_slice(stored).get_shape())

    def read(self, name: str) -> torch.Tensor:
        found = self._where.get(name)
        if found is None:
            raise ModelError(f"The model folder lacks the tensor {name!r}; it is incomplete.")
        handle, stored = found
        try:
            tensor = handle.get_tensor(stored)
        except Exception as exc:
            raise ModelError(f"Tensor {name!r} could not be read ({exc}); the file is damaged.") from None
        return tensor.to(device=self.device, dtype=torch.float32)


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"The model folder has no {path.name}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path.name} in the model folder is unreadable ({exc}).") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path.name} in the model folder is not a JSON object.")
    return value


def fill_weights(model, refs: Iterable[TensorRef], source,
                 assigned: Callable[[str], None] | None = None) -> None:
    """Read every referenced tensor once (fused tensors feed several slots) and assign it;
    `assigned(slot)` is told after each slot is filled (the weight cache's `EntryWriter`).
    The caller then finishes the model (`finish_loading`)."""
    cached_name, cached = None, None
    for ref in refs:
        if ref.name != cached_name:
            raw = (hasattr(model, "wants_raw") and hasattr(source, "read_raw")
                   and model.wants_raw(ref.slot, source.ggml_type(ref.name)))
            cached_name, cached = ref.name, (source.read_raw if raw else source.read)(ref.name)
        tensor = cached
        if ref.rows is not None:
            start, end = ref.rows
            if len(tensor.shape) < 1 or tensor.shape[0] < end:
                raise ModelError(f"Tensor {ref.name!r} has shape {tuple(tensor.shape)}, too small to "
                                 f"hold rows {start}..{end} of the fused weight.")
            tensor = tensor.rows(start, end) if isinstance(tensor, RawTensor) else tensor[start:end]
        if ref.add_one:
            tensor = tensor + 1.0
        model.assign(ref.slot, tensor)
        if assigned is not None:
            assigned(ref.slot)
