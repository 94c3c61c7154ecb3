"""One batched draft -> verify -> accept -> carry round at static shapes.

Pure tensor code over a `DecodeState`: no host reads, no data-dependent shapes, no
allocation that outlives the call, so it runs as is (eager), under
`torch.compile(fullgraph=True)`, or inside a captured CUDA graph. The only output the host
needs is `state.out` (tokens emitted per row).

Static-shape carry: the drafter appends all B features of the last verify at positions
`ctx_start..ctx_start+B-1`. Those past the committed prefix sit at or beyond the new
`start`, where the drafter's mask (positions < start) hides them until a later round
overwrites them; the same holds for rejected keys/values in the target cache.

The round is three phases so that a benchmark can time them apart; `decode_round` chains them.
Its fused ops (attention, sampling, commit) come from `kernels` (`dflow_rt.kernels`, resolved
once per Runtime); without it, or with the torch backend, the round runs plain torch.
"""

from __future__ import annotations

import torch

from dflow_rt.graphs.state import DecodeState
from dflow_rt.kernels import Kernels
from dflow_rt.kernels.commit import commit_torch
from dflow_rt.sampling import sample, screen, uniform


def draft(target, drafter, s: DecodeState, mask_token_id: int, kernels: Kernels | None = None,
          width: int | None = None) -> torch.Tensor:
    """Block ids [rows, width] (default width B): the last token, then the drafter's proposals (or
    masks without one). The drafter drafts its whole block either way; see `Drafter.propose`."""
    block = torch.where(s.slots == 0, s.tokens[:, None], mask_token_id)
    if drafter is None:
        return block[:, :width]
    pos = s.start[:, None] + s.slots
    ctx_pos = s.ctx_start[:, None] + s.slots
    drafts = drafter.propose(target, block, pos, cache=s.draft_cache, ctx_feat=s.relay.features, ctx_pos=ctx_pos,
                             relay=s.relay, attention=_fused(kernels, "attention"), width=width)
    return torch.cat([block[:, :1], drafts], dim=1)


def _fused(kernels: Kernels | None, op: str):
    """The kernel serving `op`, or None where the round's own torch code serves it."""
    return None if kernels is None or kernels.backends[op] == "torch" else getattr(kernels, op)


def verify(target, s: DecodeState, block: torch.Tensor, layer_ids: tuple[int, ...], greedy: bool = False,
           exclude: int | None = None, kernels: Kernels | None = None):
    """The target's choice at every position of `block` (greedy or sampled) and its features.

    Token `exclude` (the drafter's mask token) is never chosen, and a row whose logits hold a
    NaN or inf is marked in `s.faulted` (see `sampling.screen`).

    `block` may be the first k of the B drafted positions: verifying fewer positions costs less
    per round (on CPU, verify time grows with k), and any k is lossless.

    `greedy` (a round in which no row samples; the host knows, from its requests) takes the
    argmax and skips the sampler's softmax, sort and cumsums over the vocabulary: about a tenth
    of a batch-4 round on CPU. A host flag rather than a device branch: no read of the device,
    and nothing (such as `torch.cond`) that keeps torch's compile caches from storing the round.
    """
    pos = s.start[:, None] + s.slots[:block.shape[1]]
    logits, features = target(block, pos, s.target_cache, layer_ids=layer_ids, attention=_fused(kernels, "attention"))
    s.faulted.logical_or_(screen(logits, exclude))
    if greedy:
        return logits.argmax(-1), features
    args = (logits, s.temperature, s.top_k, s.top_p, s.seed, pos + 1)
    pick = sample if _fused(kernels, "sample") is None else _sampler(kernels.sample)
    return pick(*args), features


def _sampler(kernel):
    """`sampling.sample`'s signature over a kernel that takes the uniforms themselves."""
    def pick(logits, temperature, top_k, top_p, seed, positions):
        return kernel(logits, temperature, top_k, top_p, uniform(seed, positions))
    return pick


def commit(s: DecodeState, block: torch.Tensor, verified: torch.Tensor, features: torch.Tensor | None,
           kernel=commit_torch) -> None:
    """Accept, write the emitted tokens to `s.out`, and carry state to the next round.

    `block` and `verified` are the k verified positions ([rows, k], k <= B); `s.out` columns past
    k + 1 are left as they are (the host reads `count` tokens). `kernel` is `commit_torch` or a
    kernel of the same signature (`dflow_rt.kernels.commit`)."""
    r = s.relay
    relay = () if r is None else (r.features, r.accepted, r.bonus, r.rejected, r.width)
    kernel(block, verified, features, s.tokens, s.start, s.ctx_start, s.fresh, s.active, s.out, *relay)


def decode_round(target, drafter, state: DecodeState, mask_token_id: int, layer_ids: tuple[int, ...],
                 greedy: bool = False, verify_width: int | None = None,
                 kernels: Kernels | None = None, emit_mask_token: bool = False) -> None:
    """One round; the target verifies the first `verify_width` drafted positions (default all),
    never choosing the mask token unless `emit_mask_token`; `greedy` when no live row samples.

    The last column of `state.out` reports each row's fault flag with its tokens: one host read."""
    block = draft(target, drafter, state, mask_token_id, kernels, verify_width)
    exclude = None if drafter is None or emit_mask_token else mask_token_id
    verified, features = verify(target, state, block, layer_ids, greedy, exclude, kernels)
    commit(state, block, verified, features, _fused(kernels, "commit") or commit_torch)
    state.out[:, -1].copy_(state.faulted)
