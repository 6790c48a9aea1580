"""Where the person writes: the message box, the attached documents and the Send, Stop and
Attach buttons. It only emits what was asked for; the controller decides what happens (and
clears the text with `clear_text()` once a message is accepted)."""

from __future__ import annotations

import math

from app.ui.qt import Qt, QtCore, QtGui, QtWidgets, Signal
from app.ui.resources import danger_color
from app.ui.view_models import AttachmentChip

PLACEHOLDER = "Message… (Enter to send, Shift+Enter for a new line)"
MAX_VISIBLE_LINES = 8


def chip_text(chip: AttachmentChip) -> str:
    """"report.pdf · 1,234 tokens", or "report.pdf · counting…" while being counted, then
    how the chat uses it: "· whole", "· searched (42 passages)", "· indexing 40%"."""
    if chip.tokens is None:
        text = f"{chip.name} · counting…"
    else:
        unit = "token" if chip.tokens == 1 else "tokens"
        text = f"{chip.name} · {chip.tokens:,} {unit}"
    return f"{text} · {chip.mode}" if chip.mode else text


def local_paths(mime: QtCore.QMimeData) -> list[str]:
    """The local files in a drag, in order; other URLs (web links) are not files to attach."""
    if not mime.hasUrls():
        return []
    return [url.toLocalFile() for url in mime.urls() if url.isLocalFile()]


class ComposerEdit(QtWidgets.QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter starts a new line, Esc stops. It grows with
    its text up to MAX_VISIBLE_LINES, then scrolls."""

    submitted = Signal()
    escapePressed = Signal()

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("composer")
        self.setPlaceholderText(PLACEHOLDER)
        self.setTabChangesFocus(True)
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Expanding,
                           QtWidgets.QSizePolicy.Policy.Fixed)
        self.document().contentsChanged.connect(self.fit_height)
        self.fit_height()

    def keyPressEvent(self, event: QtGui.QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.textCursor().insertText("\n")  # a new paragraph, not a U+2028 break
            else:
                self.submitted.emit()
            event.accept()
        elif event.key() == Qt.Key.Key_Escape:
            self.escapePressed.emit()
            event.accept()
        else:
            super().keyPressEvent(event)

    def visible_lines(self) -> int:
        """Lines the text takes at the current width, capped at MAX_VISIBLE_LINES."""
        lines = 0
        block = self.document().begin()
        while block.isValid() and lines < MAX_VISIBLE_LINES:
            lines += max(1, block.layout().lineCount() if block.layout() else 1)
            block = block.next()
        return max(1, min(lines, MAX_VISIBLE_LINES))

    def fit_height(self) -> None:
        lines = self.visible_lines()
        # A scroll bar only once the box has stopped growing.
        self.setVerticalScrollBarPolicy(
            Qt.ScrollBarPolicy.ScrollBarAsNeeded if lines >= MAX_VISIBLE_LINES
            else Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        margins = self.contentsMargins()
        text_height = lines * self.fontMetrics().lineSpacing()
        # +2: QPlainTextEdit wants a pixel to spare before it stops offering to scroll.
        height = (math.ceil(text_height + 2 * self.document().documentMargin())
                  + margins.top() + margins.bottom() + 2)
        if height != self.height() or self.minimumHeight() != height:
            self.setFixedHeight(height)

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self.fit_height()  # wrapping changed

    # Dropped files are attachments (the panel takes them), not text to paste.
    def dragEnterEvent(self, event: QtGui.QDragEnterEvent) -> None:
        if local_paths(event.mimeData()):
            event.ignore()
        else:
            super().dragEnterEvent(event)

    def dragMoveEvent(self, event: QtGui.QDragMoveEvent) -> None:
        if local_paths(event.mimeData()):
            event.ignore()
        else:
            super().dragMoveEvent(event)


class FlowLayout(QtWidgets.QLayout):
    """Lays widgets out left to right, wrapping onto new rows (the chip strip)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None, spacing: int = 6):
        super().__init__(parent)
        self._items: list[QtWidgets.QLayoutItem] = []
        self.setSpacing(spacing)
        self.setContentsMargins(0, 0, 0, 0)

    def addItem(self, item: QtWidgets.QLayoutItem) -> None:
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QtWidgets.QLayoutItem | None:
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QtWidgets.QLayoutItem | None:
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        return self._arrange(QtCore.QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QtCore.QRect) -> None:
        super().setGeometry(rect)
        self._arrange(rect, move=True)

    def sizeHint(self) -> QtCore.QSize:
        return self.minimumSize()

    def minimumSize(self) -> QtCore.QSize:
        size = QtCore.QSize()
        for item in self._items:
            size = size.expandedTo(item.minimumSize())
        margins = self.contentsMargins()
        return size + QtCore.QSize(margins.left() + margins.right(),
                                   margins.top() + margins.bottom())

    def _arrange(self, rect: QtCore.QRect, move: bool) -> int:
        """Place the items in `rect` (or only measure); returns the height used."""
        margins = self.contentsMargins()
        area = rect.adjusted(margins.left(), margins.top(), -margins.right(), -margins.bottom())
        x, y, row_height = area.x(), area.y(), 0
        for item in self._items:
            hint = item.sizeHint()
            if x > area.x() and x + hint.width() > area.right() + 1:
                x, y, row_height = area.x(), y + row_height + self.spacing(), 0
            if move:
                item.setGeometry(QtCore.QRect(QtCore.QPoint(x, y), hint))
            x += hint.width() + self.spacing()
            row_height = max(row_height, hint.height())
        return y + row_height - rect.y() + margins.bottom()


