"""The GPU acceptance tier: every CUDA path one GPU can run, each a measured figure against a
stated tolerance; one module per part, each returning its checks. run.py runs them (through
benchmarks/gpu_check.sh, after the CUDA tests of tests/gpu)."""
