"""The prompt pass: prompt positions through the target into the rows' caches, eagerly (prompt
lengths vary; the rounds' shapes do not), writing only the rows it is given."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflow_rt.graphs.plan import RoundPlan
from dflow_rt.graphs.state import DecodeState
from dflow_rt.kernels.sampling import sample, screen

KEY_BLOCK = 512  # SDPA's block of keys on CPU: blocks past a prompt's end are wholly masked and add exact zeros


def keys_read(end: int, max_len: int) -> int:
    """Cache positions a CPU prompt pass ending at `end` attends over: `end` rounded up to a whole key
    block, which SDPA attends over bit-identically to the whole cache while the index copy of a
    row's keys and the masked blocks no longer grow with max_len (a chunk at position 200 of a
    2,048-position cache spent 45 % of its time there)."""
    return min(max_len, -(-end // KEY_BLOCK) * KEY_BLOCK)


def prefill(state: DecodeState, plan: RoundPlan, target, drafter, group: Sequence, end: int) -> None:
    """Prompt positions [prefilled, end) of `group` (the engine's requests, at the same point) through the target;
    a group whose prompts end at `end` starts decoding.

    The first token is sampled on the device and reported by the next round's output. Until then a
    row is padding to the rounds, parked at `end`: what a round writes there lies past its prompt so
    far, where the next chunk writes (and nothing reads it before)."""
    s, P, dev = state, group[0].prompt.numel(), state.tokens.device
    rows = torch.tensor([r.row for r in group], device=dev)
    begin = group[0].prefilled
    pos = torch.arange(begin, end, device=dev).expand(len(group), end - begin)
    ids = torch.stack([r.prompt[begin:end] for r in group])
    cache = s.target_cache
    if dev.type == "cpu":
        cache = cache.view(cache.k[0].shape[0], keys_read(end, cache.max_len))
    logits, features = target(ids, pos, cache, rows, layer_ids=plan.layer_ids, logits_from=end - begin - 1)
    if drafter is not None:
        drafter.write_context(features, pos, s.draft_cache, rows)
    for req in group:
        req.prefilled = req.position = end
    if end < P:
        s.start[rows] = end
        s.ctx_start[rows] = end
        return
    for name in ("temperature", "top_k", "top_p", "seed"):
        getattr(s, name)[rows] = torch.tensor([getattr(r, name) for r in group], device=dev,
                                              dtype=getattr(s, name).dtype)
    s.faulted[rows] = screen(logits, plan.exclude)  # reported with the next round's tokens
    if drafter is not None:
        s.last_verify.clear(rows)
    first = sample(logits, s.temperature[rows], s.top_k[rows], s.top_p[rows], s.seed[rows], pos[:, -1:] + 1)
    s.tokens[rows] = first[:, 0]
    s.start[rows] = P
    s.ctx_start[rows] = P
    s.fresh[rows] = True
    s.active[rows] = True
