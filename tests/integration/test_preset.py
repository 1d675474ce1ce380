"""preset: throughput: shown with its source by `phalanx config show`, and training under it on 2
gloo processes matches the reference."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.cli import run_phalanx
from tests.helpers.training import reference, rel_diff, run


def test_config_show_names_the_preset_as_source(tmp_path):
    shown = run_phalanx("config", "show", "--json", "--set", "preset=throughput", cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.output
    assert '"source": "preset throughput"' in shown.stdout


@pytest.mark.multiprocess
def test_training_under_the_preset_matches_the_reference():
    args = (("ddp", 16, 4, 5), {"model": "mlp", "optimizer": "adam", "preset": "throughput"})
    outs = phalanx.spawn(run, nprocs=2, args=args, cpu=True, timeout=300)
    assert outs[0]["optimizer"]["fused"] is True  # compute.optimizer_impl: auto chose fused Adam
    # Fused kernels round differently from the for-loop: the kernel tolerance of test_compute.py.
    assert rel_diff(outs[0]["state"], reference(16, 5, model="mlp", optimizer="adam", foreach=False)) < 1e-5
