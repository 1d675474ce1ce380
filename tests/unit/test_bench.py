"""`phalanx bench` without starting a run: efficiency and step-time split from synthetic per-step
metrics, the reading, bench.json and bench.png, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.bench.chart import have_matplotlib, write_chart
from phalanx.bench.reading import reading
from phalanx.bench.report import bench_json
from phalanx.bench.runner import BenchOptions, parse_nproc_list
from phalanx.bench.scaling import scaling
from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from phalanx.harness.figures import RunFigures, read_metrics, run_figures, steps_recorded


def _record(rank, step, step_time, data_wait, samples, peak=0):
    return {
        "rank": rank,
        "step": step,
        "epoch": 0,
        "time": 1000.0 + step,
        "step_time": step_time,
        "data_wait": data_wait,
        "samples": samples,
        "samples_per_s": samples / step_time,
        "loss": 1.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "peak_mem_bytes": peak,
    }


def _write_metrics(
    directory: Path, nproc: int, steps: list[tuple[float, float]], samples: int, slow_rank_extra: float = 0.0
) -> Path:
    """One rank<N>.jsonl per rank; ``steps`` holds (step_time, data_wait) per step, the last rank
    ``slow_rank_extra`` seconds slower."""
    metrics = directory / "metrics"
    metrics.mkdir(parents=True)
    for rank in range(nproc):
        extra = slow_rank_extra if rank == nproc - 1 else 0.0
        lines = [
            json.dumps(_record(rank, i + 1, t + extra, w, samples, peak=1000 * (rank + 1)))
            for i, (t, w) in enumerate(steps)
        ]
        (metrics / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return metrics


def _figures(nproc, step_time, data_wait, batch):
    return RunFigures(
        nproc=nproc,
        global_batch=batch,
        steps=10,
        samples_per_s=batch / step_time,
        step_time=step_time,
        data_wait=data_wait,
        peak_mem_bytes=None,
    )


# ---------------------------------------------------------------- figures from metrics


def test_medians_after_warmup_use_the_slowest_rank(tmp_path):
    warm = [(0.9, 0.5)] * 3  # compilation, allocator warm-up: must not count
    steady = [(0.10, 0.010), (0.12, 0.020), (0.11, 0.015), (0.10, 0.010), (0.30, 0.200)]
    metrics = _write_metrics(tmp_path, 2, warm + steady, samples=128, slow_rank_extra=0.01)
    run = run_figures(2, read_metrics(metrics), warmup=3, name="the 2-process run")
    assert run.steps == 5
    assert run.step_time == pytest.approx(0.12)  # median of 0.11, 0.13, 0.12, 0.11, 0.31
    assert run.data_wait == pytest.approx(0.015)
    assert run.global_batch == 128
    assert run.samples_per_s == pytest.approx(128 / 0.12)
    assert run.peak_mem_bytes == 2000


def test_a_restarted_rank_counts_its_last_record_of_a_step(tmp_path):
    metrics = _write_metrics(tmp_path, 2, [(0.1, 0.0)] * 4, samples=64)
    with open(metrics / "rank1.jsonl", "a") as fh:  # rank 1 restarted and redid steps 3 and 4
        fh.write("".join(json.dumps(_record(1, step, 0.3, 0.0, 64)) + "\n" for step in (3, 4)))
    run = run_figures(2, read_metrics(metrics), warmup=2, name="run")
    assert run.steps == 2 and run.step_time == pytest.approx(0.3)


def test_a_half_written_line_and_a_step_one_rank_missed_are_left_out(tmp_path):
    metrics = _write_metrics(tmp_path, 2, [(0.1, 0.0)] * 4, samples=64)
    with open(metrics / "rank0.jsonl", "a") as fh:
        fh.write(json.dumps(_record(0, 5, 9.0, 0.0, 64)) + "\n" + '{"rank": 0, "step": 6, "step_ti')
    assert steps_recorded(metrics) == 4
    run = run_figures(2, read_metrics(metrics), warmup=1, name="run")
    assert run.steps == 3 and run.step_time == pytest.approx(0.1)


def test_steps_past_the_limit_are_left_out(tmp_path):
    metrics = _write_metrics(tmp_path, 1, [(0.1, 0.0)] * 6 + [(5.0, 0.0)] * 20, samples=64)  # a stopped run's tail
    run = run_figures(1, read_metrics(metrics), warmup=2, name="run", limit=6)
    assert run.steps == 4 and run.step_time == pytest.approx(0.1)


def test_a_run_without_a_batch_size_is_an_error(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "rank0.jsonl").write_text(
        "".join(json.dumps({**_record(0, i, 0.1, 0.0, 64), "samples": None}) + "\n" for i in (1, 2, 3))
    )
    with pytest.raises(PhalanxError, match="batch.global_batch_size"):
        run_figures(1, read_metrics(metrics), warmup=1, name="run")


def test_only_warmup_steps_is_an_error(tmp_path):
    metrics = _write_metrics(tmp_path, 1, [(0.1, 0.0)] * 3, samples=64)
    with pytest.raises(PhalanxError, match="all of them warm-up"):
        run_figures(1, read_metrics(metrics), warmup=3, name="the 1-process run")


def test_efficiency_and_split():
    rows = scaling([_figures(2, 0.125, 0.015, 128), _figures(1, 0.100, 0.010, 64)])
    one, two = rows
    assert [r.nproc for r in rows] == [1, 2]
    assert one.efficiency == pytest.approx(1.0) and one.comm_wait == pytest.approx(0.0)
    assert two.efficiency == pytest.approx((128 / 0.125) / (2 * 640))  # 0.8
    assert two.speedup == pytest.approx(1.6)
    assert two.compute == pytest.approx(0.090)  # the 1-device step minus its data wait
    assert two.comm_wait == pytest.approx(0.125 - 0.090 - 0.015)


def test_communication_wait_is_never_negative():
    two = scaling([_figures(1, 0.100, 0.050, 64), _figures(2, 0.090, 0.060, 128)])[1]
    assert two.comm_wait == 0.0
    assert two.efficiency > 1  # reported as measured, not capped


def test_scaling_needs_the_one_device_run():
    with pytest.raises(PhalanxError, match="1-device"):
        scaling([_figures(2, 0.1, 0.0, 128)])


def test_nproc_list():
    assert parse_nproc_list(None, 3) == [1, 2, 3]
    assert parse_nproc_list("4,2,2", 8) == [1, 2, 4]  # the baseline is added
    for bad in ("two", "0,2", ","):
        with pytest.raises(PhalanxError, match="--nproc-list"):
            parse_nproc_list(bad, 2)


# ---------------------------------------------------------------- the reading


def test_reading_does_not_advise_changing_a_fixed_layouts_batch():
    rows = scaling([_figures(1, 0.100, 0.005, 64), _figures(2, 0.200, 0.005, 64)], strong=True)
    text = reading(rows, cpu=False, fixed_layout=True)
    assert "Communication-bound" in text and "bucket_cap_mb" in text
    assert "batch.micro_batch_size" not in text and "batch.global_batch_size" not in text


def test_reading_communication_bound():
    text = reading(scaling([_figures(1, 0.100, 0.005, 64), _figures(2, 0.200, 0.005, 128)]), cpu=False)
    assert "Communication-bound" in text and "batch.micro_batch_size" in text and "phalanx doctor" in text
    assert "50% scaling efficiency" in text
    assert "CPU processes" not in text


def test_reading_data_bound():
    text = reading(scaling([_figures(1, 0.100, 0.010, 64), _figures(2, 0.160, 0.060, 128)]), cpu=False)
    assert "Data-bound" in text and "data.num_workers" in text


def test_reading_good_scaling():
    text = reading(scaling([_figures(1, 0.100, 0.001, 64), _figures(2, 0.104, 0.001, 128)]), cpu=False)
    assert "Scales well" in text and "96%" in text


def test_reading_distrusts_a_superlinear_result():
    text = reading(scaling([_figures(1, 0.300, 0.0, 64), _figures(2, 0.100, 0.0, 128)]), cpu=False)
    assert "300% scaling efficiency" in text and "poor baseline" in text and "Scales well" not in text


def test_reading_on_cpu_says_the_processes_share_the_cores():
    text = reading(scaling([_figures(1, 0.100, 0.0, 64), _figures(2, 0.200, 0.0, 128)]), cpu=True, cores=2, threads=1)
    assert "2 processes give" in text and "CPU processes (1 thread each) sharing one machine's 2 cores" in text


def test_reading_with_one_run():
    assert "no scaling to read" in reading(scaling([_figures(1, 0.1, 0.0, 64)]), cpu=True)


# ---------------------------------------------------------------- what bench writes


def test_json_and_chart_from_synthetic_figures(tmp_path):
    rows = scaling([_figures(1, 0.100, 0.010, 64), _figures(2, 0.125, 0.015, 128), _figures(4, 0.150, 0.020, 256)])
    document = bench_json(
        rows,
        command="phalanx bench --demo",
        device="cpu",
        settings={"steps": 30},
        runs={1: "r1", 2: "r2"},
        reading="text",
        machine={"cpu": "x"},
    )
    document = json.loads(json.dumps(document))  # what bench.json holds
    assert [r["nproc"] for r in document["runs"]] == [1, 2, 4]
    four = document["runs"][2]
    assert four["efficiency"] == pytest.approx(four["samples_per_s"] / (4 * document["runs"][0]["samples_per_s"]))
    assert four["compute_s"] + four["comm_wait_s"] + four["data_wait_s"] == pytest.approx(four["step_time_s"])
    assert document["runs"][1]["run_dir"] == "r2" and document["runs"][2]["run_dir"] is None
    assert "measured" in document["split_method"] and document["date"]
    if not have_matplotlib():
        pytest.skip("matplotlib is not installed (pip install phalanx[bench])")
    png = tmp_path / "bench.png"
    write_chart(rows, png, title="synthetic", units="processes")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_repeats_the_bench():
    options = BenchOptions(
        script="train.py",
        script_args=("--lr", "3e-4"),
        nproc_list="1,2",
        steps=10,
        warmup=2,
        overrides=("precision.mode=bf16",),
    )
    assert (
        options.command()
        == "phalanx bench --nproc-list 1,2 --steps 10 --warmup 2 --set precision.mode=bf16 train.py --lr 3e-4"
    )


# ---------------------------------------------------------------- the command


BAD_INPUT = [
    (["bench"], "give the training script to bench, or --demo"),
    (["bench", "--demo", "train.py"], "either a script or --demo"),
    (["bench", "missing.py"], "script 'missing.py' not found"),
    (["bench", "--demo", "--nproc-list", "1,x"], "--nproc-list expects"),
    (["bench", "--demo", "--steps", "3", "--warmup", "3"], "--steps must be"),
    (["bench", "--demo", "--set", "train.epochs=0"], "train.epochs"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2_before_any_run(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_without_matplotlib_the_command_says_how_to_get_the_chart(tmp_path, monkeypatch, capsys):
    from phalanx.bench.runner import BenchResult
    from phalanx.cli import bench_cmd

    rows = scaling([_figures(1, 0.1, 0.0, 64), _figures(2, 0.2, 0.0, 128)])
    monkeypatch.setattr(
        bench_cmd, "run_bench", lambda options, say: BenchResult(tmp_path, rows, "cpu", "the reading", None)
    )
    assert main(["bench", "--demo"]) == 0
    out = capsys.readouterr().out
    assert "the reading" in out and f"wrote bench.json in {tmp_path}" in out
    assert out.rstrip().endswith("`pip install phalanx[bench]` adds it")
