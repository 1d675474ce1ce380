"""The built-in example: a small CNN on the UCI handwritten digits, shipped with the package."""

from pathlib import Path

# The file `phalanx demo` and `phalanx bench --demo` launch.
TRAIN_SCRIPT = str(Path(__file__).with_name("train.py"))
