"""Added models: records keyed by path; the files themselves are never touched."""

from __future__ import annotations

import pytest

from app.storage import StorageError

FACTS = {"name": "Gemma 3 270M", "architecture": "gemma3", "size_bytes": 253_000_000,
         "quantization": "Q4_K_M", "context_length": 32768}


def test_add_list_and_get(store, tmp_path):
    first = store.add_model(tmp_path / "gemma.gguf", FACTS)
    second = store.add_model(tmp_path / "other-model.Q8_0.gguf")
    assert (first.name, first.architecture, first.size_bytes, first.quantization, first.context_length) == (
        "Gemma 3 270M", "gemma3", 253_000_000, "Q4_K_M", 32768)
    assert first.path == str(tmp_path / "gemma.gguf")
    assert second.name == "other-model.Q8_0" and second.architecture is None
    assert store.list_models() == [first, second]
    assert store.get_model(second.id) == second


def test_adding_the_same_path_again_updates_it_and_keeps_its_id(store, tmp_path):
    first = store.add_model(tmp_path / "m.gguf", {**FACTS, "defaults": {"temperature": 0.5}})
    again = store.add_model(tmp_path / "m.gguf", {"context_length": 8192})
    assert again.id == first.id and again.added_at == first.added_at
    assert (again.name, again.context_length, again.defaults) == ("Gemma 3 270M", 8192, {"temperature": 0.5})
    assert len(store.list_models()) == 1


def test_remove_forgets_the_model_but_keeps_the_file(store, tmp_path):
    file = tmp_path / "keep-me.gguf"
    file.write_bytes(b"GGUF weights")
    record = store.add_model(file, FACTS)
    store.remove_model(record.id)
    assert store.list_models() == []
    assert file.read_bytes() == b"GGUF weights"
    with pytest.raises(StorageError, match="no model with id"):
        store.remove_model(record.id)


def test_defaults_merge_and_are_checked(store, tmp_path):
    record = store.add_model(tmp_path / "m.gguf", {"defaults": {"temperature": 1.0, "top_k": 64}})
    updated = store.update_model_defaults(record.id, {"temperature": 0.3, "top_k": None, "min_p": 0.05})
    assert updated.defaults == {"temperature": 0.3, "min_p": 0.05}
    with pytest.raises(StorageError, match="top_p"):
        store.update_model_defaults(record.id, {"top_p": 3})


@pytest.mark.parametrize("facts", [{"size": 1}, {"context_length": "long"}, {"name": ""},
                                   {"size_bytes": True}, {"defaults": {"temperature": -2}}])
def test_bad_facts_are_refused(store, tmp_path, facts):
    with pytest.raises(StorageError):
        store.add_model(tmp_path / "m.gguf", facts)
    assert store.list_models() == []
