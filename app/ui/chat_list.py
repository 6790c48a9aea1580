"""The sidebar's chat list: one row per chat with a pin icon, the title (elided) and, in its
own place at the right, what the chat is doing ("writing…", "reading 40%"), so a long title
never hides the badge and the badge never becomes part of the title."""

from __future__ import annotations

from app.ui.qt import Qt, QtCore, QtGui, QtWidgets, Signal
from app.ui.resources import pin_icon

CHAT_ID_ROLE = Qt.ItemDataRole.UserRole
BADGE_ROLE = Qt.ItemDataRole.UserRole + 1  # str: the chat's activity, "" when idle
PINNED_ROLE = Qt.ItemDataRole.UserRole + 2  # bool: what the icon shows
BADGE_GAP_PX = 8


class ChatRowDelegate(QtWidgets.QStyledItemDelegate):
    """Paints the row as the style does (icon, elided title) in the width the badge leaves,
    then the badge right-aligned in a smaller, muted font."""

    def sizeHint(self, option, index: QtCore.QModelIndex) -> QtCore.QSize:
        # No width of its own: a row is as wide as the list, and a long title is elided
        # rather than scrolled sideways (which would push the badge out of sight).
        return QtCore.QSize(1, super().sizeHint(option, index).height())

    def paint(self, painter: QtGui.QPainter, option, index: QtCore.QModelIndex) -> None:
        badge = index.data(BADGE_ROLE) or ""
        if not badge:
            super().paint(painter, option, index)
            return
        font = _badge_font(option.font)
        badge_width = QtGui.QFontMetrics(font).horizontalAdvance(badge) + BADGE_GAP_PX
        title_option = QtWidgets.QStyleOptionViewItem(option)
        self.initStyleOption(title_option, index)
        style = option.widget.style() if option.widget else QtWidgets.QApplication.style()
        # The background and selection over the whole row, the title in what the badge leaves.
        background = QtWidgets.QStyleOptionViewItem(title_option)
        background.text, background.icon = "", QtGui.QIcon()
        style.drawControl(QtWidgets.QStyle.ControlElement.CE_ItemViewItem, background, painter,
                          option.widget)
        title_option.rect = option.rect.adjusted(0, 0, -badge_width, 0)
        title_option.showDecorationSelected = False
        title_option.backgroundBrush = QtGui.QBrush()
        title_option.state &= ~QtWidgets.QStyle.StateFlag.State_Selected
        if option.state & QtWidgets.QStyle.StateFlag.State_Selected:
            title_option.palette.setColor(QtGui.QPalette.ColorRole.Text,
                                          option.palette.color(QtGui.QPalette.ColorRole.HighlightedText))
        style.drawControl(QtWidgets.QStyle.ControlElement.CE_ItemViewItem, title_option, painter,
                          option.widget)
        painter.save()
        painter.setFont(font)
        role = (QtGui.QPalette.ColorRole.HighlightedText
                if option.state & QtWidgets.QStyle.StateFlag.State_Selected
                else QtGui.QPalette.ColorRole.PlaceholderText)
        painter.setPen(option.palette.color(role))
        painter.drawText(option.rect.adjusted(0, 0, -BADGE_GAP_PX // 2, 0),
                         int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), badge)
        painter.restore()


def _badge_font(font: QtGui.QFont) -> QtGui.QFont:
    small = QtGui.QFont(font)
    small.setPointSizeF(max(6.0, font.pointSizeF() * 0.85))
    return small


class ChatList(QtWidgets.QListWidget):
    """Chats, pinned first; each item holds the chat id (CHAT_ID_ROLE) and its badge
    (BADGE_ROLE); the item's text is the title alone."""

    contextRequested = Signal(int, object)  # chat id, global position

    def __init__(self):
        super().__init__()
        self.setObjectName("chatList")
        self.setContextMenuPolicy(Qt.CustomContextMenu)
        self.customContextMenuRequested.connect(self._context_menu)
        self.setUniformItemSizes(True)
        self.setItemDelegate(ChatRowDelegate(self))
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

    def _context_menu(self, pos) -> None:
        item = self.itemAt(pos)
        if item is not None:
            self.contextRequested.emit(item.data(CHAT_ID_ROLE), self.viewport().mapToGlobal(pos))

    def current_chat_id(self) -> int | None:
        item = self.currentItem()
        return item.data(CHAT_ID_ROLE) if item is not None else None

    def item_for(self, chat_id: int) -> QtWidgets.QListWidgetItem | None:
        for row in range(self.count()):
            if self.item(row).data(CHAT_ID_ROLE) == chat_id:
                return self.item(row)
        return None

    @staticmethod
    def fill_item(item: QtWidgets.QListWidgetItem, chat, badge: str) -> None:
        """Show `chat` (a storage Chat) with `badge` in `item`. Only what changed is set:
        each change repaints the row, and a streaming chat's row is refreshed often."""
        if item.text() != chat.title:
            item.setText(chat.title)
            item.setToolTip(chat.title)
        if item.data(CHAT_ID_ROLE) != chat.id:
            item.setData(CHAT_ID_ROLE, chat.id)
        if item.data(BADGE_ROLE) != badge:
            item.setData(BADGE_ROLE, badge)
        if item.data(PINNED_ROLE) != chat.pinned:
            item.setData(PINNED_ROLE, chat.pinned)
            item.setIcon(pin_icon() if chat.pinned else QtGui.QIcon())
