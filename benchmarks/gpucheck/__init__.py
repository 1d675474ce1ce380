"""The parts of benchmarks/gpu_check.py: one module per CUDA path, each returning its checks."""
