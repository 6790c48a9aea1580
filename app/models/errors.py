"""The one error type a model file can raise.

Every way a model can fail to load -- a missing, truncated, corrupt or non-GGUF file, an
unsupported tensor type or architecture -- ends in a `ModelError` whose message a person can
read, never a numpy traceback or a hang. The UI and the CLI show `str(error)` as it is.
"""


class ModelError(Exception):
    """A model file cannot be used; the message says why in plain words."""
