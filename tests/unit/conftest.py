"""A script gets the strategies' own config sections (strategy.ddp, ...) through phalanx.Config or
phalanx.Session, which import the strategies; they register their sections into the config tree
(config/schema.py). The unit tests build configs from phalanx.config directly, so they import them
here once."""

import phalanx.strategies  # noqa: F401
