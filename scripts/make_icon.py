"""Render resources/icon.svg to the 256x256 resources/icon.png the app and the packagers use.

Run after editing the SVG:  QT_QPA_PLATFORM=offscreen python scripts/make_icon.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.ui.qt import QtCore, QtGui  # noqa: E402

RESOURCES = Path(__file__).resolve().parents[1] / "resources"
SIZE = 256


def render(svg: Path, png: Path, size: int = SIZE) -> None:
    reader = QtGui.QImageReader(str(svg))
    reader.setScaledSize(QtCore.QSize(size, size))
    image = reader.read()
    if image.isNull():
        raise SystemExit(f"could not render {svg}: {reader.errorString()}")
    if not image.save(str(png)):
        raise SystemExit(f"could not write {png}")


def main() -> None:
    app = QtGui.QGuiApplication(sys.argv)  # noqa: F841 (image plugins need an application)
    render(RESOURCES / "icon.svg", RESOURCES / "icon.png")
    print(f"wrote {RESOURCES / 'icon.png'}")


if __name__ == "__main__":
    main()
