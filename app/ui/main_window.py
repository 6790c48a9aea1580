"""The main window's widgets and layout. Behaviour lives in `ChatController`.

    ┌ chats ─────────┬ [model picker] [Add model…] [Chat settings] ───────────┐
    │ [search]  [New]│ message view                                           │
    │ chat list      │                                                        │
    │                │ composer: chips / text / attach, send, stop            │
    └────────────────┴────────────────────────────────────────────────────────┘
    status bar: model state · device/dtype · tok/s · context meter
"""

from __future__ import annotations

from app.ui.composer import ComposerPanel
from app.ui.message_view import MessageView
from app.ui.chat_list import ChatList
from app.ui.qt import Qt, QtCore, QtGui, QtWidgets, Signal
from app.ui.resources import app_icon


class SearchBox(QtWidgets.QLineEdit):
    """The chat search: Esc clears it while it has text (and only then stops a reply, as
    Esc does elsewhere)."""

    def event(self, event: QtCore.QEvent) -> bool:
        if (event.type() == QtCore.QEvent.Type.ShortcutOverride and self.text()
                and event.key() == Qt.Key.Key_Escape):
            event.accept()  # the key comes to us instead of the window's Esc shortcut
            return True
        return super().event(event)

    def keyPressEvent(self, event: QtGui.QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape and self.text():
            self.clear()
            event.accept()
            return
        super().keyPressEvent(event)


class ElidedLabel(QtWidgets.QLabel):
    """A one-line label that gives up width to its neighbours, ending in "…" when cut."""

    def __init__(self, text: str = ""):
        super().__init__()
        self._full = ""
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored,
                           QtWidgets.QSizePolicy.Policy.Preferred)
        self.setText(text)

    def setText(self, text: str) -> None:
        self._full = text
        self.setToolTip(text)
        self._elide()

    def full_text(self) -> str:
        return self._full

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        super().setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight,
                                                      max(self.width(), 1)))


