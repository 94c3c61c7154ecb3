"""Commit: accept, bonus, emitted tokens and carry of the batched round, and the DFlow relay write.

`commit_torch` is the round's own code (about 25 small ops over [rows, k]); `commit_triton`
does all of it, the relay record included, in one launch with one program per row, in place
on the DecodeState tensors: at these sizes the round's tail costs launches, not arithmetic.
Both take the same arguments: the verified block, then the state tensors they update.
"""

from __future__ import annotations

from typing import Any

import torch

from dflow_rt.kernels.sampling import accept
from dflow_rt.kernels.selection import triton_kernel

tl: Any = None  # triton.language, bound on the first launch (selection.triton_kernel)


def record_relay(buffer: list[torch.Tensor], rows: torch.Tensor | None, features: torch.Tensor, block: torch.Tensor,
                 verified: torch.Tensor, accepted: torch.Tensor) -> None:
    """The relay write (`models.relay.VerifyRecord.write`; its tensors: features, accepted, bonus,
    rejected, width): the verify features [b, k, F] of `rows` (None: all), their accepted count, the
    bonus token and the first rejected draft."""
    relay_features, relay_accepted, relay_bonus, relay_rejected, relay_width = buffer
    k, a = block.shape[1], accepted[:, None]
    idx = slice(None) if rows is None else rows
    relay_features[idx, :k] = features.to(relay_features.dtype)  # the target may run in another dtype
    relay_width[idx] = k
    relay_accepted[idx] = accepted
    relay_bonus[idx] = verified.gather(1, a)[:, 0]
    relay_rejected[idx] = block.gather(1, (a + 1).clamp(max=k - 1))[:, 0]


def commit_torch(block: torch.Tensor, verified: torch.Tensor, features: torch.Tensor | None, tokens: torch.Tensor,
                 start: torch.Tensor, ctx_start: torch.Tensor, fresh: torch.Tensor, active: torch.Tensor,
                 out: torch.Tensor, relay_features: torch.Tensor | None = None,
                 relay_accepted: torch.Tensor | None = None, relay_bonus: torch.Tensor | None = None,
                 relay_rejected: torch.Tensor | None = None, relay_width: torch.Tensor | None = None) -> None:
    """Accept, write the emitted tokens to `out`, record the relay (when given), carry state.

    `block` and `verified` are the k verified positions ([rows, k], k <= B); `out` columns past
    k + 1 are left as they are (the host reads `count` tokens)."""
    a = accept(block, verified)
    bonus = verified.gather(1, a[:, None])
    # Emit block[1..a] and the bonus, plus block[0] when prefill has not reported it yet.
    committed = torch.cat([block, bonus], dim=1).scatter(1, a[:, None] + 1, bonus)
    k = block.shape[1]
    skip = (~fresh).long()[:, None]
    emitted = committed.gather(1, (torch.arange(k + 1, device=block.device) + skip).clamp(max=k))
    out[:, :k + 2].copy_(torch.cat([(a + 1 + fresh.long())[:, None], emitted], dim=1))
    if relay_features is not None:
        record_relay([relay_features, relay_accepted, relay_bonus, relay_rejected, relay_width], None, features,
                     block, verified, a)
    ctx_start.copy_(torch.where(active, start, ctx_start))
    start.add_((a + 1) * active.long())
    tokens.copy_(bonus[:, 0])
    fresh.zero_()


