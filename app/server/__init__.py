"""The local OpenAI-compatible API server: `create_app` (the HTTP API over an `EngineRunner`)
and `serve` (load a model, run the engine and uvicorn until stopped).

Nothing is imported here, so the window and the command line can read the default port
without loading the web framework."""

DEFAULT_PORT = 8000  # `app serve` and the window's server both start here
