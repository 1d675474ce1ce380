"""The samples in a batch (runtime/data.py's _batch_len), asked for every batch handed out: its
quick path for the usual batch must count what the walk over the whole batch counts."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.errors import PhalanxError
from phalanx.runtime.data import _batch_len, _walked_batch_len

Pair = namedtuple("Pair", "a b")

_LEAF = st.one_of(
    st.integers(0, 4).map(lambda n: torch.zeros(n, 2)),
    st.just(torch.tensor(1.0)),  # no batch dimension
    st.lists(st.integers(), max_size=3),
    st.text(max_size=3),
    st.integers(),
)
_BATCH = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.tuples(inner, inner).map(lambda ab: Pair(*ab)),
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(batch=_BATCH)
def test_the_quick_path_counts_what_the_walk_counts(batch):
    try:
        want = _walked_batch_len(batch)
    except PhalanxError:
        with pytest.raises(PhalanxError, match="cannot tell the batch size"):
            _batch_len(batch)
        return
    assert _batch_len(batch) == want
