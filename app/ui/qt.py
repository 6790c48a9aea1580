"""Every Qt import in the app goes through this module (one place to change bindings or
versions; a test checks no other module imports PySide6 directly)."""

from PySide6 import QtCore, QtGui, QtWidgets  # noqa: F401
from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot  # noqa: F401
