"""DDP gradient compression hooks refused where they cannot work (no process group started)."""

from __future__ import annotations

import pytest

import phalanx
from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.strategies import check_combination
from tests.helpers.models import make_model


def test_bf16_compression_needs_nccl():
    session = phalanx.Session(strategy={"name": "ddp", "ddp": {"comm_hook": "bf16"}}, train={"progress": False})
    try:
        with pytest.raises(ConfigError, match="comm_hook=bf16 needs NCCL"):
            session.setup(make_model())
    finally:
        session.close()


def test_hook_with_a_strategy_that_has_no_ddp_all_reduce_is_refused():
    # A rule of the strategies (strategies/checks.py), which the launcher and every Session apply.
    with pytest.raises(
        ConfigError, match="comm_hook=fp16 compresses DDP's gradient all-reduce, which strategy fsdp does not use"
    ):
        check_combination(Config(strategy={"name": "fsdp", "ddp": {"comm_hook": "fp16"}}))
    config = Config(strategy={"name": "zero1", "ddp": {"comm_hook": "powersgd"}})
    check_combination(config)
    assert config.strategy.ddp.comm_hook == "powersgd"
