"""The eager passes' small C++ ops (`models/cpu_eager.cpp`), property-based: RMSNorm against the HF
formula in torch, the rotary embedding and cache write bit for bit against `apply_rope` and
`KVCache.write`; an eager cached pass through them against `transformers`; what they do not serve
stays with torch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models.layers import Attention, KVCache, Rotary, apply_rope
from tests.helpers import build_avx2, ours_from_hf, tiny_hf_target

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="needs an AVX-512 or AVX2 CPU and a compiler")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@settings(max_examples=60)
@given(st.integers(1, cpu_ops.MAX_ROWS), st.sampled_from([1, 7, 16, 33, 64, 576]), st.sampled_from([1e-6, 1e-5]),
       st.sampled_from([1e-3, 1.0, 100.0]), st.integers(0, 2**16))
def test_rms_norm_matches_the_hf_formula(rows, n, eps, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(1, rows, n, generator=g) * scale, torch.randn(n, generator=g)
    torch.testing.assert_close(torch.ops.dflow_rt.rms_norm(x, weight, eps), hf_rms_norm(x, weight, eps),
                               atol=1e-6, rtol=1e-5)


@st.composite
def rope_cases(draw):
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, cpu_ops.MAX_ROWS))
    kv, group, d = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([8, 16, 64, 128]))
    length = n + draw(st.integers(0, 40))
    starts = draw(st.lists(st.integers(0, length - n), min_size=b, max_size=b))
    return b, n, kv, group, d, length, torch.tensor(starts)[:, None] + torch.arange(n), draw(st.integers(0, 2**16))


@settings(max_examples=60)
@given(rope_cases())
def test_rope_write_is_the_torch_rotation_and_write_to_the_bit(case):
    b, n, kv, group, d, length, positions, seed = case
    g = torch.Generator().manual_seed(seed)
    heads = kv * group
    merged = torch.randn(b, n, (heads + 2 * kv) * d, generator=g)  # strided q, k, v, as a merged product's parts
    q, k, v = (t.unflatten(-1, (-1, d)) for t in merged.split([heads * d, kv * d, kv * d], -1))
    rotary = Rotary(d, 10_000.0, None, length)
    cos, sin = rotary(positions, torch.float32)
    ours, torchs = (KVCache(1, b, kv, length, d, torch.float32, "cpu") for _ in range(2))
    for cache in (ours, torchs):  # what a write must leave alone
        cache.k[0].normal_(generator=g.manual_seed(seed + 1))
        cache.v[0].normal_(generator=g.manual_seed(seed + 2))
    got = torch.ops.dflow_rt.rope_write(q, k, v, cos, sin, ours.k[0], ours.v[0], positions)
    torchs.write(0, None, positions, apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2))
    assert torch.equal(got, apply_rope(q.transpose(1, 2), cos, sin))
    assert torch.equal(ours.k[0], torchs.k[0]) and torch.equal(ours.v[0], torchs.v[0])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_an_eager_cached_pass_through_them_matches_transformers(family, monkeypatch):
    """A prompt, then a 4-token block over the cache it wrote, in inference mode (the Runtime's eager
    rounds): the logits are HF's over the whole sequence, and the fused ops served every layer."""
    hf = tiny_hf_target(3, vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=16, family=family)
    target = ours_from_hf(hf)
    calls = []
    fused = Attention.rotate_and_write
    monkeypatch.setattr(Attention, "rotate_and_write", lambda *a: calls.append(1) or fused(*a))
    ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(0))
    c = target.config
    cache = KVCache(c.num_hidden_layers, 1, c.num_key_value_heads, 32, c.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        first, _ = target(ids[:, :10], torch.arange(10)[None], cache)
        block, _ = target(ids[:, 10:], torch.arange(10, 14)[None], cache)
        expected = hf(ids).logits
    assert len(calls) == 2 * c.num_hidden_layers
    torch.testing.assert_close(torch.cat([first, block], 1), expected, atol=1e-4, rtol=1e-4)


def test_what_they_do_not_serve_stays_with_torch(monkeypatch):
    """Prefill-sized passes, bf16, autograd and compiled passes keep torch's ops."""
    weight = torch.randn(64)
    assert cpu_ops.eager_served(torch.randn(1, 4, 64), weight)
    assert not cpu_ops.eager_served(torch.randn(1, cpu_ops.MAX_ROWS + 1, 64), weight)
    assert not cpu_ops.eager_served(torch.randn(1, 4, 64).bfloat16(), weight.bfloat16())
    assert not cpu_ops.eager_served(torch.randn(1, 4, 64, requires_grad=True), weight)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not cpu_ops.eager_served(torch.randn(1, 4, 64), weight)


def test_bad_input_is_refused():
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16)
    cos = sin = torch.randn(1, 1, 2, 16)
    cache_k, cache_v = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    op = torch.ops.dflow_rt.rope_write
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, k, v, cos, sin, cache_k, cache_v, torch.tensor([[7, 8]]))
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k.double(), v.double(), cos.double(), sin.double(), cache_k.double(), cache_v.double(),
           torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.dflow_rt.rms_norm(torch.randn(2, 16), torch.randn(8), 1e-6)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="builds AVX2 code on an AVX-512 CPU")
def test_the_avx2_build_normalises_alike(tmp_path):
    """The other instruction set's code (8 lanes: another reduction tree and tail masks)."""
    op = build_avx2(tmp_path, cpu_ops.SOURCES[2], "dflow_rt_avx2_eager").rms_norm
    for n in (7, 8, 64, 100):
        x, weight = torch.randn(3, n) * 5, torch.randn(n)
        torch.testing.assert_close(op(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6), atol=1e-6, rtol=1e-5)
