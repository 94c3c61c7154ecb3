"""The drafter's mask token is never emitted: a target that prefers it gets its choice among every
other token, in the Runtime (greedy and sampled, prefill's token included) as in the reference round.

The target is rigged by a forward hook on the Target module, which the drafter's own head (it calls
`target.lm_head` directly) does not see: the drafter drafts as before, so the excluded target decodes
exactly as the unrigged one does, acceptance lengths included. Hooking `lm_head` instead rigs both.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from dflow_rt.engine.runtime import Runtime
from dflow_rt.oracle import generate as reference_generate
from tests.conftest import FIXTURES
from tests.helpers import fixed, random_relay

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]
PROMPTS = [c["prompt_ids"] for c in CASES[:4]]
MAX_NEW = 40


@contextmanager
def favouring(module: torch.nn.Module, token: int, bias: float):
    """`module`'s logits (its output, or the first item of it) raised by `bias` at `token`."""
    def hook(_, inputs, out):
        logits = out[0] if isinstance(out, tuple) else out
        logits[..., token] += bias
        return out

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def rigged(target, mask: int, bias: float, where: str):
    """The mask token raised in the target's own logits only ("target"), or in the shared head that
    the drafter drafts with too ("head")."""
    with favouring(target if where == "target" else target.lm_head, mask, bias):
        yield


def decode(rt: Runtime, prompts, **kw) -> tuple[list[list[int]], list[list[int]]]:
    """Every request to the end: tokens, and tokens per step as the Runtime reported them."""
    rids = [rt.add_request(p, max_new_tokens=MAX_NEW, **kw) for p in prompts]
    counts = {r: [] for r in rids}
    while not all(rt.is_finished(r) for r in rids):
        for rid, toks in rt.step().items():
            counts[rid].append(len(toks))
    return [rt.pop(r).emitted for r in rids], [counts[r] for r in rids]


def reference_counts(out) -> list[int]:
    """The reference round's acceptance lengths as the Runtime reports tokens per step (its first
    step also carries prefill's token, its last may be cut by max_new_tokens)."""
    counts = list(out.acceptance_lengths)
    counts[0] += 1
    counts[-1] -= sum(counts) - len(out.token_ids)
    return counts


def drafter_for(reference_pair, kind: str):
    target, drafter = reference_pair
    return target, (random_relay(drafter, seed=2) if kind == "dflow" else drafter)


@pytest.mark.parametrize("where", ["target", "head"])
@pytest.mark.parametrize("bias", [0.5, 50.0], ids=["sometimes", "always"])
@pytest.mark.parametrize("kind", ["dflash", "dflow"])
def test_greedy_never_emits_the_mask_token(reference_pair, kind, bias, where):
    """A bias of 0.5 makes the mask the target's argmax at some positions, 50 at every one. The
    Runtime's tokens and per-round acceptances are the reference round's; with the target alone
    rigged they are also the unrigged pair's. With `emit_mask_token` the rig shows: the mask is
    emitted, and the Runtime still follows the reference round."""
    target, drafter = drafter_for(reference_pair, kind)
    mask = drafter.config.mask_token_id
    plain = [reference_generate(target, drafter, p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    with rigged(target, mask, bias, where):
        refs = [reference_generate(target, drafter, p, max_new_tokens=MAX_NEW) for p in PROMPTS]
        outs, counts = decode(Runtime(target, drafter, fixed(max_batch=4, max_len=160)), PROMPTS)
        emitting = [reference_generate(target, drafter, p, max_new_tokens=MAX_NEW, config=fixed(emit_mask_token=True))
                    for p in PROMPTS]
        public, _ = decode(Runtime(target, drafter, fixed(max_batch=4, max_len=160, emit_mask_token=True)), PROMPTS)
    assert all(mask not in out for out in outs)
    assert all(mask not in ref.token_ids for ref in refs)
    for out, cnt, ref in zip(outs, counts, refs, strict=True):
        assert out == ref.token_ids and cnt == reference_counts(ref)
    if where == "target":
        assert [r.token_ids for r in refs] == [p.token_ids for p in plain]
        assert [r.acceptance_lengths for r in refs] == [p.acceptance_lengths for p in plain]
    seen = [out.count(mask) for out in public]
    assert all(seen) and (bias < 1 or seen == [MAX_NEW] * len(PROMPTS)), seen  # the first token included
    assert public == [e.token_ids for e in emitting]


SAMPLED = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 1.2, "top_p": 0.8},
           {"temperature": 0.01, "top_k": 1}]


@pytest.mark.parametrize("kw", SAMPLED, ids=["plain", "top-k", "top-p", "top-1"])
def test_sampling_never_emits_the_mask_token(reference_pair, kw):
    """Sampled rows draw from the target's law without the mask token, pathwise: the rigged target
    emits the unrigged one's tokens seed for seed, which are plain autoregressive sampling's with
    the mask token suppressed. With `emit_mask_token` the rigged target does emit it."""
    target, drafter = reference_pair
    mask = drafter.config.mask_token_id
    config = fixed(max_batch=4, max_len=160)
    seeded = {**kw, "seed": 17}
    unrigged, _ = decode(Runtime(target, drafter, config), PROMPTS, **seeded)
    with favouring(target.lm_head, mask, -float("inf")):  # no drafter: the head is the target's alone
        autoregressive, _ = decode(Runtime(target, None, config), PROMPTS, **seeded)
    with rigged(target, mask, 50.0, "target"):
        outs, _ = decode(Runtime(target, drafter, config), PROMPTS, **seeded)
        public, _ = decode(Runtime(target, drafter, fixed(max_batch=4, max_len=160, emit_mask_token=True)),
                           PROMPTS, **seeded)
    assert all(mask not in out for out in outs)
    assert outs == unrigged == autoregressive
    assert all(mask in out for out in public)


def test_greedy_and_sampled_rows_in_one_round_never_emit_the_mask_token(reference_pair):
    """Rows of one batch on both paths of the round (a sampled row keeps the round off the greedy
    variant): each emits what it emits alone."""
    target, drafter = reference_pair
    mask = drafter.config.mask_token_id
    kws = [{}, {"temperature": 1.0, "seed": 3}, {}, {"temperature": 0.8, "top_p": 0.9, "seed": 4}]
    with rigged(target, mask, 50.0, "target"):
        rt = Runtime(target, drafter, fixed(max_batch=4, max_len=160))
        rids = [rt.add_request(p, max_new_tokens=MAX_NEW, **kw) for p, kw in zip(PROMPTS, kws, strict=True)]
        while not all(rt.is_finished(r) for r in rids):
            rt.step()
        together = [rt.pop(r).emitted for r in rids]
        alone = [decode(Runtime(target, drafter, fixed(max_batch=1, max_len=160)), [p], **kw)[0][0]
                 for p, kw in zip(PROMPTS, kws, strict=True)]
        reference = reference_generate(target, drafter, PROMPTS[0], max_new_tokens=MAX_NEW).token_ids
    assert all(mask not in out for out in together)
    assert together == alone and together[0] == reference
