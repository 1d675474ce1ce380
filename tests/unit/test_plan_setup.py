"""Issue 12, point 3: `phalanx plan` counts the set-up peak (session.setup() putting the model in
place) as well as the training peak, and says per row which construction it assumes: whole (the
script builds the model in every process) or deferred (session.init_module()). A row fits, and
can be recommended, only when the larger of the two peaks fits."""

from __future__ import annotations

import json
import sys

import pytest
from torch import nn

from phalanx.cli.main import main
from phalanx.plan import ShardUnits, count_shard_units, make_plan, setup_peak
from phalanx.strategies.fsdp import FSDPConfig

GIB = 1024**3
PLAN = {
    "optimizer": "adam",
    "accounting": "phalanx",
    "micro_batch": 1,
    "activations": None,
    "checkpointed": None,
    "checkpoint_classes": [],
}


def layers() -> nn.Sequential:
    """Automatic FSDP units (min_params 100,000): the two wide layers; the model keeps the rest."""
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2048), nn.Linear(2048, 64), nn.Linear(64, 64))


WIDEST = 64 * 2048 + 2048  # the largest unit: layer 1, weight and bias
N_LAYERS = 2 * (64 * 64 + 64) + 2 * 64 * 2048 + 2048 + 64


@pytest.fixture
def importable(monkeypatch):
    # The CLI imports --model by name, as it would a user's module.
    monkeypatch.setitem(sys.modules, "plan_setup_example", sys.modules[__name__])


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_7b_on_eight_24_gib_devices_recommends_fsdp_zero3_with_deferred_construction(capsys):
    plan = _plan_json(capsys, "--params", "7e9", "--devices", "8", "--device-memory", "24")
    limit = 0.9 * 24 * GIB
    rows = {r["label"]: r for r in plan["rows"]}
    zero3 = rows["fsdp-zero3 (deferred)"]
    full, shard = 4 * 7e9, 4 * 7e9 / 8
    # Whole: the 26.08 GiB of fp32 weights go onto the device before fully_shard copies out 3.26 GiB.
    assert zero3["setup_whole"] == pytest.approx(full + shard) and zero3["setup_whole"] > limit
    assert zero3["total"] < limit  # training alone would fit: the old plan recommended it whole
    # Deferred: the shards plus one unit of at most 1/8 of the parameters.
    assert zero3["setup_deferred"] == zero3["setup"] == pytest.approx(2 * shard)
    assert zero3["construction"] == "deferred" and zero3["fits"] is True
    assert plan["recommendation"] == "fsdp-zero3 (deferred)"
    assert "session.init_module()" in plan["script_lines"] and "session.load_weights(" in plan["script_lines"]
    for row in plan["rows"]:
        assert row["fits"] == (max(row["setup"], row["total"]) <= limit)
    assert rows["fsdp-zero2"]["fits"] is False and rows["ddp"]["fits"] is False


