"""One batched draft -> verify -> accept -> carry round at static shapes.

Pure tensor code over a `DecodeState`: no host reads, no data-dependent shapes, no
allocation that outlives the call, so it runs as is (eager), under
`torch.compile(fullgraph=True)`, or inside a captured CUDA graph. The only output the host
needs is `state.out` (tokens emitted per row).

Static-shape carry: the drafter appends the first W features of the last verify (W the widest
verify width of the Runtime) at positions `ctx_start..ctx_start+W-1`. Those past the committed
prefix sit at or beyond the new `start`, where the drafter's mask (positions < start) hides them
until a later round overwrites them; the same holds for rejected keys/values in the target cache.

The round is three phases so that a benchmark can time them apart (`dflow_rt.bench.runtime`);
`decode_round` chains them. Everything fixed per Runtime (the fused ops of `dflow_rt.kernels`
among it) comes from its `RoundPlan`.
"""

from __future__ import annotations

import torch

from dflow_rt.graphs.plan import RoundPlan
from dflow_rt.graphs.state import DecodeState
from dflow_rt.kernels.commit import commit_torch
from dflow_rt.kernels.sampling import sample, screen, uniform


def draft(target, drafter, s: DecodeState, plan: RoundPlan, width: int | None = None,
          lookup: bool = False) -> torch.Tensor:
    """Block ids [rows, width] (default width B): the last token, then the drafter's proposals (or
    masks without one). At width 1, a plain target step, the drafter only writes the last verify's
    features to its context (`dflow_rt.engine.policy`); so it does in a `lookup` round, whose drafts the
    host wrote to `s.lookup` (the text's own continuation, `dflow_rt.engine.lookup`).

    The context write covers the verify record's first `plan.max_width` rows, the widest verify
    of this Runtime: a verify at width k commits at most k positions, and the rows past them are
    stale (at or past the next block, where they would be masked or overwritten). Projecting all B
    rows where 4 are verified cost a SmolLM2 plain step about 0.3 ms on CPU (docs/experiments.md,
    "The context write cut to the verified rows").

    The draft pass spans the `width` positions the target verifies, not the whole block: its
    products and attention then cover fewer rows (a compiled SmolLM2 round at width 2 costs about
    7 % less on CPU), and the drafts, which see fewer mask positions in the block's bidirectional
    attention, change a little (tau 1-3 % lower; docs/experiments.md, "The draft pass cut to the
    verified positions"). `dflow_rt.oracle` drafts the same way. A drafter whose config sets
    `draft_whole_block` pads the pass back to its whole block (`Drafter.propose`)."""
    block = torch.where(s.slots == 0, s.tokens[:, None], plan.filler)[:, :width]
    if lookup:
        block = torch.cat([block[:, :1], s.lookup[:, :block.shape[1] - 1]], dim=1)
    if drafter is None:
        return block
    n = max(plan.max_width, block.shape[1])  # a wider block than the plan's (width None) writes its own
    ctx_pos = s.ctx_start[:, None] + s.slots[:n]
    ctx = drafter.write_context(s.last_verify.features[:, :n], ctx_pos, s.draft_cache, None)
    if width == 1 or lookup:
        return block
    pos = s.start[:, None] + s.slots[:block.shape[1]]
    drafts = drafter.propose(target, block, pos, cache=s.draft_cache, relay=s.last_verify, projected=ctx,
                             attention=_fused(plan, "attention"))
    return torch.cat([block[:, :1], drafts], dim=1)


def _fused(plan: RoundPlan, op: str):
    """The kernel serving `op`, or None where the round's own torch code serves it."""
    return None if plan.kernels.implementations[op] == "torch" else getattr(plan.kernels, op)


def verify(target, s: DecodeState, block: torch.Tensor, plan: RoundPlan, greedy: bool = False):
    """The target's choice at every position of `block` (greedy or sampled) and its features.

    Token `plan.exclude` (the drafter's mask token) is never chosen, and a row whose logits hold a
    NaN or inf is marked in `s.faulted` (see `sampling.screen`).

    `block` may be the first k of the B drafted positions: verifying fewer positions costs less
    per round (on CPU, verify time grows with k), and any k is lossless.

    `greedy` (a round in which no row samples; the host knows, from its requests) takes the
    argmax and skips the sampler's softmax, sort and cumsums over the vocabulary: about a tenth
    of a batch-4 round on CPU. A host flag rather than a device branch: no read of the device,
    and nothing (such as `torch.cond`) that keeps torch's compile caches from storing the round.
    """
    pos = s.start[:, None] + s.slots[:block.shape[1]]
    logits, features = target(block, pos, s.target_cache, layer_ids=plan.layer_ids,
                              attention=_fused(plan, "attention"))
    s.faulted.logical_or_(screen(logits, plan.exclude))
    if greedy:
        return logits.argmax(-1), features
    args = (logits, s.temperature, s.top_k, s.top_p, s.seed, pos + 1)
    kernel = _fused(plan, "sample")
    return (sample if kernel is None else _sampler(kernel))(*args), features


def _sampler(kernel):
    """`sampling.sample`'s signature over a kernel that takes the uniforms themselves."""
    def pick(logits, temperature, top_k, top_p, seed, positions):
        return kernel(logits, temperature, top_k, top_p, uniform(seed, positions))
    return pick


def commit(s: DecodeState, block: torch.Tensor, verified: torch.Tensor, features: torch.Tensor | None,
           plan: RoundPlan) -> None:
    """Accept, write the emitted tokens to `s.out`, and carry state to the next round, with the
    plan's commit kernel (`dflow_rt.kernels.commit`); then each row's fault flag to the last
    column of `s.out`, so the host reads tokens and faults at once.

    `block` and `verified` are the k verified positions ([rows, k], k <= B); `s.out` columns past
    k + 1 are left as they are (the host reads `count` tokens)."""
    r = s.last_verify
    relay = () if r is None else r.tensors()
    kernel = _fused(plan, "commit") or commit_torch
    kernel(block, verified, features, s.tokens, s.start, s.ctx_start, s.fresh, s.active, s.out, *relay)
    s.out[:, -1].copy_(s.faulted)


def decode_round(target, drafter, state: DecodeState, plan: RoundPlan, width: int | None = None,
                 greedy: bool = False, lookup: bool = False) -> None:
    """One round; the target verifies the first `width` drafted positions (default all); `greedy`
    when no live row samples; `lookup`: the drafts are the host's (`draft`)."""
    block = draft(target, drafter, state, plan, width, lookup)
    verified, features = verify(target, state, block, plan, greedy)
    commit(state, block, verified, features, plan)
