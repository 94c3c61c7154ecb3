"""The reference round, batch 1, greedy: prefill -> (draft -> verify -> accept -> carry)*.

Plain eager torch with the semantics the Runtime must reproduce token for token in every mode:
the oracle of the tests (`dflow_rt.oracle.generate`); callers decode with `dflow_rt.generate`.
The target's KV cache and the drafter's context cache are static and addressed by absolute
position, so rolling back a rejected suffix is only moving `start`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflow_rt.checks import check_int, cut_at_stop, prompt_tensor, stop_set
from dflow_rt.config import AUTO, RuntimeConfig
from dflow_rt.engine.generation import GenerateOutput, request_length
from dflow_rt.errors import InputError
from dflow_rt.kernels.sampling import accept, excluded_token, screen
from dflow_rt.models.drafter import Drafter, relay_off
from dflow_rt.models.layers import reserve_positions
from dflow_rt.models.target import Target


@dataclass
class RoundTrace:
    """One round as the diagnostics see it: the verified block, the target's choices, drafts without the relay."""

    block: list[int]
    verified: list[int]
    accepted: int
    drafts_without_relay: list[int] | None


def _verify_width(config: RuntimeConfig, block_size: int) -> int:
    """The batch-1 verify width a config names: None = the block, an int, or a dict's entry for 1."""
    width = config.verify_width.get(1) if isinstance(config.verify_width, dict) else config.verify_width
    if width == AUTO:
        raise InputError("verify_width 'auto' is chosen by a Runtime for its device: the reference round "
                         "takes None (the whole block), an int or {1: k}")
    return block_size if width is None else check_int("verify_width", width, 1, block_size)


@torch.inference_mode()
def generate(target: Target, drafter: Drafter | None, prompt_ids: Sequence[int] | torch.Tensor,
             max_new_tokens: int = 64, stop_token_ids: Sequence[int] | None = None,
             config: RuntimeConfig | None = None, trace: list[RoundTrace] | None = None) -> GenerateOutput:
    """Greedy speculative decoding, batch 1, eager; `drafter=None` or block size 1 decodes autoregressively.

    Emits exactly the target's own greedy continuation: `max_new_tokens` tokens, or up to and
    including the first stop token; with a drafter, the target never chooses its mask token
    (`sampling.excluded_token`). `config` holds the settings this round shares with a Runtime
    (`dflow_rt.generate` takes the same): block_size (default the drafter's), verify_width (the
    drafter drafts and the target verifies the first k positions of the block; default all), emit_mask_token,
    and max_len, which bounds prompt + new tokens + block (default: the target's
    max_position_embeddings); its other fields choose how a Runtime runs and mean nothing here.
    A `trace` list receives every round (for a DFlow drafter also what it would have drafted
    with its relay off).
    """
    device, vocab = target.lm_head.weight.device, target.config.vocab_size
    prompt = prompt_tensor(prompt_ids, vocab, device)
    P = prompt.shape[1]
    B, length = request_length(target, drafter, config, P, max_new_tokens)  # caches cover this request, no more
    k = B if config is None else _verify_width(config, B)
    stops = stop_set(stop_token_ids, vocab)
    reserve_positions(length, target, drafter)
    layer_ids = drafter.target_layer_ids if B > 1 else ()
    rows = torch.zeros(1, dtype=torch.long, device=device)
    target_cache = target.new_cache(1, length)
    draft_cache = drafter.new_cache(1, length) if B > 1 else None
    relay = drafter.new_verify_record(1, B) if B > 1 else None
    arange = torch.arange(length, device=device)[None]
    mask = excluded_token(drafter, config is not None and config.emit_mask_token)

    t0 = time.perf_counter()
    logits, ctx_feat = target(prompt, arange[:, :P], target_cache, rows, layer_ids=layer_ids, logits_from=P - 1)
    screen(logits, mask)
    out = [int(logits[0, -1].argmax())]
    ctx_pos, start = arange[:, :P], P
    t1 = time.perf_counter()
    accepted: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in stops:
        block = torch.full((1, B), drafter.config.mask_token_id if B > 1 else 0, dtype=torch.long, device=device)
        block[0, 0] = out[-1]
        block_pos = arange[:, start:start + B]
        if B > 1:
            block[:, 1:k] = drafter.propose(target, block[:, :k], block_pos[:, :k], cache=draft_cache,
                                              ctx_feat=ctx_feat, ctx_pos=ctx_pos, relay=relay)
        checked = block[:, :k]
        logits, feat = target(checked, block_pos[:, :k], target_cache, rows, layer_ids=layer_ids)
        screen(logits, mask)
        verified = logits.argmax(-1)
        a_t = accept(checked, verified)
        a = int(a_t[0])
        if trace is not None:
            trace.append(RoundTrace(checked[0].tolist(), verified[0].tolist(), a, _drafts_without_relay(
                target, drafter, checked, block_pos[:, :k], draft_cache, relay)))
        out += block[0, 1:a + 1].tolist() + [int(verified[0, a])]
        accepted.append(a + 1)
        if B > 1:  # carry: accepted features become context, the rest is relayed
            ctx_feat, ctx_pos = feat[:, :a + 1], block_pos[:, :a + 1]
            relay.write(None, feat, checked, verified, a_t)
        start += a + 1
    t2 = time.perf_counter()
    out, _ = cut_at_stop(out[:max_new_tokens], stops)
    return GenerateOutput(out, accepted, t1 - t0, t2 - t1)


def _drafts_without_relay(target, drafter, block, block_pos, cache, relay) -> list[int] | None:
    """The same draft pass with the relay off (context is already in `cache`, so none is passed)."""
    if drafter is None or not drafter.use_relay or relay is None:
        return None
    masked = torch.full_like(block, drafter.config.mask_token_id)
    masked[:, 0] = block[:, 0]
    with relay_off(drafter):
        return drafter.propose(target, masked, block_pos, cache=cache, relay=relay)[0].tolist()
