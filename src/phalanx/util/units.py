"""Byte sizes and rates, as people write them (``4K``, ``64M``) and as reports show them."""

from __future__ import annotations

from phalanx.config.sizes import GIB, KIB, MIB, size_bytes
from phalanx.errors import PhalanxError


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096; K, M and G are powers of 1024 (``KiB``, ``MB`` and ``KB`` read the same)."""
    size = size_bytes(text)
    if size is None:
        raise PhalanxError(f"'{text}' is not a size; write a number of bytes with an optional K, M or G, e.g. 4K or 64M")
    return size


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def format_rate(bytes_per_second: float | None) -> str:
    """Powers of 1000, as nccl-tests report bandwidth; MB/s below 1 GB/s so small sizes do not read 0.00."""
    if bytes_per_second is None:
        return "-"
    if bytes_per_second < 1e9:
        return f"{bytes_per_second / 1e6:.1f} MB/s"
    return f"{bytes_per_second / 1e9:.2f} GB/s"


def format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
