"""The models the person added: one record per model file, keyed by its absolute path.

The store keeps facts about a file (read by the model loader) and per-model generation
defaults; it never opens, moves or deletes the file itself.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Mapping

from app.storage.base import StoreBase
from app.storage.errors import StorageError
from app.storage.records import ModelRecord, model_from_row
from app.storage.validate import check_generation_settings, merged, to_json

# facts key -> the types it may have (None is allowed too, except for name)
_FACTS = {
    "name": (str,),
    "architecture": (str,),
    "size_bytes": (int,),
    "quantization": (str,),
    "context_length": (int,),
}


class ModelRegistry(StoreBase):
    def add_model(self, path: str | os.PathLike, facts: Mapping[str, Any] | None = None) -> ModelRecord:
        """Record a model file. `facts` may hold name (default: the file name without its
        extension), architecture, size_bytes, quantization, context_length and defaults.
        Adding a path already there updates its facts and keeps its id."""
        facts = dict(facts or {})
        defaults = check_generation_settings(facts.pop("defaults", None), "Model defaults")
        key = str(Path(path).expanduser().absolute())
        values = _checked_facts(facts)
        with self._write() as conn:
            row = conn.execute("SELECT * FROM models WHERE path = ?", (key,)).fetchone()
            if row is None:
                values.setdefault("name", Path(key).stem)
                cursor = conn.execute(
                    f"INSERT INTO models (path, added_at, defaults, {', '.join(values)}) "
                    f"VALUES (?, ?, ?, {', '.join('?' * len(values))})",
                    (key, self._now(), to_json(merged({}, defaults), "Model defaults"), *values.values()))
                return self._model(conn, cursor.lastrowid)
            values["defaults"] = to_json(merged(model_from_row(row).defaults, defaults), "Model defaults")
            assignments = ", ".join(f"{column} = ?" for column in values)
            conn.execute(f"UPDATE models SET {assignments} WHERE id = ?", (*values.values(), row["id"]))
            return self._model(conn, row["id"])

    def get_model(self, model_id: int) -> ModelRecord:
        with self._read() as conn:
            return self._model(conn, model_id)

    def list_models(self) -> list[ModelRecord]:
        """All added models, in the order they were added."""
        with self._read() as conn:
            return [model_from_row(row) for row in conn.execute("SELECT * FROM models ORDER BY id")]

    def remove_model(self, model_id: int) -> None:
        """Forget a model; its file stays where it is."""
        with self._write() as conn:
            self._model(conn, model_id)
            conn.execute("DELETE FROM models WHERE id = ?", (model_id,))

    def update_model_defaults(self, model_id: int, changes: Mapping[str, Any]) -> ModelRecord:
        """Merge `changes` into the model's defaults; a None value drops a key."""
        changes = check_generation_settings(changes, "Model defaults")
        with self._write() as conn:
            current = self._model(conn, model_id).defaults
            conn.execute("UPDATE models SET defaults = ? WHERE id = ?",
                         (to_json(merged(current, changes), "Model defaults"), model_id))
            return self._model(conn, model_id)

    def _model(self, conn: sqlite3.Connection, model_id: int) -> ModelRecord:
        row = conn.execute("SELECT * FROM models WHERE id = ?", (model_id,)).fetchone()
        if row is None:
            raise StorageError(f"There is no model with id {model_id}.")
        return model_from_row(row)


def _checked_facts(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The facts given, checked; a name must be non-empty text, the rest may be None."""
    unknown = sorted(set(facts) - set(_FACTS))
    if unknown:
        raise StorageError(f"Unknown model facts: {', '.join(unknown)} "
                           f"(known: {', '.join(_FACTS)}, defaults).")
    for key, value in facts.items():
        allowed = value is None and key != "name"
        if not allowed and (not isinstance(value, _FACTS[key]) or isinstance(value, bool)):
            raise StorageError(f"Model fact {key} must be {_FACTS[key][0].__name__}, not {value!r}.")
    if "name" in facts and not facts["name"].strip():
        raise StorageError("A model's name cannot be empty.")
    return dict(facts)
