"""fp16 on a CPU is many times slower than fp32 (benchmarks/cpu_fp16.py), and only a line at set-up
says so: Precision holds it as a note, the Session prints it once on rank 0."""

from __future__ import annotations

import pytest
import torch

from phalanx import Config, Session
from phalanx.config.schema import PrecisionConfig
from phalanx.runtime.precision import CPU_FP16_NOTE, Precision


def test_fp16_on_a_cpu_carries_one_note_with_the_measured_cost_and_the_alternatives():
    notes = Precision(PrecisionConfig(mode="fp16"), torch.device("cpu")).notes
    assert notes == [CPU_FP16_NOTE]
    assert "\n" not in CPU_FP16_NOTE and "slower than fp32" in CPU_FP16_NOTE and "9-22x" in CPU_FP16_NOTE
    assert "bf16" in CPU_FP16_NOTE and "use fp32" in CPU_FP16_NOTE


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_no_note_for_the_modes_a_cpu_runs_well(mode):
    assert Precision(PrecisionConfig(mode=mode), torch.device("cpu")).notes == []


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp32"])
def test_the_session_prints_the_note_once_at_setup_under_fp16_only(mode, capsys):
    session = Session(Config(), strategy="single", precision=mode, train={"progress": False})
    try:
        model = session.setup(torch.nn.Linear(3, 2))
        session.setup(torch.optim.SGD(model.parameters(), lr=0.1))  # a later setup call: still once
        out = capsys.readouterr().out
    finally:
        session.close()
    assert out.count(CPU_FP16_NOTE) == (1 if mode == "fp16" else 0)
