"""strategy.ddp.find_unused_parameters: the values the setting takes."""

from __future__ import annotations

import pytest

from phalanx.config.schema import Config


def test_config_values():
    assert Config().strategy.ddp.find_unused_parameters == "auto"
    for given, expected in [("auto", "auto"), (True, True), ("false", False), ("True", True)]:
        assert (
            Config(strategy={"ddp": {"find_unused_parameters": given}}).strategy.ddp.find_unused_parameters == expected
        )
    with pytest.raises(ValueError, match="find_unused_parameters must be auto, true or false"):
        Config(strategy={"ddp": {"find_unused_parameters": "sometimes"}})