class AttachmentChipWidget(QtWidgets.QFrame):
    """"report.pdf · 1,234 tokens ×", with the warning (if any) in red underneath."""

    removeClicked = Signal(str)  # chip key
    cancelClicked = Signal(str)  # chip key: stop indexing it

    def __init__(self, chip: AttachmentChip, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.chip = chip
        self.setObjectName("attachmentChip")
        self.setToolTip(chip.warning or chip.name)
        self.label = QtWidgets.QLabel(chip_text(chip))
        self.label.setObjectName("chipLabel")
        self.warning = QtWidgets.QLabel(chip.warning)
        self.warning.setObjectName("chipWarning")
        self.warning.setVisible(bool(chip.warning))
        palette = self.warning.palette()
        palette.setColor(QtGui.QPalette.ColorRole.WindowText, danger_color(self.palette()))
        self.warning.setPalette(palette)
        self.remove_button = QtWidgets.QToolButton()
        self.remove_button.setObjectName("removeAttachmentButton")
        self.remove_button.setText("×")
        self.remove_button.setAutoRaise(True)
        self.remove_button.setToolTip(f"Remove {chip.name}")
        self.remove_button.clicked.connect(lambda: self.removeClicked.emit(chip.key))
        # Indexing: a bar and Cancel (the index keeps what was done; attaching again resumes).
        self.index_bar = QtWidgets.QProgressBar()
        self.index_bar.setObjectName("indexProgress")
        self.index_bar.setTextVisible(False)
        self.index_bar.setFixedHeight(5)
        self.index_bar.setRange(0, 0 if (chip.progress or 0) < 0 else 100)
        self.index_bar.setValue(max(chip.progress or 0, 0))
        self.index_bar.setVisible(chip.progress is not None)
        self.cancel_button = QtWidgets.QToolButton()
        self.cancel_button.setObjectName("cancelIndexButton")
        self.cancel_button.setText("Cancel")
        self.cancel_button.setAutoRaise(True)
        self.cancel_button.setToolTip(f"Stop indexing {chip.name}")
        self.cancel_button.setVisible(chip.progress is not None)
        self.cancel_button.clicked.connect(lambda: self.cancelClicked.emit(chip.key))
        text = QtWidgets.QVBoxLayout()
        text.setSpacing(0)
        text.addWidget(self.label)
        text.addWidget(self.index_bar)
        text.addWidget(self.warning)
        row = QtWidgets.QHBoxLayout(self)
        row.setContentsMargins(10, 3, 2, 3)
        row.setSpacing(2)
        row.addLayout(text)
        row.addWidget(self.cancel_button)
        row.addWidget(self.remove_button)
        font = self.font()
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.9))
        self.setFont(font)

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:
        palette = self.palette()
        painter = QtGui.QPainter(self)
        painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
        border = danger_color(palette) if self.chip.warning else palette.color(
            QtGui.QPalette.ColorRole.Mid)
        painter.setPen(QtGui.QPen(border, 1))
        painter.setBrush(palette.color(QtGui.QPalette.ColorRole.Button))
        painter.drawRoundedRect(QtCore.QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 9, 9)
        painter.end()


class AttachmentStrip(QtWidgets.QWidget):
    """The attached documents as chips (objectName "attachmentList")."""

    removeClicked = Signal(str)
    cancelClicked = Signal(str)

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attachmentList")
        self._flow = FlowLayout(self)
        self._chips: list[AttachmentChipWidget] = []

    def set_chips(self, chips: list[AttachmentChip]) -> None:
        for widget in self._chips:
            self._flow.removeWidget(widget)
            widget.deleteLater()
        self._chips = []
        for chip in chips:
            widget = AttachmentChipWidget(chip)
            widget.removeClicked.connect(self.removeClicked)
            widget.cancelClicked.connect(self.cancelClicked)
            self._flow.addWidget(widget)
            widget.show()
            self._chips.append(widget)
        self.setVisible(bool(chips))

    def chips(self) -> list[AttachmentChipWidget]:
        return list(self._chips)


