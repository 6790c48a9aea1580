"""Defaults the GUI starts from, in one place. Sampling defaults come from `SamplingParams`
itself, so the GUI, the CLI and the engine agree."""

from __future__ import annotations

from app.engine.sampling import SamplingParams
from app.server import DEFAULT_PORT

EMBEDDED_KEY = "embedded"  # the model picker's key for the built-in model
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens", "seed")
DEFAULT_SAMPLING = {key: getattr(SamplingParams(), key) for key in SAMPLING_KEYS}
ENGINE_DEFAULTS = {"device": "auto", "dtype": "auto", "prefill_chunk": 512, "context_size": 0}
# The conversations' KV cache on disk (issue 13): its folder in the data folder, and the
# engine setting holding its budget in MB (0 = off; absent = sized to the disk).
DISK_CACHE_FOLDER = "kv-cache"
DISK_CACHE_KEY = "disk_cache_mb"
# The local API server inside the app: the app setting holding {"enabled": bool, "port": int}.
API_SERVER_KEY = "api_server"
API_SERVER_DEFAULT = {"enabled": False, "port": DEFAULT_PORT}
