"""Checkpoint files: atomic directories with a manifest, safe loading, RNG state, export.

What a Session puts into a checkpoint is decided one layer up (``phalanx.checkpoint.manager``);
this package only knows directories, files and tensors.
"""
