"""The CPU kernels build wherever they can: on an x86 CPU with AVX2 or AVX-512 and a C++ compiler a
failed build fails here, rather than skipping the kernel tests (tests/test_cpu_*.py,
test_exact_codes.py) and leaving CI green over a broken build. One build path serves the library and
the tests' builds of one instruction set's code (`cpu_ops.build`)."""

import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from dflow_rt import compat
from dflow_rt.kernels.cpu import ops as cpu_ops
from tests.helpers import build_avx2

can_build = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() not in cpu_ops.ISAS
    or not (shutil.which("c++") or shutil.which("g++")) or os.environ.get("DFLOW_RT_CPU_GEMV") == "0",
    reason="no AVX2 / AVX-512 x86 CPU with a C++ compiler here, or the kernel is switched off")


@can_build
def test_the_cpu_kernels_build_on_a_cpu_and_compiler_that_can():
    assert compat.cpp_compiler(), "a C++ compiler is on PATH, but not the one inductor's builder runs ($CXX or g++)"
    assert cpu_ops.enabled(), "the CPU kernel library failed to build or load: see the warning logged above"


@can_build
def test_the_one_build_path_builds_an_instruction_set_asked_for(tmp_path):
    """`build_avx2` (the AVX2 code on any CPU that runs it) goes through the library's own build."""
    op = build_avx2(tmp_path, cpu_ops.SOURCES[2], "dflow_rt_build_avx2").rms_norm
    x, weight = torch.randn(3, 100), torch.randn(100)
    torch.testing.assert_close(op(x, weight, 1e-6), weight * F.rms_norm(x, (100,), None, 1e-6), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="SSE2"):
        cpu_ops.build("nothing", [], tmp_path, isa="SSE2")  # an instruction set the kernels have no tile for
