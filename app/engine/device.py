"""Device and dtype policy: the one place that decides where a model runs and in what precision.

`auto` picks CUDA, then MPS, then the CPU. Weight dtype for `auto`, per device:
  - CUDA: bfloat16 where the GPU supports it, else float16;
  - MPS: float16 (bfloat16 needs macOS 14+, float16 runs everywhere Metal does);
  - CPU: measured, not assumed (`app.engine.kernel_policy`): for a GGUF model the candidate
    kernels (float32, bfloat16, float16, the 4-bit weight-only kernel) are timed on the
    model's products for decode and for prefill (before loading on the command line, which
    checks a cached entry first; in the background after a load in the app, see
    `ModelSession`), the result cached per CPU, torch and model, and of each the fastest
    beyond noise kept: GGUF blocks that fit the 4-bit kernel
    stay quantized (`QuantizedWeight`), the rest follow the fastest float kinds, with a
    second float copy for prefill when that is faster and the model is small. CPUs differ
    too much for a fixed rule: bfloat16 matrix products are the fastest kernel with
    AVX-512-BF16/AMX and the slowest on AVX2-only CPUs.
  - Hugging Face folders on the CPU (no quantized blocks): bfloat16 + float16 as before.

`--dtype float32|bfloat16|float16|int4` forces a choice (int4: the 4-bit kernel for every
fitting weight, the rest float16).

Activations (and so the KV cache) stay float32 on the CPU and whenever the weights are
float16: Gemma's activations overflow float16 (measured: all-NaN logits in pure float16),
and the CPU gains nothing from narrow activations. Only bfloat16 weights on a GPU compute
in bfloat16. The 4-bit kernel takes its activations in its own dtype, product by product.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.kernel_policy import TWO_COPIES_MAX_FILE_BYTES
from app.heap import release_freed_memory
from app.models import int8_products
from app.models.layers import WeightFormat
from app.models.quantized import int4_kernel_available

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "int4", "int4_i8")
_INT4_CHOICES = ("int4", "int4_i8")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Prepared weights, saved once per model file and format (app.models.weight_cache), in
# this folder of the data folder unless the environment says otherwise (`weight_cache_folder`).
WEIGHT_CACHE_DIR = "weight-cache"
WEIGHT_CACHE_ENV = "FERROX_WEIGHT_CACHE"


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
    prefill speed, for twice the weight memory, for the model files the CPU policy would give
    two copies (`TWO_COPIES_MAX_FILE_BYTES`). Larger models get bfloat16 alone."""
    if name not in DTYPE_CHOICES or name in _INT4_CHOICES:
        raise DeviceError(f"Unknown float dtype {name!r}; choose one of "
                          f"{', '.join(n for n in DTYPE_CHOICES if n not in _INT4_CHOICES)}.")
    if name != "auto":
        return _DTYPES[name], None
    if device.type == "cuda":
        return (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16), None
    if device.type == "mps":
        return torch.float16, None
    if file_bytes <= TWO_COPIES_MAX_FILE_BYTES:
        return torch.float16, torch.bfloat16
    return torch.bfloat16, None


