"""Sampling from given uniforms: temperature, top-k, top-p, inverse CDF; argmax where greedy.

`sample_torch` is `sampling.sample_from_uniform`. `sample_triton` leaves the softmax and the
vocabulary sort to torch (the same calls as the reference, so the sorted probabilities are
bit-identical) and fuses everything after them into one program per position: the top-k
mass, the renormalisation, the top-p cut, the CDF, the inverse-CDF pick and the token lookup
(about a dozen passes over [b, n, V] in torch), and it takes greedy rows' argmax from the
logits without touching the sorted ones. A full Triton sort does not pay: a vocabulary does
not fit one program's registers, and a sort by logits would order probabilities that round
to equal values differently from torch's sort.

Where the two can differ: the top-k sum and the two cumulative sums run in another order
than torch's (a scan per chunk of the vocabulary), so they agree to a few fp32 ulps, not
bitwise. A draw differs only when u * mass lies within that distance of a CDF step, or top_p
within that distance of the mass ranked above a token: probability about 1e-6 per draw at
V = 32k. Greedy rows agree exactly (first maximal index on both).
"""

from __future__ import annotations

from typing import Any

import torch

from dflow_rt.kernels.sampling import sample_from_uniform
from dflow_rt.kernels.selection import triton_kernel

tl: Any = None  # triton.language, bound on the first launch (selection.triton_kernel)

sample_torch = sample_from_uniform


def _sample_kernel(logits, probs, order, temperature, top_k, top_p, u, out, n, V, BLOCK_V: tl.constexpr):
    pos = tl.program_id(0)
    row = pos // n
    base = pos.to(tl.int64) * V
    offs = tl.arange(0, BLOCK_V)
    temp = tl.load(temperature + row)
    if temp > 0:
        k = tl.load(top_k + row)
        k = tl.where(k > 0, k, V)
        p_cut = tl.load(top_p + row)
        mass = 0.0  # kept by top-k
        for v0 in range(0, V, BLOCK_V):
            i = v0 + offs
            mass += tl.sum(tl.load(probs + base + i, mask=(i < V) & (i < k), other=0.0), axis=0)
        above = 0.0  # cumulative renormalised mass before this chunk
        kept = 0.0  # cumulative mass that survives top-p
        for v0 in range(0, V, BLOCK_V):
            i = v0 + offs
            p = tl.load(probs + base + i, mask=(i < V) & (i < k), other=0.0) / mass
            c = above + tl.cumsum(p, axis=0)
            q = tl.where((c - p < p_cut) | (i == 0), p, 0.0)
            kept = tl.max(kept + tl.cumsum(q, axis=0), axis=0)
            above = tl.max(c, axis=0)
        target = tl.load(u + pos) * kept.to(tl.float64)
        above = 0.0
        cdf_end = 0.0
        picked = 0
        for v0 in range(0, V, BLOCK_V):  # the same sums again, now counting CDF values below target
            i = v0 + offs
            p = tl.load(probs + base + i, mask=(i < V) & (i < k), other=0.0) / mass
            c = above + tl.cumsum(p, axis=0)
            q = tl.where((c - p < p_cut) | (i == 0), p, 0.0)
            cdf = cdf_end + tl.cumsum(q, axis=0)
            picked += tl.sum(((cdf.to(tl.float64) < target) & (i < V)).to(tl.int32), axis=0)
            cdf_end = tl.max(cdf, axis=0)
            above = tl.max(c, axis=0)
        token = tl.load(order + base + tl.minimum(picked, V - 1))
    else:
        best = -float("inf")
        token = 0
        for v0 in range(0, V, BLOCK_V):
            i = v0 + offs
            x = tl.load(logits + base + i, mask=i < V, other=-float("inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            at = v0 + tl.argmax(x, axis=0, tie_break_left=True)
            token = tl.where(m > best, at, token)
            best = tl.maximum(best, m)
        token = token.to(tl.int64)
    tl.store(out + pos, token)


@torch.library.custom_op("dflow_rt::sample", mutates_args=())
def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor:
    """Tokens [b, n] for logits [b, n, V], per-row settings [b] and uniforms u [b, n] (float64)."""
    b, n, V = logits.shape
    t = temperature.clamp(min=1e-6)[:, None, None]
    probs, order = torch.sort(torch.softmax(logits.float() / t, dim=-1), dim=-1, descending=True)
    out = torch.empty(b, n, dtype=torch.long, device=logits.device)
    triton_kernel(_sample_kernel)[(b * n,)](
        logits.contiguous(), probs, order, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
        u.contiguous(), out, n, V,
        BLOCK_V=min(4096, max(16, 1 << (V - 1).bit_length())))
    return out


@sample_triton.register_fake
def _(logits, temperature, top_k, top_p, u):
    return logits.new_empty(logits.shape[:2], dtype=torch.long)
