"""How close the compute knobs (torch.compile, fused kernels, channels-last) keep training to eager
PyTorch, and the skip for machines where torch.compile cannot build kernels."""

from __future__ import annotations

import shutil

import pytest

# Inductor reorders and fuses float operations: the same maths, not the same rounding.
COMPILE_TOLERANCE = 1e-4
# Fused and foreach kernels compute the same update in another order of operations.
KERNEL_TOLERANCE = 1e-5
# Convolutions in channels-last pick other algorithms (other summation orders).
LAYOUT_TOLERANCE = 1e-4

needs_inductor = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")),
    reason="torch.compile's inductor backend needs a C++ compiler on CPU",
)