def _commit_kernel(block, verified, features, tokens, start, ctx_start, fresh, active, out, relay_features,
                   relay_accepted, relay_bonus, relay_rejected, relay_width, n_feat, feat_stride, relay_stride,
                   out_stride,
                   K: tl.constexpr, SLOTS: tl.constexpr, HAS_RELAY: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SLOTS)  # SLOTS >= K + 1: the verified block, then the bonus
    in_block = j < K
    blk = tl.load(block + row * K + j, mask=in_block, other=0)
    ver = tl.load(verified + row * K + j, mask=in_block, other=0)
    prev = tl.load(verified + row * K + j - 1, mask=in_block & (j >= 1), other=0)
    # a = drafts accepted: the slots 1.. before the first mismatch with the previous verified token.
    a = tl.min(tl.where(in_block & (j >= 1) & (blk != prev), j, K), axis=0) - 1
    bonus = tl.sum(tl.where(j == a, ver, 0), axis=0)
    is_fresh = tl.load(fresh + row).to(tl.int32)
    # out = [count, emitted...]: committed[min(i + skip, K)] with committed = block[:a+1], bonus, block[a+2:], bonus.
    src = tl.minimum(j + 1 - is_fresh, K)
    picked = tl.load(block + row * K + src, mask=src < K, other=0)
    emitted = tl.where((src == a + 1) | (src >= K), bonus, picked)
    tl.store(out + row * out_stride + 1 + j, emitted, mask=j < K + 1)
    tl.store(out + row * out_stride, a + 1 + is_fresh)
    if HAS_RELAY:
        tl.store(relay_accepted + row, a)
        tl.store(relay_width + row, K)
        tl.store(relay_bonus + row, bonus)
        tl.store(relay_rejected + row, tl.sum(tl.where(j == tl.minimum(a + 1, K - 1), blk, 0), axis=0))
        for f0 in range(0, n_feat, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            x = tl.load(features + row * feat_stride + f, mask=f < n_feat)
            tl.store(relay_features + row * relay_stride + f, x.to(relay_features.dtype.element_ty), mask=f < n_feat)
    is_active = tl.load(active + row)
    here = tl.load(start + row)
    tl.store(ctx_start + row, tl.where(is_active, here, tl.load(ctx_start + row)))
    tl.store(start + row, here + tl.where(is_active, a + 1, 0))
    tl.store(tokens + row, bonus)
    tl.store(fresh + row, 0)


@torch.library.custom_op("dflow_rt::commit", mutates_args=(
    "tokens", "start", "ctx_start", "fresh", "out", "relay_features", "relay_accepted", "relay_bonus",
    "relay_rejected", "relay_width"))
def commit_triton(block: torch.Tensor, verified: torch.Tensor, features: torch.Tensor | None, tokens: torch.Tensor,
                  start: torch.Tensor, ctx_start: torch.Tensor, fresh: torch.Tensor, active: torch.Tensor,
                  out: torch.Tensor, relay_features: torch.Tensor | None = None,
                  relay_accepted: torch.Tensor | None = None, relay_bonus: torch.Tensor | None = None,
                  relay_rejected: torch.Tensor | None = None, relay_width: torch.Tensor | None = None) -> None:
    """`commit_torch` in one launch. relay_features must be contiguous within a row; the k
    verified positions' features are its first k * F values."""
    rows, K = block.shape
    block, verified = block.contiguous(), verified.contiguous()
    if not all(t is None or t.is_contiguous() for t in (tokens, start, ctx_start, fresh, active, relay_accepted,
                                                        relay_bonus, relay_rejected, relay_width)):
        raise ValueError("the per-row state tensors must be contiguous: they are updated in place")
    has_relay = relay_features is not None
    if has_relay:
        if relay_features[0].stride() != (relay_features.shape[2], 1):
            raise ValueError("relay features must be contiguous within a row")
        features = features.contiguous().view(rows, -1)
        n_feat, feat_stride, relay_stride = features.shape[1], features.stride(0), relay_features.stride(0)
    else:  # the pointers are never read
        features = relay_features = relay_accepted = relay_bonus = relay_rejected = relay_width = tokens
        n_feat = feat_stride = relay_stride = 0
    block_f = min(4096, max(16, 1 << (max(n_feat, 1) - 1).bit_length()))
    triton_kernel(_commit_kernel)[(rows,)](
        block, verified, features, tokens, start, ctx_start, fresh, active, out, relay_features, relay_accepted,
        relay_bonus, relay_rejected, relay_width, n_feat, feat_stride, relay_stride, out.stride(0),
        K=K, SLOTS=max(16, 1 << K.bit_length()), HAS_RELAY=has_relay, BLOCK_F=block_f)


@commit_triton.register_fake
def _(block, verified, features, tokens, start, ctx_start, fresh, active, out, relay_features=None,
      relay_accepted=None, relay_bonus=None, relay_rejected=None, relay_width=None) -> None:
    return None
