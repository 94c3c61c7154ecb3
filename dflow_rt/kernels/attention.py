"""Block attention over the static KV cache: the drafter's (bidirectional) and verify's (causal).

Queries q [b, heads, B, d] are the block's slots at absolute positions start[b] + j; keys
and values are a cache view [b, kv_heads, L, d] (GQA: heads = kv_heads * group). Key i is
visible to slot j iff i < start[b] + B (the drafter: all committed context and the whole
block) or iff i <= start[b] + j (verify: causal). Lengths come from `start`, a device tensor,
so the same launch serves every round of a length bucket without a host read.

The Triton kernel is flash attention with one program per (row, kv head, tile of group * B
queries): the group's query heads share each key/value load, and the loop stops at the last
visible key, so a row costs its own context rather than the bucket's length L.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.kernels.selection import interpreting, triton_kernel

HEAD_SIZES = (8, 16, 32, 64, 128)  # what the C++ kernel serves on AVX-512 and AVX2 alike
tl: Any = None  # triton.language, bound on the first launch (selection.triton_kernel)


def cache_mask(positions: torch.Tensor, length: int, causal: bool) -> torch.Tensor:
    """[b, n, length]: the cache positions that queries at `positions` [b, n] (each row's run on
    from positions[:, 0]) see: up to their own (`causal`: prefill and verify), or every position
    before the end of their block (the drafter's bidirectional block)."""
    keys = torch.arange(length, device=positions.device)
    if causal:
        return keys <= positions[:, :, None]
    return (keys < positions[:, :1, None] + positions.shape[1]).expand(-1, positions.shape[1], -1)


def attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                    causal: bool) -> torch.Tensor:
    """SDPA with the dense boolean mask the models build."""
    mask = cache_mask(start[:, None] + torch.arange(q.shape[2], device=start.device), k.shape[2], causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def cpu_serves_every_pass(target, drafter, block_size: int) -> bool:
    """Whether `attention_cpu` serves every decode pass of these models by its C++ kernel (so that no
    round's cost depends on its cache view's length): float32 on CPU, head sizes in HEAD_SIZES,
    blocks of at most `cpu_ops.MAX_ROWS` queries, the kernel built."""
    models = [m for m in (target, drafter) if m is not None]
    return (block_size <= cpu_ops.MAX_ROWS and all(m.config.head_dim in HEAD_SIZES for m in models)
            and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in (next(m.parameters()) for m in models))
            and cpu_ops.enabled())


def attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                  causal: bool) -> torch.Tensor:
    """`attention_torch` by the C++ kernel (`models/cpu_attention.cpp`) where it serves: float32 on CPU,
    at most `cpu_ops.MAX_ROWS` query rows (decode, verify, draft; prefill stays with SDPA), no
    autograd, a head size in HEAD_SIZES. Each row reads only the keys it sees, summed in a fixed
    order: bit-identical whatever rows share the call and whatever the cache view's length."""
    if (q.shape[2] <= cpu_ops.MAX_ROWS and q.shape[-1] in HEAD_SIZES
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))) and cpu_ops.enabled()):
        return torch.ops.dflow_rt.cache_attention(q, k, v, start, causal)
    return attention_torch(q, k, v, start, causal)


def _attention_kernel(q, k, v, out, start, L, qk_scale, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                      o_sb, o_sh, o_ss, B: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the group: (head, slot)
    head = kv_head * GROUP + m // B  # query head h reads kv head h // GROUP, as SDPA's enable_gqa
    slot = m % B
    d = tl.arange(0, BLOCK_D)
    q_ok = (m < GROUP * B)[:, None] & (d < D)[None, :]
    qt = tl.load(q + b * q_sb + head[:, None] * q_sh + slot[:, None] * q_ss + d[None, :], mask=q_ok, other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    first = tl.load(start + b)
    end = tl.minimum(first + B, L)  # one past the last key any slot sees
    last = first + slot  # causal: the last key slot j sees
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_row, v_row = k + b * k_sb + kv_head * k_sh, v + b * v_sb + kv_head * v_sh
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (n < end)[:, None] & (d < D)[None, :]
        kt = tl.load(k_row + n[:, None] * k_ss + d[None, :], mask=kv_ok, other=0.0)
        vt = tl.load(v_row + n[:, None] * v_ss + d[None, :], mask=kv_ok, other=0.0)
        if UPCAST:
            kt, vt = kt.to(tl.float32), vt.to(tl.float32)
        s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * qk_scale  # log2 units
        seen = (n < end)[None, :]
        if CAUSAL:
            seen = seen & (n[None, :] <= last[:, None])
        s = tl.where(seen, s, -float("inf"))  # key 0 is seen by every slot: rows never go all -inf
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + b * o_sb + head[:, None] * o_sh + slot[:, None] * o_ss + d[None, :], o.to(out.dtype.element_ty),
             mask=q_ok)


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    """[b, heads, B, d] stored as [b, B, heads, d]: the output projection's input without a copy."""
    b, heads, B, d = q.shape
    return q.new_empty(b, B, heads, d).transpose(1, 2)


@torch.library.custom_op("dflow_rt::attention", mutates_args=())
def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                     causal: bool) -> torch.Tensor:
    """`attention_torch` as one launch; k/v may be strided views (the cache's length buckets)."""
    b, heads, B, D = q.shape
    kv_heads, L = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = _empty_out(q)
    group = heads // kv_heads
    block_m = min(128, max(16, 1 << (group * B - 1).bit_length()))
    upcast = q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16)  # interpreter: no bf16 math
    triton_kernel(_attention_kernel)[(b, kv_heads, -(-group * B // block_m))](
        q, k, v, out, start.contiguous(), L, math.log2(math.e) / math.sqrt(D), *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *out.stride()[:3], B=B, GROUP=group, D=D, CAUSAL=causal, UPCAST=upcast,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=block_m,
        BLOCK_N=128 if interpreting() else 64, BLOCK_D=max(16, 1 << (D - 1).bit_length()))
    return out


@attention_triton.register_fake
def _(q, k, v, start, causal):
    return _empty_out(q)
