from phalanx.config.batch import BatchPlan, plan_batch
from phalanx.config.loader import load_config, read_file
from phalanx.config.schema import Config

__all__ = ["BatchPlan", "Config", "load_config", "plan_batch", "read_file"]
