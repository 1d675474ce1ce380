"""The metrics thread (metrics/rows.py): rows in flush order, every flushed row in ``records`` when
asked, and an error writing them raised on the training thread, at the next flush or at close."""

from __future__ import annotations

import json
import math
import threading
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.metrics.rows import FIELDS, RowWriter, json_lines
from tests.helpers.metrics import pending_records


@settings(max_examples=25, deadline=None)
@given(flush_sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8))
def test_rows_keep_their_order_and_read_the_losses(flush_sizes, tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rank0.jsonl"
    records: deque = deque()
    with open(path, "w", encoding="utf-8") as file:
        writer = RowWriter(records, file, None, torch.device("cpu"))
        start = 0
        for size in flush_sizes:
            writer.submit(pending_records(range(start, start + size)), {})
            start += size
        writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in lines] == list(range(start))
    assert [row["loss"] for row in lines] == [float(s) for s in range(start)]
    assert list(records) == lines


class _Broken:
    def write(self, text: str) -> None:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass


def test_a_write_error_reaches_the_training_thread():
    writer = RowWriter(deque(), _Broken(), None, torch.device("cpu"))
    writer.submit(pending_records(range(3)), {})
    with pytest.raises(OSError, match="No space left"):
        writer.drain()
    writer.close()


def test_rows_are_written_off_the_calling_thread():
    seen: list[str] = []

    class Recording(_Broken):
        def write(self, text: str) -> None:
            seen.append(threading.current_thread().name)

    writer = RowWriter(deque(), Recording(), None, torch.device("cpu"))
    writer.submit(pending_records(range(2)), {})
    writer.close()
    assert seen and all(name.startswith("phalanx-metrics") for name in seen)


def test_an_error_of_an_earlier_flush_is_not_lost_behind_a_later_one():
    """The first flush fails while the second is queued behind it: the error still reaches the caller."""
    queued = threading.Event()

    class FailsOnce(_Broken):
        calls = 0

        def write(self, text: str) -> None:
            FailsOnce.calls += 1
            if FailsOnce.calls == 1:
                queued.wait(timeout=30)  # still writing when the second flush is handed over
                raise OSError(28, "No space left on device")

    writer = RowWriter(deque(), FailsOnce(), None, torch.device("cpu"))
    writer.submit(pending_records(range(2)), {})
    writer.submit(pending_records(range(2, 4)), {})
    queued.set()
    with pytest.raises(OSError, match="No space left"):
        writer.drain()
    writer.close()


_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False, allow_infinity=False),
)


_TEXT = st.text(max_size=8).flatmap(lambda s: st.sampled_from([s, s + ", ", s + "], [", '"' + s, s + "}, {"]))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.lists(_VALUE, min_size=len(FIELDS), max_size=len(FIELDS)), max_size=20),
    text=st.one_of(st.none(), _TEXT),
    at=st.integers(0, 10**6),
)
def test_json_lines_is_json_dumps_per_row(rows, text, at):
    """Encoding a flush's rows in one call gives the very text of one json.dumps per row, also where
    a value is text that looks like a separator (no field holds text today)."""
    if text is not None and rows:
        rows[at % len(rows)][at % len(FIELDS)] = text
    want = "".join(json.dumps(dict(zip(FIELDS, row))) + "\n" for row in rows)
    assert json_lines(rows) == want


@settings(max_examples=50, deadline=None)
@given(
    loss=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()),
    lr=st.floats(allow_nan=True, allow_infinity=True),
    as_tensor=st.booleans(),
)
def test_numbers_that_are_not_finite_are_written_as_null(loss, lr, as_tensor, tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rank0.jsonl"
    row = {**dict.fromkeys(FIELDS), "step": 0, "lr": lr, "noise_estimated": False}
    row["loss"] = torch.tensor(loss, dtype=torch.float64) if as_tensor and loss is not None else loss
    records: deque = deque()
    with open(path, "w", encoding="utf-8") as file:
        writer = RowWriter(records, file, None, torch.device("cpu"))
        writer.submit([tuple(row[f] for f in FIELDS)], {})
        writer.close()
    written = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    finite = [v if v is not None and math.isfinite(v) else None for v in (loss, lr)]
    assert [written["loss"], written["lr"]] == finite
    assert [records[0]["loss"], records[0]["lr"]] == finite
