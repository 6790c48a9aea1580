"""The local OpenAI-compatible API server: `create_app` (the HTTP API over an `EngineRunner`)
and `serve` (load a model, run the engine and uvicorn until stopped)."""
