"""Byte sizes and rates, as people write them (``4K``, ``64M``) and as reports show them."""

from __future__ import annotations

from phalanx.errors import PhalanxError
from phalanx.util.sizes import GIB, KIB, MIB, size_bytes


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096; K, M and G are powers of 1024 (``KiB``, ``MB`` and ``KB`` read the same)."""
    size = size_bytes(text)
    if size is None:
        raise PhalanxError(
            f"'{text}' is not a size; write a number of bytes with an optional K, M or G, e.g. 4K or 64M"
        )
    return size


_UNITS = {"GiB": GIB, "MiB": MIB, "KiB": KIB, "B": 1}


def format_bytes(n: int | float | None, *, decimals: int | None = None, unit: str | None = None) -> str:
    """``n`` in the largest binary unit it reaches (or in ``unit``). ``decimals`` None: one decimal,
    none for a whole value ("4 MiB", "3.5 MiB"); a number: always that many ("4.0 MiB"), as the
    Session's announcement shows sizes. Bytes are always whole ("576 B")."""
    if n is None:
        return "unknown"
    if unit is None:
        unit = next((name for name, scale in _UNITS.items() if n >= scale), "B")
    if unit == "B":
        return f"{int(n)} B"
    value = n / _UNITS[unit]
    if decimals is None:
        return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{value:.{decimals}f} {unit}"


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
