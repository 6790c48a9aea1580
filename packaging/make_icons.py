"""Make the platform icons the packagers need from the app icon: resources/icon.ico (Windows)
and resources/icon.icns (macOS). Build-time only: needs Pillow (packaging/requirements-build.txt).

    QT_QPA_PLATFORM=offscreen python packaging/make_icons.py          # (re)write both
    python packaging/make_icons.py --if-missing                       # what build.py runs

The master image is resources/icon.svg rendered by Qt at 1024x1024 (sharp at every size);
where Qt cannot render SVG it falls back to resources/icon.png (256x256, upscaled for the
512/1024 icns slots). Commit the results; run again after changing the icon.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESOURCES = ROOT / "resources"
ICO_SIZES = [16, 24, 32, 48, 64, 128, 256]
ICNS_SIZES = [16, 32, 64, 128, 256, 512, 1024]
MASTER = 1024


def _render_svg(svg: Path, size: int) -> bytes | None:
    """PNG bytes of the SVG rendered by Qt, or None where Qt (or its SVG plugin) is missing."""
    try:
        from PySide6 import QtCore, QtGui
    except ImportError:
        return None
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    app = QtGui.QGuiApplication.instance() or QtGui.QGuiApplication(sys.argv[:1])  # noqa: F841
    reader = QtGui.QImageReader(str(svg))
    reader.setScaledSize(QtCore.QSize(size, size))
    image = reader.read()
    if image.isNull():
        return None
    buf = QtCore.QBuffer()
    buf.open(QtCore.QIODevice.OpenModeFlag.WriteOnly)
    image.save(buf, "PNG")
    return bytes(buf.data())


def master_image(resources: Path = RESOURCES):
    from PIL import Image

    svg, png = resources / "icon.svg", resources / "icon.png"
    data = _render_svg(svg, MASTER) if svg.is_file() else None
    if data is not None:
        return Image.open(io.BytesIO(data)).convert("RGBA")
    if not png.is_file():
        raise SystemExit(f"no app icon: neither {svg} nor {png} exists")
    return Image.open(png).convert("RGBA").resize((MASTER, MASTER), Image.Resampling.LANCZOS)


def write_icons(resources: Path = RESOURCES, only_missing: bool = False) -> list[Path]:
    ico, icns = resources / "icon.ico", resources / "icon.icns"
    wanted = [p for p in (ico, icns) if not (only_missing and p.is_file())]
    if not wanted:
        return []
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit("Pillow is needed to make the icons: "
                         "pip install -r packaging/requirements-build.txt") from None
    master = master_image(resources)
    if ico in wanted:
        master.save(ico, format="ICO", sizes=[(s, s) for s in ICO_SIZES])
    if icns in wanted:
        # Pillow picks each icns slot from the images given, resizing the nearest larger one.
        images = [master.resize((s, s), Image.Resampling.LANCZOS) for s in ICNS_SIZES[:-1]]
        master.save(icns, format="ICNS", append_images=images)
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--if-missing", action="store_true",
                        help="only write the icons that do not exist yet")
    args = parser.parse_args(argv)
    for path in write_icons(only_missing=args.if_missing):
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
