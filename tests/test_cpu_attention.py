"""The CPU attention kernel (`models/cpu_attention.cpp`) against SDPA over the models' dense mask,
property-based; a row's result bit-identical whatever rows, threads and cache length share its call
(what lets a verify pass reproduce plain steps); what it does not serve goes to SDPA."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflow_rt.kernels.attention import HEAD_SIZES, attention_cpu, attention_torch
from dflow_rt.kernels.cpu import ops as cpu_ops
from tests.helpers import build_avx2

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="needs an AVX-512 or AVX2 CPU and a compiler")
TOL = dict(atol=1e-5, rtol=1e-5)


def case(seed: int, b: int, kv_heads: int, group: int, B: int, d: int, L: int, scale: float = 1.0):
    """q [b, heads, B, d] and cache views k, v [b, kv_heads, L, d] with one spare position (strided, as
    the Runtime's)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kv_heads * group, B, d, generator=g) * scale
    k, v = (torch.randn(b, kv_heads, L + 1, d, generator=g)[:, :, :L] for _ in "kv")
    return q, k, v


@st.composite
def shapes(draw, head_sizes=HEAD_SIZES):
    b, B, extra = draw(st.integers(1, 3)), draw(st.integers(1, cpu_ops.MAX_ROWS)), draw(st.integers(0, 90))
    L = B + extra
    edge = st.sampled_from([0, 1, L - B])  # no context, one key, the block ending at the cache's end
    starts = draw(st.lists(st.one_of(edge, st.integers(0, L - B)), min_size=b, max_size=b))
    dims = dict(b=b, kv_heads=draw(st.integers(1, 3)), group=draw(st.integers(1, 5)), B=B,
                d=draw(st.sampled_from(head_sizes)), L=L)
    return dims, torch.tensor(starts), draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=60)
@given(shapes(), st.sampled_from([1.0, 4.0]))
def test_matches_sdpa_over_the_dense_mask(shape, scale):
    dims, start, causal, seed = shape
    q, k, v = case(seed, **dims, scale=scale)
    out = torch.ops.dflow_rt.cache_attention(q, k, v, start, causal)
    torch.testing.assert_close(out, attention_torch(q, k, v, start, causal), **TOL)
    assert out.stride() == out.transpose(1, 2).contiguous().transpose(1, 2).stride()  # [b, B, heads, d] storage


@settings(max_examples=30)
@given(shapes())
def test_a_row_is_bit_identical_alone_on_other_threads_and_in_a_shorter_view(shape):
    """Row j of a block equals a 1-row call at its own last key (causal: start + j; the drafter's
    block: start + B - 1), over 2 threads, and over the cache cut just past the block."""
    dims, start, causal, seed = shape
    q, k, v = case(seed, **dims)
    op = torch.ops.dflow_rt.cache_attention
    out = op(q, k, v, start, causal)
    for j in range(q.shape[2]):
        alone = op(q[:, :, j:j + 1], k, v, start + (j if causal else q.shape[2] - 1), True)
        assert torch.equal(alone, out[:, :, j:j + 1])
    end = int(start.max()) + q.shape[2]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(op(q, k[:, :, :end], v[:, :, :end], start, causal), out)
    finally:
        torch.set_num_threads(threads)


def test_compiled_after_an_in_place_write_it_reads_the_cache_itself():
    """As in a compiled round: keys and values written into the strided cache views, then attended.
    The op reads k and v through their strides, so inductor must hand it the written views, not
    copies in the traced value's contiguous layout (one per layer, growing with the context)."""
    from torch._inductor.utils import run_and_get_code

    q, k, v = case(0, b=1, kv_heads=3, group=3, B=4, d=64, L=40)
    new_k, new_v = torch.randn(2, 1, 3, 4, 64)
    positions, start = torch.arange(20, 24), torch.tensor([20])

    def write_then_attend(q, k, v, new_k, new_v):
        k[:, :, positions] = new_k
        v[:, :, positions] = new_v
        return torch.ops.dflow_rt.cache_attention(q, k, v, start, True)

    written_k, written_v = k.clone(), v.clone()
    written_k[:, :, positions], written_v[:, :, positions] = new_k, new_v
    torch._dynamo.reset()
    compiled = torch.compile(write_then_attend, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False):  # the cache's key does not see the op's tags
        got, code = run_and_get_code(compiled, q, k, v, new_k, new_v)
    assert torch.equal(k, written_k) and torch.equal(v, written_v)  # written in the caller's storage
    torch.testing.assert_close(got, attention_torch(q, written_k, written_v, start, True), **TOL)
    assert "empty_strided_cpu((1, 3, 40, 64)" not in "".join(code), "the compiled graph copies the cache to attend"


def test_what_it_does_not_serve_goes_to_sdpa():
    q, k, v = case(0, 1, 2, 2, 3, 16, 40)
    start = torch.tensor([5])
    assert torch.equal(attention_cpu(q, k, v, start, True), torch.ops.dflow_rt.cache_attention(q, k, v, start, True))
    big = case(1, 1, 2, 2, cpu_ops.MAX_ROWS + 1, 16, 40)  # a prefill
    odd = case(2, 1, 2, 2, 3, 12, 40)  # a head size it has no shape for
    half = tuple(t.bfloat16() for t in (q, k, v))
    grad = (q.clone().requires_grad_(), k, v)
    for args in (big, odd, half, grad):
        assert torch.equal(attention_cpu(*args, start, True), attention_torch(*args, start, True))


def test_a_nan_in_a_visible_key_reaches_the_output_and_one_past_it_is_never_read():
    q, k, v = case(0, 1, 2, 2, 4, 16, 40)
    k[0, 0, 10] = float("nan")
    out = torch.ops.dflow_rt.cache_attention(q, k, v, torch.tensor([8]), True)
    assert out[0, :2, 2:].isnan().all() and not out[0, :2, :2].isnan().any() and not out[0, 2:].isnan().any()


def test_bad_input_is_refused():
    q, k, v = case(0, 1, 2, 2, 3, 16, 40)
    op = torch.ops.dflow_rt.cache_attention
    with pytest.raises(RuntimeError, match="negative start"):
        op(q, k, v, torch.tensor([-1]), True)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(q[:, :3], k, v, torch.tensor([0]), True)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k.double(), v.double(), torch.tensor([0]), True)
    with pytest.raises(RuntimeError, match="start int64"):
        op(q, k, v, torch.tensor([0, 0]), True)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="builds AVX2 code on an AVX-512 CPU")
def test_the_avx2_build_matches_sdpa_and_keeps_rows_alike(tmp_path):
    """The other instruction set's code (8 lanes: another reduction tree and exponent scaling)."""
    op = build_avx2(tmp_path, cpu_ops.SOURCES[1], "dflow_rt_avx2_attention").cache_attention
    for seed, d, causal in [(0, 8, True), (1, 64, True), (2, 64, False), (3, 128, True), (4, 24, False)]:
        dims = dict(b=2, kv_heads=3, group=3, B=4, d=d, L=150)
        q, k, v = case(seed, **dims, scale=3.0)
        start = torch.tensor([0, 146])
        out = op(q, k, v, start, causal)
        torch.testing.assert_close(out, attention_torch(q, k, v, start, causal), **TOL)
        for j in range(4):
            assert torch.equal(op(q[:, :, j:j + 1], k, v, start + (j if causal else 3), True), out[:, :, j:j + 1])
