"""A script forces the CPU itself with ``Session(launch={"cpu": True})``, as ``phalanx launch --cpu``
does from outside (issue 41): on a machine whose CUDA is there, the Session still takes the CPU."""

from __future__ import annotations

import torch

import phalanx


def test_launch_cpu_in_the_script_keeps_the_session_off_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    session = phalanx.Session(phalanx.Config(), launch={"cpu": True}, train={"progress": False})
    try:
        assert session.device == torch.device("cpu") and session.topology.backend == "gloo"
    finally:
        session.close()
