"""Token choice for verification: greedy, or lossless sampling with temperature/top-k/top-p.

The drafter proposes argmax tokens, a point mass on each draft d. Speculative sampling then
accepts d with probability p(d) and, on rejection, samples from p with d removed. Drawing
y ~ p at every block position and accepting while y == d is the same law, and it makes the
round identical in code to greedy verification (y = argmax p).

Randomness is counter-based: the uniform for the token at absolute position `pos` of a
request is a hash of (seed, pos). No generator state lives on the device, batch membership
cannot change a request's draws, and a request decodes exactly the tokens that plain
autoregressive sampling with the same seed would.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply), computed in int64 and truncated."""
    x = x & MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) [batch, n] for request `seed` [batch] at token `positions` [batch, n]."""
    x = _mix32(_mix32(positions + 0x9E3779B9) ^ _mix32(seed[:, None]) ^ (seed[:, None] >> 32))
    return (x.double() + 0.5) / 2.0**32


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Tokens [batch, n] for logits [batch, n, vocab]; rows with temperature 0 take the argmax.

    `positions` are those of the tokens being chosen (one past the logits' own positions).
    Filters apply in the usual order: temperature, top-k, then top-p on the renormalised
    rest; top_k = 0 and top_p = 1 disable them. All shapes are static: rows are filtered
    with masks, not by slicing, so the same code runs inside a captured graph.
    """
    return sample_from_uniform(logits, temperature, top_k, top_p, uniform(seed, positions))


def sample_from_uniform(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        u: torch.Tensor) -> torch.Tensor:
    """`sample` given its uniforms u [batch, n] (float64): the inverse CDF at u of the sorted,
    filtered, renormalised distribution (the rule the sampling kernels reproduce)."""
    greedy = logits.argmax(-1)
    t = temperature.clamp(min=1e-6)[:, None, None]
    probs, order = torch.sort(torch.softmax(logits.float() / t, dim=-1), dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    probs = probs * (rank < torch.where(top_k > 0, top_k, logits.shape[-1])[:, None, None])
    probs = probs / probs.sum(-1, keepdim=True)  # top-p applies to what top-k left, renormalised
    before = probs.cumsum(-1) - probs  # mass ranked strictly above each token
    cdf = (probs * ((before < top_p[:, None, None]) | (rank == 0))).cumsum(-1)
    u = u[..., None] * cdf[..., -1:].double()
    picked = (cdf.double() < u).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    sampled = order.gather(-1, picked)[..., 0]
    return torch.where(temperature[:, None] > 0, sampled, greedy)


def excluded_token(drafter, emit_mask_token: bool = False) -> int | None:
    """The token no choice may be (`screen` excludes it): beside a drafter, its mask token, which is
    no text and which a block would read as a hole, unless `emit_mask_token` (the public DFlash
    implementation lets the target choose it); without a drafter, none."""
    return None if drafter is None or emit_mask_token else drafter.config.mask_token_id


def screen(logits: torch.Tensor, exclude: int | None = None) -> torch.Tensor:
    """Rows [batch] of `logits` [batch, n, vocab] that hold a NaN or +inf, or a position without a
    finite logit; then, in place, token `exclude` (the drafter's mask token) gets logit -inf so that
    no choice can be it.

    A -inf logit is a well-defined "never" (the exclusion writes one), so only a position's
    maximum is checked: max propagates NaN. The flag is computed on the device and travels with
    the tokens the host reads anyway, so a faulty row costs no extra host read.
    """
    bad = ~torch.isfinite(logits.amax(-1)).all(-1)
    if exclude is not None:
        logits[..., exclude] = float("-inf")
    return bad


def accept(block: torch.Tensor, verified: torch.Tensor) -> torch.Tensor:
    """Drafts accepted [batch]: the number of leading slots j >= 1 with block[j] == verified[j-1]."""
    return (block[:, 1:] == verified[:, :-1]).long().cumprod(-1).sum(-1)
