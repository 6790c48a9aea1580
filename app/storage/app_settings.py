"""App-wide settings: a key -> JSON value table (window size, theme, last model, ...)."""

from __future__ import annotations

import json
from typing import Any

from app.storage.base import StoreBase
from app.storage.errors import StorageError


class AppSettings(StoreBase):
    def get_setting(self, key: str, default: Any = None) -> Any:
        """The value saved under `key`, or `default` if none is."""
        with self._read() as conn:
            row = conn.execute("SELECT value FROM app_settings WHERE key = ?", (_checked_key(key),)).fetchone()
        return default if row is None else json.loads(row["value"])

    def set_setting(self, key: str, value: Any) -> None:
        """Save `value` (anything JSON can hold) under `key`."""
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise StorageError(f"Setting {key!r} cannot be saved as JSON: {error}.") from None
        with self._write() as conn:
            conn.execute("INSERT INTO app_settings (key, value) VALUES (?, ?) "
                         "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                         (_checked_key(key), text))


def _checked_key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise StorageError(f"A setting's key must be non-empty text, not {key!r}.")
    return key
