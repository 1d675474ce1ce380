"""The built-in example: a small CNN on the UCI handwritten digits, shipped with the package."""
