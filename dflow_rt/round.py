"""The reference round, batch 1, greedy: prefill -> (draft -> verify -> accept -> carry)*.

Plain eager torch with the semantics every faster backend must reproduce token for token.
The target's KV cache and the drafter's context cache are static and addressed by absolute
position, so rolling back a rejected suffix is only moving `start`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflow_rt.errors import InputError
from dflow_rt.models.drafter import Drafter
from dflow_rt.models.layers import reserve_positions
from dflow_rt.models.target import Target


@dataclass
class RoundTrace:
    """One round as the diagnostics see it: the block, the target's choices, drafts without the relay."""

    block: list[int]
    verified: list[int]
    accepted: int
    drafts_without_relay: list[int] | None


@dataclass
class GenerateOutput:
    token_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length per round, counting the bonus token."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which comes from prefill) per second of decoding."""
        return (len(self.token_ids) - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids).flatten()
    if ids.numel() == 0:
        raise InputError("prompt_ids is empty: at least one token is needed")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"prompt_ids must be integer token ids, got {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InputError(f"prompt_ids must be integers in 0..{vocab_size - 1}")
    return ids.to(device=device, dtype=torch.long)[None]


@torch.inference_mode()
def generate(target: Target, drafter: Drafter | None, prompt_ids: Sequence[int] | torch.Tensor,
             max_new_tokens: int = 64, block_size: int | None = None,
             stop_token_ids: Sequence[int] | None = None, max_len: int | None = None,
             trace: list[RoundTrace] | None = None) -> GenerateOutput:
    """Greedy speculative decoding; `drafter=None` or `block_size=1` decodes autoregressively.

    Emits exactly the target's own greedy continuation: `max_new_tokens` tokens, or up to
    and including the first stop token. A `trace` list receives every round (for a DFlow
    drafter also what it would have drafted with its relay switched off).
    """
    device = target.lm_head.weight.device
    prompt = prompt_tensor(prompt_ids, target.config.vocab_size, device)
    B = 1 if drafter is None else (block_size or drafter.block_size)
    if B < 1 or max_new_tokens < 1:
        raise InputError(f"block_size ({B}) and max_new_tokens ({max_new_tokens}) must be at least 1")
    max_len = max_len or target.config.max_position_embeddings
    P = prompt.shape[1]
    if P + max_new_tokens + B > max_len:
        raise InputError(f"prompt of {P} tokens + max_new_tokens {max_new_tokens} + block {B} exceeds "
                         f"the cache of {max_len} positions")
    stops = set(stop_token_ids or ())
    reserve_positions(max_len, target, drafter)
    layer_ids = drafter.target_layer_ids if B > 1 else ()
    length = P + max_new_tokens + B
    rows = torch.zeros(1, dtype=torch.long, device=device)
    target_cache = target.new_cache(1, length)
    draft_cache = drafter.new_cache(1, length) if B > 1 else None
    relay = drafter.new_relay_buffer(1, B) if B > 1 else None
    arange = torch.arange(length, device=device)[None]

    t0 = time.perf_counter()
    logits, ctx_feat = target(prompt, arange[:, :P], target_cache, rows, layer_ids, logits_from=P - 1)
    out = [int(logits[0, -1].argmax())]
    ctx_pos, start = arange[:, :P], P
    t1 = time.perf_counter()
    accepted: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in stops:
        block = torch.full((1, B), drafter.config.mask_token_id if B > 1 else 0, dtype=torch.long, device=device)
        block[0, 0] = out[-1]
        block_pos = arange[:, start:start + B]
        if B > 1:
            block[:, 1:] = drafter.propose(target, block, block_pos, ctx_feat, ctx_pos, draft_cache, rows, relay)
        logits, feat = target(block, block_pos, target_cache, rows, layer_ids)
        verified = logits.argmax(-1)
        a_t = (block[:, 1:] == verified[:, :-1]).cumprod(-1).sum(-1)
        a = int(a_t[0])
        if trace is not None:
            trace.append(RoundTrace(block[0].tolist(), verified[0].tolist(), a, _drafts_without_relay(
                target, drafter, block, block_pos, draft_cache, rows, relay)))
        out += block[0, 1:a + 1].tolist() + [int(verified[0, a])]
        accepted.append(a + 1)
        if B > 1:  # carry: accepted features become context, the rest is relayed
            ctx_feat, ctx_pos = feat[:, :a + 1], block_pos[:, :a + 1]
            relay.write(rows, feat, block, verified, a_t)
        start += a + 1
    t2 = time.perf_counter()
    out = out[:max_new_tokens]
    for i, tok in enumerate(out):
        if tok in stops:
            out = out[:i + 1]
            break
    return GenerateOutput(out, accepted, t1 - t0, t2 - t1)


def _drafts_without_relay(target, drafter, block, block_pos, cache, rows, relay) -> list[int] | None:
    """The same draft pass with the relay off (context is already in `cache`, so none is passed)."""
    if drafter is None or not drafter.use_relay or relay is None:
        return None
    masked = torch.full_like(block, drafter.config.mask_token_id)
    masked[:, 0] = block[:, 0]
    drafter.use_relay = False
    try:
        return drafter.propose(target, masked, block_pos, None, None, cache, rows, relay)[0].tolist()
    finally:
        drafter.use_relay = True
