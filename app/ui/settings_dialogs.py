"""Per-chat generation settings, app-wide engine preferences and the local API server."""

from __future__ import annotations

from app.ui.defaults import DISK_CACHE_KEY
from app.ui.document_plan import MODE_KEY, MODES, chat_mode
from app.ui.qt import Qt, QtWidgets


class ChatSettingsDialog(QtWidgets.QDialog):
    """System prompt and sampling for one chat; optionally the defaults for new chats."""

    def __init__(self, values: dict, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Chat settings")
        self.setMinimumWidth(460)
        form = QtWidgets.QFormLayout()
        self.system_prompt = QtWidgets.QPlainTextEdit(values.get("system_prompt") or "")
        self.system_prompt.setPlaceholderText("Instructions the model sees before the chat")
        self.system_prompt.setMaximumHeight(110)
        self.temperature = self._double(values.get("temperature", 1.0), 0, 5, 0.05,
                                        "0 = always the most likely word")
        self.top_k = self._int(values.get("top_k", 64), 0, 10_000, "0 = off")
        self.top_p = self._double(values.get("top_p", 0.95), 0.01, 1, 0.01, "1 = off")
        self.min_p = self._double(values.get("min_p", 0.0), 0, 1, 0.01, "0 = off")
        self.repetition_penalty = self._double(values.get("repetition_penalty", 1.0), 1, 2, 0.05,
                                               "1 = off; above 1 discourages repeating words")
        self.max_tokens = self._int(values.get("max_tokens", 1024), 1, 32_768, "")
        self.seed = QtWidgets.QLineEdit("" if values.get("seed") is None else str(values["seed"]))
        self.seed.setPlaceholderText("random")
        self.documents = QtWidgets.QComboBox()
        self.documents.setObjectName("documentsMode")
        for key, label in MODES.items():
            self.documents.addItem(label, key)
        self.documents.setCurrentIndex(max(self.documents.findData(chat_mode(values)), 0))
        self.documents.setToolTip("Searched documents are indexed once; each question then "
                                  "gets the passages that match it, and the reply cites them.")
        self.as_default = QtWidgets.QCheckBox("Use these sampling settings for new chats with this model")
        form.addRow("System prompt:", self.system_prompt)
        form.addRow("Temperature:", self.temperature)
        form.addRow("Top-k:", self.top_k)
        form.addRow("Top-p:", self.top_p)
        form.addRow("Min-p:", self.min_p)
        form.addRow("Repetition penalty:", self.repetition_penalty)
        form.addRow("Max reply tokens:", self.max_tokens)
        form.addRow("Seed:", self.seed)
        form.addRow("Documents:", self.documents)
        form.addRow(self.as_default)
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.Ok
                                             | QtWidgets.QDialogButtonBox.Cancel)
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(buttons)

    @staticmethod
    def _double(value, low, high, step, tip):
        box = QtWidgets.QDoubleSpinBox()
        box.setRange(low, high)
        box.setSingleStep(step)
        box.setDecimals(2)
        box.setValue(float(value))
        box.setToolTip(tip)
        return box

    @staticmethod
    def _int(value, low, high, tip):
        box = QtWidgets.QSpinBox()
        box.setRange(low, high)
        box.setValue(int(value))
        box.setToolTip(tip)
        return box

    def _accept(self) -> None:
        text = self.seed.text().strip()
        if text and not text.lstrip("-").isdigit():
            QtWidgets.QMessageBox.warning(self, "Seed", "The seed must be a whole number or empty.")
            return
        self.accept()

    def values(self) -> dict:
        seed = self.seed.text().strip()
        return {"system_prompt": self.system_prompt.toPlainText().strip(),
                "temperature": round(self.temperature.value(), 3), "top_k": self.top_k.value(),
                "top_p": round(self.top_p.value(), 3), "min_p": round(self.min_p.value(), 3),
                "repetition_penalty": round(self.repetition_penalty.value(), 3),
                "max_tokens": self.max_tokens.value(), "seed": int(seed) if seed else None,
                MODE_KEY: self.documents.currentData()}

    def make_default(self) -> bool:
        return self.as_default.isChecked()


