"""The chat transcript: one widget per message, fed plain `MessageItem`s.

`update_message()` is called for every streamed batch of tokens. It only stores the latest
item; a 16 ms timer (display pace) applies whatever has gathered, so the view repaints on a
timer, not per call, and a streaming reply re-renders only its unfinished tail
(app/ui/markdown_render.py). The view follows the stream while it is scrolled to the bottom,
and leaves the position alone once the person has scrolled up.

The GUI thread's work stays bounded however long a chat is: opening one builds the widgets
of its newest messages only; older ones are built a slice at a time while the event loop
runs, as the person scrolls up to them, into a blank reserve of their estimated height (so
the scroll bar spans the whole chat at once, and building one moves nothing on screen).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

import html

from app.ui.citations import cite_number, link_citations
from app.ui.composer import ComposerEdit
from app.ui.markdown_render import IncrementalMarkdown
from app.ui.qt import Qt, QtCore, QtGui, QTimer, QtWidgets, Signal
from app.ui.resources import danger_color, tint
from app.ui.view_models import (
    ERROR,
    INTERRUPTED,
    LIVE_STATUSES,
    PREFILLING,
    QUEUED,
    STOPPED,
    STREAMING,
    MessageItem,
)

FLUSH_INTERVAL_MS = 16  # streamed text is shown at display pace (60 Hz), never per token
MAX_FLUSH_INTERVAL_MS = 250  # should an update grow expensive: never less than 4/s
STREAM_CPU_SHARE = 0.08  # of one core: showing streamed text, at most (see MessageView._pace)
SHARED_FLUSH_INTERVAL_MS = 50  # ... but never waiting longer than this for that (~15 a second)
# Opening a chat builds SYNC_BUILD message widgets at once, then older ones one per turn of
# the event loop (a 0 ms timer), up to OPEN_TAIL and then for as long as the view is not
# filled; scrolling near the top builds PAGE_BUILD more. One per turn: a widget costs a few
# ms to build and its layout and paint pass as much again, so a turn that built several
# (the old 6 ms budget) stalled the GUI thread 20-30 ms (scripts/bench_gui_stalls.py c).
# The messages not built yet are stood in for by one blank reserve of their estimated
# height above the built ones; a message built takes its height out of the reserve, so
# nothing below it moves, the scroll range stays put, and nothing on screen is repainted
# (moving every built message down, then the scroll bar back, repainted the whole view
# and the scroll bar for each message built).
SYNC_BUILD = 4
OPEN_TAIL = 10
PAGE_BUILD = 8
BOTTOM_SLACK_PX = 24  # "at the bottom" means within this many pixels of it
MAX_TEXT_WIDTH = 880  # readable line length; wider windows get side margins
SCRATCH_WIDTHS = 2  # measuring copies a message keeps (the layout asks ~2 other widths)

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
_WAITING_TEXT = {QUEUED: "Preparing the prompt…", PREFILLING: "Reading the prompt…",
                 STREAMING: "Writing…"}
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def code_blocks(markdown: str) -> list[str]:
    """The contents of the fenced code blocks in `markdown`, in order. A fence that is not
    closed yet (a reply still streaming) runs to the end of the text."""
    blocks: list[str] = []
    fence, lines = None, []
    for line in markdown.splitlines():
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, lines = match.group(1), []
        elif match and line.strip() == match.group(1) and match.group(1)[0] == fence[0] \
                and len(match.group(1)) >= len(fence):
            blocks.append("\n".join(lines))
            fence = None
        else:
            lines.append(line)
    if fence is not None:
        blocks.append("\n".join(lines))
    return blocks


def with_line_breaks(markdown: str) -> str:
    """`markdown` with each single newline outside code blocks made a hard line break, as
    chat apps render Markdown: a haiku, an address or a list typed with Shift+Enter keeps
    its lines (plain Markdown would join them into one paragraph). Blank lines, fences and
    the lines inside fenced code stay as they are."""
    lines = markdown.split("\n")
    fence = None
    for i, line in enumerate(lines[:-1]):
        match = _FENCE.match(line)
        if fence is not None:
            if match and line.strip() == match.group(1) and match.group(1)[0] == fence[0] \
                    and len(match.group(1)) >= len(fence):
                fence = None
            continue
        if match:
            fence = match.group(1)
            continue
        following = lines[i + 1]
        if line.strip() and following.strip() and not line.endswith(("  ", "\\")) \
                and not _FENCE.match(following):
            lines[i] = line + "  "
    return "\n".join(lines)


def _code_menu_label(code: str, index: int) -> str:
    first = next((line.strip() for line in code.splitlines() if line.strip()), "(empty)")
    if len(first) > 48:
        first = first[:47] + "…"
    return f"{index + 1}. {first}"


class _RenderMeter:
    """Milliseconds the GUI thread spent measuring and painting message text since `take()`
    was last called (see MessageView._pace)."""

    def __init__(self):
        self._ms = 0.0

    def add(self, started: float) -> None:
        self._ms += (time.perf_counter() - started) * 1000

    def take(self) -> float:
        ms, self._ms = self._ms, 0.0
        return ms


RENDER_METER = _RenderMeter()


class MarkdownBrowser(QtWidgets.QTextBrowser):
    """Read-only Markdown, frameless and transparent, as tall as its document: the
    transcript scrolls, never a single message."""

    citationClicked = Signal(int)  # N of a clicked "cite:N" link

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self._markdown: str | None = None
        self._heights: dict[int, int] = {}  # width -> height, for the current text
        # The shown document, and copies for measuring other widths (made when first asked,
        # one per width, the latest SCRATCH_WIDTHS kept), each re-rendering only the tail of
        # a growing text (app/ui/markdown_render.py).
        self._render = IncrementalMarkdown(self.document(), with_line_breaks, self._style)
        self._scratch: dict[int, IncrementalMarkdown] = {}
        self.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        policy = QtWidgets.QSizePolicy(QtWidgets.QSizePolicy.Policy.Expanding,
                                       QtWidgets.QSizePolicy.Policy.Preferred)
        policy.setHeightForWidth(True)
        self.setSizePolicy(policy)
        self.viewport().setAutoFillBackground(False)
        self.setWordWrapMode(QtGui.QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.document().setDocumentMargin(2)
        # Links open in the system browser; following them here would replace the message.
        self.setOpenLinks(False)
        self.anchorClicked.connect(self._open_link)

    def _open_link(self, url: QtCore.QUrl) -> None:
        number = cite_number(url.toString())
        if number is not None:
            self.citationClicked.emit(number)
        else:
            QtGui.QDesktopServices.openUrl(url)

    def set_markdown(self, text: str) -> None:
        if text == self._markdown:
            return
        self._markdown = text
        self._render.show(text)
        self._heights.clear()
        self.updateGeometry()  # the layout asks heightForWidth() again

    def _style(self, document: QtGui.QTextDocument, start: int) -> None:
        style_code(document, self.palette(), start)

    def markdown(self) -> str:
        return self._markdown or ""

    # The layout gives this widget the height its document needs at the width it gets, in
    # the same pass (a height fitted afterwards in resizeEvent can leave QTextEdit's scroll
    # range stale when the widget is first shown).
    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        height = self._heights.get(width)
        if height is None:
            height = self._heights[width] = self._measure(width)
        return height

    def _measure(self, width: int) -> int:
        started = time.perf_counter()
        try:
            return self._measured(width)
        finally:
            RENDER_METER.add(started)

    def _measured(self, width: int) -> int:
        margins = self.contentsMargins()
        text_width = max(1, width - margins.left() - margins.right())
        document = self.document()
        if document.textWidth() != text_width:
            # Layouts ask about widths this widget may never get (e.g. with and without the
            # transcript's scroll bar): measure a copy, leave the shown document alone.
            document = self._scratch_document(text_width)
        return math.ceil(document.size().height()) + margins.top() + margins.bottom()

    def _scratch_document(self, text_width: int) -> QtGui.QTextDocument:
        """The shown text rendered again at `text_width`, for measuring (clone() drops
        block formats). One copy per width: while a reply streams the layout asks two other
        widths on every update, and a copy whose width changed lays its whole text out
        again (a long reply's updates grew to ~1.5 ms a layout pass on it), where a copy
        that keeps its width lays out only the tail that changed."""
        shown = self.document()
        scratch = self._scratch.get(text_width)
        if scratch is None or scratch.document.defaultFont() != shown.defaultFont():
            if scratch is not None:  # the font changed: its heights are stale
                self._scratch.pop(text_width).document.deleteLater()
            # Set up once: each of these setters lays the whole document out again.
            document = QtGui.QTextDocument(self)
            document.setDocumentMargin(shown.documentMargin())
            document.setDefaultFont(shown.defaultFont())
            document.setDefaultTextOption(shown.defaultTextOption())
            document.setTextWidth(text_width)
            scratch = IncrementalMarkdown(document, with_line_breaks, self._style)
            while len(self._scratch) >= SCRATCH_WIDTHS:  # the oldest width goes
                self._scratch.pop(next(iter(self._scratch))).document.deleteLater()
            self._scratch[text_width] = scratch
        scratch.show(self.markdown())
        return scratch.document

    def _drop_scratch(self) -> None:
        for scratch in self._scratch.values():
            scratch.document.deleteLater()
        self._scratch.clear()

    def sizeHint(self) -> QtCore.QSize:
        width = self.width()
        parent = self.parentWidget()
        if not self.testAttribute(Qt.WidgetAttribute.WA_Resized) and parent is not None \
                and parent.layout() is not None:
            # Not given a size yet (a message widget being shown for the first time): the
            # width its parent's layout will give it, not QWidget's default 640 px, or the
            # text is laid out and measured at a width it never gets.
            margins = parent.layout().contentsMargins()
            width = parent.contentsRect().width() - margins.left() - margins.right()
        width = max(width, 200)
        return QtCore.QSize(width, self.heightForWidth(width))

    def minimumSizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(120, 0)

    def changeEvent(self, event: QtCore.QEvent) -> None:
        super().changeEvent(event)
        restyle = (QtCore.QEvent.Type.PaletteChange, QtCore.QEvent.Type.FontChange)
        if event.type() in restyle and self._markdown is not None:
            # The code background comes from the palette; heights depend on the font.
            text, self._markdown = self._markdown, None
            self._render.reset()
            self._drop_scratch()
            self.set_markdown(text)

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:
        started = time.perf_counter()
        super().paintEvent(event)
        RENDER_METER.add(started)

    def wheelEvent(self, event: QtGui.QWheelEvent) -> None:
        # Nothing scrolls in here: hand the wheel to the transcript around us (explicitly, as
        # Qt only propagates wheel events that come from the system).
        area = self.parentWidget()
        while area is not None and not isinstance(area, QtWidgets.QAbstractScrollArea):
            area = area.parentWidget()
        if area is None:
            event.ignore()
        else:
            QtWidgets.QApplication.sendEvent(area.viewport(), event)


def style_code(document: QtGui.QTextDocument, palette: QtGui.QPalette, start: int = 0) -> None:
    """Qt renders fenced code as non-wrapping blocks in the fixed font's family. Make
    the font truly monospace everywhere, let long lines wrap (nothing scrolls sideways
    here) and set each run of code lines in a padded frame with a faint background.
    Only the blocks from position `start` on (what was just rendered) are looked at."""
    mono = QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont)
    code_format = QtGui.QTextCharFormat()
    code_format.setFontFamilies([mono.family(), "monospace"])
    code_format.setFontFixedPitch(True)
    code_format.setFontStyleHint(QtGui.QFont.StyleHint.TypeWriter)
    frame_format = QtGui.QTextFrameFormat()
    text_color = palette.color(QtGui.QPalette.ColorRole.Text)
    frame_format.setBackground(tint(palette, text_color, 0.07))
    frame_format.setPadding(6)
    frame_format.setBorder(0)
    frame_format.setMargin(0)
    frame_format.setTopMargin(4)
    frame_format.setBottomMargin(4)
    cursor = QtGui.QTextCursor(document)
    cursor.beginEditBlock()
    for first, end in reversed(_code_runs(document, start)):  # from the end: positions stay valid
        cursor.setPosition(first)
        cursor.setPosition(end, QtGui.QTextCursor.MoveMode.KeepAnchor)
        block_format = cursor.blockFormat()
        block_format.setNonBreakableLines(False)
        cursor.mergeBlockFormat(block_format)
        cursor.mergeCharFormat(code_format)
        _fold_empty_neighbours(cursor, cursor.insertFrame(frame_format))
    cursor.endEditBlock()


def _code_runs(document: QtGui.QTextDocument, start: int = 0) -> list[tuple[int, int]]:
    """[start, end) positions of each run of consecutive code blocks from `start` on."""
    runs: list[tuple[int, int]] = []
    block = document.findBlock(start) if start else document.begin()
    while block.isValid():
        if block.blockFormat().nonBreakableLines():
            start = block.position()
            while block.next().isValid() and block.next().blockFormat().nonBreakableLines():
                block = block.next()
            runs.append((start, block.position() + block.length() - 1))
        block = block.next()
    return runs


def _fold_empty_neighbours(cursor: QtGui.QTextCursor, frame: QtGui.QTextFrame) -> None:
    """insertFrame() leaves an empty paragraph on each side of the frame (a blank line
    around every code block): join them with their neighbours."""
    cursor.setPosition(frame.lastPosition() + 1)  # the paragraph right after the frame
    after = cursor.block()
    if after.length() == 1 and after.next().isValid():
        next_format = after.next().blockFormat()
        cursor.deleteChar()  # pulls the next paragraph up into this empty one
        cursor.setBlockFormat(next_format)
    elif after.length() == 1:  # the frame ends the document: this line must stay
        cursor.setBlockFormat(_NO_HEIGHT)
    cursor.setPosition(frame.firstPosition() - 1)  # the paragraph right before the frame
    before = cursor.block()
    if before.length() == 1 and before.previous().isValid():
        cursor.deletePreviousChar()
    elif before.length() == 1:  # the frame starts the document
        cursor.setBlockFormat(_NO_HEIGHT)


_NO_HEIGHT = QtGui.QTextBlockFormat()
_NO_HEIGHT.setLineHeight(0, QtGui.QTextBlockFormat.LineHeightTypes.FixedHeight.value)


class _TintedFrame(QtWidgets.QFrame):
    """A frame painted as a rounded rectangle in a colour derived from the palette."""

    def __init__(self, fill, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self._fill = fill  # palette -> QColor | None

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:
        color = self._fill(self.palette())
        if color is not None:
            painter = QtGui.QPainter(self)
            painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(color)
            painter.drawRoundedRect(QtCore.QRectF(self.rect()), 8, 8)
            painter.end()
        super().paintEvent(event)


def _user_fill(palette: QtGui.QPalette) -> QtGui.QColor:
    return tint(palette, palette.color(QtGui.QPalette.ColorRole.Highlight), 0.10)


def _error_fill(palette: QtGui.QPalette) -> QtGui.QColor:
    return tint(palette, danger_color(palette), 0.14)


def _small(widget: QtWidgets.QWidget, scale: float = 0.9) -> QtWidgets.QWidget:
    font = widget.font()
    font.setPointSizeF(max(6.0, font.pointSizeF() * scale))
    widget.setFont(font)
    return widget


def _tool_button(text: str, tip: str, name: str) -> QtWidgets.QToolButton:
    button = QtWidgets.QToolButton()
    button.setText(text)
    button.setToolTip(tip)
    button.setObjectName(name)
    button.setAutoRaise(True)
    button.setFocusPolicy(Qt.FocusPolicy.TabFocus)
    return _small(button)


class MessageWidget(_TintedFrame):
    """One message: role, Markdown body, attachments, progress/info/error lines and a
    small toolbar (copy, copy code, regenerate or edit, version switcher)."""

    copyRequested = Signal(str, str)  # text, what was copied ("message" | "code")
    regenerateRequested = Signal(int)
    editRequested = Signal(int, str)
    versionRequested = Signal(int, int)
    continueRequested = Signal(int)

    def __init__(self, item: MessageItem, parent: QtWidgets.QWidget | None = None):
        self.item = item
        super().__init__(_user_fill if item.role == "user" else lambda _palette: None, parent)
        self.setObjectName(f"{item.role}Message")
        self._code: list[str] = []
        # Parts most messages never show are made the first time they are needed (see
        # _part): a message of an opened chat is built with its role, text and the buttons
        # of its role only, as every widget more is a cost paid again for each message.
        self._parts: dict[str, QtWidgets.QWidget] = {}
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        layout.addLayout(self._build_header())
        layout.addWidget(self._build_reasoning())
        self.body = MarkdownBrowser()
        self.body.citationClicked.connect(self.show_passage)
        layout.addWidget(self.body)
        layout.addWidget(self._build_editor())
        layout.addWidget(self._build_sources())
        self._footer = QtWidgets.QHBoxLayout()  # the info line and Continue, when made
        layout.addLayout(self._footer)
        self._column = layout
        self.apply(item)

    # -- building ----------------------------------------------------------------------

    def _build_header(self) -> QtWidgets.QHBoxLayout:
        header = QtWidgets.QHBoxLayout()
        header.setSpacing(2)
        self.role_label = QtWidgets.QLabel(ROLE_NAMES.get(self.item.role, self.item.role))
        self.role_label.setObjectName("roleLabel")
        bold = self.role_label.font()
        bold.setBold(True)
        self.role_label.setFont(bold)
        header.addWidget(self.role_label)
        header.addStretch(1)
        self._header = header
        self.copy_code_menu: QtWidgets.QMenu | None = None  # made when a reply has 2+ blocks
        self.copy_button = self._part("copy")
        if self.item.role == "assistant":
            self._part("regenerate")
        elif self.item.role == "user":
            self._part("edit")
        return header

    # -- parts made on first use -------------------------------------------------------
    # Where each goes: the toolbar's buttons in this order after the role's stretch; the
    # attachment names under the text (above the sources), the progress and error lines in
    # this order under the sources, the info line and Continue in the footer.

    _TOOLBAR = ("prev", "version", "next", "copy", "copy_code", "regenerate", "edit")
    _LINES = ("progress", "error")

    def _part(self, name: str) -> QtWidgets.QWidget:
        """The part called `name`, made (hidden, unless a toolbar button) and put in its place
        the first time it is asked for."""
        widget = self._parts.get(name)
        if widget is not None:
            return widget
        widget = self._parts[name] = getattr(self, f"_make_{name}")()
        if name in self._TOOLBAR:
            before = sum(other in self._parts for other in self._TOOLBAR[:self._TOOLBAR.index(name)])
            self._header.insertWidget(2 + before, widget)  # after the role and the stretch
        elif name == "attachments":
            widget.hide()
            self._column.insertWidget(self._column.indexOf(self.editor_box) + 1, widget)
        elif name in self._LINES:
            widget.hide()
            before = sum(other in self._parts for other in self._LINES[:self._LINES.index(name)])
            self._column.insertWidget(self._column.indexOf(self.sources_box) + 1 + before, widget)
        else:  # the footer: the info line, then Continue
            widget.hide()
            self._footer.insertWidget(0 if name == "info" else self._footer.count(), widget,
                                      1 if name == "info" else 0)
        return widget

    def _made(self, name: str) -> QtWidgets.QWidget | None:
        return self._parts.get(name)

    def _make_prev(self) -> QtWidgets.QToolButton:
        button = _tool_button("‹", "Previous version", "previousVersionButton")
        button.clicked.connect(lambda: self._request_version(-1))
        return button

    def _make_version(self) -> QtWidgets.QLabel:
        label = _small(QtWidgets.QLabel())
        label.setObjectName("versionLabel")
        return label

    def _make_next(self) -> QtWidgets.QToolButton:
        button = _tool_button("›", "Next version", "nextVersionButton")
        button.clicked.connect(lambda: self._request_version(+1))
        return button

    def _make_copy(self) -> QtWidgets.QToolButton:
        button = _tool_button("Copy", "Copy the message as Markdown", "copyButton")
        button.clicked.connect(lambda: self.copyRequested.emit(self.item.text, "message"))
        return button

    def _make_copy_code(self) -> QtWidgets.QToolButton:
        button = _tool_button("Copy code", "Copy the code block", "copyCodeButton")
        button.clicked.connect(self._copy_only_code_block)
        return button

    def _make_regenerate(self) -> QtWidgets.QToolButton:
        button = _tool_button("Regenerate", "Write this reply again", "regenerateButton")
        button.clicked.connect(lambda: self.regenerateRequested.emit(self.item.message_id))
        if self.item.role != "assistant":
            button.hide()  # never show() here: with no parent yet it would open as a window
        return button

    def _make_edit(self) -> QtWidgets.QToolButton:
        button = _tool_button("Edit", "Edit and send again", "editButton")
        button.clicked.connect(self.start_editing)
        if self.item.role != "user":
            button.hide()  # never show() here: with no parent yet it would open as a window
        return button

    def _make_attachments(self) -> QtWidgets.QLabel:
        label = _small(QtWidgets.QLabel())
        label.setObjectName("attachmentNames")
        label.setWordWrap(True)
        label.setForegroundRole(QtGui.QPalette.ColorRole.PlaceholderText)
        return label

    def _make_progress(self) -> QtWidgets.QWidget:
        box = QtWidgets.QWidget()
        row = QtWidgets.QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        self._progress_label = _small(QtWidgets.QLabel())
        self._progress_label.setObjectName("progressLabel")
        self._progress_label.setForegroundRole(QtGui.QPalette.ColorRole.PlaceholderText)
        self._busy_bar = QtWidgets.QProgressBar()
        self._busy_bar.setRange(0, 0)  # indeterminate: the progress text carries the numbers
        self._busy_bar.setTextVisible(False)
        self._busy_bar.setFixedSize(80, 6)
        row.addWidget(self._progress_label)
        row.addWidget(self._busy_bar)
        row.addStretch(1)
        return box

    def _make_error(self) -> QtWidgets.QWidget:
        box = _TintedFrame(_error_fill)
        self._error_label = QtWidgets.QLabel()
        self._error_label.setObjectName("errorLabel")
        self._error_label.setWordWrap(True)
        self._error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        error_layout = QtWidgets.QHBoxLayout(box)
        error_layout.setContentsMargins(10, 6, 10, 6)
        error_layout.addWidget(self._error_label)
        return box

    def _make_info(self) -> QtWidgets.QLabel:
        label = _small(QtWidgets.QLabel(), 0.85)
        label.setObjectName("infoLabel")
        label.setForegroundRole(QtGui.QPalette.ColorRole.PlaceholderText)
        return label

    def _make_continue(self) -> QtWidgets.QPushButton:
        button = _small(QtWidgets.QPushButton("Continue"))
        button.setObjectName("continueButton")
        button.setToolTip("Carry on writing this reply from where it ended")
        button.clicked.connect(lambda: self.continueRequested.emit(self.item.message_id))
        return button

    # What the rest of the app (and the tests) read; asking makes the part.
    prev_button = property(lambda self: self._part("prev"))
    version_label = property(lambda self: self._part("version"))
    next_button = property(lambda self: self._part("next"))
    copy_code_button = property(lambda self: self._part("copy_code"))
    regenerate_button = property(lambda self: self._part("regenerate"))
    edit_button = property(lambda self: self._part("edit"))
    attachments = property(lambda self: self._part("attachments"))
    progress_box = property(lambda self: self._part("progress"))
    progress_label = property(lambda self: (self._part("progress"), self._progress_label)[1])
    busy_bar = property(lambda self: (self._part("progress"), self._busy_bar)[1])
    error_box = property(lambda self: self._part("error"))
    error_label = property(lambda self: (self._part("error"), self._error_label)[1])
    info = property(lambda self: self._part("info"))
    continue_button = property(lambda self: self._part("continue"))

    def _show_part(self, name: str, shown: bool) -> QtWidgets.QWidget | None:
        """The part, shown or hidden; one not made yet is made only to be shown."""
        widget = self._part(name) if shown else self._made(name)
        if widget is not None:
            widget.setVisible(shown)
        return widget

    # A message is built with only what most messages show (role, text, toolbar): the
    # thinking, the sources and the editor are made the first time they are needed, as
    # building every part of every message made opening a long chat slow.

    def _build_reasoning(self) -> QtWidgets.QWidget:
        self.reasoning_box = QtWidgets.QWidget()
        self.reasoning_box.hide()
        self.reasoning_toggle = None
        return self.reasoning_box

    def _fill_reasoning(self) -> None:
        """A reasoning model's thinking: a "Thought for N s" toggle over the (collapsed)
        text."""
        if self.reasoning_toggle is not None:
            return
        box = QtWidgets.QVBoxLayout(self.reasoning_box)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(2)
        self.reasoning_toggle = _tool_button("", "Show or hide the model's thinking",
                                             "reasoningToggle")
        self.reasoning_toggle.setCheckable(True)
        self.reasoning_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.reasoning_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.reasoning_toggle.toggled.connect(self._show_reasoning)
        self.reasoning_body = MarkdownBrowser()
        self.reasoning_body.setObjectName("reasoningText")
        self.reasoning_body.setForegroundRole(QtGui.QPalette.ColorRole.PlaceholderText)
        self.reasoning_body.hide()
        box.addWidget(self.reasoning_toggle, 0, Qt.AlignmentFlag.AlignLeft)
        box.addWidget(self.reasoning_body)

    def _show_reasoning(self, shown: bool) -> None:
        self.reasoning_toggle.setArrowType(Qt.ArrowType.DownArrow if shown
                                           else Qt.ArrowType.RightArrow)
        if shown:
            self.reasoning_body.set_markdown(self.item.reasoning)
        self.reasoning_body.setVisible(shown)

    def _build_editor(self) -> QtWidgets.QWidget:
        self.editor_box = QtWidgets.QWidget()
        self.editor_box.hide()
        self.editor = None
        return self.editor_box

    def _fill_editor(self) -> None:
        if self.editor is not None:
            return
        box = QtWidgets.QVBoxLayout(self.editor_box)
        box.setContentsMargins(0, 0, 0, 0)
        # Same keys as the message box below: Enter saves and sends, Shift+Enter is a new
        # line, Esc cancels.
        self.editor = ComposerEdit()
        self.editor.setObjectName("messageEditor")
        self.editor.setPlaceholderText("")
        self.editor.submitted.connect(self._save_edit)
        self.editor.escapePressed.connect(self.stop_editing)
        box.addWidget(self.editor)
        buttons = QtWidgets.QHBoxLayout()
        buttons.addStretch(1)
        self.cancel_edit_button = QtWidgets.QPushButton("Cancel")
        self.cancel_edit_button.setObjectName("cancelEditButton")
        self.save_edit_button = QtWidgets.QPushButton("Save && send")
        self.save_edit_button.setObjectName("saveEditButton")
        buttons.addWidget(self.cancel_edit_button)
        buttons.addWidget(self.save_edit_button)
        box.addLayout(buttons)
        self.cancel_edit_button.clicked.connect(self.stop_editing)
        self.save_edit_button.clicked.connect(self._save_edit)
        self.editor.textChanged.connect(
            lambda: self.save_edit_button.setEnabled(bool(self.editor.toPlainText().strip())))

    def _build_sources(self) -> QtWidgets.QWidget:
        """The passages a reply answered from: "Sources: [1] file, page · [2] …" as links,
        and the box that shows a clicked one's text (a [n] in the reply does the same)."""
        self.sources_box = QtWidgets.QWidget()
        self.sources_box.hide()
        self.sources_label = None
        self._shown_passage = 0
        return self.sources_box

    def _fill_sources(self) -> None:
        if self.sources_label is not None:
            return
        column = QtWidgets.QVBoxLayout(self.sources_box)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(4)
        self.sources_label = _small(QtWidgets.QLabel(), 0.85)
        self.sources_label.setObjectName("sourcesLabel")
        self.sources_label.setWordWrap(True)
        self.sources_label.setTextFormat(Qt.TextFormat.RichText)
        self.sources_label.setTextInteractionFlags(Qt.TextInteractionFlag.LinksAccessibleByMouse
                                                   | Qt.TextInteractionFlag.LinksAccessibleByKeyboard)
        self.sources_label.linkActivated.connect(
            lambda url: self.show_passage(cite_number(url) or 0))
        self.passage_box = _TintedFrame(lambda palette: tint(
            palette, palette.color(QtGui.QPalette.ColorRole.Text), 0.06))
        self.passage_label = QtWidgets.QLabel()
        self.passage_label.setObjectName("citationPassage")
        self.passage_label.setWordWrap(True)
        self.passage_label.setTextFormat(Qt.TextFormat.PlainText)
        self.passage_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        inner = QtWidgets.QVBoxLayout(self.passage_box)
        inner.setContentsMargins(10, 6, 10, 6)
        inner.addWidget(_small(self.passage_label))
        self.passage_box.hide()
        column.addWidget(self.sources_label)
        column.addWidget(self.passage_box)

    def show_passage(self, number: int) -> None:
        """Show passage `number`'s place and text under the reply; the same again hides it."""
        passage = next((p for p in self.item.passages if p.number == number), None)
        if self.sources_label is None:
            return
        if passage is None or (number == self._shown_passage and not self.passage_box.isHidden()):
            self.passage_box.hide()
            self._shown_passage = 0
            return
        self.passage_label.setText(f"[{passage.number}] {passage.where}\n\n{passage.text}")
        self.passage_box.show()
        self._shown_passage = number

    def _apply_sources(self, item: MessageItem) -> None:
        if item.passages:
            self._fill_sources()
        self.sources_box.setVisible(bool(item.passages))
        if self.sources_label is None:
            return
        links = " · ".join(f'<a href="cite:{p.number}">[{p.number}]</a> {html.escape(p.where)}'
                           for p in item.passages)
        self.sources_label.setText(f"Sources: {links}" if links else "")
        if self._shown_passage and not any(p.number == self._shown_passage for p in item.passages):
            self.passage_box.hide()
            self._shown_passage = 0

    # -- showing an item ---------------------------------------------------------------

    @property
    def editing(self) -> bool:
        return not self.editor_box.isHidden()

    def apply(self, item: MessageItem) -> None:
        self.item = item
        live = item.status in LIVE_STATUSES
        self.body.set_markdown(link_citations(item.text, [p.number for p in item.passages]))
        self.body.setVisible(bool(item.text) and not self.editing)
        self._apply_sources(item)
        thinking = bool(item.reasoning or item.reasoning_label)
        if thinking:
            self._fill_reasoning()
        self.reasoning_box.setVisible(thinking)
        if self.reasoning_toggle is not None:
            self.reasoning_toggle.setText(item.reasoning_label)
            if self.reasoning_toggle.isChecked():  # rendered only while shown: it can be long
                self.reasoning_body.set_markdown(item.reasoning)
        if self._show_part("attachments", bool(item.attachments)):
            self.attachments.setText("  ".join(f"▪ {name}" for name in item.attachments))
        waiting = item.status in (QUEUED, PREFILLING) or (
            item.status == STREAMING and not item.text and not item.reasoning)
        if self._show_part("progress", waiting):
            self._progress_label.setText(item.progress or _WAITING_TEXT.get(item.status, ""))
        error = item.error or ("Something went wrong." if item.status == ERROR else "")
        if self._show_part("error", bool(error)):
            self._error_label.setText(error)
        info = self._info_text(item)
        if self._show_part("info", bool(info)):
            self.info.setText(info)
        self._show_part("continue", item.can_continue and not live and not self.editing)
        self._apply_toolbar(item, live)

    @staticmethod
    def _info_text(item: MessageItem) -> str:
        note = {STOPPED: "Stopped", INTERRUPTED: "Interrupted"}.get(item.status, "")
        if item.cut:
            note = "Cut off at the reply length limit"
        if note and note.lower() in item.info.lower():
            note = ""
        return " · ".join(part for part in (note, item.info) if part)

    def _apply_toolbar(self, item: MessageItem, live: bool) -> None:
        versions = item.version_count > 1
        if versions or self._made("version") is not None:
            self.version_label.setText(f"{item.version_index + 1}/{item.version_count}")
            for widget in (self.prev_button, self.version_label, self.next_button):
                widget.setVisible(versions and not self.editing)
            self.prev_button.setEnabled(item.version_index > 0 and not live)
            self.next_button.setEnabled(item.version_index < item.version_count - 1 and not live)
        regenerate = self._made("regenerate")
        if regenerate is not None:
            regenerate.setEnabled(not live)
            # A failed reply offers Retry: the same action, and the failed text stays as a
            # version.
            failed = item.status == ERROR
            regenerate.setText("Retry" if failed else "Regenerate")
            regenerate.setToolTip("Send again; the failed reply stays as an earlier "
                                  "version" if failed else "Write this reply again")
        self.copy_button.setEnabled(bool(item.text))
        code = code_blocks(item.text)
        if code != self._code:
            self._code = code
            if code or self._made("copy_code") is not None:
                self._rebuild_code_menu()
        self._show_part("copy_code", bool(code) and not self.editing)

    def _rebuild_code_menu(self) -> None:
        if self.copy_code_menu is not None:
            self.copy_code_menu.clear()
        if len(self._code) > 1:
            if self.copy_code_menu is None:
                self.copy_code_menu = QtWidgets.QMenu(self)
            for index, code in enumerate(self._code):
                action = self.copy_code_menu.addAction(_code_menu_label(code, index))
                action.triggered.connect(
                    lambda _checked=False, code=code: self.copyRequested.emit(code, "code"))
            self.copy_code_button.setMenu(self.copy_code_menu)
            self.copy_code_button.setPopupMode(
                QtWidgets.QToolButton.ToolButtonPopupMode.InstantPopup)
            self.copy_code_button.setToolTip("Copy one of the code blocks")
        else:
            self.copy_code_button.setMenu(None)
            self.copy_code_button.setToolTip("Copy the code block")

    def code_blocks(self) -> list[str]:
        return list(self._code)

    def _copy_only_code_block(self) -> None:
        if len(self._code) == 1:
            self.copyRequested.emit(self._code[0], "code")

    def _request_version(self, delta: int) -> None:
        self.versionRequested.emit(self.item.message_id, delta)

    # -- inline editing ----------------------------------------------------------------

    def start_editing(self) -> None:
        if self.item.role != "user" or self.editing:
            return
        self._fill_editor()
        self.editor.setPlainText(self.item.text)
        self.editor_box.show()
        self.body.hide()
        for widget in self._parts.values():
            if self._header.indexOf(widget) >= 0:  # the toolbar's buttons
                widget.hide()
        self.editor.setFocus()
        self.editor.moveCursor(QtGui.QTextCursor.MoveOperation.End)

    def stop_editing(self) -> None:
        self.editor_box.hide()
        self.edit_button.show()
        self.copy_button.show()
        self.apply(self.item)

    def _save_edit(self) -> None:
        text = self.editor.toPlainText().strip()
        if text:
            self.stop_editing()
            self.editRequested.emit(self.item.message_id, text)


class MessageView(QtWidgets.QScrollArea):
    """The transcript of the current chat. Feed it `set_messages()` when the chat changes
    and `update_message()` as replies stream; it emits what the person asks for."""

    regenerateRequested = Signal(int)  # message_id
    editRequested = Signal(int, str)  # message_id, new text
    versionRequested = Signal(int, int)  # message_id, delta (-1 | +1)
    continueRequested = Signal(int)  # message_id of a reply to carry on (item.can_continue)
    copied = Signal(str)  # a short status line, e.g. "Copied the code"

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("messageView")
        self.setWidgetResizable(True)
        self.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._widgets: dict[int, MessageWidget] = {}
        self._pending: dict[int, MessageItem] = {}
        self._follow = True
        self._flush_timer = QTimer(self)
        self._flush_timer.setSingleShot(True)
        self._flush_timer.setInterval(FLUSH_INTERVAL_MS)
        self._flush_timer.timeout.connect(self.apply_pending)
        # Long histories: items of every message, widgets for the newest from _built_from on;
        # older widgets are built in slices up to _wanted_from (lowered as the person scrolls
        # up), with the distance from the bottom kept while they are added above.
        self._items: list[MessageItem] = []
        self._index: dict[int, int] = {}  # message id -> position in _items
        self._built_from = 0
        self._wanted_from = 0
        self._build_timer = QTimer(self)
        self._build_timer.setSingleShot(True)
        self._build_timer.setInterval(0)
        self._build_timer.timeout.connect(self._build_some)
        self._anchor: tuple[MessageWidget, int] | None = None  # widget, its y on screen
        self._anchoring = False  # True while the view itself moves the scroll bar
        self._build_page()
        bar = self.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range_changed)
        bar.valueChanged.connect(self._on_scrolled)
        self._warm_up()

    @staticmethod
    def _warm_up() -> None:
        """Build and drop one message widget of each role now, at start-up: the first ones
        cost ~80 ms (PySide creates its flag-enum combinations lazily), which would
        otherwise be a visible stall at the first send. Every part made on first use is made
        here too, for the same reason."""
        for role in ("user", "assistant"):
            widget = MessageWidget(MessageItem(-1, role, "warm-up\n\n```\ncode\n```"))
            for name in (*MessageWidget._TOOLBAR, "attachments", *MessageWidget._LINES,
                         "info", "continue"):
                widget._part(name)
            widget.deleteLater()

    def _build_page(self) -> None:
        page = QtWidgets.QWidget()
        page.setObjectName("messagePage")
        page.setBackgroundRole(QtGui.QPalette.ColorRole.Base)
        page.setAutoFillBackground(True)
        row = QtWidgets.QHBoxLayout(page)
        row.setContentsMargins(12, 12, 12, 12)
        self._column = QtWidgets.QWidget()
        self._column.setMaximumWidth(MAX_TEXT_WIDTH)
        row.addStretch(1)
        row.addWidget(self._column, 1000)  # the column takes the width up to its maximum
        row.addStretch(1)
        self._layout = QtWidgets.QVBoxLayout(self._column)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(10)
        self.placeholder = QtWidgets.QLabel()
        self.placeholder.setObjectName("messagePlaceholder")
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self.placeholder.setForegroundRole(QtGui.QPalette.ColorRole.PlaceholderText)
        self.placeholder.setContentsMargins(0, 48, 0, 0)
        self._layout.addWidget(self.placeholder)
        # Stands in for the messages not built yet (see _reserve_height); shown only while
        # some are left and it is taller than nothing.
        self._reserve = QtWidgets.QWidget()
        self._reserve.setObjectName("unbuiltMessages")
        self._reserve.setFixedHeight(0)
        self._reserve.hide()
        self._layout.addWidget(self._reserve)
        self._layout.addStretch(1)
        self.setWidget(page)
        # Said over the view while the reserve fills much of it (the person jumped far up,
        # e.g. dragged the scroll bar to the top, faster than messages are built): a blank
        # view with no word reads as lost messages. Floats over the viewport, outside the
        # layout, so showing it moves nothing.
        self._loading_notice = QtWidgets.QLabel("Loading earlier messages…", self.viewport())
        self._loading_notice.setObjectName("loadingEarlierMessages")
        self._loading_notice.setForegroundRole(QtGui.QPalette.ColorRole.PlaceholderText)
        self._loading_notice.hide()

    # -- feeding -----------------------------------------------------------------------

    def set_messages(self, items: Sequence[MessageItem]) -> None:
        """Show exactly `items` (a chat was opened); drops updates not yet applied. Only the
        newest messages get widgets now; older ones are built a few at a time, while the
        event loop runs, as far as the person scrolls up (app/ui/message_view.py top)."""
        self._flush_timer.stop()
        self._build_timer.stop()
        self._pending.clear()
        for widget in self._widgets.values():
            self._layout.removeWidget(widget)
            widget.hide()  # gone now, not when the event loop gets to the deferred delete
            widget.deleteLater()
        self._widgets.clear()
        self._anchor = None
        self._set_reserve(0)
        self._items = list(items)
        self._index = {item.message_id: i for i, item in enumerate(self._items)}
        self._built_from = len(self._items)
        self._wanted_from = max(0, len(self._items) - OPEN_TAIL)
        self._set_reserve(self._reserve_height(self._items))
        if self._reserving() and not self.verticalScrollBar().isVisible():
            # Lay the page out now: the scroll bar the reserve needs appears, and the
            # messages built next are built at the width they keep (built at the width
            # without it, each was laid out again in the first frame).
            QtWidgets.QApplication.sendPostedEvents(None, QtCore.QEvent.Type.LayoutRequest.value)
        while self._built_from > max(0, len(self._items) - SYNC_BUILD):
            self._build_older()
        self._update_placeholder()
        self._follow = True
        self.scroll_to_bottom()
        if self._built_from > self._wanted_from:
            self._build_timer.start()

    def update_message(self, item: MessageItem) -> None:
        """Show `item` in place of the message with its id (or after the last one). Cheap:
        the latest item per id is kept and applied by the next timer tick."""
        self._pending[item.message_id] = item
        if not self._flush_timer.isActive():
            self._flush_timer.start()

    def apply_pending(self) -> None:
        """Apply the stored updates now (the timer calls this)."""
        self._flush_timer.stop()
        pending, self._pending = self._pending, {}
        started = time.perf_counter()
        for item in pending.values():
            index = self._index.get(item.message_id)
            if index is None:
                self._index[item.message_id] = len(self._items)
                self._items.append(item)
                self._append(item)
                continue
            self._items[index] = item
            widget = self._widgets.get(item.message_id)
            if widget is not None:  # one not built yet is built from its latest item
                widget.apply(item)
        self._update_placeholder()
        self._pace((time.perf_counter() - started) * 1000)

    def _pace(self, own_ms: float) -> None:
        """Set the wait before the next update from what the last one cost the GUI thread.
        A streaming reply re-renders only its tail (app/ui/markdown_render.py), but laying
        out and painting a long message still grows with it (a 1,500-token reply: ~5 ms an
        update by its end, the GUI thread at ~19% of a core at display pace), and on a
        2-core machine every millisecond the GUI thread spends is taken from the engine's
        threads. So an update's cost is its own work plus the measuring and painting of
        the transcript's text since the last one (`RENDER_METER`), and the wait keeps it
        near STREAM_CPU_SHARE of a core: never faster than the display's pace, never slower
        than SHARED_FLUSH_INTERVAL_MS for that; an update that is itself expensive waits
        longer (6x its own time, whose layout costs about as much again), up to
        MAX_FLUSH_INTERVAL_MS."""
        shared = min(SHARED_FLUSH_INTERVAL_MS, (own_ms + RENDER_METER.take()) / STREAM_CPU_SHARE)
        wait = max(FLUSH_INTERVAL_MS, shared, 6 * own_ms)
        self._flush_timer.setInterval(int(min(MAX_FLUSH_INTERVAL_MS, wait)))

    def clear(self) -> None:
        self.set_messages([])

    def set_placeholder(self, text: str) -> None:
        """What an empty chat shows, e.g. "Start the conversation below"."""
        self.placeholder.setText(text)
        self._update_placeholder()

    def message_widget(self, message_id: int) -> MessageWidget | None:
        """The widget of a message; None for one not shown, or older than what is built
        (one built but not placed yet, see _build_some, counts as not built)."""
        index = self._index.get(message_id)
        if index is None or index < self._built_from:
            return None
        return self._widgets.get(message_id)

    def message_ids(self) -> list[int]:
        """Every message shown, oldest first (built or not yet)."""
        return [item.message_id for item in self._items]

    def built_count(self) -> int:
        """How many of the messages have widgets in place (the newest ones; one built on
        this turn of the event loop is placed on the next)."""
        return len(self._items) - self._built_from

    def _new_widget(self, item: MessageItem) -> MessageWidget:
        widget = MessageWidget(item)
        # At the column's width from the start: laid out (and its text measured) at a
        # default 640 px first, it would be measured again at each width on its way here.
        widget.resize(self._column.width(), widget.height())
        widget.copyRequested.connect(self._copy)
        widget.regenerateRequested.connect(self.regenerateRequested)
        widget.editRequested.connect(self.editRequested)
        widget.versionRequested.connect(self.versionRequested)
        widget.continueRequested.connect(self.continueRequested)
        self._widgets[item.message_id] = widget
        return widget

    def _append(self, item: MessageItem) -> None:
        widget = self._new_widget(item)
        self._layout.insertWidget(self._layout.count() - 1, widget)  # before the stretch
        widget.show()  # now, not on the layout's next pass: callers may look at it at once

    def _build_older(self) -> None:
        """Build the widget of the newest message that has none (or place the one built
        already, see _build_some), above the built ones, taking its room out of the reserve."""
        self._built_from -= 1
        item = self._items[self._built_from]
        widget = self._widgets.get(item.message_id) or self._new_widget(item)
        self._layout.insertWidget(2, widget)  # after the placeholder and the reserve
        widget.show()
        if self._reserving():
            # What the layout will give it: nothing below moves while the reserve lasts. The
            # last message built takes the whole rest (an estimate is never exact).
            taken = widget.heightForWidth(self._column.width()) + self._layout.spacing()
            self._set_reserve(self._reserve.height() - taken if self._built_from else 0)

    # -- the reserve for messages not built yet ------------------------------------------

    def _reserve_height(self, items: Sequence[MessageItem]) -> int:
        """About how tall `items` will be as message widgets at the column's width, spacing
        included: a line per line break and per line's worth of characters at the font's
        average character width (a code line, a blank line and a wrapped line alike are a
        line; C-level counts, as it reads every message of the chat), plus the header and
        margins."""
        metrics = self.fontMetrics()
        width = self._column.width() or MAX_TEXT_WIDTH
        per_line = max(20, (width - 2 * 12 - 4) // max(1, metrics.averageCharWidth()))
        line = metrics.lineSpacing()
        frame = 8 + 8 + 4 + 4 + max(line, 22)  # margins, spacing, document margin, header
        lines = sum(item.text.count("\n") + 1 + len(item.text) // per_line for item in items)
        return len(items) * (frame + self._layout.spacing()) + lines * line

    def _reserving(self) -> bool:
        """Whether the reserve stands in for unbuilt messages. Its own flag, not
        `isVisible()`: that is False while the window is not shown yet (a chat opened at
        start-up), which once left a built chat's reserve standing, blank, above it."""
        return not self._reserve.isHidden()

    def _set_reserve(self, height: int) -> None:
        height = max(0, height)
        self._reserve.setFixedHeight(height)
        self._reserve.setVisible(height > 0 and self._built_from > 0)
        self._update_loading_notice()

    def _reserve_on_screen(self) -> int:
        """How many pixels of the viewport the reserve fills now."""
        if not self._reserving():
            return 0
        top = self.verticalScrollBar().value()
        bottom = top + self.viewport().height()
        reserve_top = self._reserve.mapTo(self.widget(), QtCore.QPoint(0, 0)).y()
        # Its height as set (the geometry catches up on the layout's next pass).
        reserve_bottom = reserve_top + self._reserve.minimumHeight()
        return max(0, min(bottom, reserve_bottom) - max(top, reserve_top))

    def _update_loading_notice(self) -> None:
        """Show the notice while the reserve fills a third of the view or more (a sliver
        of it at the top, while building catches up with a scroll, is not worth a word)."""
        notice = self._loading_notice
        show = self._reserve_on_screen() * 3 >= self.viewport().height() > 0
        if show:
            notice.adjustSize()
            notice.move((self.viewport().width() - notice.width()) // 2, 24)
        if show == notice.isHidden():  # (its own flag: see _reserving)
            notice.setVisible(show)

    def _build_some(self) -> None:
        """One slice of building older messages (the timer calls this): half a message.
        One turn constructs the next older message's widget, the next turn places it (its
        layout pass and paint follow), so the person's input runs between the halves."""
        if not self._follow and self._anchor is None and self._widgets:
            # Keep what the person reads in place as content grows above it: the oldest
            # built message stays where it is on screen.
            widget = self._widgets[self._items[self._built_from].message_id]
            self._anchor = (widget, widget.mapTo(self.viewport(), QtCore.QPoint(0, 0)).y())
            widget.installEventFilter(self)  # its moves (the layout's passes) re-anchor
        if self._built_from > self._wanted_from:
            item = self._items[self._built_from - 1]
            if item.message_id not in self._widgets:
                self._new_widget(item)  # not in the layout yet; placed on the next turn
            else:
                self._build_older()
        if self._built_from > self._wanted_from:
            self._build_timer.start()
        elif self._built_from > 0 and self.verticalScrollBar().value() < self._near_top():
            self._want_older()  # the view still reaches into the reserve: carry on

    def _want_older(self) -> None:
        """Near the top of what is built: build a page more of the older messages."""
        wanted = max(0, self._built_from - PAGE_BUILD)
        if wanted < self._wanted_from:
            self._wanted_from = wanted
            if not self._build_timer.isActive():
                self._build_timer.start()

    def _update_placeholder(self) -> None:
        self.placeholder.setVisible(not self._widgets and bool(self.placeholder.text()))

    def _copy(self, text: str, what: str) -> None:
        QtGui.QGuiApplication.clipboard().setText(text)
        self.copied.emit("Copied the code" if what == "code" else "Copied the message")

    # -- following the stream ----------------------------------------------------------

    def is_at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - BOTTOM_SLACK_PX

    def scroll_to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _on_scrolled(self, value: int) -> None:
        self._follow = self.is_at_bottom()
        if not self._anchoring and self._anchor is not None:
            self._anchor[0].removeEventFilter(self)
            self._anchor = None  # the person scrolled: where they are now counts
        if value < self._near_top():
            self._want_older()
        self._update_loading_notice()

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        # The content grew (or the view resized): stay at the bottom if we were there; keep
        # the place read when older messages were built above it.
        bar = self.verticalScrollBar()
        if self._follow:
            bar.setValue(maximum)
        elif self._anchor is not None:
            self._keep_anchor()
        if bar.value() < self._near_top():
            self._want_older()  # e.g. the built messages do not fill the view yet
        self._update_loading_notice()

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:
        super().resizeEvent(event)
        self._update_loading_notice()

    def _keep_anchor(self) -> None:
        widget, on_screen = self._anchor
        self._anchoring = True
        self.verticalScrollBar().setValue(
            widget.mapTo(self.widget(), QtCore.QPoint(0, 0)).y() - on_screen)
        self._anchoring = False

    def eventFilter(self, watched: QtCore.QObject, event: QtCore.QEvent) -> bool:
        if (self._anchor is not None and watched is self._anchor[0] and not self._follow
                and event.type() == QtCore.QEvent.Type.Move):
            self._keep_anchor()
        return super().eventFilter(watched, event)

    def _near_top(self) -> int:
        """Scrolled above this, the view is within a screen of the oldest message built
        (the reserve for the others is above it): older ones are wanted."""
        top = self._reserve.height() if self._reserving() else 0
        return top + self.viewport().height()

