"""The Trash: deleted chats wait here until restored or deleted for good.

The dialog only shows and asks; it emits the chat ids and the controller acts, then calls
`set_chats` with the Trash as it is now."""

from __future__ import annotations

import datetime as dt

from app.ui.qt import Qt, QtWidgets, Signal


def _deleted_label(chat) -> str:
    when = dt.datetime.fromtimestamp(chat.deleted_at).strftime("%Y-%m-%d %H:%M")
    return f"{when}  ·  {chat.title}"


class TrashDialog(QtWidgets.QDialog):
    restoreRequested = Signal(list)  # chat ids
    purgeRequested = Signal(list)  # chat ids, to delete for good
    emptyRequested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("trashDialog")
        self.setWindowTitle("Trash")
        self.setMinimumSize(420, 300)
        self.list = QtWidgets.QListWidget()
        self.list.setObjectName("trashList")
        self.list.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.ExtendedSelection)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setUniformItemSizes(True)
        self.empty_label = QtWidgets.QLabel("The Trash is empty.")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.restore_button = QtWidgets.QPushButton("Restore")
        self.restore_button.setObjectName("restoreButton")
        self.purge_button = QtWidgets.QPushButton("Delete for good")
        self.purge_button.setObjectName("purgeButton")
        self.empty_button = QtWidgets.QPushButton("Empty Trash")
        self.empty_button.setObjectName("emptyTrashButton")
        close_button = QtWidgets.QPushButton("Close")
        close_button.clicked.connect(self.accept)
        buttons = QtWidgets.QHBoxLayout()
        for button in (self.restore_button, self.purge_button, self.empty_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(close_button)
        layout = QtWidgets.QVBoxLayout(self)
        note = QtWidgets.QLabel("Deleted chats stay here until you delete them for good. "
                                "Newest first, with when they were deleted.")
        note.setWordWrap(True)
        layout.addWidget(note)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.empty_label)
        layout.addLayout(buttons)
        self.restore_button.clicked.connect(lambda: self._emit_selected(self.restoreRequested))
        self.purge_button.clicked.connect(lambda: self._emit_selected(self.purgeRequested))
        self.empty_button.clicked.connect(self.emptyRequested)
        self.list.itemSelectionChanged.connect(self._update_buttons)
        self.list.itemDoubleClicked.connect(lambda _item: self._emit_selected(self.restoreRequested))

    def set_chats(self, chats) -> None:
        """Show `chats` (storage Chat records, deleted ones)."""
        self.list.clear()
        for chat in chats:
            item = QtWidgets.QListWidgetItem(_deleted_label(chat))
            item.setData(Qt.ItemDataRole.UserRole, chat.id)
            self.list.addItem(item)
        if chats:
            self.list.setCurrentRow(0)
        self.list.setVisible(bool(chats))
        self.empty_label.setVisible(not chats)
        self._update_buttons()

    def chat_ids(self) -> list[int]:
        return [self.list.item(row).data(Qt.ItemDataRole.UserRole)
                for row in range(self.list.count())]

    def select(self, chat_id: int) -> None:
        for row in range(self.list.count()):
            item = self.list.item(row)
            item.setSelected(item.data(Qt.ItemDataRole.UserRole) == chat_id)

    def _selected_ids(self) -> list[int]:
        return [item.data(Qt.ItemDataRole.UserRole) for item in self.list.selectedItems()]

    def _emit_selected(self, signal) -> None:
        ids = self._selected_ids()
        if ids:
            signal.emit(ids)

    def _update_buttons(self) -> None:
        selected = bool(self.list.selectedItems())
        self.restore_button.setEnabled(selected)
        self.purge_button.setEnabled(selected)
        self.empty_button.setEnabled(self.list.count() > 0)