def compute_dtype_for(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if weight_dtype == torch.bfloat16 and device.type != "cpu":
        return torch.bfloat16
    return torch.float32


def cpu_threads() -> int:
    """The thread count matmuls use on the CPU unless the user set OMP_NUM_THREADS: every
    CPU the OS reports (the thread tuner's `most`, whatever count a previous engine left set)."""
    return max(1, os.cpu_count() or 1)


def configure_cpu_threads() -> None:
    """Use every CPU for matmuls unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads())


@dataclass(frozen=True)
class LoadPlan:
    """How `load_on` loads one model: the weight format and what the status bar says of it.
    `shapes` is set when the CPU policy applies (so the session can measure it later)."""

    dtype: torch.dtype
    wide_dtype: torch.dtype | None
    int4: WeightFormat | None
    label: str
    reason: str
    shapes: object | None = None  # kernel_policy.ModelShapes
    file_bytes: int = 0
    # How the CPU policy's choice was arrived at (kernel_policy.MEASURED, CHECKED, UNCHECKED,
    # ...); "" when no measured policy applies (a dtype chosen by hand, another device).
    policy_status: str = ""
    # The KV cache's dtype when the policy measured one faster than the activations' dtype
    # (None: the activations' dtype, as every plan without a measured policy).
    kv_dtype: torch.dtype | None = None
    # From how many keys a decode step asks attention per query head, where the policy
    # measured that faster (None: never; `TransformerLM.per_head_from`).
    per_head_from: int | None = None


def plan_from_policy(policy, device: torch.device, file_bytes: int, shapes=None) -> LoadPlan:
    """The load plan a kernel policy (`kernel_policy.Policy`) gives."""
    fmt, wide = policy.weight_format(device, file_bytes)
    reason = policy.reason + (" (cached)" if policy.cached and "(cached" not in policy.reason else "")
    return LoadPlan(fmt.dtype, wide, fmt if fmt.int4 else None, policy.label, reason, shapes, file_bytes,
                    policy.status, policy.kv_dtype, policy.per_head_from)


def plan_load(path, device: torch.device, dtype: str, measure: bool = True) -> LoadPlan:
    """The weight format for a dtype name on `device`. `auto` on the CPU with `measure` (the
    command line) uses `kernel_policy.policy_for`: the cached policy once checked, or a fresh
    measurement. Without `measure` (the window) it loads the cached policy unchecked, or
    another model's choice on this CPU (`borrowed_policy`), or the default (`default_policy`:
    4-bit decode for a model with 4-bit products), leaving the
    check or the measurement to the caller's background tuner (`ModelSession`);
    `LoadPlan.policy_status` says which."""
    from app.engine.kernel_policy import (borrowed_policy, cached_policy, default_policy,
                                          policy_for, shapes_for)
    from app.models.model_facts import model_size_bytes
    from app.paths import data_dir

    if dtype not in DTYPE_CHOICES:
        raise DeviceError(f"Unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}.")
    file_bytes = model_size_bytes(path)
    shapes = shapes_for(Path(path), data_dir()) if device.type == "cpu" else None
    if dtype == "int4_i8" and not int8_products.available():
        raise DeviceError("int4_i8 needs the 8-bit activation kernel, which cannot run here "
                          f"({int8_products.unavailable_reason()}); choose another dtype.")
    if dtype in _INT4_CHOICES and (shapes is None or not int4_kernel_available()):
        raise DeviceError(f"{dtype} needs a GGUF model on the CPU with a torch that has the 4-bit "
                          "weight-only kernel; choose another dtype.")
    if dtype in _INT4_CHOICES:
        fmt = WeightFormat(torch.float16, False, None, True, torch.bfloat16, None,
                           int8_acts=dtype == "int4_i8")
        return LoadPlan(torch.float16, None, fmt, dtype,
                        f"{dtype} chosen by hand (weights that do not fit it: float16)")
    if dtype != "auto" or shapes is None:
        weight_dtype, wide = resolve_weights(dtype, device, file_bytes)
        label = "+".join(str(d).removeprefix("torch.") for d in (weight_dtype, wide) if d)
        why = "chosen by hand" if dtype != "auto" else f"the default for {device.type}"
        return LoadPlan(weight_dtype, wide, None, label, f"{label}: {why}")
    configure_cpu_threads()  # the measurement must run on the threads the model will use
    if measure:
        policy = policy_for(shapes, data_dir())
    else:
        policy = (cached_policy(shapes, data_dir()) or borrowed_policy(shapes, data_dir())
                  or default_policy("until this CPU is measured (in the background)", shapes))
    return plan_from_policy(policy, device, file_bytes, shapes)


def load_on(path, device: str = "auto", dtype: str = "auto", progress=None, measure: bool = True):
    """Load a model file where the policy says: device and dtype names as the user gives them.
    The loaded model's `policy_label` and `policy_reason` say what was chosen and why, and
    `load_plan` how it was loaded. `measure=False`: never time kernels before loading (see
    `plan_load`)."""
    torch_device = resolve_device(device)
    if torch_device.type == "cpu":
        configure_cpu_threads()
    return load_planned(path, torch_device, plan_load(path, torch_device, dtype, measure), progress)


def weight_cache_folder() -> Path | None:
    """Where loads save and map prepared weights: the data folder's `weight-cache`, unless
    FERROX_WEIGHT_CACHE says otherwise: "0" saves none (every load prepares its weights
    again), a path other than "1" names the folder (the tests' windows share one across their
    data folders, as a person's windows share the data folder's)."""
    setting = os.environ.get(WEIGHT_CACHE_ENV, "1")
    if setting == "0":
        return None
    if setting != "1":
        return Path(setting)
    from app.paths import data_dir

    return data_dir() / WEIGHT_CACHE_DIR


def load_planned(path, torch_device: torch.device, plan: LoadPlan, progress=None):
    """Load a model file in the format `plan` says (through the weight cache on the CPU)."""
    from app.models.loader import load_model

    plain_reference = plan.dtype == torch.float32 and plan.wide_dtype is None and plan.int4 is None
    cache = weight_cache_folder() if torch_device.type == "cpu" and not plain_reference else None
    loaded = load_model(path, torch_device, plan.dtype,
                        compute_dtype_for(plan.dtype, torch_device), plan.wide_dtype,
                        progress=progress, int4=plan.int4, weight_cache_dir=cache)
    loaded.policy_label, loaded.policy_reason = plan.label, plan.reason
    loaded.load_plan = plan
    if hasattr(loaded.model, "per_head_from"):
        loaded.model.per_head_from = plan.per_head_from
    if torch_device.type == "cpu":
        release_freed_memory()  # the load's float32 temporaries (see `app.heap`)
    return loaded
