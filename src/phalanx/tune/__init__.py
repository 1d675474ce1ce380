"""``phalanx tune``: trial runs that pick the micro-batch, loader workers and DDP bucket size for this machine."""
