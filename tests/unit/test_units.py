"""util/units.format_bytes: the one byte formatter, as reports show sizes and as the Session's
console line shows them (always one decimal)."""

from __future__ import annotations

import pytest

from phalanx.util.units import format_bytes

KIB, MIB, GIB = 2**10, 2**20, 2**30


@pytest.mark.parametrize(
    "n, text",
    [(None, "unknown"), (0, "0 B"), (576, "576 B"), (KIB, "1 KiB"), (1536, "1.5 KiB"), (4 * MIB, "4 MiB")],
)
def test_reports_drop_the_decimal_of_a_whole_value(n, text):
    assert format_bytes(n) == text
    assert format_bytes(3 * GIB) == "3 GiB"


@pytest.mark.parametrize("n, text", [(576, "576 B"), (4_198_400, "4.0 MiB"), (605_224, "591.0 KiB"), (KIB, "1.0 KiB")])
def test_the_sessions_line_always_has_one_decimal(n, text):
    assert format_bytes(n, decimals=1) == text


def test_a_fixed_unit():
    assert format_bytes(300 * MIB + MIB // 2, unit="MiB", decimals=1) == "300.5 MiB"
    assert format_bytes(2 * GIB, unit="MiB", decimals=1) == "2048.0 MiB"
    assert format_bytes(KIB // 2, unit="MiB") == "0.0 MiB"
