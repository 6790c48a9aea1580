"""What the widgets draw with besides the palette itself: the app icon, and the few colours
derived from the palette (tints, the error colour), so light and dark themes both work."""

from __future__ import annotations

from pathlib import Path

from app.paths import bundle_dir
from app.ui.qt import QtCore, QtGui


def resources_dir() -> Path:
    """resources/ next to the `app` package, or inside a PyInstaller bundle (sys._MEIPASS)."""
    bundle = bundle_dir()
    if bundle is not None:
        return bundle / "resources"
    return Path(__file__).resolve().parents[2] / "resources"


def icon_path() -> Path:
    """The 256x256 PNG app icon (rendered from icon.svg by scripts/make_icon.py)."""
    return resources_dir() / "icon.png"


def app_icon() -> QtGui.QIcon:
    """The app icon: the SVG where Qt can render SVG (sharp at every size), plus the PNG.
    An empty icon if the files are missing (e.g. a wheel install without resources/)."""
    icon = QtGui.QIcon()
    svg = resources_dir() / "icon.svg"
    if svg.is_file() and b"svg" in QtGui.QImageReader.supportedImageFormats():
        icon.addFile(str(svg))
    if icon_path().is_file():
        icon.addFile(str(icon_path()))
    return icon


def blend(a: QtGui.QColor, b: QtGui.QColor, amount: float) -> QtGui.QColor:
    """`a` moved `amount` (0..1) of the way towards `b`."""
    return QtGui.QColor.fromRgbF(
        a.redF() + (b.redF() - a.redF()) * amount,
        a.greenF() + (b.greenF() - a.greenF()) * amount,
        a.blueF() + (b.blueF() - a.blueF()) * amount,
        1.0,
    )


def is_dark(palette: QtGui.QPalette) -> bool:
    return palette.color(QtGui.QPalette.ColorRole.Base).lightnessF() < 0.5


def danger_color(palette: QtGui.QPalette) -> QtGui.QColor:
    """Red for errors and warnings, readable on the palette's base colour."""
    return QtGui.QColor("#ff8a80") if is_dark(palette) else QtGui.QColor("#c62828")


def tint(palette: QtGui.QPalette, towards: QtGui.QColor, amount: float) -> QtGui.QColor:
    """The palette's base colour with a little of `towards` mixed in (backgrounds)."""
    return blend(palette.color(QtGui.QPalette.ColorRole.Base), towards, amount)


_PIN_ICON: QtGui.QIcon | None = None


def pin_icon() -> QtGui.QIcon:
    """A drawn pushpin for pinned chats (an emoji needs an emoji font, which many Linux
    desktops lack: it showed as an empty box). Drawn once, at two sizes for HiDPI."""
    global _PIN_ICON
    if _PIN_ICON is None:
        icon = QtGui.QIcon()
        for size in (16, 32):
            icon.addPixmap(_pin_pixmap(size))
        _PIN_ICON = icon
    return _PIN_ICON


def _pin_pixmap(size: int) -> QtGui.QPixmap:
    pixmap = QtGui.QPixmap(size, size)
    pixmap.fill(QtGui.QColor(0, 0, 0, 0))
    painter = QtGui.QPainter(pixmap)
    painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
    painter.scale(size / 16, size / 16)
    painter.translate(8, 8)
    painter.rotate(45)  # a pin stuck in at an angle
    painter.setPen(QtGui.QPen(QtGui.QColor("#6b6b6b"), 1.2))
    painter.drawLine(QtCore.QPointF(0, 1), QtCore.QPointF(0, 7.5))  # the needle
    painter.setPen(QtCore.Qt.PenStyle.NoPen)
    painter.setBrush(QtGui.QColor("#d64545"))
    painter.drawRoundedRect(QtCore.QRectF(-3.5, -7, 7, 3), 1, 1)  # the head
    painter.drawRect(QtCore.QRectF(-2, -4.5, 4, 4))  # the body
    painter.drawRoundedRect(QtCore.QRectF(-4.5, -1, 9, 2), 1, 1)  # the collar
    painter.end()
    return pixmap
