"""The CPU kernels build wherever they can: on an x86 CPU with AVX2 or AVX-512 and a C++ compiler a
failed build fails here, rather than skipping the kernel tests (tests/test_cpu_*.py,
test_exact_codes.py) and leaving CI green over a broken build."""

import os
import platform
import shutil

import pytest
import torch

from dflow_rt.kernels.cpu import ops as cpu_ops


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability()
                    not in cpu_ops.ISAS or not (shutil.which("c++") or shutil.which("g++"))
                    or os.environ.get("DFLOW_RT_CPU_GEMV") == "0",
                    reason="no AVX2 / AVX-512 x86 CPU with a C++ compiler here, or the kernel is switched off")
def test_the_cpu_kernels_build_on_a_cpu_and_compiler_that_can():
    assert cpu_ops.enabled(), "the CPU kernel library failed to build or load: see the warning logged above"
