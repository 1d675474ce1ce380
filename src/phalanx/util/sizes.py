"""Byte sizes as people write them: ``4K``, ``64M``, ``2GiB``, ``1.5G``, or a plain number of bytes."""

from __future__ import annotations

import re

KIB = 1024
MIB = 1024**2
GIB = 1024**3

_SUFFIX = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": 1024 * GIB}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def size_bytes(text: str) -> int | None:
    """``"4K"`` -> 4096, ``"2GiB"`` -> 2147483648; None when ``text`` is not a size. K, M, G and T
    are powers of 1024 (``KiB``, ``MB`` and ``KB`` read the same)."""
    match = _SIZE.match(text)
    if not match:
        return None
    return int(float(match.group(1)) * _SUFFIX[match.group(2).upper()])
