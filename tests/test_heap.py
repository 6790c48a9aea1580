"""Handing freed memory back to the system (glibc's malloc_trim; a no-op elsewhere)."""

from __future__ import annotations

import sys

import pytest

from app import heap


def test_freed_memory_goes_back_where_the_c_library_can():
    released = heap.release_freed_memory()
    if sys.platform.startswith("linux") and heap._MALLOC_TRIM is not None:
        assert released is True
    else:
        assert released is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_glibc_has_the_call():
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert heap._MALLOC_TRIM is not None
