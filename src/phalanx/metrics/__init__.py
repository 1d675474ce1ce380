"""What a training run measured: per-step records (``recorder``), the end-of-run summary and
straggler view (``summary``, ``straggler``, ``report``), MFU (``flops``) and the profiler window
(``profile``). See docs/metrics.md."""
