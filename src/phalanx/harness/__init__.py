"""The short-run harness under ``phalanx bench`` and ``phalanx tune``: launch a script for a few
steps in a subprocess (launching.py) and read its figures from the metrics it wrote (figures.py).
Neither command's own logic lives here; both import it, so it sits below both."""