class ComposerPanel(QtWidgets.QWidget):
    """The message box with its attachments and buttons; files dropped on it are attached."""

    sendRequested = Signal(str)  # the trimmed text ("" only when documents are attached)
    stopRequested = Signal()
    attachRequested = Signal()
    attachmentRemoved = Signal(str)  # chip key
    indexCancelRequested = Signal(str)  # chip key
    filesDropped = Signal(list)  # local paths (list[str])

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("composerPanel")
        self.setAcceptDrops(True)
        self._busy = False
        self._send_enabled = True
        self.attachment_list = AttachmentStrip()
        self.attachment_list.hide()
        self.edit = ComposerEdit()
        self.attach_button = QtWidgets.QToolButton()
        self.attach_button.setObjectName("attachButton")
        self.attach_button.setText("+")
        self.attach_button.setToolTip("Attach a document")
        self.send_button = QtWidgets.QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setToolTip("Send (Enter)")
        self.stop_button = QtWidgets.QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.setToolTip("Stop the reply (Esc)")
        self._lay_out()
        self.attach_button.clicked.connect(self.attachRequested)
        self.send_button.clicked.connect(self._try_send)
        self.stop_button.clicked.connect(self.stopRequested)
        self.edit.submitted.connect(self._try_send)
        self.edit.escapePressed.connect(self.stopRequested)
        self.attachment_list.removeClicked.connect(self.attachmentRemoved)
        self.attachment_list.cancelClicked.connect(self.indexCancelRequested)
        self.set_busy(False)

    def _lay_out(self) -> None:
        row = QtWidgets.QHBoxLayout()
        row.setSpacing(6)
        bottom = Qt.AlignmentFlag.AlignBottom
        row.addWidget(self.attach_button, 0, bottom)
        row.addWidget(self.edit, 1, bottom)
        row.addWidget(self.send_button, 0, bottom)
        row.addWidget(self.stop_button, 0, bottom)
        # The buttons match the one-line height of the message box.
        height = self.edit.height()
        for button in (self.attach_button, self.send_button, self.stop_button):
            button.setFixedHeight(height)
        self.attach_button.setFixedWidth(height)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(12, 6, 12, 10)
        layout.setSpacing(6)
        layout.addWidget(self.attachment_list)
        layout.addLayout(row)

    # -- the text ----------------------------------------------------------------------

    def text(self) -> str:
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        self.edit.setPlainText(text)
        self.edit.moveCursor(QtGui.QTextCursor.MoveOperation.End)

    def clear_text(self) -> None:
        self.edit.clear()

    def focus_input(self) -> None:
        self.edit.setFocus(Qt.FocusReason.OtherFocusReason)

    # -- state -------------------------------------------------------------------------

    def set_busy(self, busy: bool) -> None:
        """While the chat is generating: Stop is shown (Esc stops too) and Send is hidden."""
        self._busy = busy
        self.send_button.setVisible(not busy)
        self.stop_button.setVisible(busy)
        self.stop_button.setEnabled(busy)

    def is_busy(self) -> bool:
        return self._busy

    def set_send_enabled(self, enabled: bool, reason: str = "") -> None:
        """Allow or refuse sending (e.g. no model loaded); `reason` becomes the tooltip."""
        self._send_enabled = enabled
        self.send_button.setEnabled(enabled)
        self.send_button.setToolTip(reason or ("Send (Enter)" if enabled else ""))

    def set_attachments(self, chips: list[AttachmentChip]) -> None:
        self.attachment_list.set_chips(chips)

    def attachment_chips(self) -> list[AttachmentChipWidget]:
        return self.attachment_list.chips()

    def _try_send(self) -> None:
        if self._busy or not self._send_enabled:
            return
        text = self.text().strip()
        if text or self.attachment_list.chips():
            self.sendRequested.emit(text)

    # -- dropping files ----------------------------------------------------------------

    def dragEnterEvent(self, event: QtGui.QDragEnterEvent) -> None:
        if local_paths(event.mimeData()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event: QtGui.QDragMoveEvent) -> None:
        self.dragEnterEvent(event)

    def dropEvent(self, event: QtGui.QDropEvent) -> None:
        paths = local_paths(event.mimeData())
        if not paths:
            event.ignore()
            return
        event.acceptProposedAction()
        self.filesDropped.emit(paths)
