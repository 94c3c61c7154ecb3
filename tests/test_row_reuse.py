"""A row is clean for its next request: however the previous request in it ended (it finished, hit a
stop token, was cancelled, or failed) and whatever it left in the row (sampling settings, a longer
context in the caches, a relay record, padding rounds run since), the next request placed in that row
decodes exactly as in a fresh Runtime: the same tokens and the same acceptance per round.

One batch bucket of two rows and one length bucket, so that a request sees the same shapes in the
used Runtime as in the fresh one; a long request in the other row keeps the rounds running while the
row under test waits as padding.
"""

from __future__ import annotations

import json

import pytest

from dflow_rt.engine.runtime import Runtime
from tests.conftest import FIXTURES
from tests.helpers import fixed, poison, random_relay

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]
LONGEST = max(CASES, key=lambda c: len(c["prompt_ids"]))["prompt_ids"]
NEIGHBOUR = CASES[5]["prompt_ids"]  # about one token a round: it outlives everything else here
# The requests that take the row in turn, each after the one before it ends; settings that differ
# from one to the next (greedy and sampled, filters on and off, seeds).
FOLLOWERS = [(CASES[0]["prompt_ids"], {}),
             (CASES[1]["prompt_ids"], {"temperature": 1.0, "seed": 8}),
             (CASES[3]["prompt_ids"], {}),
             (CASES[4]["prompt_ids"], {"temperature": 0.8, "top_k": 4, "top_p": 0.9, "seed": 9})]
MAX_NEW = 24


def config(**kw):
    return fixed(max_batch=2, batch_buckets=(2,), max_len=160, length_buckets=(160,), **kw)


def pair(reference_pair, kind: str):
    target, drafter = reference_pair
    return target, (random_relay(drafter, seed=4) if kind == "dflow" else drafter)


def run(rt: Runtime, rid: int) -> tuple[list[int], list[int]]:
    """Step until `rid` ends; its tokens and its acceptance per round."""
    while not rt.is_finished(rid):
        rt.step()
    req = rt.requests[rid]
    return list(req.emitted), list(req.acceptance)


def fresh(target, drafter, prompt, **kw) -> tuple[list[int], list[int]]:
    """The request alone in a Runtime that never held another."""
    rt = Runtime(target, drafter, config())
    return run(rt, rt.add_request(prompt, max_new_tokens=MAX_NEW, **kw))


def leave_dirty(rt: Runtime, how: str) -> tuple[int, int]:
    """A sampled request with a long prompt in row 0, ended `how`, and a long-running neighbour in
    row 1: the used row and the neighbour's id."""
    kw = {"temperature": 1.3, "top_k": 6, "top_p": 0.7, "seed": 5}
    if how == "stopped":  # at a stop token it samples
        probe = Runtime(rt.target, rt.drafter, config())
        emitted, _ = run(probe, probe.add_request(LONGEST, max_new_tokens=30, **kw))
        kw["stop_token_ids"] = [next(t for j, t in enumerate(emitted) if j >= 6 and t not in emitted[:j])]
    rid = rt.add_request(LONGEST, max_new_tokens=30 if how != "finished" else 9, **kw)
    neighbour = rt.add_request(NEIGHBOUR, max_new_tokens=160 - len(NEIGHBOUR) - rt.block_size)
    rt.step()
    row = 0  # the lowest free row: the request added first
    assert rt.requests[neighbour].row == 1
    if how == "cancelled":
        rt.step()
        rt.cancel(rid)
    elif how == "failed":  # its logits go NaN, and it is failed and cleaned
        poison(rt, row, 120)
    run(rt, rid)
    req = rt.pop(rid)
    assert (req.error is not None) == (how == "failed") and req.emitted
    assert (how == "stopped") == (req.emitted[-1] in kw.get("stop_token_ids", ())) and len(req.emitted) > 1
    return row, neighbour


@pytest.mark.parametrize("kind", ["dflash", "dflow"])
@pytest.mark.parametrize("how", ["finished", "stopped", "cancelled", "failed"])
def test_the_next_request_in_a_row_decodes_as_in_a_fresh_runtime(reference_pair, how, kind):
    target, drafter = pair(reference_pair, kind)
    rt = Runtime(target, drafter, config())
    row, neighbour = leave_dirty(rt, how)
    for _ in range(3):  # the row runs as padding beside the neighbour
        rt.step()
    assert rt.requests[neighbour].row != row and not rt.is_finished(neighbour)
    for prompt, kw in FOLLOWERS:
        rid = rt.add_request(prompt, max_new_tokens=MAX_NEW, **kw)
        rt.step()
        assert rt.requests[rid].row == row
        got = run(rt, rid)
        assert rt.pop(rid).error is None
        assert got == fresh(target, drafter, prompt, **kw), (prompt, kw)


@pytest.mark.parametrize("kind", ["dflash", "dflow"])
@pytest.mark.parametrize("how", ["finished", "cancelled", "failed"])
def test_a_row_reused_at_once_decodes_as_in_a_fresh_runtime(reference_pair, how, kind):
    """The next request is admitted at the step right after the row is freed, with no padding
    round between that could overwrite what the previous request left (one row only: every
    request takes the same row)."""
    target, drafter = pair(reference_pair, kind)
    one_row = fixed(max_batch=1, max_len=160, length_buckets=(160,))
    rt = Runtime(target, drafter, one_row)
    first = rt.add_request(LONGEST, max_new_tokens=9 if how == "finished" else 60, temperature=1.1, top_k=5,
                           seed=2)
    rt.step()
    if how == "cancelled":
        rt.cancel(first)
    elif how == "failed":
        poison(rt, 0, 120)
    waiting = [rt.add_request(p, max_new_tokens=MAX_NEW, **kw) for p, kw in FOLLOWERS]
    for rid, (prompt, kw) in zip(waiting, FOLLOWERS, strict=True):
        got = run(rt, rid)
        alone = Runtime(target, drafter, one_row)
        assert got == run(alone, alone.add_request(prompt, max_new_tokens=MAX_NEW, **kw)), (prompt, kw)
    assert (rt.requests[first].error is not None) == (how == "failed")
