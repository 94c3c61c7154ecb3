"""The CPU product kernel against `F.linear`: any shape it serves, the rows it leaves to torch, and
a row's result independent of how many rows share the call."""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dflow_rt.kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="needs an AVX-512 or AVX2 CPU and a compiler")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, cpu_ops.MAX_ROWS), n=st.integers(1, 70), k=st.integers(1, 100), seed=st.integers(0, 99))
def test_matches_torch_at_every_shape(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    got = torch.ops.dflow_rt.gemv(x, w)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5 * k ** 0.5)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, cpu_ops.MAX_ROWS), n=st.integers(1, 40), k=st.integers(1, 600), seed=st.integers(0, 99))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, n, k, seed):
    """Bit for bit: a verify pass and a plain step compute a shared position alike."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    together = torch.ops.dflow_rt.gemv(x, w)
    for i in range(rows):
        assert torch.equal(torch.ops.dflow_rt.gemv(x[i:i + 1], w)[0], together[i])


def test_linear_routes_only_what_the_kernel_serves():
    w, b = torch.randn(24, 32), torch.randn(24)
    few, many = torch.randn(2, 3, 32), torch.randn(1, cpu_ops.MAX_ROWS + 1, 32)
    with torch.no_grad():
        served = cpu_ops.linear(few, w, b)
        kernel = torch.ops.dflow_rt.gemv(few.reshape(6, 32), w).reshape(2, 3, 24) + b
        assert torch.equal(served, kernel)
        torch.testing.assert_close(served, F.linear(few, w, b))
        assert torch.equal(cpu_ops.linear(many, w, b), F.linear(many, w, b))
        assert torch.equal(cpu_ops.linear(few.double(), w.double()), F.linear(few.double(), w.double()))
    trained = w.clone().requires_grad_()
    out = cpu_ops.linear(few, trained)  # autograd: torch's product, with its gradient
    out.sum().backward()
    assert trained.grad is not None and torch.equal(out, F.linear(few, trained))


def test_compiled_graphs_call_the_kernel():
    w = torch.randn(48, 64)
    layer = cpu_ops.Linear(64, 48, bias=False)
    layer.weight.data.copy_(w)
    x = torch.randn(1, 2, 64)
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), cpu_ops.linear(x, w))


def test_old_builds_are_pruned_to_the_newest_few(tmp_path):
    """Each kernel source or torch version builds into its own directory; a new build keeps only the
    newest KEEP_BUILDS of them (its own included), never a build in progress."""
    dirs = [tmp_path / f"cpu_gemv_{i:016x}" for i in range(5)]
    for i, d in enumerate(dirs):
        d.mkdir()
        os.utime(d, (1000 + i, 1000 + i))
    busy = tmp_path / "cpu_gemv_ffff.123.tmp"
    busy.mkdir()
    current = tmp_path / "cpu_gemv_current"
    current.mkdir()
    cpu_ops._prune(current)
    left = sorted(d.name for d in tmp_path.iterdir())
    assert left == sorted([current.name, busy.name] + [d.name for d in dirs[-(cpu_ops.KEEP_BUILDS - 1):]])
