"""`phalanx tune` for real on 2 CPU processes with a memory cap: one finds the cap's largest
micro-batch, one where only rank 1 runs out of memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from phalanx.tune.trials import OK, OOM
from tests.helpers.cli import run_phalanx
from tests.helpers.tune import MEMORY_SCRIPT, USER_CONFIG, tune_json, tune_under_a_320_mib_cap


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tune_finds_the_largest_micro_batch_under_the_memory_cap(tmp_path):
    # Global batch 48 on 2 processes: 24 per process, so micro-batches 1, 2, 3, 4, 6, 8, 12, 24 keep it.
    tune_under_a_320_mib_cap(tmp_path, "--cpu", "--nproc", "2")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_only_rank_1_over_the_cap_ends_the_trial_as_out_of_memory(tmp_path):
    # Global batch 16 on 2 processes, from micro-batch 4: rank 0 needs 16 MiB per sample, rank 1
    # 32 MiB. Under 192 MiB, micro-batch 8 fits rank 0 (128 MiB) but not rank 1 (256 MiB).
    (tmp_path / "train.py").write_text(MEMORY_SCRIPT)
    (tmp_path / "phalanx.yaml").write_text(USER_CONFIG.format(micro=4))
    result = run_phalanx(
        "tune",
        "--cpu",
        "--nproc",
        "2",
        "--memory-cap",
        "192MiB",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--search",
        "micro-batch",
        "train.py",
        "--mib-per-sample",
        "16",
        "--rank1-mib-per-sample",
        "32",
        "--global-batch",
        "16",
        cwd=tmp_path,
        timeout=160,
    )
    assert result.returncode == 0, result.output
    document = tune_json(tmp_path)
    first, second = document["trials"]
    assert (first["micro_batch_size"], first["outcome"]) == (4, OK)
    assert (second["micro_batch_size"], second["outcome"], second["detail"]) == (8, OOM, "rank 1"), second
    logs = Path(second["run_dir"]) / "logs"
    assert "OutOfMemoryError" in (logs / "rank1.log").read_text()
    assert "OutOfMemoryError" not in (logs / "rank0.log").read_text()  # rank 0 fit, and was stopped
    assert "rank 1 failed first" in Path(second["log"]).read_text()
    # One answer for every rank: the config holds the size that fits on all of them.
    assert yaml.safe_load((tmp_path / "phalanx.yaml").read_text())["batch"]["max_micro_batch_size"] == 4
