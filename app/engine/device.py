"""Device and dtype policy: the one place that decides where a model runs and in what precision.

`auto` picks CUDA, then MPS, then the CPU. Weight dtype for `auto`, per device:
  - CUDA: bfloat16 where the GPU supports it, else float16;
  - MPS: float16 (bfloat16 needs macOS 14+, float16 runs everywhere Metal does);
  - CPU: float16 + bfloat16 for models small enough to hold both (`resolve_weights`), else
    bfloat16. Decode is memory-bound, so halving the weight bytes matters most.
    Measured on the 2-core dev machine (Gemma 3 270M, see `python -m app bench`):
        weights    decode      prefill 1,024   16-token chunk
        float32    ~18 tok/s   1.8 s           --
        bfloat16   ~33 tok/s   0.8 s           39 ms
        float16    ~50 tok/s   1.8 s           97 ms
    float16 decodes fastest but torch has no fast float16 matrix-matrix kernel on the
    CPU, so prefill and the small chunks that interleave with other chats' streams are
    2-3x slower; bfloat16 is the balanced single format. Holding both and picking per
    product gets the best of each.

Activations (and so the KV cache) stay float32 on the CPU and whenever the weights are
float16: Gemma's activations overflow float16 (measured: all-NaN logits in pure float16),
and the CPU gains nothing from narrow activations. Only bfloat16 weights on a GPU compute
in bfloat16.
"""

from __future__ import annotations

import os

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `auto` on the CPU keeps two copies of the weights for model files up to this size (a Q4
# file of 800 MB is ~1.4B parameters: 5.6 GB as float16 + bfloat16).
DUAL_WEIGHTS_MAX_FILE_BYTES = 800 * 2**20


class DeviceError(ValueError):
    """A requested device or dtype is not available here; the message says which and why."""


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_device(name: str = "auto") -> torch.device:
    if name not in DEVICE_CHOICES:
        raise DeviceError(f"Unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}.")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("CUDA was requested but no CUDA GPU is usable by this torch build.")
    if name == "mps" and not mps_available():
        raise DeviceError("MPS was requested but Apple Metal is not available here.")
    return torch.device(name)


def available_devices() -> tuple[str, ...]:
    """The device names that can run a model here, "auto" first: what a settings screen
    should offer (asking for one that is missing fails only at load time)."""
    found = ["auto", "cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if mps_available():
        found.append("mps")
    return tuple(found)


def resolve_weights(name: str, device: torch.device, file_bytes: int
                    ) -> tuple[torch.dtype, torch.dtype | None]:
    """The weight dtype for a dtype name, and the dtype of a second, wide copy (or None).

    `auto` on the CPU, for a small enough model, stores each weight twice: float16 for
    decode and bfloat16 for prefill (`DualWeight`): float16's decode speed with bfloat16's
    prefill speed, for twice the weight memory. Larger models get bfloat16 alone."""
    if name not in DTYPE_CHOICES:
        raise DeviceError(f"Unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}.")
    if name != "auto":
        return _DTYPES[name], None
    if device.type == "cuda":
        return (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16), None
    if device.type == "mps":
        return torch.float16, None
    if file_bytes <= DUAL_WEIGHTS_MAX_FILE_BYTES:
        return torch.float16, torch.bfloat16
    return torch.bfloat16, None


def compute_dtype_for(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if weight_dtype == torch.bfloat16 and device.type != "cpu":
        return torch.bfloat16
    return torch.float32


def configure_cpu_threads() -> None:
    """Use every physical core for matmuls unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, os.cpu_count() or 1))


def load_on(path, device: str = "auto", dtype: str = "auto"):
    """Load a model file where the policy says: device and dtype names as the user gives them."""
    from app.models.loader import load_model
    from app.models.model_facts import model_size_bytes

    torch_device = resolve_device(device)
    file_bytes = model_size_bytes(path)
    weight_dtype, wide = resolve_weights(dtype, torch_device, file_bytes)
    if torch_device.type == "cpu":
        configure_cpu_threads()
    return load_model(path, torch_device, weight_dtype,
                      compute_dtype_for(weight_dtype, torch_device), wide)
