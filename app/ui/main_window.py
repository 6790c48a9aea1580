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
from app.ui.qt import Qt, QtGui, QtWidgets, Signal
from app.ui.resources import app_icon


class ChatList(QtWidgets.QListWidget):
    """Chats, pinned first; each item's data is the chat id."""

    contextRequested = Signal(int, object)  # chat id, global position

    def __init__(self):
        super().__init__()
        self.setObjectName("chatList")
        self.setContextMenuPolicy(Qt.CustomContextMenu)
        self.customContextMenuRequested.connect(self._context_menu)
        self.setUniformItemSizes(True)

    def _context_menu(self, pos) -> None:
        item = self.itemAt(pos)
        if item is not None:
            self.contextRequested.emit(item.data(Qt.UserRole), self.viewport().mapToGlobal(pos))

    def current_chat_id(self) -> int | None:
        item = self.currentItem()
        return item.data(Qt.UserRole) if item is not None else None


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
        self.search_box = QtWidgets.QLineEdit()
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

    def _build_main_area(self) -> None:
        self.main_area = QtWidgets.QWidget()
        layout = QtWidgets.QVBoxLayout(self.main_area)
        layout.setContentsMargins(4, 8, 8, 8)
        bar = QtWidgets.QHBoxLayout()
        self.chat_title = QtWidgets.QLabel()
        font = self.chat_title.font()
        font.setPointSizeF(font.pointSizeF() * 1.2)
        font.setBold(True)
        self.chat_title.setFont(font)
        self.chat_title.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.model_picker = QtWidgets.QComboBox()
        self.model_picker.setObjectName("modelPicker")
        self.model_picker.setMinimumWidth(220)
        self.model_picker.setToolTip("The model that answers (drop a .gguf file here to add one)")
        self.add_model_button = QtWidgets.QToolButton()
        self.add_model_button.setText("Add model…")
        self.chat_settings_button = QtWidgets.QToolButton()
        self.chat_settings_button.setText("Chat settings…")
        self.add_model_button.setToolTip("Add a .gguf model file (or drop one on the window)")
        bar.addWidget(self.chat_title, 1)
        bar.addWidget(QtWidgets.QLabel("Model:"))
        bar.addWidget(self.model_picker)
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
        self.device_label = QtWidgets.QLabel()
        self.speed_label = QtWidgets.QLabel()
        self.context_meter = QtWidgets.QLabel()
        self.context_meter.setObjectName("contextMeter")
        self.context_meter.setToolTip("Context used by this chat / the model's context size · "
                                      "tokens reused from the cache on the last reply")
        self.undo_button = QtWidgets.QPushButton("Undo")
        self.undo_button.hide()
        status.addWidget(self.model_status, 1)
        status.addPermanentWidget(self.undo_button)
        for widget in (self.device_label, self.speed_label, self.context_meter):
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
        self.add_model_action = action("&Add model…")
        self.remove_model_action = action("&Remove model from the list…")
        self.settings_action = action("&Preferences…", "Ctrl+,")
        self.chat_settings_action = action("Chat &settings…")
        self.quit_action = action("&Quit", "Ctrl+Q")
        menus = self.menuBar()
        file_menu = menus.addMenu("&File")
        for act in (self.new_chat_action, self.import_action, self.export_md_action,
                    self.export_json_action, self.add_model_action, self.remove_model_action):
            file_menu.addAction(act)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        chat_menu = menus.addMenu("&Chat")
        for act in (self.search_action, self.stop_action, self.chat_settings_action):
            chat_menu.addAction(act)
        menus.addMenu("&Settings").addAction(self.settings_action)
        self.search_action.triggered.connect(self.focus_search)
        self.add_model_button.clicked.connect(self.add_model_action.trigger)
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