def test_7b_table_names_the_construction_and_what_to_change(capsys):
    assert main(["plan", "--params", "7e9", "--devices", "8", "--device-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "set-up" in out and "fsdp-zero3 (deferred)" in out
    assert "recommended: fsdp-zero3 with deferred construction" in out
    assert "fsdp set-up assumes no FSDP unit above 1/8 of the parameters; give --model to count the real units" in out
    assert "8 processes x 26.08 GiB of fp32 weights = 208.62 GiB" in out
    yaml_at, script_at = out.index("phalanx.yaml:"), out.index("with session.init_module():")
    assert yaml_at < script_at and 'session.load_weights("weights.safetensors")' in out[script_at:]
    assert max(len(line) for line in out.splitlines()) <= 110


def test_ddp_sets_up_its_parameters():
    plan = make_plan(10_000, 4, device_memory=GIB, **PLAN)
    (ddp,) = [r for r in plan.rows if r.strategy == "ddp"]
    assert ddp.setup == ddp.parameters == 4 * 10_000
    assert ddp.setup_whole == ddp.setup_deferred and ddp.construction == "whole"
    assert setup_peak("zero1", 10_000, 4) == setup_peak("ddp", 10_000, 4)


def test_fsdp_whole_sets_up_the_full_weights_and_the_shards():
    for row in ("fsdp-zero2", "fsdp-zero3"):
        assert setup_peak(row, 8000, 8).whole == 4 * 8000 + 4 * 8000 / 8


def test_pipeline_sets_up_its_stage_in_either_construction():
    peak = setup_peak("pipeline", 8000, 8)
    assert peak.whole == peak.deferred == 4 * 8000 / 8
    plan = make_plan(8000, 8, device_memory=None, **PLAN)
    (pipeline,) = [r for r in plan.rows if r.strategy == "pipeline"]
    assert pipeline.setup == pipeline.parameters


def test_the_real_largest_unit_is_counted():
    units = count_shard_units(layers(), FSDPConfig())
    assert (units.largest, units.largest_name, units.largest_class) == (WIDEST, "1", "Linear")
    assert units.count == 3 and units.largest_parameter == 64 * 2048  # two wide layers and the model itself
    by_class = count_shard_units(layers(), FSDPConfig(wrap=["Linear"]))
    assert by_class.count == 5 and by_class.largest == WIDEST and by_class.rule == "wrap: Linear"
    plan = make_plan(N_LAYERS, 8, device_memory=None, units=units, **PLAN)
    (zero3,) = [r for r in plan.rows if r.strategy == "fsdp-zero3"]
    assert zero3.setup_deferred == pytest.approx(4 * N_LAYERS / 8 + 4 * WIDEST)
    assert plan.largest_unit == WIDEST and plan.fsdp_units is units


def test_the_cli_counts_the_units_of_the_model(importable, capsys):
    argv = ["--model", "plan_setup_example:layers", "--input-shape", "64", "--devices", "8"]
    plan = _plan_json(capsys, *argv)
    assert plan["fsdp_units"]["largest"] == WIDEST and plan["fsdp_units"]["largest_name"] == "1"
    (zero3,) = [r for r in plan["rows"] if r["strategy"] == "fsdp-zero3"]
    assert zero3["setup_deferred"] == pytest.approx(4 * N_LAYERS / 8 + 4 * WIDEST)
    assert main(["plan", *argv]) == 0
    assert "fsdp set-up: largest unit 1 (Linear), 133,120 parameters, of 3 (automatic, min_params 100,000)" in (
        capsys.readouterr().out
    )


def test_a_row_whose_set_up_alone_does_not_fit_is_not_recommended():
    # One unit holds every parameter: deferred construction materialises all of it at once.
    whole = ShardUnits(count=1, largest=1000, largest_name="", largest_class="Linear", largest_parameter=1000, rule="")
    plan = make_plan(1000, 8, device_memory=2500 / 0.9, units=whole, **PLAN)
    rows = {r.strategy: r for r in plan.rows}
    zero3 = rows["fsdp-zero3"]
    assert zero3.total == pytest.approx(2000) and zero3.total <= 2500  # training fits
    assert min(zero3.setup_whole, zero3.setup_deferred) == pytest.approx(4500) and zero3.fits is False
    assert plan.recommendation is rows["pipeline"] and plan.recommendation.construction == "whole"
    assert plan.script_lines is None


def test_whole_construction_is_kept_where_it_fits(capsys):
    plan = _plan_json(capsys, "--example", "gpt", "--device-memory", "1")
    assert {r["construction"] for r in plan["rows"]} == {"whole"}
    assert plan["recommendation"] == "ddp" and plan["script_lines"] is None


def test_deferred_construction_is_shown_only_where_it_lowers_the_peak():
    # ddp materialises the whole model either way: nothing fits, and nothing changes, deferred.
    plan = make_plan(7_000_000_000, 8, device_memory=24 * GIB, **PLAN)
    rows = {r.strategy: r for r in plan.rows}
    assert rows["ddp"].construction == rows["zero1"].construction == "whole"
    # fsdp-zero2's gathered copy makes training its peak, above the set-up of either construction.
    assert rows["fsdp-zero2"].construction == "whole" and rows["fsdp-zero2"].setup_deferred < rows["fsdp-zero2"].setup
    # Without a device memory, deferred wherever whole construction's set-up is the larger peak.
    unknown = {r.strategy: r for r in make_plan(7_000_000_000, 8, device_memory=None, **PLAN).rows}
    assert unknown["fsdp-zero3"].construction == "deferred" and unknown["fsdp-zero3"].fits is None


def test_json_fields(capsys):
    plan = _plan_json(capsys, "--params", "1e9", "--devices", "4")
    for row in plan["rows"]:
        assert {"setup", "construction", "setup_whole", "setup_deferred"} <= set(row)
        assert row["construction"] in ("whole", "deferred")
        assert all(isinstance(row[k], float) for k in ("setup", "setup_whole", "setup_deferred"))
    assert plan["fsdp_units"] is None and plan["largest_unit"] == plan["largest_parameter"] == 1e9 / 4
    assert plan["script_lines"] is None  # no device memory, no recommendation


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "1e9", "--fsdp-wrap", "Block"], "--fsdp-wrap needs --model or --example"),
        (["--params", "1e9", "--fsdp-min-params", "10"], "--fsdp-min-params needs --model or --example"),
        (["--example", "gpt", "--fsdp-wrap", "Nope"], "--fsdp-wrap names Nope, but the model has no such submodule"),
        (["--example", "gpt", "--fsdp-min-params", "0"], "--fsdp-min-params must be at least 1"),
    ],
)
def test_bad_unit_flags_are_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