class MainWindow(QtWidgets.QMainWindow):
    filesDropped = Signal(list)
    closing = Signal()

    def __init__(self):
        super().__init__()
        self.setWindowTitle("Ferrox Chat")
        self.setWindowIcon(app_icon())
        self.setMinimumSize(720, 480)
        self.resize(1100, 760)
        self.setAcceptDrops(True)
        self._build_sidebar()
        self._build_main_area()
        splitter = QtWidgets.QSplitter()
        splitter.addWidget(self.sidebar)
        splitter.addWidget(self.main_area)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([260, 840])
        splitter.setChildrenCollapsible(False)
        self.setCentralWidget(splitter)
        self._build_status_bar()
        self._build_actions()

    # ---- layout ------------------------------------------------------------------------

    def _build_sidebar(self) -> None:
        self.sidebar = QtWidgets.QWidget()
        self.sidebar.setMinimumWidth(200)
        layout = QtWidgets.QVBoxLayout(self.sidebar)
        layout.setContentsMargins(8, 8, 4, 8)
        top = QtWidgets.QHBoxLayout()
        self.search_box = SearchBox()
        self.search_box.setObjectName("searchBox")
        self.search_box.setPlaceholderText("Search chats (Ctrl+K)")
        self.search_box.setClearButtonEnabled(True)
        self.new_chat_button = QtWidgets.QPushButton("New chat")
        self.new_chat_button.setObjectName("newChatButton")
        self.new_chat_button.setToolTip("Start a new chat (Ctrl+N)")
        top.addWidget(self.search_box, 1)
        top.addWidget(self.new_chat_button)
        layout.addLayout(top)
        self.chat_list = ChatList()
        layout.addWidget(self.chat_list, 1)
        self.trash_button = QtWidgets.QToolButton()
        self.trash_button.setObjectName("trashButton")
        self.trash_button.setText("Trash")
        self.trash_button.setIcon(self.style().standardIcon(
            QtWidgets.QStyle.StandardPixmap.SP_TrashIcon))
        self.trash_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.trash_button.setAutoRaise(True)
        self.trash_button.setToolTip("Deleted chats: restore them or delete them for good")
        layout.addWidget(self.trash_button, 0, Qt.AlignmentFlag.AlignLeft)

    def _build_main_area(self) -> None:
        self.main_area = QtWidgets.QWidget()
        layout = QtWidgets.QVBoxLayout(self.main_area)
        layout.setContentsMargins(4, 8, 8, 8)
        bar = QtWidgets.QHBoxLayout()
        self.chat_title = ElidedLabel()
        self.chat_title.setObjectName("chatTitle")
        font = self.chat_title.font()
        font.setPointSizeF(font.pointSizeF() * 1.2)
        font.setBold(True)
        self.chat_title.setFont(font)
        self.chat_title.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.model_picker = QtWidgets.QComboBox()
        self.model_picker.setObjectName("modelPicker")
        # Narrow windows shrink the picker (its names elide), never overlap it.
        self.model_picker.setSizeAdjustPolicy(
            QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_picker.setMinimumContentsLength(14)
        self.model_picker.setSizePolicy(QtWidgets.QSizePolicy.Policy.Expanding,
                                        QtWidgets.QSizePolicy.Policy.Fixed)
        self.model_picker.setMaximumWidth(360)
        self.model_picker.setToolTip("The model that answers (drop a .gguf file or a model "
                                     "folder here to add one)")
        self.add_model_button = QtWidgets.QToolButton()
        self.add_model_button.setObjectName("addModelButton")
        self.add_model_button.setText("Add model…")
        self.add_model_button.setPopupMode(QtWidgets.QToolButton.ToolButtonPopupMode.InstantPopup)
        self.chat_settings_button = QtWidgets.QToolButton()
        self.chat_settings_button.setObjectName("chatSettingsButton")
        self.chat_settings_button.setText("Chat settings…")
        self.add_model_button.setToolTip("Add a .gguf model file or a Hugging Face model folder "
                                         "(or drop one on the window)")
        bar.addWidget(self.chat_title, 1)
        bar.addWidget(self.model_picker, 2)
        bar.addWidget(self.add_model_button)
        bar.addWidget(self.chat_settings_button)
        layout.addLayout(bar)
        self.message_view = MessageView()
        layout.addWidget(self.message_view, 1)
        self.composer = ComposerPanel()
        layout.addWidget(self.composer)

    def _build_status_bar(self) -> None:
        status = self.statusBar()
        self.model_status = QtWidgets.QLabel("No model loaded")
        self.model_status.setObjectName("modelStatus")
        self.load_bar = QtWidgets.QProgressBar()  # while a model loads
        self.load_bar.setObjectName("loadBar")
        self.load_bar.setTextVisible(False)
        self.load_bar.setFixedSize(90, 8)
        self.load_bar.hide()
        self.device_label = QtWidgets.QLabel()
        self.speed_label = QtWidgets.QLabel()
        self.context_meter = QtWidgets.QLabel()
        self.context_meter.setObjectName("contextMeter")
        self.context_meter.setToolTip("Context used by this chat / the model's context size · "
                                      "tokens reused from the cache on the last reply")
        self.undo_button = QtWidgets.QPushButton("Undo")
        self.undo_button.hide()
        # The local API server's address while it serves (or why it could not); a click
        # opens its settings.
        self.api_status = QtWidgets.QPushButton()
        self.api_status.setObjectName("apiStatus")
        self.api_status.setFlat(True)
        self.api_status.setCursor(Qt.PointingHandCursor)
        self.api_status.hide()
        status.addWidget(self.load_bar)
        status.addWidget(self.model_status, 1)
        status.addPermanentWidget(self.undo_button)
        for widget in (self.api_status, self.device_label, self.speed_label, self.context_meter):
            status.addPermanentWidget(widget)

    def _build_actions(self) -> None:
        def action(text: str, shortcut: str | None = None) -> QtGui.QAction:
            act = QtGui.QAction(text, self)
            if shortcut:
                act.setShortcut(QtGui.QKeySequence(shortcut))
            self.addAction(act)
            return act

        self.new_chat_action = action("&New chat", "Ctrl+N")
        self.search_action = action("&Search chats", "Ctrl+K")
        self.stop_action = action("S&top reply", "Esc")
        self.import_action = action("&Import chat (JSON)…")
        self.export_md_action = action("Export chat as &Markdown…")
        self.export_json_action = action("Export chat as &JSON…")
        self.add_model_action = action("&Add model file (.gguf)…")
        self.add_model_folder_action = action("Add model &folder (Hugging Face)…")
        self.trash_action = action("&Trash…")
        self.remove_model_action = action("&Remove model from the list…")
        self.settings_action = action("&Preferences…", "Ctrl+,")
        self.connections_action = action("&Connections…")
        self.api_server_action = action("Local &API server…")
        self.chat_settings_action = action("Chat &settings…")
        self.quit_action = action("&Quit", "Ctrl+Q")
        menus = self.menuBar()
        file_menu = menus.addMenu("&File")
        for act in (self.new_chat_action, self.import_action, self.export_md_action,
                    self.export_json_action, self.add_model_action, self.add_model_folder_action,
                    self.remove_model_action, self.trash_action):
            file_menu.addAction(act)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        chat_menu = menus.addMenu("&Chat")
        for act in (self.search_action, self.stop_action, self.chat_settings_action):
            chat_menu.addAction(act)
        settings_menu = menus.addMenu("&Settings")
        settings_menu.addAction(self.settings_action)
        settings_menu.addAction(self.connections_action)
        settings_menu.addAction(self.api_server_action)
        self.search_action.triggered.connect(self.focus_search)
        add_menu = QtWidgets.QMenu(self.add_model_button)
        add_menu.addAction(self.add_model_action)
        add_menu.addAction(self.add_model_folder_action)
        self.add_model_button.setMenu(add_menu)
        self.trash_button.clicked.connect(self.trash_action.trigger)
        self.chat_settings_button.clicked.connect(self.chat_settings_action.trigger)
        self.quit_action.triggered.connect(self.close)

    def focus_search(self) -> None:
        self.search_box.setFocus()
        self.search_box.selectAll()

    # ---- drag and drop onto the window -------------------------------------------------

    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls() and any(u.isLocalFile() for u in event.mimeData().urls()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.filesDropped.emit(paths)

    def closeEvent(self, event) -> None:
        self.closing.emit()
        super().closeEvent(event)
