"""The parallel layout (strategies/parallel_layout.py) over any world and axis sizes: the axes
multiply to the world, a rank's coordinates and its rank are one another's inverse, every axis's
groups partition the ranks, tensor peers are neighbours in rank order and share a random stream,
and every data-parallel share is held by exactly the tensor and pipeline peers. Each registered
strategy lays a world out on its own axes; what cannot be laid out is refused in one line."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import Config
from phalanx.errors import ConfigError
from phalanx.strategies import check_combination
from phalanx.strategies.parallel_layout import AXES, DATA_AXES, ParallelLayout
from phalanx.strategies.registry import STRATEGIES

SIZES = st.integers(min_value=1, max_value=4)


@st.composite
def layouts(draw) -> tuple[ParallelLayout, dict[str, int]]:
    """A layout from drawn axis sizes, and the sizes asked for: built by ``of`` (one data axis), or
    directly with both data axes (replicas of sharded groups)."""
    if draw(st.booleans()):
        sizes = {axis: draw(SIZES) for axis in AXES}
        return ParallelLayout(**sizes), sizes
    tp, pp, data = draw(SIZES), draw(SIZES), draw(SIZES)
    axis = draw(st.sampled_from(DATA_AXES))
    layout = ParallelLayout.of(tp * pp * data, data_axis=axis, tp=tp, pp=pp)
    return layout, {"tp": tp, "pp": pp, axis: data}


def _one_line_refusal(excinfo) -> str:
    message = str(excinfo.value)
    assert excinfo.type is ConfigError
    assert message and "\n" not in message, message
    return message


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_the_axes_multiply_to_the_world_and_take_the_sizes_asked(drawn):
    layout, asked = drawn
    assert layout.world_size == asked["tp"] * asked["pp"] * asked.get("dp_replicate", 1) * asked.get("dp_shard", 1)
    for axis in AXES:
        assert layout.size(axis) == asked.get(axis, 1), axis
    assert layout.dp_size == layout.world_size // (layout.tp * layout.pp)
    assert layout.used == tuple(a for a in AXES if asked.get(a, 1) > 1)
    assert layout.describe().count(" x ") == max(0, len(layout.used) - 1)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_coordinates_and_rank_at_are_inverses(drawn):
    layout, _ = drawn
    seen = set()
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        assert list(coords) == list(AXES)
        assert all(0 <= coords[a] < layout.size(a) for a in AXES)
        assert layout.rank_at(coords) == rank
        seen.add(tuple(coords.values()))
    assert len(seen) == layout.world_size  # every rank its own place
    for outside in (-1, layout.world_size):
        with pytest.raises(ValueError):
            layout.coordinates(outside)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_axis_partitions_the_ranks_into_groups_of_its_size(drawn):
    layout, _ = drawn
    for axis in AXES:
        groups = layout.groups(axis)
        assert len(groups) == layout.world_size // layout.size(axis)
        assert all(len(g) == layout.size(axis) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        for rank in range(layout.world_size):
            group = layout.group(axis, rank)
            assert rank in group and group in groups
            # The members differ from the rank along this axis alone.
            here = layout.coordinates(rank)
            for member in group:
                there = layout.coordinates(member)
                assert {a: there[a] for a in AXES if a != axis} == {a: here[a] for a in AXES if a != axis}


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_tensor_peers_are_consecutive_ranks(drawn):
    layout, _ = drawn
    for group in layout.groups("tp"):
        assert group == list(range(group[0], group[0] + layout.tp))
        assert group[0] % layout.tp == 0


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_each_data_parallel_share_is_held_by_the_tensor_and_pipeline_peers(drawn):
    layout, _ = drawn
    shares = Counter(layout.dp_rank(rank) for rank in range(layout.world_size))
    assert sorted(shares) == list(range(layout.dp_size))
    assert set(shares.values()) == {layout.tp * layout.pp}
    for group in layout.groups("tp") + layout.groups("pp"):  # peers that see the same batch
        assert len({layout.dp_rank(r) for r in group}) == 1
    for axis in DATA_AXES:  # ranks along a data axis take different shares
        for group in layout.groups(axis):
            assert len({layout.dp_rank(r) for r in group}) == len(group)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_the_seed_rank_is_shared_exactly_by_tensor_peers(drawn):
    layout, _ = drawn
    peers = {r: frozenset(layout.group("tp", r)) for r in range(layout.world_size)}
    for a in range(layout.world_size):
        for b in range(layout.world_size):
            assert (layout.seed_rank(a) == layout.seed_rank(b)) == (b in peers[a]), (a, b)


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(min_value=1, max_value=64),
    tp=st.integers(min_value=1, max_value=9),
    pp=st.integers(min_value=1, max_value=4),
)
def test_sizes_that_do_not_divide_the_world_are_refused_in_one_line(world, tp, pp):
    if world % (tp * pp) == 0:
        layout = ParallelLayout.of(world, tp=tp, pp=pp)
        assert layout.world_size == world and layout.dp_replicate == world // (tp * pp)
        return
    with pytest.raises(ConfigError) as excinfo:
        ParallelLayout.of(world, tp=tp, pp=pp)
    message = _one_line_refusal(excinfo)
    assert f"{world} process" in message
    if tp > 1:
        assert f"strategy.tp.size {tp}" in message


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(min_value=2, max_value=8), nodes=st.integers(min_value=1, max_value=4), data=st.data())
def test_tensor_peers_across_nodes_are_refused_in_one_line(tp, nodes, data):
    per_node = data.draw(st.integers(min_value=1, max_value=16))
    world = per_node * nodes
    if world % tp:
        return  # the world's own refusal, above
    if per_node % tp == 0:
        layout = ParallelLayout.of(world, tp=tp, per_node=per_node)
        for group in layout.groups("tp"):  # the launcher numbers ranks node by node
            assert len({r // per_node for r in group}) == 1
        return
    with pytest.raises(ConfigError) as excinfo:
        ParallelLayout.of(world, tp=tp, per_node=per_node)
    message = _one_line_refusal(excinfo)
    assert f"strategy.tp.size {tp}" in message and f"{per_node} processes per node" in message


@pytest.mark.parametrize("sizes", [{"world_size": 0}, {"world_size": 4, "tp": 0}, {"world_size": 4, "pp": -1}])
def test_sizes_below_one_are_refused_in_one_line(sizes):
    world = sizes.pop("world_size")
    with pytest.raises(ConfigError) as excinfo:
        ParallelLayout.of(world, **sizes)
    _one_line_refusal(excinfo)


def test_only_a_data_axis_takes_the_data():
    with pytest.raises(ValueError, match="data_axis"):
        ParallelLayout.of(4, data_axis="tp")


def test_describe_names_the_axes_used():
    assert ParallelLayout.of(1).describe() == "1 process"
    assert (
        ParallelLayout.of(4, data_axis="dp_shard", tp=2).describe() == "2 data-parallel (sharded) x 2 tensor-parallel"
    )
    assert ParallelLayout.of(8, tp=2, pp=2).describe() == "2 pipeline x 2 data-parallel x 2 tensor-parallel"


# -- each strategy's layout -----------------------------------------------------------------


def _worlds(cls) -> list[int]:
    return [cls.processes_per_node] if cls.processes_per_node is not None else [1, 2, 4, 6]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_lays_out_its_world_on_its_own_axes(name):
    cls = STRATEGIES[name]
    for world in _worlds(cls):
        layout = cls.layout_for(Config(strategy={"name": name}), world)
        assert layout.world_size == world
        assert set(layout.used) <= set(cls.axes), (name, world, layout)
        if "pp" in cls.axes:  # every rank a stage: one data-parallel share
            assert (layout.pp, layout.dp_size) == (world, 1)
        elif cls.tp_by_default:  # strategy tp: every process a tensor peer, unless told otherwise
            assert (layout.tp, layout.dp_size) == (world, 1)
        else:  # the data axis takes every process
            data = next(a for a in cls.axes if a in DATA_AXES)
            assert layout.size(data) == world and layout.dp_size == world and layout.tp == 1


@pytest.mark.parametrize(
    "name, world, per_node, tp, expected",
    [
        ("tp", 4, None, None, {"tp": 4}),
        ("tp", 4, 2, None, {"dp_replicate": 2, "tp": 2}),  # null: every process of the node
        ("tp", 4, None, 2, {"dp_replicate": 2, "tp": 2}),
        ("tp", 2, None, 1, {"dp_replicate": 2}),
        ("fsdp", 4, None, None, {"dp_shard": 4}),
        ("fsdp", 4, 4, 2, {"dp_shard": 2, "tp": 2}),
        ("fsdp", 8, 4, 4, {"dp_shard": 2, "tp": 4}),
        ("ddp", 4, None, 1, {"dp_replicate": 4}),
    ],
)
def test_strategy_tp_size_under_the_strategies_that_hold_it(name, world, per_node, tp, expected):
    config = Config(strategy={"name": name, "tp": {"size": tp}})
    layout = STRATEGIES[name].layout_for(config, world, per_node)
    assert {a: layout.size(a) for a in layout.used} == expected
    check_combination(config, world_size=world, per_node=per_node)  # and nothing refuses it


@pytest.mark.parametrize("name", [n for n, cls in STRATEGIES.items() if "tp" not in cls.axes])
def test_tp_size_above_one_is_refused_under_strategies_without_a_tensor_axis(name):
    assert {"ddp", "zero1", "single", "pipeline"} <= {n for n, c in STRATEGIES.items() if "tp" not in c.axes}
    config = Config(strategy={"name": name, "tp": {"size": 2}})
    world = STRATEGIES[name].processes_per_node or 2
    for kwargs in ({}, {"world_size": world}):  # before the process count is known too
        with pytest.raises(ConfigError) as excinfo:
            check_combination(config, **kwargs)
        message = _one_line_refusal(excinfo)
        assert f"strategy {name} cannot hold" in message and "strategy.tp.size: 1" in message
    with pytest.raises(ConfigError) as excinfo:
        STRATEGIES[name].layout_for(config, world)
    _one_line_refusal(excinfo)
    # tp.size 1 is every strategy's own layout.
    check_combination(Config(strategy={"name": name, "tp": {"size": 1}}), world_size=world)


@pytest.mark.parametrize(
    "name, world, per_node, tp, words",
    [
        ("tp", 6, 3, 2, "does not divide the 3 processes per node"),  # TP across nodes
        ("fsdp", 8, 2, 4, "does not divide the 2 processes per node"),
        ("tp", 3, None, 2, "does not divide the 3 processes"),
        ("fsdp", 6, None, 4, "does not divide the 6 processes"),
    ],
)
def test_tp_sizes_that_do_not_divide_are_refused_by_check_combination(name, world, per_node, tp, words):
    config = Config(strategy={"name": name, "tp": {"size": tp}})
    with pytest.raises(ConfigError) as excinfo:
        check_combination(config, world_size=world, per_node=per_node)
    message = _one_line_refusal(excinfo)
    assert words in message and f"strategy.tp.size {tp}" in message
