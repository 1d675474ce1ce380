"""What is wrong with this machine for multi-GPU work: environment facts (``phalanx env``), checks
with a verdict and a fix each, and a live all-reduce bandwidth measurement (``phalanx doctor``)."""
