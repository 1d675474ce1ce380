"""benchmarks/compare.py's harness: workloads, one worker per contender, launches, summary, report."""