class PreferencesDialog(QtWidgets.QDialog):
    """Where the model runs: device, weight precision, prefill chunk size."""

    def __init__(self, values: dict, parent=None, devices: tuple[str, ...] = ("auto", "cpu"),
                 dtypes: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16"),
                 disk_cache_default_mb: int = 2000):
        """`devices`: the ones that exist here, `dtypes` the engine's weight formats (both
        asked of the engine); only these are offered. `disk_cache_default_mb`: the disk
        cache's budget when none was chosen (sized to the disk)."""
        super().__init__(parent)
        self.setWindowTitle("Preferences")
        form = QtWidgets.QFormLayout()
        self.device = QtWidgets.QComboBox()
        self.device.setObjectName("deviceChoice")
        self.device.addItems(list(devices))
        current = values.get("device", "auto")
        self.device.setCurrentText(current if current in devices else "auto")
        self.device.setToolTip("auto: a GPU when there is one, else the CPU. Only the devices "
                               "found on this computer are listed.")
        self.dtype = QtWidgets.QComboBox()
        self.dtype.addItems(list(dtypes))
        self.dtype.setCurrentText(values.get("dtype", "auto"))
        self.dtype.setToolTip("auto: float16 + bfloat16 copies on the CPU (bfloat16 alone for "
                              "large models), bfloat16 on CUDA, float16 on Apple GPUs")
        self.prefill_chunk = QtWidgets.QSpinBox()
        self.prefill_chunk.setRange(16, 8192)
        self.prefill_chunk.setSingleStep(64)
        self.prefill_chunk.setValue(int(values.get("prefill_chunk", 512)))
        self.prefill_chunk.setToolTip("Most prompt tokens read in one step while no other chat "
                                      "is writing; smaller keeps other chats smoother")
        self.context_size = QtWidgets.QSpinBox()
        self.context_size.setRange(0, 1_048_576)
        self.context_size.setSingleStep(1024)
        self.context_size.setSpecialValueText("the model's full context")
        self.context_size.setValue(int(values.get("context_size", 0) or 0))
        self.context_size.setToolTip("Most tokens one conversation may hold (remembered for "
                                     "this model); smaller keeps long documents quick on a "
                                     "slow machine")
        self.disk_cache = QtWidgets.QSpinBox()
        self.disk_cache.setObjectName("diskCacheSize")
        self.disk_cache.setRange(0, 1_000_000)
        self.disk_cache.setSingleStep(250)
        self.disk_cache.setSuffix(" MB")
        self.disk_cache.setSpecialValueText("off")
        chosen = values.get(DISK_CACHE_KEY)
        self.disk_cache.setValue(int(disk_cache_default_mb if chosen is None else chosen))
        self.disk_cache.setToolTip("Conversations' prompt cache kept on disk, so a long chat "
                                   "or document answers quickly after a restart; the least "
                                   "recently used is deleted beyond this size. 0 = off.")
        form.addRow("Device:", self.device)
        form.addRow("Precision:", self.dtype)
        form.addRow("Prefill chunk (tokens):", self.prefill_chunk)
        form.addRow("Context size (tokens):", self.context_size)
        form.addRow("Disk cache for conversations:", self.disk_cache)
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.Ok
                                             | QtWidgets.QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(QtWidgets.QLabel("Changes reload the model."))
        layout.addWidget(buttons)

    def values(self) -> dict:
        return {"device": self.device.currentText(), "dtype": self.dtype.currentText(),
                "prefill_chunk": self.prefill_chunk.value(),
                "context_size": self.context_size.value(),
                DISK_CACHE_KEY: self.disk_cache.value()}


class ApiServerDialog(QtWidgets.QDialog):
    """Whether the loaded local model is served to other programs on this computer, on
    which port. The server itself runs below the GUI (app/server/embedded.py)."""

    def __init__(self, enabled: bool, port: int, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Local API server")
        self.enabled = QtWidgets.QCheckBox("Serve the loaded model to programs on this computer")
        self.enabled.setObjectName("apiServerEnabled")
        self.enabled.setChecked(enabled)
        self.port = QtWidgets.QSpinBox()
        self.port.setObjectName("apiServerPort")
        self.port.setRange(1024, 65535)
        self.port.setValue(port)
        self.address = QtWidgets.QLabel()
        self.address.setObjectName("apiServerAddress")
        self.address.setTextInteractionFlags(Qt.TextSelectableByMouse)
        form = QtWidgets.QFormLayout()
        form.addRow("Port:", self.port)
        form.addRow("Address:", self.address)
        note = QtWidgets.QLabel(
            "An OpenAI-compatible API (chat and text completions, models, health) at this "
            "address, for the model this window has loaded, sharing its engine with your "
            "chats (a remote model picked for a chat leaves it serving the local one). Only "
            "this computer can connect. While no local model is loaded, requests are "
            "answered that none is.")
        note.setWordWrap(True)
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.Ok
                                             | QtWidgets.QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addWidget(self.enabled)
        layout.addLayout(form)
        layout.addWidget(note)
        layout.addWidget(buttons)
        self.port.valueChanged.connect(self._show_address)
        self.enabled.toggled.connect(self._show_address)
        self._show_address()

    def _show_address(self) -> None:
        self.port.setEnabled(self.enabled.isChecked())
        self.address.setText(f"http://127.0.0.1:{self.port.value()}/v1"
                             if self.enabled.isChecked() else "off")

    def values(self) -> tuple[bool, int]:
        return self.enabled.isChecked(), self.port.value()
