"""The GPU acceptance tier: every CUDA path one GPU can run, each a measured figure against a
stated tolerance; one module per part, each returning its checks. run.py runs them (benchmarks/
gpu_check.sh 1 and 2 run them between the CUDA tests of tests/gpu, within a lent GPU's 15 minutes)."""
