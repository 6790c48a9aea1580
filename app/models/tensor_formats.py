"""Which GGUF tensor types Ferrox Chat can read, without importing torch (the GUI asks this
when a model is added, so an unreadable file is refused by name before any load)."""

from __future__ import annotations

from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as T

# Dequantized by the torch kernels in app.models.dequant (which checks it has exactly these).
NATIVE_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                          T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})


def readable_types() -> frozenset[T]:
    """The native types plus those gguf-py's numpy code dequantizes (IQ*, TQ*, MXFP4, ...)."""
    return NATIVE_TYPES | frozenset(gguf_quants._type_traits)


def unreadable_type_names(types) -> list[str]:
    """Names of the tensor types among `types` that no code here can read."""
    readable = readable_types()
    return sorted({getattr(t, "name", str(t)) for t in types if t not in readable})
