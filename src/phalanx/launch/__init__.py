"""Starting processes: ``phalanx launch`` (launcher.py, on torch elastic) and ``phalanx.spawn``
(spawn.py, on torch.multiprocessing). Nothing is imported here, so the worker bootstrap can start
before torch loads."""
