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
"""

from __future__ import annotations

import torch

from dflow_rt.graphs.state import DecodeState
from dflow_rt.sampling import accept, sample


def draft(target, drafter, s: DecodeState, mask_token_id: int) -> torch.Tensor:
    """Block ids [rows, B]: the last token, then the drafter's proposals (or masks without one)."""
    block = torch.where(s.slots == 0, s.tokens[:, None], mask_token_id)
    if drafter is None:
        return block
    pos = s.start[:, None] + s.slots
    ctx_pos = s.ctx_start[:, None] + s.slots
    drafts = drafter.propose(target, block, pos, cache=s.draft_cache, ctx_feat=s.relay.features, ctx_pos=ctx_pos,
                             relay=s.relay)
    return torch.cat([block[:, :1], drafts], dim=1)


def verify(target, s: DecodeState, block: torch.Tensor, layer_ids: tuple[int, ...], greedy_shortcut: bool = False):
    """The target's choice at every position of `block` (greedy or sampled) and its features.

    `block` may be the first k of the B drafted slots: verifying fewer positions costs less
    per round (on CPU, verify time grows with k), and any k is lossless.

    With `greedy_shortcut`, a round in which no row samples (padding rows have temperature
    0) takes the argmax and skips the sampler's softmax, sort and cumsums over the vocabulary:
    about a tenth of a batch-4 round on CPU. Deciding reads a device value (`torch.cond` when
    compiled), which is free on CPU but a sync on CUDA and impossible inside a CUDA graph, so
    the Runtime asks for it on CPU only.
    """
    pos = s.start[:, None] + s.slots[:block.shape[1]]
    logits, features = target(block, pos, s.target_cache, layer_ids=layer_ids)
    args = (logits, s.temperature, s.top_k, s.top_p, s.seed, pos + 1)
    if not greedy_shortcut:
        return sample(*args), features
    sampling = (s.temperature > 0).any()
    if torch.compiler.is_compiling():
        return torch.cond(sampling, sample, _argmax, args), features
    return (sample(*args) if sampling else _argmax(*args)), features


def _argmax(logits: torch.Tensor, *_) -> torch.Tensor:
    return logits.argmax(-1)


def commit(s: DecodeState, block: torch.Tensor, verified: torch.Tensor, features: torch.Tensor | None) -> None:
    """Accept, write the emitted tokens to `s.out`, and carry state to the next round.

    `block` and `verified` are the k verified positions ([rows, k], k <= B); `s.out` columns past
    k + 1 are left as they are (the host reads `count` tokens)."""
    a = accept(block, verified)
    bonus = verified.gather(1, a[:, None])
    # Emit block[1..a] and the bonus, plus block[0] when prefill has not reported it yet.
    committed = torch.cat([block, bonus], dim=1).scatter(1, a[:, None] + 1, bonus)
    k = block.shape[1]
    skip = (~s.fresh).long()[:, None]
    emitted = committed.gather(1, (torch.arange(k + 1, device=block.device) + skip).clamp(max=k))
    s.out[:, :k + 2].copy_(torch.cat([(a + 1 + s.fresh.long())[:, None], emitted], dim=1))
    if s.relay is not None:
        s.relay.write(None, features, block, verified, a)
    s.ctx_start.copy_(torch.where(s.active, s.start, s.ctx_start))
    s.start.add_((a + 1) * s.active.long())
    s.tokens.copy_(bonus[:, 0])
    s.fresh.zero_()


def decode_round(target, drafter, state: DecodeState, mask_token_id: int, layer_ids: tuple[int, ...],
                 greedy_shortcut: bool = False, verify_width: int | None = None) -> None:
    """One round; the target verifies the first `verify_width` drafted positions (default all)."""
    block = draft(target, drafter, state, mask_token_id)[:, :verify_width]
    verified, features = verify(target, state, block, layer_ids, greedy_shortcut)
    commit(state, block, verified, features)
